"""``roundpipe.optim.RAdam``: torch.optim.RAdam's interface and results, stepped by SIMD kernels."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from ._base import BETAS, CpuOptimizer, check_betas, check_lr, check_non_negative


class RAdam(CpuOptimizer):
    """RAdam, Rectified Adam (Liu et al., "On the Variance of the Adaptive Learning Rate and
    Beyond", 2020), with optional decoupled weight decay (RAdamW, Loshchilov & Hutter, 2019):
    a drop-in replacement for ``torch.optim.RAdam`` whose step runs in the RoundPipe C++
    kernels. While the length of the approximated simple moving average ``rho_t`` is at most 5
    (the first steps), the update is the bias-corrected momentum times ``lr``; after that it is
    Adam's step times the variance rectification term.

    Same signature, defaults, validation errors, ``state`` keys (``step``: 0-dim float32
    tensor; ``exp_avg``, ``exp_avg_sq``: float32, shaped like the parameter) and
    ``state_dict`` format as ``torch.optim.RAdam``, so LR schedulers and checkpoints work
    unchanged, in both directions. Results match ``torch.optim.RAdam(foreach=False)`` to a few
    float32 ulp per step.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` and ``betas`` may be 1-element tensors (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate (default 1e-3).
        betas: decay rates of the first and second moment estimates (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: L2 penalty, or decoupled decay with ``decoupled_weight_decay`` (default 0).
        decoupled_weight_decay: apply weight decay as AdamW does (default False).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        capturable: must be False.
        differentiable: must be False.

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: a hyperparameter is out of range (as torch.optim.RAdam), or ``capturable`` /
            ``differentiable`` is True.
    """

    _algorithm = "RAdam"  # kernel, state and option tables: from roundpipe._C
    _option_keys = BETAS
    _group_defaults = {**CpuOptimizer._group_defaults, "decoupled_weight_decay": False}

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        decoupled_weight_decay: bool = False,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
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
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            decoupled_weight_decay=decoupled_weight_decay,
            differentiable=differentiable,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)
