"""``roundpipe.optim.Rprop``: torch.optim.Rprop's interface and results, stepped by SIMD kernels."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from ._base import CpuOptimizer, check_lr


class Rprop(CpuOptimizer):
    """Rprop, resilient backpropagation (Riedmiller & Braun, "A Direct Adaptive Method for
    Faster Backpropagation Learning: The RPROP Algorithm", 1993), in torch's variant: a drop-in
    replacement for ``torch.optim.Rprop`` whose step runs in the RoundPipe C++ kernels.

    Each element keeps its own step size: multiplied by ``etaplus`` while the gradient keeps its
    sign, by ``etaminus`` when the sign flips (and that step's gradient then counts as zero),
    clamped to ``step_sizes``; the parameter moves by ``-sign(grad) * step_size``. ``lr`` is
    only the initial step size, read when a parameter's state is created (as in torch, a later
    change of ``lr``, by hand or by an LR scheduler, does not affect existing state).
    Non-finite values land where torch puts them: ``torch.sign(nan)`` is 0, so a NaN gradient
    leaves the parameter and its step size unchanged and is remembered in ``prev``.

    Same signature, defaults, validation errors, ``state`` keys (``step``: 0-dim float32
    tensor; ``prev``, ``step_size``: float32, shaped like the parameter) and ``state_dict``
    format as ``torch.optim.Rprop``, so checkpoints move between the two in both directions.
    Results match ``torch.optim.Rprop(foreach=False)`` to a few float32 ulp per step.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` may be a 1-element tensor.

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: the initial step size (default 1e-2).
        etas: ``(etaminus, etaplus)``, the step-size factors after a sign change and while the
            sign holds (default (0.5, 1.2)).
        step_sizes: ``(min, max)`` step size (default (1e-6, 50)); not checked, as in torch
            (``max`` wins where it is below ``min``; a NaN bound makes every step size NaN).
        capturable: must be False.
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        differentiable: must be False.

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: ``lr`` or ``etas`` out of range (as torch.optim.Rprop), or ``capturable`` /
            ``differentiable`` is True.
    """

    _algorithm = "Rprop"  # kernel, state and option tables: from roundpipe._C
    _option_keys = {"etaminus": ("etas", 0), "etaplus": ("etas", 1),
                    "step_size_min": ("step_sizes", 0), "step_size_max": ("step_sizes", 1)}

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-2,
        etas: Tuple[float, float] = (0.5, 1.2),
        step_sizes: Tuple[float, float] = (1e-6, 50),
        *,
        capturable: bool = False,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        check_lr(lr)
        if not 0.0 < etas[0] < 1.0 < etas[1]:
            raise ValueError(f"Invalid eta values: {etas[0]}, {etas[1]}")
        defaults = dict(
            lr=lr,
            etas=etas,
            step_sizes=step_sizes,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            capturable=capturable,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _init_state(self, group, p, state):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.dim() != 0:
            lr = lr.squeeze()  # torch's _to_scalar
        state["step"] = torch.zeros((), dtype=torch.float32)
        self._new_state(p, state, "prev")
        self._new_state(p, state, "step_size", fill=float(lr))
