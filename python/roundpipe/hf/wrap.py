"""Finding the parts of a Hugging Face decoder-only causal LM and wrapping it.

The parts are found by probing the attribute paths the common families use (Llama, Mistral,
Qwen2, Qwen3, Qwen3-MoE and every model following their layout), not by a list of classes:

- token embeddings, decoder layers (an ``nn.ModuleList``), final norm and rotary embedding
  module under the base model (``model.model``), and the output head (``lm_head``);
- the decoder layers must take ``position_embeddings`` (rotary computed once by the model, the
  layout of transformers 4.48+ / 5.x);
- each layer's mask: ``config.layer_types[i]`` when the config has it (``full_attention`` /
  ``sliding_attention``), else sliding-window when ``config.sliding_window`` is set, as the
  model forwards of those families choose;
- MoE routers: the module class HF records as ``router_logits`` (``_can_record_outputs``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Optional

import torch
from torch import nn

_PATHS = {
    "token embeddings": ("model.embed_tokens", "model.embed_in", "transformer.wte", "embed_tokens"),
    "decoder layers": ("model.layers", "model.decoder.layers", "transformer.h", "layers"),
    "final norm": ("model.norm", "model.final_layernorm", "model.final_norm", "transformer.ln_f",
                   "norm"),
    "rotary embedding": ("model.rotary_emb", "model.rotary_embedding", "transformer.rotary_emb",
                         "rotary_emb"),
    "output head": ("lm_head", "embed_out", "output"),
}
# config attributes of families whose forward scales embeddings or logits beyond this layout
_UNSUPPORTED_CONFIG = ("final_logit_softcapping", "logit_scale", "embedding_multiplier",
                       "logits_scaling", "scale_emb")


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` or a peft ``PeftModel`` (checked
    without importing either library: an instance implies it is imported)."""
    mods = [sys.modules.get("transformers"), sys.modules.get("peft")]
    classes = []
    if mods[0] is not None:
        classes.append(mods[0].PreTrainedModel)
    if mods[1] is not None:
        classes.append(mods[1].PeftModel)
    return bool(classes) and isinstance(model, tuple(classes))


def _probe(model: nn.Module, part: str) -> nn.Module:
    for path in _PATHS[part]:
        obj: Any = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.Module):
            return obj
    raise TypeError(f"wrap_model_to_roundpipe: cannot split {type(model).__name__}: no {part} "
                    f"found (looked for {', '.join(_PATHS[part])})")


class Parts:
    """The probed parts of an HF causal LM (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        config = getattr(model, "config", None)
        if config is None:
            raise TypeError(f"wrap_model_to_roundpipe: {type(model).__name__} has no config")
        for attr in _UNSUPPORTED_CONFIG:
            if getattr(config, attr, None) not in (None, 0, 0.0, 1, 1.0, False):
                raise TypeError(f"wrap_model_to_roundpipe: {type(model).__name__} sets "
                                f"config.{attr}, which scales embeddings or logits beyond the "
                                "supported layout (Llama/Mistral/Qwen style)")
        self.config = config
        self.embed_tokens = _probe(model, "token embeddings")
        layers = _probe(model, "decoder layers")
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
            raise TypeError("wrap_model_to_roundpipe: the decoder layers must be a non-empty "
                            f"nn.ModuleList, got {type(layers).__name__}")
        self.layers = list(layers)[: getattr(config, "num_hidden_layers", len(layers))]
        params = inspect.signature(self.layers[0].forward).parameters
        if "position_embeddings" not in params:
            raise TypeError(f"wrap_model_to_roundpipe: the decoder layers "
                            f"({type(self.layers[0]).__name__}) do not take position_embeddings "
                            "(rotary embedding computed by the model); not supported")
        self.norm = _probe(model, "final norm")
        self.rotary_emb = _probe(model, "rotary embedding")
        self.lm_head = _probe(model, "output head")
        if not isinstance(self.lm_head, nn.Linear):
            raise TypeError("wrap_model_to_roundpipe: the output head must be an nn.Linear "
                            f"(the chunked loss reads its weight), got {type(self.lm_head).__name__}"
                            " (LoRA on lm_head is not supported)")
        self.mask_fns = [self._mask_fn(i) for i in range(len(self.layers))]

    def _mask_fn(self, i: int):
        from transformers import masking_utils as mu

        kinds = getattr(self.config, "layer_types", None)
        if kinds is not None:
            kind = kinds[i]
        else:
            kind = ("sliding_attention" if getattr(self.config, "sliding_window", None) is not None
                    else "full_attention")
        if kind == "full_attention":
            return mu.create_causal_mask
        if kind == "sliding_attention":
            return mu.create_sliding_window_causal_mask
        raise TypeError(f"wrap_model_to_roundpipe: decoder layer {i} has attention type "
                        f"{kind!r}; only full_attention and sliding_attention are supported")


def disable_gradient_checkpointing(model: nn.Module) -> None:
    """Switches HF's own gradient checkpointing off in every module (RoundPipe already
    recomputes each layer; HF's would recompute a second time)."""
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False


