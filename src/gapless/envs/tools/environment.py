"""Multi-turn tool-use environment: the model calls Python in a sandbox session, reads the output,
and continues, up to `max_turns` model turns (turn format: envs/tools/tasks.py).

Per turn, for every unfinished episode at once:

    generator.generate(contexts) ──> parse each turn ──> answer: grade, episode over
                                                      ──> tool call: run it in the episode's own
                                                          sandbox session (thread pool, `sessions`
                                                          at once), append <out>...</out>
                                                          (loss-masked), next turn

A call runs like a notebook cell: statements execute in the session's persistent namespace, and
the value of a final expression is printed (repr). An exception is shown to the model as its
last line and the episode goes on; the model may recover.

reward = 1.0 for a correct final answer, else 0.0. Statuses:
    ok            the final answer equals the task's answer
    wrong_answer  an answer was given and is wrong
    no_answer     a turn held neither a well-formed tool call nor an answer (e.g. an unclosed
                  <py>, plain text, an empty turn); `info["detail"]` says which
    turn_limit    `max_turns` model turns without an answer
    tool_error    a tool call hit a sandbox limit (timeout, output flood; `info["tool_status"]`),
                  a resumed episode's variables did not load from its snapshot (`restore_failed`:
                  the model's own objects, e.g. a `__reduce__` that fails on load), its snapshot
                  did not come back (`snapshot_failed`), or the session's slot failed after the
                  model's code had run in it (`crashed`: its code may have caused it): the
                  episode ends, its session is discarded
    infra_error   the host saw the sandbox fail before any of the model's code ran in the
                  session (it could not start), or closed the session itself (idle timeout):
                  excluded from group statistics; a step where every rollout failed so raises
                  SandboxUnavailable
Attribution is typed (`SessionResult.status`, `is_lost`, `SnapshotFailed`), never read from a
message: the session's texts hold the model's output. Model output is untrusted: every path above
is a status, never an exception.

Partial rollouts: `start` / `advance(turns=k)` / `suspend` / `advance` again continue an episode
later, possibly in another session and under a newer policy: `suspend` snapshots the session
(files and picklable variables) and closes it; the next tool call restores the snapshot in a new
session and records the environment-state staleness (episode.py). Sessions are opened at an
episode's first tool call and closed when it ends, so at most `sessions` are held at once:
`rollout_groups` runs episodes in waves of that size.
Not guaranteed: exactly-once tool side effects across a suspend (a call's effects after the
last snapshot are lost), or live objects (sockets, generators) surviving a snapshot.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Sequence

from gapless.config import Config
from gapless.envs.base import Generator, Split, check_infra
from gapless.envs.code.environment import SandboxUnavailable
from gapless.envs.episode import Episode
from gapless.envs.tools.tasks import (
    MARKUP,
    ToolTask,
    Turn,
    demonstration,
    generate_tool_tasks,
    parse_turn,
    tool_output_text,
)
from gapless.envs.turns import ToolLatency, run_waves
from gapless.sandbox import SandboxError, SandboxLimits, SnapshotFailed, Status, open_sandbox
from gapless.sandbox.frames import clean_text
from gapless.sandbox.worker import SlotFailure
from gapless.types import Completion, Rollout, SamplingParams

# Runs the model's code like a notebook cell; the names it uses are removed before returning so
# that the namespace (and its snapshots) holds only what the model defined.
CELL = """\
import ast as __g_ast
__g_tree = __g_ast.parse({source!r}, "<tool>")
__g_last = __g_tree.body.pop() if __g_tree.body and isinstance(__g_tree.body[-1], __g_ast.Expr) else None
del __g_ast
try:
    exec(compile(__g_tree, "<tool>", "exec"), globals())
    if __g_last is not None:
        __g_value = eval(compile(__import__("ast").Expression(__g_last.value), "<tool>", "eval"), globals())
        if __g_value is not None:
            print(repr(__g_value))
