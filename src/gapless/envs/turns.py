"""Turns of multi-turn episodes: how each is seeded and sampled, and the reference wave loop.

An episodic environment (`EpisodeSteps`: the tool_use and repo environments) exposes one turn
at a time, so that two drivers can run the same episodes:

    run_waves (here)           the reference: lock-step waves of `sessions` episodes, one batched
                               sampling call per turn, every tool call of the turn, next turn
    EpisodeRunner              the pipeline (orchestrate/episode_runner.py): each episode's next
                               turn joins the generator's continuous batch as soon as its tool
                               returns; no episode waits for another

Turn k of episode j of a group sampled with `params` draws from the random stream
(`turn_params(params, k).seed`, j), whatever batch it lands in (`TurnRequest`), so both drivers
sample the same tokens for the same group; equal log-probs bit for bit also need the same batch
composition (a float sum depends on the batch: the engine docstring), which the pipeline's `waves`
schedule reproduces. Guaranteed: a driver calls `take_turn` for an episode only after its
previous call returned, `to_rollout` once per episode, after its last turn; tool calls of
different episodes may run at once (threads).
"""

from __future__ import annotations

import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence, runtime_checkable

from gapless.envs.episode import Episode
from gapless.generate.protocol import SteppedGenerator
from gapless.generate.sampling import sample_seed
from gapless.types import Completion, Rollout, SamplingParams

TURN_SEED_STRIDE = 7_919  # turn k of a group samples with seed group_seed + k * stride


@runtime_checkable
class EpisodeSteps(Protocol):
    """What a driver asks of an episodic environment, one turn at a time."""

    sessions: int  # episodes the reference runs at once (sandbox sessions held)

    def start_episode(self, task, prompt_ids: list[int]) -> Episode:
        """A fresh episode of `task` whose first turn continues `prompt_ids`."""
        ...

    def take_turn(self, episode: Episode, completion: Completion, encode: Callable[[str], list[int]]) -> None:
        """Record the model's turn, run what it asks (blocking: a tool call in the episode's own
        session) and append the reply, or end the episode (`episode.is_done`)."""
        ...

    def to_rollout(self, episode: Episode) -> Rollout:
        """The scored rollout of a finished episode (blocking: grading may run a sandbox job)."""
        ...

    def discard(self, episode: Episode) -> None:
        """Drop an episode nobody will score (its group was cut): close its session."""
        ...

    # Optional: `open_episode(episode, encode)`, blocking, called once before an episode's first
    # turn when the environment has it: the episode's first context comes from outside (an agent
    # program's first call, envs/agent/environment.py); it may also end the episode (`is_done`) at once.


@dataclass(frozen=True)
class TurnRequest:
    """One turn to sample: continue `context` as sample `sample` of group `group`'s turn `turn`."""

    group: int  # the group's index (also the engine request id)
    sample: int  # the episode's index within its group
    turn: int  # model turns the episode has taken
    context: tuple[int, ...]


class ToolLatency:
    """The latency benchmarks add to every tool call, without CPU: lognormal with mean `mean_s`
    and shape `sigma` (0: exactly `mean_s`). Thread-safe; seeded, though which call draws which
    value depends on the order in which threads call."""

    def __init__(self, mean_s: float, sigma: float = 0.0, seed: int = 0):
        self.mean_s, self.sigma = mean_s, sigma
        self._rng, self._lock = random.Random(f"tool-latency-{seed}"), threading.Lock()

    def draw(self) -> float:
        if self.mean_s <= 0 or self.sigma <= 0:
            return self.mean_s
        with self._lock:
            z = self._rng.gauss(0.0, 1.0)
        return self.mean_s * math.exp(self.sigma * z - self.sigma**2 / 2)

    def wait(self) -> None:
        seconds = self.draw()
        if seconds > 0:
            time.sleep(seconds)


