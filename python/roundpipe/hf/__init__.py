"""Hugging Face causal LMs in RoundPipe: :func:`wrap_model_to_roundpipe` splits a transformers
(or PEFT) decoder-only model into pipeline layers and gives the wrapper HF semantics.

Modules: ``wrap`` (finding the parts), ``layers`` (prefix, decoder layers, postfix and what
travels between them), ``loss`` (the chunked causal-LM loss), ``moe`` (routing kept for the
recomputation, the whole-batch router auxiliary loss), ``model`` (:class:`HFRoundPipe`),
``save`` (``save_pretrained``), ``kv_cache`` (:class:`PipelineCache`, the KV cache of
generation, a transformers ``Cache``), ``generate`` (``generate`` through the pipeline).
transformers and peft are imported only when an HF model is wrapped (or ``PipelineCache`` is
first read): ``import roundpipe`` does not need them.
"""

from .loss import chunked_cross_entropy_sum
from .model import HFRoundPipe
from .wrap import wrap_model_to_roundpipe


__all__ = ["HFRoundPipe", "PipelineCache", "chunked_cross_entropy_sum", "wrap_model_to_roundpipe"]


def __getattr__(name: str):
    """``PipelineCache`` subclasses transformers' ``Cache``: imported on first use only."""
    if name == "PipelineCache":
        from .kv_cache import PipelineCache

        return PipelineCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
