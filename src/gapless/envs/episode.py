"""One multi-turn rollout in progress: the token record of every turn, and its environment state.

Token accounting (what the trainer sees, via `to_completion`):
    token_ids  every token after the prompt, in order: the model's turns (each ending at its EOS)
               and the environment's replies between them
    loss_mask  1 on the model's tokens, 0 on the environment's
    logprobs   the sampling log-prob of each model token; 0.0 on environment tokens
    versions   the policy version that sampled each model token; an environment token carries
               the version of the turn it answered
so `prompt_ids + token_ids` is exactly the context the last turn was sampled from.

Environment state: `snapshot` holds the tool session's state when the episode is suspended
(session closed), to be restored in a new session when it resumes; `state_version` is the
policy version whose turn last changed that state. A resume by a newer policy records both in
`info` (`env_state_version`, `resumed_by_version`): the environment-state staleness.
Not guaranteed: that a resumed episode sees the same live objects (only what pickles survives a
snapshot; sandbox/session.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gapless.types import Completion


@dataclass
class Episode:
    task: Any  # the environment's task (uid, prompt, ...)
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the turns' texts, model and environment
    turns: int = 0  # model turns taken
    finish_reason: str = "stop"
    status: str | None = None  # set when the episode is over
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    session: Any = None  # the live tool session, if any (never serialised)
    snapshot: bytes | None = None  # the session's state while suspended
    state_version: int | None = None  # policy version whose turn last wrote the session state

    @property
    def is_done(self) -> bool:
        return self.status is not None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add_model_turn(self, completion: Completion) -> None:
        self.token_ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.versions += completion.versions
        self.loss_mask += [1] * len(completion.token_ids)
        self.texts.append(completion.text)
        self.finish_reason = completion.finish_reason
        self.turns += 1

    def add_environment_text(self, text: str, ids: list[int]) -> None:
        version = self.versions[-1] if self.versions else 0
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.texts.append(text)

    def finish(self, status: str, reward: float = 0.0, **info: Any) -> None:
        self.status, self.reward = status, reward
        self.info.update(info)

    def to_completion(self) -> Completion:
        return Completion(
            list(self.prompt_ids),
            list(self.token_ids),
            list(self.logprobs),
            list(self.versions),
            self.finish_reason,
            "".join(self.texts),
            loss_mask=list(self.loss_mask),
        )
