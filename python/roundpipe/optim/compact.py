"""Compact storage for ``roundpipe.optim``: bfloat16 parameters and bfloat16 or 8-bit state.

Host memory per trainable parameter is what limits the model size RoundPipe can train. With a
bfloat16 model copy and float32 master weights, gradient and AdamW state a parameter costs ~18
bytes; these options cut it (see the memory ladder in docs/host_memory.md):

- ``state_dtype=torch.bfloat16``: per-element state kept in bfloat16 (2 bytes per value instead
  of 4), read as float32, updated by the algorithm's float32 arithmetic and stored with
  stochastic rounding (unbiased: the expected stored value is the float32 result).
- ``state_dtype="int8"``: 8-bit blockwise state, the scheme of 8-bit Adam (Dettmers et al.,
  "8-bit Optimizers via Block-wise Quantization", 2022): per block of 256 elements one float32
  absmax, per element the uint8 code of the nearest value of the *dynamic map* (signed for
  state of either sign such as ``exp_avg``, unsigned for non-negative state such as
  ``exp_avg_sq``; ``roundpipe/compact.hpp`` defines them). About 1.02 bytes per value. Only for
  parameters of at least 4096 elements (as bitsandbytes' ``min_8bit_size``): the others keep
  float32 state. A block holding an inf or NaN reads back as NaN in all of its elements.
- ``stochastic_rounding=True``: bfloat16 parameters are accepted and stepped in place, updated in
  float32 registers and stored with stochastic rounding, so no float32 master copy exists and
  updates far below a bfloat16 step still move the weights by their expected amount.

Everything happens in the step's single pass over memory (the C++ kernels read and write the
compact forms directly). Rounding bits come from a counter-based hash of (seed, parameter
position, step count, element index): reproducible, and the same on every thread count.

In ``state``/``state_dict`` compact state appears as it is kept: a bfloat16 tensor, or for int8
the uint8 codes under the state's key and the float32 block maxima under ``<key>_absmax``.
``state_dict(state_dtype=torch.float32)`` converts it to what ``torch.optim`` loads, and
``load_state_dict`` accepts any of these forms and converts them to the optimizer's own.
"""

from __future__ import annotations

import math
import mmap
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import _C
from ..host_buffers import LARGE, host_empty, host_zeros

#: Elements per int8 block (one float32 absmax each).
QUANT_BLOCK: int = _C.QUANT_BLOCK
#: Smallest parameter whose state is kept as int8 under ``state_dtype="int8"``.
INT8_MIN_NUMEL: int = _C.INT8_MIN_NUMEL

STATE_DTYPES = (torch.float32, torch.bfloat16, "int8")


def dynamic_map(is_signed: bool) -> torch.Tensor:
    """The 256 float32 values of the signed or unsigned dynamic map, ascending (code k reads as
    ``map[k] * absmax``)."""
    return torch.tensor(_C.dynamic_map(is_signed), dtype=torch.float32)


