"""The trainer's log-probs without a (B, T, V) log-softmax, and without the LM head over prompts."""

import pytest
import torch

from gapless.trainer.batch import first_trained_position, token_logprobs, token_logprobs_and_entropy
from gapless.trainer.selected_logprobs import selected_logprobs


def plain(logits, targets, temperature):
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradient_equal_the_log_softmax(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 97, generator=gen) * 4).requires_grad_()
    targets = torch.randint(0, 97, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)
    mine, entropy = selected_logprobs(logits, targets, temperature, with_entropy=True)
    (mine * weights).sum().backward()
    grad, logits.grad = logits.grad.clone(), None
    theirs, their_entropy = plain(logits, targets, temperature)
    (theirs * weights).sum().backward()
    assert torch.allclose(mine, theirs, atol=1e-5) and torch.allclose(entropy, their_entropy, atol=1e-5)
    assert torch.allclose(grad, logits.grad, atol=1e-6)
    assert not entropy.requires_grad  # a metric here; an entropy bonus takes the plain path


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="do not match targets"):
        selected_logprobs(torch.zeros(2, 4, 8), torch.zeros(2, 3, dtype=torch.long))


def test_skipping_the_prompts_changes_no_trained_log_prob(tiny_policy):
    model = tiny_policy.model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=gen)
    mask = torch.zeros(4, 11)
    mask[0, 6:] = mask[1, 4:9] = mask[3, 7:] = 1  # row 2 trains on nothing
    first = first_trained_position(mask)
    assert first == 4 and first_trained_position(torch.zeros(2, 5)) == 0
    full = token_logprobs(model, ids, torch.ones_like(ids), 0.9)
    skipped = token_logprobs(model, ids, torch.ones_like(ids), 0.9, first=first)
    assert skipped.shape == full.shape and (skipped[:, :first] == 0).all()
    assert torch.allclose(skipped[:, first:], full[:, first:], atol=1e-6)
    logp, entropy = token_logprobs_and_entropy(model, ids, torch.ones_like(ids), 0.9, first=first)
    assert torch.allclose(logp, skipped, atol=1e-6) and (entropy[:, first:] > 0).all()
    # the gradient the loss sees is the same with and without the skip
    grads = []
    for start in (0, first):
        model.zero_grad()
        (token_logprobs(model, ids, torch.ones_like(ids), 0.9, first=start) * mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