def turn_params(params: SamplingParams, turn: int) -> SamplingParams:
    """The sampling parameters of a group's turn `turn` (its own seed per turn)."""
    return replace(params, seed=params.seed + TURN_SEED_STRIDE * turn)


def queue_turn(engine: SteppedGenerator, request: TurnRequest, params: SamplingParams) -> None:
    """Queue one turn in a stepped engine: sample `request.sample` of a request whose prompt is
    the episode's context, drawing from stream (turn seed, sample) like `add_request`'s samples."""
    p = turn_params(params, request.turn)
    start = Completion(
        list(request.context),
        [],
        [],
        [],
        "abort",
        "",
        str(request.group),
        request.sample,
        sample_seed(p.seed, request.sample),
    )
    engine.resume([start], p, str(request.group))


def sample_turns(generator, requests: Sequence[TurnRequest], params: Sequence[SamplingParams]) -> list[Completion]:
    """Sample every request (request i with `params[i]`, its group's), all in one batch on a
    stepped engine; completions in request order."""
    if not isinstance(generator, SteppedGenerator):  # the simple reference sampler: one call per turn
        out = []
        for request, p in zip(requests, params):
            tp = turn_params(p, request.turn)
            out += generator.generate([list(request.context)], replace(tp, seed=sample_seed(tp.seed, request.sample)))
        return out
    if generator.has_work:
        raise RuntimeError("sample_turns needs an idle engine")
    order = {}
    for i, (request, p) in enumerate(zip(requests, params)):
        order[(str(request.group), request.sample)] = i
        queue_turn(generator, request, p)
    done: list[Completion | None] = [None] * len(requests)
    while generator.has_work:
        for completion in generator.step():
            done[order[(completion.request_id, completion.index)]] = completion
    return done  # type: ignore[return-value]


def run_waves(
    env: EpisodeSteps,
    generator,
    tasks: Sequence,
    group_size: int,
    params: SamplingParams | Sequence[SamplingParams],
    encode: Callable[[str], list[int]],
    pool: ThreadPoolExecutor,
) -> list[list[Rollout]]:
    """The reference multi-turn loop: `group_size` episodes per task, in waves of `env.sessions`
    episodes; per turn one sampling call over the wave's unfinished episodes, then their tool
    calls at once on `pool`. Group g is sampled with `params[g]` (one value: every group)."""
    per_group = [params] * len(tasks) if isinstance(params, SamplingParams) else list(params)
    episodes = [
        (g, j, env.start_episode(task, encode(task.prompt))) for g, task in enumerate(tasks) for j in range(group_size)
    ]
    for wave in range(0, len(episodes), env.sessions):
        run_wave(env, generator, episodes[wave : wave + env.sessions], per_group, encode, pool)
    rollouts = list(pool.map(lambda gje: env.to_rollout(gje[2]), episodes))
    return [rollouts[i : i + group_size] for i in range(0, len(rollouts), group_size)]


def run_wave(
    env: EpisodeSteps,
    generator,
    wave: Sequence[tuple[int, int, Episode]],
    params: Sequence[SamplingParams],
    encode: Callable[[str], list[int]],
    pool: ThreadPoolExecutor,
) -> None:
    """Run one wave's episodes (group, sample, episode) to their end in lock-step turns."""
    opener = getattr(env, "open_episode", None)
    if opener is not None:  # an agent's first call is its first context (envs/agent/environment.py)
        list(pool.map(lambda e: opener(e, encode), [e for _, _, e in wave if e.turns == 0 and not e.is_done]))
    while active := [(g, j, e) for g, j, e in wave if not e.is_done]:
        requests = [TurnRequest(g, j, e.turns, tuple(e.context)) for g, j, e in active]
        completions = sample_turns(generator, requests, [params[g] for g, _, _ in active])
        list(
            pool.map(
                lambda ec: env.take_turn(ec[0], ec[1], encode), [(e, c) for (_, _, e), c in zip(active, completions)]
            )
        )
