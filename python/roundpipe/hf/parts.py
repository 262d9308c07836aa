"""Finding the parts of a Hugging Face decoder-only causal LM, and checking once that the
pipeline layers built from them reproduce the model (:func:`check_logits`).

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

:func:`roundpipe.hf.wrap.wrap_model_to_roundpipe` builds the wrapper from them.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from typing import Any, Optional

import torch
from torch import nn

from .attention import describe

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


def _probe(model: nn.Module, part: str, owner: bool = False) -> Any:
    """The module at the first of ``part``'s attribute paths that holds one; with ``owner``,
    ``(module, the module holding it, its attribute name)``."""
    for path in _PATHS[part]:
        obj: Any = model
        parent: Any = None
        for name in path.split("."):
            parent, obj = obj, getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.Module):
            return (obj, parent, path.split(".")[-1]) if owner else obj
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
        layers, self.layers_owner, self.layers_attr = _probe(model, "decoder layers", owner=True)
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
        self.rope_types = self._rope_types()
        # a model whose forward always materialises its causal mask (e.g. Doge, whose attention
        # adds its own dynamic mask onto it and ignores is_causal) needs the same here
        self.mask_kwargs = ({"allow_is_causal_skip": False}
                            if "allow_is_causal_skip=False" in _source(type(self.layers_owner))
                            else {})
        self.lm_head = _probe(model, "output head")
        if not isinstance(self.lm_head, nn.Linear):
            raise TypeError("wrap_model_to_roundpipe: the output head must be an nn.Linear "
                            f"(the chunked loss reads its weight), got {type(self.lm_head).__name__}"
                            " (LoRA on lm_head is not supported)")
        self.mask_fns = [self._mask_fn(i) for i in range(len(self.layers))]

    def _rope_types(self) -> Optional[list]:
        """Per decoder layer, the ``layer_type`` its rotary embedding is computed for, when the
        rotary embedding's forward takes one (Gemma 3, Olmo 3: one rotary base per attention
        type); else None.

        Raises:
            TypeError: the rotary embedding takes ``layer_type`` but the config has no
                ``layer_types``, or its forward takes another required argument.
        """
        params = inspect.signature(self.rotary_emb.forward).parameters
        extra = [n for n, p in list(params.items())[2:]
                 if p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        where = f"the rotary embedding ({type(self.rotary_emb).__name__})"
        if extra and extra != ["layer_type"]:
            raise TypeError(f"wrap_model_to_roundpipe: {where} takes the argument(s) "
                            f"{', '.join(extra)} beyond (x, position_ids); not supported")
        if not extra:
            return None
        kinds = getattr(self.config, "layer_types", None)
        if kinds is None or len(kinds) < len(self.layers):
            raise TypeError(f"wrap_model_to_roundpipe: {where} takes a layer_type, but the "
                            "config has no layer_types for every decoder layer; not supported")
        return list(kinds[:len(self.layers)])

    def _mask_fn(self, i: int):
        from transformers import masking_utils as mu

        kinds = getattr(self.config, "layer_types", None)
        if kinds is not None:
            kind = kinds[i]
        else:
            kind = ("sliding_attention" if getattr(self.config, "sliding_window", None) is not None
                    else "full_attention")
        fn = {"full_attention": mu.create_causal_mask,
              "sliding_attention": mu.create_sliding_window_causal_mask}.get(kind)
        if fn is not None:
            return functools.partial(fn, **self.mask_kwargs) if self.mask_kwargs else fn
        raise TypeError(f"wrap_model_to_roundpipe: decoder layer {i} has attention type "
                        f"{kind!r}; only full_attention and sliding_attention are supported")


def _source(cls: type) -> str:
    """The source of ``cls.forward`` ("" when it cannot be read)."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def disable_gradient_checkpointing(model: nn.Module) -> None:
    """Switches HF's own gradient checkpointing off in every module (RoundPipe already
    recomputes each layer; HF's would recompute a second time)."""
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            m.gradient_checkpointing = False


