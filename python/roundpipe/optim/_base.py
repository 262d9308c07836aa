"""What every ``roundpipe.optim`` class shares: the compatibility placeholders, scalar
hyperparameters given as tensors, torch.optim's hyperparameter checks (same conditions, same
messages), and gathering a parameter group into the lists one C++ call takes."""

from __future__ import annotations

import math
import numbers
import operator
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch.autograd.graph import increment_version
from torch.optim import Optimizer

from .. import _C
from ..host_buffers import host_zeros


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


def mark_updated(params: list, model_copies: Optional[list] = None) -> None:
    """The kernels write through raw pointers, which autograd cannot see: bump the version
    counters of the updated parameters (and model copies) as torch's in-place ops do, so that
    autograd still refuses a backward through values saved before the step."""
    updated = [p for p in params if p is not None]
    if model_copies:
        updated += [c for c, p in zip(model_copies, params) if p is not None]
    increment_version(updated)


def _grad_scale(grad_scale: Any, name: str) -> float:
    """``grad_scale`` (None, a real number or a 1-element tensor, e.g. a GradScaler's scale)
    as a float whose float32 reciprocal is finite and > 0."""
    if grad_scale is None:
        return 1.0
    ok = not isinstance(grad_scale, bool) and (
        isinstance(grad_scale, numbers.Real)
        or (isinstance(grad_scale, torch.Tensor) and grad_scale.numel() == 1
            and grad_scale.is_floating_point()))
    try:
        value = float(grad_scale) if ok else float("nan")
    except OverflowError:
        value = float("inf")
    inv = torch.tensor(1.0 / value if 0.0 < value < float("inf") else float("nan"),
                       dtype=torch.float32)
    if not (0.0 < value < float("inf")) or not (0.0 < float(inv) < float("inf")):
        raise ValueError(f"{name}: grad_scale must be a number or 1-element floating tensor, "
                         f"finite and > 0 with a finite float32 reciprocal, got {grad_scale!r}")
    return value


class StepStats(NamedTuple):
    """What :meth:`CpuOptimizer.fused_step` saw in the gradients it applied.

    Attributes:
        found_inf: some gradient element (after unscaling) was inf or NaN.
        grad_norm_sq: sum of squares of the unscaled gradients (float64 accumulation), or
            None when ``grad_norm=False``.
    """

    found_inf: bool
    grad_norm_sq: Optional[float]


