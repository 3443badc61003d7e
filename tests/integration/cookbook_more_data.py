"""Local data for the cookbook recipes beyond the six of cookbook_data.py, each in the layout its
loader reads, for offline runs:

    openthoughts_rows      open-thoughts/OpenThoughts3-1.2M (`conversations`: from/value turns;
                           off_policy_reasoning streams it, which `datasets` serves from a prepared
                           cache offline as it does a plain load)
    wikitext_rows          Salesforce/wikitext, wikitext-103-raw-v1 (`text` lines; rl_numerics_check)
    write_toolalpaca       a `save_to_disk` directory with `prompt` and `golden_response`, the
                           SDFT paper's format that `sdft.train toolalpaca_data_path=...` loads
    write_messages_jsonl   one `{"messages": [...]}` per line (prompt_distillation.train file_path=...)
    write_prophet_arena    a Prophet Arena CSV (decisions.forecasting data_path=...): events that
                           close before the default split date train, those after it validate

`seed_named_dataset` writes a Hub data set where `datasets` finds it offline. The problems are the gsm8k-style sums of cookbook_data.py; nothing here is downloaded.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from cookbook_data import problems, seed_dataset


def seed_named_dataset(cache: Path, repo_id: str, config: str, splits: dict[str, list[dict]]) -> None:
    """seed_dataset for any repository name: `datasets` looks for ORG___NAME with NAME in snake
    case (OpenThoughts3-1.2M -> open_thoughts3-1.2_m), which seed_dataset writes only for names
    already in it."""
    from datasets.naming import camelcase_to_snakecase

    seed_dataset(cache, repo_id, config, splits)
    org, name = repo_id.split("/")
    wanted = cache / f"{org}___{camelcase_to_snakecase(name)}"
    if not wanted.exists():
        (cache / repo_id.replace("/", "___")).rename(wanted)


def openthoughts_rows(n: int, seed: int) -> list[dict]:
    return [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": f"{q[8:-1]} = {v}"}]}
        for q, v in problems(n, seed)
    ]


def wikitext_rows(n: int, seed: int) -> list[dict]:
    """Lines of English-like text: the counting task cuts its pages from them."""
    return [{"text": f" The sum of {q[8:-1]} is {v} , and the cat sat on the mat . \n"} for q, v in problems(n, seed)]


def write_toolalpaca(path: Path, n: int, seed: int) -> None:
    from datasets import Dataset

    rows = [{"prompt": q, "golden_response": [f"The answer is {v}."]} for q, v in problems(n, seed)]
    Dataset.from_list(rows).save_to_disk(str(path))


def write_messages_jsonl(path: Path, n: int, seed: int) -> None:
    """Language labels as prompt_distillation's create_data writes them (user text, assistant label)."""
    lines = []
    for i, (q, _) in enumerate(problems(n, seed)):
        label = "en" if i % 2 else "fr"
        text = q if label == "en" else q.replace("Compute", "Calculez")
        lines.append(
            json.dumps({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": label}]})
        )
    path.write_text("\n".join(lines) + "\n")


def write_prophet_arena(path: Path, n: int, seed: int) -> None:
    fields = ["submission_id", "event_ticker", "title", "snapshot_time", "close_time", "market_outcome"]
    fields += ["category", "markets", "sources"]
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        for i, (q, v) in enumerate(problems(n, seed)):
            month = "09" if i % 4 else "11"  # the default split date is 2025-10-20
            threshold = v - 1 + (i % 3)
            market = f"the sum is above {threshold}"
            writer.writerow(
                {
                    "submission_id": f"s{i}",
                    "event_ticker": f"E{i}",
                    "title": q,
                    "snapshot_time": f"2025-{month}-01T00:00:00Z",
                    "close_time": f"2025-{month}-05T00:00:00Z",
                    "market_outcome": json.dumps({market: int(v > threshold)}),
                    "category": "Arithmetic",
                    "markets": json.dumps([market]),
                    "sources": json.dumps([{"title": "Addition", "summary": f"{q[8:-1]} = {v}"}]),
                }
            )
