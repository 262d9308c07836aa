"""Checkpoints of a RoundPipe and its optimizer with ``torch.distributed.checkpoint`` (DCP):
each rank writes only what it owns (with ``shard_optimizer=True``, its rows of every
optimizer copy and optimizer state tensor, described as ``DTensor`` shards), and a checkpoint
saved at N ranks loads at M ranks, or in one process, and training continues identically.

Layout of the saved state (keys are the model's parameter names, so nothing depends on the
world size): ``model``: every trainable parameter at full precision (the optimizer copies),
every buffer and frozen parameter except the quantized frozen base (``frozen_dtype``: it is
the model's, loaded with it, and never changes); ``optimizer``: ``state`` (per parameter name, per state
key, as the optimizer keeps it: float32, bfloat16 or int8 codes with their block maxima; only
``state_dtype="int8"`` state of a sharded parameter is written as the float32 values it reads
back as, since each rank's block maxima would not split over another world size — a passing 4
bytes per state value of the rank's rows while saving, and a resume within the quantisation
error instead of bit for bit) and ``param_groups`` (hyperparameters, parameters by name);
``extra``: whatever the caller adds (an LR scheduler's state, the step, a GradScaler's state).
Loading converts the state to the optimizer's own ``state_dtype``, whatever it was saved as.

    roundpipe.save_checkpoint("ckpt", model, opt, extra={"step": step})
    extra = roundpipe.load_checkpoint("ckpt", model, opt)   # any world size
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp

from .disk import store_of
from .optim import CpuOptimizer
from .quant import frozen_base_keys


class _Params:
    """What a checkpoint needs of a RoundPipe's trainable parameters, read through its public
    accessors once: their names, optimizer copies, this rank's rows and whole shapes."""

    def __init__(self, model) -> None:
        named = list(model.optim_named_parameters())
        rows = model.optim_shard_rows()
        self.names = [n for n, _ in named]
        self.optim = [o for _, o in named]
        self.rows = [rows[n] for n in self.names]
        self.model = [model.module.get_parameter(n) for n in self.names]  # the model copies
        self.index = {id(o): i for i, o in enumerate(self.optim)}


def _wrap(params: _Params, i: int, t: torch.Tensor, mesh) -> Any:
    """``t`` (this rank's part of parameter ``i``'s tensor) as what DCP saves: a ``DTensor``
    sharded by rows when the optimizer is sharded, else the tensor itself (replicated)."""
    if mesh is None or params.rows[i] is None or t.dim() == 0:
        return t
    from torch.distributed.tensor import DTensor, Shard

    full = params.model[i].shape
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=full, stride=stride)


def _mesh(model):
    group = model.host_process_group
    if group is None or not model.shard_optimizer:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


def _state(model, optimizer, mesh, template_keys: Optional[dict] = None) -> dict:
    params = _Params(model)
    names, index = params.names, params.index
    sd: dict[str, Any] = {"model": {}}
    for i, name in enumerate(names):
        sd["model"][name] = _wrap(params, i, params.optim[i].data, mesh)
    trainable = {id(p) for p in params.model}
    base = frozen_base_keys(model.module)  # quantized frozen weights: the base, not written
    for name, t in model.module.state_dict(keep_vars=True).items():
        if name in base:
            continue
        if name not in sd["model"] and not (isinstance(t, torch.nn.Parameter) and id(t) in trainable):
            sd["model"][name] = t.data
    if optimizer is not None:
        state, groups = {}, []
        templates = None if template_keys is None else _templates(optimizer, params,
                                                                    template_keys)
        for g in optimizer.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = [names[index[id(p)]] for p in g["params"]]
            groups.append(entry)
            for p in g["params"]:
                i = index[id(p)]
                if template_keys is None:
                    st = optimizer.state.get(p, {})
                    if params.rows[i] is not None:
                        st = _portable(optimizer, st)
                else:  # loading: a tensor for every entry of the checkpoint, as it was saved
                    st = templates.get(names[i], {})
                state[names[i]] = {k: (_wrap(params, i, v, mesh) if torch.is_tensor(v)
                                       and v.shape == p.shape and v.dim() > 0 else v)
                                   for k, v in st.items()}
        sd["optimizer"] = {"state": state, "param_groups": _blob(groups),
                           "info": _blob(_info(optimizer))}
    return sd


