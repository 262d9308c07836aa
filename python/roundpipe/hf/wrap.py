"""``wrap_model_to_roundpipe``: the factory that picks the wrapper for a model (an
:class:`~roundpipe.hf.HFRoundPipe` for a Hugging Face causal LM, found by
:mod:`roundpipe.hf.parts`; a plain :class:`~roundpipe.RoundPipe` otherwise)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..wrapper import RoundPipe
from .model import HFRoundPipe
from .parts import is_hf_model


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
    one optimizer copy. A dropout the model's forward applies to the embeddings (Phi's
    ``embd_pdrop``, Starcoder2's ``embedding_dropout``) is applied by the prefix, as there.

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
            ``position_embeddings``, whose rotary embedding takes arguments other than
            ``layer_type`` (which is supported: one rotary embedding per layer type), whose
            ``lm_head`` is not an ``nn.Linear``, or whose MoE router is not of the supported
            kind; a config giving decoder layers their own rotary base
            (``config.layer_rope_theta``); a model whose layers, run as RoundPipe runs them,
            do not reproduce its own logits on a small test input, in eval mode and, where
            it has dropout, in training mode under a fixed seed (naming the config's dropout
            values: a dropout its forward applies outside the decoder layers that RoundPipe
            does not know; checked once here, see :func:`roundpipe.hf.parts.check_logits`).
        ValueError: ``loss_chunk_size`` < 1; with the MoE auxiliary loss on, a MoE layer in
            the last stage (choose ``layers_per_stage`` so that the postfix's stage holds no
            MoE layer); everything :class:`roundpipe.RoundPipe` raises.
    """
    if not is_hf_model(model):
        return RoundPipe(model, optim_dtype, **roundpipe_kwargs)
    return HFRoundPipe(model, optim_dtype, loss_chunk_size=loss_chunk_size, **roundpipe_kwargs)
