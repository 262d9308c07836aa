"""Resuming :class:`roundpipe.hf.RoundPipeTrainer` from a checkpoint plain ``transformers.Trainer``
wrote (``checkpoint-N/``), converted on the way in.

Such a folder holds the model's weights as ``save_pretrained`` writes them
(``model.safetensors``, sharded with ``model.safetensors.index.json``, or the legacy
``pytorch_model.bin`` forms; for a PEFT model the adapter, ``adapter_model.safetensors`` or
``adapter_model.bin``, whose names lack the adapter's name), ``optimizer.pt`` (a
``torch.optim`` state dict: its parameters are numbered in the order of Trainer's param groups,
decay then no-decay, each in ``named_parameters()`` order), ``scheduler.pt``, ``rng_state.pth``
and ``trainer_state.json`` (the last three Trainer reads itself).

- :func:`read` maps the weights to the wrapped model's state-dict names and checks them and
  the optimizer state against the model, raising ``ValueError`` with the way forward before
  anything changes; the weights then load at the precision saved (the optimizer copies take
  them unrounded, the model copy rounded to its dtype), through ``RoundPipe.load_state_dict``;
- :func:`check_optimizer` checks the saved optimizer state against the param groups of the
  trainer's optimizer (their sizes, the state's shapes), before the weights load; the
  optimizer's ``load_state_dict`` (``roundpipe.optim``'s, as torch's) then converts it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch

OPTIMIZER_NAME = "optimizer.pt"
_FULL = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
         "pytorch_model.bin.index.json")
_ADAPTER = ("adapter_model.safetensors", "adapter_model.bin")

_WAY_FORWARD = (
    "To start from its weights without its optimizer state, load the model from the folder "
    "(AutoModelForCausalLM.from_pretrained({folder!r}); for a PEFT adapter "
    "PeftModel.from_pretrained(base_model, {folder!r}, is_trainable=True)), pass it as model= "
    "and call train() without resume_from_checkpoint")


@dataclass
class PlainCheckpoint:
    """What :func:`read` found: ``weights`` under the wrapped model's state-dict names (on the
    host, in the dtype saved), ``optimizer`` the ``torch.optim`` state dict of ``optimizer.pt``."""

    folder: str
    weights: dict
    optimizer: dict


def is_plain(folder: str) -> bool:
    """Whether ``folder`` holds model weights in one of Trainer's formats."""
    return any(os.path.isfile(os.path.join(folder, f)) for f in _FULL + _ADAPTER)


def _refuse(folder: str, why: str) -> ValueError:
    return ValueError(f"RoundPipeTrainer: cannot resume from {folder!r}: {why}. "
                      + _WAY_FORWARD.format(folder=folder))


def _load_file(path: str) -> dict:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_weights(folder: str, names: tuple) -> dict:
    """The state dict stored under the first of ``names`` present in ``folder`` (a sharded
    checkpoint's ``.index.json`` read shard by shard)."""
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".index.json"):
            return _load_file(path)
        with open(path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        out: dict = {}
        for shard in shards:
            out.update(_load_file(os.path.join(folder, shard)))
        return out
    return {}


def _adapter_name(module: Any) -> Optional[str]:
    """The active adapter of a PEFT model, else None."""
    name = getattr(module, "active_adapter", None)
    return name if isinstance(name, str) else None


def read(folder: str, rp: Any) -> PlainCheckpoint:
    """Reads a plain Trainer checkpoint for ``rp`` (the trainer's ``HFRoundPipe``).

    Returns:
        The weights under ``rp``'s state-dict names and the optimizer state dict.

    Raises:
        ValueError: (nothing changed yet) no ``optimizer.pt``; no weights in a known format;
            weights for a PEFT model in a full-model checkpoint or the reverse; names that are
            not the model's; a trainable parameter the checkpoint lacks; a shape that differs.
            The message says how to start from the folder's weights instead.
    """
    module = rp.module
    adapter = _adapter_name(module) if rp.peft_model is not None else None
    if not os.path.isfile(os.path.join(folder, OPTIMIZER_NAME)):
        raise _refuse(folder, f"it holds no {OPTIMIZER_NAME} (and no roundpipe_state folder), "
                              "so its optimizer state is unknown")
    files = _ADAPTER if adapter is not None else _FULL
    saved = _read_weights(folder, files)
    if not saved:
        other = _FULL if adapter is not None else _ADAPTER
        kind = "a PEFT adapter" if adapter is not None else "a full model"
        found = [f for f in other if os.path.isfile(os.path.join(folder, f))]
        raise _refuse(folder, f"the trainer's model is {kind}, but the folder holds "
                              f"{', '.join(found) if found else 'no weights'} (looked for "
                              f"{', '.join(files)})")
    params = dict(module.named_parameters(remove_duplicate=False))
    tensors = {**params, **dict(module.named_buffers(remove_duplicate=False))}
    # PEFT saves its parameters without the adapter's name ("lora_A.weight" for
    # "lora_A.default.weight"): the same renaming maps them back
    names = {(k.replace(f".{adapter}", "") if adapter is not None else k): k for k in tensors}
    weights, unknown = {}, []
    for key, value in saved.items():
        name = names.get(key)
        if name is None:
            unknown.append(key)
            continue
        if tuple(value.shape) != tuple(tensors[name].shape):
            raise _refuse(folder, f"{key!r} has shape {tuple(value.shape)} there and "
                                  f"{tuple(tensors[name].shape)} in the model")
        weights[name] = value
    if unknown:
        raise _refuse(folder, f"{len(unknown)} of its weights are not the model's (e.g. "
                              f"{', '.join(sorted(unknown)[:3])})")
    # every trainable parameter (under one of its names, tied weights have several) is loaded
    loaded = {id(params[n]) for n in weights if n in params}
    missing = sorted({n for n, p in params.items() if p.requires_grad and id(p) not in loaded})
    if missing:
        raise _refuse(folder, f"it lacks {len(missing)} trainable parameters of the model "
                              f"(e.g. {', '.join(missing[:3])})")
    optimizer = torch.load(os.path.join(folder, OPTIMIZER_NAME), map_location="cpu",
                           weights_only=True)
    return PlainCheckpoint(folder, weights, optimizer)


def check_optimizer(ckpt: PlainCheckpoint, groups: list) -> None:
    """Raises ``ValueError`` (the way forward included) unless ``ckpt.optimizer`` has the param
    groups ``groups`` (lists of the optimizer copies, as the trainer's optimizer groups them):
    as many, with as many parameters each, every state tensor of its parameter's shape or
    0-dim (a step count)."""
    sd = ckpt.optimizer
    saved = sd.get("param_groups", [])
    if [len(g["params"]) for g in saved] != [len(g) for g in groups]:
        raise _refuse(ckpt.folder, f"its {OPTIMIZER_NAME} has param groups of "
                                   f"{[len(g['params']) for g in saved]} parameters, this "
                                   f"trainer's optimizer {[len(g) for g in groups]}")
    state = sd.get("state", {})
    for g_saved, g_mine in zip(saved, groups):
        for index, p in zip(g_saved["params"], g_mine):
            for key, value in state.get(index, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != p.shape:
                    raise _refuse(ckpt.folder, f"its {OPTIMIZER_NAME} holds {key!r} of shape "
                                               f"{tuple(value.shape)} for a parameter of shape "
                                               f"{tuple(p.shape)}: another model or param "
                                               "group order")
