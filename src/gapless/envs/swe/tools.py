"""The swe task's tools, its prompt and its teacher (envs/swe/environment.py runs them).

The repo task's command syntax and in-session toolbox (envs/commands.py, which says what each
tool guarantees), sized for real code:

    ls [DIR]                     the files under DIR (default: the whole repository), one a line
    cat PATH [FIRST-LAST]        numbered lines of a file (default: the first `page_lines`)
    grep PATTERN                 lines matching a Python regular expression, `path:line: text`;
                                 an optional second line restricts it to a file or folder
    write PATH\\nTEXT             replace (or create) a file
    patch PATH\\nOLD\\n---\\nNEW      replace the one occurrence of OLD in the file by NEW
    run COMMAND                  a shell command in the repository (output and exit code)
    test [TEST IDS]              the repository's visible tests with its test command (-x)
    done                         end the episode; the final tree is graded

Every output is cut to `max_output_bytes` (head and tail); `cat` pages by line range and `grep`
stops after `max_matches`. `run` and `test` see the repository and its dependencies
(/work/env) on PYTHONPATH.
"""

from __future__ import annotations

from dataclasses import dataclass

from gapless.envs import commands
from gapless.envs.commands import PATCH_SEPARATOR, PLAIN, Command, Segment, TurnFormat, command_text, observe
from gapless.envs.swe.instances import SweInstance
from gapless.envs.swe.patches import apply_file_patch, parse_patch

VERBS = ("ls", "cat", "grep", "write", "patch", "run", "test", "done")
SKIP_DIRS = ("__pycache__", ".pytest_cache")  # the tools' own caches: never part of the answer
INSTRUCTIONS = """

Fix the repository in your working directory so that the issue above is resolved. One command per
turn, in <cmd>...</cmd>: ls [DIR] | cat PATH [FIRST-LAST] | grep PATTERN | write PATH, newline,
TEXT | patch PATH, newline, OLD, newline, ---, newline, NEW | run COMMAND | test [TEST IDS] | done
"""


@dataclass(frozen=True)
class ToolSizes:
    """How much a tool call may show or touch."""

    max_output_bytes: int = 2048
    max_file_bytes: int = 1 << 20
    page_lines: int = 80
    max_matches: int = 40


@dataclass(frozen=True)
class SweTask:
    uid: str
    prompt: str
    instance: SweInstance


def parse_command(turn: str) -> Command:
    """Read one model turn (envs/commands.py); untrusted: any text gives a Command."""
    command = commands.parse_command(turn, VERBS, has_ranges=True)
    if command.kind == "ls" and command.path and commands.path_problem(command.path):
        return Command("invalid", error=commands.path_problem(command.path))
    return command


def prompt_of(instance: SweInstance, turn_format: TurnFormat = PLAIN) -> str:
    return turn_format.prompt(instance.problem_statement.strip() + INSTRUCTIONS)


def request_of(command: Command, instance: SweInstance, sizes: ToolSizes, run_timeout_s: float,
               python_path: str) -> dict:  # fmt: skip
    """The toolbox request (envs/commands.py) of a parsed command."""
    base = {"op": command.kind, "run_timeout_s": run_timeout_s, "max_output_bytes": sizes.max_output_bytes,
            "max_file_bytes": sizes.max_file_bytes, "env": {"PYTHONPATH": python_path}}  # fmt: skip
    if command.kind == "ls":
        return {**base, "path": command.path, "sep": "\n"}
    if command.kind == "cat":
        first = command.first or 1
        return {**base, "path": command.path, "first": first, "last": command.last or first + sizes.page_lines - 1}
    if command.kind == "grep":
        return {**base, "pattern": command.text, "path": command.path, "max_matches": sizes.max_matches}
    if command.kind == "test":
        return {**base, "op": "run", "command": test_shell(instance, command.text)}
    if command.kind == "run":
        return {**base, "command": command.text}
    return {**base, "path": command.path, "text": command.text, "old": command.old, "new": command.new}


