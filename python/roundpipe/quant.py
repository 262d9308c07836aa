"""Quantized frozen weights: the frozen base of LoRA kept on the host in NF4 or blockwise
int8, uploaded packed and dequantized on the compute device once per stage visit, right after
the upload (:func:`dequantize_uploaded`; outside RoundPipe, before each linear runs).

Formats (``frozen_dtype``), both over blocks of :data:`BLOCK` = 64 consecutive values of the
row-major flattened weight (the last block zero-padded):

- ``"nf4"``: QLoRA's 4-bit NormalFloat (Dettmers et al., "QLoRA: Efficient Finetuning of
  Quantized LLMs", 2023, §3; the code book is bitsandbytes' ``NF4`` table, :data:`NF4_CODE`).
  Per block one float32 ``absmax`` (the largest magnitude); each value ``x`` gets the index
  of the code-book entry nearest to ``x / absmax`` (ties to the lower index, decided in
  float64), two indices per byte, the first value of a pair in the high nibble (bitsandbytes'
  packing). Dequantized: ``NF4_CODE[i] * absmax`` in float32 (exact product, one rounding).
  Host bytes per value 0.5 + 4/64 = 0.5625.
- ``"nf4-dq"``: ``"nf4"`` with QLoRA's double quantization of the absmax (§3, "Double
  Quantization"; bitsandbytes' ``quantize_4bit(..., compress_statistics=True)``): the float32
  block absmax values, less their float32 mean (the ``offset``), are quantized blockwise
  again, :data:`DQ_BLOCK` = 256 at a time, to the 8-bit signed dynamic map
  (:func:`dynamic_code`, bitsandbytes' ``create_dynamic_map(signed=True)``) with one float32
  scale (their absmax) per block of 256: the code of the map value nearest to
  ``(absmax - offset) / scale`` (decided in float64, ties to the lower code; bitsandbytes' CPU
  quantizer rounds values below about 2e-5 of the scale differently, so its codes can differ
  there while ours are never farther). Read back as ``code[q] * scale + offset`` in float32
  (bitsandbytes' ``dequantize_4bit`` of a nested state, bit for bit), then as ``"nf4"``. Host
  bytes per value 0.5 + (1 + 4/256)/64 ~= 0.516.
- ``"int8"``: symmetric linear codes ``q = round_half_even(127 * x / absmax)`` in [-127, 127]
  (int8), per block the float32 scale ``absmax / 127``. Dequantized: ``q * scale`` in
  float32 (exact product, one rounding). Linear rather than bitsandbytes' dynamic (tree)
  map: a frozen weight's values inside a block of 64 are roughly uniform in magnitude, the
  linear grid has the smaller worst-case error there (absmax/254) and dequantizes with a
  multiply, no table. Host bytes per value 1 + 4/64 = 1.0625.

:func:`quantize_frozen_linears` replaces every ``nn.Linear`` whose weight does not require
grad (and is not tied to another module: an output embedding tied to the input embedding
stays in the model dtype, as do biases, norms and embeddings) by a :class:`QuantizedLinear`
whose packed codes and block scales are frozen parameters: RoundPipe uploads them as they
are (``pipeline_stats()`` counts the packed bytes, and the weight floor is the packed size),
and they are dequantized on the device (on the CPU with the SIMD kernels of ``roundpipe._C``,
``roundpipe/dequant.hpp``, elsewhere with the fused kernel of :mod:`roundpipe.fused_dequant`
or torch ops; the same bits every way),
so gradients reach the input (and PEFT's LoRA adapters around it) through the dequantized
weight, as in QLoRA; the dequantized weight lives only while the layer's autograd graph does.

``state_dict()`` of a :class:`QuantizedLinear` holds ``weight`` dequantized in the model
dtype under the original name (never the packed codes), so a saved model loads into plain
transformers/PyTorch with the values RoundPipe computed with; ``load_state_dict`` quantizes an
incoming ``weight``, except one equal to the values the module stands for (in the incoming
dtype), which keeps its packed form: ``load_state_dict(state_dict())`` is exact in every format
(``"nf4-dq"`` re-quantized from its own dequantized values would move its absmax).
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import _C, fused_dequant

BLOCK = 64
DQ_BLOCK = 256
FROZEN_DTYPES = ("nf4", "nf4-dq", "int8")

#: The NF4 code book (QLoRA, Dettmers et al. 2023; bitsandbytes ``get_4bit_type("nf4")``),
#: float32 values, index 7 is zero.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)

_C_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the SIMD kernels write
_CHUNK_BLOCKS = 1 << 14  # blocks quantized at once (float64 temporaries: 8 MiB)
_tables: dict[tuple[str, str], torch.Tensor] = {}
_tables_lock = threading.Lock()


def dynamic_code() -> torch.Tensor:
    """The signed 8-bit dynamic map (Dettmers, "8-Bit Approximations for Parallelism in Deep
    Learning", 2016) as bitsandbytes' ``create_dynamic_map(signed=True)`` builds it, the code
    book of ``"nf4-dq"``'s second level: 0, 1 and, for decades i = 0..6, the 2^i midpoints of
    ``torch.linspace(0.1, 1, 2^i + 1)`` (float32) times ``10^(i-6)`` and their negatives, all
    float32 products; float32 ``(256,)`` ascending, on the CPU."""
    parts = [torch.tensor([0.0, 1.0])]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        parts += [10.0 ** (i - 6) * mids, -(10.0 ** (i - 6)) * mids]
    return torch.cat(parts).sort().values


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, str(device))
    t = _tables.get(key)
    if t is None:
        values = torch.tensor(NF4_CODE, dtype=torch.float32) if name == "nf4" else dynamic_code()
        with _tables_lock:
            t = _tables.setdefault(key, values.to(device))
    return t


def check_frozen_dtype(frozen_dtype, who: str) -> None:
    """Raises ValueError unless ``frozen_dtype`` is None, ``"nf4"``, ``"nf4-dq"`` or ``"int8"``."""
    if frozen_dtype is not None and frozen_dtype not in FROZEN_DTYPES:
        raise ValueError(f"{who}: frozen_dtype must be None, 'nf4', 'nf4-dq' or 'int8', got "
                         f"{frozen_dtype!r}")


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def compress_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """``"nf4-dq"``'s second level (module docstring) of float32 ``absmax`` ``(nb,)`` (CPU):
    a uint8 ``(pad4(nb) + 4 * (ceil(nb / 256) + 1),)`` byte string: the nb 8-bit codes (zero
    padded to a multiple of 4), then float32 bytes of the ceil(nb / 256) block scales and the
    offset."""
    nb = absmax.numel()
    offset = absmax.mean()
    centred = absmax - offset  # float32, as bitsandbytes
    nb2 = -(-nb // DQ_BLOCK)
    padded = torch.zeros(nb2 * DQ_BLOCK, dtype=torch.float32)
    padded[:nb] = centred
    scale = padded.view(nb2, DQ_BLOCK).abs().amax(dim=1)
    code = dynamic_code().double()
    mids = (code[1:] + code[:-1]) / 2  # exact in float64
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).double()
    y = (padded.double().view(nb2, DQ_BLOCK) / safe[:, None]).reshape(-1)[:nb]
    out = torch.zeros(_pad4(nb) + 4 * (nb2 + 1), dtype=torch.uint8)
    out[:nb] = torch.searchsorted(mids, y, side="left").to(torch.uint8)
    out[_pad4(nb):].view(torch.float32).copy_(torch.cat((scale, offset.view(1))))
    return out


def expand_absmax(packed: torch.Tensor, nb: int) -> torch.Tensor:
    """The float32 ``(nb,)`` absmax that :func:`compress_absmax`'s bytes stand for, computed on
    their device: ``code[q] * scale + offset`` in float32 (two roundings, as bitsandbytes)."""
    return _expand(*_absmax_parts(packed, nb))


def _absmax_parts(packed: torch.Tensor, nb: int) -> tuple[torch.Tensor, ...]:
    """Views of :func:`compress_absmax`'s bytes: uint8 codes ``(nb,)``, float32 scales
    ``(ceil(nb / 256),)``, float32 offset ``(1,)``."""
    q, floats = fused_dequant.absmax_views(packed, nb)
    return q, floats[:-1], floats[-1:]


def _expand(q: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    scale = scales.repeat_interleave(DQ_BLOCK)[:q.numel()]
    return _table("dynamic", q.device)[q.long()] * scale + offset


def quantize(weight: torch.Tensor, frozen_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a floating tensor (any shape, on the CPU) blockwise (see the module docstring).

    Returns:
        ``(codes, scales)``: ``nf4``: uint8 ``(ceil(n / 64) * 32,)`` packed indices and float32
        ``(ceil(n / 64),)`` absmax per block; ``nf4-dq``: the same codes and the uint8 bytes of
        :func:`compress_absmax`; ``int8``: int8 ``(ceil(n / 64) * 64,)`` codes and float32
        ``(ceil(n / 64),)`` scale (absmax / 127) per block. ``n = weight.numel()``.

    Raises:
        ValueError: ``frozen_dtype`` unknown, or ``weight`` not floating point.
    """
    check_frozen_dtype(frozen_dtype, "quantize")
    if frozen_dtype is None or not weight.is_floating_point():
        raise ValueError(f"quantize: needs a floating tensor and a frozen_dtype, got "
                         f"{weight.dtype} and {frozen_dtype!r}")
    flat = weight.detach().reshape(-1)
    n = flat.numel()
    nb = -(-n // BLOCK)
    scales = torch.empty(nb, dtype=torch.float32)
    nf4 = frozen_dtype.startswith("nf4")
    if nf4:
        codes = torch.empty(nb * BLOCK // 2, dtype=torch.uint8)
        table = torch.tensor(NF4_CODE, dtype=torch.float64)
        mids = (table[1:] + table[:-1]) / 2  # exact in float64
    else:
        codes = torch.empty(nb * BLOCK, dtype=torch.int8)
    for b0 in range(0, nb, _CHUNK_BLOCKS):
        b1 = min(nb, b0 + _CHUNK_BLOCKS)
        x = torch.zeros((b1 - b0) * BLOCK, dtype=torch.float64)
        part = flat[b0 * BLOCK:min(n, b1 * BLOCK)]
        x[:part.numel()] = part
        x = x.view(-1, BLOCK)
        absmax = x.abs().amax(dim=1)
        if nf4:
            scales[b0:b1] = absmax  # the largest magnitude: exact in float32 for <= fp32 input
            absmax32 = scales[b0:b1].double()
            safe = torch.where(absmax32 > 0, absmax32, torch.ones_like(absmax32))
            # nearest code: the number of midpoints strictly below (ties to the lower index)
            idx = torch.searchsorted(mids, (x / safe[:, None]).reshape(-1), side="left")
            idx = idx.to(torch.uint8).view(-1, 2)
            codes[b0 * BLOCK // 2:b1 * BLOCK // 2] = (idx[:, 0] << 4) | idx[:, 1]
        else:
            safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
            q = torch.round(x * 127 / safe[:, None]).clamp_(-127, 127)
            codes[b0 * BLOCK:b1 * BLOCK] = q.reshape(-1).to(torch.int8)
            scales[b0:b1] = absmax / 127
    if frozen_dtype == "nf4-dq":
        scales = compress_absmax(scales)
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, frozen_dtype: str,
               shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` that ``(codes, scales)`` (from :func:`quantize`)
    stand for, computed on their device: each value the float32 product of its code-book
    value (or int8 code) and its block's scale, rounded to ``dtype`` to nearest even.

    On the CPU, with ``dtype`` float32, bfloat16 or float16, the SIMD kernels of
    ``roundpipe._C`` (``dequantize_nf4`` / ``dequantize_int8``, ``cpp/include/roundpipe/
    dequant.hpp``: runtime-dispatched AVX-512 / AVX2 / NEON / scalar, on the worker pool for
    big tensors when it is idle); elsewhere (CUDA) torch ops on the device. Both give the same
    bits (tests/test_dequant.py). ``"nf4-dq"`` first expands the absmax
    (:func:`expand_absmax`, torch ops: 1/64 of the values).

    On other devices (and on the CPU when ``ROUNDPIPE_DEQUANT=compiled``), one fused kernel
    compiled by ``torch.compile`` (:mod:`roundpipe.fused_dequant`; ``"nf4-dq"`` expanded in the
    same kernel), checked once against the torch-op path; where it cannot be compiled or differs,
    the torch-op path (``ROUNDPIPE_DEQUANT`` chooses, see :mod:`roundpipe.fused_dequant`).

    Raises:
        ValueError: ``ROUNDPIPE_DEQUANT`` holds an unknown value.
        RuntimeError: ``ROUNDPIPE_DEQUANT=compiled`` and the kernel cannot run here.
    """
    n = 1
    for s in shape:
        n *= s
    nb = -(-n // BLOCK)
    mode = fused_dequant.mode()
    if mode != "torch" and not (mode == "auto" and codes.device.type == "cpu"):
        fn = fused_dequant.kernel(frozen_dtype, dtype, codes.device, _TABLES, _torch_ops,
                                  required=mode == "compiled")
        if fn is not None:
            with torch.no_grad(), torch.autocast(codes.device.type, enabled=False):
                return fn(*_kernel_args(codes.detach(), scales.detach(), frozen_dtype, nb),
                          n).view(tuple(shape))
    if frozen_dtype == "nf4-dq":
        scales = expand_absmax(scales, nb)
    if codes.device.type == "cpu" and dtype in _C_DTYPES and mode == "auto":
        out = torch.empty(tuple(shape), dtype=dtype)
        fn = _C.dequantize_int8 if frozen_dtype == "int8" else _C.dequantize_nf4
        fn(codes.detach().contiguous(), scales.detach().contiguous(), out)
        return out
    return dequantize_torch(codes, scales, frozen_dtype, shape, dtype)


_TABLES = {"nf4": torch.tensor(NF4_CODE, dtype=torch.float32), "dynamic": dynamic_code()}


def _kernel_args(codes: torch.Tensor, scales: torch.Tensor, frozen_dtype: str,
                 nb: int) -> tuple[torch.Tensor, ...]:
    """The tensor arguments of :mod:`roundpipe.fused_dequant`'s body for ``frozen_dtype``."""
    if frozen_dtype == "int8":
        return codes, scales
    nf4 = _table("nf4", codes.device)
    if frozen_dtype == "nf4":
        return codes, scales, nf4
    return (codes, *fused_dequant.absmax_views(scales, nb), nf4, _table("dynamic", codes.device))


def _torch_ops(kind: str, args: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The torch-op path on :mod:`roundpipe.fused_dequant`'s arguments ``(tensors..., n)``:
    what its kernels are checked against."""
    *tensors, n = args
    if kind == "nf4-dq":
        codes, q, floats = tensors[:3]
        tensors = [codes, _expand(q, floats[:-1], floats[-1:])]
    return dequantize_torch(tensors[0], tensors[1], kind, (n,), dtype)


#: blocks per chunk of :func:`dequantize_torch`: 4M values, so its temporaries (the int32
#: code-book indices and two float32 products, 12 bytes per value) stay near 50 MB whatever the
#: weight's size (unchunked: 3-4x the dense weight, on the weights stream, under a device cap)
TORCH_CHUNK_BLOCKS = 1 << 16


def dequantize_torch(codes: torch.Tensor, scales: torch.Tensor, frozen_dtype: str,
                     shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """:func:`dequantize` with torch ops on the codes' device (the CUDA path where the compiled
    kernel is refused; on the CPU, the reference the SIMD kernels are held to and the speed
    they are measured against), ``scales`` already float32 per block (``"nf4-dq"``
    expanded). Works through the blocks in chunks of :data:`TORCH_CHUNK_BLOCKS`, each value
    the float32 product of its code-book value (or int8 code) and its block's scale, rounded
    once to ``dtype``."""
    n = 1
    for s in shape:
        n *= s
    nf4 = frozen_dtype.startswith("nf4")
    per_block = BLOCK // 2 if nf4 else BLOCK  # code bytes per block
    out = torch.empty(n, dtype=dtype, device=codes.device)
    for b0 in range(0, scales.numel(), TORCH_CHUNK_BLOCKS):
        b1 = min(b0 + TORCH_CHUNK_BLOCKS, scales.numel())
        part = codes.view(-1)[b0 * per_block:b1 * per_block]
        if nf4:
            idx = torch.stack((part >> 4, part & 15), dim=-1).view(-1).int()
            vals = _table("nf4", codes.device)[idx].view(-1, BLOCK)
        else:
            vals = part.view(-1, BLOCK).float()
        vals = vals * scales[b0:b1, None]
        v0, v1 = b0 * BLOCK, min(b1 * BLOCK, n)
        out[v0:v1] = vals.view(-1)[:v1 - v0]  # rounded to dtype as .to(dtype) does
    return out.view(tuple(shape))


def _stored(scales: torch.Tensor) -> torch.Tensor:
    # float32 scales as their int32 bits (no cast of the model rounds them); nf4-dq's bytes as is
    return scales.view(torch.int32) if scales.dtype == torch.float32 else scales


def _loaded(stored: torch.Tensor) -> torch.Tensor:
    return stored.view(torch.float32) if stored.dtype == torch.int32 else stored


class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is kept blockwise quantized (see the module
    docstring): ``y = x @ W^T + b`` with ``W`` dequantized from :attr:`weight_codes` and
    :attr:`weight_scales` on their device, in :attr:`compute_dtype`, at each forward.

    Args:
        linear: the module replaced (its weight is quantized; its bias, trainable or not,
            is kept as the same parameter object).
        frozen_dtype: ``"nf4"``, ``"nf4-dq"`` or ``"int8"``.

    Attributes:
        weight_codes: frozen parameter, uint8 (nf4, packed) or int8 codes.
        weight_scales: frozen parameter, one float32 per block of 64 values, kept as its
            int32 bit pattern, so that ``model.to(dtype)`` / ``.half()`` cannot round the
            scales and the module's first floating parameter is the bias, not a scale (what
            RoundPipe casts floating inputs to); ``nf4-dq``: the uint8 bytes of
            :func:`compress_absmax`.
        compute_dtype: the original weight's dtype (what ``W`` is dequantized into); a cast
            of the module (``.to(torch.bfloat16)``) changes it as it would the weight's.

    Raises:
        ValueError: the weight requires grad (a trainable weight is never quantized).
    """

    def __init__(self, linear: nn.Linear, frozen_dtype: str) -> None:
        super().__init__()
        check_frozen_dtype(frozen_dtype, "QuantizedLinear")
        if linear.weight.requires_grad:
            raise ValueError("QuantizedLinear: the weight requires grad; trainable weights are "
                             "never quantized (freeze it, or leave it out)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.frozen_dtype = frozen_dtype
        self.compute_dtype = linear.weight.dtype
        self.weight_shape = tuple(linear.weight.shape)
        codes, scales = quantize(linear.weight, frozen_dtype)
        self.weight_codes = nn.Parameter(codes, requires_grad=False)
        self.weight_scales = nn.Parameter(_stored(scales), requires_grad=False)
        self.bias = linear.bias
        self._register_state_dict_hook(QuantizedLinear._dequantized_state)
        self._register_load_state_dict_pre_hook(QuantizedLinear._quantize_loaded, with_module=True)
        _owners[id(self._parameters)] = self

    def __setstate__(self, state) -> None:  # copy.deepcopy and pickle: a new parameter dict
        super().__setstate__(state)
        _owners[id(self._parameters)] = self

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight ``(out_features, in_features)`` in :attr:`compute_dtype`,
        on the codes' device: a new tensor (writing to it changes nothing), except inside a
        RoundPipe stage visit, where it is the one dequantized when the stage was uploaded
        (:func:`dequantize_uploaded`), the same tensor for each microbatch of the visit."""
        dense = getattr(self.weight_codes, _DENSE, None)
        if dense is not None and dense.dtype == self.compute_dtype:
            return dense
        return dequantize(self.weight_codes, _loaded(self.weight_scales),
                          self.frozen_dtype, self.weight_shape, self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def _apply(self, fn, *args, **kwargs):
        # a cast of the model (``.to(dtype)``, ``.half()``) casts floating tensors: the
        # dequantized weight follows it, the codes and int32-coded scales do not change
        out = super()._apply(fn, *args, **kwargs)
        self.compute_dtype = fn(torch.empty(0, dtype=self.compute_dtype)).dtype
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, frozen_dtype={self.frozen_dtype!r}, "
                f"compute_dtype={self.compute_dtype}")

    @staticmethod
    def _dequantized_state(module, state_dict, prefix, local_metadata):
        codes = state_dict.pop(prefix + "weight_codes", None)
        scales = state_dict.pop(prefix + "weight_scales", None)
        if codes is not None and scales is not None:
            state_dict[prefix + "weight"] = dequantize(
                codes.detach(), _loaded(scales.detach()), module.frozen_dtype,
                module.weight_shape,
                module.compute_dtype)
        return state_dict

    @staticmethod
    def _quantize_loaded(self, state_dict, prefix, local_metadata, strict, missing_keys,
                         unexpected_keys, error_msgs):
        w = state_dict.pop(prefix + "weight", None)
        if w is None:
            return
        if tuple(w.shape) != self.weight_shape:
            error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape "
                              f"{tuple(w.shape)}, the shape in current model is {self.weight_shape}")
            return
        w = w.detach().to("cpu")
        if w.is_floating_point() and torch.equal(w, dequantize(
                self.weight_codes.detach(), _loaded(self.weight_scales.detach()),
                self.frozen_dtype, self.weight_shape, w.dtype)):
            # the values this module already stands for (a state_dict() round trip, a
            # checkpoint it saved): its packed form is kept, bit for bit ("nf4-dq" re-quantized
            # from its own lossy absmax would drift)
            codes, scales = self.weight_codes.detach(), _loaded(self.weight_scales.detach())
        else:
            codes, scales = quantize(w, self.frozen_dtype)
        state_dict[prefix + "weight_codes"] = codes
        state_dict[prefix + "weight_scales"] = _stored(scales)


_DENSE = "_roundpipe_dense"  # attribute of an uploaded codes tensor: its dense weight
# id(module._parameters) -> the QuantizedLinear owning that dict: how dequantize_uploaded finds
# a module from the places (dict, key) the pipeline swaps tensors into
_owners: "weakref.WeakValueDictionary[int, QuantizedLinear]" = weakref.WeakValueDictionary()


def dequantize_uploaded(layers: Sequence[Sequence], copies: dict[int, torch.Tensor]) -> list:
    """Dequantizes, right after a stage's upload and on the stream current there, the weight
    of every :class:`QuantizedLinear` whose codes and scales were uploaded, once for the whole
    stage visit: the dense weight is attached to the uploaded codes tensor, where
    :attr:`QuantizedLinear.weight` finds it while the pipeline has swapped that tensor into the
    module, and lives as long as it (the visit's weights). On CUDA the dequantization of stage
    ``s + 1`` is then issued on the upload stream behind its copies and overlaps the compute
    of stage ``s``, instead of running before each linear for each microbatch.

    Args:
        layers: per layer of the stage, its tensors: objects with ``host`` (the host tensor)
            and ``sites`` (``(dict, key)`` pairs: the module dicts holding it), as
            :class:`roundpipe.transfer.TensorRef`.
        copies: ``id(host tensor)`` -> its copy on the device.

    Returns:
        The dense weights made (device tensors, to be kept alive for the compute stream and
        counted as the stage's device bytes).
    """
    made = []
    for refs in layers:
        for ref in refs:
            for held, key in ref.sites:
                if key != "weight_codes":
                    continue
                m = _owners.get(id(held))
                if m is None or m._parameters is not held:
                    continue
                codes = copies.get(id(ref.host))
                scales = copies.get(id(held.get("weight_scales")))
                if codes is None or scales is None or getattr(codes, _DENSE, None) is not None:
                    continue
                dense = dequantize(codes, _loaded(scales), m.frozen_dtype, m.weight_shape,
                                   m.compute_dtype)
                setattr(codes, _DENSE, dense)
                made.append(dense)
    return made


def _output_embeddings(model: nn.Module) -> Optional[nn.Module]:
    get = getattr(model, "get_output_embeddings", None)
    if not callable(get):
        return None
    try:
        return get()
    except (AttributeError, NotImplementedError):
        return None


def quantize_frozen_linears(model: nn.Module, frozen_dtype: str,
                            modules: Optional[Sequence[str]] = None) -> dict[int, nn.Module]:
    """Replaces frozen ``nn.Linear`` modules of ``model`` (in place, on the CPU) by
    :class:`QuantizedLinear` in ``frozen_dtype``; the original weights are released.

    Args:
        model: the model (its weights on the CPU).
        frozen_dtype: ``"nf4"``, ``"nf4-dq"`` or ``"int8"``.
        modules: names (as ``named_modules`` gives them) of the linears to quantize; None:
            every ``nn.Linear`` whose weight does not require grad, except weights shared
            with another module (tied embeddings) and the model's output embeddings
            (``get_output_embeddings()``, as transformers leaves ``lm_head`` unquantized).

    Returns:
        ``{id(old module): new module}``.

    Raises:
        ValueError: ``frozen_dtype`` unknown; a name in ``modules`` is not an ``nn.Linear`` of
            ``model``, or its weight requires grad, or is tied; ``modules`` is None and no
            frozen linear is found (forgetting to freeze the base would quantize nothing),
            unless some are quantized already (``roundpipe.hf.from_pretrained``'s models);
            linears quantized already in another format. Raised before anything is modified.
    """
    found = dict(model.named_modules(remove_duplicate=False))
    todo = frozen_linears(model, frozen_dtype, modules)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent in found.values():
        for cname, child in parent._modules.items():
            if child is not None:
                holders.setdefault(id(child), []).append((parent, cname))
    olds = {id(found[name]): found[name] for name in todo}
    del found
    replaced: dict[int, nn.Module] = {}
    for key in list(olds):  # one at a time: each dense weight can go before the next is made
        new = replaced[key] = QuantizedLinear(olds.pop(key), frozen_dtype)
        for parent, cname in holders.get(key, []):
            parent._modules[cname] = new
    return replaced


def frozen_linears(model: nn.Module, frozen_dtype: str,
                   modules: Optional[Sequence[str]] = None) -> list[str]:
    """The names of the linears :func:`quantize_frozen_linears` would replace (same
    arguments and errors; nothing is modified)."""
    check_frozen_dtype(frozen_dtype, "quantize_frozen_linears")
    if frozen_dtype is None:
        raise ValueError("quantize_frozen_linears: frozen_dtype must be 'nf4', 'nf4-dq' or "
                         "'int8', got None")
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    found = dict(model.named_modules(remove_duplicate=False))
    held = {m.frozen_dtype for m in found.values() if isinstance(m, QuantizedLinear)}
    if held - {frozen_dtype}:
        raise ValueError(f"frozen_dtype={frozen_dtype!r}: the model's linears are already "
                         f"quantized as {sorted(held)}")
    if modules is not None:
        todo = []
        for name in modules:
            m = found.get(name)
            if not isinstance(m, nn.Linear):
                raise ValueError(f"quantize_frozen_linears: modules: {name!r} is not an nn.Linear "
                                 "of the model")
            if m.weight.requires_grad:
                raise ValueError(f"quantize_frozen_linears: modules: {name!r} has a trainable "
                                 "weight (requires_grad=True); trainable weights are never "
                                 "quantized: freeze it first, or leave it out")
            if uses[id(m.weight)] > 1:
                raise ValueError(f"quantize_frozen_linears: modules: {name!r} has a weight tied "
                                 "to another module; tied weights stay in the model dtype")
            todo.append(name)
    else:
        skip = _output_embeddings(model)
        todo = [name for name, m in found.items()
                if isinstance(m, nn.Linear) and m is not skip and not m.weight.requires_grad
                and m.weight.is_floating_point() and uses[id(m.weight)] == 1]
        if not todo and not held:  # none left to quantize: already done (from_pretrained)
            raise ValueError(
                f"frozen_dtype={frozen_dtype!r}: the model has no frozen nn.Linear weight to "
                "quantize; freeze the base first (e.g. peft.get_peft_model, or "
                "requires_grad_(False)) or leave frozen_dtype=None")
    return todo


def frozen_base_keys(model: nn.Module) -> set[str]:
    """State-dict names of ``model``'s quantized weights (what checkpoints leave out)."""
    return {f"{name}.weight" if name else "weight"
            for name, m in model.named_modules(remove_duplicate=False)
            if isinstance(m, QuantizedLinear)}


def host_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes, values)`` of ``model``'s quantized weights on the host: packed codes plus
    block scales, and the number of weight values they stand for."""
    seen: set[int] = set()
    total = values = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and id(m) not in seen:
            seen.add(id(m))
            total += sum(t.numel() * t.element_size() for t in (m.weight_codes, m.weight_scales))
            values += m.in_features * m.out_features
    return total, values


def dequantize_linears(model: nn.Module) -> None:
    """Replaces every :class:`QuantizedLinear` of ``model`` (in place) by an ``nn.Linear``
    holding its dequantized weight in its compute dtype (the values the model computes with)
    and the same bias object: a plain model, e.g. to merge adapters into (the dense weights
    take their full size in memory)."""
    parents = [(parent, cname, child) for parent in model.modules()
               for cname, child in parent._modules.items() if isinstance(child, QuantizedLinear)]
    dense: dict[int, nn.Linear] = {}
    for parent, cname, q in parents:
        if id(q) not in dense:
            lin = nn.Linear(q.in_features, q.out_features, bias=False, device="meta")
            lin.weight = nn.Parameter(q.weight.detach(), requires_grad=False)
            lin.bias = q.bias
            dense[id(q)] = lin
        parent._modules[cname] = dense[id(q)]


def refuse_foreign_quantization(model: nn.Module, who: str) -> None:
    """Raises TypeError when ``model`` holds weights quantized by another library: bitsandbytes
    modules (what transformers' ``BitsAndBytesConfig(load_in_4bit=True)`` / ``load_in_8bit``
    makes), or a model transformers quantized otherwise (``hf_quantizer`` set: GPTQ, AWQ, ...).
    Their packed weights carry state (quantization maps, outlier handling) outside the tensors
    RoundPipe streams; RoundPipe quantizes a frozen base itself instead
    (``roundpipe.hf.from_pretrained(..., frozen_dtype="nf4")``)."""
    for name, m in model.named_modules():
        cls = type(m)
        if cls.__module__.split(".")[0] == "bitsandbytes":
            kind = "int8" if "8bit" in cls.__name__ else "nf4"
            raise TypeError(
                f"{who}: {name!r} is a bitsandbytes {cls.__name__} (a model loaded with "
                "transformers' BitsAndBytesConfig); its packed weights and quantization state "
                "are not streamed by RoundPipe. Load the full-precision checkpoint with "
                f"roundpipe.hf.from_pretrained(path, frozen_dtype={kind!r}, "
                "peft_config=...) instead: it quantizes the frozen base as it reads it")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", "?")
        raise TypeError(
            f"{who}: the model was quantized by transformers ({method}); RoundPipe streams "
            "plain weights or its own quantized frozen base: load the full-precision checkpoint "
            "with roundpipe.hf.from_pretrained(path, frozen_dtype='nf4', peft_config=...)")
