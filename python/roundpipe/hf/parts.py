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
- MoE routers: the module class HF records as ``router_logits`` (``_can_record_outputs``);
- the dropout the base model's forward applies to the embeddings (:data:`_EMBED_DROPOUTS`:
  Phi's ``embed_dropout``, Starcoder2's ``embedding_dropout``; the other families the wrap
  accepts in transformers 5.24 apply dropout only inside their decoder layers), which the
  prefix applies as the forward does (:class:`EmbedDropout`).

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
# the dropouts a base model's forward applies to the embeddings before its first decoder layer,
# by the base model's attribute that holds them, and the config attribute that sets it
_EMBED_DROPOUTS = (("embed_dropout", "embd_pdrop"),              # Phi: an nn.Dropout
                   ("embedding_dropout", "embedding_dropout"))   # Starcoder2: a float p


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
        self._refuse_rope_per_layer()
        self.embed_dropout = self._embed_dropout()
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

    def _refuse_rope_per_layer(self) -> None:
        """Raises ``TypeError`` for a config whose ``layer_rope_theta`` gives a decoder layer a
        rotary base other than the model's (GraniteSWA: one rotary embedding per base, ``0``
        for a layer without one), which the model's forward chooses per layer and the single
        rotary embedding of this layout cannot."""
        thetas = getattr(self.config, "layer_rope_theta", None)
        if thetas is None:
            return
        base = (getattr(self.config, "rope_parameters", None) or {}).get(
            "rope_theta", getattr(self.config, "rope_theta", None))
        if any(t != base for t in list(thetas)[:len(self.layers)]):
            raise TypeError("wrap_model_to_roundpipe: the config sets config.layer_rope_theta "
                            f"({list(thetas)[:len(self.layers)]}), a rotary base per decoder layer "
                            f"(0: none) other than the model's ({base}), which the model's forward "
                            "chooses per layer; not supported")

    def _embed_dropout(self) -> Optional["EmbedDropout"]:
        """The dropout the base model's forward applies to the embeddings (see
        :data:`_EMBED_DROPOUTS`), as it applies it, or None."""
        owner = self.layers_owner
        for attr, config_attr in _EMBED_DROPOUTS:
            held = getattr(owner, attr, None)
            if isinstance(held, nn.Dropout) or (isinstance(held, (int, float))
                                                and not isinstance(held, bool)):
                return EmbedDropout(owner, attr, config_attr)
        return None

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


class EmbedDropout:
    """The dropout a base model's forward applies to the embeddings, applied as it applies it:
    ``owner.<attr>`` is an ``nn.Dropout`` (Phi's ``embed_dropout``), called, or a float ``p``
    (Starcoder2's ``embedding_dropout``), ``F.dropout(x, p, training=owner.training)``; read
    at each call, so a change of the model's attribute or mode holds. Not an ``nn.Module``:
    it holds the base model without making it a submodule of the prefix.

    Attributes:
        config_attr: the config attribute that sets it (for messages).
    """

    def __init__(self, owner: nn.Module, attr: str, config_attr: str) -> None:
        self._owner, self._attr, self.config_attr = owner, attr, config_attr

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        held = getattr(self._owner, self._attr)
        if isinstance(held, nn.Module):
            return held(x)
        return nn.functional.dropout(x, p=held, training=self._owner.training)


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


def _dropouts(model: nn.Module, config: Any) -> list[str]:
    """What makes ``model``'s training forward random: its config's dropout settings above 0
    (``name=value``, e.g. ``embedding_dropout=0.1``) and, when none, its ``nn.Dropout``
    modules with ``p > 0``; empty when it has no dropout."""
    found = [f"{k}={v}" for k, v in sorted(vars(config).items())
             if "drop" in k.lower() and isinstance(v, (int, float)) and not isinstance(v, bool)
             and v > 0]
    if not found:
        found = sorted({f"nn.Dropout(p={m.p})" for m in model.modules()
                        if isinstance(m, nn.Dropout) and m.p > 0})
    return found


