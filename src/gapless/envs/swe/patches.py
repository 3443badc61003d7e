"""Unified diffs over repository trees (relative path -> text): parse, apply, make.

The instance's `patch` and `test_patch` (trusted: they come from the task file) are applied to
trees on the host, as `git apply` would: each hunk's context and removed lines must match the
file at the hunk's line, or at the nearest place where they do (an offset, as `patch` allows
after earlier edits). `/dev/null` creates or deletes a file.

Guaranteed: `apply_patch` returns a new tree or raises `PatchError` naming the file and the
hunk; it never writes outside the tree (a path with `..` or a leading `/` is refused).
NOT handled: binary patches, renames and mode changes (git's extended headers are skipped),
fuzzy matching of changed context.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Mapping

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patch that does not parse or does not apply; the message names the file."""


@dataclass
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[tuple[int, list[str]]] = field(default_factory=list)  # (old start, lines with ' ', '-', '+')

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


def parse_patch(text: str) -> list[FilePatch]:
    """The file patches of a unified diff (git's or plain `diff -u`'s)."""
    patches: list[FilePatch] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            current = FilePatch(_name(lines[i][4:]), _name(lines[i + 1][4:]))
            patches.append(current)
            i += 2
            while i < len(lines) and (match := _HUNK.match(lines[i])):
                old_count = int(match.group(2) or 1) if match.group(2) != "0" else 0
                new_count = int(match.group(4) or 1) if match.group(4) != "0" else 0
                body: list[str] = []
                i += 1
                while (old_count > 0 or new_count > 0) and i < len(lines):
                    line = lines[i] or " "  # an empty context line lost its space
                    if line.startswith("\\"):
                        i += 1
                        continue
                    if line[0] not in " -+":
                        raise PatchError(f"{current.path}: a hunk line starts with {line[:1]!r}")
                    old_count -= line[0] in " -"
                    new_count -= line[0] in " +"
                    body.append(line)
                    i += 1
                current.hunks.append((int(match.group(1)), body))
            continue
        i += 1
    if not patches:
        raise PatchError("no file in the patch (expected '--- a/PATH' and '+++ b/PATH' lines)")
    return patches


def apply_patch(tree: Mapping[str, str], text: str) -> dict[str, str]:
    """`tree` with the patch applied (a new dict)."""
    out = dict(tree)
    for patch in parse_patch(text):
        if patch.new_path is None:
            if patch.old_path not in out:
                raise PatchError(f"{patch.old_path}: deleted by the patch but not in the tree")
            del out[patch.old_path]
            continue
        source = "" if patch.old_path is None else out.get(patch.old_path)
        if source is None:
            raise PatchError(f"{patch.old_path}: patched but not in the tree")
        out[patch.new_path] = apply_file_patch(patch, source)
        if patch.old_path not in (None, patch.new_path):
            del out[patch.old_path]
    return out


def make_patch(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    """The unified diff from `before` to `after` (git's a/ b/ prefixes)."""
    out: list[str] = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        diff = difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            (new or "").splitlines(keepends=True),
            "/dev/null" if old is None else f"a/{path}",
            "/dev/null" if new is None else f"b/{path}",
        )
        out += [line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in diff]
    return "".join(out)


def _name(header: str) -> str | None:
    name = header.split("\t")[0].strip()
    if name == "/dev/null":
        return None
    if name[:2] in ("a/", "b/"):
        name = name[2:]
    if not name or name.startswith("/") or ".." in PurePosixPath(name).parts:
        raise PatchError(f"{name!r}: a patched path must be relative and stay in the repository")
    return name


def apply_file_patch(patch: FilePatch, source: str) -> str:
    """`source` (the old file's text) with one file's hunks applied."""
    lines = source.splitlines(keepends=True)
    has_final_newline = source.endswith("\n") or not source
    offset = 0
    for number, (start, body) in enumerate(patch.hunks, 1):
        old = [line[1:] for line in body if line[0] in " -"]
        new = [line[1:] for line in body if line[0] in " +"]
        at = _find(lines, old, max(start - 1 + offset, 0) if old else start + offset)
        if at is None:
            raise PatchError(f"{patch.path}: hunk {number} (line {start}) does not match the file")
        lines[at : at + len(old)] = [line + "\n" for line in new]
        offset += len(new) - len(old)
    text = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    return text if has_final_newline or not text else text[:-1]


def _find(lines: list[str], old: list[str], guess: int) -> int | None:
    """Where `old` (without line ends) sits in `lines`, nearest to `guess` first."""
    stripped = [line.rstrip("\n") for line in lines]
    if not old:
        return min(guess, len(lines))
    for distance in range(len(lines) + 1):
        for at in (guess - distance, guess + distance):
            if 0 <= at <= len(lines) - len(old) and stripped[at : at + len(old)] == old:
                return at
    return None
