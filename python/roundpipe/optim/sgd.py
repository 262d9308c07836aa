"""``roundpipe.optim.SGD``: torch.optim.SGD's interface and results, stepped by SIMD kernels."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from ._base import CpuOptimizer, mark_updated, check_tensor_lr

# The kernel's flag for a momentum buffer that already holds a value. The kernel writes a flag
# only when it turns it from 0 to 1, so this one tensor serves every such buffer and is never
# written; a buffer created in this step gets a zero flag of its own.
_READY = torch.ones((), dtype=torch.float32)


class SGD(CpuOptimizer):
    """Stochastic gradient descent, optionally with momentum (Polyak's heavy ball, with
    dampening) or Nesterov momentum (Sutskever et al., "On the importance of initialization and
    momentum in deep learning", 2013), L2 weight decay and maximize: a drop-in replacement for
    ``torch.optim.SGD`` whose step runs in the RoundPipe C++ kernels.

    Same signature, defaults, validation errors, ``state`` and ``state_dict`` format as
    ``torch.optim.SGD``: no ``step`` count; with ``momentum != 0``, ``momentum_buffer`` (float32,
    shaped like the parameter) appears at a parameter's first step as a copy of its (decayed)
    gradient; with ``momentum == 0`` the optimizer keeps no state at all. LR schedulers and
    checkpoints work unchanged, in both directions. Results match
    ``torch.optim.SGD(foreach=False)`` to a float32 ulp or so per step.

    Parameters must be float32, CPU, dense and contiguous tensors with dense gradients of the
    same shape. ``lr`` and ``weight_decay`` may be 1-element tensors (read at every step).

    Args:
        params: iterable of parameters, ``(name, parameter)`` pairs or param-group dicts.
        lr: learning rate (default 1e-3).
        momentum: momentum factor (default 0).
        dampening: dampening for momentum (default 0).
        weight_decay: L2 penalty (default 0).
        nesterov: use Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``
            (default False).
        maximize: maximize the objective instead of minimizing it (default False).
        foreach: ignored with a UserWarning (placeholder for torch compatibility).
        differentiable: must be False.
        fused: ignored with a UserWarning (placeholder for torch compatibility).

        state_dtype, stochastic_rounding, seed: compact storage, keyword-only (see
            :class:`roundpipe.optim.CpuOptimizer`, :mod:`roundpipe.optim.compact`).
    Raises:
        ValueError: a hyperparameter is out of range or ``nesterov`` lacks momentum or has
            dampening (as torch.optim.SGD), or ``differentiable`` is True.
    """

    _algorithm = "SGD"  # kernel, state and option tables: from roundpipe._C
    # the kernel's one 0-dim slot (SGDState.scalar_names: momentum_buffer_ready) is not a state
    # key of torch's: the step passes it itself (_plan_scalars, _step_tensors)
    _scalar_keys = ()
    _group_defaults = {"nesterov": False, "maximize": False, "foreach": None,
                       "differentiable": False, "fused": False}

    def __init__(
        self,
        params,
        lr: Union[float, torch.Tensor] = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: Union[float, torch.Tensor] = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        state_dtype: Any = torch.float32,
        stochastic_rounding: bool = False,
        seed: Optional[int] = None
    ) -> None:
        check_tensor_lr(lr)
        # torch.optim.SGD tests `x < 0.0`, not `not 0.0 <= x`: NaN passes, as there.
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
        )
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, defaults, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _step_tensors(self, group, group_params, group_grads, model_copies=None, io=None):
        """One kernel call over ``group_params`` with ``group_grads``, as torch.optim.SGD.step
        (see CpuOptimizer._step_tensors): without momentum no state
        is read or created; with momentum a parameter without ``momentum_buffer`` gets one (in
        the optimizer's state format), stored only once the kernel has filled it, so a step
        that fails its checks leaves no unfilled buffer behind."""
        use_momentum = group["momentum"] != 0
        params: list = []
        grads: list = []
        buffers: list = []
        ready: list = []
        pstates: list = []
        created: list = []
        for p, g in zip(group_params, group_grads):
            if g is not None and g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            params.append(None if g is None else p)
            grads.append(g)
            if not use_momentum:
                continue
            if g is None:
                buffers.append(None)
                ready.append(None)
                pstates.append(None)
                continue
            st = self.state.get(p, {})  # no empty entry left behind by a refused step
            if st.get("momentum_buffer") is None:
                st = {}
                self._new_state(p, st, "momentum_buffer")  # its values are never read
                created.append((p, st))
                ready.append(torch.zeros((), dtype=torch.float32))
            else:
                ready.append(_READY)
            buffers.append(st["momentum_buffer"])
            pstates.append(st)
        self._call_kernel(group, params, grads, [buffers] if use_momentum else [],
                          [ready] if use_momentum else [], pstates, model_copies, io)
        mark_updated(params, model_copies)
        for p, st in created:
            self.state[p].update(st)

    def _plan_scalars(self, group):
        # the kernel's momentum-ready flag: every buffer in the state holds a value
        return (_READY,) if group["momentum"] != 0 else ()

    def _active_state_keys(self, group):
        return self._state_keys if group["momentum"] != 0 else ()
