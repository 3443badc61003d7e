"""Sampling whole groups: N completions of each prompt, each group with its own seed.

Both the synchronous loop and the pipeline's generator ask for groups this way, so that with the
same seeds and the same batch composition they sample the same tokens. A stepped engine gets one
request per group (its N samples share the prompt's prefill); the simple reference sampler gets
one `generate` call per group.
"""

from __future__ import annotations

from gapless.generate.protocol import Generator, SteppedGenerator
from gapless.types import Completion, SamplingParams


def generate_groups(
    generator: Generator, prompts: list[list[int]], n: int, params: list[SamplingParams]
) -> list[list[Completion]]:
    """`n` completions of each prompt, group i sampled with `params[i]`; groups in prompt order."""
    if not isinstance(generator, SteppedGenerator):
        return [generator.generate([prompt] * n, p) for prompt, p in zip(prompts, params)]
    if generator.has_work:
        raise RuntimeError("generate_groups needs an idle engine")
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        generator.add_request(prompt, p, n, request_id=str(i))
    done: dict[str, list[Completion]] = {str(i): [] for i in range(len(prompts))}
    while generator.has_work:
        for completion in generator.step():
            done[completion.request_id].append(completion)
    return [sorted(done[str(i)], key=lambda c: c.index) for i in range(len(prompts))]
