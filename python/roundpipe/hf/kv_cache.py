"""The KV cache of generation through the pipeline: each decoder layer's keys and values on the
host (or on the layer's device), read and extended by that layer once per pass.

A pass of generation streams every stage's weights once for the whole batch (see
:mod:`roundpipe.hf.generate`); each decoder layer, on its device, needs the keys and values it
cached in earlier passes. :class:`PipelineCache` keeps them, per decoder layer and per
*part* (the rows of one microbatch), in one buffer of shape ``(capacity, 2, rows, kv_heads,
head_dim)`` in the model dtype: position-major, so the cached positions ``[start, length)``
are one contiguous block (one copy up; a pass's new positions are one contiguous block down).

In a pass, each layer gets a :class:`LayerView` of its part, which is what the transformers
decoder layer sees as its ``cache``: ``update(k, v, ...)`` uploads the cached positions the
layer attends to (``kv_cache="host"``; with ``"device"`` the buffer already is on the
device), returns them concatenated with the new ones exactly as transformers' own
``DynamicLayer`` / ``DynamicSlidingWindowLayer`` return them (same values, same contiguous
layout: the attention computes the same numbers), and writes the new positions down. The
mask sizes (``get_mask_sizes``, ``get_query_offset``) are those of transformers' layers too:
a full-attention layer attends to every cached position, a sliding-window layer of window
``W`` to the last ``W - 1`` (its mask offset moves with them).

Prefill in chunks: a part's chunks are successive microbatches of one pass; each layer runs
them in order, so chunk ``c`` reads the positions chunks ``< c`` wrote in the same pass (on
CUDA its upload waits for their download's event).

Bytes (``pipeline_stats()``, ``kv_cache="host"``): per layer, part and pass, the cached
positions attended to go up once and the new positions come down once; ``kv_floor_bytes``
counts exactly that from the lengths.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from ..transfer import current_io

try:  # transformers is needed only when an HF model is wrapped
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError:  # pragma: no cover - the wrapper refuses HF models without it anyway
    Cache, CacheLayerMixin = object, object

KV_CACHE_MODES = ("host", "device")


class _Part:
    """One microbatch's rows of one layer: the buffer, the positions written, the event of the
    last download into it (CUDA; None when done), the pass it was last updated in, and the
    upload of its attended positions made ahead by the layer before (see
    :meth:`LayerView.update`): ``(buffer, start, length, device tensor, event, io)`` or None."""

    __slots__ = ("buf", "length", "pending", "keep", "updated_in", "ahead")

    def __init__(self) -> None:
        self.buf: Optional[torch.Tensor] = None
        self.length = 0
        self.pending: Any = None
        self.keep: list = []
        self.updated_in = -1
        self.ahead: Optional[tuple] = None


class PipelineLayer(CacheLayerMixin):
    """One decoder layer's cache in a :class:`PipelineCache`: its parts (one per microbatch of
    rows). ``sliding_window``: the layer's window ``W`` (None: full attention)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, sliding_window: Optional[int] = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.parts: list[_Part] = []
        self.io: Any = None  # weakref to the device I/O this layer ran on in the last pass

    # --- what transformers asks a cache layer --------------------------------------------

    def lazy_initialization(self, key_states, value_states) -> None:  # noqa: D401 - HF hook
        """Nothing to do: the parts are allocated when the pipeline first writes them."""

    def update(self, *args, **kwargs):
        raise TypeError("PipelineCache: layers are updated through the pipeline (a wrapped "
                        "model's forward or generate), not directly")

    def get_seq_length(self) -> int:
        """Positions cached (the same for every part)."""
        return self.parts[0].length if self.parts else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for ``query_length`` new positions, as transformers'
        ``DynamicLayer`` / ``DynamicSlidingWindowLayer``."""
        return mask_sizes(self.get_seq_length(), query_length, self.sliding_window)

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    get_max_cache_shape = get_max_length  # its name before transformers 5.13

    def reset(self) -> None:
        self.parts = []

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("PipelineCache: beam search is not supported")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PipelineCache: cropping (assisted decoding) is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PipelineCache: changing the batch of a cache is not supported")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("PipelineCache: changing the batch of a cache is not supported")


def mask_sizes(length: int, query_length: int, window: Optional[int]) -> tuple[int, int]:
    """``(kv_length, kv_offset)`` of a layer with ``length`` cached positions (see
    :meth:`PipelineLayer.get_mask_sizes`)."""
    if window is None:
        return length + query_length, 0
    offset = max(length - window + 1, 0)
    if length >= window:
        return window - 1 + query_length, offset
    return length + query_length, offset


def attended_start(length: int, window: Optional[int]) -> int:
    """The first cached position a layer attends to: 0, or the start of the last ``W - 1``
    positions for a sliding window ``W`` (what ``DynamicSlidingWindowLayer`` keeps)."""
    if window is None or window <= 1:
        return 0
    return max(0, length - (window - 1))


class PipelineCache(Cache):
    """The KV cache of a wrapped Hugging Face model (:class:`~roundpipe.hf.HFRoundPipe`), a
    transformers ``Cache`` whose layers live on the host (``kv_cache="host"``) or each on its
    layer's device (``"device"``); made by ``generate`` or by ``forward(..., use_cache=True)``
    and passed back as ``cache=`` to continue. See the module docstring.

    Shapes: per decoder layer and microbatch of rows, ``(capacity, 2, rows, kv_heads,
    head_dim)`` in the dtype of the keys the model computes (the model dtype, or the autocast
    dtype); ``capacity`` starts at ``capacity_hint`` positions (or what the first pass needs)
    and doubles when a pass would exceed it.

    Args:
        windows: per decoder layer, its sliding window (None: full attention).
        kv_cache: ``"host"`` or ``"device"``.
        num_microbatch: microbatches of rows per pass (fixed by the first pass: at most the
            batch size; the rows split as ``torch.tensor_split``).
        prefill_chunk_size: a pass over more new positions than this runs them in chunks of
            this many (successive microbatches of the pass; None: one chunk).
        capacity_hint: positions to allocate for at first (e.g. prompt + new tokens).

    Raises:
        ValueError: ``kv_cache`` not one of ``"host"``/``"device"``, ``num_microbatch`` or
            ``prefill_chunk_size`` not an int >= 1 (or None).
    """

    def __init__(self, windows: list, kv_cache: str = "host", num_microbatch: int = 1,
                 prefill_chunk_size: Optional[int] = None, capacity_hint: int = 0) -> None:
        if kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_MODES}, got {kv_cache!r}")
        _check_count("num_microbatch", num_microbatch)
        if prefill_chunk_size is not None:
            _check_count("prefill_chunk_size", prefill_chunk_size)
        super().__init__(layers=[PipelineLayer(w) for w in windows])
        self.kv_cache = kv_cache
        self.num_microbatch = num_microbatch
        self.prefill_chunk_size = prefill_chunk_size
        self.capacity_hint = int(capacity_hint)
        self.rows: Optional[list[tuple[int, int]]] = None
        self.retired: list = []  # buffers replaced in this pass (copies may still read them)
        self.passes = 0  # passes started

    @property
    def on_device(self) -> bool:
        return self.kv_cache == "device"

    def start_pass(self) -> None:
        """A pass of the pipeline starts reading and extending the cache."""
        self.passes += 1
        self.retired = []

    def end_pass(self) -> None:
        """The pass is over (done or failed): buffers it replaced and uploads made ahead that
        no layer took are released."""
        self.retired = []
        for layer in self.layers:
            for part in layer.parts:
                part.ahead = None

    def bind(self, batch: int) -> list[tuple[int, int]]:
        """The row ranges of the microbatches for a pass over ``batch`` rows (fixed by the
        first pass).

        Raises:
            ValueError: a later pass has another batch size.
        """
        if self.rows is None:
            n = max(1, min(self.num_microbatch, batch))
            sizes = [len(c) for c in torch.tensor_split(torch.arange(batch), n)]
            starts = [sum(sizes[:i]) for i in range(n)]
            self.rows = [(s, s + k) for s, k in zip(starts, sizes)]
            for layer in self.layers:
                layer.parts = [_Part() for _ in self.rows]
        elif self.rows[-1][1] != batch:
            raise ValueError(f"PipelineCache: this cache holds {self.rows[-1][1]} rows; a pass "
                             f"over {batch} rows cannot use it")
        return self.rows

    def key_value(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every cached position of a layer as ``(keys, values)``, each ``(batch, kv_heads,
        length, head_dim)`` on the host (a copy; a sliding-window layer keeps every position,
        of which it attends to the last ``W - 1``)."""
        parts = self.layers[layer_idx].parts
        if not parts or parts[0].buf is None:
            raise ValueError(f"PipelineCache: layer {layer_idx} holds nothing yet")
        blocks = [part.buf[:part.length].to("cpu").permute(1, 2, 3, 0, 4) for part in parts]
        both = torch.cat(blocks, dim=1)  # (2, batch, heads, length, dim)
        return both[0].contiguous(), both[1].contiguous()


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class MicrobatchKV:
    """What travels with a microbatch's state through the pipeline (not a tensor: the
    transfers pass it along as it is): the cache and which part of it the microbatch's rows
    are. Each decoder layer asks it for its :class:`LayerView`."""

    def __init__(self, cache: PipelineCache, part: int) -> None:
        self.cache = cache
        self.part = part

    def view(self, layer_idx: int) -> "LayerView":
        return LayerView(self.cache, self.cache.layers[layer_idx], self.part, layer_idx)


