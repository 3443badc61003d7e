"""An SDK `SampleRequest` (tinker 0.38) as the scheduler's `SampleRequest`: prompt, parameters, stops.

Pure translation with validation: token ids outside the vocabulary, a non-text prompt chunk or
`num_samples < 1` raise `UserError` naming the field. The SDK's conventions kept:
- `stop=None` stops at EOS; a list of token ids *replaces* EOS (`[]` disables stopping, so a
  sample runs to `max_tokens`, as the SDK documents); stop strings end a sample in addition to EOS;
- `temperature <= 0` is greedy; `top_k = -1` is no limit;
- `seed=None` draws a fresh seed per request (two calls with the same prompt differ), a given seed
  reproduces the same samples (sample j uses the engine's stream (seed, j));
- `max_tokens=None` fills the context, at most `default_max_tokens`.
"""

from __future__ import annotations

import hashlib
import itertools

from tinker import types as tt

from gapless.serve.protocol import SampleRequest
from gapless.service.models import UserError
from gapless.types import SamplingParams

_fresh = itertools.count()


def scheduler_request(body: tt.SampleRequest, vocab_size: int, context: int, default_max_tokens: int) -> SampleRequest:
    prompt: list[int] = []
    for chunk in body.prompt.chunks:
        if not isinstance(chunk, tt.EncodedTextChunk):
            raise UserError(f"only encoded_text prompt chunks are served (got {type(chunk).__name__})")
        prompt += list(chunk.tokens)
    _check_ids("prompt token", prompt, vocab_size)
    if body.num_samples < 1:
        raise UserError(f"num_samples must be at least 1 (got {body.num_samples})")
    sp = body.sampling_params
    max_tokens = sp.max_tokens if sp.max_tokens is not None else min(default_max_tokens, context - len(prompt))
    stop_strings, stop_ids, ignore_eos = stops(sp.stop)
    _check_ids("stop token", stop_ids, vocab_size)
    seed = sp.seed if sp.seed is not None else fresh_seed(body.sampling_session_id, body.seq_id)
    greedy = sp.temperature <= 0
    params = SamplingParams(
        temperature=1.0 if greedy else sp.temperature,
        top_p=sp.top_p,
        top_k=max(sp.top_k, 0),
        max_new_tokens=max_tokens,
        greedy=greedy,
        seed=seed,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
    )
    return SampleRequest(tuple(prompt), params, body.num_samples, stop_strings, source="tinker")


def stops(stop) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
    """SDK `stop` -> (stop strings, stop token ids, ignore_eos)."""
    if stop is None:
        return (), (), False
    if isinstance(stop, str):
        return (stop,), (), False
    stop = list(stop)
    if stop and all(isinstance(s, str) for s in stop):
        return tuple(stop), (), False
    return (), tuple(int(s) for s in stop), True


def fresh_seed(*ids) -> int:
    """A seed for a request that gives none: distinct for every request of this process."""
    return int.from_bytes(hashlib.sha256(repr((*ids, next(_fresh))).encode()).digest()[:7], "little")


def _check_ids(what: str, ids, vocab_size: int) -> None:
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise UserError(f"{what} id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
