"""`cross_entropy` with K target tokens per position (Tinker's top-k distillation form, which the
cookbook's SDFT and off-policy distillation send): target_tokens and weights (T, K), logprobs
(T, K) back, loss -sum w_tk log p(x_tk). Checked against the same model's (T,) forward, column by
column, through the SDK, and its gradient against the sum of K one-target passes."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker_service import KEY, served

from gapless.lora import LoraSpec
from gapless.service.models import BaseModel, TrainingRun
from gapless.service.wire import DatumIn

TOKENS = [5, 9, 14, 3, 22, 7, 11]
K = 3


def _targets() -> np.ndarray:
    """(T, K): the next token, then two others per position."""
    nxt = np.array(TOKENS[1:], dtype=np.int64)
    return np.stack([nxt, (nxt + 1) % 50, (nxt * 3 + 2) % 50], axis=1)


def _weights() -> np.ndarray:
    return np.tile(np.array([0.6, 0.3, 0.1], dtype=np.float32), (len(TOKENS) - 1, 1))


def test_topk_cross_entropy_through_the_sdk(tmp_path):
    with served(tmp_path) as (server, _), tinker.ServiceClient(base_url=server.base_url, api_key=KEY) as client:
        trainer = client.create_lora_training_client(base_model="tiny", rank=2, seed=1).result()
        prompt = types.ModelInput.from_ints(TOKENS[:-1])
        targets, weights = _targets(), _weights()
        one = [
            types.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": targets[:, k].copy()}) for k in range(K)
        ]
        topk = types.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": targets, "weights": weights})
        columns = [o["logprobs"].to_numpy() for o in trainer.forward(one, "cross_entropy").result().loss_fn_outputs]
        out = trainer.forward([one[0], topk, one[1]], "cross_entropy").result()  # mixed shapes in one call
        shapes = [tuple(o["logprobs"].shape) for o in out.loss_fn_outputs]
        assert shapes == [(6,), (6, K), (6,)]
        got = out.loss_fn_outputs[1]["logprobs"].to_numpy().reshape(6, K)
        assert np.allclose(got, np.stack(columns, axis=1), atol=1e-5)
        expect = -(columns[0].sum() + (weights * got).sum() + columns[1].sum())
        assert out.metrics["loss:sum"] == pytest.approx(float(expect), rel=1e-4)
        with pytest.raises(tinker.RequestFailedError, match="only cross_entropy"):
            bad = {"target_tokens": targets, "logprobs": np.zeros((6, K), np.float32)}
            trainer.forward(
                [types.Datum(model_input=prompt, loss_fn_inputs={**bad, "advantages": bad["logprobs"]})], "ppo"
            ).result()
        with pytest.raises(tinker.RequestFailedError, match="weights"):
            short = {"target_tokens": targets, "weights": weights[:, :2].copy()}
            trainer.forward([types.Datum(model_input=prompt, loss_fn_inputs=short)], "cross_entropy").result()


def test_topk_gradient_is_the_sum_of_its_columns(tmp_path):
    from serve_model import tiny_policy

    policy = tiny_policy()
    targets, weights = torch.from_numpy(_targets()), torch.from_numpy(_weights())
    grads = []
    for datums in (
        [DatumIn(TOKENS[:-1], {"target_tokens": targets, "weights": weights})],
        [DatumIn(TOKENS[:-1], {"target_tokens": targets[:, k], "weights": weights[:, k]}) for k in range(K)],
    ):
        run = TrainingRun("m", BaseModel("tiny", policy, "", context=256), LoraSpec(rank=2, seed=0))
        for name, p in run.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
        _, metrics = run.forward_backward(datums, "cross_entropy", {}, forward_only=False)
        grads.append((metrics["loss:sum"], [p.grad.clone() for p in run.params]))
    (loss_a, grad_a), (loss_b, grad_b) = grads
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    # float rounding of sums taken in another order: ~2e-5 on gradients of ~20
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(grad_a, grad_b))