class CpuOptimizer(Optimizer):
    """Base of the ``roundpipe.optim`` classes: a ``torch.optim.Optimizer`` whose ``step`` hands
    each parameter group to one C++ kernel call.

    A subclass validates its hyperparameters as torch does, calls ``__init__`` with its
    defaults, and declares:

    - ``_kernel``: the ``roundpipe._C.<name>_step`` function;
    - ``_state_keys``: its per-element state tensors, in the kernel's slot order;
    - ``_scalar_keys``: its 0-dim float32 state tensors, ``"step"`` first;
    - ``_active_state_keys(group)``: the state keys a group uses (default: all);
    - ``_group_defaults``: the options torch's ``__setstate__`` adds to old param groups;
    - ``_init_state(group, p, state)``: fills a parameter's empty state as torch initialises
      it (default: zeros; see below);
    - ``_options(group)``: the ``roundpipe._C.<Name>Options`` for a group.

    ``foreach`` and ``fused`` are accepted and ignored with a ``UserWarning`` (the group keeps
    ``None``); ``capturable=True`` or ``differentiable=True`` is a ``ValueError``, also when it
    comes from a loaded state dict.
    """

    _kernel: Callable[..., None]
    _state_keys: tuple[str, ...] = ()
    _scalar_keys: tuple[str, ...] = ("step",)
    # options the torch class's __setstate__ adds to param groups of old checkpoints
    _group_defaults: dict[str, Any] = {"foreach": None, "maximize": False,
                                       "differentiable": False, "capturable": False}

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

    @property
    def num_threads(self) -> Optional[int]:
        """Threads this optimizer's steps use; None (the default) follows
        ``roundpipe.optim.num_threads()``. Set it to an int in [1, 1024] or None (ValueError
        otherwise). Not part of ``state_dict``."""
        return getattr(self, "_num_threads", None)

    @num_threads.setter
    def num_threads(self, n: Optional[int]) -> None:
        if n is not None:
            try:
                value = None if isinstance(n, bool) else operator.index(n)
            except TypeError:
                value = None
            if value is None or not 1 <= value <= 1024:
                raise ValueError(f"roundpipe.optim.{type(self).__name__}.num_threads must be "
                                 f"None or an int in [1, 1024], got {n!r}")
            n = value
        self._num_threads = n

    def _check_placeholders(self, group: dict[str, Any]) -> None:
        for flag in ("capturable", "differentiable"):
            if group.get(flag):
                raise ValueError(
                    f"roundpipe.optim.{type(self).__name__} does not support {flag}=True"
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; 0-dim state saved in another dtype (an
        int64 or float64 ``step``, which torch keeps as it is) is converted to the float32 the
        kernels keep, so the next steps compute what torch computes from it.

        Raises:
            ValueError: (before anything changes) a per-element state tensor's shape differs from
                its parameter's; the kernels compare only element and dimension counts.
        """
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) == len(self.param_groups):
            by_id = {saved: p for sg, g in zip(saved_groups, self.param_groups)
                     for saved, p in zip(sg["params"], g["params"])}
            for saved, p_state in state_dict.get("state", {}).items():
                p = by_id.get(saved)
                for key in self._state_keys:
                    v = p_state.get(key) if p is not None else None
                    if torch.is_tensor(v) and v.shape != p.shape:
                        raise ValueError(
                            f"roundpipe.optim.{type(self).__name__}.load_state_dict: state "
                            f"{key!r} of parameter {saved} has shape {tuple(v.shape)}, the "
                            f"parameter {tuple(p.shape)}")
        super().load_state_dict(state_dict)  # ends with __setstate__, which converts 0-dim state

    def _scalar_state_to_tensors(self) -> None:
        """0-dim state as the kernels keep it, float32 tensors: Python numbers (old checkpoints;
        torch's ``__setstate__`` converts them too) and tensors of another dtype (an int64 or
        float64 ``step``, which torch accepts) are converted."""
        for p_state in self.state.values():
            for key in self._scalar_keys:
                v = p_state.get(key)
                if v is None or (torch.is_tensor(v) and v.dtype == torch.float32):
                    continue
                p_state[key] = (v.to(torch.float32) if torch.is_tensor(v)
                                else torch.tensor(float(v), dtype=torch.float32))

    def _active_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._state_keys

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict) -> None:
        """Fills the empty ``state`` of ``p`` as torch initialises most algorithms' state: each
        0-dim value (``_scalar_keys``) a float32 zero, each per-element tensor the group uses
        (``_active_state_keys``) zeros shaped like ``p`` (large ones in their own memory
        mapping, see :mod:`roundpipe.host_buffers`). Algorithms that start elsewhere override
        it."""
        for key in self._scalar_keys:
            state[key] = torch.zeros((), dtype=torch.float32)
        for key in self._active_state_keys(group):
            state[key] = host_zeros(p.shape, p.dtype)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As torch's ``__setstate__``: param groups from old checkpoints get the options they
        lack (``_group_defaults``, the keys the torch class fills in); 0-dim state becomes
        float32 tensors (``_scalar_state_to_tensors``)."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self._group_defaults.items():
                group.setdefault(key, value)
        self._scalar_state_to_tensors()

    def _options(self, group: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _step_group(self, group: dict[str, Any]) -> None:
        """One kernel call over the group with the parameters' own ``.grad``."""
        self._step_tensors(group, group["params"], [p.grad for p in group["params"]])

    def _step_tensors(self, group: dict[str, Any], params: list, grads: list,
                      model_copies: list | None = None, io: Any = None) -> None:
        """One kernel call over ``params`` (all of ``group``) with gradients ``grads``: lists in
        parameter order, ``None`` at every position whose gradient is None (the kernel skips
        it), an empty list for a state slot the group does not use. Missing state is
        initialised first, as torch does."""
        active = self._active_state_keys(group)
        if any(g.is_sparse for g in grads if g is not None):
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        state_of = self.state
        pstates = [None if g is None else state_of[p] for p, g in zip(params, grads)]

        def gather():  # per slot, the state of every parameter (None where skipped)
            states = [[None if st is None else st[k] for st in pstates] if k in active else []
                      for k in self._state_keys]
            scalars = [[None if st is None else st[k] for st in pstates]
                       for k in self._scalar_keys]
            return states, scalars

        try:
            states, scalars = gather()
        except KeyError:
            # As torch: a parameter without state (its first step) gets it now; state that
            # lacks a key the group needs (a damaged checkpoint, amsgrad switched on later) is
            # torch's KeyError naming the key, raised before anything is created or stepped.
            for st in pstates:
                missing = [k for k in active + self._scalar_keys if st and k not in st]
                if missing:
                    raise KeyError(missing[0]) from None
            for p, st in zip(params, pstates):
                if st is not None and not st:
                    self._init_state(group, p, st)
            states, scalars = gather()
        kparams = [None if st is None else p for p, st in zip(params, pstates)]
        type(self)._kernel(self._options(group), kparams, grads, states, scalars, model_copies, io,
                           self.num_threads or 0)
        mark_updated(kparams, model_copies)

    def _group_of(self, p: torch.Tensor) -> Optional[int]:
        """Index of the param group holding ``p`` (None if none does), from an index rebuilt
        whenever it disagrees with the groups (checked at the cached position)."""
        for attempt in (0, 1):
            index = getattr(self, "_group_index_cache", None)
            if index is None or attempt == 1:
                index = {id(q): (gi, k) for gi, g in enumerate(self.param_groups)
                         for k, q in enumerate(g["params"])}
                self._group_index_cache = index
            where = index.get(id(p))
            if where is not None:
                gi, k = where
                if (gi < len(self.param_groups) and k < len(self.param_groups[gi]["params"])
                        and self.param_groups[gi]["params"][k] is p):
                    return gi
        return None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_num_threads"] = self.num_threads  # kept by copy.deepcopy and pickling
        return state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; ``capturable``/``differentiable``
        True is a ``ValueError`` here too, before the group is added."""
        self._check_placeholders(param_group)
        super().add_param_group(param_group)

    @torch.no_grad()
    def fused_step(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   model_copies: Optional[Sequence[torch.Tensor]] = None, *,
                   grad_scale: Optional[float] = None, clip_factor: float = 1.0,
                   grad_norm: bool = False) -> StepStats:
        """Steps only ``params``, with the gradients ``grads`` instead of their ``.grad``, and
        writes the updated values into ``model_copies``: the mixed-precision entry point of
        the pipeline (a layer's parameters are stepped as soon as its gradients are final).

        The result equals, bit for bit, setting ``p.grad = g.float() * (1 / grad_scale)``
        (the factor rounded to float32; then ``* clip_factor``) for each pair, calling :meth:`step` on an optimizer
        holding only these parameters (each with its own group's hyperparameters), then
        ``copy.copy_(p)`` (round to nearest even). State is created and step counts advance
        as in :meth:`step`; parameters' ``.grad`` are neither read nor changed.

        Args:
            params: parameters of this optimizer (float32, CPU, contiguous), each at most once.
            grads: one gradient per parameter, same shape; float32, bfloat16 or float16, CPU,
                contiguous. Read, never modified.
            model_copies: optional, one tensor per parameter, same shape; float32, bfloat16 or
                float16, CPU, contiguous: receives the updated parameter.
            grad_scale: the gradients are multiplied by ``1 / grad_scale`` (e.g. a loss scale;
                a number or a 1-element floating tensor, finite and > 0). The update is applied even when a gradient is inf or
                NaN; check ``found_inf`` (or check the gradients before) to skip a step.
            clip_factor: then the gradients are multiplied by this number rounded to float32, a
                second rounding (``g * float32(1 / grad_scale) * float32(clip_factor)``, as
                ``torch.nn.utils.clip_grad_norm_`` after ``GradScaler.unscale_``; default 1:
                not applied). NaN is accepted and spreads, as torch's clipping by a NaN norm.
            grad_norm: also return the squared L2 norm of the unscaled gradients (before
                ``clip_factor``).

        Returns:
            :class:`StepStats`.

        Raises:
            ValueError: a parameter is not in this optimizer or is given twice, the lists differ
                in length, a tensor's shape differs from its parameter's, a tensor is a negated
                view, a group asks for ``capturable``/``differentiable``, or ``grad_scale`` is
                not finite and > 0 (with a finite float32 reciprocal).
            TypeError: a tensor has the wrong dtype or device.
            RuntimeError: a gradient is sparse.
            KeyError: a parameter's state lacks a key its group needs (as :meth:`step`).
        Nothing is modified when a check of the arguments fails. The parameters' own tensors
        (parameter, state) are checked group by group as each group steps, as in :meth:`step`:
        a bad tensor there (e.g. a corrupted state tensor) leaves the earlier groups stepped.
        Step hooks do not run (this is a partial step); for torch's LR schedulers it counts
        as an optimizer step.
        """
        name = f"roundpipe.optim.{type(self).__name__}.fused_step"
        params, grads = list(params), list(grads)
        copies = list(model_copies) if model_copies is not None else None
        if len(grads) != len(params) or (copies is not None and len(copies) != len(params)):
            raise ValueError(f"{name}: params, grads and model_copies must have the same length, "
                             f"got {len(params)}, {len(grads)}"
                             + (f", {len(copies)}" if copies is not None else ""))
        scale = _grad_scale(grad_scale, name)
        if isinstance(clip_factor, bool) or not isinstance(clip_factor, numbers.Real) \
                or math.isinf(clip_factor):
            raise ValueError(f"{name}: clip_factor must be a finite real number (or NaN), got "
                             f"{clip_factor!r}")
        by_group: dict[int, list[int]] = {}
        seen: set[int] = set()
        for i, p in enumerate(params):
            gi = self._group_of(p)
            if gi is None:
                raise ValueError(f"{name}: params[{i}] is not a parameter of this optimizer")
            if id(p) in seen:
                raise ValueError(f"{name}: params[{i}] is given twice")
            seen.add(id(p))
            by_group.setdefault(gi, []).append(i)
        for gi in by_group:  # before any group steps
            self._check_placeholders(self.param_groups[gi])
        for i, (p, g) in enumerate(zip(params, grads)):
            if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
                raise TypeError(f"{name}: params[{i}] must be a contiguous float32 CPU tensor, "
                                f"got {p.dtype} on {p.device}")
            tensors = [("grads", g)] + ([("model_copies", copies[i])] if copies is not None else [])
            for what, t in tensors:
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}: {what}[{i}] must be a tensor, got {type(t).__name__}")
                if t.is_sparse:
                    raise RuntimeError(f"{name}: {what}[{i}] is sparse")
                if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                    raise TypeError(f"{name}: {what}[{i}] must be float32, bfloat16 or float16, "
                                    f"got {t.dtype}")
                if t.device.type != "cpu":
                    raise TypeError(f"{name}: {what}[{i}] must be a CPU tensor, got {t.device}")
                if t.shape != p.shape:
                    raise ValueError(f"{name}: {what}[{i}] has shape {tuple(t.shape)}, its "
                                     f"parameter {tuple(p.shape)}")
                if not t.is_contiguous():
                    raise ValueError(f"{name}: {what}[{i}] must be contiguous")
        io = _C.StepIO()
        io.grad_scale = scale
        io.grad_clip = float(clip_factor)
        io.want_grad_norm = bool(grad_norm)
        self._opt_called = True  # an optimizer step for torch's LR schedulers (no warning)
        found_inf, norm_sq = False, 0.0
        for gi, positions in sorted(by_group.items()):
            group = self.param_groups[gi]
            self._check_placeholders(group)
            try:
                self._step_tensors(group, [params[i] for i in positions],
                                   [grads[i] for i in positions],
                                   [copies[i] for i in positions] if copies is not None else None,
                                   io)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{name}: param group {gi}: {e}") from None
            found_inf = found_inf or io.found_inf
            norm_sq += io.grad_norm_sq
        return StepStats(found_inf, norm_sq if grad_norm else None)

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
            KeyError: a parameter's state lacks a key its group needs (e.g. ``exp_avg_sq``, or
                ``max_exp_avg_sq`` once ``amsgrad`` is switched on), as torch.optim raises it.
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