def quantize(x: torch.Tensor, is_signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32, CPU, contiguous) as int8 state: uint8 codes shaped like ``x`` and the
    float32 absmax of each block of 256 elements, as the kernels store it."""
    codes = host_empty(x.shape, torch.uint8)
    absmax = torch.empty(math.ceil(x.numel() / QUANT_BLOCK), dtype=torch.float32)
    _C.quantize_blockwise(x, is_signed, codes, absmax)
    return codes, absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, is_signed: bool) -> torch.Tensor:
    """The float32 values int8 state reads back as: ``map[code] * absmax`` per element."""
    out = host_empty(codes.shape, torch.float32)
    _C.dequantize_blockwise(codes, absmax, is_signed, out)
    return out


@dataclass
class Memory:
    """An optimizer's compact-storage settings and its rounding-call counter (one object shared
    with the optimizer's shallow twins, so their steps advance the same counter)."""

    state_dtype: Any
    stochastic_rounding: bool
    seed: int
    calls: int = 0   # kernel calls with rounding, for algorithms without a step count (SGD)

    @classmethod
    def create(cls, where: str, state_dtype: Any, stochastic_rounding: Any,
               seed: Optional[int], int8_allowed: bool) -> "Memory":
        """Validated settings (ValueError / TypeError naming the argument); ``seed`` None
        draws one from torch's global generator."""
        if not any(state_dtype is d or (isinstance(d, str) and state_dtype == d)
                   for d in STATE_DTYPES):
            raise ValueError(f"{where}: state_dtype must be torch.float32, torch.bfloat16 or "
                             f"'int8', got {state_dtype!r}")
        if state_dtype == "int8" and not int8_allowed:
            raise ValueError(f"{where}: state_dtype='int8' is not supported by this algorithm "
                             "(torch.float32 or torch.bfloat16)")
        if not isinstance(stochastic_rounding, bool):
            raise TypeError(f"{where}: stochastic_rounding must be a bool, got "
                            f"{stochastic_rounding!r}")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        elif isinstance(seed, bool) or not isinstance(seed, numbers.Integral) \
                or not 0 <= seed < 2**64:
            raise ValueError(f"{where}: seed must be None or an int in [0, 2**64), got {seed!r}")
        return cls(state_dtype, stochastic_rounding, int(seed))

    @property
    def rounds(self) -> bool:
        """Whether steps draw rounding bits (bfloat16 parameters or state)."""
        return self.stochastic_rounding or self.state_dtype is torch.bfloat16

    def seeds(self, params: list, index: Callable[[torch.Tensor], int],
              counts_steps: bool) -> list:
        """One rounding seed per parameter (0 where None): the stream of its position; the
        kernels mix in the step count, and for an algorithm without one the number of the
        coming call (``calls + 1``) is mixed in here. The caller advances ``calls`` once the
        kernel call succeeded (a refused step changes nothing)."""
        if counts_steps:
            return [0 if p is None else _C.rounding_seed(self.seed, index(p)) for p in params]
        return [0 if p is None else _C.rounding_seed(_C.rounding_seed(self.seed, index(p)),
                                                     self.calls + 1) for p in params]

    def format_of(self, p: torch.Tensor, key: str, int8_signed: dict) -> Any:
        """How state ``key`` of ``p`` is kept: torch.float32, torch.bfloat16 or "int8"."""
        if self.state_dtype == "int8":
            return "int8" if key in int8_signed and p.numel() >= INT8_MIN_NUMEL else torch.float32
        return self.state_dtype


def check_calls(where: str, calls: Any) -> int:
    """A saved rounding-call count (``Memory.calls``) as an int; ValueError naming
    ``rounding_calls`` unless it is an int >= 0."""
    if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 0:
        raise ValueError(f"{where}: rounding_calls must be an int >= 0, got {calls!r}")
    return int(calls)


#: Bytes per memory page, over which :func:`staggered_zeros` spreads a parameter's state.
PAGE = 4096


def staggered_zeros(p: torch.Tensor, slot: int, slots: int) -> torch.Tensor:
    """Float32 zeros shaped like ``p`` (a CPU tensor), for state slot ``slot`` of an algorithm
    keeping ``slots`` per-element state tensors. Below :data:`~roundpipe.host_buffers.LARGE`
    bytes, or for a parameter that is not float32, as ``host_zeros``. A large one gets its own
    memory mapping (freed with the tensor, as ``host_zeros``'), with its first element at the
    page offset of ``p``'s plus ``(slot + 1) * PAGE / (slots + 1)`` bytes (rounded down to a
    64-byte cache line), modulo :data:`PAGE`: slot k's element i then never shares its
    position in a page with the parameter's element i or another slot's. The mapping is private
    and advised for transparent huge pages (``MADV_HUGEPAGE``, where the OS has it; used when
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``): fewer TLB
    misses for a step streaming through several such arrays.

    Why: a step reads and writes element i of the parameter and of every state array together;
    with each array in a page-aligned mapping of its own (``host_zeros``, and a parameter
    allocated the same way) they all start at one page offset, and the step over one large
    tensor ran 5-6% slower than over the same bytes in many tensors, whose arrays malloc
    places at scattered offsets (docs/benchmarks.md: issue 37). The offset wastes at most a
    page per tensor and changes nothing else: the tensor is contiguous, its storage starts at
    its first element, and it saves and loads as any other."""
    n = p.numel()
    if n * 4 < LARGE or p.dtype != torch.float32 or not hasattr(mmap, "MAP_PRIVATE"):
        return host_zeros(p.shape, torch.float32)
    stride = PAGE // (slots + 1) // 64 * 64
    offset = (p.data_ptr() + (slot + 1) * stride) % PAGE // 64 * 64
    # private (as malloc's memory; a shared mapping is shmem, which gets no transparent huge
    # pages), zero-filled, freed with the tensor
    buffer = mmap.mmap(-1, n * 4 + offset, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=torch.float32, count=n, offset=offset).view(p.shape)


