"""``roundpipe.optim.RMSprop``: torch.optim.RMSprop's interface and results, stepped by SIMD
kernels."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ._base import CpuOptimizer, check_lr, check_non_negative


class RMSprop(CpuOptimizer):
    """RMSprop (Hinton, Srivastava & Swersky, "Neural Networks for Machine Learning", lecture 6e,
    2012), with the centered variant (Graves, "Generating Sequences With Recurrent Neural
    Networks", 2013), momentum, L2 weight decay and maximize: a drop-in replacement for
    ``torch.optim.RMSprop`` whose step runs in the RoundPipe C++ kernels.

    Same signature, defaults, validation errors, ``state`` keys (``step``: 0-dim float32 tensor;
    ``square_avg``, with ``momentum > 0`` ``momentum_buffer`` and with ``centered``
    ``grad_avg``: float32, shaped like the parameter, created as zeros at its first step) and
    ``state_dict`` format as ``torch.optim.RMSprop``, so LR schedulers and checkpoints work
    unchanged, in both directions. Results match ``torch.optim.RMSprop(foreach=False)`` to a few
    float32 ulp per step, including torch's NaN where rounding makes the centered variance
    ``square_avg - grad_avg**2`` negative.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` may be a 1-element tensor (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate (default 1e-2).
        alpha: smoothing constant of the running averages (default 0.99).
        eps: added to the denominator, after the square root (default 1e-8).
        weight_decay: L2 penalty (default 0).
        momentum: momentum factor (default 0).
        centered: normalise the gradient by an estimate of its variance (default False).
        capturable: must be False.
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        differentiable: must be False.

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: a hyperparameter is out of range (as torch.optim.RMSprop), or
            ``capturable`` / ``differentiable`` is True.
    """

    _algorithm = "RMSprop"  # kernel, state and option tables: from roundpipe._C
    _group_defaults = {**CpuOptimizer._group_defaults, "momentum": 0, "centered": False}

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        capturable: bool = False,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
        *,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        check_lr(lr)
        check_non_negative(eps, "epsilon")
        check_non_negative(momentum, "momentum")
        check_non_negative(weight_decay, "weight_decay")
        check_non_negative(alpha, "alpha")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            alpha=alpha,
            eps=eps,
            centered=centered,
            weight_decay=weight_decay,
            capturable=capturable,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def check_group(self, group):
        """Also refuses ``centered=True`` with compact state: the centered variance
        ``square_avg - grad_avg**2`` cancels where the gradient barely varies, and the
        rounding of compact state makes it negative there (a NaN square root)."""
        super().check_group(group)
        if group.get("centered") and self.state_dtype is not torch.float32:
            raise ValueError(f"roundpipe.optim.RMSprop: centered=True needs float32 state, got "
                             f"state_dtype={self.state_dtype!r}: the rounding of compact state "
                             "turns square_avg - grad_avg**2 negative where it cancels")

    def _active_state_keys(self, group):
        keys = ("square_avg",)
        if group["momentum"] > 0:
            keys += ("momentum_buffer",)
        if group["centered"]:
            keys += ("grad_avg",)
        return keys
