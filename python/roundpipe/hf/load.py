"""Loading a Hugging Face causal LM for RoundPipe without its full-precision weights in host
memory: :func:`from_pretrained`.

1. The model is built on the meta device (``accelerate.init_empty_weights``: parameters take no
   memory, buffers such as rotary tables are computed as usual); each parameter is then replaced
   by a CPU placeholder of its shape and dtype holding one value (tied parameters stay one), so
   that PEFT, applied now, makes its adapters on the CPU, initialised as usual (their values do
   not depend on the base: only LoRA initialisations that do not read the base are accepted).
2. Every checkpoint name and shape is checked against the model (PEFT's ``base_layer`` /
   ``modules_to_save`` paths mapped back to the checkpoint's names) before a weight is read.
3. The safetensors files are read one tensor at a time (``safetensors.safe_open``; the file is
   opened for that tensor alone, so the memory map, whose touched pages count as resident, goes
   with the tensor): a frozen ``nn.Linear`` weight goes straight into a
   :class:`~roundpipe.quant.QuantizedLinear` and its dense values are dropped; every other
   tensor becomes the model's parameter as read (cast to the parameter's dtype), one copy.

Peak host memory while loading: the model as it ends up (quantized base, the rest in the model
dtype) + the tensor being read and the quantizer's temporaries (its chunks, a fixed size) +
fixed costs (the interpreter, torch, transformers).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
from typing import Any, Optional

import torch
from torch import nn

from ..quant import FROZEN_DTYPES, QuantizedLinear, check_frozen_dtype, frozen_linears

WHO = "roundpipe.hf.from_pretrained"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# LoRA initialisations that do not read the base weights (made before they are read)
_PLAIN_LORA_INITS = (True, False, "gaussian")


@contextlib.contextmanager
def _opened(file: str):
    """``safetensors.safe_open(file)``; a file safetensors cannot read (a corrupt or truncated
    shard) raises ``ValueError`` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(file, framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{WHO}: path: {file} is not a readable safetensors file ({e}); "
                         "is it corrupt or truncated? Save or download it again") from e
    with f:
        yield f


def _is_floating(safetensors_dtype: str) -> bool:
    """Whether a safetensors dtype name (``"F32"``, ``"BF16"``, ``"F8_E4M3"``, ``"I32"``, ...)
    is a floating type."""
    return safetensors_dtype.startswith(("F", "BF"))


def checkpoint_files(path: str) -> dict[str, list[str]]:
    """The safetensors files of the checkpoint in directory ``path`` and the tensor names each
    holds: ``{file path: [names]}``, from ``model.safetensors.index.json`` (sharded) or
    ``model.safetensors``.

    Raises:
        ValueError: ``path`` is not a directory, or has no safetensors weights (e.g. only
            ``pytorch_model.bin``), or its index has no ``weight_map``, or its
            ``model.safetensors`` is not readable (named).
        FileNotFoundError: a shard the index names is missing (the message names it).
    """
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        raise ValueError(f"{WHO}: path must be a local directory holding a saved model "
                         f"(config.json + safetensors), got {path!r}")
    path = os.fspath(path)
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{WHO}: path: {index} has no weight_map")
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(os.path.join(path, shard), []).append(name)
        for shard in files:
            if not os.path.isfile(shard):
                raise FileNotFoundError(f"{WHO}: path: the shard {os.path.basename(shard)!r} "
                                        f"that {INDEX} names is missing from {path}")
        return files
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        with _opened(single) as f:
            return {single: list(f.keys())}
    raise ValueError(f"{WHO}: path: {path} has no {SINGLE} or {INDEX} (only safetensors "
                     "checkpoints are read; re-save a .bin checkpoint with save_pretrained)")


