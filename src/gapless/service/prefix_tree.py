"""Datums that share a prefix, packed into rows that hold each shared token once.

A multi-turn recipe sends one datum per turn, each repeating the whole conversation before its
turn (the cookbook starts a new datum whenever a turn's rendered history is not an exact extension
of the tokens sampled before it), so most of a call's tokens are the same prefixes again. In a
causal model a position's hidden state depends only on the tokens up to it, so datums that share
their first k tokens share those k positions' states exactly: `pack` merges such datums into one
prefix tree (a trie) per row, and the forward runs over the trees' nodes instead of the datums'
tokens, each node at position id = its depth, attending to itself and its ancestors only
(service/tree_attention.py). Each datum then reads its log-probs at its own path of nodes,
with its own targets (two datums sharing a node may predict different next tokens there).

    pack(sequences, max_tokens, attention_span)  ->  rows (Row) and, per datum, (row, its nodes)

Longest datum first, each joins the row where it adds the least cost (`cost`: the nodes, plus
the row's attention, quadratic in its width) or starts its own row if that is cheaper, each row
within `max_tokens` nodes: datums that share little, such as an SFT batch's separate
conversations, stay one row each (each the plain causal forward of its tokens), and a multi-turn
episode's turns become one tree whose first sequence, its spine, is the episode's last turn.
Guaranteed: every datum's path holds exactly its tokens at positions 0..len-1, and a node's
ancestors are exactly the tokens before it in every datum through it. Not guaranteed: the fewest
nodes overall (the choice of row is greedy).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Row:
    tokens: list[int] = field(default_factory=list)  # one per node; a parent comes before its children
    parents: list[int] = field(default_factory=list)  # the node before it, -1 at a root
    depths: list[int] = field(default_factory=list)  # its position id
    spine: int = 0  # nodes of the first sequence inserted: nodes 0..spine-1 at depths 0..spine-1
    _children: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node

    def __len__(self) -> int:
        return len(self.tokens)

    def shared(self, sequence: list[int]) -> int:
        """How many leading tokens of `sequence` are already a path in this row."""
        node, n = -1, 0
        for token in sequence:
            node = self._children.get((node, token), -2)
            if node == -2:
                break
            n += 1
        return n

    def insert(self, sequence: list[int]) -> list[int]:
        """Add `sequence` as a path from a root; the node of each of its positions."""
        if not self.tokens:
            self.spine = len(sequence)
        path, node = [], -1
        for depth, token in enumerate(sequence):
            child = self._children.get((node, token))
            if child is None:
                child = self._children[(node, token)] = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(depth)
            path.append(child)
            node = child
        return path


def pack(
    sequences: list[list[int]], max_tokens: int, attention_span: int
) -> tuple[list[Row], list[tuple[int, list[int]]]]:
    """Rows of prefix trees holding `sequences`, and for each sequence (its row, its path of nodes).

    Longest sequences first, so that a turn's datum finds the later turn that contains it; each
    joins the row where it adds least to `cost` (or starts its own row where that is cheaper),
    within `max_tokens` nodes a row."""
    rows: list[Row] = []
    where: list[tuple[int, list[int]] | None] = [None] * len(sequences)
    for i in sorted(range(len(sequences)), key=lambda i: -len(sequences[i])):
        sequence = sequences[i]
        best, best_extra = -1, cost(len(sequence), attention_span)  # a row of its own
        for r, row in enumerate(rows):
            grown = len(row) + len(sequence) - row.shared(sequence)
            extra = cost(grown, attention_span) - cost(len(row), attention_span)
            if grown <= max_tokens and extra < best_extra:
                best, best_extra = r, extra
        if best < 0:
            rows.append(Row())
            best = len(rows) - 1
        where[i] = (best, rows[best].insert(sequence))
    return rows, where


def cost(nodes: int, attention_span: int) -> float:
    """Relative cost of a row's forward and backward: linear in its nodes (the layers' matmuls) plus
    its attention, quadratic in them (each query against the row's keys before it). `attention_span`
    is the width at which the two are equal; the square makes merging two sequences pay off only
    where they share enough: never for sequences that share nothing."""
    return nodes + nodes * nodes / attention_span


def ancestors(row: Row, start: int) -> torch.Tensor:
    """(len(row) - start, len(row)) boolean: True where node start + i may attend, at itself and its
    ancestors, for `start` <= row.spine (the nodes before it are a chain, each the parent of the
    next). Parents come before their children, so each node copies its parent's finished row."""
    n = len(row)
    mask = np.zeros((n - start, n), dtype=bool)
    for i in range(start, n):
        parent = row.parents[i]
        if parent >= start:
            mask[i - start, : parent + 1] = mask[parent - start, : parent + 1]
        elif parent >= 0:  # a node of the chain: its ancestors are the chain up to it
            mask[i - start, : parent + 1] = True
        mask[i - start, i] = True
    return torch.from_numpy(mask)
