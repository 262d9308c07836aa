"""Hugging Face causal LMs in RoundPipe: :func:`wrap_model_to_roundpipe` splits a transformers
(or PEFT) decoder-only model into pipeline layers and gives the wrapper HF semantics.

Modules: ``parts`` (finding the parts, the wrap-time check), ``wrap`` (the factory),
``layers`` (prefix, decoder layers, postfix and what travels between them), ``loss`` (the
chunked causal-LM loss), ``moe`` (routing kept for the recomputation, the whole-batch router
auxiliary loss), ``model`` (:class:`HFRoundPipe`), ``save`` (``save_pretrained``), ``load``
(:func:`from_pretrained`: a safetensors checkpoint read tensor by tensor, its frozen base
quantized as it is read), ``kv_cache`` (:class:`PipelineCache`, the KV cache of generation, a
transformers ``Cache``), ``generate`` (``generate`` through the pipeline),
``trainer`` (:class:`RoundPipeTrainer`, a transformers ``Trainer``) and ``sft``
(:class:`RoundPipeSFTTrainer`, a TRL ``SFTTrainer``). transformers and peft are imported only
when an HF model is wrapped (or ``PipelineCache`` is first read), the trainers (and trl) only
when one of them is first named: ``import roundpipe`` does not need them.
"""

from .load import from_pretrained
from .loss import chunked_cross_entropy_sum
from .model import HFRoundPipe
from .wrap import wrap_model_to_roundpipe

_LAZY = {"PipelineCache": "kv_cache", "RoundPipeTrainer": "trainer",
         "RoundPipeTrainerMixin": "trainer", "RoundPipeSFTTrainer": "sft"}

__all__ = ["HFRoundPipe", "PipelineCache", "RoundPipeSFTTrainer", "RoundPipeTrainer",
           "RoundPipeTrainerMixin", "chunked_cross_entropy_sum", "from_pretrained",
           "wrap_model_to_roundpipe"]


def __getattr__(name: str):
    """``PipelineCache`` (a transformers ``Cache``), ``RoundPipeTrainer`` /
    ``RoundPipeSFTTrainer`` (transformers' Trainer, and trl): imported on first use only."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
