"""``roundpipe.optim.Adamax``: torch.optim.Adamax's interface and results, stepped by SIMD
kernels."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from ._base import BETAS, CpuOptimizer, check_betas, check_lr, check_non_negative


class Adamax(CpuOptimizer):
    """Adamax (Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015, section 7.1:
    Adam based on the infinity norm): a drop-in replacement for ``torch.optim.Adamax`` whose
    step runs in the RoundPipe C++ kernels.

    As in torch, ``eps`` enters inside the maximum: ``exp_inf = max(beta2 * exp_inf,
    |grad| + eps)``, and the step is ``lr / (1 - beta1**step) * exp_avg / exp_inf``.

    Same signature, defaults, validation errors, ``state`` keys (``step``: 0-dim float32
    tensor; ``exp_avg``, ``exp_inf``: float32, shaped like the parameter, created at the first
    step) and ``state_dict`` format as ``torch.optim.Adamax``, so LR schedulers and checkpoints
    work unchanged, in both directions. Results match ``torch.optim.Adamax(foreach=False)`` to a
    few float32 ulp per step.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` and ``betas`` may be 1-element tensors (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate (default 2e-3).
        betas: decay rates of the first moment and of the infinity norm (default (0.9, 0.999)).
        eps: added to ``|grad|`` inside the maximum (default 1e-8).
        weight_decay: L2 penalty (default 0).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        differentiable: must be False.
        capturable: must be False.

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: a hyperparameter is out of range (as torch.optim.Adamax), or
            ``capturable`` / ``differentiable`` is True.
        TypeError, ValueError, RuntimeError at ``step``: see :meth:`CpuOptimizer.step`.
    """

    _algorithm = "Adamax"  # kernel, state and option tables: from roundpipe._C
    _option_keys = BETAS

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 2e-3,
        betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: Optional[bool] = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        check_lr(lr)
        check_non_negative(eps, "epsilon")
        check_betas(betas)
        check_non_negative(weight_decay, "weight_decay")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            capturable=capturable,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)
