"""The SWE environment (`task.name = 'swe'`): fix a real repository with tools, graded by its tests.

Instances come from `task.path` (envs/swe/instances.py: SWE-bench's field names, the repository
as a local folder or tarball). An episode (envs/episode.py) per rollout; per turn, for every
unfinished episode at once (envs/turns.py drives them, as for `repo`):

    generator ──> parse the command (envs/swe/tools.py)
        done, or no <cmd>  ──> the episode ends
        invalid            ──> <out>the reason</out>, next turn
        a tool             ──> run in the episode's own sandbox session, whose /work/session is a
                               copy-on-write view of the instance's snapshot (sandbox/cow.py),
                               <out>...</out> (loss-masked)
    after `max_turns` model turns the episode ends (the last command still runs)

At its end the session reports its changes against the snapshot (changed and deleted files,
untrusted: checked on the host) and is closed; its grading starts at once, in a fresh sandbox
job (envs/swe/grading.py: the snapshot, the changes, the test patch; SWE-bench's rule), and
`to_rollout` waits for it. The
hidden tests and the reference patch are never in the session: the snapshot lacks the former,
the latter stays on the host. Statuses:
    ok            resolved (reward 1)
    tests_failed  not resolved (reward 0, or the partial credit); `info` names failing tests
    tool_error    the session's slot failed after the model's code had run in it: reward 0
    infra_error   the host saw the sandbox fail before any of the model's code ran, or the
                  grading job could not run (after the pool's retry): no reward
`info["ended_by"]`: done, no_command, turn_limit; `info["changed_files"]`. Model output is
untrusted: every path above is a status or an observation, never an exception.
Not guaranteed: suspend/resume (episodes run to their end in one session); that the instance's
tests pin down the fix (a set's quality is its builder's).
"""

from __future__ import annotations

import hashlib
import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Callable, Sequence

from gapless.envs.base import Generator, Split, check_infra
from gapless.envs.code.environment import SandboxUnavailable
from gapless.envs.commands import PLAIN, TurnFormat, observe, path_problem
from gapless.envs.episode import Episode
from gapless.envs.session_calls import call, close_session, tool_text
from gapless.envs.swe.grading import Changes, Grade, GradeRules, grade
from gapless.envs.swe.instances import SweInstance
from gapless.envs.swe.snapshots import SnapshotStore
from gapless.envs.swe.testrun import DEFAULT_LIMITS, load_env
from gapless.envs.swe.tools import (
    SweTask,
    ToolSizes,
    changes_request,
    parse_command,
    prompt_of,
    reference_turns,
    request_of,
)
from gapless.envs.turns import run_waves
from gapless.sandbox import SandboxLimits, Status
from gapless.types import Completion, Rollout, SamplingParams

MAX_CHANGED_FILES = 256  # files an episode may change; more makes its tree ungradable (reward 0)
RUN_MARGIN_S = 1.0  # a run command's deadline is the tool call's minus this
SESSION_OUTPUT_BYTES = 64 << 20  # a session's stdout cap: the changes of a whole episode come back through it
STATE_CHANGING = ("write", "patch", "run", "test")  # tools that may change the session's tree
GRADE_ROOM_MB = 256  # a grading job's /tmp holds its checkout of the repository besides the tests' own files


