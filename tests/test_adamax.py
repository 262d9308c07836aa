"""Adamax-specific behaviour; what every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import torch

import roundpipe.optim as rpo
from conftest import make_params


def test_eps_is_inside_the_maximum_as_in_torch():
    # exp_inf = max(beta2 * exp_inf, |g| + eps): with zero gradients it stays eps (eps added
    # after the maximum would grow it), and zero-gradient elements never move.
    results = []
    for cls in (rpo.Adamax, torch.optim.Adamax):
        (p,) = make_params([(40,)])
        opt = cls([p], lr=0.1, betas=(0.9, 0.5), eps=0.25)
        for step in range(4):
            p.grad = torch.zeros(40)
            p.grad[::3] = 1.0 if step == 0 else 0.0
            opt.step()
        results.append((p.detach().clone(), opt.state[p]["exp_inf"].clone()))
    (pa, ua), (pb, ub) = results
    assert torch.equal(ua, ub)
    assert torch.equal(ua[1::3], torch.full_like(ua[1::3], 0.25))
    torch.testing.assert_close(pa, pb, rtol=1e-6, atol=0)