def _templates(optimizer: torch.optim.Optimizer, params: _Params, template_keys: dict) -> dict:
    """Per parameter name, per state key of the checkpoint, an empty tensor to load into, as it
    was saved (shape or "param", dtype): a ``roundpipe.optim`` optimizer makes them
    (:meth:`~roundpipe.optim.CpuOptimizer.empty_state`: in the files of its state on a disk,
    so that loading never holds the whole state in host memory)."""
    requests = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            name = params.names[params.index[id(p)]]
            for key, (shape, dtype) in template_keys.get(name, {}).items():
                requests.append((name, key, p, tuple(p.shape) if shape == "param" else shape,
                                 dtype))
    if isinstance(optimizer, CpuOptimizer):
        made = optimizer.empty_state([(p, shape, dtype) for _, _, p, shape, dtype in requests])
    else:
        made = [torch.empty(shape, dtype=dtype) for *_, shape, dtype in requests]
    out: dict = {}
    for (name, key, *_), t in zip(requests, made):
        out.setdefault(name, {})[key] = t
    return out


def _class_name(optimizer: torch.optim.Optimizer) -> str:
    """The algorithm of ``optimizer``: the name of the first class in its MRO defined by
    ``torch.optim`` or ``roundpipe.optim`` (so ``torch.optim.Adam`` and
    ``roundpipe.optim.Adam``, or a user's subclass of either, are one algorithm)."""
    for cls in type(optimizer).__mro__:
        module = cls.__module__ or ""
        if module.startswith(("torch.optim", "roundpipe.optim")):
            return cls.__name__
    return type(optimizer).__name__


def _info(optimizer: torch.optim.Optimizer) -> dict:
    """What a checkpoint keeps about the optimizer beside its state: its algorithm and, for a
    ``roundpipe.optim`` optimizer, its count of rounding kernel calls (SGD's rounding bits
    depend on it, see ``CpuOptimizer.state_dict``)."""
    info = {"class": _class_name(optimizer)}
    if isinstance(optimizer, CpuOptimizer):
        info["rounding_calls"] = optimizer.rounding_calls
    return info


def _portable(optimizer: torch.optim.Optimizer, st: dict) -> dict:
    """This rank's rows of a sharded parameter's optimizer state as a checkpoint holds them: as
    kept, except int8 state (block maxima over this rank's elements, which another world size
    would split differently), written as the float32 values it reads back as."""
    if isinstance(optimizer, CpuOptimizer) and any(
            torch.is_tensor(v) and v.dtype == torch.uint8 for v in st.values()):
        return optimizer.state_as_float32(st)
    return st


def _adopt(optimizer: torch.optim.Optimizer, p: torch.Tensor, loaded: dict,
           rows: Optional[tuple[int, int]]) -> None:
    """``loaded`` (one parameter's state read from a checkpoint, in the form it was saved;
    int8 codes whole, the rest ``rows`` of it when sharded) becomes ``optimizer``'s state of
    ``p``, converted to the optimizer's own format (a ``roundpipe.optim`` optimizer with
    compact state: bfloat16 or int8; int8 checkpoints reach only those, see
    :func:`_check_optimizer`)."""
    if not isinstance(optimizer, CpuOptimizer):  # as torch's load_state_dict casts it
        optimizer.state[p] = {k: v.to(p.dtype) if torch.is_tensor(v) and v.dim() > 0
                              and v.is_floating_point() else v for k, v in loaded.items()}
        return
    if rows is not None and any(torch.is_tensor(v) and v.dtype == torch.uint8
                                for v in loaded.values()):  # whole codes: values, our rows
        loaded = {k: v[rows[0]:rows[1]] if k in optimizer.state_keys and v.dim() > 0 else v
                  for k, v in optimizer.state_as_float32(loaded).items()}
    st = {k: v for k, v in loaded.items()
          if k not in optimizer.state_keys and not k.endswith("_absmax")}
    optimizer.store_state(p, st, loaded)
    optimizer.state[p] = st