CHECK_TOKENS = 6   # tokens of the wrap-time test input
CHECK_LAYERS = 2   # decoder layers it runs through


def check_logits(model: nn.Module, parts: Parts, layers: list) -> None:
    """Checks once, at wrap time, that the pipeline layers reproduce the model: the logits of
    ``[prefix, the first CHECK_LAYERS decoder layers, postfix]`` on a fixed input of
    CHECK_TOKENS tokens, and on the same tokens packed as two sequences (``position_ids``
    restarting halfway: each layer's mask or segments as the wrapper builds them), against
    ``model``'s own forward with only those decoder layers, and that the earlier positions'
    logits do not change with the last token (the causal mask). A model the probe accepts but
    that computes something else (a mask built otherwise, a scaling in its forward) is refused
    before it can train. Cost: five forwards of two layers on 6 tokens (no gradient, eval
    mode; the modules' training flags are restored; no random numbers drawn).

    Raises:
        TypeError: the logits differ (by more than 1e-4 of their largest magnitude for a
            float32 head, 3e-2 for a 16-bit one) or the layers fail on the test input; the
            message names the model and the difference.
    """
    name = type(model).__name__
    vocab = int(getattr(parts.config, "vocab_size", None) or parts.lm_head.out_features)
    k = min(CHECK_LAYERS, len(parts.layers))
    ids = ((torch.arange(CHECK_TOKENS) * 7919 + 11) % vocab).unsqueeze(0)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % vocab
    packed = {"input_ids": ids,
              "position_ids": (torch.arange(CHECK_TOKENS) % (CHECK_TOKENS // 2)).unsqueeze(0)}
    training = {m: m.training for m in model.modules()}
    owner, attr = parts.layers_owner, parts.layers_attr
    full = getattr(owner, attr)

    def ours(**inputs) -> torch.Tensor:
        state = layers[0](**inputs, segments=describe(inputs))
        for d in layers[1:1 + k]:
            routing, d.routing = d.routing, None  # no routing statistics for a test input
            try:
                state = d(state)
            finally:
                d.routing = routing
        return layers[-1]({**state, "labels": None}).float()

    def theirs() -> tuple:
        return tuple(model(**inputs, use_cache=False).logits.float()
                     for inputs in ({"input_ids": ids}, packed))

    model.eval()
    try:
        with torch.no_grad():
            try:
                setattr(owner, attr, nn.ModuleList(list(full)[:k]))
                try:
                    expected = theirs()
                finally:
                    setattr(owner, attr, full)
            except Exception:  # a forward that needs all its layers: the whole model
                k = len(parts.layers)
                expected = theirs()
            try:
                a, b, c = ours(input_ids=ids), ours(input_ids=changed), ours(**packed)
            except Exception as e:
                raise TypeError(f"wrap_model_to_roundpipe: {name}'s layers fail when called "
                                f"as RoundPipe calls them ({type(e).__name__}: {e}); this model "
                                "is not supported") from e
    finally:
        for m, flag in training.items():
            m.training = flag
    tol = (1e-4 if parts.lm_head.weight.dtype == torch.float32 else 3e-2) * \
        max(float(expected[0].abs().max()), 1e-6)
    err = max(float((x - y).abs().max()) if x.shape == y.shape else math.inf
              for x, y in zip((a, c), expected))
    leak = float((b[:, :-1] - a[:, :-1]).abs().max())
    if not (err <= tol and leak <= tol):
        why = (" (earlier positions depend on the last token: no causal mask)" if not leak <= tol
               else "")
        raise TypeError(f"wrap_model_to_roundpipe: {name} split into layers does not reproduce "
                        f"its own logits on a test input: largest difference {err:.3g} (allowed "
                        f"{tol:.3g}){why}; this model is not supported")
