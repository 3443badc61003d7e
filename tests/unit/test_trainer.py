"""The trainer on the project's own sampler: micro-batching is exact for every variant, and with
zero staleness every importance ratio is 1 and the corrections change nothing."""

import copy

import pytest
import torch

from gapless.config import TrainerConfig
from gapless.generate.sampler import TorchSampler
from gapless.trainer.batch import build_batch
from gapless.trainer.losses import LOSSES
from gapless.trainer.micro_batches import balanced_cuts, padded_tokens
from gapless.trainer.normalisers import StepNorm
from gapless.trainer.trainer import GRPOTrainer
from gapless.types import Completion, SamplingParams

GROUP_SIZE = 4
MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def sampled(tiny_policy, problems):
    """A fresh copy of the tiny policy and a batch it sampled: 3 groups of 4, one infra failure."""
    model = copy.deepcopy(tiny_policy.model)
    sampler = TorchSampler(model, tiny_policy.eos_id, tiny_policy.pad_id)
    prompts = [tiny_policy.encode(p.prompt) for p in problems[:3] for _ in range(GROUP_SIZE)]
    completions = sampler.generate(prompts, SamplingParams(temperature=0.7, max_new_tokens=MAX_NEW_TOKENS, seed=5))
    advantages = torch.randn(len(completions), generator=torch.Generator().manual_seed(0)).tolist()
    valid = [i != 6 for i in range(len(completions))]
    group_ids = [i // GROUP_SIZE for i in range(len(completions))]
    return model, build_batch(completions, advantages, valid, tiny_policy.pad_id, group_ids)


def gradients(model, batch, cfg: TrainerConfig):
    trainer = GRPOTrainer(model, cfg, temperature=0.7, max_new_tokens=MAX_NEW_TOKENS)
    model.zero_grad(set_to_none=True)
    norm = StepNorm.of(batch.loss_mask, batch.group_ids, MAX_NEW_TOKENS)
    stats = trainer.accumulate_gradients(batch, norm, torch.zeros_like(batch.behaviour_logprobs))
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, stats


def relative_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """|a - b| / |a| over all parameters: near-zero entries make elementwise tolerances meaningless."""
    num = sum(float(((x - y) ** 2).sum()) for x, y in zip(a, b))
    return (num / sum(float((x**2).sum()) for x in a)) ** 0.5


def off_policy(batch, scale: float = 0.3):
    """The same batch as if sampled by a slightly different policy: ratios away from 1."""
    noise = scale * torch.randn(batch.behaviour_logprobs.shape, generator=torch.Generator().manual_seed(1))
    out = copy.copy(batch)
    out.behaviour_logprobs = batch.behaviour_logprobs + noise * batch.loss_mask
    return out


VARIANTS = [dict(loss=name) for name in sorted(LOSSES)] + [
    dict(loss="dapo", clip_eps_high=0.28, kl_coef=0.05, kl_estimator="k1", entropy_coef=0.01),
    dict(loss="grpo", old_logprobs="trainer", correction="tis", correction_level="sequence", tis_cap=1.5),
    dict(loss="gspo", old_logprobs="trainer", correction="mis", mis_low=0.8, mis_high=1.25, kl_coef=0.1),
    dict(loss="cispo", clip_eps=0.9, clip_eps_high=1.0, old_logprobs="trainer", correction="tis", entropy_coef=0.02),
    dict(
        loss="drgrpo", old_logprobs="trainer", correction="mis", correction_level="sequence", mis_low=0.2, mis_high=5.0
    ),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_micro_batches_give_the_one_batch_gradient(sampled, variant):
    model, batch = sampled
    batch = off_policy(batch)
    whole, whole_stats = gradients(model, batch, TrainerConfig(micro_batch_size=len(batch), **variant))
    split, split_stats = gradients(model, batch, TrainerConfig(micro_batch_size=5, **variant))  # cuts groups
    for a, b in zip(whole, split):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert split_stats.loss == pytest.approx(whole_stats.loss, rel=1e-5, abs=1e-7)
    assert split_stats.offpolicy == pytest.approx(whole_stats.offpolicy, rel=1e-5)
    assert any(bool(g.abs().sum() > 0) for g in whole)


@pytest.mark.parametrize(
    "correction, level", [("tis", "token"), ("tis", "sequence"), ("mis", "token"), ("mis", "sequence")]
)
def test_zero_staleness_ratios_are_one_and_corrections_change_nothing(sampled, correction, level):
    """Invariant 5 through the trainer: the generator's log-probs are the trainer's (fp32 tolerance)."""
    model, batch = sampled
    base = dict(old_logprobs="trainer", micro_batch_size=5)
    plain, plain_stats = gradients(model, batch, TrainerConfig(**base))
    corrected, stats = gradients(model, batch, TrainerConfig(**base, correction=correction, correction_level=level))
    assert stats.ratio_mean == 1.0 and stats.clip_frac == 0.0  # PPO ratio current / start: exactly 1
    assert stats.offpolicy["offpolicy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats.offpolicy["offpolicy/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert stats.offpolicy["offpolicy/behaviour_kl"] < 1e-9
    assert stats.offpolicy.get("offpolicy/clipped_frac", 0.0) == 0.0
    assert stats.offpolicy.get("offpolicy/masked_frac", 0.0) == 0.0
    # token log-probs of sampler and trainer differ by < 1e-6 here, so rho - 1 does too
    assert stats.loss == pytest.approx(plain_stats.loss, rel=1e-5, abs=1e-8)
    assert relative_difference(plain, corrected) < 1e-5


def test_zero_staleness_behaviour_and_trainer_old_logprobs_agree(sampled):
    model, batch = sampled
    behaviour, stats = gradients(model, batch, TrainerConfig(old_logprobs="behaviour"))
    trainer, _ = gradients(model, batch, TrainerConfig(old_logprobs="trainer"))
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert relative_difference(behaviour, trainer) < 1e-5


def test_off_policy_corrections_act(sampled):
    model, batch = sampled
    stale = off_policy(batch)
    _, stats = gradients(
        model, stale, TrainerConfig(old_logprobs="trainer", correction="mis", mis_low=0.8, mis_high=1.25)
    )
    assert 0.0 < stats.offpolicy["offpolicy/masked_frac"] < 1.0
    assert stats.offpolicy["offpolicy/behaviour_kl"] > 1e-3


def test_later_epochs_use_the_start_of_step_log_probs(sampled):
    model = copy.deepcopy(sampled[0])
    trainer = GRPOTrainer(model, TrainerConfig(old_logprobs="trainer", epochs=2, lr=1e-2), 0.7, MAX_NEW_TOKENS)
    stats = trainer.step(sampled[1])
    # update 2 divides by the log-probs of update 1 (before the first optimizer step): no longer 1
    assert stats.ratio_mean != 1.0 and trainer.version == 1


def test_a_step_without_loss_tokens_publishes_unchanged_weights(sampled):
    model = copy.deepcopy(sampled[0])
    trainer = GRPOTrainer(model, TrainerConfig(lr=1e-2), 0.7, MAX_NEW_TOKENS)
    trainer.step(sampled[1])  # gives AdamW momentum
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = trainer.step(sampled[1].select([]))  # every group dropped
    assert stats.num_tokens == 0 and trainer.version == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_drgrpo_needs_the_generation_cap(sampled):
    with pytest.raises(ValueError, match="max_new_tokens"):
        GRPOTrainer(sampled[0], TrainerConfig(loss="drgrpo"))


def test_micro_batches_cover_every_row_once_sorted_and_cut_to_their_longest_row(sampled):
    _, batch = sampled
    lengths = batch.attention_mask.sum(-1)
    assert len(set(lengths.tolist())) > 1  # rows of different lengths, or the test proves nothing
    parts = batch.micro_batches(5)
    assert len(parts) <= -(-len(batch) // 5)
    assert max(mb.input_ids.numel() for _, mb in parts) <= 5 * int(lengths.max())  # never above the plain split's peak
    order = torch.cat([index for index, _ in parts])
    assert sorted(order.tolist()) == list(range(len(batch)))
    assert lengths[order].tolist() == sorted(lengths.tolist())
    for index, mb in parts:
        width = int(lengths[index].max())
        assert mb.input_ids.shape == (len(index), width) and mb.loss_mask.shape == (len(index), width - 1)
        assert torch.equal(mb.input_ids, batch.input_ids[index, :width])
        assert torch.equal(mb.behaviour_logprobs, batch.behaviour_logprobs[index, : width - 1])
        assert batch.loss_mask[index, width - 1 :].sum() == 0  # nothing cut off trained
    assert sum(float(mb.loss_mask.sum()) for _, mb in parts) == float(batch.loss_mask.sum())


def test_balanced_cuts_minimise_the_largest_micro_batch():
    """Against an exhaustive search over every way to cut sorted lengths into contiguous ranges."""
    import functools
    import random

    rng = random.Random(0)
    for _ in range(200):
        lengths = sorted(rng.randint(2, 40) for _ in range(rng.randint(1, 12)))
        parts = rng.randint(1, 4)

        @functools.cache
        def best(stop: int, left: int) -> float:  # least largest range over rows [0, stop) in `left` ranges
            if stop == 0:
                return 0
            if left == 0:
                return float("inf")
            return min(max(best(start, left - 1), (stop - start) * lengths[stop - 1]) for start in range(stop))

        cuts = balanced_cuts(lengths, parts)
        assert len(cuts) <= parts and cuts[0][0] == 0 and cuts[-1][1] == len(lengths)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(cuts, cuts[1:]))
        assert max((stop - start) * lengths[stop - 1] for start, stop in cuts) == best(len(lengths), parts)


def test_padded_tokens_are_the_positions_the_micro_batches_hold():
    """What the simulator prices a step by is what `Batch.micro_batches` builds (rows x width)."""
    import random

    rng = random.Random(1)
    for _ in range(20):
        prompts = [rng.randint(2, 9) for _ in range(rng.randint(1, 14))]
        completions = []
        for p in prompts:
            n = rng.randint(1, 30)
            completions.append(Completion(list(range(p)), list(range(n)), [0.0] * n, [0] * n, "stop", ""))
        batch = build_batch(completions, [0.0] * len(completions), [True] * len(completions), 0)
        size = rng.randint(1, 5)
        held = sum(len(index) * mb.input_ids.shape[1] for index, mb in batch.micro_batches(size))
        assert padded_tokens([len(c.prompt_ids) + len(c.token_ids) for c in completions], size) == held
    # by hand: rows 1, 2, 3, 10 in two micro-batches: [1, 2, 3] padded to 3, [10] alone: 9 + 10
    assert padded_tokens([10, 2, 1, 3], 2) == 19