def wrap_model_to_roundpipe(model: nn.Module, optim_dtype: Optional[torch.dtype] = None, *,
                            loss_chunk_size: int = 1024, **roundpipe_kwargs: Any):
    """Wraps a model for RoundPipe training; Hugging Face causal LMs are split into layers.

    For a transformers decoder-only causal LM (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and any
    model with their layout: token embeddings, an ``nn.ModuleList`` of decoder layers taking
    ``position_embeddings``, final norm, rotary embedding module, ``lm_head``), or a peft
    ``PeftModel`` around one, returns an :class:`~roundpipe.hf.HFRoundPipe` whose layers are
    ``[prefix, decoder layer 0, ..., decoder layer L-1, postfix]`` (see
    :mod:`roundpipe.hf.layers`), with HF semantics: ``forward_backward`` without ``loss_fn``
    computes HF's causal-LM loss of the whole batch, chunked (``loss_chunk_size`` tokens at a
    time, never the full logits); ``forward`` returns HF output objects; ``state_dict`` has the
    model's keys; ``save_pretrained`` writes an HF (or PEFT adapter) checkpoint; the model's
    attributes (``config``, ``generation_config``, ...) are reachable through the wrapper.
    HF's gradient checkpointing is switched off (RoundPipe recomputes already); the decoder
    layers run with ``use_cache=False``. Tied input/output embeddings stay one parameter with
    one optimizer copy.

    Any other ``nn.Module`` is wrapped as ``RoundPipe(model, optim_dtype, **roundpipe_kwargs)``.

    Args:
        model: the model, on the CPU, in the dtype to compute in (e.g. bf16).
        optim_dtype: dtype of the optimizer copies (e.g. ``torch.float32``).
        loss_chunk_size: tokens per chunk of the ``lm_head`` + cross-entropy (HF models only):
            at most ``loss_chunk_size x vocab`` fp32 logits exist at a time.
        **roundpipe_kwargs: passed to :class:`roundpipe.RoundPipe` (``device``,
            ``num_microbatch``, ``layers_per_stage``, ...).

    Raises:
        TypeError: an HF model whose parts cannot be found (the message names the part and
            the attribute paths tried), whose decoder layers do not take
            ``position_embeddings``, whose ``lm_head`` is not an ``nn.Linear``, or whose MoE
            router is not of the supported kind.
        ValueError: ``loss_chunk_size`` < 1; with the MoE auxiliary loss on, a MoE layer in
            the last stage (choose ``layers_per_stage`` so that the postfix's stage holds no
            MoE layer); everything :class:`roundpipe.RoundPipe` raises.
    """
    from ..wrapper import RoundPipe

    if not is_hf_model(model):
        return RoundPipe(model, optim_dtype, **roundpipe_kwargs)
    from .model import HFRoundPipe

    return HFRoundPipe(model, optim_dtype, loss_chunk_size=loss_chunk_size, **roundpipe_kwargs)
