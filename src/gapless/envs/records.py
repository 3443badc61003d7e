"""Read task records from a JSONL or Parquet file, with every bad record named by file and line.

`load_records(path, parse)` reads every record (a JSON object per line, or a Parquet row), turns
each into a task with `parse(record)`, and either returns all of them or raises `DatasetError`
listing the bad ones ("data.jsonl:17: missing field 'prompt'"). A bad record never disappears
silently and never shortens the data set: the run stops before it starts. Blank JSONL lines are
skipped. `split_by_hash` gives records without an explicit split a deterministic one.
Not guaranteed: that the tasks are solvable, or distinct (duplicates are the file's business).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")
MAX_REPORTED = 5


class DatasetError(ValueError):
    """The data file has malformed records; the message names each (file:line) and what is wrong."""


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, record) for each record; a record that is not even JSON comes back as an exception."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 -- pyarrow's errors have no common base worth naming
            raise DatasetError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
        for row, record in enumerate(rows, start=1):
            yield f"{path.name}:row {row}", record
        return
    with path.open(encoding="utf-8", errors="strict") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path.name}:{number}", json.loads(line)
            except json.JSONDecodeError as exc:
                yield f"{path.name}:{number}", DatasetError(f"not JSON ({exc.msg} at column {exc.colno})")


def load_records(path: str | Path, parse: Callable[[dict], T]) -> list[T]:
    """Every record of `path` through `parse` (which raises ValueError/KeyError/TypeError on a bad one)."""
    path = Path(path)
    tasks, errors = [], []
    try:
        for where, record in iter_records(path):
            try:
                if isinstance(record, Exception):
                    raise record
                if not isinstance(record, dict):
                    raise DatasetError(f"expected a JSON object, got {type(record).__name__}")
                tasks.append(parse(record))
            except KeyError as exc:
                errors.append(f"{where}: missing field {exc}")
            except (ValueError, TypeError) as exc:
                errors.append(f"{where}: {exc}")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc})") from None
    if errors:
        more = f" (and {len(errors) - MAX_REPORTED} more)" if len(errors) > MAX_REPORTED else ""
        raise DatasetError(f"{path}: {len(errors)} malformed record(s): " + "; ".join(errors[:MAX_REPORTED]) + more)
    if not tasks:
        raise DatasetError(f"{path}: no records")
    return tasks


def stable_uid(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def split_by_hash(uid: str) -> str:
    """About 1 in 8 records is held out for evaluation, decided by the uid (deterministic)."""
    return "eval" if int(hashlib.sha256(uid.encode()).hexdigest(), 16) % 8 == 0 else "train"


def require_str(record: dict, field: str) -> str:
    value = record[field]
    if not isinstance(value, str) or not value:
        raise ValueError(f"field '{field}' must be a non-empty string, got {type(value).__name__}")
    return value
