"""``roundpipe.optim.Adadelta``: torch.optim.Adadelta's interface and results, stepped by SIMD
kernels."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ._base import CpuOptimizer, check_lr, check_non_negative


class Adadelta(CpuOptimizer):
    """Adadelta (Zeiler, "ADADELTA: An Adaptive Learning Rate Method", 2012): a drop-in
    replacement for ``torch.optim.Adadelta`` whose step runs in the RoundPipe C++ kernels.

    Same signature, defaults, validation errors, ``state`` keys (``step``: 0-dim float32
    tensor; ``square_avg``, ``acc_delta``: float32, shaped like the parameter, created at the
    first step) and ``state_dict`` format as ``torch.optim.Adadelta``, so LR schedulers and
    checkpoints work unchanged, in both directions. Results match
    ``torch.optim.Adadelta(foreach=False)`` to a few float32 ulp per step.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` may be a 1-element tensor (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: coefficient that scales the delta before it is applied (default 1.0).
        rho: decay of the running averages of squared gradients and deltas (default 0.9).
        eps: added inside both square roots (default 1e-6).
        weight_decay: L2 penalty (default 0).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        capturable: must be False.
        maximize: maximize the objective instead of minimizing it (default False).
        differentiable: must be False.

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: a hyperparameter is out of range (as torch.optim.Adadelta), or
            ``capturable`` / ``differentiable`` is True.
        TypeError, ValueError, RuntimeError at ``step``: see :meth:`CpuOptimizer.step`.
    """

    _algorithm = "Adadelta"  # kernel, state and option tables: from roundpipe._C

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        foreach: Optional[bool] = None,
        *,
        capturable: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        check_lr(lr)
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        check_non_negative(eps, "epsilon")
        check_non_negative(weight_decay, "weight_decay")
        defaults = dict(
            lr=lr,
            rho=rho,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
            capturable=capturable,
            foreach=foreach,
            differentiable=differentiable,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)
