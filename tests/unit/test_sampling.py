"""Per-row sampling: truncation, the recorded log-prob, greedy rows, and the random streams."""

import math

import torch

from gapless.generate.sampling import RowSettings, sample_rows, sample_seed, uniform_stream


def _rows(batch, temperature=1.0, top_p=1.0, top_k=0, greedy=False):
    greedy_t = torch.full((batch,), greedy)
    return RowSettings(
        torch.full((batch,), temperature),
        torch.full((batch,), top_p),
        torch.full((batch,), top_k),
        greedy_t,
        any_truncation=top_p < 1 or top_k > 0,
        any_greedy=greedy,
        all_greedy=greedy,
    )


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def test_inverse_cdf_follows_the_distribution():
    u = torch.linspace(0, 0.999, 1000)
    tokens, logp = sample_rows(PROBS.log().expand(1000, 4), _rows(1000), u)
    freq = torch.bincount(tokens, minlength=4) / 1000
    assert torch.allclose(freq, PROBS, atol=0.01)
    assert torch.allclose(logp, PROBS.log()[tokens], atol=1e-6)


def test_top_k_and_top_p_keep_the_head_and_renormalise_the_logprob():
    u = torch.linspace(0, 0.999, 500)
    tokens, logp = sample_rows(PROBS.log().expand(500, 4), _rows(500, top_k=2), u)
    assert set(tokens.tolist()) == {0, 1}
    # log p under the truncated distribution actually sampled from: p / (0.5 + 0.3)
    assert torch.allclose(logp, (PROBS[tokens] / 0.8).log(), atol=1e-6)
    tokens, logp = sample_rows(PROBS.log().expand(500, 4), _rows(500, top_p=0.9), u)
    assert set(tokens.tolist()) == {0, 1, 2}  # 0.5 + 0.3 < 0.9: the third token completes the nucleus
    assert torch.allclose(logp, (PROBS[tokens] / 0.95).log(), atol=1e-6)


def test_temperature_scales_the_recorded_logprob():
    logits = PROBS.log()[None]
    tokens, logp = sample_rows(logits, _rows(1, temperature=0.5), torch.tensor([0.3]))
    assert math.isclose(float(logp[0]), float(torch.log_softmax(logits / 0.5, -1)[0, tokens[0]]), abs_tol=1e-6)


def test_greedy_rows_mix_with_sampled_rows():
    logits = PROBS.log().expand(2, 4)
    rows = RowSettings(
        torch.tensor([1.0, 1.0]),
        torch.ones(2),
        torch.zeros(2, dtype=torch.long),
        torch.tensor([True, False]),
        any_truncation=False,
        any_greedy=True,
        all_greedy=False,
    )
    tokens, _ = sample_rows(logits, rows, torch.tensor([0.99, 0.99]))
    assert tokens.tolist() == [0, 3]


def test_streams_are_fixed_by_seed_and_index():
    assert torch.equal(uniform_stream(sample_seed(7, 3), 5), uniform_stream(sample_seed(7, 3), 5))
    assert not torch.equal(uniform_stream(sample_seed(7, 3), 5), uniform_stream(sample_seed(7, 4), 5))
    assert torch.equal(uniform_stream(11, 8)[:5], uniform_stream(11, 5))  # a prefix does not depend on the length
