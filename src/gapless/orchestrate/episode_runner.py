"""Multi-turn episodes in the pipeline's environment process: turns scheduled, not waves.

    replica ──StartEpisodes──> EpisodeRunner: group_size episodes per group
    replica ──TurnDone──────> take_turn on a tool thread (the episode's sandbox session) ──┐
    replica <──NextTurns───── the episode's next turn, as soon as its tool returned <─────┘
                              (or, with schedule 'waves', once every episode of its wave has)
    all episodes of a group over ──> to_rollout (grading, on a tool thread) ──> Scored to the trainer

The generator replica only samples turns (envs/turns.py `queue_turn`: each turn joins its
continuous batch when it arrives, and leaves it at its stop token, so an episode waiting on a
tool holds no slot); the environment owns every episode's state, its session and its reply
tokens. Tool calls of different episodes run at once, each on its own thread (`sessions` of the
environment bound the reference loop's waves, not this: a session is opened per episode at its
first tool call and closed at its end). Every token keeps the version that sampled it (the
engine records it, also across an in-flight swap inside a turn); a group's staleness is its
oldest token's, checked by the trainer's buffer exactly as for single-turn groups; admission,
budget and the ledger are unchanged (a group is one admitted unit).

Guaranteed: one `take_turn` at a time per episode, in turn order; a group is sent to the trainer
once, after every one of its episodes ended, with its rollouts in sample order; a cancelled group
(straggler cut) gets no further turn, and its sessions are closed. With schedule 'waves' the turns
are queued exactly as the reference loop's `run_waves` batches them (waves of `sessions` episodes
of one StartEpisodes message, in order), which makes budget 0 bitwise equal to it.
Environment-state staleness (pipeline.suspend_between_turns): after each turn's tool call the
episode's session is snapshotted and closed (env.suspend), and restored at its next tool call in
a new session; its next turn may wait `resume_after_s` first. When a suspended episode's next
turn comes back, the runner records `env_state_version` (the version whose turn last changed
the sandbox state) and `resumed_by_version` (this turn's), and, past `max_state_staleness`,
restarts the episode from its prompt or ends it as `env_state_stale` (its group is then dropped
with that reason by the trainer's buffer), before any tool call of the stale turn runs.

An environment with `open_episode` (an agent program, envs/agent/environment.py) opens each episode on a
tool thread first (its first context is the agent's first call); the episode's first turn goes out
when that returns, like a turn after a tool call.

Not guaranteed: when a turn returns relative to other episodes' (timing), so with 'turns' the
engine's batches, and the last bits of the log-probs, vary from run to run.
"""

from __future__ import annotations

import queue
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from gapless.envs.episode import Episode
from gapless.envs.turns import EpisodeSteps, TurnRequest
from gapless.orchestrate.messages import StartEpisodes, TurnDone
from gapless.types import Group, Rollout

MAX_TOOL_THREADS = 4096  # threads are made on demand; a tool call waits on the sandbox, not on a core


@dataclass
class _Group:
    index: int
    task_index: int
    born: int
    replica: int
    episodes: list[Episode]
    ended: int = 0


