"""Supervised warm start: teach a randomly initialised model the task's format before RL.

A random model never writes valid code (or a number after "Answer:"), so RL alone would see only
zero-reward groups. The warm start trains on (prompt, demonstration + EOS) pairs of the train
split, loss on completion tokens only, for a short schedule. The environment's teacher
(`envs.base.Teacher`) writes the demonstrations and, like real warm-start data, they are
imperfect: part of the time the teacher makes its typical mistake (for the code task a solution
that only fits the visible examples). The warm-started model therefore has habits that the
reward does not like: the room RL is measured in. Deterministic in the seed.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from gapless.config import WarmStartConfig
from gapless.envs.base import Task, Teacher
from gapless.models import Policy
from gapless.trainer.batch import token_logprobs

Batch3 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids (B, L), attention mask (B, L), loss mask (B, L-1)


def supervised_batch(policy: Policy, pairs: list[tuple[str, str]]) -> Batch3:
    seqs, starts = [], []
    for prompt, target in pairs:
        p = policy.encode(prompt)
        seqs.append(p + policy.encode.text(target) + [policy.stop_ids[0] if policy.stop_ids else policy.eos_id])
        starts.append(len(p))
    return completion_batch(seqs, starts, policy.pad_id)


def completion_batch(seqs: list[list[int]], starts: list[int], pad_id: int) -> Batch3:
    """Right-padded token sequences with the loss on each one's tokens from `starts[i]` on."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, L)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(seqs), width - 1))  # (B, L-1)
    for row, (seq, start) in enumerate(zip(seqs, starts)):
        ids[row, : len(seq)] = torch.tensor(seq)
        attn[row, : len(seq)] = 1
        mask[row, start - 1 : len(seq) - 1] = 1.0
    return ids, attn, mask


def warm_start(
    policy: Policy,
    problems: list[Task],
    teacher: Teacher,
    cfg: WarmStartConfig,
    seed: int,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    rng = random.Random(seed)

    def next_batch() -> Batch3:
        chosen = rng.sample(problems, min(cfg.batch_size, len(problems)))
        return supervised_batch(policy, [(p.prompt, teacher.demonstration(p, rng)) for p in chosen])

    return supervised_steps(policy, next_batch, cfg, log)


def supervised_steps(
    policy: Policy,
    next_batch: Callable[[], Batch3],
    cfg: WarmStartConfig,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """`cfg.steps` AdamW steps (linear warm-up over 20 steps, grad clip 1.0) of the masked
    negative log-likelihood of `next_batch()` (ids, attention mask, loss mask); returns the losses."""
    model = policy.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    losses = []
    model.train()
    for step in range(cfg.steps):
        ids, attn, mask = next_batch()
        loss = -(token_logprobs(model, ids, attn) * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log is not None:
            log(step, losses[-1])
    model.eval()
    return losses
