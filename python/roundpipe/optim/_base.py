"""What every ``roundpipe.optim`` class shares: the compatibility placeholders, scalar
hyperparameters given as tensors, torch.optim's hyperparameter checks (same conditions, same
messages), compact storage (bfloat16 parameters, bfloat16 or int8 state; :mod:`.compact`), and
gathering a parameter group into the lists one C++ call takes."""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import operator
import struct
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
from torch.autograd.graph import increment_version
from torch.optim import Optimizer

from .. import _C
from . import compact
from ..disk import StateStore, any_open, store_of
from ..exit_gate import STEP_GATE
from ..torch_private import mark_stepped, tree_map


def _gated(fn: Callable) -> Callable:
    """``fn`` run inside :data:`roundpipe.exit_gate.STEP_GATE` (its C++ work ends before the
    interpreter finalises)."""

    @functools.wraps(fn)
    def gated(*args, **kwargs):
        with STEP_GATE:
            return fn(*args, **kwargs)

    return gated


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


# the option fields of the Adam family: torch's ``betas`` pair (see ``_option_keys``)
BETAS = {"beta1": ("betas", 0), "beta2": ("betas", 1)}


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
    if not (0.0 < value < float("inf")) or not (0.0 < _float32(1.0 / value) < float("inf")):
        raise ValueError(f"{name}: grad_scale must be a number or 1-element floating tensor, "
                         f"finite and > 0 with a finite float32 reciprocal, got {grad_scale!r}")
    return value


def _float32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even; inf where it overflows), without a tensor."""
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # struct refuses what rounds to +-inf
        return math.copysign(float("inf"), x)


_F32 = struct.Struct("f")


class StepStats(NamedTuple):
    """What :meth:`CpuOptimizer.fused_step` saw in the gradients it applied.

    Attributes:
        found_inf: some gradient element (after unscaling) was inf or NaN.
        grad_norm_sq: sum of squares of the unscaled gradients (float64 accumulation), or
            None when ``grad_norm=False``.
    """

    found_inf: bool
    grad_norm_sq: Optional[float]


def frozen_copy(opt: Optimizer) -> Optimizer:
    """A shallow twin of any ``torch.optim.Optimizer`` ``opt``: the same class, sharing its
    state, parameters and everything else, but with a copy of each param group's
    hyperparameters as they are now (tensors cloned, e.g. a tensor ``lr`` that an LR
    scheduler changes in place). Stepping the twin updates ``opt``'s parameters and state with
    those hyperparameters, whatever is done to ``opt.param_groups`` meanwhile (RoundPipe's
    asynchronous and exact steps). Instance attributes wrapping ``opt``'s own ``step`` or
    ``zero_grad`` (an LR scheduler's step counter, RoundPipe's waiting ``zero_grad``) are not
    copied: the twin uses its class's methods."""
    twin = object.__new__(type(opt))
    twin.__dict__.update(opt.__dict__)
    twin.param_groups = [
        {k: (v if k == "params" else tree_map(
            lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, v))
         for k, v in g.items()}
        for g in opt.param_groups]
    twin.__dict__.pop("step", None)
    twin.__dict__.pop("zero_grad", None)
    return twin


class _DiskRoom:
    """An optimizer's room in a :class:`~roundpipe.disk.StateStore` (shared with its shallow
    twins): the file reserved at its first step for all of its state there."""

    store: Optional[StateStore] = None
    extent: Any = None


