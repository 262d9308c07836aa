"""Every part of torch's private API RoundPipe uses, in one place: what a new torch release
may change without notice, so an upgrade is checked here (and by the tests of the callers
named below) rather than all over the package.

Checked against torch 2.13.0 (the version ``requirements-dev.txt`` pins); each one exists
unchanged since torch 2.6, the oldest version ``pyproject.toml`` accepts.

- ``torch.utils._pytree`` (:func:`tree_map`, :func:`tree_flatten`, :func:`tree_unflatten`):
  nested inputs and outputs (microbatch splitting, device transfers, stage outputs). Public
  in spirit (``torch.export`` documents its trees) but not yet under a public name.
  :func:`tree_map` walks plain tuples, lists and dicts itself (the trees of every call).
- An optimizer's step hook registries ``_optimizer_step_pre_hooks`` /
  ``_optimizer_step_post_hooks`` and the global ones
  ``torch.optim.optimizer._global_optimizer_pre_hooks`` / ``_global_optimizer_post_hooks``
  (:func:`step_hooks`): an optimizer with user hooks is stepped whole, since the fused entry
  point runs none. An object standing in for an optimizer needs the instance registries
  (:func:`init_hook_registries`).
- ``Optimizer._opt_called`` (:func:`mark_stepped`): what ``torch.optim.lr_scheduler`` reads
  to warn about ``scheduler.step()`` before ``optimizer.step()``; RoundPipe steps optimizers
  through a snapshot or the fused entry point, so it sets the flag itself.
- ``Tensor._version`` (:func:`tensor_version`): in-place writes to a tensor, to notice a
  model copy or buffer changed behind the wrapper's back.
- ``Tensor._base`` (:func:`tensor_base`): the tensor a view was taken from.
- ``Module._parameters`` / ``Module._buffers`` (:func:`module_parameters`,
  :func:`module_buffers`): a module's own parameters and buffers, entries registered as None
  included: the dicts a layer's tensors are swapped into while it runs (what
  ``torch.func.functional_call`` swaps too, at several times the cost per call).
- ``torch.autograd.graph._engine_run_backward`` (:func:`run_backward`): the autograd engine's
  backward, what ``torch.autograd.backward`` calls once it has checked its arguments and made
  the implicit gradient of a scalar; called once per stage visit and microbatch, where the
  checks (``_make_grads``, its symbolic-shape comparisons) cost as much as a small layer's
  backward itself.
- ``ProcessGroup._get_backend(device).options._timeout`` (:func:`group_timeout`): the timeout a
  user's process group was made with (``init_process_group(timeout=...)``), which the gloo
  group RoundPipe makes for its own collectives inherits; torch has no public getter (when the
  options cannot be read, ``distributed_c10d._get_default_timeout``: the backend's default).
"""

from __future__ import annotations

from typing import Any, Callable

import datetime

import torch
from torch import nn
from torch.autograd.graph import _engine_run_backward
from torch.optim import optimizer as _optimizer
from torch.utils import _pytree
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["tree_map", "tree_flatten", "tree_unflatten", "step_hooks", "init_hook_registries",
           "mark_stepped", "tensor_version", "tensor_base", "module_buffers", "group_timeout",
           "run_backward"]

def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``torch.utils._pytree.tree_map(fn, tree)``: ``fn`` applied to every leaf, the
    containers rebuilt. Plain ``tuple``, ``list`` and ``dict`` nodes and tensor leaves are
    walked here as pytree walks them (a dict keeps its key order), without its per-node
    bookkeeping (this runs several times per training call); anything else (None, which
    torch versions treat differently, other leaves and containers) is handed to pytree."""
    kind = type(tree)
    if kind is tuple:
        return tuple([tree_map(fn, x) for x in tree])
    if kind is list:
        return [tree_map(fn, x) for x in tree]
    if kind is dict:
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor) and kind not in _pytree.SUPPORTED_NODES:
        return fn(tree)
    return _pytree.tree_map(fn, tree)


_HOOK_REGISTRIES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks",
                    "_optimizer_load_state_dict_post_hooks")


def step_hooks(opt: torch.optim.Optimizer) -> tuple[list[Callable], list[Callable]]:
    """The step hooks that run around ``opt.step()``: ``(pre, post)``, each ``opt``'s own
    (``register_step_pre_hook`` / ``register_step_post_hook``) followed by the global ones
    (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``)."""
    pre = list(opt._optimizer_step_pre_hooks.values())
    pre += _optimizer._global_optimizer_pre_hooks.values()
    post = list(opt._optimizer_step_post_hooks.values())
    post += _optimizer._global_optimizer_post_hooks.values()
    return pre, post


def init_hook_registries(obj: Any) -> None:
    """Gives ``obj`` (an object standing in for an optimizer without calling
    ``Optimizer.__init__``) the empty hook registries that ``Optimizer``'s methods and
    ``torch.optim.lr_scheduler`` read."""
    for name in _HOOK_REGISTRIES:
        setattr(obj, name, {})


def mark_stepped(opt: torch.optim.Optimizer) -> None:
    """Records that ``opt`` was stepped, as the wrapper ``torch.optim.lr_scheduler`` puts
    around ``opt.step`` does (its warning about calling ``scheduler.step()`` first)."""
    opt._opt_called = True


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s version counter: increases with every in-place write through autograd-visible
    views (not through ``.data``)."""
    return t._version


def tensor_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, or None."""
    return t._base


def module_parameters(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own parameters by name (not its children's), None entries included: the
    dict itself, whose values :func:`roundpipe.pipeline.execute.run_layers` swaps."""
    return module._parameters


def module_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by name (not its children's), None entries included: the
    dict itself, whose values :func:`roundpipe.pipeline.execute.run_layers` swaps."""
    return module._buffers


def group_timeout(group: Any) -> datetime.timedelta:
    """The timeout ``group`` (a ``torch.distributed`` process group) was made with: its
    backend's options, for the first device type it serves; torch's default for the group's
    backend when they cannot be read."""
    import torch.distributed as dist

    for device in getattr(group, "_device_types", ()):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))


def run_backward(tensors: list[torch.Tensor], grads: list) -> None:
    """``torch.autograd.backward(tensors, grads)`` without its argument checks: ``tensors``
    require grad, each ``grads[i]`` is a tensor of ``tensors[i]``'s shape, dtype and device,
    or None for a 1-element ``tensors[i]`` (then its gradient is 1, as torch makes it)."""
    grads = [torch.ones_like(t, memory_format=torch.preserve_format) if g is None else g
             for t, g in zip(tensors, grads)]
    _engine_run_backward(tuple(tensors), tuple(grads), False, False, (),
                         allow_unreachable=True, accumulate_grad=True)