def check_logits(model: nn.Module, parts: Parts, layers: list) -> None:
    """Checks once, at wrap time, that the pipeline layers reproduce the model: the logits of
    ``[prefix, the first CHECK_LAYERS decoder layers, postfix]`` on a fixed input of
    CHECK_TOKENS tokens, and on the same tokens packed as two sequences (``position_ids``
    restarting halfway: each layer's mask or segments as the wrapper builds them), against
    ``model``'s own forward with only those decoder layers, and that the earlier positions'
    logits do not change with the last token (the causal mask). Where the model has dropout
    (:func:`_dropouts`), the same comparison in training mode too, every part under the seed
    the pipeline gives it (``roundpipe.layer_seed(seed, layer, 0)``: the model's forward
    seeded so by hooks on its embeddings and decoder layers), so a dropout (or other
    randomness) the model's forward applies outside its decoder layers and the layers lack is
    seen. A model the probe accepts but that computes something else (a mask built otherwise,
    a scaling or a dropout in its forward) is refused before it can train. Cost: five forwards
    of two layers on 6 tokens (seven with dropout; no gradient; the modules' training flags,
    HF's gradient checkpointing flags and torch's random number generator are restored).

    Raises:
        TypeError: the logits differ (by more than 1e-4 of their largest magnitude for a
            float32 head, 3e-2 for a 16-bit one) or the layers fail on the test input; the
            message names the model and the difference, and in training mode the config's
            dropout settings.
    """
    from ..pipeline.execute import layer_seed

    name = type(model).__name__
    vocab = int(getattr(parts.config, "vocab_size", None) or parts.lm_head.out_features)
    k = min(CHECK_LAYERS, len(parts.layers))
    ids = ((torch.arange(CHECK_TOKENS) * 7919 + 11) % vocab).unsqueeze(0)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % vocab
    packed = {"input_ids": ids,
              "position_ids": (torch.arange(CHECK_TOKENS) % (CHECK_TOKENS // 2)).unsqueeze(0)}
    training = {m: m.training for m in model.modules()}
    checkpointing = [m for m in model.modules()
                     if getattr(m, "gradient_checkpointing", False) is True]
    owner, attr = parts.layers_owner, parts.layers_attr
    full = getattr(owner, attr)
    dropouts = _dropouts(model, parts.config)
    seed = 12345

    def ours(seeded: bool = False, **inputs) -> torch.Tensor:
        if seeded:
            torch.manual_seed(layer_seed(seed, 0, 0))
        state = layers[0](**inputs, segments=describe(inputs))
        for i, d in enumerate(layers[1:1 + k], 1):
            routing, d.routing = d.routing, None  # no routing statistics for a test input
            try:
                if seeded:
                    torch.manual_seed(layer_seed(seed, i, 0))
                state = d(state)
            finally:
                d.routing = routing
        if seeded:
            torch.manual_seed(layer_seed(seed, len(parts.layers) + 1, 0))
        return layers[-1]({**state, "labels": None}).float()

    def theirs(inputs: dict, seeded: bool = False) -> torch.Tensor:
        """The model's forward on its first ``k`` decoder layers (all of them when it needs
        them); ``seeded``: each part seeded as the pipeline seeds it."""
        nonlocal k
        hooks = []
        if seeded:
            def at(i):
                def hook(module, args) -> None:
                    torch.manual_seed(layer_seed(seed, i, 0))
                return hook
            hooks = [m.register_forward_pre_hook(at(i)) for i, m in
                     enumerate([parts.embed_tokens] + parts.layers + [parts.norm])]
        try:
            try:
                setattr(owner, attr, nn.ModuleList(list(full)[:k]))
                try:
                    return model(**inputs, use_cache=False).logits.float()
                finally:
                    setattr(owner, attr, full)
            except Exception:  # a forward that needs all its layers: the whole model
                k = len(parts.layers)
                return model(**inputs, use_cache=False).logits.float()
        finally:
            for h in hooks:
                h.remove()

    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            before = k
            want, want_packed = theirs({"input_ids": ids}), theirs(packed)
            if k != before:  # the packed forward needed every layer: the first one too
                want = theirs({"input_ids": ids})
            try:
                a, b, c = ours(input_ids=ids), ours(input_ids=changed), ours(**packed)
            except Exception as e:
                raise TypeError(f"wrap_model_to_roundpipe: {name}'s layers fail when called "
                                f"as RoundPipe calls them ({type(e).__name__}: {e}); this model "
                                "is not supported") from e
            if dropouts:
                model.train()
                for m in checkpointing:  # HF's own recomputation: not what is compared
                    m.gradient_checkpointing = False
                want_train = theirs({"input_ids": ids}, True)
                a_train = ours(True, input_ids=ids)
    finally:
        for m, flag in training.items():
            m.training = flag
        for m in checkpointing:
            m.gradient_checkpointing = True

    def err_tol(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
        tol = (1e-4 if parts.lm_head.weight.dtype == torch.float32 else 3e-2) * \
            max(float(ref.abs().max()), 1e-6)
        return (float((got - ref).abs().max()) if got.shape == ref.shape else math.inf), tol

    err, tol = err_tol(a, want)
    err = max(err, err_tol(c, want_packed)[0])
    leak = float((b[:, :-1] - a[:, :-1]).abs().max())
    if not (err <= tol and leak <= tol):
        why = (" (earlier positions depend on the last token: no causal mask)" if not leak <= tol
               else "")
        raise TypeError(f"wrap_model_to_roundpipe: {name} split into layers does not reproduce "
                        f"its own logits on a test input: largest difference {err:.3g} (allowed "
                        f"{tol:.3g}){why}; this model is not supported")
    if dropouts:
        err, tol = err_tol(a_train, want_train)
        if not err <= tol:
            raise TypeError(
                f"wrap_model_to_roundpipe: {name} split into layers does not reproduce its own "
                f"logits in training mode (with dropout: {', '.join(dropouts)}) on a test "
                f"input under a fixed seed: largest difference {err:.3g} (allowed {tol:.3g}), "
                "though it does in eval mode: its forward applies a dropout (or other "
                "randomness) outside its decoder layers that RoundPipe does not apply; set that "
                "config value to 0 (before creating the model) to train it, or use a supported "
                "family")
