"""The host copies of a model's parameters, and the maps between parameters, layers and stages.

Every parameter that requires grad when the model is wrapped has two host copies: the
*model copy* (the module's own parameter, in the model's dtype: what the devices compute
with) and the *optimizer copy* (a separate ``nn.Parameter`` in ``optim_dtype``: what optimizers
step) — or one, when ``optim_dtype`` is given and is the parameter's own dtype (e.g. bfloat16
master weights): the optimizer then steps the model copy itself (:attr:`ParamIndex.shared`),
and writing back is nothing to do. :class:`ParamCopies` owns the optimizer copies, the
gradients accumulated for them between steps, and keeping the two copies consistent
(write-back after a step, picking up a model copy changed behind the wrapper's back, the set
of model copies an asynchronous step left behind), each change one of its methods, as each
``FSDPParam`` of FSDP2 owns one parameter's state. The maps between parameters, layers and
stages change only with the stage plan: :class:`ParamIndex`. Sharded over ranks (:mod:`roundpipe.distributed`),
an optimizer copy holds only this rank's rows of its parameter (:attr:`ParamIndex.rows`); the
model copy stays whole.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from .host_buffers import HostBuffers, host_empty
from .plan import Stage
from .torch_private import module_buffers, module_parameters, tensor_version
from .transfer import TensorRef


@dataclass(frozen=True)
class ParamIndex:
    """The maps between a wrapped model's trainable parameters (numbered ``0..n-1`` in
    ``module.named_parameters()`` order, a tied parameter once), its layers and its stages,
    built once per wrapper and stage plan (again after unpickling: they are keyed by object
    identity).

    Attributes:
        names: each parameter's (first) name in the module.
        position: ``id(model copy)`` -> its number.
        known: ids of every parameter of the module (trainable when wrapped or not).
        rows: per parameter, the ``(start, stop)`` rows of dim 0 this rank's optimizer copy
            holds when sharded over ranks, else None (the whole parameter).
        shared: per parameter, whether the optimizer copy is (this rank's rows of) the model
            copy itself (``optim_dtype`` equal to its dtype): nothing to write back.
        optim_dtypes: the dtypes of the optimizer copies.
        layer_params: per layer, the parameters it uses, each once, in its order.
        param_layers: per parameter, the layers using it, in order.
        own_params: per layer, the parameters whose first layer it is (each parameter in
            exactly one layer: where a step writes it).
        final_params: per stage, the parameters whose gradient is final after that stage's
            backward visit (their lowest stage: the backward runs stages in descending order).
        stage_params: per stage, the parameters its layers use, each once, in layer order.
    """

    names: tuple[str, ...]
    position: Mapping[int, int]
    known: frozenset[int]
    rows: tuple[Optional[tuple[int, int]], ...]
    shared: tuple[bool, ...]
    optim_dtypes: frozenset[torch.dtype]
    layer_params: tuple[tuple[int, ...], ...]
    param_layers: tuple[tuple[int, ...], ...]
    own_params: tuple[tuple[int, ...], ...]
    final_params: tuple[tuple[int, ...], ...]
    stage_params: tuple[tuple[int, ...], ...]

    @classmethod
    def build(cls, module: nn.Module, layers: list[nn.Module], stages: list[Stage],
              model: Sequence[torch.Tensor], optim: Sequence[torch.Tensor], names: Sequence[str],
              rows: Sequence[Optional[tuple[int, int]]], shared: Sequence[bool]) -> "ParamIndex":
        """The maps for the model copies ``model`` (with their optimizer copies ``optim``,
        ``names``, ``rows`` and ``shared`` flags, one each) over ``layers`` and ``stages``."""
        position = {id(p): i for i, p in enumerate(model)}
        layer_params: list[tuple[int, ...]] = []
        for layer in layers:
            ids = dict.fromkeys(position[id(p)] for p in layer.parameters() if id(p) in position)
            layer_params.append(tuple(ids))
        param_layers: list[list[int]] = [[] for _ in model]
        for li, ids in enumerate(layer_params):
            for i in ids:
                param_layers[i].append(li)
        own_params = tuple(tuple(i for i in ids if param_layers[i][0] == li)  # first layer
                           for li, ids in enumerate(layer_params))
        first_stage: dict[int, int] = {}
        for st in stages:
            for li in st.layers:
                for i in layer_params[li]:
                    first_stage[i] = min(first_stage.get(i, st.index), st.index)
        final_params: list[list[int]] = [[] for _ in stages]
        for i in range(len(model)):
            if i in first_stage:
                final_params[first_stage[i]].append(i)
        stage_params = tuple(  # each once, in layer order
            tuple(dict.fromkeys(i for li in st.layers for i in layer_params[li])) for st in stages)
        return cls(tuple(names), MappingProxyType(position),
                   frozenset({id(p) for p in module.parameters()} | set(position)),
                   tuple(rows), tuple(shared), frozenset(p.dtype for p in optim),
                   tuple(layer_params), tuple(tuple(ls) for ls in param_layers), own_params,
                   tuple(tuple(f) for f in final_params), stage_params)

    def __len__(self) -> int:
        return len(self.names)

    def first_trainable_stage(self) -> int:
        """The lowest stage holding a trainable parameter (its backward visit comes last)."""
        return next((s for s, f in enumerate(self.final_params) if f),
                    len(self.final_params) - 1)

    def layers_of(self, indices: Iterable[int]) -> list[int]:
        """The layers holding any of the parameters ``indices``, in order."""
        return sorted({li for i in indices for li in self.param_layers[i]})

    def sharded(self, indices: Iterable[int]) -> list[int]:
        """Those of ``indices`` whose optimizer copy holds only some rows."""
        return [i for i in indices if self.rows[i] is not None]


def _rows_shape(p: torch.Tensor, part: Optional[tuple[int, int]]) -> tuple:
    """The shape of the optimizer copy of ``p`` holding rows ``part`` (all: None)."""
    return tuple(p.shape) if part is None else (part[1] - part[0], *p.shape[1:])


class ParamCopies:
    """The copies of one wrapper's trainable parameters (see the module docstring), and the
    state that changes between steps — the accumulated gradients with their known squared
    norms, which model copies an asynchronous step left behind (*stale*), the version of each
    model copy last written from its optimizer copy — changed only through its methods
    (called on the caller's thread or the optimizer thread, never both at once except for
    the stale set, which :attr:`lock` guards).

    Args:
        module: the module whose names the wrapper presents.
        layers: the pipeline's layers (their parameters and buffers belong to ``module``).
        stages: the stages over ``layers``.
        optim_dtype: dtype of the optimizer copies (None: a separate copy in each parameter's
            own dtype; a parameter already of ``optim_dtype`` has one copy).
        comm: the process group side (:class:`roundpipe.distributed.Comm`), or None.
        store: where the optimizer copies and the optimizer state live
            (:class:`roundpipe.disk.StateStore`, ``optimizer_dir``), or None: host memory.

    Attributes:
        model: the model copies (the module's parameters), in :class:`ParamIndex` order.
        optim: their optimizer copies (``nn.Parameter``; the model copy itself where shared;
            with a ``store``, the separate ones view their file between steps).
        store: the :class:`roundpipe.disk.StateStore`, or None.
        index: the fixed maps (:class:`ParamIndex`).
        pool: recycled host buffers for gradients.

    Raises:
        ValueError: a trainable parameter is not floating point.
        StateDiskError: (with a ``store``) the disk cannot hold the optimizer copies.
    """

    def __init__(self, module: nn.Module, layers: list[nn.Module], stages: list[Stage],
                 optim_dtype: Optional[torch.dtype], comm: Any = None, store: Any = None) -> None:
        self.module, self.layers, self.stages, self.comm = module, layers, stages, comm
        self.store = store
        names: list[str] = []
        model: list[nn.Parameter] = []
        rows: list[Optional[tuple[int, int]]] = []  # this rank's rows (None: whole)
        shared: list[bool] = []  # the optimizer copy is (this rank's rows of) the model copy
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if not p.dtype.is_floating_point:
                raise ValueError(f"RoundPipe: trainable parameter {name!r} has dtype {p.dtype}")
            names.append(name)
            model.append(p)
            rows.append(comm.rows(p.shape) if comm is not None and comm.sharded(p.shape) else None)
            shared.append(p.dtype == optim_dtype)
        slots = iter(())
        if store is not None:  # the optimizer copies' files, allocated at once
            shapes = [(_rows_shape(p, part), optim_dtype or p.dtype, name, 0)
                      for name, p, part, one in zip(names, model, rows, shared) if not one]
            if shapes:
                slots = iter(store.slots(shapes, store.reserve(
                    [s[:2] for s in shapes], f"the {len(shapes)} optimizer copies")))
        optim: list[nn.Parameter] = []
        for name, p, part, one in zip(names, model, rows, shared):
            src = p.detach() if part is None else p.detach()[part[0]:part[1]]
            if one:
                optim.append(p if part is None else nn.Parameter(src))
                if store is not None:
                    store.keep_state_of(optim[-1], name)
            else:
                copy = nn.Parameter(host_empty(src.shape, optim_dtype or p.dtype).copy_(src))
                if store is not None:
                    store.bind(copy, next(slots))  # its values into the file, viewed there
                optim.append(copy)
        if store is not None:
            store.sync_files()
        self.model, self.optim = tuple(model), tuple(optim)
        self._stale: set[int] = set()  # model copies behind their optimizer copies (async step)
        self._start(names, rows, shared)

    def _start(self, names, rows, shared) -> None:
        """The maps (from the parameter objects), the lock, the pool and empty gradients."""
        self.index = ParamIndex.build(self.module, self.layers, self.stages, self.model,
                                      self.optim, names, rows, shared)
        self.lock = threading.Lock()
        self.pool = HostBuffers()
        self._grads: list[Optional[torch.Tensor]] = [None] * len(self.model)
        self._norms_sq: list[Optional[float]] = [None] * len(self.model)
        self._synced = [self.version(p) for p in self.model]

    def set_stages(self, stages: list[Stage]) -> None:
        """A new stage plan: the maps over stages are made again (between calls, with no
        optimizer work pending: queued work refers to stage numbers)."""
        self.stages = stages
        index = self.index
        self.index = ParamIndex.build(self.module, self.layers, stages, self.model, self.optim,
                                      index.names, index.rows, index.shared)

    def __getstate__(self) -> dict:
        """Pickling keeps the copies and the set of stale model copies; the maps (over object
        identities), the lock and the gradients are rebuilt or dropped.

        Raises:
            TypeError: the optimizer copies live in files (``optimizer_dir``)."""
        if self.store is not None:
            raise TypeError(f"RoundPipe with optimizer_dir={self.store.folder.base!r} cannot be "
                            "pickled or deep-copied: its optimizer copies and state live in "
                            "files there; save a checkpoint (roundpipe.save_checkpoint) instead")
        keep = ("module", "layers", "stages", "model", "optim", "_stale")
        state = {k: self.__dict__[k] for k in keep}
        state.update(names=self.index.names, rows=self.index.rows, shared=self.index.shared)
        return state

    def __setstate__(self, state: dict) -> None:
        names, rows, shared = state.pop("names"), state.pop("rows"), state.pop("shared")
        self.__dict__.update(state)
        self.comm, self.store = None, None
        self._start(names, rows, shared)

    @staticmethod
    def version(p: torch.Tensor) -> tuple[int, int]:
        return (p.data_ptr(), tensor_version(p))

    def __len__(self) -> int:
        return len(self.model)

    # --- what the layers compute with ------------------------------------------------------------

    def refs(self) -> list[list[TensorRef]]:
        """Per layer, the tensors it computes with now (its parameters, then its buffers,
        each once, under the layer's own name, as ``named_parameters`` / ``named_buffers``
        give them, with every place in the layer's modules that holds it), taken on the
        calling thread at the start of a call so that workers never read module attributes
        (which :func:`roundpipe.pipeline.execute.run_layers` swaps while a layer runs).

        Raises:
            RuntimeError: a parameter that requires grad has no optimizer copy: it was frozen
                when the model was wrapped, or it replaced a wrapped parameter.
        """
        position, known = self.index.position, self.index.known
        out = []
        for li, layer in enumerate(self.layers):
            # one walk over the modules, in named_parameters' order: per tensor (first name,
            # tensor, holding module, [(dict, key), ...] of every module holding it)
            params: dict[int, tuple] = {}
            buffers: dict[int, tuple] = {}
            for prefix, module in layer.named_modules():
                for found, held in ((params, module_parameters(module)),
                                    (buffers, module_buffers(module))):
                    for key, t in held.items():
                        if t is None:
                            continue
                        entry = found.get(id(t))
                        if entry is None:
                            entry = found[id(t)] = (f"{prefix}.{key}" if prefix else key, t,
                                                    id(module), [])
                        entry[3].append((held, key))
            refs = []
            for name, p, _, sites in params.values():
                i = position.get(id(p))
                if i is None and p.requires_grad:
                    if id(p) in known:
                        raise RuntimeError(
                            f"RoundPipe: parameter {name!r} of layer {li} requires grad but was "
                            "frozen when the model was wrapped, so it has no optimizer copy; set "
                            "requires_grad before wrapping (parameters frozen after wrapping are "
                            "simply not trained)")
                    raise RuntimeError(
                        f"RoundPipe: parameter {name!r} of layer {li} was replaced after the "
                        "model was wrapped (a new nn.Parameter was assigned), so it has no "
                        "optimizer copy and would not be trained; change weights in place "
                        "(under torch.no_grad()) or with load_state_dict, or wrap the model "
                        "again")
                refs.append(TensorRef(name, p, i, False, sites=tuple(sites)))
            for name, b, owner, sites in buffers.values():
                refs.append(TensorRef(name, b, None, True, owner, tuple(sites)))
            out.append(refs)
        return out

    # --- keeping the copies consistent ---------------------------------------------------------------

    def model_rows(self, i: int) -> torch.Tensor:
        """The part of model copy ``i`` that optimizer copy ``i`` holds (all of it unless
        sharded)."""
        rows = self.index.rows[i]
        return self.model[i] if rows is None else self.model[i].data[rows[0]:rows[1]]

    def reading(self, indices: Iterable[int], write: bool = False):
        """A context in which the optimizer copies ``indices`` hold their values in memory
        (with a ``store``: read into its window, written back on leaving with ``write``;
        otherwise they always do)."""
        if self.store is None:
            return contextlib.nullcontext()
        return self.store.acquire([self.optim[i] for i in indices], write=write)

    def by_layer(self, indices: Iterable[int]) -> list[list[int]]:
        """``indices`` grouped by the layer they belong to (their first), in order: the sets
        read through a store's window together."""
        groups: dict[int, list[int]] = {}
        for i in sorted(indices):
            layers = self.index.param_layers[i]
            groups.setdefault(layers[0] if layers else -1, []).append(i)
        return [groups[k] for k in sorted(groups)]

    def settle(self) -> None:
        """Before the optimizer copies are written outside a step through their files'
        mappings (a checkpoint loaded in place): with a store, its writes have ended and
        nothing read ahead is kept."""
        if self.store is not None:
            self.store.settle()

    def refresh_from_model(self) -> None:
        """A model copy changed behind the wrapper's back (e.g. ``load_state_dict`` on the
        wrapped model after wrapping): its optimizer copy takes its value, so the next step
        trains what was loaded. Only called while no optimizer work is pending."""
        rows, shared = self.index.rows, self.index.shared
        changed = [i for i, p in enumerate(self.model) if self.version(p) != self._synced[i]]
        if not changed:
            return
        with torch.no_grad():
            for i in changed:
                if not shared[i]:
                    with self.reading([i], write=True):
                        self.optim[i].copy_(self.model_rows(i))
                elif rows[i] is not None and self.optim[i].data_ptr() != \
                        self.model_rows(i).data_ptr():  # .data replaced: view the new rows
                    self.optim[i].data = self.model_rows(i)
                self._synced[i] = self.version(self.model[i])

    def write_back(self, i: int) -> None:
        """Model copy ``i`` takes its optimizer copy's value, rounded to the model dtype (its
        rows of it when sharded: the caller all-gathers the rest); nothing to copy when they
        are one."""
        if not self.index.shared[i]:
            with torch.no_grad(), self.reading([i]):
                self.model_rows(i).copy_(self.optim[i])
        self._synced[i] = self.version(self.model[i])

    def write_back_many(self, indices: list[int]) -> None:
        """:meth:`write_back` of each of ``indices``, read together (one set of a store's
        window, layer by layer)."""
        for part in self.by_layer(indices) if self.store is not None else [indices]:
            with self.reading([i for i in part if not self.index.shared[i]]):
                for i in part:
                    self.write_back(i)

    def mark_synced(self, i: int) -> None:
        """Model copy ``i`` was just written from its optimizer copy (by a fused step)."""
        self._synced[i] = self.version(self.model[i])

    def write_back_stale(self) -> None:
        """Every model copy an asynchronous step left behind takes its optimizer copy's value
        (sharded: this rank's rows, then every rank's rows all-gathered)."""
        with self.lock:
            todo, self._stale = sorted(self._stale), set()
        self.write_back_many(todo)
        if self.comm is not None:
            self.comm.all_gather_rows([self.model[i] for i in self.index.sharded(todo)])

    def write_back_all(self) -> None:
        """Every model copy takes its optimizer copy's value (sharded: this rank's rows, then
        every rank's rows all-gathered; a collective), e.g. after the optimizer copies were
        loaded in place from a checkpoint. Only called while no optimizer work is pending."""
        with self.lock:
            self._stale = set()
        self.settle()  # e.g. loaded into the files through their mappings: nothing read before
        self.write_back_many(list(range(len(self.model))))
        if self.store is not None:
            self.store.sync_files()  # what was written through the mappings: on the disk
        if self.comm is not None:
            self.comm.all_gather_rows([self.model[i]
                                       for i in self.index.sharded(range(len(self.model)))])
        for i, p in enumerate(self.model):
            self._synced[i] = self.version(p)

    def begin_async_step(self) -> list[int]:
        """An asynchronous step is queued: returns the model copies the step before left
        behind (sorted; the step writes them back first), and from now on every model copy
        with a separate optimizer copy is behind it until written back."""
        shared = self.index.shared
        with self.lock:
            behind = sorted(self._stale)
            self._stale = {i for i in range(len(self.model)) if not shared[i]}
        return behind

    def will_write(self, indices: Optional[Iterable[int]] = None) -> None:
        """The model copies ``indices`` (default: all) are written by work queued now (exact
        mode's step of a stage, or of everything after the backward): no longer behind."""
        with self.lock:
            if indices is None:
                self._stale.clear()
            else:
                self._stale.difference_update(indices)

    # --- gradients -----------------------------------------------------------------------------------

    def accumulate(self, i: int, g: torch.Tensor, owned: bool,
                   norm_sq: Optional[float] = None) -> None:
        """Adds gradient ``g`` (fp32 or the model dtype, on the host) into parameter ``i``'s
        accumulated gradient (a buffer of :attr:`pool` in float32, or the optimizer dtype
        when wider: a bfloat16 sum would stop growing, and differ from exact mode, which steps
        from the float32 download): the first one since the last step is taken without a copy
        when ``owned`` and already of that dtype, later ones are added in one pass (an owned
        ``g`` then goes back to the pool). ``norm_sq`` (the squared norm of ``g``, measured
        where it was summed) is kept for the first one; a sum's norm is unknown until
        measured."""
        dtype = torch.promote_types(self.optim[i].dtype, torch.float32)
        if self._grads[i] is None:
            if owned and g.dtype == dtype:
                self._grads[i] = g
            else:
                self._grads[i] = self.pool.take(g.shape, dtype).copy_(g)
            self._norms_sq[i] = norm_sq
        else:
            self._grads[i].add_(g)
            self._norms_sq[i] = None
            if owned:
                self.pool.give(g)

    def has_grad(self, i: int) -> bool:
        """Whether parameter ``i`` has an accumulated gradient."""
        return self._grads[i] is not None

    def accumulated(self) -> dict[str, Optional[torch.Tensor]]:
        """A copy of each accumulated gradient (None where there is none) under the
        parameter's (first) name; nothing changes."""
        return {n: None if g is None else g.clone() for n, g in zip(self.index.names, self._grads)}

    def take_grads(self) -> tuple[list[Optional[torch.Tensor]], list[Optional[float]]]:
        """The accumulated gradients and their known squared norms (the copies start over
        without any)."""
        grads, self._grads = self._grads, [None] * len(self.model)
        norms, self._norms_sq = self._norms_sq, [None] * len(self.model)
        return grads, norms

    def take_final(self, indices: Iterable[int],
                   direct: dict[int, torch.Tensor]) -> dict[int, Optional[torch.Tensor]]:
        """The gradients of the parameters ``indices``, final at a stage (exact mode): the
        download in ``direct`` where there is one, else the accumulated one, which the copies
        then no longer hold."""
        out = {}
        for i in indices:
            out[i] = direct[i] if i in direct else self._grads[i]
            self._grads[i] = None
            self._norms_sq[i] = None
        return out

    def clear_grads(self) -> None:
        """Discards the accumulated gradients (their buffers go back to the pool)."""
        grads, _ = self.take_grads()
        for g in grads:
            if g is not None:
                self.pool.give(g)

    # --- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self, sd: dict, prefix: str, keep_vars: bool) -> dict:
        """``sd`` (the module's state dict) with every name of a trainable parameter (tied ones
        included) holding its optimizer copy."""
        if self.store is not None:
            self.store.wait_writes()
        full = {}
        for i in self.index.sharded(range(len(self.model))):  # collective: every rank calls it
            full[i] = self.comm.gather_rows(self.optim[i].detach(), self.model[i].shape)
        position = self.index.position
        for name, p in self.module.named_parameters(remove_duplicate=False):
            i = position.get(id(p))
            if i is not None:
                o = full.get(i, self.optim[i])
                sd[prefix + name] = o if keep_vars else o.detach()
        return sd

    def load(self, state_dict: dict) -> None:
        """After the module loaded ``state_dict``: each optimizer copy takes its value at full
        precision. A parameter loaded under several names (tied weights) takes the value of
        the name the module loaded last, as the model copy did."""
        position = self.index.position
        last: dict[int, str] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            i = position.get(id(p))
            if i is not None and name in state_dict:
                last[i] = name
        with torch.no_grad():
            for part in self.by_layer(last):
                with self.reading([i for i in part if not self.index.shared[i]], write=True):
                    for i in part:
                        if self.index.shared[i]:
                            continue  # the module loaded it
                        value, rows = state_dict[last[i]], self.index.rows[i]
                        self.optim[i].copy_(value if rows is None else value[rows[0]:rows[1]])
        for i, p in enumerate(self.model):
            self._synced[i] = self.version(p)