class CpuOptimizer(Optimizer):
    """Base of the ``roundpipe.optim`` classes: a ``torch.optim.Optimizer`` whose ``step`` hands
    each parameter group to one C++ kernel call.

    A subclass validates its hyperparameters as torch does, calls ``__init__`` with its
    defaults, and declares:

    - ``_algorithm``: its C++ algorithm, a key of ``roundpipe._C.algorithms`` (e.g. ``"Adam"``).
      The tables below are derived from it when the class is created, from the metadata the
      C++ headers export (the single source): ``_kernel`` (``roundpipe._C.<name>_step``),
      ``_state_keys`` (the per-element state tensors, in the kernel's slot order:
      ``<Name>State.state_names``), ``_scalar_keys`` (the 0-dim float32 state tensors,
      ``"step"`` first: ``<Name>State.scalar_names``, unless the class sets its own),
      ``_int8_signed`` (from ``<Name>State.int8_signed``) and the option fields of
      :meth:`_options` (``<Name>Options.fields``);
    - ``_option_keys``: the C++ option fields that torch names otherwise, each mapped to
      ``(param group key, index in it)``, e.g. ``{"beta1": ("betas", 0)}``; every other field
      is read from the group key of its own name;
    - ``_active_state_keys(group)``: the state keys a group uses (default: all);
    - ``_group_defaults``: the options torch's ``__setstate__`` adds to old param groups;
    - ``_init_state(group, p, state)``: fills a parameter's empty state as torch initialises
      it (default: zeros; see below).

    ``foreach`` and ``fused`` are accepted and ignored with a ``UserWarning`` (the group keeps
    ``None``); ``capturable=True`` or ``differentiable=True`` is a ``ValueError``, also when it
    comes from a loaded state dict.

    Compact storage (keyword-only arguments of every class; :mod:`roundpipe.optim.compact`):

    - ``state_dtype``: ``torch.float32`` (default: torch's state, bit for bit),
      ``torch.bfloat16`` (per-element state stored in bfloat16, rounded stochastically, math
      in float32) or ``"int8"`` (8-bit blockwise, the dynamic maps of 8-bit Adam, one float32
      absmax per 256 elements; for the algorithms listing ``_int8_signed`` and parameters of
      at least 4096 elements, smaller ones keeping float32). The state is read and written in
      its compact form by the one pass of the step; no float32 copy of it exists.
    - ``stochastic_rounding``: accept bfloat16 parameters ("master weights" kept in bfloat16):
      read, updated in float32, stored with stochastic rounding (the expected stored value is
      the float32 update). False (default): parameters must be float32, as without it.
    - ``seed``: the rounding bits' seed (an int; None: drawn from torch's global generator,
      so ``torch.manual_seed`` fixes it). The bits of a parameter at a step depend only on
      the seed, the parameter's position in the optimizer and its step count (for SGD, the
      optimizer's count of kernel calls): the same on every thread count.

    ``_int8_signed`` (state key -> whether its values take either sign: the signed map, else
    the unsigned one) is empty for an algorithm that does not allow int8 state.
    """

    _algorithm: str = ""
    _option_keys: dict[str, tuple[str, int]] = {}
    _kernel: Callable[..., None]
    _state_keys: tuple[str, ...] = ()
    _int8_signed: dict[str, bool] = {}
    _scalar_keys: tuple[str, ...] = ("step",)
    _options_type: Any = None
    # per C++ option field: (field, param group key, index in it or None, whether a float)
    _option_fields: tuple[tuple[str, str, Optional[int], bool], ...] = ()
    # options the torch class's __setstate__ adds to param groups of old checkpoints
    _group_defaults: dict[str, Any] = {"foreach": None, "maximize": False,
                                       "differentiable": False, "capturable": False}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Derives the class's tables from the C++ algorithm it names in its own body
        (``_algorithm``; a subclass that names none, such as AdamW, keeps its parent's).

        Raises:
            TypeError: ``_algorithm`` is not one of ``roundpipe._C.algorithms``.
        """
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("_algorithm")
        if name is None:
            return
        if name not in _C.algorithms:
            raise TypeError(f"{cls.__name__}._algorithm: {name!r} is not a C++ algorithm "
                            f"(roundpipe._C.algorithms: {sorted(_C.algorithms)})")
        state = getattr(_C, f"{name}State")
        cls._kernel = getattr(_C, f"{_C.algorithms[name]}_step")
        cls._state_keys = tuple(state.state_names)
        cls._int8_signed = ({} if state.int8_signed is None
                            else dict(zip(state.state_names, state.int8_signed)))
        if "_scalar_keys" not in cls.__dict__:
            cls._scalar_keys = tuple(state.scalar_names)
        cls._options_type = getattr(_C, f"{name}Options")
        defaults = cls._options_type()
        cls._option_fields = tuple(
            (field, *cls._option_keys.get(field, (field, None)),
             isinstance(getattr(defaults, field), float))
            for field in cls._options_type.fields)

    @staticmethod
    def profile_hook_step(func: Callable) -> Callable:
        """torch's wrapper of ``step`` (its step hooks and profiler range, installed once per
        class by ``Optimizer.__init__``), itself run inside
        :data:`roundpipe.exit_gate.STEP_GATE`: a daemon thread's step, torch's C++ calls
        around it included, ends before the interpreter finalises."""
        return _gated(Optimizer.profile_hook_step(func))

    def __init__(self, params, defaults: dict[str, Any], *, state_dtype: Any = torch.float32,
                 stochastic_rounding: bool = False, seed: Optional[int] = None) -> None:
        name = type(self).__name__
        self._memory = compact.Memory.create(f"roundpipe.optim.{name}", state_dtype,
                                             stochastic_rounding, seed,
                                             int8_allowed=bool(self._int8_signed))
        for flag in ("foreach", "fused"):
            if defaults.get(flag):
                warnings.warn(
                    f"roundpipe.optim.{name}: {flag}={defaults[flag]!r} is ignored; the "
                    "RoundPipe CPU kernels are always used",
                    UserWarning,
                    stacklevel=3,
                )
                defaults[flag] = None
        self.check_group(defaults)
        self._disk = _DiskRoom()
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

    @property
    def state_dtype(self) -> Any:
        """How per-element state is stored: ``torch.float32``, ``torch.bfloat16`` or
        ``"int8"`` (set at construction)."""
        return self._memory.state_dtype

    @property
    def stochastic_rounding(self) -> bool:
        """Whether bfloat16 parameters are accepted (stored with stochastic rounding)."""
        return self._memory.stochastic_rounding

    @property
    def seed(self) -> int:
        """The seed of the stochastic rounding bits."""
        return self._memory.seed

    def frozen_copy(self) -> "CpuOptimizer":
        """This optimizer with its hyperparameters as they are now (:func:`frozen_copy`): the
        twin shares the parameters, the state and the rounding memory, and ``step`` /
        ``fused_step`` on it update them with the hyperparameters of the moment it was made."""
        twin = frozen_copy(self)
        twin.__dict__.pop("_group_index_cache", None)  # the twin's own groups
        return twin

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The names of this algorithm's per-element state tensors (shaped like their
        parameter; e.g. ``("exp_avg", "exp_avg_sq")`` for Adam), in the kernel's order."""
        return self._state_keys

    @property
    def rounding_calls(self) -> int:
        """This optimizer's count of kernel calls that drew stochastic rounding bits (what an
        algorithm without a step count, SGD, derives its bits from; see :meth:`state_dict`).
        Settable (an int >= 0) to resume a run saved elsewhere, as a checkpoint does."""
        return self._memory.calls

    @rounding_calls.setter
    def rounding_calls(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"roundpipe.optim.{type(self).__name__}: rounding_calls must be "
                             f"an int >= 0, got {n!r}")
        self._memory.calls = n

    def check_group(self, group: dict[str, Any]) -> None:
        """Refuses what a param group may not ask for, before anything is stepped: capturable
        or differentiable (and what a subclass adds); called by ``step``, ``fused_step``,
        ``add_param_group`` and by RoundPipe before a step it runs layer by layer, so that a
        step never fails halfway.

        Raises:
            ValueError: naming the option.
        """
        for flag in ("capturable", "differentiable"):
            if group.get(flag):
                raise ValueError(
                    f"roundpipe.optim.{type(self).__name__} does not support {flag}=True"
                )

    def state_dict(self, *, state_dtype: Any = None) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``: the state as it is kept (references, as in
        torch). Compact state appears as kept: bfloat16 tensors, or for int8 state the uint8
        codes under the state's key (shaped like the parameter) and their float32 block
        maxima under ``<key>_absmax`` (one per 256 elements): all :meth:`load_state_dict`
        needs to restore it exactly. An algorithm without a step count (SGD) whose steps
        drew rounding bits adds ``"rounding_calls"`` (its count of kernel calls, which those
        bits depend on), so a resumed run rounds as the uninterrupted one; torch ignores it.

        Args:
            state_dtype: None (as kept) or ``torch.float32``: every per-element state tensor
                converted to float32 (new tensors, ``_absmax`` entries dropped), the layout
                the ``torch.optim`` class of the same name loads.

        Raises:
            ValueError: another ``state_dtype``.
        """
        sd = super().state_dict()
        store = self._store(p for g in self.param_groups for p in g["params"])
        if store is not None:  # copies of what lives in files (torch gives references)
            store.wait_writes()
            sd["state"] = {pid: {k: v.clone() if store.holds(v) else v for k, v in st.items()}
                           for pid, st in sd["state"].items()}
        if self._memory.calls:
            sd["rounding_calls"] = self._memory.calls
        if state_dtype is None:
            return sd
        if state_dtype is not torch.float32:
            raise ValueError(f"roundpipe.optim.{type(self).__name__}.state_dict: state_dtype "
                             f"must be None or torch.float32, got {state_dtype!r}")
        sd["state"] = {pid: self.state_as_float32(st) for pid, st in sd["state"].items()}
        return sd

    def state_as_float32(self, p_state: dict) -> dict:
        """A copy of one parameter's state (``opt.state[p]``, in any of the forms this
        optimizer keeps) with its per-element state (:attr:`state_keys`) as new float32 tensors
        and no ``<key>_absmax`` entries: torch.optim's layout (:func:`compact.as_float32`; int8
        codes decoded through their block maxima, bfloat16 widened exactly). Nothing changes."""
        return compact.as_float32(p_state, self._state_keys, self._int8_signed)

    def store_state(self, p: torch.Tensor, p_state: dict, values: dict) -> None:
        """Writes each per-element state entry of ``values`` (:attr:`state_keys`, in any form:
        float32 or another float dtype, bfloat16, int8 codes with their ``<key>_absmax``) into
        ``p_state`` (the state dict of parameter ``p``, e.g. ``opt.state[p]``), converted to
        this optimizer's format for ``p`` (``state_dtype``; :func:`compact.store`). Entries of
        ``values`` that are not per-element state are left to the caller."""
        for key in self._state_keys:
            if key in values:
                compact.store(self._memory, p, p_state, key, values, self._int8_signed)
        store = self._store((p,))
        if store is not None:  # kept in files: what is not there yet moves there
            self._to_disk(store, [(p, p_state)])

    def empty_state(self, requests: Sequence[tuple]) -> list[torch.Tensor]:
        """For each ``(p, shape, dtype)`` of ``requests``, an uninitialised tensor to load a
        state tensor of parameter ``p`` into (e.g. from a checkpoint), then handed to
        :meth:`store_state`: in host memory, or, when ``p``'s state is kept in files
        (``RoundPipe(..., optimizer_dir=...)``) and the tensor has dimensions, in a file
        allocated for all of them at once (the values arrive through its mapping)."""
        out: list = [None] * len(requests)
        by_store: dict = {}
        for k, (p, shape, dtype) in enumerate(requests):
            store = self._store((p,)) if len(shape) else None
            if store is None:
                out[k] = torch.empty(shape, dtype=dtype)
            else:
                by_store.setdefault(store, []).append(k)
        for store, ks in by_store.items():
            extent = store.reserve([(requests[k][1], requests[k][2]) for k in ks],
                                   f"the loaded state of roundpipe.optim.{type(self).__name__}")
            for k in ks:
                p, shape, dtype = requests[k]
                out[k] = store.empty(shape, dtype, f"{store.name(p)}: loaded state", extent)
            store.done_carving(extent)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; 0-dim state saved in another dtype (an
        int64 or float64 ``step``, which torch keeps as it is) is converted to the float32 the
        kernels keep, so the next steps compute what torch computes from it. Per-element state
        in any form (float32 or another float dtype, bfloat16, int8 codes with their
        ``_absmax``) is converted to this optimizer's ``state_dtype``, one tensor at a time.
        A saved ``"rounding_calls"`` (see :meth:`state_dict`) is restored.

        Raises:
            ValueError: (before anything changes) a per-element state tensor's shape differs from
                its parameter's (the kernels compare only element and dimension counts), int8
                codes come without their ``_absmax`` of the right length, or
                ``"rounding_calls"`` is not an int >= 0.
        """
        calls = compact.check_calls(f"roundpipe.optim.{type(self).__name__}.load_state_dict",
                                    state_dict.get("rounding_calls", self._memory.calls))
        store = self._store(p for g in self.param_groups for p in g["params"])
        if store is not None:
            store.settle()  # no write in flight to the state being replaced
            room = self._disk
            if room.store is store:
                store.done_carving(room.extent)
            room.store, room.extent = store, store.reserve(  # what store_state moves there
                [s for g in self.param_groups for p in g["params"] if store_of(p) is store
                 for s in self._state_layout(g, p)],
                f"the loaded state of roundpipe.optim.{type(self).__name__}")
        saved_groups = state_dict.get("param_groups", [])
        by_id: dict = {}
        if len(saved_groups) == len(self.param_groups):
            by_id = {saved: p for sg, g in zip(saved_groups, self.param_groups)
                     for saved, p in zip(sg["params"], g["params"])}
            for saved, p_state in state_dict.get("state", {}).items():
                p = by_id.get(saved)
                for key in self._state_keys:
                    v = p_state.get(key) if p is not None else None
                    if torch.is_tensor(v) and v.shape != self._state_shape(p, key):
                        raise ValueError(
                            f"roundpipe.optim.{type(self).__name__}.load_state_dict: state "
                            f"{key!r} of parameter {saved} has shape {tuple(v.shape)}, "
                            f"expected {tuple(self._state_shape(p, key))} (the parameter's "
                            f"{tuple(p.shape)})")
                    if torch.is_tensor(v) and v.dtype == torch.uint8:
                        compact.check_absmax(f"roundpipe.optim.{type(self).__name__}."
                                             "load_state_dict", saved, key, p_state, v)
        # State that torch's loading would cast to the parameter's dtype (int8 codes, state of
        # a bfloat16 parameter, state to be kept compactly) is held back and converted here.
        held: dict = {}
        light = dict(state_dict)
        light["state"] = {}
        for saved, p_state in state_dict.get("state", {}).items():
            p = by_id.get(saved)
            keep = {}
            for key, v in p_state.items():
                if p is not None and compact.held_back(self._memory, p, key, v, self._state_keys,
                                                       self._int8_signed):
                    held.setdefault(saved, {})[key] = v
                else:
                    keep[key] = v
            light["state"][saved] = keep
        super().load_state_dict(light)  # ends with __setstate__, which converts 0-dim state
        for saved, values in held.items():
            p = by_id[saved]
            self.store_state(p, self.state[p], values)
        for p, st in self.state.items():  # state kept as loaded, in this optimizer's format
            if torch.is_tensor(p):
                self.store_state(p, st, st)
        self._memory.calls = calls
        if store is not None:  # all of it is in the files now (store_state): nothing to carve
            store.done_carving(self._disk.extent)
            self._disk.extent = None

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

    def _required_keys(self, active: tuple[str, ...]) -> tuple[str, ...]:
        """The state keys whose absence from a parameter's (non-empty) state is torch's
        KeyError, in torch's lookup order: the active per-element keys, then the 0-dim ones."""
        return active + self._scalar_keys

    @staticmethod
    def _state_shape(p: torch.Tensor, key: str) -> torch.Size:
        """The shape of ``p``'s per-element state ``key``: the parameter's (Adafactor's factors
        differ)."""
        return p.shape

    @staticmethod
    def _state_value(st: dict, key: str) -> Any:
        """A parameter's state ``key`` for the kernel (KeyError if absent: the state is then
        created, or torch's KeyError raised)."""
        return st[key]

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, state: dict) -> None:
        """Fills the empty ``state`` of ``p`` as torch initialises most algorithms' state: each
        0-dim value (``_scalar_keys``) a float32 zero, each per-element tensor the group uses
        (``_active_state_keys``) zeros shaped like ``p``, in this optimizer's state format
        (:meth:`_new_state`). Algorithms that start elsewhere override it."""
        for key in self._scalar_keys:
            state[key] = torch.zeros((), dtype=torch.float32)
        for key in self._active_state_keys(group):
            self._new_state(p, state, key)

    def _new_state(self, p: torch.Tensor, state: dict, key: str, fill: float = 0.0) -> None:
        """``state[key]`` (and, int8, ``state[key + "_absmax"]``) for a new per-element state
        tensor of ``p`` holding ``fill`` everywhere, in this optimizer's format for it (large
        ones in their own memory mapping, see :mod:`roundpipe.host_buffers`; float32 ones
        spread over the page offsets, :func:`compact.staggered_zeros`)."""
        keys = self._state_keys
        compact.new_state(self._memory, p, state, key, fill, self._int8_signed,
                          keys.index(key) if key in keys else 0, max(1, len(keys)))

    def _rounding_index(self, p: torch.Tensor) -> int:
        """The position of ``p`` among all parameters, group by group (its rounding stream)."""
        index = getattr(self, "_rounding_index_cache", None)
        if index is None or id(p) not in index:
            index = {id(q): i for i, q in enumerate(q for g in self.param_groups for q in g["params"])}
            self._rounding_index_cache = index
        return index.get(id(p), 0)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As torch's ``__setstate__``: param groups from old checkpoints get the options they
        lack (``_group_defaults``, the keys the torch class fills in); 0-dim state becomes
        float32 tensors (``_scalar_state_to_tensors``)."""
        super().__setstate__(state)
        self.__dict__.setdefault("_disk", _DiskRoom())
        if "_memory" not in self.__dict__:  # pickled before compact storage existed
            self._memory = compact.Memory(torch.float32, False, 0)
        for group in self.param_groups:
            for key, value in self._group_defaults.items():
                group.setdefault(key, value)
        self._scalar_state_to_tensors()

    def _options(self, group: dict[str, Any]) -> Any:
        """The ``roundpipe._C.<Name>Options`` of a param group: every C++ field from the group
        key of its name (or its ``_option_keys`` entry), floats through :func:`scalar` (so a
        tensor ``lr`` or beta is read at every step)."""
        options = self._options_type()
        for field, key, index, is_float in self._option_fields:
            value = group[key] if index is None else group[key][index]
            if is_float and type(value) is not float:  # a float as is: the common case, fast
                value = scalar(value)
            setattr(options, field, value)
        return options

    def _step_group(self, group: dict[str, Any]) -> None:
        """One kernel call over the group with the parameters' own ``.grad``: through the
        group's step plan (its tensors checked once, re-checked only where they can change:
        bindings/step_plan.hpp) when it can take the step, else through the lists
        (:meth:`_step_tensors`, which creates missing state and raises what is wrong)."""
        if not self._step_planned(group):
            self._step_tensors(group, group["params"], [p.grad for p in group["params"]])

    def _plan_scalars(self, group: dict[str, Any]) -> tuple:
        """Per 0-dim kernel slot, the state key that holds it (or a tensor shared by every
        parameter)."""
        return self._scalar_keys

    def _step_planned(self, group: dict[str, Any]) -> bool:
        """The step of ``group`` through its cached :class:`roundpipe._C.StepPlan`; False
        (nothing modified) when the list-based step must run instead."""
        params = group["params"]
        if not isinstance(params, list):
            return False
        plans = self.__dict__.setdefault("_plans", {})
        scalars = self._plan_scalars(group)
        cached = plans.get(id(params))
        if cached is None or cached[0] is not params or cached[1] != scalars:
            plan = _C.StepPlan(list(self._state_keys), tuple(scalars))
            cached = plans[id(params)] = (params, scalars, plan)
        active = self._active_state_keys(group)
        mask = sum(1 << k for k, key in enumerate(self._state_keys) if key in active)
        memory = self._memory
        counts_steps = bool(self._scalar_keys) and self._scalar_keys[0] == "step"
        seed_mix = memory.calls + 1 if memory.rounds and not counts_steps else 0
        first = self._rounding_index(params[0]) if params and memory.rounds else 0
        done = self._plan_kernel(self._options(group), cached[2], params, self.state, mask,
                                 self.num_threads or 0, memory.stochastic_rounding,
                                 memory.rounds, memory.seed, first, seed_mix)
        if done and seed_mix:
            memory.calls = seed_mix
        return done

    @property
    def _plan_kernel(self) -> Callable[..., bool]:
        return getattr(_C, type(self)._kernel.__name__ + "_plan")

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
        if any(g is not None and not state_of.get(p) for p, g in zip(params, grads)):
            self._check_options(group)  # state to create: not for a step that is refused
        pstates = [None if g is None else state_of[p] for p, g in zip(params, grads)]

        value = self._state_value

        def gather():  # per slot, the state of every parameter (None where skipped)
            states = [[None if st is None else value(st, k) for st in pstates] if k in active
                      else [] for k in self._state_keys]
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
                missing = [k for k in self._required_keys(active) if st and k not in st]
                if missing:
                    raise KeyError(missing[0]) from None
            for p, st in zip(params, pstates):
                if st is not None and not st:
                    self._init_state(group, p, st)
            states, scalars = gather()
        kparams = [None if st is None else p for p, st in zip(params, pstates)]
        self._call_kernel(group, kparams, grads, states, scalars, pstates, model_copies, io)
        mark_updated(kparams, model_copies)

    def _check_options(self, group: dict[str, Any]) -> None:
        """The kernel's checks of the group's options (ValueError naming the option), through
        a call with no tensors: nothing is stepped or created."""
        type(self)._kernel(self._options(group), [], [], [[] for _ in self._state_keys],
                           [[] for _ in self._scalar_keys], None, None, 0, None, None, False)

    def _call_kernel(self, group, kparams, grads, states, scalars, pstates, model_copies,
                     io) -> None:
        """The C++ step over the gathered lists, with what compact storage adds: the int8
        block maxima (``<key>_absmax``), the rounding seeds and, with ``stochastic_rounding``,
        bfloat16 parameters allowed."""
        memory = self._memory
        absmax = None
        if memory.state_dtype == "int8":
            absmax = [[None if st is None else st.get(k + "_absmax") for st in pstates]
                      if states[j] else [] for j, k in enumerate(self._state_keys)]
        seeds = None
        counts_steps = bool(self._scalar_keys) and self._scalar_keys[0] == "step"
        if memory.rounds:
            seeds = memory.seeds(kparams, self._rounding_index, counts_steps=counts_steps)
        type(self)._kernel(self._options(group), kparams, grads, states, scalars, model_copies, io,
                           self.num_threads or 0, absmax, seeds, memory.stochastic_rounding)
        if seeds is not None and not counts_steps:
            memory.calls += 1  # only once the call succeeded

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
        state["_memory"] = self._memory
        return state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; ``capturable``/``differentiable``
        True is a ``ValueError`` here too, before the group is added."""
        self.check_group(param_group)
        super().add_param_group(param_group)

    # --- state on a disk (roundpipe.disk; RoundPipe(..., optimizer_dir=...)) ------------------

    @staticmethod
    def _store(tensors) -> Optional[StateStore]:
        """The store keeping the state of any of ``tensors`` (parameters), or None."""
        if not any_open():
            return None
        for p in tensors:
            s = store_of(p) if torch.is_tensor(p) else None
            if s is not None:
                return s
        return None

    def _state_layout(self, group: dict[str, Any], p: torch.Tensor) -> list[tuple]:
        """``(shape, dtype)`` of each per-element state tensor a step creates for ``p`` (int8
        state: the codes and the block maxima)."""
        out = []
        for key in self._active_state_keys(group):
            shape = tuple(self._state_shape(p, key))
            fmt = self._memory.format_of(p, key, self._int8_signed)
            if fmt == "int8":
                out += [(shape, torch.uint8),
                        ((math.ceil(math.prod(shape) / compact.QUANT_BLOCK),), torch.float32)]
            else:
                out.append((shape, fmt))
        return out

    def _disk_prepare(self, store: StateStore, work: list[tuple[dict, list]]) -> list:
        """For a step of the parameters of each ``(group, params)`` of ``work`` whose state is
        kept by ``store``: at this optimizer's first such step, room for all of its state there
        is reserved (a full disk is an error now, before anything is stepped); state is created
        where missing, as the step would create it (torch's KeyError for damaged state, the
        kernel's checks of the options, first), and moved to the store. Returns the tensors the
        step reads and writes (parameters and per-element state) for :meth:`StateStore.acquire`.
        """
        room = self._disk
        if room.store is not store:
            shapes = [s for g in self.param_groups for p in g["params"]
                      if store_of(p) is store and not self.state.get(p)
                      for s in self._state_layout(g, p)]
            room.extent = store.reserve(shapes, f"the optimizer state of roundpipe.optim."
                                                f"{type(self).__name__}")
            room.store = store
        tensors: list = []
        new: list = []  # (param, its state) whose state the store keeps
        for group, params in work:
            active = self._active_state_keys(group)
            pstates = [self.state[p] for p in params]
            if any(not st for st in pstates):
                for st in pstates:
                    missing = [k for k in self._required_keys(active) if st and k not in st]
                    if missing:
                        raise KeyError(missing[0])
                self._check_options(group)
                for p, st in zip(params, pstates):
                    if not st:
                        self._init_state(group, p, st)
            for p, st in zip(params, pstates):
                tensors.append(p)
                tensors += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
                if store_of(p) is store:
                    new.append((p, st))
        self._to_disk(store, new)
        return tensors

    def _to_disk(self, store: StateStore, states: list[tuple]) -> None:
        """Every per-element state tensor of each ``(p, p_state)`` of ``states`` that ``store``
        does not hold yet moves into its files (carved from this optimizer's reserved file
        while it has room)."""
        new = [(v, f"{store.name(p)}: {k}") for p, st in states for k, v in st.items()
               if torch.is_tensor(v) and v.dim() > 0 and not store.holds(v)]
        if new:
            room = self._disk
            store.adopt([t for t, _ in new], [n for _, n in new],
                        room.extent if room.store is store else None)

    @torch.no_grad()
    @_gated
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
            params: parameters of this optimizer (float32, CPU, contiguous; bfloat16 with
                ``stochastic_rounding``, then no model copy is needed: the parameter is it),
                each at most once.
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
            self.check_group(self.param_groups[gi])
        param_dtypes = (torch.float32, torch.bfloat16) if self.stochastic_rounding else (torch.float32,)
        for i, (p, g) in enumerate(zip(params, grads)):
            if p.dtype not in param_dtypes or p.device.type != "cpu" or not p.is_contiguous():
                raise TypeError(f"{name}: params[{i}] must be a contiguous float32 CPU tensor "
                                f"(bfloat16 with stochastic_rounding=True), got {p.dtype} on "
                                f"{p.device}")
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
        mark_stepped(self)  # an optimizer step for torch's LR schedulers (no warning)
        found_inf, norm_sq = False, 0.0
        store = self._store(params)
        held: Any = contextlib.nullcontext()
        if store is not None:  # the tensors of this call into the window, from the disk
            held = store.acquire(self._disk_prepare(store, [
                (self.param_groups[gi], [params[i] for i in positions])
                for gi, positions in sorted(by_group.items())]))
        with held:
            for gi, positions in sorted(by_group.items()):
                group = self.param_groups[gi]
                self.check_group(group)
                try:
                    self._step_tensors(group, [params[i] for i in positions],
                                       [grads[i] for i in positions],
                                       [copies[i] for i in positions] if copies is not None
                                       else None, io)
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
            self.check_group(group)
            try:
                store = self._store(group["params"])
                if store is None:
                    self._step_group(group)
                else:  # through the window (roundpipe.disk)
                    params = list(group["params"])
                    grads = [p.grad for p in params]
                    stepped = [p for p, g in zip(params, grads) if g is not None]
                    with store.acquire(self._disk_prepare(store, [(group, stepped)])):
                        self._step_tensors(group, params, grads)
            except (TypeError, ValueError) as e:
                raise type(e)(f"roundpipe.optim.{type(self).__name__}: param group {index}: {e}") from None
        return loss
