"""Automatic prefix caching: keys/values of earlier contexts, reused by a later context that starts
with the same tokens (a multi-turn client re-sending its growing conversation).

An entry is a token sequence and the keys/values of exactly those tokens under the engine's
current weights (the runner's stash layout: per layer (1, kv_heads, n, head_dim)). `lookup(tokens)`
returns the longest entry prefix shared with `tokens`, sliced to that length (views, no copy);
the engine prefills only the rest. Entries are found through a hash chain of full
`BLOCK`-token blocks (as vLLM's automatic prefix caching keys its blocks), then the match is
extended token by token past the last shared block and checked token for token, so a hash
collision can never serve another context's keys.

Guaranteed: the cache holds keys/values of one set of weights; the engine `clear`s it on every
weight change (a push, a LoRA adapter, another snapshot), so a hit is exactly what a fresh
prefill would compute up to float rounding of the batch composition. Memory stays within
`budget_bytes`: the least recently used entries are evicted first, and an entry larger than the
budget is not kept. An entry that is a prefix of a newer one is dropped (the newer covers it).
Not guaranteed: sharing between entries. Each holds its own copy of its whole prefix, so the
n completions of one prompt hold n copies of the prompt's keys/values; matches shorter than one
block are not looked for.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK = 16  # tokens per hashed block: the shortest match worth a lookup

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, kv_heads, n, head_dim)


@dataclass
class PrefixCacheStats:
    """Counters since creation, one lookup per distinct context the engine prefills."""

    hits: int = 0  # lookups that reused at least one block
    misses: int = 0
    hit_tokens: int = 0  # context tokens whose keys/values came from the cache
    evictions: int = 0
    invalidations: int = 0  # clears on a weight change


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: KV
    num_bytes: int
    chain: list[int] = field(default_factory=list)  # hash of each full block's prefix


def _chain(tokens: tuple[int, ...]) -> list[int]:
    """Hash of tokens[: (i + 1) * BLOCK] for each full block i, each from the one before."""
    out, h = [], 0
    for i in range(len(tokens) // BLOCK):
        h = hash((h, tokens[i * BLOCK : (i + 1) * BLOCK]))
        out.append(h)
    return out


def _shared(a: tuple[int, ...], b: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of a and b, given that the first `start` tokens agree."""
    n = min(len(a), len(b))
    while start < n and a[start] == b[start]:
        start += 1
    return start


class PrefixCache:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.stats = PrefixCacheStats()
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # least recently used first
        self._by_block: dict[int, set[tuple[int, ...]]] = {}  # chain hash -> entries holding that prefix
        self._by_last: dict[int, set[tuple[int, ...]]] = {}  # chain hash -> entries whose last full block it is

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: tuple[int, ...]) -> tuple[KV, int] | None:
        """The keys/values of the longest cached prefix of `tokens` and its length (>= BLOCK), or None."""
        entry, length = self._longest(tokens)
        if entry is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(entry.tokens)
        self.stats.hits += 1
        self.stats.hit_tokens += length
        return [(k[:, :, :length], v[:, :, :length]) for k, v in entry.kv], length

    def insert(self, tokens: tuple[int, ...], kv: KV) -> None:
        """Keep `kv`, the keys/values of `tokens` (the caller hands over tensors it will not change)."""
        if len(tokens) < BLOCK:
            return
        covering, length = self._longest(tokens)
        if covering is not None and length == len(tokens):  # already held, as itself or inside a longer entry
            self._entries.move_to_end(covering.tokens)
            return
        num_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if num_bytes > self.budget_bytes:
            return
        entry = _Entry(tokens, kv, num_bytes, _chain(tokens))
        for h in entry.chain:  # entries that are prefixes of this one are covered by it
            for old in [t for t in self._by_last.get(h, ()) if len(t) <= len(tokens) and tokens[: len(t)] == t]:
                self._remove(old)
        self._entries[tokens] = entry
        for h in entry.chain:
            self._by_block.setdefault(h, set()).add(tokens)
        self._by_last.setdefault(entry.chain[-1], set()).add(tokens)
        self.num_bytes += num_bytes
        while self.num_bytes > self.budget_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1

    def clear(self) -> None:
        """Drop every entry (the weights changed)."""
        if self._entries:
            self.stats.invalidations += 1
        self._entries.clear()
        self._by_block.clear()
        self._by_last.clear()
        self.num_bytes = 0

    def _longest(self, tokens: tuple[int, ...]) -> tuple[_Entry | None, int]:
        candidates, depth = (), 0
        for i, h in enumerate(_chain(tokens)):
            found = self._by_block.get(h)
            if not found:
                break
            candidates, depth = found, (i + 1) * BLOCK
        # the candidates share `depth` tokens by hash: rank them by the cheap tail past it, then
        # check the whole prefix of the best only (many entries may share a long system prompt)
        ranked = sorted(((_shared(key, tokens, depth), key) for key in candidates), key=lambda p: p[0], reverse=True)
        for length, key in ranked:
            if key[:depth] == tokens[:depth]:  # else a hash collision, not a shared prefix
                return self._entries[key], length
        return None, 0

    def _remove(self, tokens: tuple[int, ...]) -> None:
        entry = self._entries.pop(tokens)
        for index, hashes in ((self._by_block, entry.chain), (self._by_last, entry.chain[-1:])):
            for h in hashes:
                held = index[h]
                held.discard(tokens)
                if not held:
                    del index[h]
        self.num_bytes -= entry.num_bytes