def _blob(obj: Any) -> io.BytesIO:
    """An object DCP stores as bytes (not flattened: its structure may differ at load)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _unblob(buf: io.BytesIO) -> Any:
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@contextlib.contextmanager
def _dcp_quiet():
    """DCP's warnings that restate what we asked for, and read to a user as if something were
    wrong, filtered by message and module (torch 2.6-2.13): a single-process save or load
    ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to
    save in a single process": we pass ``no_dist=True`` for a model without a process group)
    and the replacement of an earlier checkpoint in the same folder (we pass
    ``overwrite=True``: "... `overwrite` will default to False"). Every other warning shows."""
    with warnings.catch_warnings():
        for message in (r"torch\.distributed is disabled, unavailable or uninitialized, "
                        r"assuming the intent is to (save|load) in a single process",
                        r"Detected an existing checkpoint in .*, overwriting since "):
            warnings.filterwarnings("ignore", message=message, category=UserWarning,
                                    module=r"torch\.distributed\.checkpoint")
        yield


def save_checkpoint(path: str, model, optimizer: Optional[torch.optim.Optimizer] = None,
                    extra: Optional[dict] = None) -> None:
    """Writes ``model`` (a RoundPipe), ``optimizer`` (over its optimizer copies) and ``extra``
    to the folder ``path`` with DCP (a checkpoint already there is replaced); with a process
    group every rank of it must call this (a collective), each writing what it owns. Waits
    for pending optimizer work first."""
    model.synchronize()
    sd = _state(model, optimizer, _mesh(model))
    sd["extra"] = _blob(dict(extra or {}))
    group = model.process_group
    writer = dcp.FileSystemWriter(path, overwrite=True)
    with _dcp_quiet():
        dcp.save(sd, storage_writer=writer, process_group=group) if group is not None \
            else dcp.save(sd, storage_writer=writer, no_dist=True)
    _let_go(model)


def _let_go(model) -> None:
    """With the optimizer state on a disk, what a checkpoint read or wrote through the files'
    mappings leaves this process's resident set (and written data reaches the disk)."""
    store = next((s for s in map(store_of, model.optim_parameters()) if s is not None), None)
    if store is not None:
        store.sync_files()


def _dcp_load(sd: dict, path: str, group) -> None:
    """DCP's load of the entries of ``sd`` (a part of the checkpoint is fine), in place."""
    with _dcp_quiet():
        dcp.load(sd, checkpoint_id=path, process_group=group) if group is not None \
            else dcp.load(sd, checkpoint_id=path, no_dist=True)


def _check_optimizer(path: str, meta, model, optimizer: torch.optim.Optimizer,
                     group) -> tuple[list[dict], dict]:
    """What would make loading into ``optimizer`` fail or go wrong halfway, checked from the
    checkpoint's metadata, saved param groups and optimizer class before anything is loaded;
    returns the saved param groups and the saved ``info`` (:func:`_info`; empty for older
    checkpoints)."""
    where = "roundpipe.load_checkpoint"
    if "optimizer.param_groups" not in meta.state_dict_metadata:
        raise ValueError(f"{where}: {path!r} holds no optimizer state (saved without one)")
    if not isinstance(optimizer, CpuOptimizer) and any(
            fqn.startswith("optimizer.state.") and getattr(m, "properties", None) is not None
            and m.properties.dtype == torch.uint8 for fqn, m in meta.state_dict_metadata.items()):
        raise TypeError(f"{where}: the checkpoint holds int8 optimizer state, which only "
                        "roundpipe.optim optimizers load (with any state_dtype), not "
                        f"{type(optimizer).__name__}")
    part = {"optimizer": {"param_groups": io.BytesIO()}}
    has_info = "optimizer.info" in meta.state_dict_metadata  # not in older checkpoints
    if has_info:
        part["optimizer"]["info"] = io.BytesIO()
    _dcp_load(part, path, group)
    saved = _unblob(part["optimizer"]["param_groups"])
    info = _unblob(part["optimizer"]["info"]) if has_info else {}
    saved_class, mine_class = info.get("class"), _class_name(optimizer)
    if saved_class is not None and saved_class != mine_class:
        raise ValueError(f"{where}: the checkpoint was saved by another optimizer class "
                         f"({saved_class}) than this one ({mine_class}); their states do not "
                         "mean the same")
    params = _Params(model)
    names, index = params.names, params.index
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"{where}: the checkpoint's optimizer has {len(saved)} param groups, "
                         f"this one {len(optimizer.param_groups)}")
    for k, (s, g) in enumerate(zip(saved, optimizer.param_groups)):
        mine = [names[index[id(p)]] for p in g["params"]]
        if sorted(s["params"]) != sorted(mine):
            raise ValueError(f"{where}: param group {k} holds other parameters than the "
                             f"checkpoint's (saved {s['params']}, here {mine})")
        missing = sorted(set(optimizer.defaults) - set(s))
        if missing:
            raise ValueError(
                f"{where}: param group {k} of the checkpoint lacks the hyperparameters "
                f"{missing} of {type(optimizer).__name__}: was it saved by another optimizer "
                "class?")
    return saved, info


