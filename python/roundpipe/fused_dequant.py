"""The fused dequantization kernel of a quantized frozen base (:mod:`roundpipe.quant`): one
``torch.compile`` d function per format and output dtype, so that a whole weight is
dequantized by one generated kernel (Triton on CUDA, C++ on the CPU) reading the packed codes
and scales once and writing the weight once, instead of the six to ten torch ops (each a pass
over memory) of the torch-op path.

The function's body is the formats' arithmetic written in torch ops (:func:`nf4`,
:func:`nf4_dq`, :func:`int8`), the same operations as the torch-op path: each value is the
float32 product of its code-book value (or int8 code) and its block's float32 scale, rounded
once to the output dtype; ``"nf4-dq"``'s block absmax is ``code[q] * scale + offset`` with two
roundings. The compiler is asked to keep those roundings (``emulate_precision_casts``, which
also turns off Triton's contraction of a multiply and an add into an FMA, and no flushing of
denormals where the installed torch has that setting), and every kernel is checked once per
process, device type, format and dtype against the torch-op path on a probe that covers every
code and scales over 60 binades: it is used only if it gives the same bits.

Which path :func:`roundpipe.quant.dequantize` takes is set by the environment variable
``ROUNDPIPE_DEQUANT`` (read at each call):

- ``"auto"`` (default, also when unset or empty): on the CPU the SIMD kernels of
  ``roundpipe._C``; on other devices the compiled kernel, or, when it cannot be compiled
  (no Triton, no C++ compiler, an error of the compiler) or differs from the torch-op path on
  the probe, the torch-op path, with one ``UserWarning`` per device type, format and dtype
  saying why;
- ``"compiled"``: the compiled kernel on every device, the CPU included; ``RuntimeError`` when
  it cannot be compiled or differs;
- ``"torch"``: the torch-op path on every device.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Callable, Optional

import torch

ENV = "ROUNDPIPE_DEQUANT"
MODES = ("auto", "compiled", "torch")
BLOCK = 64       # values per scale (roundpipe.quant.BLOCK)
DQ_BLOCK = 256   # nf4-dq: absmax values per second-level scale (roundpipe.quant.DQ_BLOCK)

_kernels: dict[tuple, tuple[Optional[Callable], str]] = {}  # key -> (kernel or None, why not)
_errors: dict[tuple, BaseException] = {}  # key -> the compiler's error
_lock = threading.Lock()


def mode() -> str:
    """The dequantization path asked for by ``ROUNDPIPE_DEQUANT`` (see the module docstring).

    Raises:
        ValueError: the variable holds something else than ``auto``, ``compiled``, ``torch``.
    """
    value = os.environ.get(ENV, "") or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)} (or unset), got {value!r}")
    return value


# --- the arithmetic (traced by torch.compile) ---------------------------------------------------

def nf4(codes: torch.Tensor, absmax: torch.Tensor, table: torch.Tensor, n: int,
        dtype: torch.dtype) -> torch.Tensor:
    """NF4: uint8 ``codes`` ``(nb * 32,)`` (two indices per byte, the first in the high
    nibble), float32 ``absmax`` ``(nb,)``, float32 code book ``table`` ``(16,)`` -> the first
    ``n`` values, ``(n,)`` in ``dtype``."""
    idx = torch.stack((codes >> 4, codes & 15), dim=-1).view(-1).long()
    values = table[idx].view(-1, BLOCK) * absmax[:, None]
    return values.view(-1)[:n].to(dtype)


def nf4_dq(codes: torch.Tensor, q: torch.Tensor, floats: torch.Tensor, table: torch.Tensor,
           dynamic: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """NF4 with double quantization: as :func:`nf4`, the absmax of block ``b`` being
    ``dynamic[q[b]] * floats[b // 256] + floats[-1]`` in float32 (uint8 ``q`` ``(nb,)``,
    float32 ``floats`` ``(ceil(nb / 256) + 1,)``: the second-level scales, then the offset,
    as :func:`absmax_views` gives them; ``dynamic`` ``(256,)``)."""
    block = torch.arange(q.shape[0], device=q.device) // DQ_BLOCK
    absmax = dynamic[q.long()] * floats[:-1][block] + floats[-1:]
    return nf4(codes, absmax, table, n, dtype)


def absmax_views(packed: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The double-quantized absmax of ``nb`` blocks (``roundpipe.quant.compress_absmax``'s
    bytes: ``nb`` uint8 codes, zero padded to a multiple of 4, then the float32 second-level
    scales and offset) as :func:`nf4_dq`'s arguments, views without a copy: uint8 ``(nb,)``
    and float32 ``(ceil(nb / 256) + 1,)``. The kernel is compiled on views laid out so
    (:func:`probe`), as every real weight's are: its guards then hold for them (a probe of
    separate tensors recompiled at the first real weight, on the upload path, unchecked)."""
    return packed[:nb], packed[-(-nb // 4) * 4:].view(torch.float32)


def int8(codes: torch.Tensor, scales: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Blockwise int8: int8 ``codes`` ``(nb * 64,)``, float32 ``scales`` ``(nb,)`` -> the first
    ``n`` values of ``codes * scale``, ``(n,)`` in ``dtype``."""
    values = codes.view(-1, BLOCK).float() * scales[:, None]
    return values.view(-1)[:n].to(dtype)


BODIES = {"nf4": nf4, "nf4-dq": nf4_dq, "int8": int8}


# --- compiling and checking -------------------------------------------------------------------

def compile_options() -> dict:
    """Inductor options that keep eager's roundings (see the module docstring), those the
    installed torch knows."""
    from torch._inductor import config

    options = {"emulate_precision_casts": True}
    numerics = getattr(config, "eager_numerics", None)
    if numerics is not None and hasattr(numerics, "disable_ftz"):
        options["eager_numerics.disable_ftz"] = True
    return options


def compile_body(kind: str, dtype: torch.dtype, backend: Any = "inductor") -> Callable:
    """The compiled function for ``kind`` (``"nf4"``, ``"nf4-dq"``, ``"int8"``) writing
    ``dtype``: takes the body's tensor arguments and ``n`` (dynamic shapes: one compilation for
    every size; one per dtype and device type, each a guarded entry of the body's code object,
    so at most 6 of dynamo's 8 per code object). Compiles lazily, at the first call.
    ``backend``: torch.compile's (tests count compilations with their own)."""
    options = {"options": compile_options()} if backend == "inductor" else {}
    compiled = torch.compile(BODIES[kind], dynamic=True, fullgraph=True, backend=backend,
                             **options)

    def run(*args):
        return compiled(*args, dtype)

    return run


def probe(kind: str, device: torch.device, tables: dict) -> tuple:
    """Arguments of the body of ``kind`` on ``device`` covering every code (every byte value of
    the packed NF4 codes, int8 -127..127, every code of the second level) with scales over 60
    binades (products that overflow float16, float16 subnormals), zeros, and a few float32
    subnormal products, over 600 blocks (3 blocks of the second level) and a partial last
    block: ``(tensors..., n)``."""
    g = torch.Generator().manual_seed(34)
    nb = 600
    n = nb * BLOCK - 17
    scales = torch.exp2(torch.rand(nb, generator=g) * 60 - 40)
    scales[::13] = 0.0
    scales[5::101] = 2.0 ** -125  # float32 subnormal products (a flush to zero shows)
    if kind == "int8":
        codes = torch.randint(-127, 128, (nb * BLOCK,), dtype=torch.int8, generator=g)
        return codes.to(device), scales.to(device), n
    codes = torch.randint(0, 256, (nb * BLOCK // 2,), dtype=torch.uint8, generator=g)
    codes[:256] = torch.arange(256, dtype=torch.uint8)
    if kind == "nf4":
        return codes.to(device), scales.to(device), tables["nf4"].to(device), n
    nb2 = -(-nb // DQ_BLOCK)
    packed = torch.zeros(-(-nb // 4) * 4 + 4 * (nb2 + 1), dtype=torch.uint8, device=device)
    q, floats = absmax_views(packed, nb)  # laid out as a real weight's (see absmax_views)
    q.copy_(torch.randint(0, 256, (nb,), dtype=torch.uint8, generator=g))
    q[:256] = torch.arange(256, dtype=torch.uint8)
    floats.copy_(torch.cat((torch.exp2(torch.rand(nb2, generator=g) * 20 - 10),    # scales
                            torch.exp2(torch.rand(1, generator=g) * 10 - 8))))     # offset
    return (codes.to(device), q, floats, tables["nf4"].to(device),
            tables["dynamic"].to(device), n)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() in (2, 4, 8):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(bits), b.view(bits))
    return torch.equal(a, b)


def kernel(kind: str, dtype: torch.dtype, device: torch.device, tables: dict,
           reference: Callable, required: bool = False) -> Optional[Callable]:
    """The checked compiled kernel of ``kind`` writing ``dtype`` for tensors on ``device``'s
    type, or None where the torch-op path is to be used (see the module docstring). The first
    call per (device type, kind, dtype) compiles and checks it (seconds); later calls return
    what it found.

    Args:
        kind: ``"nf4"``, ``"nf4-dq"`` or ``"int8"``.
        dtype: the output dtype.
        device: where the tensors are.
        tables: ``{"nf4": float32 (16,), "dynamic": float32 (256,)}`` code books (any device).
        reference: ``reference(kind, args, dtype)``: the torch-op path's result for the body's
            arguments ``args`` (tensors..., n), what the kernel must equal bit for bit.
        required: raise instead of returning None (``ROUNDPIPE_DEQUANT=compiled``).

    Raises:
        RuntimeError: ``required`` and the kernel cannot be compiled or differs from
            ``reference`` (the compiler's error chained).
    """
    key = (device.type, kind, dtype)
    with _lock:
        if key not in _kernels:
            _kernels[key] = _build(kind, dtype, device, tables, reference)
        fn, reason = _kernels[key]
    if fn is None and required:
        raise RuntimeError(f"{ENV}=compiled: the compiled {kind} dequantization kernel into "
                           f"{dtype} on {device.type} {reason}") from _errors.get(key)
    return fn


def _build(kind: str, dtype: torch.dtype, device: torch.device, tables: dict,
           reference: Callable) -> tuple[Optional[Callable], str]:
    """``(checked compiled function, "")`` or ``(None, why not)``; warns when it is None."""
    args = probe(kind, device, tables)
    try:
        fn = compile_body(kind, dtype)
        with torch.no_grad():
            got = fn(*args)
    except Exception as e:  # the compiler's own errors are of many types
        _errors[(device.type, kind, dtype)] = e
        reason = f"could not be compiled ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    else:
        with torch.no_grad():
            want = reference(kind, args, dtype)
        if _same_bits(got, want):
            return fn, ""
        reason = "differs from the torch-op path on the probe"
    if mode() == "auto":
        warnings.warn(f"RoundPipe: the compiled {kind} dequantization kernel into {dtype} on "
                      f"{device.type} {reason}; dequantizing with torch ops (slower, the same "
                      f"bits). {ENV}=torch silences this", UserWarning, stacklevel=4)
    return None, reason


def why_not(kind: str, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """Why :func:`kernel` refused the kernel of ``kind`` into ``dtype`` on ``device``'s type
    (None: not refused, or not tried yet)."""
    with _lock:
        entry = _kernels.get((device.type, kind, dtype))
    return entry[1] if entry is not None and entry[0] is None else None


def clear() -> None:
    """Forgets every kernel compiled or refused (the next use compiles and checks again)."""
    with _lock:
        _kernels.clear()
        _errors.clear()
