"""gapless's synchronous loop against TRL's `GRPOTrainer`: seconds per step and peak memory.

    PYTHONPATH=src .venv/bin/python bench/vs_trl.py [--rounds 3] [--warmup 2] [--steps 4] [--threads 2]
                                                   [--warmstart-steps 250]  (RL's real starting point)

TRL is measured, never used by gapless: it lives in this benchmark's own virtualenv,
`bench/.venv-trl` (gitignored), created on first use with `torch==2.13.0+cpu` named explicitly (a
bare `torch` may pull a multi-GB CUDA wheel), then `trl` and `pydantic` from the package index.
Both sides run in that virtualenv's interpreter, so torch and transformers are the same build on
both, with gapless imported from `src/` through PYTHONPATH. Each side runs in its own child process
(bench/vs_trl_side.py), so its peak resident set (VmHWM) is its own. Rounds interleave the sides,
alternating which goes first (A B, B A, ...): the machine is shared and its load drifts.
If TRL cannot be installed or run, the script says why in one line and exits 1.

Aligned (both sides):
  model        gapless `build_tiny` with the default ModelConfig (1M-parameter Qwen2, local BPE
               tokenizer), randomly initialised, saved with `save_pretrained` to a temp dir and
               loaded from there by both (gapless `load_local`, which TRL gets as model and
               processing_class); `--warmstart-steps N` warm-starts it first, as `gapless train` does
  task         `generate_problems(seed 0, "train", 4000, levels 1-3, 5 hidden tests)`; plain-text
               prompts, tokenised without special tokens on both sides (this tokenizer adds none)
  reward       gapless's `CodeEnvironment` (bubblewrap, warm slots, concurrency 4), the same
               `score_groups` call, called from a TRL reward function
  batch        16 prompts x group size 8 = 128 completions per optimizer step, generated at once;
               micro-batches of 64 with gradient accumulation (TRL: per_device_train_batch_size 64,
               gradient_accumulation_steps 2, so generation_batch_size 128, steps_per_generation 2)
  sampling     max 24 new tokens, temperature 1.0, top-p 1.0, no top-k, stop at EOS
  update       one AdamW step per generation batch (num_iterations 1), lr 3e-4 constant (TRL:
               lr_scheduler_type constant, no warm-up), weight decay 0, betas/eps torch defaults,
               grad-norm clip 1.0, PPO clip 0.2 both sides, no KL (beta 0, no reference model), no
               entropy bonus, truncated completions kept
  loss         token-level PPO-clip normalised by the number of completion tokens of the whole
               step: gapless `dapo` = TRL `loss_type="dapo"` (TRL "grpo" is gapless "grpo", the
               per-sequence mean; TRL "dr_grpo" is gapless "drgrpo")
  advantage    (r - group mean) / (group std + eps): gapless `grpo` = TRL `scale_rewards="group"`
  numerics     fp32 (bf16/fp16 off), CPU, torch threads 2 (OMP_NUM_THREADS too), no gradient
               checkpointing (TRL's GRPOConfig turns it on by default), no evaluation
Not aligned:
  - the generator: gapless samples with its own KV-cache engine (continuous batching, finished rows
    leave the batch, behaviour log-probs recorded while sampling); TRL calls `model.generate`
    (padded static batch; it recomputes no old log-probs here since num_iterations is 1)
  - the random streams: the same seed, different samplers, so the completions differ (the mean
    completion length per side is reported to show the work was comparable)
  - the advantage epsilon (gapless 1e-6, TRL 1e-4) and TRL's per-step logging and metric
    gathering, which are part of TRL's step and counted
  - what a step times: gapless `RunLoop.train_step` (inline source) (generate, score, train, weight push to its
    generator); TRL the interval between optimizer steps (generate, score, train)
Prints one line per side per round, then one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "bench" / ".venv-trl"
TORCH_PIN = "torch==2.13.0+cpu"
SIDES = ("gapless", "trl")
SPEED_TARGET = 0.75  # gapless s/step at most this fraction of TRL's


def fail(reason: str) -> NoReturn:
    print(f"vs_trl: {reason}", file=sys.stderr)
    sys.exit(1)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def ensure_trl_env() -> Path:
    """The benchmark's own virtualenv with CPU torch and TRL; created once, reused after."""
    python = VENV / "bin" / "python"
    probe = [str(python), "-c", "import trl, torch, pydantic"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"vs_trl: installing {TORCH_PIN} and trl into bench/.venv-trl (once)", flush=True)
    if not python.exists():
        made = subprocess.run([sys.executable, "-m", "venv", str(VENV)], capture_output=True, text=True)
        if made.returncode != 0:
            fail(f"cannot create bench/.venv-trl: {last_line(made.stderr)}")
    pip = [str(python), "-m", "pip", "install", "-q"]
    torch_ok = subprocess.run(pip + [TORCH_PIN], capture_output=True, text=True)
    if torch_ok.returncode != 0:  # the CPU build may only be on PyTorch's own index
        torch_ok = subprocess.run(
            pip + [TORCH_PIN, "--extra-index-url", "https://download.pytorch.org/whl/cpu"],
            capture_output=True,
            text=True,
        )
        if torch_ok.returncode != 0:
            fail(f"cannot install {TORCH_PIN} into bench/.venv-trl: {last_line(torch_ok.stderr)}")
    trl_ok = subprocess.run(pip + ["trl", "pydantic>=2.7", TORCH_PIN], capture_output=True, text=True)
    if trl_ok.returncode != 0:
        fail(f"cannot install trl into bench/.venv-trl: {last_line(trl_ok.stderr)}")
    probed = subprocess.run(probe, capture_output=True, text=True)
    if probed.returncode != 0:
        fail(f"trl installed but does not import: {last_line(probed.stderr)}")
    return python