def _check_peft_config(peft_config: Any, frozen_dtype: Optional[str]) -> None:
    if peft_config is None:
        if frozen_dtype is not None:
            raise ValueError(f"{WHO}: frozen_dtype={frozen_dtype!r} needs a peft_config: the "
                             "quantized base is frozen, so without adapters nothing would train "
                             "(pass e.g. peft.LoraConfig(...), or frozen_dtype=None for a full "
                             "model)")
        return
    import peft

    if not isinstance(peft_config, peft.PeftConfig):
        raise TypeError(f"{WHO}: peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig), "
                        f"got {type(peft_config).__name__}")
    if peft_config.peft_type != peft.PeftType.LORA:
        raise ValueError(f"{WHO}: peft_config must be a LoRA config (the adapters are made "
                         f"before the base is read); got {peft_config.peft_type}")
    init = getattr(peft_config, "init_lora_weights", True)
    if not any(init is v or (isinstance(v, str) and init == v) for v in _PLAIN_LORA_INITS) \
            or getattr(peft_config, "use_dora", False):
        what = "use_dora=True" if getattr(peft_config, "use_dora", False) \
            else f"init_lora_weights={init!r}"
        raise ValueError(f"{WHO}: peft_config.{what} computes the adapters from the base "
                         "weights, which are read after the adapters are made; use "
                         "init_lora_weights True, False or 'gaussian' without DoRA")


def _config_dtype(config: Any) -> torch.dtype:
    """The checkpoint's dtype as its config records it (``dtype``, or ``torch_dtype`` of older
    configs), float32 when it records none."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _model_class(config: Any, path: str):
    import transformers

    if getattr(config, "quantization_config", None) is not None:
        method = getattr(config.quantization_config, "quant_method", None) \
            if not isinstance(config.quantization_config, dict) \
            else config.quantization_config.get("quant_method")
        raise ValueError(f"{WHO}: path: {path} holds a checkpoint already quantized "
                         f"({method}); load the original full-precision checkpoint with "
                         f"frozen_dtype={FROZEN_DTYPES[0]!r} or {FROZEN_DTYPES[1]!r}")
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{WHO}: path: the architecture {config.model_type!r} "
                         f"({', '.join(getattr(config, 'architectures', None) or [])}) is not a "
                         "causal LM transformers knows; not supported") from None


def _placeholders(model: nn.Module) -> dict[int, list[str]]:
    """Replaces each meta parameter of ``model`` by a CPU placeholder of its shape and dtype
    that holds one value (an expanded view), tied parameters by one placeholder: PEFT then makes
    its adapters on the CPU (it puts them on the device of the base weight). Returns
    ``{id(placeholder): [its names]}``."""
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.device.type == "meta":
                if id(p) not in made:
                    made[id(p)] = (p, nn.Parameter(torch.empty((), dtype=p.dtype).expand(p.shape),
                                                   requires_grad=p.requires_grad))
                module._parameters[name] = made[id(p)][1]
    return _placeholder_names(model, {id(new) for _, new in made.values()})


def _placeholder_names(model: nn.Module, ids: set[int]) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ids:
            names.setdefault(id(p), []).append(name)
    return names


# what PEFT inserts into a module path: the wrapped layer, and modules_to_save's copies
_PEFT_PATH = re.compile(r"\.(?:base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def _checkpoint_name(name: str) -> str:
    """The checkpoint's name of a parameter of the (PEFT-wrapped) model."""
    return _PEFT_PATH.sub("", name)


