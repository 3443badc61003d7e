"""Where a step's length-sorted rows are cut into micro-batches, and what that costs in padding.

Torch-free, so that the capacity simulator (simulate/run.py) prices a training step with the
trainer's own cuts. `balanced_cuts` is exact (a binary search over the bound); `padded_tokens`
is the number of token positions the forward and backward passes compute: every row of a
micro-batch is right-padded to that micro-batch's longest row (batch.py).
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


def padded_tokens(lengths: list[int], micro_batch_size: int) -> int:
    """Token positions of a step whose rows have `lengths`, cut as the trainer cuts them:
    ceil(rows / micro_batch_size) micro-batches, each padded to its own longest row."""
    ordered = sorted(lengths)
    parts = -(-len(ordered) // micro_batch_size)
    return sum((stop - start) * ordered[stop - 1] for start, stop in balanced_cuts(ordered, parts))