def save_model(model_dir: Path, warmstart_steps: int) -> None:
    """The default tiny policy (warm-started if asked), as a local HF checkpoint both sides load."""
    from gapless.config import Config
    from gapless.envs.registry import make_environment
    from gapless.orchestrate.policy_setup import prepare_policy

    cfg = Config.model_validate({"warmstart": {"steps": warmstart_steps}})
    env = make_environment(cfg)
    try:
        policy, _ = prepare_policy(cfg, env, log=lambda *_: None)
    finally:
        env.close()
    policy.save(model_dir)


def run_side(python: Path, side: str, model_dir: Path, args: argparse.Namespace) -> dict:
    threads = str(args.threads)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    cmd = [
        str(python),
        str(ROOT / "bench" / "vs_trl_side.py"),
        side,
        "--model",
        str(model_dir),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--threads",
        threads,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        fail(f"the {side} side failed (exit {done.returncode}): {last_line(done.stderr)}")
    return json.loads(last_line(done.stdout))


def side_summary(results: list[dict]) -> dict:
    pooled = lambda key: [x for r in results for x in r[key]]  # noqa: E731
    return {
        "step_s_median": statistics.median(pooled("step_s")),
        "cpu_s_median": statistics.median(pooled("cpu_s")),
        "generate_s_median": statistics.median(pooled("generate_s")),
        "score_s_median": statistics.median(pooled("score_s")),
        "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in results),
        "completion_len_mean": statistics.mean(r["completion_len_mean"] for r in results),
        "step_s_per_round": [round(statistics.median(r["step_s"]), 3) for r in results],
        "versions": results[0]["versions"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="steps per side and round left out of the figures")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per side and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmstart-steps", type=int, default=0, help="warm-start the tiny model first (0: random init)")
    args = ap.parse_args()
    python = ensure_trl_env()
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    per_round = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model(model_dir, args.warmstart_steps)
        for rnd in range(args.rounds):
            order = SIDES if rnd % 2 == 0 else SIDES[::-1]
            load = os.getloadavg()[0]
            for side in order:
                result = run_side(python, side, model_dir, args)
                runs[side].append(result)
                print(
                    f"round {rnd} {side:>7}: {statistics.median(result['step_s']):.2f} s/step "
                    f"(cpu {statistics.median(result['cpu_s']):.2f} s), peak {result['peak_rss_mb']:.0f} MB, "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            g, t = runs["gapless"][-1], runs["trl"][-1]
            per_round.append(
                {
                    "order": "/".join(order),
                    "ratio_step_s": statistics.median(g["step_s"]) / statistics.median(t["step_s"]),
                    "ratio_cpu_s": statistics.median(g["cpu_s"]) / statistics.median(t["cpu_s"]),
                    "ratio_peak_rss": g["peak_rss_mb"] / t["peak_rss_mb"],
                    "loadavg_1m_start": load,
                    "loadavg_1m_end": os.getloadavg()[0],
                }
            )
    from gapless.config import Config

    cfg = Config()  # the defaults both sides ran with
    gapless, trl = side_summary(runs["gapless"]), side_summary(runs["trl"])
    ratio_step = gapless["step_s_median"] / trl["step_s_median"]
    ratio_rss = gapless["peak_rss_mb_median"] / trl["peak_rss_mb_median"]
    print(
        json.dumps(
            {
                "bench": "vs_trl",
                "settings": {
                    "rounds": args.rounds,
                    "warmup_steps": args.warmup,
                    "measured_steps": args.steps,
                    "threads": args.threads,
                    "prompts_per_step": cfg.loop.prompts_per_step,
                    "group_size": cfg.generator.group_size,
                    "max_new_tokens": cfg.generator.max_new_tokens,
                    "warmstart_steps": args.warmstart_steps,
                },
                "gapless": gapless,
                "trl": trl,
                "ratio_step_s": ratio_step,
                "ratio_cpu_s": gapless["cpu_s_median"] / trl["cpu_s_median"],
                "ratio_peak_rss": ratio_rss,
                "ratio_step_s_round_median": statistics.median(r["ratio_step_s"] for r in per_round),
                "ratio_peak_rss_round_median": statistics.median(r["ratio_peak_rss"] for r in per_round),
                "per_round": per_round,
                "target_step_ratio": SPEED_TARGET,
                "meets_speed_target": ratio_step <= SPEED_TARGET,
                "meets_memory_target": ratio_rss <= 1.0,
            }
        )
    )


if __name__ == "__main__":
    main()
