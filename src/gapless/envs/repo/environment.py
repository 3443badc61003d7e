"""The coding-agent environment (`task.name = 'repo'`): fix a generated repository with tools.

An episode (envs/episode.py) per rollout; per turn, for every unfinished episode at once:

    generator.generate(contexts) ──> parse the command (envs/repo/tools.py)
        done, or no <cmd>     ──> the episode ends
        invalid               ──> <out>the reason</out>, next turn
        ls/cat/write/patch/run/test ──> run it in the episode's own sandbox session (thread
                                       pool, `sessions` at once), <out>...</out> (loss-masked)
    after `max_turns` model turns the episode ends (the last command still runs)

At its end the session's final files are collected (regular files only) and the session closed;
then the episode is graded in a fresh sandbox job, as a judged job (envs/code/environment.py): the files go
to /work/job/repo, the hidden tests' calls to the judge's private directory, which the
candidate's process (where the repository's code runs) cannot see; the expected values never
enter the sandbox: the host compares the reported results. So nothing the model did in its
session (editing check.py, planting links, leaving processes) reaches the grade.

reward = fraction of hidden tests passing. Statuses:
    ok            every hidden test passes
    tests_failed  some fail (`info["passed"]` of `info["hidden"]`); the grading job's own limit
                  status, if any, is `info["grade_status"]`
    tool_error    the session's slot failed after the model's code had run in it (a death
                  its code could have caused; `info["tool_status"]` crashed): reward 0, the
                  files are lost with the session, nothing is graded
    infra_error   the host saw the sandbox fail before any of the model's code ran (a session
                  could not start or be seeded, or the host closed it), or the grading job could
                  not run, after one retry: no reward, excluded from group statistics; never for
                  anything the repository's code does while graded (sandbox/result.py): a
                  grading job it killed is `tests_failed` with reward 0 (`grade_status` killed)
`info["ended_by"]`: done, no_command (a turn without <cmd>), turn_limit. A tool call that hits a
session limit (timeout, output flood, memory) is shown to the model as an error and the episode
goes on: the files survive, the next call gets a fresh live process. Model output is untrusted:
every path above is a status or an observation, never an exception.
Not guaranteed: suspend/resume (the tool_use environment has it; here episodes run to their end
in one session), or that hidden tests cover every behaviour (five calls per repository).
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import PurePosixPath
from typing import Callable, Sequence

from gapless.config import Config
from gapless.envs.base import Generator, Split, check_infra
from gapless.envs.code.environment import HARNESSES, JUDGE_FILES, JUDGED, SandboxUnavailable, parse_report
from gapless.envs.episode import Episode
from gapless.envs.repo.tasks import RepoTask, generate_repo_tasks
from gapless.envs.repo.tools import (
    PLAIN,
    Command,
    TurnFormat,
    chat_format,
    demonstration,
    observe,
    parse_command,
    path_problem,
    request_of,
    session_code,
    solution_text,
)
from gapless.envs.session_calls import call, close_session, tool_text
from gapless.envs.turns import ToolLatency, run_waves
from gapless.sandbox import SandboxError, SandboxLimits, Status, open_sandbox
from gapless.sandbox.frames import clean_text
from gapless.types import Completion, Rollout, SamplingParams

# The candidate's module in the grading job (trusted, the host's): it imports the repository's
# modules on demand, so that one entry point answers every hidden call.
GRADING_SHIM = """\
import importlib
import sys

sys.path.insert(0, "/work/job/repo")


def call(module, function, *args):
    return getattr(importlib.import_module(module), function)(*args)
