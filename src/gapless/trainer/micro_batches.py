"""Where a step's length-sorted rows are cut into micro-batches, and what that costs in padding.

Torch-free, so that the capacity simulator (simulate/run.py) prices a training step with the
trainer's own cuts: `micro_batch_rows` is how `Batch.micro_batches` (batch.py) cuts a step, and
`padded_tokens` the number of token positions its forward and backward passes then compute
(every row of a micro-batch right-padded to that micro-batch's longest row). `balanced_cuts` is
exact (a binary search over the bound). `token_budget_rows` is the cut of a packed step
(`trainer.max_tokens_per_micro_batch`): micro-batches bounded by their real tokens, no padding.
"""

from __future__ import annotations


def balanced_cuts(lengths: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut ascending `lengths` into at most `parts` contiguous [start, stop) ranges minimising the
    largest rows x longest-row product. For a bound A, filling ranges greedily from the longest
    row down (each as many rows as fit under A) needs the fewest ranges, so a binary search over
    A on that greedy count finds the least A that `parts` ranges reach."""

    def cuts(bound: int) -> list[tuple[int, int]]:
        out, stop = [], len(lengths)
        while stop > 0:
            start = max(0, stop - max(1, bound // lengths[stop - 1]))
            out.append((start, stop))
            stop = start
        return out[::-1]

    if not lengths:
        return []
    lo, hi = 1, -(-len(lengths) // parts) * lengths[-1]  # the even split of sorted rows reaches hi
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(cuts(mid)) <= parts else (mid + 1, hi)
    return cuts(lo)


def micro_batch_rows(lengths: list[int], micro_batch_size: int) -> list[tuple[list[int], int]]:
    """How the trainer cuts a step whose rows have `lengths` (tokens, prompt included):
    (row indices, width) per micro-batch, ceil(rows / micro_batch_size) of them over the rows
    sorted by length (stable), each padded to its own longest row (at least 2 positions: a row
    predicts its next token)."""
    widths = [max(n, 2) for n in lengths]
    order = sorted(range(len(widths)), key=widths.__getitem__)
    parts = -(-len(order) // micro_batch_size)
    cuts = balanced_cuts([widths[i] for i in order], parts)
    return [(order[start:stop], widths[order[stop - 1]]) for start, stop in cuts]


def padded_tokens(lengths: list[int], micro_batch_size: int) -> int:
    """Token positions the trainer computes for a step whose rows have `lengths`: rows x width
    summed over its micro-batches (`micro_batch_rows`)."""
    return sum(len(rows) * width for rows, width in micro_batch_rows(lengths, micro_batch_size))


def token_budget_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """How the trainer cuts a packed step whose rows have `lengths` (tokens, prompt included):
    the rows sorted by length (stable) and filled greedily into micro-batches of at most
    `max_tokens` tokens in all; a row longer than `max_tokens` is a micro-batch of its own.
    Contiguous greedy filling gives the fewest micro-batches of sorted rows, and rows of similar
    length share one (their padded loss layout stays near their packed size)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    out: list[list[int]] = []
    total = 0
    for row in order:
        if out and total + lengths[row] <= max_tokens:
            out[-1].append(row)
            total += lengths[row]
        else:
            out.append([row])
            total = lengths[row]
    return out
