"""Generation through the pipeline: ``generate`` of a wrapped Hugging Face model with
transformers' own ``GenerationMixin`` semantics, and the forward with a KV cache it drives.

``HFRoundPipe.generate(...)`` runs transformers' ``generate`` of the wrapped model itself
(greedy search, sampling, logits processors, stopping criteria, ``streamer``,
``num_return_sequences``, ``generation_config``, ... all are transformers' code), with one
change: each forward call it makes runs as one pass of the pipeline (:func:`cached_forward`)
instead of the model's own forward. So a decoding step streams every stage's weights once
for the whole batch, each decoder layer reads and extends its part of a
:class:`~roundpipe.hf.kv_cache.PipelineCache` (host memory by default), and the logits of the
last position come back to the host, where transformers picks the next tokens exactly as it
would. The prompt is prefilled in one pass too, in chunks of ``prefill_chunk_size`` positions
(transformers' ``GenerationConfig.prefill_chunk_size``: the same chunks, but the weights
stream once for all of them).

Around it: the wrapper's call lock is held for the whole generation (no training call of
another thread runs in between, and none waits on a lock generate does not own); pending
optimizer work is finished first (:meth:`~roundpipe.RoundPipe.synchronize`: generation uses
the current weights); every module is in eval mode while it runs and gets its own mode back
after; nothing else of the training state is touched (gradients accumulated since the last
step, optimizer state, loss scaler, the RNG: the passes draw no random numbers, so sampling
with a seed equals transformers').
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from ..pipeline.fetch import Carry
from ..pipeline.stage import AutocastState, PassSpec
from .attention import describe
from .kv_cache import KV_CACHE_MODES, MicrobatchKV, PipelineCache

# generate() arguments that need a cache this pipeline does not have
_REFUSED = {"assistant_model": "assisted decoding", "custom_generate": "custom_generate"}


def windows_of(model) -> list:
    """Per decoder layer, its sliding window (None: full attention)."""
    return [layer.sliding_window for layer in model._layers[1:-1]]


def new_cache(model, kv_cache: str = "host", num_microbatch: int = 1,
              prefill_chunk_size: Optional[int] = None, capacity_hint: int = 0) -> PipelineCache:
    """An empty :class:`PipelineCache` for ``model`` (an :class:`~roundpipe.hf.HFRoundPipe`)."""
    return PipelineCache(windows_of(model), kv_cache, num_microbatch, prefill_chunk_size,
                         capacity_hint)


def _rows(t: Optional[torch.Tensor], r0: int, r1: int, batch: int):
    """Rows ``[r0, r1)`` of a per-row tensor; a tensor with one row for all (or no batch
    dimension) is shared."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch:
        return t
    return t[r0:r1]


