"""`gapless eval`: score a checkpoint on an environment's eval split and write `RUN_DIR/eval.json`.

With `eval.samples = 1` each task gets one greedy completion and pass@1 is the fraction scored
"ok". With k > 1 samples per task (at `generator.temperature`), pass@1 is the mean fraction of ok
samples and pass@k the fraction of tasks with at least one ok sample (the unbiased estimator of
Chen et al. 2021 with n = k). Samples that could not be scored (`infra_error`: a sandbox or judge
outage) are left out of every figure and counted in `infra_errors`. The JSON holds the figures, the status counts, and one record per
task (uid, ok samples, status and completion of the first sample) so a result can be audited.
Not guaranteed: comparability with published HumanEval numbers, which use a model's own prompt
format and stop sequences; this scores the raw continuation of the prompt up to EOS or
`generator.max_new_tokens`.

The generator is the reference sampler (`generator.engine` 'torch' or 'reference'), or vLLM with
`generator.engine = 'vllm'` (its own copy of the checkpoint under RUN_DIR/vllm; the same prompts,
seeds and sampling parameters).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from gapless.config import Config
from gapless.envs.registry import make_environment
from gapless.generate import Generator, make_generator
from gapless.generate.sampler import TorchSampler
from gapless.models import Policy, load_local
from gapless.orchestrate.policy_setup import prepare_policy
from gapless.types import SamplingParams


def run_eval(cfg: Config, log=print) -> dict:
    started = time.perf_counter()
    env = make_environment(cfg)
    try:
        tasks = list(env.tasks("eval"))
        if cfg.eval.max_tasks:
            tasks = tasks[: cfg.eval.max_tasks]
        # a checkpoint is evaluated as it is; without one, the embedded model as `gapless train` starts it
        policy = (
            load_local(cfg.model.path, cfg.model.prompt_format, cfg.model.system_prompt)
            if cfg.model.path
            else prepare_policy(cfg, env, log)[0]
        )
        policy.encode.keep(t.prompt for t in tasks)  # each task's prompt encoded once, not once per sample
        sampler = _sampler(cfg, policy, max((len(policy.encode(t.prompt)) for t in tasks), default=0), log)
        k = cfg.eval.samples
        params = SamplingParams(
            cfg.generator.temperature, cfg.generator.top_p, cfg.generator.max_new_tokens, greedy=k == 1, seed=cfg.seed
        )
        groups = []
        for start in range(0, len(tasks), 64):
            chunk = tasks[start : start + 64]
            completions = sampler.generate([policy.encode(t.prompt) for t in chunk for _ in range(k)], params)
            groups += env.score_groups(chunk, [completions[i * k : (i + 1) * k] for i in range(len(chunk))])
    finally:
        env.close()
    # infra errors (sandbox or judge outage) are no verdict on the model: out of every denominator, counted
    valid = [[r for r in group if not r.is_infra_failure] for group in groups]
    ok_counts = [sum(r.status == "ok" for r in group) for group in valid]
    scored_tasks = [g for g in valid if g]
    infra_errors = sum(len(g) - len(v) for g, v in zip(groups, valid))
    result = {
        "task": cfg.task.name,
        "model": cfg.model.path,
        "samples": k,
        "greedy": k == 1,
        "max_new_tokens": cfg.generator.max_new_tokens,
        "num_tasks": len(tasks),
        "pass@1": sum(c / len(v) for c, v in zip(ok_counts, valid) if v) / len(scored_tasks) if scored_tasks else None,
        f"pass@{k}": sum(c > 0 for c, v in zip(ok_counts, valid) if v) / len(scored_tasks) if scored_tasks else None,
        "reward_mean": (sum(r.reward for v in valid for r in v) / sum(map(len, valid))) if scored_tasks else None,
        "infra_errors": infra_errors,  # samples left out of every figure above
        "scored_tasks": len(scored_tasks),
        "statuses": dict(Counter(r.status for g in groups for r in g)),
        "wall_s": time.perf_counter() - started,
        "per_task": [
            {"uid": t.uid, "ok": c, "status": g[0].status, "completion": g[0].completion.text}
            for t, c, g in zip(tasks, ok_counts, groups)
        ],
    }
    out = Path(cfg.run_dir) / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    figure = "n/a (nothing could be scored)" if result["pass@1"] is None else f"{result['pass@1']:.3f}"
    log(
        f"{cfg.task.name}: pass@1 {figure} over {len(scored_tasks)} of {len(tasks)} tasks ({k} sample(s) each; "
        f"{infra_errors} infra errors left out); wrote {out}"
    )
    return result


def _sampler(cfg: Config, policy: Policy, longest_prompt: int, log) -> Generator:
    if cfg.generator.engine == "vllm":
        return make_generator(
            cfg.generator, policy, longest_prompt + cfg.generator.max_new_tokens, Path(cfg.run_dir), log
        )
    return TorchSampler(policy.model, policy.eos_id, policy.pad_id, policy.decode)
