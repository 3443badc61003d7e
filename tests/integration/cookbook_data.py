"""Local stand-ins for the Hub data sets tinker-cookbook's recipes load by name, for offline runs.

    seed_dataset(cache, "openai/gsm8k", "main", {"train": rows, "test": rows})

writes `rows` where `datasets.load_dataset(repo_id, config)` looks first when offline
(HF_DATASETS_OFFLINE=1): a prepared data set under HF_DATASETS_CACHE/ORG___NAME/CONFIG/. The rows
follow each data set's own schema (only the columns the recipes read). The problems are
gsm8k-style arithmetic ("Compute 4+7." with a worked answer ending `#### 11`), small enough that
the service's built-in model can learn them in a few steps on a CPU.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

SUFFIX = " Write your answer in \\boxed{} format."  # math_rl's MathEnv.question_suffix()


def seed_dataset(cache: Path, repo_id: str, config: str, splits: dict[str, list[dict]]) -> None:
    from datasets.packaged_modules.json.json import Json

    staging = cache / f".staging-{repo_id.replace('/', '___')}-{config}"
    shutil.rmtree(staging, ignore_errors=True)
    files = {}
    for split, rows in splits.items():
        path = staging / "src" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files[split] = str(path)
    name = repo_id.split("/")[-1]
    builder = Json(cache_dir=str(staging / "built"), dataset_name=name, config_name=config, data_files=files)
    builder.download_and_prepare()
    info = next((staging / "built").rglob("dataset_info.json"))  # its folder holds the prepared splits
    target = cache / repo_id.replace("/", "___") / config / "0.0.0" / "gapless"  # CONFIG/VERSION/HASH
    shutil.rmtree(target.parent.parent, ignore_errors=True)
    target.parent.mkdir(parents=True)
    shutil.move(str(info.parent), str(target))
    shutil.rmtree(staging)


def problems(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        out.append((f"Compute {a}+{b}.", a + b))
    return out


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    return [{"question": q, "answer": f"We add the numbers: {q[8:-1]} = {v}.\n#### {v}"} for q, v in problems(n, seed)]


def boxed_conversations(n: int, seed: int, fewshot: list[dict]) -> list[dict]:
    """Chats in math_rl's gsm8k format (its few-shot example first), the reply a boxed answer."""
    return [
        {
            "messages": [
                *fewshot,
                {"role": "user", "content": q + SUFFIX},
                {"role": "assistant", "content": f"\\boxed{{{v}}}"},
            ]
        }
        for q, v in problems(n, seed)
    ]


def hh_rows(n: int, seed: int) -> list[dict]:
    """Anthropic/hh-rlhf rows: the chosen reply is the right sum, the rejected one a wrong one."""
    rows = []
    for q, v in problems(n, seed):
        head = f"\n\nHuman: {q}\n\nAssistant:"
        rows.append({"chosen": f"{head} {v}", "rejected": f"{head} {v + 3} is what I think, maybe."})
    return rows


def prompt_rows(n: int, seed: int) -> list[dict]:
    """allenai/tulu-3-sft-mixture rows (on-policy distillation takes the user turn as the prompt)."""
    return [
        {"id": f"p{i}", "source": "gapless", "messages": [{"role": "user", "content": q + SUFFIX}]}
        for i, (q, _) in enumerate(problems(n, seed))
    ]