def cached_forward(model, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                   inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                   num_microbatch: Optional[int] = None, carry: Optional[Carry] = None,
                   upload_ahead: bool = False, **kwargs):
    """One pass of ``model`` (an :class:`~roundpipe.hf.HFRoundPipe`) as the model's own
    ``forward(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
    use_cache, logits_to_keep)`` computes it, without autograd; the caller holds the
    wrapper's call lock.

    With a cache (``cache`` given, or ``use_cache=True``: a new host cache), the new positions
    are appended to it layer by layer; ``position_ids`` default to the positions after the
    cached ones, ``attention_mask`` (2D) covers cached and new positions. The batch splits
    into the cache's microbatches of rows (fixed by its first pass), each prefilled in chunks
    of its ``prefill_chunk_size``. Without one, the pass is the plain inference pass in
    ``num_microbatch`` microbatches (default 1).

    ``carry`` / ``upload_ahead`` (generate's passes): uploads handed between passes, see
    :class:`roundpipe.pipeline.stage.PassSpec`.

    Returns a transformers ``CausalLMOutputWithPast`` (``MoeCausalLMOutputWithPast`` for MoE
    models): ``logits`` ``(batch, kept positions, vocab)`` on the host in the model dtype,
    the cache (its ``cache`` field), and with ``labels`` HF's loss of those logits.

    Raises:
        TypeError: ``cache`` is not a :class:`PipelineCache`; an unsupported keyword
            (``output_attentions=True``, ``output_hidden_states=True``, anything the model's
            forward would not take).
        ValueError: not exactly one of ``input_ids`` and ``inputs_embeds``; a cache made for
            another batch size; ``labels`` with a cache or with ``logits_to_keep``; a
            ``cache_position`` (accepted as older transformers pass it) other than the
            positions right after the cached ones.
    """
    for key in ("return_dict", "output_router_logits"):
        kwargs.pop(key, None)
    cache_position = kwargs.pop("cache_position", None)
    for key in ("output_attentions", "output_hidden_states"):
        if kwargs.pop(key, None):
            raise TypeError(f"RoundPipe.forward: {key}=True is not supported (the pipeline "
                            "returns the logits only)")
    if kwargs:
        raise TypeError(f"RoundPipe.forward: unsupported argument(s) {', '.join(sorted(kwargs))}")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("RoundPipe.forward: give exactly one of input_ids and inputs_embeds")
    if cache is None and use_cache:
        cache = new_cache(model, num_microbatch=num_microbatch or 1)
    if cache is not None and not isinstance(cache, PipelineCache):
        raise TypeError("RoundPipe.forward: cache must be a roundpipe.hf.PipelineCache (made "
                        "by generate or by forward(..., use_cache=True)), got "
                        f"{type(cache).__name__}; a transformers cache lives on one device")
    if labels is not None and (cache is not None or not (isinstance(logits_to_keep, int)
                                                          and logits_to_keep == 0)):
        raise ValueError("RoundPipe.forward: labels need the logits of every position, without "
                         "a cache")
    x = input_ids if input_ids is not None else inputs_embeds
    batch, seq = x.shape[:2]
    if cache_position is not None:  # transformers < 5: where the new positions go; implied here
        past = cache.get_seq_length() if cache is not None else 0
        if not torch.equal(torch.as_tensor(cache_position).cpu(), torch.arange(past, past + seq)):
            raise ValueError(f"RoundPipe.forward: cache_position must be the {seq} positions "
                             f"after the {past} cached ones (new positions are appended)")
    key = "input_ids" if input_ids is not None else "inputs_embeds"
    microbatches = []
    if cache is None:
        n = max(1, min(num_microbatch or 1, batch))
        sizes = [len(c) for c in torch.tensor_split(torch.arange(batch), n)]
        bounds = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(n)]
        for r0, r1 in bounds:
            kw = {key: x[r0:r1], "logits_to_keep": _rows(logits_to_keep, r0, r1, batch)}
            for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids),
                            ("labels", labels)):
                if t is not None:
                    kw[name] = _rows(t, r0, r1, batch)
            kw["segments"] = describe(kw)
            microbatches.append(((), kw, None))
        last = [True] * n
    else:
        cache.start_pass()
        bounds = cache.bind(batch)
        past = cache.get_seq_length()
        step = cache.prefill_chunk_size or seq
        chunks = [(a, min(a + step, seq)) for a in range(0, seq, step)] or [(0, 0)]
        if position_ids is None:
            position_ids = torch.arange(past, past + seq).unsqueeze(0)
        last = []
        for part, (r0, r1) in enumerate(bounds):
            kv = MicrobatchKV(cache, part)
            for c, (a, e) in enumerate(chunks):
                final = c == len(chunks) - 1
                kw = {key: x[r0:r1, a:e], "kv": kv,
                      "position_ids": _rows(position_ids, r0, r1, batch)[..., a:e],
                      "logits_to_keep": _rows(logits_to_keep, r0, r1, batch) if final else None}
                if attention_mask is not None:
                    kw["attention_mask"] = _rows(attention_mask, r0, r1, batch)[:, :past + e]
                kw["segments"] = describe(kw)
                microbatches.append(((), kw, None))
                last.append(final)
    spec = PassSpec(microbatches, False, call_seed=0, autocast=AutocastState.capture(),
                    carry=carry, upload_ahead=upload_ahead)
    try:
        run = model._run_pass(spec)
    finally:
        spec.store.clear()
        if cache is not None:
            cache.end_pass()
    outs = [run.acts[-1][m].get(None)[0] for m in range(len(microbatches))]
    logits = torch.cat([o for o, final in zip(outs, last) if final], dim=0)
    return _output(model, logits, labels, cache)


