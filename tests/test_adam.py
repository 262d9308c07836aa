"""Adam-specific behaviour; what every optimizer shares is in test_optimizers.py."""

from __future__ import annotations

import torch

import roundpipe.optim as rpo
from conftest import make_params


def test_amsgrad_switched_on_later_creates_its_state():
    a, b = make_params([(5,), (6,)])
    opt = rpo.Adam([a], lr=0.1)
    opt.add_param_group({"params": [b], "lr": 0.2, "amsgrad": True})
    a.grad, b.grad = torch.ones(5), torch.ones(6)
    opt.step()
    assert "max_exp_avg_sq" in opt.state[b] and "max_exp_avg_sq" not in opt.state[a]
    opt.param_groups[0]["amsgrad"] = True
    opt.step()
    assert opt.state[a]["max_exp_avg_sq"].shape == (5,)


def test_adamw_is_adam_with_decoupled_weight_decay():
    (p,) = make_params([(7,)])
    opt = rpo.AdamW([p])
    assert isinstance(opt, rpo.Adam)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    assert opt.param_groups[0]["weight_decay"] == 1e-2
