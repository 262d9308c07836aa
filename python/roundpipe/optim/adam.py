"""``roundpipe.optim.Adam``: torch.optim.Adam's interface and results, stepped by SIMD kernels."""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from ._base import BETAS, CpuOptimizer, check_betas, check_lr, check_non_negative, scalar


class Adam(CpuOptimizer):
    """Adam (Kingma & Ba, 2015), with the AMSGrad variant (Reddi et al., 2018) and decoupled
    weight decay (AdamW, Loshchilov & Hutter, 2019): a drop-in replacement for
    ``torch.optim.Adam`` whose step runs in the RoundPipe C++ kernels.

    Same signature, defaults, validation errors, ``state`` keys (``step``: 0-dim float32
    tensor; ``exp_avg``, ``exp_avg_sq`` and, with ``amsgrad``, ``max_exp_avg_sq``: float32,
    shaped like the parameter) and ``state_dict`` format as ``torch.optim.Adam``, so LR
    schedulers and checkpoints work unchanged, in both directions. Results match
    ``torch.optim.Adam(foreach=False)`` to a few float32 ulp per step.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` and ``betas`` may be 1-element tensors (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate (default 1e-3).
        betas: decay rates of the first and second moment estimates (default (0.9, 0.999)).
        eps: added to the denominator (default 1e-8).
        weight_decay: L2 penalty, or decoupled decay with ``decoupled_weight_decay`` (default 0).
        amsgrad: use the running maximum of the second moment (default False).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        capturable: must be False.
        differentiable: must be False.
        fused: ignored with a UserWarning (placeholder for torch compatibility).
        decoupled_weight_decay: apply weight decay as AdamW does (default False).

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: a hyperparameter is out of range (as torch.optim.Adam), or ``capturable`` /
            ``differentiable`` is True.
    """

    _algorithm = "Adam"  # kernel, state and option tables: from roundpipe._C
    _option_keys = BETAS
    _group_defaults = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                       "differentiable": False, "decoupled_weight_decay": False, "fused": None}

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-3,
        betas: Tuple[Union[float, torch.Tensor], Union[float, torch.Tensor]] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        decoupled_weight_decay: bool = False,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        check_lr(lr)
        check_non_negative(eps, "epsilon")
        check_betas(betas)
        check_non_negative(weight_decay, "weight_decay")
        if not (
            (isinstance(betas[0], float) and isinstance(betas[1], float))
            or (isinstance(betas[0], torch.Tensor) and isinstance(betas[1], torch.Tensor))
        ):
            raise ValueError("betas must be either both floats or both Tensors")
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor) and b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
        defaults = dict(
            lr=lr,
            betas=tuple(scalar(b) for b in betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _active_state_keys(self, group):
        return self._state_keys if group["amsgrad"] else self._state_keys[:2]
