"""The registry the generic optimizer tests (test_optimizers.py) run over: one Case per
roundpipe.optim class, with the hyperparameter sweep that covers every option of its torch
counterpart and their interactions, and the bad values torch rejects."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

import roundpipe.optim as rpo


def grid(**axes) -> list[dict]:
    """Every combination of the given values: grid(a=[1, 2], b=[3]) -> [{a: 1, b: 3}, {a: 2, b: 3}]."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*axes.values())]


@dataclass
class Case:
    name: str
    ours: type
    ref: type
    sweep: list[dict]            # kwargs combinations compared against torch, on every ISA
    invalid: list[dict]          # kwargs torch rejects: ours must raise the same type and text
    base: dict = field(default_factory=dict)  # kwargs for the generic behaviour tests
    lr: float = 1e-2             # a learning rate that suits a 20-step comparison
    # Bounds (assert_same_training's rtol/atol) for a sweep entry on the scalar ISA when torch
    # fuses multiply-adds and that ISA does not (test_optimizers.SCALAR_ISA_UNFUSED): each fused
    # op then rounds once more. {}: the strict bounds hold anyway. Only for an algorithm that
    # amplifies those roundings, with the reason written at the case; the strict bounds are
    # still checked against torch built the same way (test_scalar_isa_matches_torch_without_fma).
    scalar_isa_tolerance: Callable[[dict], dict] = lambda kwargs: {}

    def __str__(self) -> str:
        return self.name


CASES = [
    Case(
        "Adam", rpo.Adam, torch.optim.Adam,
        sweep=grid(lr=[1e-2], betas=[(0.8, 0.99)], eps=[1e-6], amsgrad=[False, True],
                   maximize=[False, True], weight_decay=[0.0, 0.1],
                   decoupled_weight_decay=[False, True]),
        invalid=[dict(lr=-1.0), dict(eps=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
                 dict(weight_decay=-1.0), dict(betas=(0.9, torch.tensor(0.9))),
                 dict(lr=torch.tensor([0.1, 0.2]))],
        base=dict(lr=1e-2, amsgrad=True, weight_decay=0.1),
    ),
    Case(
        "AdamW", rpo.AdamW, torch.optim.AdamW,
        sweep=grid(lr=[1e-2], amsgrad=[False, True], maximize=[False, True],
                   weight_decay=[0.0, 0.1]),
        invalid=[dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(weight_decay=-1e-3)],
        base=dict(lr=1e-2, amsgrad=True),
    ),
    Case(
        "SGD", rpo.SGD, torch.optim.SGD,
        sweep=[kw for kw in grid(lr=[1e-2], momentum=[0.0, 0.9], dampening=[0.0, 0.3],
                                 nesterov=[False, True], weight_decay=[0.0, 0.1],
                                 maximize=[False, True])
               if not kw["nesterov"] or (kw["momentum"] > 0 and kw["dampening"] == 0)],
        invalid=[dict(lr=-1.0), dict(momentum=-0.1), dict(weight_decay=-1.0),
                 dict(nesterov=True), dict(nesterov=True, momentum=0.9, dampening=0.1),
                 dict(lr=torch.tensor([0.1, 0.2]))],
        base=dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
    ),
    Case(
        "Adagrad", rpo.Adagrad, torch.optim.Adagrad,
        sweep=grid(lr=[1e-2], lr_decay=[0.0, 0.1], weight_decay=[0.0, 0.1],
                   initial_accumulator_value=[0.0, 0.5], maximize=[False, True])
        + [dict(lr=1e-2, lr_decay=0.1, weight_decay=0.1, eps=1e-3)],  # an eps that matters
        invalid=[dict(lr=-1.0), dict(lr_decay=-0.1), dict(weight_decay=-1.0),
                 dict(initial_accumulator_value=-1.0), dict(eps=-1e-10),
                 dict(lr=torch.tensor([0.1, 0.2]))],
        base=dict(lr=1e-2, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1),
    ),
    Case(
        "RMSprop", rpo.RMSprop, torch.optim.RMSprop,
        # alpha 0.99 and 0.3 take both branches of torch's lerp_ (1 - alpha below / above 0.5).
        # maximize only negates the gradient before weight decay: swept with weight decay and
        # with the options that use the gradient most (centered, momentum).
        sweep=grid(lr=[1e-2], alpha=[0.99, 0.3], eps=[1e-6], centered=[False, True],
                   momentum=[0.0, 0.9], weight_decay=[0.0, 0.1])
        + grid(lr=[1e-2], alpha=[0.3], eps=[1e-6], centered=[True], momentum=[0.9],
               weight_decay=[0.0, 0.1], maximize=[True]),
        invalid=[dict(lr=-1.0), dict(eps=-1.0), dict(momentum=-0.5), dict(weight_decay=-1.0),
                 dict(alpha=-0.1), dict(lr=torch.tensor([0.1, 0.2]))],
        # No weight decay in base: with the 1e-20 gradients of test_extreme_gradient_scales the
        # decayed gradient is ~0.1 * p, the same at every step, so the centered variance
        # square_avg - grad_avg**2 is pure rounding noise; torch's sqrt (MKL's, which is not
        # correctly rounded: 1 ulp low on ~0.7% of inputs) differs from ours by an ulp, and that
        # noise amplifies it to any size. The sweep covers weight decay with real gradients.
        base=dict(lr=1e-2, momentum=0.9, centered=True),
        # Centered: square_avg - grad_avg**2 cancels wherever the gradient barely varies, which
        # multiplies the relative effect of one extra rounding (in lerp_ and addcmul_) by
        # square_avg / variance; with alpha 0.3 some elements of a 20-step run reach ~100.
        # Elements where a state crosses zero (a 1-element tensor's scale is that element) do
        # the same. Measured worst on the sweep: 4x the param bound, 30x the state bound.
        scalar_isa_tolerance=lambda kw: dict(rtol=1e-3, atol=1e-5) if kw["centered"] else {},
    ),
]