class SweEnvironment:
    name = "swe"

    def __init__(
        self,
        sandbox,
        tasks: dict[str, Sequence[SweTask]],
        limits: SandboxLimits,
        grade_limits: SandboxLimits = DEFAULT_LIMITS,
        rules: GradeRules = GradeRules(),
        sizes: ToolSizes = ToolSizes(),
        max_turns: int = 8,
        sessions: int = 8,
        idle_timeout_s: float = 600.0,
        turn_format: TurnFormat = PLAIN,
    ):
        self.sandbox, self._tasks, self.limits, self.grade_limits = sandbox, tasks, limits, grade_limits
        self.rules, self.sizes, self.max_turns, self.sessions = rules, sizes, max_turns, sessions
        self.idle_timeout_s, self.turn_format = idle_timeout_s, turn_format
        self.snapshots = SnapshotStore()
        self.pool = ThreadPoolExecutor(max_workers=sessions, thread_name_prefix="swe")
        # grading jobs, apart from the tool threads (the reference loop's to_rollout waits on
        # them from `pool`); the sandbox's admission bounds the jobs running at once
        self.grader = ThreadPoolExecutor(max_workers=sessions, thread_name_prefix="swe-grade")

    def tasks(self, split: Split) -> Sequence[SweTask]:
        return self._tasks[split]

    # -- the teacher (warm start) ----------------------------------------------------------------

    def reference(self, task: SweTask) -> str:
        return "".join(text for text, _ in self.demonstration_turns(task, random.Random(0)))

    def demonstration_turns(self, task: SweTask, rng: random.Random) -> list[tuple[str, bool]]:
        return reference_turns(task, self.snapshots.get(task.instance).files, self.sizes, self.turn_format)

    def demonstration(self, task: SweTask, rng: random.Random) -> str:
        return "".join(text for text, _ in self.demonstration_turns(task, rng))

    def metrics(self) -> dict[str, float]:
        return self.sandbox.metrics()

    def max_context_tokens(self, prompt_tokens: int, max_new_tokens: int) -> int:
        output_tokens = len(self.turn_format.reply("").encode()) + self.sizes.max_output_bytes
        return prompt_tokens + self.max_turns * max_new_tokens + (self.max_turns - 1) * output_tokens

    # -- the multi-turn path -------------------------------------------------------------------

    def rollout_groups(
        self,
        generator: Generator,
        tasks: Sequence[SweTask],
        group_size: int,
        params: SamplingParams | Sequence[SamplingParams],
        encode: Callable[[str], list[int]],
    ) -> list[list[Rollout]]:
        return run_waves(self, generator, tasks, group_size, params, encode, self.pool)

    def start_episode(self, task: SweTask, prompt_ids: list[int]) -> Episode:
        return Episode(task, list(prompt_ids))

    def take_turn(self, episode: Episode, completion: Completion, encode: Callable[[str], list[int]]) -> None:
        episode.add_model_turn(completion)
        command = parse_command(completion.text)
        if command.kind in ("done", "none"):
            self._end(episode, "done" if command.kind == "done" else "no_command")
            return
        output = self._tool(episode, command)
        if command.kind in STATE_CHANGING and completion.versions:  # the version that last wrote the tree
            episode.state_version = completion.versions[-1]
        if episode.is_done:
            return
        if episode.turns >= self.max_turns:
            self._end(episode, "turn_limit")
        else:
            episode.add_environment_text(output, encode(output))

    def _tool(self, episode: Episode, command) -> str:
        if command.kind == "invalid":
            return observe(f"error: {command.error}", self.sizes.max_output_bytes, self.turn_format)
        episode.info["tool_calls"] = episode.info.get("tool_calls", 0) + 1
        snapshot = self.snapshots.get(episode.task.instance)
        run_timeout_s = max(self.limits.timeout_s - RUN_MARGIN_S, 0.1)
        request = request_of(command, episode.task.instance, self.sizes, run_timeout_s, snapshot.python_path)
        result = self._call(episode, request)
        if result is None:
            return ""
        return observe(tool_text(result), self.sizes.max_output_bytes, self.turn_format)

    def _call(self, episode: Episode, request: dict):
        """One request in the episode's session (opened on first use); None when the session
        failed, which ends the episode (infra_error or tool_error, envs/session_calls.py)."""
        return call(episode, self._open, request)

    def _open(self, episode: Episode) -> None:
        base = self.snapshots.get(episode.task.instance).base
        episode.session = self.sandbox.open_session(self.limits, self.idle_timeout_s, base=base)

    def _end(self, episode: Episode, ended_by: str) -> None:
        """Collect the session's changes, close it and start grading them (on the grader's
        threads, so that an episode is graded as soon as it ends, while others still run and
        a group's episodes are graded at once); `to_rollout` waits for the grade."""
        changes: Changes | None = Changes({})  # no tool ran: the snapshot as it is
        if episode.session is not None:
            result = self._call(episode, changes_request(self.sizes, MAX_CHANGED_FILES))
            if result is None:
                return
            changes = _changes(result.stdout if result.status is Status.OK else "", self.sizes.max_file_bytes)
            close_session(episode)
        grading = None if changes is None else self.grader.submit(self._graded, episode.task.instance, changes)
        episode.finish("pending", ended_by=ended_by, grading=grading)

    def _graded(self, instance: SweInstance, changes: Changes) -> tuple[Grade, int]:
        return self.grade(instance, changes), len(changes.changed)

    def discard(self, episode: Episode) -> None:
        close_session(episode)
        grading = episode.info.pop("grading", None)
        if grading is not None:
            grading.cancel()

    def to_rollout(self, episode: Episode) -> Rollout:
        if not episode.is_done:
            self._end(episode, "turn_limit")
        grading = episode.info.pop("grading", None)
        if episode.status == "pending":
            if grading is None:  # the session could not say what changed: nothing to grade
                episode.finish("tests_failed", 0.0, changes="unreadable")
            else:
                result, changed_files = grading.result()
                episode.finish(result.status, result.reward, **result.info, changed_files=changed_files)
        info = {**episode.info, "turns": episode.turns, "transcript": "".join(episode.texts)[-500:]}
        return Rollout(episode.task.uid, episode.to_completion(), episode.reward, episode.status, info)

    def grade(self, instance: SweInstance, changes: Changes):
        """The agent's tree graded in a fresh job (envs/swe/grading.py)."""
        snapshot = self.snapshots.get(instance)
        env = load_env(instance.env_path) if instance.env_path is not None else None
        return grade(self.sandbox, instance, snapshot.files, changes, env, self.grade_limits, self.rules)

    # -- the single-turn protocol --------------------------------------------------------------

    def score_groups(self, tasks, groups):
        raise TypeError(
            "the swe task is multi-turn: drive it with rollout_groups (the run loop picks the inline source for it)"
        )

    @staticmethod
    def check_infra(rollouts: list[Rollout]) -> int:
        return check_infra(
            rollouts, "; run `gapless sandbox check`", "swe episode of this step failed", SandboxUnavailable
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.grader.shutdown(wait=True)
        self.sandbox.close()
        self.snapshots.close()


def _changes(stdout: str, max_file_bytes: int) -> Changes | None:
    """The changes a `changes` call printed (untrusted: anything printed before is ignored; a
    name that is not a plain relative path is dropped). None: no readable answer, or more
    changes than can be graded."""
    try:
        value = json.loads(stdout.rsplit("\n", 1)[-1])
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("changed"), dict):
        return None
    deleted = value.get("deleted")
    if not isinstance(deleted, list):
        return None

    def is_plain(path) -> bool:
        return isinstance(path, str) and not path_problem(path) and str(PurePosixPath(path)) == path

    changed = {
        path: text.encode("utf-8", "replace")
        for path, text in value["changed"].items()
        if is_plain(path) and isinstance(text, str) and len(text.encode("utf-8", "replace")) <= max_file_bytes
    }
    return Changes(changed, tuple(p for p in deleted if is_plain(p)))


