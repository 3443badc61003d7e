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
    guess_number             plays and trains its multi-turn episodes (10 turns of a growing context);
                             its reward cannot move here: the untrained player never writes
                             `Guess: N`, so every group's reward is constant and its advantages 0

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
    # the two means differ by about 0.02 (one standard deviation) in a run that does not learn, which
    # fails this margin about nine times in ten; the runs measured rose 0.034-0.072
    first, last = sum(correct[:16]) / 16, sum(correct[-16:]) / 16
    assert 0.15 < first < 0.6 and last > first + 0.025, (first, last, correct)
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
        "max_tokens=8", "learning_rate=3e-3", "eval_every=0", "save_every=0", "max_steps=6",
    )  # fmt: skip
    assert len([r for r in rows if "env/all/reward/total" in r]) == 6
    assert _mean(rows, "env/all/turns_per_episode") >= 1


# ---- the cookbook's other entry points (docs/service.md, "Other recipes") ----------------------


def _run(cookbook, args: list[str], stdin: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=cookbook["env"], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def _last_checkpoint(cookbook, name: str) -> dict:
    return json.loads((cookbook["root"] / name / "checkpoints.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def more(cookbook):
    """The other recipes' data: Hub data sets in the offline cache, local files where a recipe takes a path."""
    from cookbook_more_data import (
        openthoughts_rows,
        seed_named_dataset,
        wikitext_rows,
        write_messages_jsonl,
        write_prophet_arena,
        write_toolalpaca,
    )

    root, data = cookbook["root"], cookbook["root"] / "datasets"
    seed_named_dataset(data, "open-thoughts/OpenThoughts3-1.2M", "default", {"train": openthoughts_rows(64, 7)})
    seed_named_dataset(data, "Salesforce/wikitext", "wikitext-103-raw-v1", {"train": wikitext_rows(400, 8)})
    deepmath = [{"question": r["question"]} for r in gsm8k_rows(64, 12)]
    seed_named_dataset(data, "zwhe99/DeepMath-103K", "default", {"train": deepmath})
    write_toolalpaca(root / "toolalpaca", 40, 9)
    write_messages_jsonl(root / "lang.jsonl", 64, 10)
    write_prophet_arena(root / "prophet.csv", 48, 11)
    return cookbook


@pytest.fixture(scope="module")
def sl_loop(cookbook):
    rows = _recipe(
        cookbook, "sl_loop", "sl_loop",
        f"model_name={MODEL}", "batch_size=16", "learning_rate=3e-3", "lora_rank=16", "max_length=1024",
        "save_every=0", "max_steps=6",
    )  # fmt: skip
    return rows, _last_checkpoint(cookbook, "sl_loop")


def test_sl_loop_lowers_the_loss(sl_loop):
    nll = [r["train_mean_nll"] for r in sl_loop[0] if "train_mean_nll" in r]
    assert len(nll) == 6 and nll[-1] < nll[0], nll


def test_rl_loop_runs_with_a_served_loss_and_refuses_its_default(cookbook):
    rows = _recipe(
        cookbook, "rl_loop", "rl_loop",
        f"model_name={MODEL}", "loss_fn=importance_sampling", "batch_size=4", "group_size=4",
        "learning_rate=3e-3", "lora_rank=16", "max_tokens=16", "save_every=0", "max_steps=3",
    )  # fmt: skip
    assert len([r for r in rows if "reward/total" in r]) == 3
    default = _run(cookbook, ["-m", "tinker_cookbook.recipes.rl_loop", f"model_name={MODEL}", "batch_size=1",
                              "group_size=2", "max_tokens=4", "max_steps=1", f"log_path={cookbook['root'] / 'rl_loop_sr'}"])  # fmt: skip
    assert default.returncode != 0 and "stable_reinforce" in default.stderr and "not served" in default.stderr


def test_rl_basic_runs_its_gsm8k_prompt_and_max_tokens(cookbook):
    """rl_basic's own few-shot prompt (~300 tokens) and max_tokens=256, over the old 512 context;
    only the batch (128 x 16 by default, one step takes over 10 minutes here) is made smaller."""
    rows = _recipe(
        cookbook, "rl_basic", "rl_basic",
        f"model_name={MODEL}", "dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
        "dataset_builder.batch_size=4", "dataset_builder.group_size=4",
        f"dataset_builder.model_name_for_tokenizer={MODEL}", "dataset_builder.renderer_name=qwen3_instruct",
        "learning_rate=3e-3", "lora_rank=16", "max_steps=2",
    )  # fmt: skip
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert len(steps) == 2 and steps[0]["env/all/ob_tokens_per_turn"] + 256 > 512, steps


def test_chat_cli_answers_each_turn(cookbook, sl_loop):
    out = _run(
        cookbook,
        ["-m", "tinker_cookbook.chat_app.tinker_chat_cli", f"base_model={MODEL}",
         f"model_path={sl_loop[1]['sampler_path']}", f"base_url={cookbook['env']['TINKER_BASE_URL']}"],
        stdin="Compute 2+3.\nCompute 4+1.\nq\n",
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.count("Assistant:") == 2 and "Goodbye" in out.stdout, out.stdout[-2000:]


def test_prompt_distillation_trains_on_its_file(more):
    rows = _recipe(
        more, "prompt_distillation.train", "prompt_distillation",
        f"model_name={MODEL}", f"file_path={more['root'] / 'lang.jsonl'}", "renderer_name=qwen3_instruct",
        "lora_rank=16", "batch_size=16", "learning_rate=3e-3", "max_length=512", "eval_every=0", "save_every=0",
        "max_steps=4",
    )  # fmt: skip
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 4 and nll[-1] < nll[0], nll


def test_off_policy_reasoning_streams_its_data_set(more):
    rows = _recipe(
        more, "distillation.off_policy_reasoning", "off_policy_reasoning",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", "lora_rank=16", "batch_size=8",
        "learning_rate=3e-3", "max_length=1024", "buffer_size=64", "max_prompts=64", "eval_every=0",
        "save_every=0", "max_steps=4",
    )  # fmt: skip
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 4 and nll[-1] < nll[0], nll


@pytest.mark.parametrize("reverse", [False, True])
def test_sdft_distills_the_top_k_teacher(more, reverse):
    """Forward KL: cross_entropy on (T, K) targets; reverse: forward_backward_custom. Both take the
    teacher's topk_prompt_logprobs."""
    rows = _recipe(
        more, "sdft.train", f"sdft_{reverse}",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", "dataset=toolalpaca",
        f"toolalpaca_data_path={more['root'] / 'toolalpaca'}", "lora_rank=16", "groups_per_batch=4",
        "group_size=1", "max_tokens=16", "learning_rate=3e-3", "topk=8", f"reverse={reverse}",
        "max_context_length=1024", "eval_every=0", "save_every=0", "max_steps=2",
    )  # fmt: skip
    steps = [r for r in rows if "sdft/topk" in r or "sdft/num_datums" in r]
    assert len([r for r in rows if "env/all/reward/total" in r]) == 2 and steps, rows[-1]


def test_decisions_demo_and_forecasting(more):
    demo = _run(more, ["-m", "tinker_cookbook.recipes.decisions.demo", f"model_name={MODEL}"], stdin="Which team?\n")
    assert demo.returncode == 0, demo.stderr[-2000:]
    probs = json.loads(demo.stdout[demo.stdout.index("{") : demo.stdout.index("}") + 1])
    assert list(probs) == ["billing", "sdk", "console", "cookbook"] and sum(probs.values()) == pytest.approx(
        1, abs=1e-3
    )
    rows = _recipe(
        more, "decisions.forecasting", "forecasting",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", f"data_path={more['root'] / 'prophet.csv'}",
        "lora_rank=16", "batch_size=8", "learning_rate=3e-3", "eval_every=2", "max_steps=4",
    )  # fmt: skip
    assert len([r for r in rows if "train/loss" in r]) == 4 and len([r for r in rows if "test/brier_reward" in r]) >= 2


def test_rl_numerics_check_finds_sampler_and_trainer_agree(more):
    rows = _recipe(
        more, "rl_numerics_check.train", "rl_numerics_check",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", "lora_rank=16", "group_size=2",
        "groups_per_batch=2", "max_tokens=32", "max_trajectory_tokens=3000", "task.num_pages_min=2",
        "task.num_pages_max=2", "task.page_chars=400", "learning_rate=3e-3", "save_every=0", "max_steps=2",
    )  # fmt: skip
    kl = [r["optim/kl_sample_train_v1"] for r in rows if "optim/kl_sample_train_v1" in r]
    assert len(kl) == 2 and all(abs(k) < 1e-3 for k in kl), kl


def test_tinker_cli_lists_and_downloads(cookbook, sl_loop):
    tinker_cli = [sys.executable, "-m", "tinker.cli"]  # the `tinker` command
    runs = subprocess.run(
        [*tinker_cli, "-f", "json", "run", "list"], env=cookbook["env"], capture_output=True, text=True
    )
    run_id = sl_loop[1]["state_path"].split("/")[2]
    assert runs.returncode == 0 and run_id in runs.stdout, runs.stderr[-2000:]
    listed = subprocess.run(
        [*tinker_cli, "-f", "json", "checkpoint", "list", "--run-id", run_id],
        env=cookbook["env"],
        capture_output=True,
        text=True,
    )
    assert sl_loop[1]["state_path"] in listed.stdout and sl_loop[1]["sampler_path"] in listed.stdout, listed.stdout
    out = cookbook["root"] / "download"
    got = subprocess.run(
        [*tinker_cli, "checkpoint", "download", sl_loop[1]["state_path"], "--output", str(out)],
        env=cookbook["env"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    assert {p.name for p in out.rglob("*")} >= {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"}


def test_chat_sl_trains_on_no_robots(cookbook):
    rows = _recipe(
        cookbook, "chat_sl.train", "chat_sl",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", "dataset=no_robots", "lora_rank=16",
        "batch_size=16", "learning_rate=3e-3", "max_length=1024", "eval_every=0", "infrequent_eval_every=0",
        "save_every=0", "max_steps=3",
    )  # fmt: skip
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 3 and nll[-1] < nll[0], nll


def test_forecasting_rl_runs_on_a_local_csv(more):
    rows = _recipe(
        more, "forecasting.train", "forecasting_rl",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", f"data_path={more['root'] / 'prophet.csv'}",
        "lora_rank=16", "group_size=4", "groups_per_batch=4", "validation_group_size=2", "max_tokens=32",
        "learning_rate=3e-3", "eval_every=0", "save_every=0", "max_steps=2",
    )  # fmt: skip
    assert len([r for r in rows if "env/all/brier_reward" in r]) == 2


def test_multi_teacher_distillation_against_its_own_base(more):
    """Both teachers are the student's base model: the teacher KL of the first step is 0."""
    rows = _recipe(
        more, "distillation.on_policy_multi_teacher", "multi_teacher",
        f"model_name={MODEL}", "renderer_name=qwen3_instruct", f"deepmath_teacher_model={MODEL}",
        f"tulu3_teacher_model={MODEL}", "deepmath_groups_per_batch=2", "tulu3_groups_per_batch=2", "group_size=2",
        "max_tokens=16", "lora_rank=16", "learning_rate=3e-3", "eval_every=0", "save_every=0", "max_steps=2",
    )  # fmt: skip
    first = next(r for r in rows if "teacher_kl/dataset_0" in r)
    assert abs(first["teacher_kl/dataset_0"]) < 1e-4 and abs(first["teacher_kl/dataset_1"]) < 1e-4, first
