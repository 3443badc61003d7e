"""Supervised warm start on multi-turn transcripts (the tool-use task's counterpart of trainer/warmstart/pairs.py).

A transcript is the prompt plus segments (text, written by the model). Each segment is tokenized
on its own, exactly as a multi-turn environment does during rollouts (model turns end with EOS,
environment text is encoded as it is appended), so the warm-started model learns the very token
sequences it will later sample. The loss is on model segments only: the environment's text is
context, as in RL (Completion.loss_mask). Deterministic in the seed.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from gapless.config import WarmStartConfig
from gapless.models import Policy
from gapless.trainer.warmstart.pairs import supervised_steps

Transcript = tuple[str, Sequence[tuple[str, bool]]]  # (prompt, [(text, is_model), ...])


def transcript_batch(policy: Policy, transcripts: list[Transcript]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs, masks = [], []
    for prompt, segments in transcripts:
        ids, mask = policy.encode(prompt), []
        mask += [0] * len(ids)
        for text, is_model in segments:
            end_of_turn = policy.stop_ids[0] if policy.stop_ids else policy.eos_id
            piece = policy.encode.text(text) + [end_of_turn] if is_model else policy.encode.turn(text)
            ids += piece
            mask += [int(is_model)] * len(piece)
        seqs.append(ids)
        masks.append(mask)
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), policy.pad_id, dtype=torch.long)  # (B, L)
    attention = torch.zeros_like(input_ids)
    loss_mask = torch.zeros((len(seqs), width - 1))  # (B, L-1) position t predicts token t + 1
    for row, (seq, mask) in enumerate(zip(seqs, masks)):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
        loss_mask[row, : len(seq) - 1] = torch.tensor(mask[1:], dtype=torch.float32)
    return input_ids, attention, loss_mask


def warm_start_transcripts(
    policy: Policy,
    sample: Callable[[random.Random], Transcript],
    cfg: WarmStartConfig,
    seed: int,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """`cfg.steps` AdamW steps on batches of `sample(rng)` transcripts (the schedule of trainer/warmstart/pairs.py)."""
    rng = random.Random(seed)
    return supervised_steps(
        policy, lambda: transcript_batch(policy, [sample(rng) for _ in range(cfg.batch_size)]), cfg, log
    )
