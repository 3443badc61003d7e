"""Chat messages to prompt token ids: the tokenizer's own chat template, or a plain fallback.

With a chat template (`tokenizer.chat_template`), the messages are rendered and tokenized by
`apply_chat_template(..., add_generation_prompt=True, tokenize=True)`, straight to ids: no text
round trip and no special tokens added on top of the template's own (so no doubled BOS).
Without one (a checkpoint that ships none), each message becomes a "role: content" line and the
prompt ends with "assistant:". Content given as a list of text parts is joined with newlines.
Not supported: tools, images and audio parts (refused by the request model, openai_params.py).
"""

from __future__ import annotations

from typing import Sequence

from gapless.serve.openai_params import Message
from gapless.serve.protocol import InvalidRequest


def chat_prompt_ids(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
    plain = [{"role": m.role, "content": m.text} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                return_dict=False)
        except Exception as exc:  # noqa: BLE001 -- a template's own complaint (e.g. roles must alternate) is the user's to fix
            raise InvalidRequest(f"the model's chat template refused these messages: {exc}", "messages") from None
        return list(ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain) + ("assistant:" if add_generation_prompt else "")
    return tokenizer.encode(text, add_special_tokens=False)
