"""ASGD-specific behaviour; what every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import torch

import roundpipe.optim as rpo
from conftest import make_params


def test_eta_and_mu_follow_torchs_schedule_exactly_per_parameter():
    # eta and mu are Python-float schedules stored as float32 0-dim tensors: they must be the
    # same bits as torch's, step by step, and each parameter keeps its own (b first gets a
    # gradient at step 4, so its schedule runs three steps behind a's).
    kwargs = dict(lr=0.05, lambd=0.5, alpha=0.6, t0=3.0)
    runs = []
    for cls in (rpo.ASGD, torch.optim.ASGD):
        a, b = make_params([(9,), (20,)])
        opt = cls([a, b], **kwargs)
        history = []
        for step in range(12):
            a.grad = torch.full((9,), 0.5)
            b.grad = torch.full((20,), -0.25) if step >= 3 else None
            opt.step()
            history.append([(k, v.clone()) for p in (a, b) for k, v in opt.state[p].items()
                            if v.dim() == 0])
        runs.append(history)
    for step, (ours, ref) in enumerate(zip(*runs)):
        assert [k for k, _ in ours] == [k for k, _ in ref]
        for (k, va), (_, vb) in zip(ours, ref):
            assert va.dtype == torch.float32 and torch.equal(va, vb), (step, k, va, vb)


def test_first_step_uses_lr_as_eta_and_copies_the_parameter_into_ax():
    (p,) = make_params([(5,)])
    before = p.detach().clone()
    opt = rpo.ASGD([p], lr=0.1, lambd=0.5)
    p.grad = torch.ones(5)
    opt.step()
    torch.testing.assert_close(p.detach(), before * (1 - 0.5 * 0.1) - 0.1, rtol=0, atol=1e-6)
    assert torch.equal(opt.state[p]["ax"], p.detach())
    assert opt.state[p]["mu"].item() == 1.0