def test_shell(instance: SweInstance, selection: str) -> str:
    """The `test` tool's shell command: the instance's runner, quiet, stopping at a failure."""
    return f"{instance.test_command} -q -x --no-header -p no:cacheprovider {selection}".strip()


def changes_request(sizes: ToolSizes, max_files: int) -> dict:
    return {"op": "changes", "base": "/work/base", "skip_dirs": list(SKIP_DIRS), "max_files": max_files,
            "max_file_bytes": sizes.max_file_bytes, "max_output_bytes": 0, "run_timeout_s": 0}  # fmt: skip


def numbered(text: str, first: int, last: int) -> str:
    """What `cat PATH FIRST-LAST` shows of `text` (the toolbox's format, for the teacher)."""
    lines = text.splitlines()
    shown = [f"{n:>5} {lines[n - 1]}" for n in range(first, min(last, len(lines)) + 1)]
    more = f"\n[lines {first}-{min(last, len(lines))} of {len(lines)}]" if len(lines) > last or first > 1 else ""
    return "\n".join(shown) + more


def reference_turns(task: SweTask, files: dict[str, bytes], sizes: ToolSizes,
                    turn_format: TurnFormat = PLAIN) -> list[Segment]:  # fmt: skip
    """The teacher: read each hunk's lines, patch them (or write the whole file where the old
    text is not unique, or the file is new), done. The observations are the tools' own
    answers, computed on the host."""
    turns: list[Segment] = []
    for file_patch in parse_patch(task.instance.patch):
        path = file_patch.path
        if file_patch.new_path is None:  # a deletion: the shell does it
            turns += _turn(command_text("run", f"rm {path}"), "[exit 0]", sizes, turn_format)
            continue
        text = files.get(file_patch.old_path or "", b"").decode("utf-8", "replace")
        if file_patch.old_path != file_patch.new_path:
            fixed = apply_file_patch(file_patch, text)
            turns += _turn(command_text("write", path, fixed), f"wrote {path}", sizes, turn_format)
            continue
        for start, body in file_patch.hunks:
            old, new, first = _smallest_edit(text, start, body)
            last = first + max(old.count("\n"), 1) - 1
            shown = numbered(text, first, last)
            turns += _turn(command_text("cat", f"{path} {first}-{last}"), shown, sizes, turn_format)
            if old and text.count(old) == 1:
                text = text.replace(old, new, 1)
                body_text = old[:-1] + PATCH_SEPARATOR + new[:-1]
                turns += _turn(command_text("patch", path, body_text), "patched", sizes, turn_format)
            else:  # the whole file, once: the remaining hunks are in it
                text = apply_file_patch(file_patch, files[path].decode("utf-8", "replace"))
                turns += _turn(command_text("write", path, text), f"wrote {path}", sizes, turn_format)
                break
    return turns + [(command_text("done"), True)]


def _smallest_edit(text: str, start: int, body: list[str]) -> tuple[str, str, int]:
    """(old, new, first line of old) of a hunk: its changed lines alone when they are one block
    whose old text occurs once in the file (a short patch turn), else the whole hunk."""
    changed = [i for i, line in enumerate(body) if line[0] in "-+"]
    old = "".join(line[1:] + "\n" for line in body if line[0] in " -")
    new = "".join(line[1:] + "\n" for line in body if line[0] in " +")
    if changed and changed[-1] - changed[0] + 1 == len(changed):
        block = body[changed[0] : changed[-1] + 1]
        core_old = "".join(line[1:] + "\n" for line in block if line[0] == "-")
        core_new = "".join(line[1:] + "\n" for line in block if line[0] == "+")
        if core_old and core_new and text.count(core_old) == 1:  # (a pure deletion keeps its context)
            before = sum(1 for line in body[: changed[0]] if line[0] == " ")
            return core_old, core_new, start + before
    return old, new, start


def _turn(command: str, output: str, sizes: ToolSizes, turn_format: TurnFormat) -> list[Segment]:
    return [(command, True), (observe(output, sizes.max_output_bytes, turn_format), False)]
