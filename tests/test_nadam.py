"""NAdam-specific behaviour: the float32 running product ``mu_product`` and old checkpoints
holding it as a Python number. What every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim as rpo
from conftest import make_params


@pytest.mark.parametrize("momentum_decay", [4e-3, 0.3])
def test_mu_product_is_torchs_float32_product_bit_for_bit(isa, momentum_decay):
    # torch multiplies a 0-dim float32 tensor by mu_t (a Python float, rounded to float32) at
    # every step, so the product carries float32 rounding; a float64 product would drift off
    # torch's by an ulp within a few steps.
    states = []
    for cls in (rpo.NAdam, torch.optim.NAdam):
        (p,) = make_params([(3,)])
        opt = cls([p], momentum_decay=momentum_decay)
        for _ in range(60):
            p.grad = torch.ones(3)
            opt.step()
        states.append(opt.state[p])
    ours, ref = states
    assert ours["mu_product"].dtype == torch.float32 and ours["mu_product"].dim() == 0
    assert ours["mu_product"].item() == ref["mu_product"].item()
    assert ours["step"].item() == ref["step"].item() == 60.0


def test_old_checkpoint_with_number_mu_product_matches_torch():
    results = []
    for cls in (rpo.NAdam, torch.optim.NAdam):
        (p,) = make_params([(4,)])
        opt = cls([p], lr=0.1)
        p.grad = torch.ones(4)
        opt.step()
        state = opt.__getstate__()
        state["state"][p]["mu_product"] = 0.5
        state["state"][p]["step"] = 1
        opt.__setstate__(state)
        p.grad = torch.ones(4)
        opt.step()
        results.append((p.detach().clone(), opt.state[p]["mu_product"]))
    (po, mo), (pr, mr) = results
    assert mo.dtype == mr.dtype == torch.float32 and mo.item() == mr.item()
    torch.testing.assert_close(po, pr, rtol=1e-6, atol=0)