def _plan(model: nn.Module, holders: dict[int, list[str]], files: dict[str, list[str]],
          path: str) -> dict[str, tuple[str, list[int]]]:
    """``{checkpoint name: (file, [placeholder ids])}``: what each checkpoint tensor is read
    into (a persistent buffer: no ids), checked against ``model``: every name is a parameter or
    persistent buffer of the same shape and kind of dtype (floating or not: a floating one is
    cast to the model's dtype, as transformers casts it, an integer one never is), and every
    placeholder (``holders``) is given.

    Raises:
        ValueError: a name the model does not have, a shape or kind of dtype that differs, or
            a parameter the checkpoint lacks (the message names up to five, with the file); a
            shard safetensors cannot read (named).
    """
    targets: dict[str, list[int]] = {}
    shapes: dict[str, tuple] = {}
    floating: dict[str, torch.dtype] = {}  # name -> the model's dtype
    for key, names in holders.items():
        for name in names:
            ids = targets.setdefault(_checkpoint_name(name), [])
            if key not in ids:
                ids.append(key)
            shapes[_checkpoint_name(name)] = tuple(model.get_parameter(name).shape)
            floating[_checkpoint_name(name)] = model.get_parameter(name).dtype
    persistent = set(model.state_dict(keep_vars=True))
    for name, b in model.named_buffers():
        if name in persistent:
            targets.setdefault(name, [])
            shapes[name] = tuple(b.shape)
            floating[name] = b.dtype
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None)
                                      or [])]
    todo: dict[str, tuple[str, list[int]]] = {}
    unexpected, wrong, kinds = [], [], []
    for file, names in files.items():
        with _opened(file) as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise ValueError(f"{WHO}: path: {os.path.basename(file)} lacks {name!r}, "
                                     f"which {INDEX} places there")
                if name not in targets:
                    if not any(p.search(name) for p in ignore):
                        unexpected.append(name)
                    continue
                piece = f.get_slice(name)
                shape = tuple(piece.get_shape())
                if shape != shapes[name]:
                    wrong.append(f"{name} {shape} (the model's: {shapes[name]})")
                if _is_floating(piece.get_dtype()) != floating[name].is_floating_point:
                    kinds.append(f"{name} in {os.path.basename(file)} is {piece.get_dtype()} "
                                 f"(the model's: {floating[name]})")
                todo[name] = (file, targets[name])
    type_name = type(model).__name__
    if unexpected:
        raise ValueError(f"{WHO}: path: {path} does not match {type_name}: the checkpoint has "
                         f"{len(unexpected)} tensor(s) the model has not, e.g. "
                         f"{', '.join(unexpected[:5])} (a layout transformers converts while "
                         "loading is not supported)")
    if wrong:
        raise ValueError(f"{WHO}: path: {path} does not match {type_name}: shapes differ for "
                         f"{', '.join(wrong[:5])}")
    if kinds:
        raise ValueError(f"{WHO}: path: {path} does not match {type_name}: dtypes differ "
                         f"(floating against integer) for {', '.join(kinds[:5])}; a tensor "
                         "of the wrong kind would be cast silently")
    given = {key for _, ids in todo.values() for key in ids}
    missing = [names[0] for key, names in holders.items() if key not in given]
    if missing:
        raise ValueError(f"{WHO}: path: {path} lacks {len(missing)} parameter(s) of "
                         f"{type_name}, e.g. {', '.join(map(_checkpoint_name, missing[:5]))}")
    return todo


def _split(name: str) -> tuple[str, str]:
    module, _, attr = name.rpartition(".")
    return module, attr


def _load(model: nn.Module, holders: dict[int, list[str]],
          todo: dict[str, tuple[str, list[int]]], quantized: set[str],
          frozen_dtype: Optional[str]) -> None:
    """Reads every tensor of ``todo`` into ``model`` in place of its placeholders (see the
    module docstring); the modules named in ``quantized`` become :class:`QuantizedLinear` as
    their weight is read."""
    # the placeholders live until the end, so that their ids (the keys) are not reused
    placeholders = [model.get_parameter(names[0]) for names in holders.values()]
    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in model.modules():
        for child_name, child in parent._modules.items():
            if child is not None:
                parents.setdefault(id(child), []).append((parent, child_name))
    for key, (file, ids) in todo.items():
        with _opened(file) as f:
            t = f.get_tensor(key)  # memory-mapped: pages are read as they are used
        if not ids:  # a persistent buffer
            with torch.no_grad():
                model.get_buffer(key).copy_(t)
        for pid in ids:
            names = holders[pid]
            old = model.get_parameter(names[0])
            module_name, attr = _split(names[0])
            if module_name in quantized and attr == "weight":
                linear = model.get_submodule(module_name)
                linear.weight = nn.Parameter(t.to(old.dtype), requires_grad=False)
                new = QuantizedLinear(linear, frozen_dtype)
                linear.weight = None
                for parent, child_name in parents.get(id(linear), []):
                    parent._modules[child_name] = new
                parents[id(new)] = parents.pop(id(linear), [])
                continue
            value = t.to(old.dtype, copy=True) if t.is_floating_point() else t.clone()
            param = nn.Parameter(value,
                                 requires_grad=old.requires_grad and value.is_floating_point())
            for name in names:
                mod, a = _split(name)
                model.get_submodule(mod)._parameters[a] = param
        del t
    left = _placeholder_names(model, {id(p) for p in placeholders})
    if left:  # _plan covers every placeholder; this guards the invariant
        raise RuntimeError(f"{WHO}: parameters left unread: "
                           f"{', '.join(n for names in left.values() for n in names[:1])}")


