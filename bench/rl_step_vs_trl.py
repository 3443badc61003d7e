"""One GRPO step at the 0.5B shapes, full and LoRA: gapless's loop against TRL's `GRPOTrainer`.

    PYTHONPATH=src .venv/bin/python bench/rl_step_vs_trl.py [--shapes qwen2.5-0.5b,qwen3-0.6b]
        [--modes full,lora] [--rank 8] [--warmup 1] [--steps 1] [--threads 2]

bench/vs_trl.py compares whole runs on the embedded tiny model; this compares the step itself
where the model is the size people start from. A step is the same work on both sides: sample
`--group` completions of up to `--new-tokens` tokens for each of `--prompts` prompts at
temperature 1, score them, and take one optimizer step on all of them.

Aligned (both sides):
  model      bench/real_shapes.py's randomly initialised Qwen2.5-0.5B or Qwen3-0.6B shape (true
             151,936-token vocabulary, tied embeddings), fp32, saved with `save_pretrained` with
             a word-level tokenizer of the same size ("<eos>", "t1" ... "t151935"; no chat
             template), loaded from that directory by both
  prompts    `--prompts` prompts of `--prompt-tokens` random words "t1000" .. "t3999"
  reward     the fraction of completion words "tN" with N even, one Python function on the
             decoded text (a random model's completions have spread in it, so every group carries
             signal on both sides)
  update     lr 1e-5 constant, no warm-up, AdamW (torch defaults, weight decay 0), grad clip 1.0,
             PPO clip 0.2, one update per batch, no KL (TRL beta 0), token-level loss over the
             whole step (gapless `dapo` = TRL `loss_type="dapo"`), group mean/std advantages
             (TRL `scale_rewards="group"`), all completions in one micro-batch (TRL
             per_device_train_batch_size = prompts x group; `--micro-batch-size` to cut it, with
             gradient accumulation on TRL's side), no gradient checkpointing (`--gradient-checkpointing`
             turns it on for both)
  LoRA       rank `--rank`, alpha 32, dropout 0, on q/k/v/o/gate/up/down (gapless's
             `lora.target_modules` default; TRL through peft's LoraConfig)
  numerics   CPU, torch threads `--threads` (OMP_NUM_THREADS too), one child process per side
             and step count (its own peak resident set, VmHWM)
Not aligned (each side as its users run it):
  - sampling: gapless's engine (a second copy of the weights, packed for its kernels, and a KV
    cache) inside the same process; TRL calls `model.generate` on the trained model
  - gapless's step includes the weight push to its engine (full weights, or adapters merged);
    TRL's has no push
  - the random streams: same seed, different samplers, so the completions differ
Each side runs `--warmup` + `--steps` steps; the figures are the steps after the warm-up. Rounds
alternate which side goes first. Prints a line per run, then one JSON object on the last line.
TRL is measured, never used by gapless: both sides run in bench/.venv-trl (bench/vs_trl.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from real_shapes import build_model, peak_rss_gb  # noqa: E402
from vs_trl import ensure_trl_env, fail, last_line  # noqa: E402

SIDES = ("gapless", "trl")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR, ALPHA = 1e-5, 32.0


def parity_reward(text: str) -> float:
    """Fraction of the words "tN" of a completion with N even (0 for none)."""
    numbers = [int(w[1:]) for w in text.split() if w[:1] == "t" and w[1:].isdigit()]
    return sum(1 for n in numbers if n % 2 == 0) / len(numbers) if numbers else 0.0


def prompt_texts(count: int, words: int) -> list[str]:
    import random

    rng = random.Random(1)
    return [" ".join(f"t{rng.randrange(1000, 4000)}" for _ in range(words)) for _ in range(count)]


def save_checkpoint(shape: str, directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = build_model(shape)
    vocab = model.config.vocab_size
    model.config.eos_token_id = model.config.pad_token_id = 0
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    words = {"<eos>": 0, **{f"t{i}": i for i in range(1, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<eos>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<eos>").save_pretrained(directory)


class ParityEnvironment:
    """gapless's side of the reward: the prompts as tasks, `parity_reward` as the score."""

    name = "parity"

    def __init__(self, prompts: list[str]):
        from dataclasses import make_dataclass

        task = make_dataclass("ParityTask", [("uid", str), ("prompt", str)], frozen=True)
        self._tasks = [task(f"p{i}", p) for i, p in enumerate(prompts)]

    def tasks(self, split):
        return self._tasks

    def score_groups(self, tasks, groups):
        from gapless.types import Rollout

        return [[Rollout(t.uid, c, parity_reward(c.text), "ok") for c in cs] for t, cs in zip(tasks, groups)]

    def close(self):
        pass