class EpisodeRunner:
    def __init__(
        self,
        env: EpisodeSteps,
        tasks: Sequence,
        encode: Callable[[str], list[int]],
        group_size: int,
        schedule: str,
        send_turns: Callable[[int, tuple[TurnRequest, ...]], None],
        send_scored: Callable[[Group], None],
        suspend: bool = False,
        max_state_staleness: int = -1,
        on_stale: str = "restart",
        resume_after_s: float = 0.0,
        progress: Callable[[str], None] = lambda what: None,
    ):
        """`send_turns(replica, turns)` and `send_scored(group)` are called from this runner's
        owner thread only (inside `handle` and `poll`). `suspend`: snapshot and close each
        episode's session after its turn (env.suspend); `max_state_staleness` (-1: off) and
        `on_stale` ('restart' | 'drop'): the bound checked when a suspended episode resumes.
        `progress(what)`: the environment's progress mark (watchdog.py), called in `poll` for
        every tool call answered and group graded."""
        self.suspend, self.max_state_staleness, self.on_stale = suspend, max_state_staleness, on_stale
        self.resume_after_s = resume_after_s  # a suspended episode's next turn waits this long
        self.parked: list[tuple[float, int, int]] = []  # (due, index, sample): suspended, next turn not sent yet
        self.env, self.tasks, self.encode, self.group_size, self.schedule = env, tasks, encode, group_size, schedule
        self.send_turns, self.send_scored, self.progress = send_turns, send_scored, progress
        self.groups: dict[int, _Group] = {}
        self.pool = ThreadPoolExecutor(MAX_TOOL_THREADS, thread_name_prefix="turn")
        self.results: queue.Queue = queue.Queue()  # (kind, index, sample, payload) from the tool threads
        self.failures: list[str] = []
        self.waves: list[list[tuple[int, int]]] = []  # waves not started yet ('waves'), each (index, sample)
        self.wave: list[tuple[int, int]] = []  # the running wave
        self.in_flight: set[tuple[int, int]] = set()  # its episodes whose turn is out
        self.turning: set[tuple[int, int]] = set()  # episodes whose take_turn runs on a tool thread
        self.cut: dict[int, _Group] = {}  # cancelled groups, until their running turns are back

    # ---- messages from the replicas ------------------------------------------------------------
    def handle(self, message) -> None:
        if isinstance(message, StartEpisodes):
            self._start(message)
        elif isinstance(message, TurnDone):
            self._turn_done(message)

    def cancel(self, indices: Sequence[int]) -> None:
        """Groups the trainer cut: no more turns; their sessions are closed (after a running turn)."""
        for index in indices:
            group = self.groups.pop(index, None)
            if group is not None:
                self.cut[index] = group
                for sample, episode in enumerate(group.episodes):
                    if (index, sample) not in self.turning:
                        self.pool.submit(self._guarded, "discarded", index, sample, self.env.discard, episode)
        self.in_flight = {key for key in self.in_flight if key[0] in self.groups}
        self._next_wave()

    def _start(self, message: StartEpisodes) -> None:
        keys = []
        for index, task_index, born in message.groups:
            task = self.tasks[task_index]
            prompt = self.encode(task.prompt)
            episodes = [self.env.start_episode(task, prompt) for _ in range(self.group_size)]
            self.groups[index] = _Group(index, task_index, born, message.replica, episodes)
            keys += [(index, sample) for sample in range(self.group_size)]
        if self.schedule == "turns" and hasattr(self.env, "open_episode"):
            for index, sample in keys:  # each first turn goes out once its episode has opened
                self.turning.add((index, sample))
                self.pool.submit(
                    self._guarded,
                    "turn",
                    index,
                    sample,
                    self.env.open_episode,
                    self.groups[index].episodes[sample],
                    self.encode,
                )
        elif self.schedule == "turns":
            for index, task_index, _ in message.groups:
                self._send(self.groups[index], range(self.group_size))
        else:
            sessions = max(1, self.env.sessions)
            self.waves += [keys[i : i + sessions] for i in range(0, len(keys), sessions)]
            self._next_wave()

    def _turn_done(self, message: TurnDone) -> None:
        group = self.groups.get(message.group)
        if group is None:
            return  # cut while its turn was sampled
        sample, completion = message.completion.index, message.completion
        episode = group.episodes[sample]
        if episode.snapshot is not None and completion.versions:  # a suspended episode resumes: record both versions
            resumed_by, wrote = completion.versions[-1], episode.state_version or 0
            gap = resumed_by - wrote
            episode.info.update(
                env_state_version=wrote,
                resumed_by_version=resumed_by,
                resumes=episode.info.get("resumes", 0) + 1,
                env_state_gap_max=max(gap, episode.info.get("env_state_gap_max", gap)),
            )
        if self._is_state_stale(episode, completion):
            if self.on_stale == "restart":  # from the prompt, under the weights current now
                restarts = episode.info.get("env_state_restarts", 0) + 1
                episode = group.episodes[sample] = self.env.start_episode(episode.task, episode.prompt_ids)
                episode.info["env_state_restarts"] = restarts
                self._sent_back(group, sample)
                return
            episode.finish(
                "env_state_stale", env_state_version=episode.state_version, resumed_by_version=completion.versions[-1]
            )
            episode.snapshot = None
            self.results.put(("turn", group.index, sample, None))
            self.turning.add((group.index, sample))
            return
        self.turning.add((group.index, sample))
        self.pool.submit(self._guarded, "turn", group.index, sample, self._take_turn, episode, completion)

    def _is_state_stale(self, episode: Episode, completion) -> bool:
        """A suspended episode whose state was written more than the bound before this turn's version."""
        if self.max_state_staleness < 0 or episode.snapshot is None or not completion.versions:
            return False
        return completion.versions[-1] - (episode.state_version or 0) > self.max_state_staleness

    def _take_turn(self, episode: Episode, completion) -> None:
        self.env.take_turn(episode, completion, self.encode)
        if self.suspend and not episode.is_done:
            self.env.suspend(episode)  # no session held while the next turn is sampled

    # ---- results from the tool threads ---------------------------------------------------------
    def _guarded(self, kind: str, index: int, sample: int, work, *args) -> None:
        try:
            payload = work(*args)
        except BaseException:
            self.failures.append(traceback.format_exc())
            return
        self.results.put((kind, index, sample, payload))

    def poll(self) -> None:
        """Act on every finished turn and grading: send next turns, finished groups."""
        now, parked = time.monotonic(), self.parked
        self.parked = [p for p in parked if p[0] > now]
        for _, index, sample in (p for p in parked if p[0] <= now):
            if index in self.groups:
                self._send(self.groups[index], [sample])
        while True:
            try:
                kind, index, sample, payload = self.results.get_nowait()
            except queue.Empty:
                return
            if kind == "turn":
                self.turning.discard((index, sample))
                self.progress(f"answered a turn's tool calls (group {index}, sample {sample})")
            elif kind == "scored":
                self.progress(f"graded group {index}")
            group = self.groups.get(index)
            if group is None:
                if kind == "turn" and index in self.cut:  # cut while its tool ran
                    episode = self.cut[index].episodes[sample]
                    self.pool.submit(self._guarded, "discarded", index, sample, self.env.discard, episode)
                if index in self.cut and not any(key[0] == index for key in self.turning):
                    del self.cut[index]
                continue
            if kind == "scored":
                del self.groups[index]
                self.send_scored(
                    Group(index=index, task_index=group.task_index, born=group.born, rollouts=tuple(payload))
                )
            elif kind == "turn":
                self._after_turn(group, sample)

    def _sent_back(self, group: _Group, sample: int) -> None:
        """Queue a restarted episode's first turn."""
        if self.schedule == "turns":
            self._send(group, [sample])
        else:
            self.in_flight.discard((group.index, sample))
            self._next_wave()

    def _after_turn(self, group: _Group, sample: int) -> None:
        episode = group.episodes[sample]
        if episode.is_done:
            group.ended += 1
            if group.ended == self.group_size:
                self.pool.submit(self._guarded, "scored", group.index, -1, self._grade, group.episodes)
        elif self.schedule == "turns" and self.resume_after_s > 0 and episode.snapshot is not None:
            self.parked.append((time.monotonic() + self.resume_after_s, group.index, sample))
        elif self.schedule == "turns":
            self._send(group, [sample])
        if self.schedule == "waves":
            self.in_flight.discard((group.index, sample))
            self._next_wave()

    def _grade(self, episodes: list[Episode]) -> list[Rollout]:
        return [self.env.to_rollout(e) for e in episodes]

    # ---- turns out ----------------------------------------------------------------------------
    def _send(self, group: _Group, samples) -> None:
        turns = tuple(
            TurnRequest(group.index, s, group.episodes[s].turns, tuple(group.episodes[s].context)) for s in samples
        )
        if turns:
            self.send_turns(group.replica, turns)

    def _next_wave(self) -> None:
        """'waves': once the running wave's turn is back, queue its next turn (every unfinished
        episode at once, in order), or start the next wave."""
        if self.schedule != "waves" or self.in_flight:
            return
        while True:
            active = [(i, s) for i, s in self.wave if i in self.groups and not self.groups[i].episodes[s].is_done]
            if active:
                by_replica: dict[int, list[TurnRequest]] = {}
                for index, sample in active:
                    group, episode = self.groups[index], self.groups[index].episodes[sample]
                    by_replica.setdefault(group.replica, []).append(
                        TurnRequest(index, sample, episode.turns, tuple(episode.context))
                    )
                for replica, turns in by_replica.items():
                    self.send_turns(replica, tuple(turns))
                self.in_flight = set(active)
                return
            if not self.waves:
                self.wave = []
                return
            self.wave = self.waves.pop(0)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
