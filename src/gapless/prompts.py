"""Prompt formats: how a task's prompt text becomes the tokens the model continues.

`model.prompt_format`: 'raw' encodes the text as it is (no special tokens added); 'chat' renders
the checkpoint's chat template around it -- an optional system message, the prompt as the user's
message, the generation prompt that opens the assistant's turn -- and stops generation on the
template's end-of-turn token; 'auto' (default) is 'chat' when the tokenizer has a template.
`PromptEncoder` is called wherever a prompt is encoded (`Policy.encode`); `turn(text)` encodes
an environment reply inside an episode (the tool task) as the template's next user turn,
following the model's end-of-turn token; `text(text)` is the raw encoding of any other text.
`keep(prompts)` names the task prompts of a process (its train and eval tasks): each is encoded on
its first call and kept, so a process encodes a task's prompt once however often it samples it.

Guaranteed (tests/unit/test_prompts.py): the chat tokens are exactly the template's rendering,
tokenised without adding special tokens, so a template that writes its own BOS gets one BOS,
never two; the end-of-turn token is the special token the template writes right after an
assistant message; a kept prompt's ids equal a fresh encoding's, and each call returns a list of
its own. Not guaranteed: that a template nests (a later turn's rendering extends the
earlier one's) -- `turn` checks it and raises if this template does not.
"""

from __future__ import annotations

from typing import Iterable, Literal

PromptFormat = Literal["auto", "raw", "chat"]
_PROBE = "ZQXJ"  # an assistant message to locate where a turn's content ends in a rendering


class PromptEncoder:
    def __init__(
        self,
        tokenizer,
        prompt_format: PromptFormat = "auto",
        system_prompt: str | None = None,
        source: str = "the tokenizer",
    ):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if prompt_format == "chat" and not has_template:
            raise ValueError(
                f"model.prompt_format = 'chat' but {source} has no chat template; set it to 'raw' or 'auto'"
            )
        self.tokenizer = tokenizer
        self.format: Literal["raw", "chat"] = (
            "chat" if prompt_format == "chat" or (prompt_format == "auto" and has_template) else "raw"
        )
        self.system_prompt = system_prompt
        self.stop_ids: tuple[int, ...] = (self._end_of_turn(),) if self.format == "chat" else ()
        self._turn_cut: tuple[str, int] | None = None
        # the kept prompts: None until first encoded; only these, so one-off texts (a judge's) do not pile up
        self._kept: dict[str, tuple[int, ...] | None] = {}

    def keep(self, prompts: Iterable[str]) -> None:
        """Keep the encodings of these prompts once made (this process's task prompts)."""
        for prompt in prompts:
            self._kept.setdefault(prompt, None)

    def __call__(self, text: str) -> list[int]:
        """A prompt: raw tokens, or the first user turn of a conversation ready for the reply."""
        if text not in self._kept:
            return self._encode(text)
        ids = self._kept[text]
        if ids is None:
            ids = self._kept[text] = tuple(self._encode(text))
        return list(ids)  # a list of its own: a caller may extend it

    def _encode(self, text: str) -> list[int]:
        if self.format == "raw":
            return self.text(text)
        return self.text(self._render(self._messages(text), generation_prompt=True))

    def text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def turn(self, text: str) -> list[int]:
        """An environment reply after the model's turn (which ended with its stop token)."""
        if self.format == "raw":
            return self.text(text)
        before, cut = self._turn_cut or self._find_turn_cut()
        after = self._render(self._messages("U", _PROBE, text), generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "chat template: a later turn's rendering does not extend the earlier one; "
                "multi-turn episodes need model.prompt_format = 'raw' with this checkpoint"
            )
        return self.text(after[cut:])

    # ---- the template -------------------------------------------------------------------------
    def _messages(self, *contents: str) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as err:  # a template's own raise_exception (e.g. no system role)
            raise ValueError(f"chat template refused the conversation ({err}); check model.system_prompt") from None

    def _end_of_turn(self) -> int:
        """The first special token the template writes after an assistant message's content."""
        rendered = self._render(self._messages("U", _PROBE), generation_prompt=False)
        tail = rendered[rendered.rindex(_PROBE) + len(_PROBE) :]
        special = set(self.tokenizer.all_special_ids) | set(getattr(self.tokenizer, "added_tokens_decoder", {}))
        for token in self.text(tail):
            if token in special:
                return token
        if self.tokenizer.eos_token_id is None:
            raise ValueError(
                "chat template writes no special token after an assistant turn and the tokenizer has no eos"
            )
        return self.tokenizer.eos_token_id

    def _find_turn_cut(self) -> tuple[str, int]:
        """What of a rendered exchange the context already holds when the model stops: the
        rendering up to the probe's end plus the end-of-turn token's text."""
        rendered = self._render(self._messages("U", _PROBE), generation_prompt=False)
        cut = rendered.rindex(_PROBE) + len(_PROBE)
        stop_text = self.tokenizer.decode([self.stop_ids[0]])
        if rendered[cut : cut + len(stop_text)] == stop_text:
            cut += len(stop_text)
        self._turn_cut = (rendered[:cut], cut)
        return self._turn_cut
