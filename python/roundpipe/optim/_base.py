"""What every ``roundpipe.optim`` class shares: the compatibility placeholders, scalar
hyperparameters given as tensors, and gathering a parameter group into the lists one C++ call
takes."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.optim import Optimizer


def scalar(x: Any) -> float:
    """A hyperparameter as a Python float (a 1-element tensor such as a tensor ``lr`` included)."""
    return x.item() if isinstance(x, torch.Tensor) else float(x)


class CpuOptimizer(Optimizer):
    """Base of the ``roundpipe.optim`` classes: a ``torch.optim.Optimizer`` whose ``step`` hands
    each parameter group to one C++ kernel call.

    Subclasses validate their hyperparameters as torch does, call ``__init__`` with their
    defaults, and implement ``_init_state(group, p, state)`` and ``_step_group(group, lists)``.

    ``foreach`` and ``fused`` are accepted and ignored with a ``UserWarning`` (the group keeps
    ``None``); ``capturable=True`` or ``differentiable=True`` is a ``ValueError``, also when it
    comes from a loaded state dict.
    """

    # State keys holding one tensor shaped like the parameter, in the order the kernel takes them.
    _state_keys: tuple[str, ...] = ()

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

    def _gather(self, group: dict[str, Any]) -> tuple[list, list, dict[str, list], list]:
        """Lists over the group's parameters, in order: params, grads, one list per
        state key, and the ``step`` tensors; ``None`` everywhere for a parameter without a
        gradient (the kernel skips it). Initialises missing state as torch does."""
        name = type(self).__name__
        params: list = []
        grads: list = []
        states: dict[str, list] = {k: [] for k in self._state_keys}
        steps: list = []
        for p in group["params"]:
            g = p.grad
            if g is None:
                params.append(None)
                grads.append(None)
                for lst in states.values():
                    lst.append(None)
                steps.append(None)
                continue
            if g.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            state = self.state[p]
            if len(state) == 0 or any(k not in state for k in self._required_keys(group)):
                self._init_state(group, p, state)
            params.append(p)
            grads.append(g)
            for k, lst in states.items():
                lst.append(state.get(k))
            steps.append(state.get("step"))
        return params, grads, states, steps

    def _required_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._state_keys

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict) -> None:
        raise NotImplementedError

    def _step_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

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