def micro_batch(args) -> int:
    return args.micro_batch_size or args.prompts * args.group


def run_gapless(args) -> dict:
    from gapless.config import Config
    from gapless.orchestrate.loop import RunLoop

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = Config.model_validate(
            {
                "run_dir": run_dir,
                "seed": 0,
                "model": {"path": args.model},
                "warmstart": {"steps": 0},
                "generator": {
                    "group_size": args.group,
                    "max_new_tokens": args.new_tokens,
                    "temperature": 1.0,
                    "top_p": 1.0,
                },
                "trainer": {
                    "threads": args.threads,
                    "lr": LR,
                    "micro_batch_size": micro_batch(args),
                    "loss": "dapo",
                    "advantage": "grpo",
                    "clip_eps": 0.2,
                    "max_grad_norm": 1.0,
                    "weight_decay": 0.0,
                    "gradient_checkpointing": args.gradient_checkpointing,
                },
                "lora": {"rank": args.rank if args.mode == "lora" else 0, "alpha": ALPHA, "target_modules": TARGETS},
                "loop": {"steps": args.warmup + args.steps, "prompts_per_step": args.prompts},
                "metrics": {"tensorboard": False, "timeline": False, "live": "plain"},
            }
        )
        loop = RunLoop(
            cfg,
            log=lambda *_: None,
            env=ParityEnvironment(prompt_texts(args.prompts, args.prompt_tokens)),
            source="inline",
        )
        steps = []
        for step in range(args.warmup + args.steps):
            started = time.perf_counter()
            m = loop.train_step(step)
            steps.append(
                {
                    "step_s": time.perf_counter() - started,
                    "generate_s": m["perf/generate_s"],
                    "train_s": m["perf/train_s"],
                    "push_s": m["perf/weight_push_s"],
                    "completion_len": m["rollout/completion_len_mean"],
                    "reward": m.get("rollout/reward_mean"),
                }
            )
        loop.env.close()
    return {"steps": steps[args.warmup :]}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(args.model)
    steps, pending = [], {"generate_s": 0.0, "lengths": [], "rewards": []}

    def reward(prompts, completions, completion_ids, **_):
        pending["lengths"] += [len(ids) for ids in completion_ids]
        scores = [parity_reward(text) for text in completions]
        pending["rewards"] += scores
        return scores

    class StepClock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, a, state, control, **kwargs):
            steps.append(
                {
                    "step_s": time.perf_counter() - self.started,
                    "generate_s": pending["generate_s"],
                    "completion_len": statistics.mean(pending["lengths"]),
                    "reward": statistics.mean(pending["rewards"]),
                }
            )
            pending.update(generate_s=0.0, lengths=[], rewards=[])

    batch = args.prompts * args.group
    peft_config = None
    if args.mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.rank, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, bias="none", task_type="CAUSAL_LM"
        )
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            report_to="none",
            save_strategy="no",
            logging_steps=10**6,
            disable_tqdm=True,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=args.gradient_checkpointing,
            seed=0,
            max_steps=args.warmup + args.steps,
            per_device_train_batch_size=micro_batch(args),
            gradient_accumulation_steps=batch // micro_batch(args),
            num_generations=args.group,
            max_completion_length=args.new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            optim="adamw_torch",
            beta=0.0,
            num_iterations=1,
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
            mask_truncated_completions=False,
            dataloader_num_workers=0,
        )
        data = Dataset.from_dict({"prompt": prompt_texts(args.prompts, args.prompt_tokens) * 64})
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[StepClock()],
            peft_config=peft_config,
        )
        generate = trainer.model.generate

        def timed_generate(*a, **k):
            started = time.perf_counter()
            out = generate(*a, **k)
            pending["generate_s"] += time.perf_counter() - started
            return out

        trainer.model.generate = timed_generate
        trainer.train()
    import trl

    return {"steps": steps[args.warmup :], "trl": trl.__version__}


