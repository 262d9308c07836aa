"""Saving a wrapped Hugging Face model as an HF (or PEFT) checkpoint."""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from ..quant import dequantize_linears


def _cast(state_dict: dict, dtype: torch.dtype) -> dict:
    """Floating tensors rounded to ``dtype``; tensors shared between keys (tied weights) stay
    shared, so transformers recognises the tie."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, t in state_dict.items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key not in done:
            done[key] = t.detach().to(dtype) if t.is_floating_point() else t.detach()
        out[k] = done[key]
    return out


def save_pretrained(wrapper: Any, save_directory: str, dtype: Optional[torch.dtype] = None,
                    merged: bool = False, **kwargs: Any) -> None:
    """Writes the trained model as a checkpoint.

    - transformers model: ``config.json``, ``generation_config.json`` and safetensors, loadable
      with ``AutoModelForCausalLM.from_pretrained(save_directory)``. The weights are the
      optimizer copies (full precision) rounded to ``dtype`` (default: the model copy's dtype);
      ``config.dtype`` says that dtype.
    - PEFT model: the adapter only, as ``PeftModel.save_pretrained`` writes it (``adapter_config.json``
      + ``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained(base, dir)``),
      from the optimizer copies rounded to ``dtype``. With ``merged=True`` instead: the base
      model with the adapters merged in (computed in fp32 on a temporary fp32 copy of the model
      — host memory for it is needed — then rounded to ``dtype``), as a plain transformers
      checkpoint.

    Waits for pending optimizer work (the state dict does). With a ``process_group`` every rank
    must call it (the consolidated state dict is a collective when the optimizer is sharded);
    only the group's rank 0 writes. ``kwargs`` go to the underlying ``save_pretrained`` (e.g.
    ``max_shard_size``).

    With ``frozen_dtype`` (quantized frozen base), a transformers model is written with each
    quantized weight dequantized in the model dtype (the values the model computed with); with
    ``merged=True``, the adapters are merged into those dequantized values (the temporary fp32
    copy is then the dense model's size).

    Raises:
        TypeError: ``dtype`` is not a floating dtype; ``merged=True`` for a model without PEFT.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"save_pretrained: dtype must be a floating torch.dtype, got {dtype!r}")
    peft = wrapper.peft_model
    if merged and peft is None:
        raise TypeError("save_pretrained: merged=True is for PEFT models")
    hf = wrapper.hf_model
    dtype = dtype or hf.dtype
    state = wrapper.state_dict()
    group = wrapper.process_group
    if group is not None and torch.distributed.get_rank(group) != 0:
        return
    if peft is not None and not merged:
        peft.save_pretrained(save_directory, state_dict=_cast(state, dtype), **kwargs)
        return
    if peft is not None:
        full = copy.deepcopy(peft)
        dequantize_linears(full)  # a quantized base: merged into its dequantized values
        full = full.float()
        full.load_state_dict(state)
        hf_out = full.merge_and_unload()
        state = hf_out.state_dict()
    else:
        hf_out = hf
    hf_out.save_pretrained(save_directory, state_dict=_cast(state, dtype), **kwargs)
    # transformers records the model's own dtype in config.json; the weights are in ``dtype``
    config = copy.deepcopy(hf_out.config)
    config.dtype = dtype
    config.save_pretrained(save_directory)
