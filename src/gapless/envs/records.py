"""Read task records from a JSONL or Parquet file, with every bad record named by file and line.

`load_records(path, parse)` reads every record (a JSON object per line, or a Parquet row), turns
each into a task with `parse(record)`, and either returns all of them or raises `DatasetError`,
whose message is one line that starts with the first bad record's place and says what is wrong
and how to fix it ("data.jsonl:17: missing field 'prompt'; add it (schema: docs/environments.md)"),
followed by the next few bad records and a count. A bad record never disappears silently and never
shortens the data set: the run stops before it starts, and the CLI prints `gapless: error: ...`
and exits with code 2 (`DatasetError` is a `ConfigError`: the file is the user's to fix).
Rules beyond the schema of each record:
    - uids are unique in a file: a second record with a uid already used is refused, naming both
      lines (a duplicate uid would let one problem's grading or statistics stand for another's);
    - identical records are refused too, naming both lines (without a uid both would get the
      same default uid and count as one problem): remove one, or give each its own uid;
    - the file is UTF-8: a line that is not is reported by its line and column, not a byte offset;
    - blank JSONL lines are skipped; a UTF-8 byte-order mark on the first line is ignored.
`split_by_hash` gives records without an explicit split a deterministic one.
Not guaranteed: that the tasks are solvable, or that two records with different uids are not the
same problem in other words.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from gapless.config import ConfigError

T = TypeVar("T")
MAX_REPORTED = 5
SCHEMA_HINT = "schema: docs/environments.md"


class DatasetError(ConfigError):
    """A data file the user must fix: one line, `file:line: what is wrong; how to fix it`."""


class _BadRecord(ValueError):
    """One record's problem, before it is given its place in the file."""


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(place, record) for each record; a record that cannot even be read comes back as an exception."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # noqa: BLE001 -- pyarrow's errors have no common base worth naming
            raise DatasetError(
                f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc}); "
                "write it with pyarrow or pandas .to_parquet()"
            ) from None
        for row, record in enumerate(rows, start=1):
            yield f"{path}:row {row}", record
        return
    with path.open("rb") as fh:  # bytes, so that a bad encoding is found per line, not per buffer
        for number, raw in enumerate(fh, start=1):
            where = f"{path}:{number}"
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                column = len(raw[: exc.start].decode("utf-8", errors="replace")) + 1
                yield (
                    where,
                    _BadRecord(f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {column}); save the file as UTF-8"),
                )
                continue
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                yield (
                    where,
                    _BadRecord(f"not JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object"),
                )


def load_records(path: str | Path, parse: Callable[[dict], T]) -> list[T]:
    """Every record of `path` through `parse` (which raises ValueError/KeyError/TypeError on a bad one);
    parsed tasks must have a `uid`."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(
            f"{path}: no such data file; check task.path (relative paths start at the working directory)"
        )
    tasks: list[T] = []
    errors: list[str] = []
    first_seen: dict[str, tuple[str, Any]] = {}  # uid -> (place, record) of its first record
    for where, record in iter_records(path):
        try:
            if isinstance(record, Exception):
                raise record
            if not isinstance(record, dict):
                raise _BadRecord(
                    f"expected a JSON object, got {type(record).__name__}; each record must be one {{...}}"
                )
            task = parse(record)
        except KeyError as exc:
            errors.append(f"{where}: missing field {exc}; add it ({SCHEMA_HINT})")
            continue
        except (ValueError, TypeError) as exc:
            errors.append(f"{where}: {exc}")
            continue
        uid = task.uid  # type: ignore[attr-defined]
        if uid in first_seen:
            errors.append(f"{where}: {_duplicate(uid, record, *first_seen[uid])}")
            continue
        first_seen[uid] = (where, record)
        tasks.append(task)
    if errors:
        shown = "; ".join(errors[:MAX_REPORTED])
        more = f", {MAX_REPORTED} shown" if len(errors) > MAX_REPORTED else ""
        raise DatasetError(f"{shown} ({len(errors)} bad record(s) in {path.name}{more}; nothing was loaded)")
    if not tasks:
        raise DatasetError(f"{path}: no records; write one JSON object per line ({SCHEMA_HINT})")
    return tasks


def _duplicate(uid: str, record: dict, first_where: str, first_record: dict) -> str:
    if record == first_record:
        return f"the same record as {first_where}; remove one of them (a copy would count one problem twice)"
    if "uid" in record:
        return f"uid {uid!r} is already used by {first_where}; give each record its own uid"
    return (
        f"gets the same default uid {uid!r} as {first_where} (no 'uid' field, so the uid is derived from the prompt); "
        "add a distinct 'uid' to each"
    )


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
