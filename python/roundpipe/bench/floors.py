"""The memory-traffic floor of an optimizer step, as the optimizer benchmark measures it: the
streaming kernel (``roundpipe._C.stream_step``) moving the step's bytes per element over the same
tensors, through the same per-tensor checks as a ``roundpipe.optim`` step (a
``roundpipe._C.StepPlan``: its tensors checked once, their gradients, pointers and versions
re-checked at every call), so that on many small tensors the floor and the step pay the same
per-tensor cost and their ratio measures the kernels.

A step of ``states`` float32 state arrays moves ``4 * (2 * states + 3)`` bytes per element (read
param, grad and each state array, write param and each state array). Adafactor's step on
matrices reads the gradient three times and the parameter twice and writes it once (24 bytes per
element: roundpipe/adafactor.hpp): two streaming passes without state (12 bytes each).
"""

from __future__ import annotations

from typing import Callable

import torch

from roundpipe import _C
from roundpipe.optim.compact import staggered_zeros

STATE_KEYS = ["state0", "state1", "state2"]


def _pass(params: list, states: list[list[torch.Tensor]]) -> Callable[[], None]:
    """One streaming pass over ``params`` (their ``.grad``) and the per-slot ``states``."""
    opts = _C.StreamOptions()
    opts.states = len(states)
    state = {p: {k: s[i] for k, s in zip(STATE_KEYS, states)} for i, p in enumerate(params)}
    plan = _C.StepPlan(STATE_KEYS, ())
    mask = (1 << len(states)) - 1

    def run() -> None:
        if not _C.stream_step_plan(opts, plan, params, state, mask, 0, False, False, 0, 0, 0):
            raise RuntimeError("the floor's tensors were refused")
    return run


def _twins(params: list) -> list:
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, p in zip(twins, params):
        t.grad = p.grad.clone()
    return twins


def floor_step(params: list, n_states: int, passes: int = 1) -> tuple[Callable[[], None], int]:
    """The floor of a step over ``params`` (with gradients) keeping ``n_states`` float32 state
    arrays, in ``passes`` streaming passes: a callable doing one step, and the bytes per element
    it moves."""
    # laid out as roundpipe.optim lays out its state (compact.staggered_zeros), so that the floor
    # and the step stream through the same page offsets
    states = [[staggered_zeros(p, k, n_states) for p in params] for k in range(n_states)]
    # each pass over tensors of its own: a plan re-checks a parameter whose version counter
    # another call bumped (as it must), which two plans over the same tensors would do each time
    runs = [_pass(params if k == 0 else _twins(params), states) for k in range(passes)]

    def step() -> None:
        for run in runs:
            run()
    return step, passes * 4 * (2 * n_states + 3)


def matrix_shape(size: int) -> tuple[int, int]:
    """A matrix of ``size`` elements as square as its divisors allow (Adafactor's layouts)."""
    rows = int(size ** 0.5)
    while size % rows:
        rows -= 1
    return rows, size // rows
