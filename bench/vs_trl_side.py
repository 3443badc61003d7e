"""One side of `bench/vs_trl.py`, run in its own process so that its peak memory is its own.

    python bench/vs_trl_side.py {gapless,trl} --model DIR --warmup W --steps S --threads T

Both sides load the policy from the same local checkpoint directory, draw prompts from the same
procedural training split and score completions with the same sandboxed `CodeEnvironment`.
`gapless` times `RunLoop.train_step` (inline source) (generate, score, train, push; no evaluation); `trl` times
`GRPOTrainer` optimizer steps (the interval between consecutive `on_step_end` callbacks). The
first W steps are warm-up and not reported. The last line printed is one JSON object: per-step
wall seconds and process CPU seconds (all threads; less sensitive to other tenants than wall
time), per-step scoring seconds, mean completion length, library versions and the process's peak
resident set (VmHWM, which excludes the sandbox's own processes on both sides).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from gapless.config import Config
from gapless.envs.base import check_infra
from gapless.envs.registry import make_environment
from gapless.orchestrate.loop import RunLoop
from gapless.types import Completion


def peak_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process's threads)."""
    return time.perf_counter(), time.process_time()


def summarise(marks: list[tuple[float, float]], per_step: dict[str, list[float]], warmup: int) -> dict:
    """Per-step figures after the warm-up: wall and CPU seconds from consecutive step-end clock
    marks, and the lists in `per_step` (one entry per step: generate_s, score_s, completion_len)."""
    steps = list(zip(marks, marks[1:]))[warmup:]
    lengths = per_step.pop("completion_len")[warmup:]
    return {
        "step_s": [b[0] - a[0] for a, b in steps],
        "cpu_s": [b[1] - a[1] for a, b in steps],
        **{key: values[warmup:] for key, values in per_step.items()},
        "completion_len_mean": sum(lengths) / len(lengths),
    }


def timed(fn, seconds: list[float]):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        seconds.append(time.perf_counter() - t0)
        return out

    return wrapper


def gapless_config(model_dir: str, run_dir: str, threads: int, steps: int) -> Config:
    return Config.model_validate(
        {
            "run_dir": run_dir,
            "model": {"path": model_dir},
            "warmstart": {"steps": 0},
            "trainer": {"threads": threads},
            "loop": {"steps": steps},
            "metrics": {"tensorboard": False, "timeline": False, "live": "plain"},  # TRL's side logs nowhere either
        }
    )


def run_gapless(model_dir: str, warmup: int, steps: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        loop = RunLoop(
            gapless_config(model_dir, run_dir, threads, warmup + steps), log=lambda *_: None, source="inline"
        )
        marks, per_step = [clock()], {"generate_s": [], "score_s": [], "completion_len": []}
        for step in range(warmup + steps):
            metrics = loop.train_step(step)
            marks.append(clock())
            per_step["generate_s"].append(metrics["perf/generate_s"])
            per_step["score_s"].append(metrics["perf/score_s"])
            per_step["completion_len"].append(metrics["rollout/completion_len_mean"])
        loop.env.close()
    return summarise(marks, per_step, warmup)


def run_trl(model_dir: str, warmup: int, steps: int, threads: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gapless.models import load_local

    cfg = gapless_config(model_dir, "unused", threads, warmup + steps)
    torch.set_num_threads(threads)
    env = make_environment(cfg)
    problems = list(env.tasks("train"))
    by_uid = {p.uid: p for p in problems}
    per_step = {"generate_s": [], "score_s": [], "completion_len": []}

    def code_reward(prompts, completions, completion_ids, uid, **_):
        """gapless's reward: each completion against its problem's hidden tests in the sandbox."""
        t0 = time.perf_counter()
        wrapped = [[Completion([], ids, [], [], "stop", text)] for ids, text in zip(completion_ids, completions)]
        groups = env.score_groups([by_uid[u] for u in uid], wrapped)
        rollouts = [g[0] for g in groups]
        check_infra(rollouts)
        per_step["score_s"].append(time.perf_counter() - t0)
        per_step["completion_len"].append(sum(len(ids) for ids in completion_ids) / len(completion_ids))
        return [None if r.is_infra_failure else r.reward for r in rollouts]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks.append(clock())

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(clock())

    g, t = cfg.generator, cfg.trainer
    micro = t.micro_batch_size
    batch = cfg.loop.prompts_per_step * g.group_size
    policy = load_local(model_dir)  # the tokenizer exactly as gapless loads it (see models.py)
    policy.model.generate = timed(policy.model.generate, per_step["generate_s"])  # TRL samples with it
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir,
            report_to="none",
            save_strategy="no",
            logging_steps=10**6,
            disable_tqdm=True,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            seed=cfg.seed,
            max_steps=warmup + steps,
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=batch // micro,
            num_generations=g.group_size,
            max_completion_length=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=0,
            learning_rate=t.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            optim="adamw_torch",
            beta=0.0,
            num_iterations=t.epochs,
            epsilon=t.clip_eps,
            loss_type=t.loss,
            scale_rewards="group",
            mask_truncated_completions=False,
            dataloader_num_workers=0,
        )
        assert args.generation_batch_size == batch and args.steps_per_generation * micro == batch
        data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "uid": [p.uid for p in problems]})
        step_clock = StepClock()
        trainer = GRPOTrainer(
            model=policy.model,
            reward_funcs=code_reward,
            args=args,
            train_dataset=data,
            processing_class=policy.tokenizer,
            callbacks=[step_clock],
        )
        trainer.train()
    env.close()
    import trl

    return {**summarise(step_clock.marks, per_step, warmup), "trl": trl.__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("side", choices=["gapless", "trl"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    run = run_gapless if a.side == "gapless" else run_trl
    result = run(a.model, a.warmup, a.steps, a.threads)
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if "trl" in result:
        versions["trl"] = result.pop("trl")
    print(
        json.dumps(
            {
                "side": a.side,
                **result,
                "peak_rss_mb": peak_rss_mb(),
                "torch_threads": torch.get_num_threads(),
                "versions": versions,
            }
        )
    )


if __name__ == "__main__":
    main()
