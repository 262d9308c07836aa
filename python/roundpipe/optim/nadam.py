"""``roundpipe.optim.NAdam``: torch.optim.NAdam's interface and results, stepped by SIMD kernels."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from ._base import BETAS, CpuOptimizer, check_betas, check_lr, check_non_negative


class NAdam(CpuOptimizer):
    """NAdam: Adam with Nesterov momentum (Dozat, "Incorporating Nesterov Momentum into Adam",
    2016), with the momentum schedule ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))``
    and optional decoupled weight decay (NAdamW, Loshchilov & Hutter, 2019): a drop-in
    replacement for ``torch.optim.NAdam`` whose step runs in the RoundPipe C++ kernels.

    Same signature, defaults, validation errors, ``state`` keys (``step`` and ``mu_product``:
    0-dim float32 tensors, the running product of the ``mu_t`` starting at 1; ``exp_avg``,
    ``exp_avg_sq``: float32, shaped like the parameter) and ``state_dict`` format as
    ``torch.optim.NAdam``, so LR schedulers and checkpoints work unchanged, in both directions.
    Results match ``torch.optim.NAdam(foreach=False)`` to a few float32 ulp per step.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` and ``betas`` may be 1-element tensors (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate (default 2e-3).
        betas: decay rates of the first and second moment estimates (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: L2 penalty, or decoupled decay with ``decoupled_weight_decay`` (default 0).
        momentum_decay: the ``psi`` of the momentum schedule (default 4e-3).
        decoupled_weight_decay: apply weight decay as AdamW does (default False).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        capturable: must be False.
        differentiable: must be False.

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: a hyperparameter is out of range (as torch.optim.NAdam), or ``capturable`` /
            ``differentiable`` is True.
    """

    _algorithm = "NAdam"  # kernel, state and option tables: from roundpipe._C
    _option_keys = BETAS
    _group_defaults = {**CpuOptimizer._group_defaults, "decoupled_weight_decay": False}

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 2e-3,
        betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum_decay: float = 4e-3,
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
        check_non_negative(momentum_decay, "momentum_decay")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum_decay=momentum_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _init_state(self, group, p, state):
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["mu_product"] = torch.tensor(1.0, dtype=torch.float32)
        self._new_state(p, state, "exp_avg")
        self._new_state(p, state, "exp_avg_sq")
