import math

import pytest
import torch

from gapless.trainer.corrections import importance_weights, summarise

# trainer / behaviour ratios 3.0, 0.4, 1.5 on one sequence, plus a masked position
TRAINER = torch.log(torch.tensor([[3.0, 0.4, 1.5, 1.0]]))
BEHAVIOUR = torch.zeros(1, 4)
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_token_tis_truncates_at_the_cap():
    # min(rho, 2): 3.0 -> 2.0, 0.4 -> 0.4, 1.5 -> 1.5; one of three tokens truncated
    w, d = importance_weights(TRAINER, BEHAVIOUR, MASK, "tis", "token", cap=2.0)
    assert w[0, :3].tolist() == pytest.approx([2.0, 0.4, 1.5], abs=1e-6)
    m = summarise([d], "tis")
    # mean rho (3.0 + 0.4 + 1.5) / 3 = 1.633333, max 3.0
    assert m["offpolicy/ratio_mean"] == pytest.approx(4.9 / 3, abs=1e-6)
    assert m["offpolicy/ratio_max"] == pytest.approx(3.0, abs=1e-6)
    assert m["offpolicy/clipped_frac"] == pytest.approx(1 / 3)
    # k3 of KL(behaviour || trainer) per token: rho - 1 - log rho
    #   3.0: 2 - 1.098612 = 0.901388;  0.4: -0.6 + 0.916291 = 0.316291;  1.5: 0.5 - 0.405465 = 0.094535
    #   mean = 1.312214 / 3 = 0.437405
    assert m["offpolicy/behaviour_kl"] == pytest.approx(1.312214 / 3, abs=1e-6)


def test_token_mis_masks_outside_the_band():
    # band [0.5, 2]: 3.0 and 0.4 leave it -> weight 0; 1.5 stays with its IS weight 1.5
    w, d = importance_weights(TRAINER, BEHAVIOUR, MASK, "mis", "token", low=0.5, high=2.0)
    assert w[0, :3].tolist() == pytest.approx([0.0, 0.0, 1.5], abs=1e-6)
    assert summarise([d], "mis")["offpolicy/masked_frac"] == pytest.approx(2 / 3)


def test_sequence_level_uses_the_product_over_the_completion():
    # rho = 3.0 * 0.4 * 1.5 = 1.8 (the masked position counts for nothing)
    w, d = importance_weights(TRAINER, BEHAVIOUR, MASK, "tis", "sequence", cap=2.0)
    assert w[0, :3].tolist() == pytest.approx([1.8] * 3, abs=1e-5)
    m = summarise([d], "tis")
    assert m["offpolicy/ratio_mean"] == pytest.approx(1.8, abs=1e-5) and m["offpolicy/clipped_frac"] == 0.0
    # cap 1.5 truncates the whole sequence to 1.5; band [0.5, 1.5] masks all of it
    w, _ = importance_weights(TRAINER, BEHAVIOUR, MASK, "tis", "sequence", cap=1.5)
    assert w[0, :3].tolist() == pytest.approx([1.5] * 3, abs=1e-6)
    w, d = importance_weights(TRAINER, BEHAVIOUR, MASK, "mis", "sequence", low=0.5, high=1.5)
    assert torch.equal(w[0, :3], torch.zeros(3)) and summarise([d], "mis")["offpolicy/masked_frac"] == 1.0


def test_long_sequence_ratio_does_not_overflow():
    trainer = torch.full((1, 200), 1.0)  # log rho = 200 in total: exp would overflow float32
    w, d = importance_weights(trainer, torch.zeros(1, 200), torch.ones(1, 200), "tis", "sequence", cap=2.0)
    assert torch.all(w == 2.0)
    w, _ = importance_weights(trainer, torch.zeros(1, 200), torch.ones(1, 200), "mis", "sequence")
    assert torch.all(w == 0.0)
    assert math.isfinite(summarise([d], "tis")["offpolicy/ratio_max"])


def test_weights_carry_no_gradient():
    trainer = TRAINER.clone().requires_grad_(True)
    for kind in ("tis", "mis"):
        w, _ = importance_weights(trainer, BEHAVIOUR, MASK, kind)
        assert not w.requires_grad


def test_micro_batch_diagnostics_merge():
    # two halves of the token example give the metrics of the whole
    rows = torch.cat([TRAINER, TRAINER.flip(-1)])
    mask = torch.cat([MASK, MASK.flip(-1)])
    behaviour = torch.zeros(2, 4)
    _, whole = importance_weights(rows, behaviour, mask, "tis")
    parts = [importance_weights(rows[i : i + 1], behaviour[i : i + 1], mask[i : i + 1], "tis")[1] for i in range(2)]
    assert summarise(parts, "tis") == pytest.approx(summarise([whole], "tis"))