def load_checkpoint(path: str, model, optimizer: Optional[torch.optim.Optimizer] = None) -> dict:
    """Loads a checkpoint of :func:`save_checkpoint` (saved at any world size, sharded or
    not) into ``model`` and ``optimizer`` as they are built now; returns its ``extra``. With
    a process group every rank of it must call this. The model copies take the loaded
    weights (rounded to the model dtype), the optimizer its state and hyperparameters.

    Raises:
        ValueError: (before anything changes) the checkpoint was saved by another optimizer
            class (``torch.optim.X`` and ``roundpipe.optim.X`` count as one), the optimizer's
            param groups differ from the checkpoint's in number, parameters or
            hyperparameter names, or the checkpoint holds no optimizer.
        TypeError: (before anything changes) the checkpoint holds int8 optimizer state and
            ``optimizer`` is not a ``roundpipe.optim`` optimizer.
        KeyError / RuntimeError (from DCP): the checkpoint does not hold this model's names.
    """
    model.synchronize()
    meta = dcp.FileSystemReader(path).read_metadata()
    group = model.process_group
    saved_groups, info = (None, {}) if optimizer is None else _check_optimizer(
        path, meta, model, optimizer, group)
    params = _Params(model)
    trainable = {name: i for i, name in enumerate(params.names)}
    keys: dict[str, dict[str, tuple]] = {}  # name -> key -> (shape or "param", dtype)
    for fqn, m in meta.state_dict_metadata.items():
        parts = fqn.split(".")
        if parts[:2] == ["optimizer", "state"] and hasattr(m, "size"):
            name, key = ".".join(parts[2:-1]), parts[-1]
            i = trainable.get(name)
            whole = i is not None and tuple(m.size) == tuple(params.model[i].shape) \
                and len(m.size) > 0 and m.properties.dtype != torch.uint8  # codes: whole
            keys.setdefault(name, {})[key] = ("param" if whole else tuple(m.size),
                                              m.properties.dtype)
    sd = _state(model, optimizer, _mesh(model), keys)
    sd["extra"] = io.BytesIO()
    if optimizer is not None:
        del sd["optimizer"]["param_groups"]  # both read by _check_optimizer
        del sd["optimizer"]["info"]
    _dcp_load(sd, path, group)
    model.sync_model_copies()  # the optimizer copies, buffers and state were loaded in place
    if optimizer is not None:
        for g in optimizer.param_groups:
            for p in g["params"]:
                i = params.index[id(p)]
                loaded = sd["optimizer"]["state"].get(params.names[i], {})
                _adopt(optimizer, p, {k: v.to_local() if hasattr(v, "to_local") else v
                                      for k, v in loaded.items()}, params.rows[i])
        for g, saved in zip(optimizer.param_groups, saved_groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        if isinstance(optimizer, CpuOptimizer) and "rounding_calls" in info:
            optimizer.rounding_calls = int(info["rounding_calls"])
    _let_go(model)
    return _unblob(sd["extra"])
