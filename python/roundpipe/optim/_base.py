"""What every ``roundpipe.optim`` class shares: the compatibility placeholders, scalar
hyperparameters given as tensors, torch.optim's hyperparameter checks (same conditions, same
messages), and gathering a parameter group into the lists one C++ call takes."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.optim import Optimizer


def scalar(x: Any) -> float:
    """A hyperparameter as a Python float (a 1-element tensor such as a tensor ``lr`` included)."""
    return x.item() if isinstance(x, torch.Tensor) else float(x)


# torch.optim's constructor checks, with its exact messages. Each class calls them in the order
# its torch counterpart checks, so the first bad value reported is the same.


def check_tensor_lr(lr: Any) -> None:
    """A tensor ``lr`` must have one element."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")


def check_lr(lr: Any) -> None:
    """``lr``: a 1-element tensor or a number, ``>= 0`` (NaN fails)."""
    check_tensor_lr(lr)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")


def check_non_negative(value: Any, name: str) -> None:
    """``value >= 0`` (NaN fails); the message calls it ``name`` ("epsilon" for ``eps``)."""
    if not 0.0 <= value:
        raise ValueError(f"Invalid {name} value: {value}")


def check_betas(betas: Any) -> None:
    """Each of the two betas in ``[0, 1)`` (NaN fails), index 0 first."""
    for i in (0, 1):
        if not 0.0 <= betas[i] < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {betas[i]}")


class CpuOptimizer(Optimizer):
    """Base of the ``roundpipe.optim`` classes: a ``torch.optim.Optimizer`` whose ``step`` hands
    each parameter group to one C++ kernel call.

    A subclass validates its hyperparameters as torch does, calls ``__init__`` with its
    defaults, and declares:

    - ``_kernel``: the ``roundpipe._C.<name>_step`` function;
    - ``_state_keys``: its per-element state tensors, in the kernel's slot order;
    - ``_scalar_keys``: its 0-dim float32 state tensors, ``"step"`` first;
    - ``_active_state_keys(group)``: the state keys a group uses (default: all);
    - ``_init_state(group, p, state)``: fills the missing keys as torch initialises them;
    - ``_options(group)``: the ``roundpipe._C.<Name>Options`` for a group.

    ``foreach`` and ``fused`` are accepted and ignored with a ``UserWarning`` (the group keeps
    ``None``); ``capturable=True`` or ``differentiable=True`` is a ``ValueError``, also when it
    comes from a loaded state dict.
    """

    _kernel: Callable[..., None]
    _state_keys: tuple[str, ...] = ()
    _scalar_keys: tuple[str, ...] = ("step",)

    def __init__(self, params, defaults: dict[str, Any]) -> None:
        name = type(self).__name__
        for flag in ("foreach", "fused"):
            if defaults.get(flag):
                warnings.warn(
                    f"roundpipe.optim.{name}: {flag}={defaults[flag]!r} is ignored; the "
                    "RoundPipe CPU kernels are always used",
                    UserWarning,
                    stacklevel=3,
                )
                defaults[flag] = None
        self._check_placeholders(defaults)
        super().__init__(params, defaults)

    def _check_placeholders(self, group: dict[str, Any]) -> None:
        for flag in ("capturable", "differentiable"):
            if group.get(flag):
                raise ValueError(
                    f"roundpipe.optim.{type(self).__name__} does not support {flag}=True"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; 0-dim state saved in another floating
        dtype (e.g. a float64 ``step``) is converted to the float32 the kernels keep."""
        super().load_state_dict(state_dict)
        for p_state in self.state.values():
            for key in self._scalar_keys:
                v = p_state.get(key)
                if torch.is_tensor(v) and v.dtype != torch.float32 and v.is_floating_point():
                    p_state[key] = v.to(torch.float32)

    def _scalar_state_to_tensors(self, keys: tuple[str, ...] = ("step",)) -> None:
        """As torch's ``__setstate__``: 0-dim state saved as Python numbers by old checkpoints
        becomes float32 tensors again."""
        for p_state in self.state.values():
            for key in keys:
                if key in p_state and not torch.is_tensor(p_state[key]):
                    p_state[key] = torch.tensor(float(p_state[key]), dtype=torch.float32)

    def _active_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._state_keys

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError

    def _options(self, group: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _step_group(self, group: dict[str, Any]) -> None:
        """One kernel call over the group: lists in parameter order, ``None`` at every position
        whose parameter has no gradient (the kernel skips it), an empty list for a state slot
        the group does not use. Missing state is initialised first, as torch does."""
        name = type(self).__name__
        active = self._active_state_keys(group)
        needed = frozenset(self._scalar_keys + active)
        params: list = []
        grads: list = []
        states: list[list] = [[] for _ in self._state_keys]
        in_use = [k in active for k in self._state_keys]
        scalars: list[list] = [[] for _ in self._scalar_keys]
        for p in group["params"]:
            g = p.grad
            if g is None:
                state = None
            else:
                if g.is_sparse:
                    raise RuntimeError(f"{name} does not support sparse gradients")
                state = self.state[p]
                if not needed <= state.keys():
                    self._init_state(group, p, state)
            params.append(None if state is None else p)
            grads.append(g)
            for k, lst, use in zip(self._state_keys, states, in_use):
                if use:
                    lst.append(None if state is None else state[k])
            for k, lst in zip(self._scalar_keys, scalars):
                lst.append(None if state is None else state[k])
        type(self)._kernel(self._options(group), params, grads, states, scalars)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Performs one optimization step over every parameter group.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss; it
                runs with gradients enabled.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            RuntimeError: a gradient is sparse.
            TypeError: a parameter, gradient or state tensor is not a float32 CPU tensor (the
                message names the group and the parameter's position in it).
            ValueError: a tensor is not contiguous or not shaped like its parameter, or the
                group asks for ``capturable``/``differentiable``.
        Nothing in a group is modified when its check fails.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            self._check_placeholders(group)
            try:
                self._step_group(group)
            except (TypeError, ValueError) as e:
                raise type(e)(f"roundpipe.optim.{type(self).__name__}: param group {index}: {e}") from None
        return loss
