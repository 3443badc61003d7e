"""The records that flow between actors, named as in the glossary (docs/architecture.md).

prompt -> completion (generator) -> rollout (environment) -> group (N rollouts of one prompt)
-> batch (trainer). Policy versions are data: every completion token carries the version of the
weights that sampled it, and the trainer computes staleness from them instead of assuming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, NamedTuple

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class LogitAdjustment:
    """Per-request changes to the next-token logits before sampling (OpenAI's and vLLM's names;
    applied by generate/logit_adjust.py). The sampling log-probs are those of the adjusted
    distribution, the one the token was drawn from."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, value) pairs added to the logits (-100 bans a token, +100 all but forces it)."""
    presence_penalty: float = 0.0
    """Subtracted once from every token already generated (not the prompt's)."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence of a token in the generated tokens."""
    repetition_penalty: float = 1.0
    """vLLM/CTRL's: logits of tokens in prompt or output divided by it when positive, multiplied when negative."""

    @property
    def is_identity(self) -> bool:
        return (
            not self.logit_bias
            and self.presence_penalty == 0
            and self.frequency_penalty == 0
            and self.repetition_penalty == 1
        )


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """Softmax temperature; the recorded log-probs are taken at this temperature."""
    top_p: float = 1.0
    """Nucleus mass kept before sampling; 1.0 disables it."""
    max_new_tokens: int = 24
    """Cap on generated tokens per completion, counting tokens generated before a resume."""
    greedy: bool = False
    """Argmax decoding; temperature, top-p and top-k are ignored."""
    seed: int = 0
    """Seeds the request's random streams: same seed and prompt, same tokens."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling; 0 disables it."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion (finish reason 'stop'), besides EOS."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks that force a length)."""
    adjust: LogitAdjustment | None = None
    """Logit bias and repetition penalties (served requests); None: the model's logits as they are."""


@dataclass
class Completion:
    """Generator output for one prompt: token ids with their sampling log-probs and versions."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the distribution it was sampled from
    versions: list[int]  # policy version that sampled each token
    finish_reason: FinishReason  # "abort": a partial completion that the engine can resume
    text: str
    request_id: str = ""  # the engine request this completion belongs to
    index: int = 0  # which of the request's samples
    seed: int = 0  # seed of this sample's random stream; a resumed sample continues it
    loss_mask: list[int] | None = None  # per token: 1 = sampled by the model (trained), 0 = written
    # by the environment into a multi-turn context (tool output: masked, its logprob 0.0 and its
    # version that of the turn it answered). None: every token is the model's.

    @property
    def oldest_version(self) -> int:
        return min(self.versions) if self.versions else 0


@dataclass
class Rollout:
    """A scored completion. `status` explains `reward`; infra failures carry no reward signal."""

    prompt_uid: str
    completion: Completion
    reward: float
    status: str
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def is_infra_failure(self) -> bool:
        return self.status == "infra_error"


class Admitted(NamedTuple):
    """A group as admission hands it out (Assign): what a Group carries before its rollouts exist."""

    index: int  # admission order: the group's number in groups.jsonl
    task_index: int  # its task's position in the train split
    born: int  # the policy version when it was admitted


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """One prompt's group of rollouts, the unit of admission, advantages and the ledger. Built when
    its scoring ends (an environment actor, or the inline source), it reaches the buffer and the
    trainer's step unchanged; the trainer computes advantages within each Group, never by position."""

    index: int  # admission order: the group's number in groups.jsonl
    task_index: int  # its task's position in the train split
    born: int  # the policy version when it was admitted
    rollouts: tuple[Rollout, ...]

    @property
    def oldest_version(self) -> int:
        return min(r.completion.oldest_version for r in self.rollouts)

    @property
    def is_zero_variance(self) -> bool:
        rewards = {r.reward for r in self.rollouts if not r.is_infra_failure}
        return len(rewards) <= 1

    @property
    def is_infra_failure(self) -> bool:
        return all(r.is_infra_failure for r in self.rollouts)


class DropReason(StrEnum):
    """Why an admitted group was not trained: the `reason` of its `dropped` event in groups.jsonl."""

    INFRA_ERROR = "infra_error"  # every rollout failed in the infrastructure
    ENV_STATE_STALE = "env_state_stale"  # an episode resumed past pipeline.max_env_state_staleness
    ZERO_VARIANCE = "zero_variance"  # dynamic sampling: one reward for the whole group, no signal
    OVER_BUDGET = "over_budget"  # staler than pipeline.max_staleness at consume time (admission prevents it)
    STRAGGLER = "straggler"  # due at this step and still generating
    SURPLUS = "surplus"  # due at this step, scored, and not needed
    REPLICA_LOST = "replica_lost"  # its generator replica died or was evicted
    ENV_LOST = "env_lost"  # its environment actor died or was evicted
    RUN_ENDED = "run_ended"  # still admitted when the run ended
    RUN_STOPPED = "run_stopped"  # ... when a signal stopped it
    RUN_FAILED = "run_failed"  # ... when it failed
    RUN_LOST = "run_lost"  # open when the trainer crashed; closed by the next --resume