def child(args) -> dict:
    out = (run_gapless if args.side == "gapless" else run_trl)(args)
    import torch
    import transformers

    out["versions"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": out.pop("trl", None),
    }
    out["peak_rss_gb"] = peak_rss_gb()
    return out


def run_side(python: Path, side: str, mode: str, model_dir: Path, args) -> dict:
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
        __file__,
        "--side",
        side,
        "--mode",
        mode,
        "--model",
        str(model_dir),
        "--threads",
        threads,
        "--rank",
        str(args.rank),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--prompts",
        str(args.prompts),
        "--group",
        str(args.group),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--new-tokens",
        str(args.new_tokens),
        "--micro-batch-size",
        str(args.micro_batch_size),
    ] + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        fail(f"the {side} side ({mode}) failed (exit {done.returncode}): {last_line(done.stderr)}")
    return json.loads(last_line(done.stdout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-0.5b,qwen3-0.6b")
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1, help="steps per run left out of the figures")
    ap.add_argument("--steps", type=int, default=1, help="measured steps per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sides", default="gapless,trl", help="run only these sides (ratios need both)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=0, help="rows per forward/backward (0: all of the step's)")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="both sides (TRL's own default is on)")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--mode", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        print(json.dumps(child(args)))
        return
    python = ensure_trl_env()
    probe = subprocess.run([str(python), "-c", "import peft"], capture_output=True)
    if (
        probe.returncode != 0
        and subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "peft", "torch==2.13.0+cpu"], capture_output=True
        ).returncode
        != 0
    ):
        fail("cannot install peft into bench/.venv-trl (TRL's LoRA path)")
    results: dict = {}
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = Path(tmp) / "model"
            save_checkpoint(shape, model_dir)
            for mode in args.modes.split(","):
                sides = [side for side in SIDES if side in args.sides.split(",")]
                runs = {side: [] for side in sides}
                for rnd in range(args.rounds):
                    for side in sides if rnd % 2 == 0 else sides[::-1]:
                        result = run_side(python, side, mode, model_dir, args)
                        runs[side].append(result)
                        step = statistics.median(s["step_s"] for s in result["steps"])
                        print(
                            f"{shape} {mode} round {rnd} {side:>7}: {step:.1f} s/step "
                            f"(generate {statistics.median(s['generate_s'] for s in result['steps']):.1f} s), "
                            f"peak {result['peak_rss_gb']:.2f} GB, completion {result['steps'][0]['completion_len']:.1f} tokens",
                            flush=True,
                        )
                summary = {}
                for side, rs in runs.items():
                    steps = [s for r in rs for s in r["steps"]]
                    numeric = [k for k in steps[0] if all(isinstance(s[k], (int, float)) for s in steps)]
                    summary[side] = {k: statistics.median(s[k] for s in steps) for k in numeric}
                    summary[side]["peak_rss_gb"] = statistics.median(r["peak_rss_gb"] for r in rs)
                    summary[side]["versions"] = rs[0]["versions"]
                results[f"{shape} {mode}"] = summary
                if len(sides) < 2:
                    continue
                g, t = summary["gapless"], summary["trl"]
                summary["ratio_step_s"] = g["step_s"] / t["step_s"]
                summary["ratio_peak_rss"] = g["peak_rss_gb"] / t["peak_rss_gb"]
                print(
                    f"{shape} {mode}: gapless / TRL step {summary['ratio_step_s']:.2f}x, "
                    f"peak memory {summary['ratio_peak_rss']:.2f}x",
                    flush=True,
                )
    print(
        json.dumps(
            {
                "bench": "rl_step_vs_trl",
                "settings": {k: v for k, v in vars(args).items() if k not in ("side", "mode", "model")},
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
