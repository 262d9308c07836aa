"""The registry the generic optimizer tests (test_optimizers.py) run over: one Case per
roundpipe.optim class, with the hyperparameter sweep that covers every option of its torch
counterpart and their interactions, and the bad values torch rejects."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

import roundpipe.optim as rpo
from conftest import SHAPES


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
    shapes: list = field(default_factory=lambda: list(SHAPES))  # of the compared parameters

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
                 dict(lr=torch.tensor([0.1, 0.2])),
                 # NaN fails every range check; with two bad values, torch's order decides
                 # which one is reported; a tensor beta must have one element.
                 dict(lr=float("nan")), dict(eps=float("nan")), dict(betas=(0.9, float("nan"))),
                 dict(eps=-1.0, betas=(2.0, 0.9)), dict(betas=(2.0, -1.0)),
                 dict(betas=(2.0, 0.9), weight_decay=-1.0),
                 dict(betas=(torch.tensor(0.9), torch.tensor([0.9, 0.8])))],
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
        "Adadelta", rpo.Adadelta, torch.optim.Adadelta,
        # rho 0 and 1 are the ends torch accepts: 1 - rho is then 1 (no memory) or 0 (frozen
        # averages, delta = grad); eps 0.5 makes eps dominate both square roots.
        sweep=grid(lr=[0.5], rho=[0.9, 0.25], weight_decay=[0.0, 0.1], maximize=[False, True])
        + [dict(lr=1.0, rho=0.0), dict(lr=1e-2, rho=1.0, weight_decay=0.1),
           dict(lr=0.5, eps=0.5, maximize=True)],
        invalid=[dict(lr=-1.0), dict(rho=1.1), dict(rho=-0.1), dict(eps=-1.0),
                 dict(weight_decay=-1.0), dict(lr=torch.tensor([0.1, 0.2]))],
        base=dict(lr=0.5, weight_decay=0.1),
        lr=0.5,
    ),
    Case(
        "Adamax", rpo.Adamax, torch.optim.Adamax,
        # beta1 0.3: 1 - beta1 >= 0.5 takes torch's other lerp formula; eps 0.5 makes
        # |g| + eps win the maximum often, and beta2 0.5 lets exp_inf fall below it.
        sweep=grid(lr=[1e-2], betas=[(0.9, 0.999), (0.3, 0.5)], weight_decay=[0.0, 0.1],
                   maximize=[False, True])
        + [dict(lr=1e-2, betas=(0.0, 0.0), eps=0.5), dict(lr=1e-2, eps=0.0, maximize=True)],
        invalid=[dict(lr=-1.0), dict(eps=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
                 dict(weight_decay=-1.0), dict(lr=torch.tensor([0.1, 0.2]))],
        base=dict(lr=1e-2, weight_decay=0.1),
    ),
    Case(
        "ASGD", rpo.ASGD, torch.optim.ASGD,
        # t0 = 5: averaging (mu = 1 / (step - t0) != 1) starts within the 20 steps; lambd 0.5
        # makes the decay term and the eta schedule visible.
        sweep=grid(lr=[1e-2], lambd=[1e-4, 0.5], t0=[1e6, 5.0], weight_decay=[0.0, 0.1],
                   maximize=[False, True])
        + [dict(lr=0.1, lambd=1.0, alpha=1.5, t0=0.0), dict(lr=0.1, lambd=0.0, alpha=0.0, t0=-3.0)],
        invalid=[dict(lr=-1.0), dict(weight_decay=-1.0), dict(lr=torch.tensor([0.1, 0.2]))],
        base=dict(lr=1e-2, lambd=0.1, t0=2.0, weight_decay=0.1),
    ),
]

CASES += [
    Case(
        "Adafactor", rpo.Adafactor, torch.optim.Adafactor,
        # eps1 1e-3 and d 1.5 with lr 0.5 make the floors and the clipping act; beta2_decay
        # -0.5 a slower-decaying second moment; a 3-D tensor is a batch of factored matrices.
        sweep=grid(lr=[1e-2], beta2_decay=[-0.8, -0.5], weight_decay=[0.0, 0.1],
                   maximize=[False, True])
        + [dict(lr=1e-2, eps=(1e-3, 1e-3)), dict(lr=0.5, d=1.5, weight_decay=0.1),
           dict(lr=1e-2, eps=(None, 0.5))],
        invalid=[dict(lr=-1.0), dict(beta2_decay=0.1), dict(eps=(-1.0, 1e-3)),
                 dict(eps=(None, -1.0)), dict(d=0.5), dict(weight_decay=-1.0),
                 dict(lr=torch.tensor([0.1, 0.2])), dict(lr=float("nan")),
                 dict(d=0.5, weight_decay=-1.0)],
        base=dict(lr=1e-2, weight_decay=0.1),
        # torch 2.13 raises ZeroDivisionError on a parameter with no elements (ours steps it:
        # tests/test_adafactor.py); a 3-D tensor: factored over its last two dimensions
        shapes=[s for s in SHAPES if 0 not in s] + [(3, 5, 7), (2, 1, 9)],
    ),
    Case(
        "NAdam", rpo.NAdam, torch.optim.NAdam,
        sweep=grid(lr=[1e-2], betas=[(0.8, 0.99)], eps=[1e-6], maximize=[False, True],
                   weight_decay=[0.0, 0.1], decoupled_weight_decay=[False, True])
        # momentum_decay drives mu_t and the float32 running product mu_product: none (mu_t is
        # constant), a fast schedule, torch's default with beta1 = 0 (mu_product 0).
        + [dict(lr=1e-2, momentum_decay=0.0), dict(lr=1e-2, momentum_decay=0.3),
           dict(lr=1e-2, betas=(0.0, 0.5))]
        + [dict(lr=1e-2, betas=(torch.tensor(0.8), torch.tensor(0.99)), weight_decay=0.1)],
        invalid=[dict(lr=-1.0), dict(eps=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
                 dict(weight_decay=-1.0), dict(momentum_decay=-1e-3),
                 dict(lr=torch.tensor([0.1, 0.2])), dict(betas=(float("nan"), 0.9)),
                 dict(weight_decay=-1.0, momentum_decay=-1.0)],
        base=dict(lr=1e-2, weight_decay=0.1, momentum_decay=0.01),
    ),
    Case(
        "RAdam", rpo.RAdam, torch.optim.RAdam,
        sweep=grid(lr=[1e-2], eps=[1e-6], maximize=[False, True], weight_decay=[0.0, 0.1],
                   decoupled_weight_decay=[False, True])
        # Where the rectified branch (rho_t > 5) starts: step 6 for beta2 near 1, step 10 for
        # beta2 = 0.7 (rho_inf = 5.67, r_t small), never for beta2 <= 0.6 (rho_inf <= 4).
        + grid(lr=[1e-2], betas=[(0.9, 0.99), (0.8, 0.7), (0.0, 0.5)])
        + [dict(lr=1e-2, betas=(torch.tensor(0.8), torch.tensor(0.99)), weight_decay=0.1)],
        invalid=[dict(lr=-1.0), dict(eps=-1.0), dict(betas=(1.0, 0.9)), dict(betas=(0.9, -0.1)),
                 dict(weight_decay=-1.0), dict(lr=torch.tensor([0.1, 0.2])),
                 dict(betas=(0.9, 2.0), weight_decay=-1.0)],
        base=dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    ),
    Case(
        "Rprop", rpo.Rprop, torch.optim.Rprop,
        # Random gradients flip sign half the time, so growth, shrinking and the zeroed
        # gradient all occur; step_sizes (1e-3, 1.5e-2) with lr 1e-2 reach both clamps within
        # a few steps; max < min (torch's clamp then gives max everywhere).
        sweep=grid(lr=[1e-2], etas=[(0.5, 1.2), (0.25, 2.0)],
                   step_sizes=[(1e-6, 50), (1e-3, 1.5e-2), (0.02, 0.01)])
        + [dict(lr=1e-2, etas=(0.25, 2.0), step_sizes=(1e-3, 1.5e-2), maximize=True)],
        invalid=[dict(lr=-1.0), dict(etas=(0.0, 1.2)), dict(etas=(1.0, 1.2)),
                 dict(etas=(0.5, 1.0)), dict(etas=(0.5, 0.9)),
                 dict(lr=torch.tensor([0.1, 0.2]))],
        base=dict(lr=1e-2, etas=(0.4, 1.3), step_sizes=(1e-4, 0.1)),
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
                 dict(lr=torch.tensor([0.1, 0.2])), dict(lr=float("nan")),
                 dict(initial_accumulator_value=-1.0, eps=-1.0)],
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
                 dict(alpha=-0.1), dict(lr=torch.tensor([0.1, 0.2])), dict(alpha=float("nan")),
                 dict(momentum=-1.0, weight_decay=-1.0)],
        # No weight decay in base: with the 1e-20 gradients of test_extreme_gradient_scales the
        # decayed gradient is ~0.1 * p, the same at every step, so the centered variance
        # square_avg - grad_avg**2 is pure rounding noise, which amplifies any one-rounding
        # difference (the scalar ISA's unfused multiply-adds against torch's FMA) to any size.
        # The sweep covers weight decay with real gradients.
        base=dict(lr=1e-2, momentum=0.9, centered=True),
        # Centered: square_avg - grad_avg**2 cancels wherever the gradient barely varies, which
        # multiplies the relative effect of one extra rounding (in lerp_ and addcmul_) by
        # square_avg / variance; with alpha 0.3 some elements of a 20-step run reach ~100.
        # Elements where a state crosses zero (a 1-element tensor's scale is that element) do
        # the same. Measured worst on the sweep: 4x the param bound, 30x the state bound.
        scalar_isa_tolerance=lambda kw: dict(rtol=1e-3, atol=1e-5) if kw["centered"] else {},
    ),
]
