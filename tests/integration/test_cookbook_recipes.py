"""tinker-cookbook 0.6.1's recipes, run unchanged (their own `python -m` entry points, command-line
options only) against `gapless serve-training` in a separate process, offline: no network, no
hand-seeded tokenizer cache (the service exports its tokenizer into a fresh HF_HUB_CACHE under the
served name), the Hub data sets replaced by local gsm8k-style rows (cookbook_data.py).

The service serves two built-in models under names the cookbook maps to the `qwen3_instruct`
renderer: the embedded tiny model (the [model] defaults, untrained: no warm start, task math for
its tokenizer) as "Qwen/Qwen3-4B-Instruct-2507", and the `chat_arithmetic` base (the tiny model
warm-started on boxed chat arithmetic, built at the service's first start and cached) as
"Qwen/Qwen3-30B-A3B-Instruct-2507". Each recipe moves its own metric:

    sl_basic                 train_mean_nll falls (boxed answers; its final state is distillation's teacher)
    math_rl (gsm8k, IS)      env/all/correct rises, on the chat_arithmetic base
    preference/dpo (hhh)     dpo_loss falls, accuracy reaches 1
    preference/shorter       completions get shorter (ac_tokens_per_turn)
    on_policy_distillation   teacher_kl falls (teacher: the same base with the SFT sampler weights)
    guess_number             runs its multi-turn episodes (10 turns of a growing context)

docs/service.md ("Running the cookbook") gives the same commands.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook comes with the test extra (scripts/setup.sh)")
pytest.importorskip("pylatexenc", reason="math_rl's grader; the test extra installs it")
from cookbook_data import boxed_conversations, gsm8k_rows, hh_rows, prompt_rows, seed_dataset  # noqa: E402

pytestmark = pytest.mark.slow
KEY = "tml-gapless-test"
MODEL = "Qwen/Qwen3-4B-Instruct-2507"
ARITHMETIC = "Qwen/Qwen3-30B-A3B-Instruct-2507"  # the chat_arithmetic base
SRC = Path(__file__).parents[2] / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook")
    data = root / "datasets"
    seed_dataset(
        data,
        "HuggingFaceH4/no_robots",
        "default",
        {"train": boxed_conversations(512, 0, []), "test": boxed_conversations(16, 1, [])},
    )
    seed_dataset(data, "openai/gsm8k", "main", {"train": gsm8k_rows(1024, 2), "test": gsm8k_rows(16, 3)})
    seed_dataset(data, "Anthropic/hh-rlhf", "default", {"train": hh_rows(256, 4), "test": hh_rows(16, 5)})
    seed_dataset(data, "allenai/tulu-3-sft-mixture", "default", {"train": prompt_rows(64, 6)})
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "HF_HUB_CACHE": str(root / "hub"),  # empty: what the service exports is all there is
        "HF_DATASETS_CACHE": str(data),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TINKER_API_KEY": KEY,
        "TINKER_BASE_URL": f"http://127.0.0.1:{port}",
    }
    args = [
        sys.executable, "-m", "gapless.cli", "serve-training", "--port", str(port), "--threads", "1",
        "--task.name", '"math"', "--warmstart.steps", "0",
        "--service.base_models", f'{{"{MODEL}" = {{}}, "{ARITHMETIC}" = {{builtin = "chat_arithmetic"}}}}',
        "--service.checkpoint_dir", json.dumps(str(root / "service")),
    ]  # fmt: skip
    log = open(root / "service.log", "w")  # noqa: SIM115 -- the server's, closed after it
    server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 3600  # the first start builds the chat_arithmetic base (cached after)
    while "serving the Tinker API" not in (root / "service.log").read_text():
        assert server.poll() is None and time.monotonic() < deadline, (root / "service.log").read_text()[-3000:]
        time.sleep(0.5)
    state = {"root": root, "env": env}
    yield state
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=60)
    log.close()


def _recipe(cookbook, module: str, name: str, *options: str) -> list[dict]:
    """Run `python -m tinker_cookbook.recipes.MODULE OPTIONS log_path=...`; its metrics.jsonl rows."""
    log_path = cookbook["root"] / name
    args = [sys.executable, "-m", f"tinker_cookbook.recipes.{module}", *options, f"log_path={log_path}"]
    out = subprocess.run(args, env=cookbook["env"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(not k.startswith(("time/", "progress/")) for k in r)]


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    assert values, f"no {key} logged"
    return sum(values) / len(values)


@pytest.fixture(scope="module")
def sft(cookbook):
    rows = _recipe(
        cookbook, "sl_basic", "sl_basic",
        f"model_name={MODEL}", "learning_rate=3e-3", "lr_schedule=constant", "lora_rank=16",
        "num_epochs=3", "max_steps=40", "eval_every=0", "save_every=0",
        # the recipe's NoRobots builder, with a batch and the reply-only loss that suit a CPU run
        "dataset_builder=tinker_cookbook.recipes.chat_sl.chat_datasets:NoRobotsBuilder",
        f"dataset_builder.common_config.model_name_for_tokenizer={MODEL}",
        "dataset_builder.common_config.renderer_name=qwen3_instruct",
        "dataset_builder.common_config.batch_size=32", "dataset_builder.common_config.max_length=1024",
        "dataset_builder.common_config.train_on_what=last_assistant_message",
    )  # fmt: skip
    saved = json.loads((cookbook["root"] / "sl_basic" / "checkpoints.jsonl").read_text().splitlines()[-1])
    return rows, saved


def test_sl_basic_lowers_the_loss(sft):
    rows, saved = sft
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 40 and nll[-1] < nll[0] / 4, nll
    assert saved["state_path"].startswith("tinker://") and "/sampler_weights/" in saved["sampler_path"]


def test_math_rl_raises_the_correct_rate(cookbook):
    rows = _recipe(
        cookbook, "math_rl.train", "math_rl",
        f"model_name={ARITHMETIC}", "env=gsm8k", "loss_fn=importance_sampling", "group_size=8",
        "groups_per_batch=8", "max_tokens=8", "learning_rate=3e-3", "lora_rank=16", "eval_every=0",
        "save_every=0", "max_steps=64",
    )  # fmt: skip
    correct = [r["env/all/correct"] for r in rows if "env/all/correct" in r]
    assert len(correct) == 64, correct
    # the base answers in the format and is right part of the time; RL makes it right more often.
    # 16 steps of 64 answers each side, since one step's rate varies by about 0.1 around its mean;
    # the rise is a few points, so the margin is small (a run that does not learn fails it about half the time)
    first, last = sum(correct[:16]) / 16, sum(correct[-16:]) / 16
    assert 0.15 < first < 0.6 and last > first + 0.01, (first, last, correct)
    assert _mean(rows, "env/all/format") > 0.9, [r.get("env/all/format") for r in rows]


def test_dpo_learns_the_preferences(cookbook):
    rows = _recipe(
        cookbook, "preference.dpo.train", "dpo",
        f"model_name={MODEL}", "dataset=hhh", "learning_rate=1e-3", "batch_size=16", "max_length=512", "max_steps=8",
    )  # fmt: skip
    losses = [r["dpo_loss"] for r in rows if "dpo_loss" in r]
    assert losses[-1] < 0.5 * losses[0] and rows[-1]["accuracy"] == 1.0, losses


def test_shorter_shortens_completions(cookbook):
    rows = _recipe(
        cookbook, "preference.shorter.train", "shorter",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", "batch_size=4", "group_size=4",
        "max_tokens=24", "learning_rate=3e-3", "eval_every=0", "max_steps=8",
    )  # fmt: skip
    lengths = [r["env/all/ac_tokens_per_turn"] for r in rows if "env/all/ac_tokens_per_turn" in r]
    assert sum(lengths[-3:]) / 3 < sum(lengths[:3]) / 3 - 1, lengths


def test_on_policy_distillation_approaches_the_teacher(cookbook, sft):
    rows = _recipe(
        cookbook, "distillation.on_policy_distillation", "distillation",
        f"model_name={MODEL}", f"teacher_model={MODEL}", f"teacher_checkpoint={sft[1]['sampler_path']}",
        "dataset=tulu3", "group_size=4", "groups_per_batch=4", "max_tokens=12", "learning_rate=3e-3",
        "lora_rank=16", "eval_every=0", "save_every=0", "max_steps=8",
    )  # fmt: skip
    kl = [r["teacher_kl"] for r in rows if "teacher_kl" in r]
    assert len(kl) == 8 and sum(kl[-3:]) / 3 < sum(kl[:3]) / 3, kl


def test_guess_number_runs_its_episodes(cookbook):
    rows = _recipe(
        cookbook, "multiplayer_rl.guess_number.train", "guess_number",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", "batch_size=2", "group_size=2",
        "max_tokens=8", "learning_rate=3e-3", "eval_every=0", "save_every=0", "max_steps=2",
    )  # fmt: skip
    assert len([r for r in rows if "env/all/reward/total" in r]) == 2
    assert _mean(rows, "env/all/turns_per_episode") >= 1