def _output(model, logits: torch.Tensor, labels, cache):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    cls = CausalLMOutputWithPast if model._routing is None else MoeCausalLMOutputWithPast
    fields = getattr(cls, "__dataclass_fields__", {})
    out = {"logits": logits}
    if cache is not None:
        out["cache" if "cache" in fields else "past_key_values"] = cache
    if labels is not None:
        hf = model.hf_model
        out["loss"] = hf.loss_function(logits, labels, vocab_size=hf.config.vocab_size)
    return cls(**out)


def _cache_kwarg() -> str:
    """The keyword transformers' ``generate`` keeps its cache under: ``"cache"`` where its
    ``ALL_CACHE_NAMES`` starts with it (the rename of 5.24), else ``"past_key_values"``
    (5.9 - 5.23). Given the other name, ``generate`` would make a ``DynamicCache`` of its own
    and pass that to the forward instead."""
    from transformers.generation import utils

    names = getattr(utils, "ALL_CACHE_NAMES", None) or ["past_key_values"]
    return names[0]


def _forward_for(model, carry: Carry, calls: Optional[int]):
    """The function ``generate`` puts in place of the wrapped transformers model's forward:
    the signature transformers inspects (``attention_mask``, ``position_ids``,
    ``logits_to_keep``, ``cache``) and :func:`cached_forward` behind it. Each pass but the
    last of the ``calls`` expected (None: unknown) uploads the first stage of the next one as
    it ends (``carry``), so that copy overlaps transformers' choice of the next tokens."""
    done = [0]

    def forward(input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if "past_key_values" in kwargs:
            cache = kwargs.pop("past_key_values")
        done[0] += 1
        out = cached_forward(model, input_ids, attention_mask, position_ids, cache,
                             inputs_embeds, labels, use_cache, logits_to_keep, carry=carry,
                             upload_ahead=calls is None or done[0] < calls, **kwargs)
        model._stats.add("generate_steps", 1)  # one new token for every row
        model._stats.add("generated_tokens", out.logits.shape[0])
        return out

    return forward


def _check_device_kv_fits(model, rows: int, positions: int) -> None:
    """``kv_cache="device"`` on CUDA: the keys and values of ``rows`` rows and ``positions``
    positions of each device's decoder layers must fit in its free memory next to two stages
    of weights (an estimate from the config, checked before anything runs).

    Raises:
        ValueError: they do not fit on some device (the message gives both sizes).
    """
    if model.devices[0].type != "cuda":
        return
    config = model.hf_model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(p for p in model.module.parameters() if p.is_floating_point()).element_size()
    per_layer = 2 * rows * heads * dim * positions * itemsize
    need: dict = {}
    for stage in model._stages:
        decoders = sum(1 for li in stage.layers if 0 < li < len(model._layers) - 1)
        need[stage.device] = need.get(stage.device, 0) + decoders * per_layer
    weights = 2 * max(model._stage_bytes)
    for device, size in need.items():
        free = torch.cuda.mem_get_info(device)[0]
        if size + weights > free:
            raise ValueError("RoundPipe.generate: kv_cache='device' needs about "
                             f"{size / 2**30:.2f} GiB of keys and values on {device} ({rows} rows x {positions} "
                             f"positions) besides {weights / 2**30:.2f} GiB of weights, but "
                             f"{free / 2**30:.2f} GiB are free; use kv_cache='host'")


def _setting(name: str, kwargs: dict, generation_config, default_config) -> Any:
    """A generation setting as transformers resolves it: the keyword argument, else the
    ``generation_config`` given, else the model's."""
    if name in kwargs:
        return kwargs[name]
    for config in (generation_config, default_config):
        value = getattr(config, name, None) if config is not None else None
        if value is not None:
            return value
    return None


def generate(model, inputs: Optional[torch.Tensor] = None, generation_config=None, *,
             kv_cache: str = "host", num_microbatch: Optional[int] = None, **kwargs):
    """See :meth:`roundpipe.hf.HFRoundPipe.generate`."""
    if kv_cache not in KV_CACHE_MODES:
        raise ValueError(f"RoundPipe.generate: kv_cache must be one of {KV_CACHE_MODES}, got "
                         f"{kv_cache!r}")
    if num_microbatch is not None and (not isinstance(num_microbatch, int)
                                       or isinstance(num_microbatch, bool) or num_microbatch < 1):
        raise ValueError(f"RoundPipe.generate: num_microbatch must be an int >= 1, got "
                         f"{num_microbatch!r}")
    for key, what in _REFUSED.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"RoundPipe.generate: {what} ({key}=) is not supported")
    hf = model.hf_model
    default = hf.generation_config
    num_beams = _setting("num_beams", kwargs, generation_config, default)
    if num_beams is not None and num_beams > 1:
        raise ValueError(f"RoundPipe.generate: beam search (num_beams={num_beams}) is not "
                         "supported; greedy search and sampling are")
    implementation = _setting("cache_implementation", kwargs, generation_config, default)
    if implementation not in (None, "dynamic"):
        raise ValueError(f"RoundPipe.generate: cache_implementation={implementation!r} is not "
                         "supported (the pipeline has its own KV cache, see kv_cache=)")
    chunk = _setting("prefill_chunk_size", kwargs, generation_config, default)
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise ValueError("RoundPipe.generate: prefill_chunk_size must be an int >= 1, got "
                         f"{chunk!r}")
    use_cache = _setting("use_cache", kwargs, generation_config, default)
    given = kwargs.pop("cache", None)
    if "past_key_values" in kwargs:
        given = kwargs.pop("past_key_values")
    if given is not None and not isinstance(given, PipelineCache):
        raise TypeError("RoundPipe.generate: cache must be a roundpipe.hf.PipelineCache (from "
                        f"an earlier generate or forward), got {type(given).__name__}")
    if chunk is not None and use_cache is False:
        raise ValueError("RoundPipe.generate: prefill_chunk_size needs use_cache (chunks are "
                         "prefilled through the cache)")
    # the pipeline prefills the chunks in one pass: transformers must not split the prompt
    if generation_config is not None and generation_config.prefill_chunk_size is not None:
        generation_config = copy.deepcopy(generation_config)
        generation_config.prefill_chunk_size = None
    if "prefill_chunk_size" in kwargs or default.prefill_chunk_size is not None:
        kwargs["prefill_chunk_size"] = None
    prompt = inputs if inputs is not None else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    new_tokens = _setting("max_new_tokens", kwargs, generation_config, default)
    hint = _setting("max_length", kwargs, generation_config, default) or 0
    if new_tokens is not None and isinstance(prompt, torch.Tensor) and prompt.dim() >= 2:
        hint = prompt.shape[1] + new_tokens
    if given is None and use_cache is not False and kv_cache == "device" \
            and isinstance(prompt, torch.Tensor):
        rows = prompt.shape[0] * (_setting("num_return_sequences", kwargs, generation_config,
                                           default) or 1)
        _check_device_kv_fits(model, rows, hint)
    with model._call("generate"):
        model.synchronize()
        cache = given
        if cache is None and use_cache is not False:
            cache = new_cache(model, kv_cache, num_microbatch or 1, chunk, hint)
        elif cache is not None:
            cache.prefill_chunk_size = chunk
        if cache is not None:
            kwargs[_cache_kwarg()] = cache
        modes = [(m, m.training) for m in model.module.modules()]
        previous = hf.__dict__.get("forward")
        carry = Carry()  # the next pass's first uploads; dropped at the end
        hf.forward = _forward_for(model, carry,
                                  new_tokens if isinstance(new_tokens, int) else None)
        try:
            model.module.eval()
            target = model.peft_model if model.peft_model is not None else hf
            return target.generate(inputs, generation_config=generation_config, **kwargs)
        finally:
            carry.drop()  # waits for the copies: the caller may free or change the model next
            if previous is None:
                del hf.forward
            else:
                hf.forward = previous
            for m, mode in modes:
                m.training = mode


__all__ = ["cached_forward", "generate", "new_cache"]