def new_state(memory: Memory, p: torch.Tensor, state: dict, key: str, fill: float,
              int8_signed: dict, slot: int = 0, slots: int = 1) -> None:
    """``state[key]`` (and, int8, ``state[key + "_absmax"]``) filled with ``fill``, shaped like
    ``p``, in ``memory``'s format for it; float32 state as :func:`staggered_zeros` places it
    for slot ``slot`` of ``slots``."""
    fmt = memory.format_of(p, key, int8_signed)
    if fmt == "int8":
        if fill == 0.0:  # the code of 0, any absmax
            codes = host_zeros(p.shape, torch.uint8)
            if int8_signed[key]:
                codes.fill_(127)
            state[key] = codes
            state[key + "_absmax"] = torch.zeros(math.ceil(p.numel() / QUANT_BLOCK))
        else:
            state[key], state[key + "_absmax"] = quantize(
                torch.full(p.shape, fill, dtype=torch.float32), int8_signed[key])
        return
    t = staggered_zeros(p, slot, slots) if fmt is torch.float32 else host_zeros(p.shape, fmt)
    if fill != 0.0:
        t.fill_(fill)
    state[key] = t


def as_float32(p_state: dict, state_keys: tuple, int8_signed: dict) -> dict:
    """A copy of one parameter's state with every per-element state tensor as float32 (new
    tensors where converted) and no ``_absmax`` entries: the layout of torch.optim."""
    out = {}
    for key, v in p_state.items():
        if key.endswith("_absmax") and key[:-7] in state_keys:
            continue
        if key in state_keys and torch.is_tensor(v) and v.dtype == torch.uint8:
            v = dequantize(v, p_state[key + "_absmax"], int8_signed.get(key, True))
        elif key in state_keys and torch.is_tensor(v) and v.dtype != torch.float32:
            v = v.to(torch.float32)
        out[key] = v
    return out


def check_absmax(where: str, saved: Any, key: str, p_state: dict, codes: torch.Tensor) -> None:
    """int8 codes in a loaded state dict come with ``<key>_absmax``: a float32 tensor of one
    value per block (ValueError otherwise)."""
    absmax = p_state.get(key + "_absmax")
    blocks = math.ceil(codes.numel() / QUANT_BLOCK)
    if not (torch.is_tensor(absmax) and absmax.dtype == torch.float32
            and absmax.numel() == blocks):
        raise ValueError(f"{where}: state {key!r} of parameter {saved} holds int8 codes, which "
                         f"need {key + '_absmax'!r}: a float32 tensor of {blocks} values")


def held_back(memory: Memory, p: torch.Tensor, key: str, value: Any, state_keys: tuple,
              int8_signed: dict) -> bool:
    """Whether a loaded state entry must bypass torch's loading, which casts state tensors to
    the parameter's dtype: int8 codes and their absmax, state of a bfloat16 parameter, state
    kept compactly here."""
    if not torch.is_tensor(value):
        return False
    slot = key[:-7] if key.endswith("_absmax") and key[:-7] in state_keys else key
    if slot not in state_keys:
        return False
    return (slot != key or value.dtype == torch.uint8 or p.dtype != torch.float32
            or memory.format_of(p, slot, int8_signed) is not torch.float32)


def store(memory: Memory, p: torch.Tensor, state: dict, key: str, values: dict,
          int8_signed: dict) -> None:
    """``state[key]`` (and ``_absmax``) from ``values[key]`` (and ``values[key + "_absmax"]``)
    in any form, converted to ``memory``'s format for it; a tensor already in that form is
    kept as it is (as torch's loading keeps a float32 tensor). float32 values become bfloat16
    rounded to nearest."""
    v = values[key]
    if not torch.is_tensor(v):
        state[key] = v
        return
    fmt = memory.format_of(p, key, int8_signed)
    is_signed = int8_signed.get(key, True)
    if fmt == "int8":
        if v.dtype == torch.uint8:
            state[key], state[key + "_absmax"] = v, values[key + "_absmax"]
            return
        state[key], state[key + "_absmax"] = quantize(
            v.detach().to(torch.float32).contiguous(), is_signed)
        return
    if v.dtype == torch.uint8:
        v = dequantize(v, values[key + "_absmax"], is_signed)
    if v.dtype != fmt:
        v = v.detach().to(fmt)
    state.pop(key + "_absmax", None)
    state[key] = v.contiguous()