def split_instances(instances: Sequence[SweInstance], eval_frac: float) -> dict[str, list[SweInstance]]:
    """Train and eval by a hash of `instance_id` (stable as the file grows); at least one held
    out; a single instance serves both."""
    if len(instances) == 1:
        return {"train": list(instances), "eval": list(instances)}
    ranked = sorted(instances, key=lambda i: hashlib.sha256(i.instance_id.encode()).hexdigest())
    held = set(id(i) for i in ranked[: max(1, round(eval_frac * len(instances)))])
    return {
        "train": [i for i in instances if id(i) not in held],
        "eval": [i for i in instances if id(i) in held],
    }


def make_swe_environment(cfg) -> SweEnvironment:
    """The environment of `task.name = "swe"`: instances from `task.path` (default: the default
    set, envs/swe/default_set.py), [swe] settings,
    copy-on-write sessions and grading jobs in a bubblewrap sandbox (needs root)."""
    from gapless.config import ConfigError
    from gapless.envs.swe.instances import load_instances
    from gapless.envs.swe.testrun import pytest_args
    from gapless.sandbox import open_sandbox

    s = cfg.swe
    path = cfg.task.path
    if path is None:  # the default set that scripts/setup.sh builds
        from gapless.envs.swe.default_set import default_instances_path

        path = default_instances_path()
        if not path.is_file():
            raise ConfigError(
                f"task.path: no instances file given and the default SWE set is not built ({path} is missing): "
                "run scripts/setup.sh (or `gapless swe build --default`), or set task.path to a JSONL file"
            )
    instances = load_instances(path)[: s.max_instances]
    for instance in instances:
        try:
            pytest_args(instance.test_command)
        except ValueError as exc:
            raise ConfigError(f"task.path: instance {instance.instance_id!r}: {exc}") from None
    limits = SandboxLimits(
        timeout_s=s.timeout_s, memory_mb=s.memory_mb, max_processes=cfg.sandbox.max_processes,
        tmp_size_mb=s.disk_mb, max_output_bytes=SESSION_OUTPUT_BYTES,
    )  # fmt: skip
    grade_limits = replace(
        DEFAULT_LIMITS, timeout_s=s.grade_timeout_s, memory_mb=s.memory_mb, tmp_size_mb=s.disk_mb + GRADE_ROOM_MB
    )
    sandbox = open_sandbox(limits, cfg.sandbox.python, mode="bwrap", max_concurrency=s.sessions)
    turn_format = PLAIN
    if cfg.model.path is not None:
        from transformers import AutoTokenizer

        from gapless.envs.commands import chat_format

        turn_format = chat_format(AutoTokenizer.from_pretrained(cfg.model.path))
    tasks = {
        split: [SweTask(i.instance_id, prompt_of(i, turn_format), i) for i in chosen]
        for split, chosen in split_instances(instances, s.eval_frac).items()
    }
    rules = GradeRules(s.reward == "partial", s.skip_is_failure, s.protect_tests)
    sizes = ToolSizes(s.max_output_bytes, s.max_file_bytes, s.page_lines, s.max_matches)
    return SweEnvironment(sandbox, tasks, limits, grade_limits, rules, sizes, s.max_turns, s.sessions,
                          turn_format=turn_format)  # fmt: skip
