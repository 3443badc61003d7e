"""The environment protocol: tasks in, scored rollouts out.

An environment owns its tasks (a train and an eval split) and scores completions of them:

    env.tasks("train") -> [Task]        the loop samples prompts from these
    generator.generate(...)             N completions per task (the loop's job, not the env's)
    env.score_groups(tasks, groups)     -> one Rollout per completion: reward, status, info

Guarantees every environment gives:
- Model output is untrusted data. Scoring never raises because of what the model wrote; it
  returns a reward and a status (a string from the environment's documented set, "ok" when the
  rollout is fully correct). Malformed output is a status, not an exception.
- Infrastructure failures (sandbox down, judge unreachable after its retries) have status
  "infra_error": they carry no reward signal and are excluded from group statistics.
- `score_groups` returns groups in the order given, each with one rollout per completion in order.

A multi-turn environment additionally drives generation itself (`MultiTurnEnvironment.rollout_groups`),
because the model's next turn depends on what the environment answered; its completions carry a
`loss_mask` so that only the model's own tokens are trained on. The loop calls `rollout_groups`
instead of generate + `score_groups` when the environment is one (`isinstance` check).

Optional: an environment with a teacher (`Teacher`: `reference` and `demonstration`) lets the
warm start teach a fresh model the task's format before RL; one without is trained from its
starting weights as they are. `check_infra` turns a step in which nothing could be scored into a
loud `InfraUnavailable` instead of a batch of fake zeros.

Not guaranteed: that scoring is deterministic (an LLM judge may not be), or that tasks fit any
particular tokenizer's context (the loop truncates nothing; over-long prompts are the user's to fix).
"""

from __future__ import annotations

import random
from typing import Callable, Literal, Protocol, Sequence, runtime_checkable

from gapless.errors import InfrastructureError
from gapless.types import Completion, Rollout, SamplingParams

Split = Literal["train", "eval"]


@runtime_checkable
class Task(Protocol):
    """One prompt of an environment. Environments add their own fields (tests, answer, rubric)."""

    @property
    def uid(self) -> str: ...

    @property
    def prompt(self) -> str: ...


@runtime_checkable
class Environment(Protocol):
    name: str

    def tasks(self, split: Split) -> Sequence[Task]:
        """The split's tasks, in a fixed order (deterministic from the config's seed)."""
        ...

    def score_groups(self, tasks: Sequence[Task], groups: Sequence[Sequence[Completion]]) -> list[list[Rollout]]:
        """One list of rollouts per task, one rollout per completion, in order."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Teacher(Protocol):
    """An environment that can write completions itself (for the warm start)."""

    def reference(self, task: Task) -> str:
        """A correct completion of `task` (also text for training a fresh tokenizer)."""
        ...

    def demonstration(self, task: Task, rng: random.Random) -> str:
        """What the warm start trains on: usually the reference, part of the time the teacher's
        typical mistake (real demonstration data is imperfect; RL has to unlearn it)."""
        ...


class InfraUnavailable(InfrastructureError):
    """Every rollout of a step failed for infrastructure reasons; fix the host, not the model."""


def check_infra(
    rollouts: Sequence[Rollout],
    hint: str = "",
    what: str = "rollout of this step failed to be scored",
    error: type[Exception] = InfraUnavailable,
) -> int:
    """Count infra failures; raise `error` ("every {what} ({the first error}){hint}") when no
    rollout could be scored at all."""
    failures = sum(r.is_infra_failure for r in rollouts)
    if rollouts and failures == len(rollouts):
        detail = rollouts[0].info.get("error", "")
        raise error(f"every {what} ({detail}){hint}")
    return failures


class Generator(Protocol):
    """What a multi-turn environment needs of the generator (TorchSampler is one)."""

    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...


@runtime_checkable
class MultiTurnEnvironment(Environment, Protocol):
    def rollout_groups(
        self,
        generator: Generator,
        tasks: Sequence[Task],
        group_size: int,
        params: SamplingParams | Sequence[SamplingParams],
        encode: Callable[[str], list[int]],
    ) -> list[list[Rollout]]:
        """`group_size` scored rollouts per task, in order (group g sampled with `params[g]`, or
        every group with one `params`). Each turn samples from the whole context so far; each
        rollout's completion holds every token after the prompt (the model's and the
        environment's) with `loss_mask` 1 on the model's. An environment that also implements
        `EpisodeSteps` (envs/turns.py) runs in the pipeline, turn by turn."""
        ...
