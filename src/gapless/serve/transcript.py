"""An agent's chat calls as one token sequence: how the gateway turns messages into the context
the model continues, token for token.

An agent (the user's program, through the gateway, serve/gateway.py) sends the whole
conversation on every call. Re-rendering it and tokenising it again would train on tokens the
model never sampled (retokenisation drift: the sampled ids of an earlier reply need not be what
the tokenizer makes of its text). So the context of call k is built from call k-1's, never re-read:

    call 1   render(messages)                                  (with the generation prompt)
    call k   context(k-1) + the ids sampled at call k-1 + encode(what the template adds after it)

`Transcript.extend` checks that call k's messages are call k-1's followed by the reply exactly as
returned (whitespace at its ends aside) and then new messages; "what the template adds" is the
rendering of call k less the rendering up to that reply's content, less the stop token the model
already sampled (prompts.py's end-of-turn rule). A call that rewrites earlier messages is a
`NotAnExtension` (the gateway answers 400): one episode trains one token sequence. A call the
chat template or the tokenizer refuses (a template's own `raise_exception`, text a tokenizer
cannot encode) is an `Unrenderable` (a 400 too), and leaves the transcript as it was: the
messages carry the model's text, so their rendering must fail as a refusal, never as an
exception out of the episode.

Rendering follows the run's prompt format (prompts.py `PromptEncoder`): `chat` renders the
tokenizer's chat template (no system prompt is added: the agent sends its own); `raw` concatenates
the messages' contents as they are, so an agent that sends a task's prompt as its one user
message gets exactly the tokens that `encode(prompt)` gives, as in the warm start. (Not the
"role: content" lines that `gapless serve` writes for a template-less tokenizer, serve/openai/chat.py:
in training the first call must tokenise as the task's prompt does.)
Not guaranteed: that a chat template nests (a later call's rendering extends the earlier one);
`extend` raises `NotAnExtension` when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from gapless.prompts import PromptEncoder


class NotAnExtension(ValueError):
    """A call's messages do not continue the episode's previous call and its reply."""


class Unrenderable(NotAnExtension):
    """The chat template or the tokenizer refused a call's messages."""


def render(encoder: PromptEncoder, messages: Sequence[tuple[str, str]], generation_prompt: bool) -> str:
    """The text of `messages` ((role, content) pairs) in the run's prompt format."""
    if encoder.format == "raw":
        return "".join(content for _, content in messages)
    plain = [{"role": role, "content": content} for role, content in messages]
    try:
        return encoder.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 -- a template may raise anything on content it did not expect
        raise Unrenderable(
            f"the chat template refused these messages: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None


def encode(encoder: PromptEncoder, text: str) -> list[int]:
    """`encoder.text(text)`; a text the tokenizer refuses is `Unrenderable`."""
    try:
        return encoder.text(text)
    except Exception as exc:  # noqa: BLE001 -- tokenizers raise TypeError, ValueError or their own errors
        raise Unrenderable(f"the tokenizer refused this text: {type(exc).__name__}: {str(exc)[:200]}") from None


@dataclass
class Transcript:
    """The messages of an episode's last call and the context it was sampled from."""

    encoder: PromptEncoder
    messages: list[tuple[str, str]] = field(default_factory=list)
    reply: str | None = None  # the text returned for the last call (None: not answered yet)
    reply_ids: list[int] = field(default_factory=list)  # the ids sampled for it, stop token included

    def first(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The context of the first call."""
        ids = encode(self.encoder, render(self.encoder, messages, generation_prompt=True))
        self.messages = list(messages)
        return ids

    def answered(self, text: str, ids: Sequence[int]) -> None:
        self.reply, self.reply_ids = text, list(ids)

    def extend(self, messages: Sequence[tuple[str, str]]) -> tuple[str, list[int]]:
        """(text, ids) the environment appends after the last reply's sampled ids, so that the
        context of this call is the last one + reply ids + these ids."""
        n = len(self.messages)
        messages = list(messages)
        if self.reply is None:
            raise NotAnExtension("the previous call has not been answered yet")
        if messages[:n] != self.messages:
            raise NotAnExtension(f"the first {n} messages must be the previous call's, unchanged")
        if len(messages) <= n + 1 or messages[n][0] != "assistant" or messages[n][1].strip() != self.reply.strip():
            raise NotAnExtension(f"message {n} must be the assistant's reply as returned, followed by new messages")
        before = render(self.encoder, messages[:n], generation_prompt=True)  # what call k-1 continued
        upto = render(self.encoder, messages[: n + 1], generation_prompt=False)
        full = render(self.encoder, messages, generation_prompt=True)
        content = messages[n][1]
        start = upto.find(content, len(before)) if upto.startswith(before) else -1
        if start < 0 or not full.startswith(upto):
            raise NotAnExtension(
                "the chat template renders this call differently from the previous one; "
                "use model.prompt_format = 'raw' with this checkpoint"
            )
        tail = upto[start + len(content) :] + full[len(upto) :]  # what the template writes after the reply's content
        if self.encoder.format == "chat" and self.reply_ids and self.reply_ids[-1] in self.encoder.stop_ids:
            stop_text = self.encoder.tokenizer.decode([self.reply_ids[-1]])
            if tail.startswith(stop_text):
                tail = tail[len(stop_text) :]  # sampled already: the model's own stop token
        ids = encode(self.encoder, tail)
        self.messages, self.reply, self.reply_ids = messages, None, []
        return tail, ids