finally:
    for __g_name in [n for n in globals() if n.startswith("__g_")]:
        globals().pop(__g_name, None)
"""


# What survives a crash of the live process, exactly (sandbox/session.py): the files, nothing else.
LOST_NOTE = "(the tool process ended: its variables are lost, its files are kept)"


class ToolUseEnvironment:
    name = "tool_use"
    markup = MARKUP  # the embedded model's tokenizer keeps these tags whole (models.train_tokenizer)

    def __init__(
        self,
        sandbox,
        tasks: dict[str, Sequence[ToolTask]],
        limits: SandboxLimits,
        max_turns: int = 3,
        max_output_chars: int = 64,
        sessions: int = 8,
        idle_timeout_s: float = 300.0,
        skip_frac: float = 0.0,
        typo_frac: float = 0.0,
        latency_s: float = 0.0,
        latency_sigma: float = 0.0,
    ):
        self.sandbox = sandbox
        self.latency = ToolLatency(latency_s, latency_sigma)
        self.skip_frac, self.typo_frac = skip_frac, typo_frac
        self._tasks = tasks
        self.limits = limits
        self.max_turns = max_turns
        self.max_output_chars = max_output_chars
        self.sessions = sessions
        self.idle_timeout_s = idle_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=sessions, thread_name_prefix="tool")

    def tasks(self, split: Split) -> Sequence[ToolTask]:
        return self._tasks[split]

    def reference(self, task: ToolTask) -> str:
        """The ideal transcript as one text (for training a fresh tokenizer)."""
        return task.solution

    def demonstration_turns(self, task: ToolTask, rng: random.Random) -> list[tuple[str, bool]]:
        """A warm-start transcript from the imperfect teacher (tool_task.demonstration)."""
        return demonstration(task, rng, self.skip_frac, self.typo_frac)

    def demonstration(self, task: ToolTask, rng: random.Random) -> str:
        """The same transcript as one text (the Teacher protocol); the warm start uses
        `demonstration_turns`, which keeps the turn boundaries."""
        return "".join(text for text, _ in self.demonstration_turns(task, rng))

    def metrics(self) -> dict[str, float]:
        """The sandbox's counters and latency percentiles (sessions included)."""
        return self.sandbox.metrics()

    def max_context_tokens(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Upper bound of an episode's context: the prompt, every turn, every tool output between
        (at most one token per byte of `<out>`, the shown output, `...</out>`, the crash note and
        the newline)."""
        output_tokens = len(tool_output_text("..." + LOST_NOTE).encode()) + 4 * self.max_output_chars
        return prompt_tokens + self.max_turns * max_new_tokens + (self.max_turns - 1) * output_tokens

    # -- the multi-turn path -------------------------------------------------------------------

    def rollout_groups(
        self,
        generator: Generator,
        tasks: Sequence[ToolTask],
        group_size: int,
        params: SamplingParams | Sequence[SamplingParams],
        encode: Callable[[str], list[int]],
    ) -> list[list[Rollout]]:
        """The reference loop: lock-step waves of `sessions` episodes (envs/turns.py)."""
        return run_waves(self, generator, tasks, group_size, params, encode, self.pool)

    def start(self, task: ToolTask, encode: Callable[[str], list[int]]) -> Episode:
        return Episode(task, encode(task.prompt))

    def start_episode(self, task: ToolTask, prompt_ids: list[int]) -> Episode:
        return Episode(task, list(prompt_ids))

    def take_turn(self, episode: Episode, completion: Completion, encode: Callable[[str], list[int]]) -> None:
        """One model turn: grade an answer, or run its tool call (in the episode's session, as the
        policy version of the turn's last token) and append the output."""
        episode.add_model_turn(completion)
        call = self._after_turn(episode, parse_turn(completion.text))
        if call is not None:
            version = completion.versions[-1] if completion.versions else 0
            output = self._run_tool(episode, call, version)
            if output is not None:
                # a prompt encoder (Policy.encode) writes the reply as the chat template's next turn
                episode.add_environment_text(output, getattr(encode, "turn", encode)(output))
        if episode.is_done:
            self._close_session(episode)

    def advance(
        self,
        generator: Generator,
        episodes: Sequence[Episode],
        params: SamplingParams,
        encode: Callable[[str], list[int]],
        turns: int | None = None,
    ) -> None:
        """Take up to `turns` more turns (None: until every episode is over) of the unfinished
        episodes, all of them in one `generate` call per turn."""
        for _ in range(self.max_turns if turns is None else turns):
            active = [e for e in episodes if not e.is_done]
            if not active:
                break
            turn_params = replace(params, seed=params.seed + 7_919 * max(e.turns for e in active))  # new per turn
            completions = generator.generate([e.context for e in active], turn_params)
            list(self.pool.map(lambda ec: self.take_turn(ec[0], ec[1], encode), zip(active, completions)))

    def _after_turn(self, episode: Episode, turn: Turn) -> str | None:
        """Grade an answer or end the episode; return the code of a tool call to run."""
        if turn.kind == "answer":
            is_right = turn.content == episode.task.answer
            episode.finish("ok" if is_right else "wrong_answer", 1.0 if is_right else 0.0, answer=turn.content[:100])
        elif turn.kind == "none":
            episode.finish("no_answer", detail=turn.detail)
        elif episode.turns >= self.max_turns:
            episode.finish("turn_limit")  # nobody would read this call's output
        else:
            return turn.content
        return None

    def _run_tool(self, episode: Episode, code: str, version: int) -> str | None:
        """Run one call in the episode's session; the text to append, or None if it ended."""
        self.latency.wait()  # an added tool latency (benchmarks): a remote tool, no CPU
        try:
            if episode.session is None:
                episode.session = self.sandbox.open_session(self.limits, self.idle_timeout_s)
                if episode.snapshot is not None:
                    restored = episode.session.restore(episode.snapshot)
                    if restored.status is Status.INFRA_ERROR:  # the session never started
                        episode.finish("infra_error", error=f"restore failed: {clean_text(restored.stderr, 300)}")
                        self._close_session(episode)
                        return None
                    if restored.status is not Status.OK:  # the model's own values did not load
                        tool_status = "crashed" if restored.is_lost else "restore_failed"
                        episode.finish(
                            "tool_error", tool_status=tool_status, error=clean_text(restored.error or "", 300)
                        )
                        self._close_session(episode)
                        return None
                    episode.info.update(env_state_version=episode.state_version, resumed_by_version=version)
                    episode.snapshot = None
            result = episode.session.run(CELL.format(source=code))
        except (SandboxError, SlotFailure) as exc:  # no session, or one the host closed (idle)
            episode.finish("infra_error", error=str(exc)[:300])
            self._close_session(episode)
            return None
        episode.info["tool_calls"] = episode.info.get("tool_calls", 0) + 1
        if result.status is Status.INFRA_ERROR:  # the session never started: nothing of the model ran
            episode.finish("infra_error", error=clean_text(result.stderr, 300))
            self._close_session(episode)
            return None
        if result.is_lost or result.status not in (Status.OK, Status.NONZERO_EXIT):
            tool_status = "crashed" if result.is_lost else result.status.value
            episode.finish("tool_error", tool_status=tool_status, protocol=result.violation)
            self._close_session(episode)  # its state is suspect (killed mid-call, flooded, lost)
            return None
        episode.state_version = version
        shown = (result.stdout if result.error is None else f"{result.stdout}{result.error}").strip()
        if len(shown) > self.max_output_chars:
            shown = shown[: self.max_output_chars] + "..."
        if result.restarted and result.status is Status.NONZERO_EXIT and not result.error:
            shown += LOST_NOTE  # never cut: it is the environment's word, not the model's output
        return tool_output_text(shown)

    def suspend(self, episode: Episode) -> None:
        """Snapshot the episode's session and close it; the next tool call restores it. A
        snapshot that fails ends the episode: `infra_error` when the sandbox failed, else
        `tool_error` (`snapshot_failed`: the model's state hit a limit, e.g. a huge namespace)."""
        if episode.session is not None and not episode.is_done:
            try:
                episode.snapshot = episode.session.snapshot()
            except SnapshotFailed as failed:
                result = failed.result
                if result.status is Status.INFRA_ERROR:  # the session never started
                    episode.finish("infra_error", error=f"snapshot failed: {clean_text(result.stderr, 300)}")
                else:
                    episode.finish(
                        "tool_error",
                        tool_status="snapshot_failed",
                        snapshot_status=result.status.value,
                        protocol=result.violation,
                        error=clean_text(result.error or "", 300),
                    )
            except (SandboxError, SlotFailure) as exc:  # the host closed the session (idle timeout)
                episode.finish("infra_error", error=f"snapshot failed: {str(exc)[:300]}")
        self._close_session(episode)

    def discard(self, episode: Episode) -> None:
        """An episode the run no longer needs (its group was cut): close its session."""
        self._close_session(episode)

    def _close_session(self, episode: Episode) -> None:
        if episode.session is not None:
            episode.session.close()
            episode.session = None

    def to_rollout(self, episode: Episode) -> Rollout:
        """The scored rollout of an episode; one still running counts as out of turns."""
        if not episode.is_done:
            episode.finish("turn_limit")
        self._close_session(episode)
        info = {**episode.info, "turns": episode.turns, "transcript": "".join(episode.texts)[-500:]}
        return Rollout(episode.task.uid, episode.to_completion(), episode.reward, episode.status, info)

    # -- the single-turn protocol: grade finished transcripts ----------------------------------

    def score_groups(self, tasks: Sequence[ToolTask], groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        """Grade given transcripts by their last model turn (the text after the last tool output).
        Runs no tools: a transcript ending in a tool call is `no_answer`."""
        out = []
        for task, completions in zip(tasks, groups):
            rollouts = []
            for c in completions:
                last = parse_turn(c.text.rsplit("</out>", 1)[-1])
                is_right = last.kind == "answer" and last.content == task.answer
                status = "ok" if is_right else "wrong_answer" if last.kind == "answer" else "no_answer"
                rollouts.append(Rollout(task.uid, c, float(is_right), status, {"detail": last.detail}))
            out.append(rollouts)
        return out

    @staticmethod
    def check_infra(rollouts: list[Rollout]) -> int:
        return check_infra(
            rollouts, "; run `gapless sandbox check`", "tool session of this step failed", SandboxUnavailable
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.sandbox.close()


def make_tool_environment(cfg: Config) -> ToolUseEnvironment:
    """The environment of `task.name = "tool_use"`: embedded tasks, [tools] settings, sessions in
    a bubblewrap sandbox (sessions need it: reduced mode has no private filesystem)."""
    limits = SandboxLimits(
        timeout_s=cfg.tools.timeout_s, memory_mb=cfg.sandbox.memory_mb, max_processes=cfg.sandbox.max_processes
    )
    sandbox = open_sandbox(limits, cfg.sandbox.python, mode="bwrap", max_concurrency=cfg.tools.sessions)
    tasks = {
        "train": generate_tool_tasks(cfg.seed, "train", cfg.tools.num_train_prompts),
        "eval": generate_tool_tasks(cfg.seed, "eval", cfg.tools.num_eval_prompts),
    }
    return ToolUseEnvironment(
        sandbox,
        tasks,
        limits,
        cfg.tools.max_turns,
        cfg.tools.max_output_chars,
        cfg.tools.sessions,
        skip_frac=cfg.tools.skip_frac,
        typo_frac=cfg.tools.typo_frac,
        latency_s=cfg.tools.latency_s,
        latency_sigma=cfg.tools.latency_sigma,
    )
