"""The service's prefix-tree batching (service/prefix_tree.py, service/tree_attention.py): datums
that share prefixes, packed into trees and run as one forward, give each datum the log-probs,
loss and gradients it gets alone, under SDPA's tree attention and under the dense-mask path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from serve_model import tiny_policy

from gapless.lora import LoraSpec
from gapless.service.models import BaseModel, TrainingRun
from gapless.service.prefix_tree import ancestors, pack
from gapless.service.wire import DatumIn


def _turns(policy) -> list[list[int]]:
    """A multi-turn episode's datums (each turn's history re-rendered, so no turn extends the one
    before), one turn that is a prefix of another, and an unrelated sequence."""
    gen = torch.Generator().manual_seed(0)
    history, seqs = policy.encode("System: guess my number. User: between 1 and 100?"), []
    for _ in range(4):
        seqs.append(history + torch.randint(5, 200, (3,), generator=gen).tolist())
        history = history + torch.randint(5, 200, (7,), generator=gen).tolist()
    return [*seqs, seqs[2][:-2], policy.encode("Something else entirely, not shared.")]


def test_pack_shares_prefixes_and_keeps_every_path():
    a, b, c = [1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8]
    rows, where = pack([b, a, c, a[:3]], max_tokens=64, attention_span=4)
    assert [len(r) for r in rows] == [6, 2]  # a and b share 1 2 3; c shares nothing: its own row
    for seq, (r, path) in zip([b, a, c, a[:3]], where):
        row = rows[r]
        assert [row.tokens[n] for n in path] == seq and [row.depths[n] for n in path] == list(range(len(seq)))
        assert all(row.parents[n] == (path[i - 1] if i else -1) for i, n in enumerate(path))
    assert where[3][1] == where[1][1][:3]  # a prefix of a datum adds no node
    assert rows[0].spine == 5  # the longest first: a is the chain the others branch from
    # a row bounded by max_tokens: b no longer fits beside a
    assert [len(r) for r in pack([a, b], max_tokens=5, attention_span=4)[0]] == [5, 4]


def test_ancestors_are_the_paths():
    rows, where = pack([[1, 2, 3, 4], [1, 2, 5, 6], [1, 7]], max_tokens=64, attention_span=100)
    row = rows[0]
    mask = ancestors(row, 0)
    expected = torch.zeros_like(mask)
    for _, path in where:
        for i, n in enumerate(path):
            expected[n, path[: i + 1]] = True
    assert torch.equal(mask, expected)
    assert torch.equal(ancestors(row, row.spine), expected[row.spine :])


def _run(policy, spec, budget=4096) -> TrainingRun:
    run = TrainingRun("m", BaseModel("tiny", policy, "", context=256), spec, micro_batch_tokens=budget)
    for name, p in run.model.named_parameters():  # LoRA's B starts at 0: make the adapter matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(len(name)))
    return run


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("lora", [True, False])
def test_batched_forward_backward_equals_one_datum_at_a_time(attention, lora):
    policy = tiny_policy()
    policy.model.config._attn_implementation_internal = attention
    seqs = _turns(policy)
    datums = [
        DatumIn(
            s[:-1],
            {
                "target_tokens": torch.tensor(s[1:]),
                "advantages": torch.linspace(-1, 1, len(s) - 1) * (i - 2),
                "logprobs": torch.full((len(s) - 1,), -3.0),
            },
        )
        for i, s in enumerate(seqs)
    ]
    spec = LoraSpec(rank=2, seed=0) if lora else None
    rows, _ = pack([d.tokens for d in datums], 4096, 32)
    assert len(rows) == 2 and sum(map(len, rows)) < sum(len(d.tokens) for d in datums) / 2  # shared: one tree

    together = _run(policy, spec)
    lp_a, metrics = together.forward_backward(datums, "ppo", {}, forward_only=False)
    grads_a = [p.grad.clone() for p in together.params]
    forward_lp, forward_metrics = together.forward_backward(datums, "ppo", {}, forward_only=True)
    together.close()

    alone = _run(policy, spec)
    outs = [alone.forward_backward([d], "ppo", {}, forward_only=False) for d in datums]
    grads_b = [p.grad.clone() for p in alone.params]

    assert metrics["loss:sum"] == pytest.approx(sum(o[1]["loss:sum"] for o in outs), rel=1e-5)
    assert forward_metrics["loss:sum"] == pytest.approx(metrics["loss:sum"], rel=1e-6)
    for a, f, (b, _) in zip(lp_a, forward_lp, outs):
        assert a.shape == b[0].shape and np.allclose(a, b[0], atol=1e-5) and np.allclose(f, a, atol=1e-6)
    # fp32 rounding of other shapes moves gradients of magnitude ~10 by ~1e-5; a wrong mask or
    # position moves them by a whole token's contribution
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(grads_a, grads_b))
    assert max(float(g.abs().max()) for g in grads_a) > 0.1


@pytest.mark.parametrize("window", [None, 3])
def test_tree_attention_equals_the_dense_tree_mask(window):
    """The row-by-row attention (causal spine, masked branches) against one SDPA call under the
    dense mask of the same trees, a sliding window included (it bounds the depth distance)."""
    import torch.nn.functional as F

    from gapless.service import tree_attention

    rows, _ = pack([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 8], [1, 2, 7], [4, 4, 4]], 64, 100)
    assert [len(r) for r in rows] == [9, 3]
    depths = torch.tensor([d for r in rows for d in r.depths])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, len(depths), 8, generator=gen)
    k, v = (torch.randn(1, 2, len(depths), 8, generator=gen) for _ in range(2))  # 2 kv heads: grouped

    class Module(torch.nn.Module):
        pass

    dense = tree_attention._dense_mask(rows, depths, window)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense)
    tree_attention._state.rows = [
        (len(r), r.spine, ancestors(r, r.spine) if len(r) > r.spine else None, torch.tensor(r.depths)) for r in rows
    ]
    try:
        out, _ = tree_attention._tree_attention(Module().eval(), q, k, v, None, sliding_window=window)
    finally:
        tree_attention._state.rows = None
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-6)


def test_other_threads_see_plain_attention_during_a_tree_call():
    """The service's scorer (and a generic sampling engine) run the same module on other threads
    while the training thread's call has switched its attention: they must get the plain forward."""
    import threading

    from gapless.service.tree_attention import tree_inputs

    policy = tiny_policy()
    model = policy.model
    batch = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])  # left padding: HF's own mask is needed
    with torch.no_grad():
        expected = model(input_ids=batch, attention_mask=mask).logits
        alone = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits[0]
        rows, _ = pack([[1, 2, 3, 4], [1, 2, 9]], 64, 100)
        seen = {}
        with tree_inputs(model.config, rows) as kwargs:
            other = threading.Thread(target=lambda: seen.update(out=model(input_ids=batch, attention_mask=mask).logits))
            other.start()
            other.join()
            tree = model(**kwargs).logits[0]
    assert torch.allclose(seen["out"][mask.bool()], expected[mask.bool()], atol=1e-6)
    assert torch.allclose(tree[:4], alone, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"
