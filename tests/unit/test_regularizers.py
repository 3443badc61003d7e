import math

import pytest
import torch

from gapless.trainer.batch import token_logprobs_and_entropy
from gapless.trainer.regularizers import sequence_kl, token_kl


def test_k3_value_and_gradient():
    # delta = ref - logp = log(0.5): k3 = 0.5 - log(0.5) - 1 = 0.193147
    # d k3 / d logp = -exp(delta) + 1 = 0.5
    logp = torch.tensor([[0.0]], requires_grad=True)
    kl = token_kl(logp, torch.tensor([[math.log(0.5)]]), torch.ones(1, 1), "k3")
    assert kl.item() == pytest.approx(0.5 - math.log(0.5) - 1, abs=1e-7)
    kl.sum().backward()
    assert logp.grad.item() == pytest.approx(0.5, abs=1e-7)


def test_k1_value_and_gradient():
    # k1 = logp - ref = 0 - log(0.5) = 0.693147; d k1 / d logp = 1
    logp = torch.tensor([[0.0]], requires_grad=True)
    kl = token_kl(logp, torch.tensor([[math.log(0.5)]]), torch.ones(1, 1), "k1")
    assert kl.item() == pytest.approx(math.log(2), abs=1e-7)
    kl.sum().backward()
    assert logp.grad.item() == 1.0


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_masked_tokens_have_no_kl_and_no_gradient(estimator):
    logp = torch.tensor([[-1.0, 7.0]], requires_grad=True)
    ref = torch.tensor([[-2.0, -40.0]])
    kl = token_kl(logp, ref, torch.tensor([[1.0, 0.0]]), estimator)
    assert kl[0, 1] == 0.0
    kl.sum().backward()
    assert logp.grad[0, 1] == 0.0


def test_sequence_kl_sums_the_completion():
    # k3 with delta = log 0.5 on two tokens, third masked: 2 * 0.193147 = 0.386294
    logp = torch.zeros(1, 3)
    ref = torch.full((1, 3), math.log(0.5))
    assert sequence_kl(logp, ref, torch.tensor([[1.0, 1.0, 0.0]])).item() == pytest.approx(2 * 0.193147, abs=1e-6)


class _FixedLogits(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids, attention_mask, use_cache):
        return type("Out", (), {"logits": self.logits})()


def test_entropy_at_the_sampling_temperature():
    # uniform over 4 tokens: entropy log 4 = 1.386294 at any temperature;
    # logits (log 3, 0, 0, 0) at T = 1: p = (0.5, 1/6, 1/6, 1/6), H = 0.5 log 2 + 0.5 log 6 = 1.242453
    # at T = 2 the logits halve: (log 3 / 2, 0, 0, 0), p = (sqrt 3, 1, 1, 1) / (3 + sqrt 3) = (0.366025, 0.211325 x3)
    #   H = -0.366025 log 0.366025 - 3 * 0.211325 log 0.211325 = 0.367875 + 0.985424 = 1.353299
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, 0.0, 0.0], [0.0] * 4]])
    model = _FixedLogits(logits)
    ids = torch.tensor([[0, 1, 0]])
    logp, entropy = token_logprobs_and_entropy(model, ids, torch.ones_like(ids), temperature=1.0, entropy_grad=True)
    assert entropy[0].tolist() == pytest.approx([math.log(4), 0.5 * math.log(2) + 0.5 * math.log(6)], abs=1e-6)
    # targets are ids[1] = 1 (p 0.25 under the uniform row) and ids[2] = 0 (p 0.5 under the second row)
    assert logp[0].tolist() == pytest.approx([math.log(0.25), math.log(0.5)], abs=1e-6)
    assert entropy.requires_grad
    _, hot = token_logprobs_and_entropy(model, ids, torch.ones_like(ids), temperature=2.0)
    assert hot[0, 1].item() == pytest.approx(1.353299, abs=1e-6)
    assert not hot.requires_grad  # a metric unless the bonus needs its gradient