def from_pretrained(path: str, frozen_dtype: Optional[str] = None,
                    torch_dtype: Optional[torch.dtype] = None, peft_config: Any = None,
                    **roundpipe_kwargs: Any):
    """Loads a transformers causal LM saved with ``save_pretrained`` (safetensors) straight
    into RoundPipe, never holding its full-precision weights in host memory when
    ``frozen_dtype`` is set.

    Args:
        path: a local directory with ``config.json`` and ``model.safetensors`` or a sharded
            checkpoint (``model.safetensors.index.json`` and its shards).
        frozen_dtype: ``"nf4"`` or ``"int8"``: every frozen ``nn.Linear`` of the base (all but
            the output embeddings, tied weights and the trainable copies PEFT makes for
            ``modules_to_save``) is quantized as its weight is read (see
            :mod:`roundpipe.quant`); needs ``peft_config`` (the base is frozen, the adapters
            train). None: the base in ``torch_dtype``, one copy.
        torch_dtype: the model dtype (what non-quantized parameters are kept in and quantized
            weights are dequantized into on the device); None: ``config.dtype`` of the
            checkpoint, else float32.
        peft_config: a ``peft.LoraConfig`` (``init_lora_weights`` True, False or
            ``"gaussian"``, no DoRA): the model is ``peft.get_peft_model(model, peft_config)``
            (on a copy of the config), the base frozen. None: every parameter trains
            (``frozen_dtype`` must then be None).
        **roundpipe_kwargs: passed to :func:`roundpipe.wrap_model_to_roundpipe` (``optim_dtype``,
            ``device``, ``num_microbatch``, ``loss_chunk_size``, ...).

    Returns:
        the :class:`~roundpipe.hf.HFRoundPipe` wrapping the model (in eval mode, as
        transformers' ``from_pretrained`` returns it; ``generation_config`` read from ``path``
        when it has one).

    Raises:
        ValueError: ``path`` is not a directory, has no safetensors checkpoint or holds one
            already quantized, an architecture that is not a transformers causal LM, tensor
            names, shapes or kinds of dtype (a floating parameter given an integer tensor, or
            the reverse) that do not match the model, or a parameter the checkpoint lacks; a
            shard safetensors cannot read (corrupt, truncated: the message names the file);
            a bad ``frozen_dtype`` / ``torch_dtype``; ``frozen_dtype`` without ``peft_config``;
            a ``peft_config`` that is not LoRA or whose adapters are computed from the base
            (``init_lora_weights`` "pissa", "olora", "loftq", ..., or ``use_dora``). All before
            any weight is read.
        FileNotFoundError: a shard the index names is missing.
        TypeError: ``peft_config`` is not a ``peft.PeftConfig``; the model's layout is not one
            RoundPipe splits (see :func:`roundpipe.wrap_model_to_roundpipe`), raised before any
            weight is read.
        everything :func:`roundpipe.wrap_model_to_roundpipe` raises.
    """
    check_frozen_dtype(frozen_dtype, WHO)
    if torch_dtype is not None and not (isinstance(torch_dtype, torch.dtype)
                                        and torch_dtype.is_floating_point):
        raise ValueError(f"{WHO}: torch_dtype must be None or a floating torch.dtype, got "
                         f"{torch_dtype!r}")
    _check_peft_config(peft_config, frozen_dtype)
    files = checkpoint_files(path)
    import transformers
    from accelerate import init_empty_weights

    from .parts import Parts
    from .wrap import wrap_model_to_roundpipe

    config = transformers.AutoConfig.from_pretrained(path)
    model_class = _model_class(config, path)
    dtype = torch_dtype or _config_dtype(config)
    with init_empty_weights():
        model = model_class._from_config(config, dtype=dtype)
    model.tie_weights()
    holders = _placeholders(model)
    wrapped = model
    if peft_config is not None:
        import peft

        wrapped = peft.get_peft_model(model, copy.deepcopy(peft_config))
        holders = _placeholder_names(model, set(holders))  # under the names PEFT gave them
    Parts(model)  # the layout RoundPipe splits, refused now rather than after reading
    todo = _plan(model, holders, files, os.fspath(path))
    quantized = set(frozen_linears(model, frozen_dtype)) if frozen_dtype is not None else set()
    _load(model, holders, todo, quantized, frozen_dtype)
    wrapped.eval()
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except OSError:
        pass  # no generation_config.json: the one built from the config stays
    return wrap_model_to_roundpipe(wrapped, frozen_dtype=frozen_dtype, **roundpipe_kwargs)
