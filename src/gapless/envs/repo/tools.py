"""The repo task's tools, its turn format and its teacher (envs/repo/environment.py runs them).

A model turn holds one command (envs/commands.py has the syntax, the toolbox every verb runs in
the session, and what each guarantees), its first line the verb:

    ls                       the repository's files
    cat PATH                 a file's text
    write PATH\\nTEXT         replace (or create) a file
    patch PATH\\nOLD\\n---\\nNEW  replace the one occurrence of OLD in the file by NEW
    run COMMAND              a shell command in the repository (output and exit code)
    test                     the visible check (`python check.py`)
    done                     end the episode; the final files are graded
"""

from __future__ import annotations

import random

from gapless.envs import commands
from gapless.envs.commands import (
    CMD_OPEN,
    PATCH_SEPARATOR,
    PLAIN,
    Command,
    Segment,
    TurnFormat,
    chat_format,
    command_text,
    observe,
    output_text,
    path_problem,
    session_code,
    shown,
)
from gapless.envs.repo.tasks import CHECK_FILE, OPERATORS, RepoTask, check_verdict

VERBS = ("ls", "cat", "write", "patch", "run", "test", "done")
__all__ = [
    "CMD_OPEN",
    "PATCH_SEPARATOR",
    "PLAIN",
    "Command",
    "TurnFormat",
    "chat_format",
    "output_text",
    "path_problem",
    "session_code",
    "shown",
]


def parse_command(turn: str) -> Command:
    """Read one model turn (envs/commands.py); untrusted: any text gives a Command."""
    return commands.parse_command(turn, VERBS)


def request_of(command: Command, run_timeout_s: float, max_output_bytes: int, max_file_bytes: int) -> dict:
    base = {
        "op": command.kind,
        "run_timeout_s": run_timeout_s,
        "max_output_bytes": max_output_bytes,
        "max_file_bytes": max_file_bytes,
    }
    if command.kind == "test":
        return {**base, "op": "run", "command": f"python {CHECK_FILE}"}
    if command.kind == "run":
        return {**base, "command": command.text}
    if command.kind == "ls":  # the whole repository, whatever follows the verb
        return base
    return {**base, "path": command.path, "text": command.text, "old": command.old, "new": command.new}


def solution_text(task: RepoTask) -> str:
    """The ideal transcript as one text (the reference solution; trains a fresh tokenizer)."""
    return "".join(text for text, _ in ideal_transcript(task))


def ideal_transcript(task: RepoTask, max_output_bytes: int = 1 << 16, turn_format: TurnFormat = PLAIN) -> list[Segment]:
    """Read the module, patch the broken line, run the check, done."""
    fixed = task.fixed_files
    return [
        (command_text("cat", task.path), True),
        (observe(task.files[task.path], max_output_bytes, turn_format), False),
        (command_text("patch", task.path, task.broken_line + PATCH_SEPARATOR + task.fixed_line), True),
        (observe("patched", max_output_bytes, turn_format), False),
        (command_text("test"), True),
        (observe(_check_output(task, fixed), max_output_bytes, turn_format), False),
        (command_text("done"), True),
    ]


def demonstration(
    task: RepoTask,
    rng: random.Random,
    skip_frac: float,
    typo_frac: float,
    max_output_bytes: int = 1 << 16,
    turn_format: TurnFormat = PLAIN,
) -> list[Segment]:
    """One transcript from the imperfect teacher: with `skip_frac` it patches a guessed line
    without reading (a random operator: a bug's real line only by chance, never a missing
    body), with `typo_frac` it reads, then writes a wrong operator; after a failed patch or
    check it gives up (`done`)."""
    draw = rng.random()
    if draw >= skip_frac + typo_frac:
        return ideal_transcript(task, max_output_bytes, turn_format)
    if draw < skip_frac:
        guess = task.function.line(rng.choice([o for o in OPERATORS if o != task.function.operator]))
        patch = command_text("patch", task.path, guess + PATCH_SEPARATOR + task.fixed_line)
        if guess == task.broken_line:  # a lucky guess: the patch applies
            verdict = _check_output(task, task.fixed_files)
            return [
                (patch, True),
                (observe("patched", max_output_bytes, turn_format), False),
                (command_text("test"), True),
                (observe(verdict, max_output_bytes, turn_format), False),
                (command_text("done"), True),
            ]
        refused = f"the old text occurs 0 times in {task.path}; it must occur once"
        return [(patch, True), (observe(refused, max_output_bytes, turn_format), False), (command_text("done"), True)]
    wrong = rng.choice([o for o in OPERATORS if o != task.function.operator])
    typo_line = task.function.line(wrong)
    typo_files = {**task.files, task.path: task.files[task.path].replace(task.broken_line, typo_line, 1)}
    return [
        (command_text("cat", task.path), True),
        (observe(task.files[task.path], max_output_bytes, turn_format), False),
        (command_text("patch", task.path, task.broken_line + PATCH_SEPARATOR + typo_line), True),
        (observe("patched", max_output_bytes, turn_format), False),
        (command_text("test"), True),
        (observe(_check_output(task, typo_files), max_output_bytes, turn_format), False),
        (command_text("done"), True),
    ]


def _check_output(task: RepoTask, files: dict[str, str]) -> str:
    return check_verdict(files, task.visible) + "[exit 0]"