class LayerView:
    """One decoder layer's cache for one microbatch in one pass: what the transformers layer
    receives as ``cache`` (it calls :meth:`update`; the mask functions call
    :meth:`get_mask_sizes` / :meth:`get_query_offset` before it, on the same lengths as
    transformers' own cache). The ``layer_idx`` arguments transformers passes are ignored:
    the view is its layer's."""

    is_compileable = False

    def __init__(self, cache: PipelineCache, layer: PipelineLayer, part: int,
                 index: int = 0) -> None:
        self.cache, self.layer, self.part = cache, layer, layer.parts[part]
        self.part_index, self.index = part, index

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.part.length

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.part.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return mask_sizes(self.part.length, query_length, self.layer.sliding_window)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: Any = None,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new ``(rows, kv_heads, n, head_dim)`` keys and values and returns the
        keys and values the layer attends to, ``(rows, kv_heads, attended + n, head_dim)``
        contiguous on the layer's device (see the module docstring)."""
        io = current_io()
        part, window = self.part, self.layer.sliding_window
        rows, heads, n, dim = key_states.shape
        length = part.length
        start = attended_start(length, window)
        first = part.updated_in != self.cache.passes  # the part's first chunk in this pass
        part.updated_in = self.cache.passes
        ahead, part.ahead = part.ahead, None
        # uploaded ahead from this buffer (before _reserve may move its positions to a bigger one)
        took = (ahead is not None and ahead[0] is part.buf and ahead[1:3] == (start, length)
                and ahead[5] is io)
        self._reserve(length + n, (2, rows, heads, dim), key_states, io)
        new = torch.stack([key_states, value_states]).permute(3, 0, 1, 2, 4).contiguous()
        if length > start:
            past = part.buf[start:length]
            if self.cache.on_device:
                pass
            elif took:
                io.kv_ready(ahead[4])
                past = ahead[3]
            else:
                past = io.kv_to_device(past, part.pending)
            past = past.permute(1, 2, 3, 0, 4)  # (2, rows, heads, t, dim), a view
            # cat makes the contiguous (rows, heads, t + n, dim) transformers' cat makes
            keys = torch.cat([past[0], key_states], dim=-2)
            values = torch.cat([past[1], value_states], dim=-2)
        else:  # as transformers: a fresh contiguous copy of the new ones
            empty = key_states.new_empty((rows, heads, 0, dim))
            keys = torch.cat([empty, key_states], dim=-2)
            values = torch.cat([empty, value_states], dim=-2)
        if self.cache.on_device:
            with torch.no_grad():
                part.buf[length:length + n].copy_(new)
        else:
            part.pending = io.kv_to_host(new, part.buf[length:length + n])
            per_position = new[0].numel() * new.element_size()
            io.stats.add("kv_floor_bytes", (length - start + n) * per_position)
        part.length = length + n
        if first and not self.cache.on_device:
            self._upload_next_ahead(io)
        self.layer.io = weakref.ref(io)
        return keys, values

    def _upload_next_ahead(self, io) -> None:
        """Uploads, on the copy stream, the positions the next decoder layer's part will attend
        to in this pass, if it ran on this device in the last pass and has not run in this
        one: its upload then overlaps this layer's compute instead of delaying the next's.
        Only the positions cached before the pass (what its first chunk reads)."""
        layers = self.cache.layers
        i = self.index + 1
        if i >= len(layers) or layers[i].io is None or layers[i].io() is not io:
            return
        nxt = layers[i].parts[self.part_index]
        if nxt.buf is None or nxt.updated_in == self.cache.passes:
            return
        start = attended_start(nxt.length, layers[i].sliding_window)
        if nxt.length > start:
            dev, event = io.kv_prefetch(nxt.buf[start:nxt.length], nxt.pending)
            nxt.ahead = (nxt.buf, start, nxt.length, dev, event, io)

    def _reserve(self, needed: int, shape: tuple, like: torch.Tensor, io) -> None:
        """Makes the part's buffer hold ``needed`` positions (allocated, or doubled with the
        written positions copied over)."""
        part = self.part
        if part.buf is not None and part.buf.shape[0] >= needed:
            if part.buf.shape[1:] != shape or part.buf.dtype != like.dtype:
                raise ValueError(f"PipelineCache: the cache holds {tuple(part.buf.shape[1:])} "
                                 f"{part.buf.dtype} entries, the layer made {shape} {like.dtype}")
            return
        capacity = max(needed, self.cache.capacity_hint,
                       2 * part.buf.shape[0] if part.buf is not None else 0)
        keep: list = []
        if self.cache.on_device:
            buf = torch.empty((capacity, *shape), dtype=like.dtype, device=like.device)
        else:
            buf = io.kv_host_empty((capacity, *shape), like.dtype, keep)
        if part.buf is not None and part.length:
            if part.pending is not None:
                io.host_wait(part.pending)
                part.pending = None
            with torch.no_grad():
                buf[:part.length].copy_(part.buf[:part.length])
        if part.buf is not None:  # an earlier chunk's upload of this pass may still read it
            self.cache.retired.append((part.buf, part.keep))
        part.buf, part.keep = buf, keep
