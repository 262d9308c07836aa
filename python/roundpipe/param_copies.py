"""The host copies of a model's parameters, and the maps between parameters, layers and stages.

Every parameter that requires grad when the model is wrapped has two host copies: the
*model copy* (the module's own parameter, in the model's dtype: what the devices compute
with) and the *optimizer copy* (a separate ``nn.Parameter`` in ``optim_dtype``: what optimizers
step) — or one, when ``optim_dtype`` is given and is the parameter's own dtype (e.g. bfloat16
master weights): the optimizer then steps the model copy itself (:attr:`ParamCopies.shared`),
and writing back is nothing to do. :class:`ParamCopies` owns the optimizer copies, the
gradients accumulated for them between steps, and keeping the two copies consistent
(write-back after a step, picking up a model copy changed behind the wrapper's back, the set
of model copies an asynchronous step left behind). Sharded over ranks (:mod:`roundpipe.distributed`), an optimizer copy holds only
this rank's rows of its parameter (:attr:`ParamCopies.rows`); the model copy stays whole.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Optional

import torch
from torch import nn

from .host_buffers import HostBuffers, host_empty
from .plan import Stage
from .transfer import TensorRef


class ParamCopies:
    """Args:
        module: the module whose names the wrapper presents.
        layers: the pipeline's layers (their parameters and buffers belong to ``module``).
        stages: the stages over ``layers``.
        optim_dtype: dtype of the optimizer copies (None: a separate copy in each parameter's
            own dtype; a parameter already of ``optim_dtype`` has one copy).
        comm: the process group side (:class:`roundpipe.distributed.Comm`), or None.

    Raises:
        ValueError: a trainable parameter is not floating point.
    """

    def __init__(self, module: nn.Module, layers: list[nn.Module], stages: list[Stage],
                 optim_dtype: Optional[torch.dtype], comm: Any = None) -> None:
        self.module, self.layers, self.stages, self.comm = module, layers, stages, comm
        self.names: list[str] = []
        self.model: list[nn.Parameter] = []
        self.optim: list[nn.Parameter] = []
        self.rows: list[Optional[tuple[int, int]]] = []  # this rank's rows (None: whole)
        self.shared: list[bool] = []  # the optimizer copy is (this rank's rows of) the model copy
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if not p.dtype.is_floating_point:
                raise ValueError(f"RoundPipe: trainable parameter {name!r} has dtype {p.dtype}")
            self.names.append(name)
            self.model.append(p)
            rows = comm.rows(p.shape) if comm is not None and comm.sharded(p.shape) else None
            self.rows.append(rows)
            src = p.detach() if rows is None else p.detach()[rows[0]:rows[1]]
            shared = p.dtype == optim_dtype
            self.shared.append(shared)
            if shared:
                self.optim.append(p if rows is None else nn.Parameter(src))
            else:
                copy = host_empty(src.shape, optim_dtype or p.dtype).copy_(src)
                self.optim.append(nn.Parameter(copy))
        self.lock = threading.Lock()
        self.pool = HostBuffers()
        self.stale: set[int] = set()  # model copies behind their optimizer copies (async step)
        self.rebuild()

    def rebuild(self) -> None:
        """(Re)builds every map from the parameter objects (after unpickling too)."""
        self.index = {id(p): i for i, p in enumerate(self.model)}
        self.known = {id(p) for p in self.module.parameters()} | set(self.index)
        self.grads: list[Optional[torch.Tensor]] = [None] * len(self.model)
        self.norms_sq: list[Optional[float]] = [None] * len(self.model)
        self.synced = [self.version(p) for p in self.model]
        self.optim_dtypes = frozenset(p.dtype for p in self.optim)
        self.layer_params: list[list[int]] = []
        for layer in self.layers:
            ids: list[int] = []
            for p in layer.parameters():
                i = self.index.get(id(p))
                if i is not None and i not in ids:
                    ids.append(i)
            self.layer_params.append(ids)
        self.param_layers: list[list[int]] = [[] for _ in self.model]
        for li, ids in enumerate(self.layer_params):
            for i in ids:
                self.param_layers[i].append(li)
        self.own_params = [[i for i in ids if self.param_layers[i][0] == li]  # first layer
                           for li, ids in enumerate(self.layer_params)]
        stages_of: dict[int, set[int]] = {}
        for st in self.stages:
            for li in st.layers:
                for i in self.layer_params[li]:
                    stages_of.setdefault(i, set()).add(st.index)
        self.final_params: list[list[int]] = [[] for _ in self.stages]
        for i in range(len(self.model)):
            if i in stages_of:
                self.final_params[min(stages_of[i])].append(i)
        self.stage_params: list[list[int]] = [  # each once, in layer order
            list(dict.fromkeys(i for li in st.layers for i in self.layer_params[li]))
            for st in self.stages]

    _DERIVED = ("lock", "pool", "comm", "index", "known", "grads", "norms_sq", "synced",
                "optim_dtypes", "layer_params", "param_layers", "own_params", "final_params",
                "stage_params")

    def __getstate__(self) -> dict:
        """Pickling keeps the copies and the set of stale model copies; the maps (over object
        identities), the lock and the gradients are rebuilt or dropped."""
        return {k: v for k, v in self.__dict__.items() if k not in self._DERIVED}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()
        self.pool = HostBuffers()
        self.comm = None
        self.rebuild()

    @staticmethod
    def version(p: torch.Tensor) -> tuple[int, int]:
        return (p.data_ptr(), p._version)

    def __len__(self) -> int:
        return len(self.model)

    def first_trainable_stage(self) -> int:
        """The lowest stage holding a trainable parameter (its backward visit comes last)."""
        return next((s for s, f in enumerate(self.final_params) if f), len(self.stages) - 1)

    def layers_of(self, indices: Iterable[int]) -> list[int]:
        """The layers holding any of the parameters ``indices``, in order."""
        return sorted({li for i in indices for li in self.param_layers[i]})

    # --- what the layers compute with ------------------------------------------------------------

    def refs(self) -> list[list[TensorRef]]:
        """Per layer, the tensors it computes with now (its parameters, then its buffers,
        each once, under the layer's own name, as ``named_parameters`` / ``named_buffers``
        give them), taken on the calling thread at the start of a call
        so that workers never read module attributes (which ``functional_call`` swaps while
        a layer runs).

        Raises:
            RuntimeError: a parameter that requires grad has no optimizer copy: it was frozen
                when the model was wrapped, or it replaced a wrapped parameter.
        """
        out = []
        for li, layer in enumerate(self.layers):
            refs = []
            for name, p in layer.named_parameters():
                i = self.index.get(id(p))
                if i is None and p.requires_grad:
                    if id(p) in self.known:
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
                refs.append(TensorRef(name, p, i, False))
            seen: set[int] = set()
            for prefix, module in layer.named_modules():
                for bname, b in module._buffers.items():
                    if b is not None and id(b) not in seen:
                        seen.add(id(b))
                        refs.append(TensorRef(f"{prefix}.{bname}" if prefix else bname, b, None,
                                              True, id(module)))
            out.append(refs)
        return out

    # --- keeping the copies consistent ---------------------------------------------------------------

    def model_rows(self, i: int) -> torch.Tensor:
        """The part of model copy ``i`` that optimizer copy ``i`` holds (all of it unless
        sharded)."""
        rows = self.rows[i]
        return self.model[i] if rows is None else self.model[i].data[rows[0]:rows[1]]

    def sharded(self, indices: Iterable[int]) -> list[int]:
        """Those of ``indices`` whose optimizer copy holds only some rows."""
        return [i for i in indices if self.rows[i] is not None]

    def refresh_from_model(self) -> None:
        """A model copy changed behind the wrapper's back (e.g. ``load_state_dict`` on the
        wrapped model after wrapping): its optimizer copy takes its value, so the next step
        trains what was loaded. Only called while no optimizer work is pending."""
        with torch.no_grad():
            for i, p in enumerate(self.model):
                if self.version(p) != self.synced[i]:
                    if not self.shared[i]:
                        self.optim[i].copy_(self.model_rows(i))
                    elif self.rows[i] is not None and self.optim[i].data_ptr() != \
                            self.model_rows(i).data_ptr():  # .data replaced: view the new rows
                        self.optim[i].data = self.model_rows(i)
                    self.synced[i] = self.version(p)

    def write_back(self, i: int) -> None:
        """Model copy ``i`` takes its optimizer copy's value, rounded to the model dtype (its
        rows of it when sharded: the caller all-gathers the rest); nothing to copy when they
        are one."""
        if not self.shared[i]:
            with torch.no_grad():
                self.model_rows(i).copy_(self.optim[i])
        self.synced[i] = self.version(self.model[i])

    def mark_synced(self, i: int) -> None:
        """Model copy ``i`` was just written from its optimizer copy (by a fused step)."""
        self.synced[i] = self.version(self.model[i])

    def write_back_stale(self) -> None:
        """Every model copy an asynchronous step left behind takes its optimizer copy's value
        (sharded: this rank's rows, then every rank's rows all-gathered)."""
        with self.lock:
            todo, self.stale = sorted(self.stale), set()
        for i in todo:
            self.write_back(i)
        if self.comm is not None:
            self.comm.all_gather_rows([self.model[i] for i in self.sharded(todo)])

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
        if self.grads[i] is None:
            if owned and g.dtype == dtype:
                self.grads[i] = g
            else:
                self.grads[i] = self.pool.take(g.shape, dtype).copy_(g)
            self.norms_sq[i] = norm_sq
        else:
            self.grads[i].add_(g)
            self.norms_sq[i] = None
            if owned:
                self.pool.give(g)

    def take_grads(self) -> tuple[list[Optional[torch.Tensor]], list[Optional[float]]]:
        """The accumulated gradients and their known squared norms (the copies start over
        without any)."""
        grads, self.grads = self.grads, [None] * len(self.model)
        norms, self.norms_sq = self.norms_sq, [None] * len(self.model)
        return grads, norms

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
        full = {}
        for i in self.sharded(range(len(self.model))):  # collective: every rank calls it
            full[i] = self.comm.gather_rows(self.optim[i].detach(), self.model[i].shape)
        for name, p in self.module.named_parameters(remove_duplicate=False):
            i = self.index.get(id(p))
            if i is not None:
                o = full.get(i, self.optim[i])
                sd[prefix + name] = o if keep_vars else o.detach()
        return sd

    def load(self, state_dict: dict) -> None:
        """After the module loaded ``state_dict``: each optimizer copy takes its value at full
        precision. A parameter loaded under several names (tied weights) takes the value of
        the name the module loaded last, as the model copy did."""
        last: dict[int, str] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            i = self.index.get(id(p))
            if i is not None and name in state_dict:
                last[i] = name
        with torch.no_grad():
            for i, name in last.items():
                if self.shared[i]:
                    continue  # the module loaded it
                value, rows = state_dict[name], self.rows[i]
                self.optim[i].copy_(value if rows is None else value[rows[0]:rows[1]])
        for i, p in enumerate(self.model):
            self.synced[i] = self.version(p)