"""
MAX_FILES = 64  # files collected for grading
RUN_MARGIN_S = 1.0  # a run command's deadline is the tool call's minus this


class RepoEnvironment:
    name = "repo"

    def __init__(
        self,
        sandbox,
        tasks: dict[str, Sequence[RepoTask]],
        limits: SandboxLimits,
        max_turns: int = 5,
        max_output_bytes: int = 160,
        max_file_bytes: int = 4096,
        sessions: int = 8,
        skip_frac: float = 0.0,
        typo_frac: float = 0.0,
        idle_timeout_s: float = 300.0,
        turn_format: TurnFormat = PLAIN,
        latency_s: float = 0.0,
        latency_sigma: float = 0.0,
    ):
        self.sandbox, self._tasks, self.limits = sandbox, tasks, limits
        self.latency = ToolLatency(latency_s, latency_sigma)
        self.max_turns, self.max_output_bytes, self.max_file_bytes = max_turns, max_output_bytes, max_file_bytes
        self.sessions, self.idle_timeout_s = sessions, idle_timeout_s
        self.skip_frac, self.typo_frac = skip_frac, typo_frac
        self.turn_format = turn_format  # tasks' prompts are already framed by it (make_repo_environment)
        self.pool = ThreadPoolExecutor(max_workers=sessions, thread_name_prefix="repo")

    def tasks(self, split: Split) -> Sequence[RepoTask]:
        return self._tasks[split]

    # -- the teacher (warm start) ----------------------------------------------------------------

    def reference(self, task: RepoTask) -> str:
        return solution_text(task)

    def demonstration_turns(self, task: RepoTask, rng: random.Random) -> list[tuple[str, bool]]:
        return demonstration(task, rng, self.skip_frac, self.typo_frac, self.max_output_bytes, self.turn_format)

    def demonstration(self, task: RepoTask, rng: random.Random) -> str:
        return "".join(text for text, _ in self.demonstration_turns(task, rng))

    def metrics(self) -> dict[str, float]:
        return self.sandbox.metrics()

    def max_context_tokens(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The prompt, every turn, and every output between (a byte is at most one token)."""
        output_tokens = len(self.turn_format.reply("").encode()) + self.max_output_bytes
        return prompt_tokens + self.max_turns * max_new_tokens + (self.max_turns - 1) * output_tokens

    # -- the multi-turn path -------------------------------------------------------------------

    def rollout_groups(
        self,
        generator: Generator,
        tasks: Sequence[RepoTask],
        group_size: int,
        params: SamplingParams | Sequence[SamplingParams],
        encode: Callable[[str], list[int]],
    ) -> list[list[Rollout]]:
        """The reference loop: lock-step waves of `sessions` episodes (envs/turns.py)."""
        return run_waves(self, generator, tasks, group_size, params, encode, self.pool)

    def start_episode(self, task: RepoTask, prompt_ids: list[int]) -> Episode:
        return Episode(task, list(prompt_ids))

    def take_turn(self, episode: Episode, completion: Completion, encode: Callable[[str], list[int]]) -> None:
        """One model turn: end the episode (done, no command) or run its command in the
        episode's session and append the output; past `max_turns` the episode ends."""
        episode.add_model_turn(completion)
        command = parse_command(completion.text)
        if command.kind in ("done", "none"):
            self._end(episode, "done" if command.kind == "done" else "no_command")
            return
        output = self._tool(episode, command)
        if episode.is_done:  # the session failed under it
            return
        if episode.turns >= self.max_turns:
            self._end(episode, "turn_limit")  # nobody would read the output
        else:
            episode.add_environment_text(output, encode(output))

    def _tool(self, episode: Episode, command: Command) -> str:
        """Run one command; the text to append (the episode ends if its session fails)."""
        if command.kind == "invalid":
            return self._observe(f"error: {command.error}")
        self.latency.wait()  # an added tool latency (benchmarks): a remote tool, no CPU
        episode.info["tool_calls"] = episode.info.get("tool_calls", 0) + 1
        run_timeout_s = max(self.limits.timeout_s - RUN_MARGIN_S, 0.1)
        request = request_of(command, run_timeout_s, self.max_output_bytes, self.max_file_bytes)
        if command.kind == "write" and len(command.text.encode("utf-8", "surrogatepass")) > self.max_file_bytes:
            return self._observe(f"refused: the file would be larger than {self.max_file_bytes} bytes")
        result = self._call(episode, request)
        if result is None:
            return ""
        return self._observe(tool_text(result))

    def _observe(self, text: str) -> str:
        return observe(text, self.max_output_bytes, self.turn_format)

    def _call(self, episode: Episode, request: dict):
        """One request in the episode's session (opened and seeded on first use); None when the
        session failed, which ends the episode (infra_error or tool_error, envs/session_calls.py)."""
        return call(episode, self._open, request)

    def _open(self, episode: Episode) -> None:
        episode.session = self.sandbox.open_session(self.limits, self.idle_timeout_s)
        seeded = episode.session.run(
            session_code({"op": "seed", "files": episode.task.files, "max_file_bytes": self.max_file_bytes})
        )
        if seeded.status is not Status.OK:  # the host's own code, before any of the model's
            raise SandboxError(f"seeding the repository failed: {seeded.status.value} {clean_text(seeded.stderr, 200)}")

    def _end(self, episode: Episode, ended_by: str) -> None:
        """Collect the final files and close the session; grading comes in `to_rollout`."""
        files = dict(episode.task.files)  # no tool ran: the repository as it was given
        if episode.session is not None:
            result = self._call(
                episode, {"op": "collect", "max_files": MAX_FILES, "max_file_bytes": self.max_file_bytes}
            )
            if result is None:
                return
            files = _collected(result.stdout, self.max_file_bytes)
            close_session(episode)
        episode.finish("pending", ended_by=ended_by, final_files=files)

    def discard(self, episode: Episode) -> None:
        """An episode the run no longer needs (its group was cut): close its session."""
        close_session(episode)

    def to_rollout(self, episode: Episode) -> Rollout:
        """Grade a finished episode (one still running ends at its turn limit)."""
        if not episode.is_done:
            self._end(episode, "turn_limit")
        files = episode.info.pop("final_files", None)
        if episode.status == "pending":
            reward, status, info = self.grade(episode.task, files)
            episode.finish(status, reward, **info)
        info = {**episode.info, "turns": episode.turns, "transcript": "".join(episode.texts)[-500:]}
        return Rollout(episode.task.uid, episode.to_completion(), episode.reward, episode.status, info)

    def grade(self, task: RepoTask, files: dict[str, str]) -> tuple[float, str, dict]:
        """Run the hidden tests on `files` in a fresh judged job; (reward, status, info)."""
        job = {
            "harness.py": HARNESSES["io"],
            **JUDGE_FILES,
            "solution.py": GRADING_SHIM,
            "judge/tests.json": json.dumps([[t.module, t.function, *t.args] for t in task.hidden]),
        }
        job.update({f"repo/{path}": text for path, text in files.items()})
        expected = tuple(json.dumps(t.expected, sort_keys=True) for t in task.hidden)
        for _attempt in range(2):
            result = self.sandbox.run_python(job, "harness.py", ["call"], self.limits, judged=JUDGED)
            if result.status is not Status.INFRA_ERROR:
                break
        if result.status is Status.INFRA_ERROR:
            return 0.0, "infra_error", {"error": result.stderr.strip()[:300] + " (run `gapless sandbox check`)"}
        passed = parse_report(result.report, expected).passed if result.status is not Status.KILLED else 0
        info = {"passed": passed, "hidden": len(expected)}
        if result.status not in (Status.OK, Status.NONZERO_EXIT):
            info["grade_status"] = result.status.value  # killed: the repository's code did it, scored 0
        return passed / len(expected), "ok" if passed == len(expected) else "tests_failed", info

    # -- the single-turn protocol --------------------------------------------------------------

    def score_groups(self, tasks: Sequence[RepoTask], groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        """Not available: a transcript cannot be graded without the session its commands ran
        in. Raised loudly, since a caller here has taken the single-turn path by mistake."""
        raise TypeError(
            "the repo task is multi-turn: drive it with rollout_groups (the run loop picks the inline source for it); "
            "a single-turn path (generate + score_groups) would grade repositories no tool has touched"
        )

    @staticmethod
    def check_infra(rollouts: list[Rollout]) -> int:
        return check_infra(
            rollouts, "; run `gapless sandbox check`", "repo episode of this step failed", SandboxUnavailable
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.sandbox.close()


def _collected(stdout: str, max_file_bytes: int) -> dict[str, str]:
    """The files a `collect` call printed (untrusted: whatever the session printed before is
    ignored, a name that is not a plain relative path is dropped, a lone surrogate in a text is
    replaced: it could not be written into the grading job)."""
    try:
        value = json.loads(stdout.rsplit("\n", 1)[-1])
    except (ValueError, RecursionError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {
        path: clean_text(text, max_file_bytes)
        for path, text in list(value.items())[:MAX_FILES]
        if isinstance(path, str)
        and isinstance(text, str)
        and not path_problem(path)
        and clean_text(path) == path
        and str(PurePosixPath(path)) == path
        and len(text.encode("utf-8", "surrogatepass")) <= max_file_bytes
    }


def make_repo_environment(cfg: Config) -> RepoEnvironment:
    """The environment of `task.name = "repo"`: generated repositories, [repo] settings, sessions
    and grading in a bubblewrap sandbox (reduced mode has neither private files nor sessions)."""
    r = cfg.repo
    limits = SandboxLimits(
        timeout_s=r.timeout_s, memory_mb=cfg.sandbox.memory_mb, max_processes=cfg.sandbox.max_processes
    )
    sandbox = open_sandbox(limits, cfg.sandbox.python, mode="bwrap", max_concurrency=r.sessions)
    turn_format = PLAIN
    if cfg.model.path is not None:  # an instruct checkpoint's chat template frames the turns
        from transformers import AutoTokenizer

        turn_format = chat_format(AutoTokenizer.from_pretrained(cfg.model.path))
    tasks = {
        split: [
            replace(t, prompt=turn_format.prompt(t.prompt))
            for t in generate_repo_tasks(cfg.seed, split, count, r.missing_frac)
        ]
        for split, count in (("train", r.num_train_prompts), ("eval", r.num_eval_prompts))
    }
    return RepoEnvironment(
        sandbox,
        tasks,
        limits,
        r.max_turns,
        r.max_output_bytes,
        r.max_file_bytes,
        r.sessions,
        r.skip_frac,
        r.typo_frac,
        turn_format=turn_format,
        latency_s=r.latency_s,
        latency_sigma=r.latency_sigma,
    )
