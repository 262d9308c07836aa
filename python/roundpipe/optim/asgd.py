"""``roundpipe.optim.ASGD``: torch.optim.ASGD's interface and results, stepped by SIMD
kernels."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ._base import CpuOptimizer, check_lr, check_non_negative, scalar


class ASGD(CpuOptimizer):
    """ASGD, averaged stochastic gradient descent (Polyak & Juditsky, "Acceleration of
    Stochastic Approximation by Averaging", 1992), with the step-size and averaging schedules
    of ``torch.optim.ASGD``: a drop-in replacement for it whose step runs in the RoundPipe C++
    kernels.

    Each step, with the ``eta`` and ``mu`` stored by the previous one::

        p  = p * (1 - lambd * eta) - eta * grad
        ax = ax + (p - ax) * mu        (ax = p while mu == 1)
        eta = lr / (1 + lambd * lr * step) ** alpha;   mu = 1 / max(1, step - t0)

    Same signature (``foreach``, ``maximize``, ``differentiable`` and ``capturable`` may be
    passed by position, as in torch), defaults, validation errors (only ``lr`` and
    ``weight_decay`` are checked), ``state`` keys (``step``, ``eta``, ``mu``: 0-dim float32
    tensors starting at 0, ``lr`` and 1; ``ax``: float32, shaped like the parameter; all created
    at the first step) and ``state_dict`` format as ``torch.optim.ASGD``, so LR schedulers and
    checkpoints work unchanged, in both directions. Results match
    ``torch.optim.ASGD(foreach=False)`` to a few float32 ulp per step. (With a tensor ``lr``
    torch computes the next ``eta`` in float32 tensor arithmetic; we compute it in double, as
    torch does for a float ``lr``: the stored ``eta`` may then differ in its last bit.)

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` may be a 1-element tensor (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate, and the first step's eta (default 1e-2).
        lambd: decay term (default 1e-4).
        alpha: power of the eta schedule (default 0.75).
        t0: step from which averaging starts (default 1e6).
        weight_decay: L2 penalty (default 0).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        differentiable: must be False.
        capturable: must be False.

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: ``lr`` or ``weight_decay`` is out of range (as torch.optim.ASGD), or
            ``capturable`` / ``differentiable`` is True.
        TypeError, ValueError, RuntimeError at ``step``: see :meth:`CpuOptimizer.step`.
    """

    _algorithm = "ASGD"  # kernel, state and option tables: from roundpipe._C

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-2,
        lambd: float = 1e-4,
        alpha: float = 0.75,
        t0: float = 1e6,
        weight_decay: float = 0.0,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
        *,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        check_lr(lr)
        check_non_negative(weight_decay, "weight_decay")
        defaults = dict(
            lr=lr,
            lambd=lambd,
            alpha=alpha,
            t0=t0,
            weight_decay=weight_decay,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            capturable=capturable,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _init_state(self, group, p, state):
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["eta"] = torch.tensor(scalar(group["lr"]), dtype=torch.float32)
        state["mu"] = torch.ones((), dtype=torch.float32)
        self._new_state(p, state, "ax")
