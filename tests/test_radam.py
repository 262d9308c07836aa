"""RAdam-specific behaviour: the unrectified first steps (rho_t <= 5) against torch bit for bit.
What every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import pytest
import torch

import roundpipe.optim as rpo
from conftest import make_params


@pytest.mark.parametrize("kwargs", [dict(weight_decay=0.1),
                                    dict(weight_decay=0.1, decoupled_weight_decay=True),
                                    dict(maximize=True, betas=(0.0, 0.5))])
def test_unrectified_steps_match_torch_bit_for_bit(isa, kwargs):
    # Before rho_t exceeds 5 (steps 1-5 for beta2 = 0.999; every step for beta2 <= 0.6) the
    # update is p - (m / bias_correction1) * lr: no sqrt is involved (torch's float32 sqrt, MKL's
    # vsSqrt, is not always correctly rounded, which is why the rectified steps agree to an ulp
    # rather than to the bit). lerp_, addcmul_ and add(alpha=) fuse their multiply-add in torch's
    # CPU kernels, as our fmadd does on every ISA except x86 `scalar`, which has no FMA.
    if isa == "scalar" and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        pytest.skip("the scalar ISA rounds a*b+c twice where torch's kernels fuse it")
    ours_p = make_params([(4097,), (33, 65), (7,)])
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours, ref = rpo.RAdam(ours_p, **kwargs), torch.optim.RAdam(ref_p, foreach=False, **kwargs)
    gen = torch.Generator().manual_seed(5)
    for step in range(5):
        for a, b in zip(ours_p, ref_p):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
        for a, b in zip(ours_p, ref_p):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"step {step + 1}: {m}")
            for k in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours.state[a][k], ref.state[b][k], rtol=0, atol=0)
