"""``roundpipe.optim.Adagrad``: torch.optim.Adagrad's interface and results, stepped by SIMD
kernels."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ._base import CpuOptimizer, check_lr, check_non_negative


class Adagrad(CpuOptimizer):
    """Adagrad (Duchi, Hazan & Singer, "Adaptive Subgradient Methods for Online Learning and
    Stochastic Optimization", JMLR 2011) with learning-rate decay, L2 weight decay and maximize:
    a drop-in replacement for ``torch.optim.Adagrad`` whose step runs in the RoundPipe C++
    kernels.

    Same signature, defaults, validation errors, ``state`` and ``state_dict`` format as
    ``torch.optim.Adagrad``. As there, the state is created when the optimizer is constructed,
    for every parameter (with a gradient or not): ``step`` (0-dim float32 tensor, 0) and ``sum``
    (float32, shaped like the parameter, filled with ``initial_accumulator_value``); a parameter
    added later with ``add_param_group`` gets it at its first step. Like torch, both use the
    constructor's ``initial_accumulator_value``, not a param group's own value. LR schedulers and
    checkpoints work unchanged, in both directions. Results match
    ``torch.optim.Adagrad(foreach=False)`` to a few float32 ulp per step.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape (torch's sparse-gradient Adagrad is not supported). ``lr`` may be a 1-element
    tensor (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate (default 1e-2).
        lr_decay: learning-rate decay: step t uses ``lr / (1 + (t - 1) * lr_decay)``
            (default 0).
        weight_decay: L2 penalty (default 0).
        initial_accumulator_value: initial value of ``sum`` (default 0).
        eps: added to the denominator (default 1e-10).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        maximize: maximize the objective instead of minimizing it (default False).
        differentiable: must be False.
        fused: ignored with a UserWarning (placeholder for torch compatibility).

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: a hyperparameter is out of range (as torch.optim.Adagrad), or
            ``differentiable`` is True.
    """

    _algorithm = "Adagrad"  # kernel, state and option tables: from roundpipe._C
    _group_defaults = {"foreach": None, "maximize": False, "differentiable": False, "fused": None}

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: Optional[bool] = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        check_lr(lr)
        check_non_negative(lr_decay, "lr_decay")
        check_non_negative(weight_decay, "weight_decay")
        check_non_negative(initial_accumulator_value, "initial_accumulator_value")
        check_non_negative(eps, "epsilon")
        defaults = dict(
            lr=lr,
            lr_decay=lr_decay,
            eps=eps,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            fused=fused,
        )
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(group, p, self.state[p])

    def share_memory(self) -> None:
        """Calls ``tensor.share_memory_()`` on the state ``sum`` tensors, as torch does."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"].share_memory_()

    def _init_state(self, group, p, state):
        # torch fills `sum` with the constructor's value (self.defaults), also for a param
        # group that names its own initial_accumulator_value.
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        self._new_state(p, state, "sum", fill=self.defaults["initial_accumulator_value"])
