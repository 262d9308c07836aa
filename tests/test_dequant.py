"""Dequantization of quantized frozen weights on the CPU (issue 25 item 1: the SIMD kernels of
roundpipe._C, cpp/include/roundpipe/dequant.hpp) and QLoRA's double quantization of the absmax
(frozen_dtype="nf4-dq").

References are independent of the code under test: a float64 computation written here from
the published code books (the exact product of code-book value and scale, rounded to float32,
then by torch to the output dtype), and bitsandbytes' CPU ``quantize_4bit`` /
``dequantize_4bit`` / ``create_dynamic_map`` where it is installed (requirements-peers.txt pins
it). The CPU kernels are run under every ISA this CPU supports; they must give the bits of the
torch-op path (what CUDA runs) too.
"""

from __future__ import annotations

import pytest
import torch

from roundpipe import _C, quant
from roundpipe.quant import (DQ_BLOCK, dequantize, dequantize_torch, dynamic_code,
                             expand_absmax, quantize)

PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def each_isa():
    """Yields a function running ``fn()`` once per supported ISA, that ISA forced."""
    before = _C.active_isa()

    def run(fn):
        for isa in _C.supported_isas():
            _C.set_isa(isa)
            fn(isa)
    yield run
    _C.set_isa(before)


def random_codes(kind: str, n: int, seed: int):
    """Codes covering every byte value and per-block scales over 40 binades (float16 overflow
    and subnormals included), some zero."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-n // 64)
    if kind == "nf4":
        codes = torch.randint(0, 256, (nb * 32,), dtype=torch.uint8, generator=g)
    else:
        codes = torch.randint(-127, 128, (nb * 64,), dtype=torch.int8, generator=g)
    scales = torch.exp2(torch.rand(nb, generator=g) * 40 - 25)
    scales[::11] = 0.0
    return codes, scales


def float64_reference(kind: str, codes, scales, n: int, dtype) -> torch.Tensor:
    if kind == "nf4":
        book = torch.tensor(PUBLISHED_NF4, dtype=torch.float64)
        idx = torch.stack((codes.long() // 16, codes.long() % 16), dim=-1).reshape(-1)
        values = book[idx]
    else:
        values = codes.double()
    exact = values.view(-1, 64) * scales.double()[:, None]  # exact: 24 x 24 bits < 53
    return exact.reshape(-1)[:n].float().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("shape", [(3, 7), (64,), (37, 53), (3, 64 * 1024 + 5)])
def test_cpu_kernel_equals_float64_reference_and_torch_ops(kind, dtype, shape, each_isa):
    n = shape[0] * shape[1] if len(shape) == 2 else shape[0]
    codes, scales = random_codes(kind, n, seed=n)
    want = float64_reference(kind, codes, scales, n, dtype).view(shape)
    torch_ops = dequantize_torch(codes, scales, kind, shape, dtype)
    assert torch.equal(torch_ops, want)

    def check(isa):
        got = dequantize(codes, scales, kind, shape, dtype)
        assert got.dtype == dtype and got.shape == shape
        # bitwise: NaN-free, and -0.0 vs 0.0 counts
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), isa
    each_isa(check)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_the_torch_ops_work_in_chunks_of_bounded_temporaries(kind, monkeypatch):
    """The torch-op path (CUDA's where the compiled kernel is refused) makes int32 indices and
    float32 products per value: over a whole weight 3-4x its dense size, on the weights stream
    while the current stage computes. In chunks of 3 blocks here (a partial last chunk and a
    partial last block), every intermediate it makes is at most a chunk's float32 values, and
    the result is the float64 reference's bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n = 64 * 10 + 17
    codes, scales = random_codes(kind, n, seed=3)
    monkeypatch.setattr(quant, "TORCH_CHUNK_BLOCKS", 3)
    largest = [0]

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.int32,
                                                                torch.int64):
                    largest[0] = max(largest[0], t.numel() * t.element_size())
            return out

    with Sizes():
        got = dequantize_torch(codes, scales, kind, (n,), torch.bfloat16)
    assert torch.equal(got, float64_reference(kind, codes, scales, n, torch.bfloat16))
    assert 0 < largest[0] <= 3 * 64 * 4


def test_big_tensors_use_the_pool_and_give_the_same_bits():
    codes, scales = random_codes("nf4", 2_000_003, seed=1)
    want = dequantize_torch(codes, scales, "nf4", (2_000_003,), torch.bfloat16)
    before = _C.num_threads()
    try:
        for threads in (1, 2, 4):
            _C.set_num_threads(threads)
            got = dequantize(codes, scales, "nf4", (2_000_003,), torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), threads
    finally:
        _C.set_num_threads(before)


def test_kernel_argument_errors_name_the_argument_and_write_nothing():
    codes, scales = random_codes("nf4", 128, seed=0)
    out = torch.full((128,), 7.0)
    cases = [
        (lambda: _C.dequantize_nf4(codes.view(torch.int8), scales, out), TypeError, "codes"),
        (lambda: _C.dequantize_nf4(codes, scales.double(), out), TypeError, "absmax"),
        (lambda: _C.dequantize_nf4(codes, scales, out.int()), TypeError, "out"),
        (lambda: _C.dequantize_nf4(codes[:63], scales, out), ValueError, "codes"),
        (lambda: _C.dequantize_nf4(codes, scales[:1], out), ValueError, "scale"),
        (lambda: _C.dequantize_int8(codes.view(torch.int8), scales, out), ValueError, "codes"),
        (lambda: _C.dequantize_int8(codes, scales, out), TypeError, "int8"),
    ]
    for call, error, word in cases:
        with pytest.raises(error, match=word):
            call()
        assert torch.equal(out, torch.full((128,), 7.0))
    with pytest.raises(TypeError):  # not C-contiguous
        _C.dequantize_nf4(codes, scales, torch.empty(256)[::2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernel_equals_bitsandbytes_dequantize_4bit(dtype):
    bnb = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(5)
    # rows a multiple of 64 long: bitsandbytes' CPU dequantize_4bit (0.50.2) misplaces values
    # of blocks that straddle rows (its codes and absmax are right; dequantize_4bit is not)
    w = (torch.randn(80, 192, generator=g) * torch.logspace(-3, 1, 192)).to(dtype)
    ref_codes, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    theirs = bnb.dequantize_4bit(ref_codes, state)
    ours = dequantize(ref_codes.reshape(-1), state.absmax.float(), "nf4", w.shape, dtype)
    assert torch.equal(ours.view(-1).view(torch.uint8), theirs.view(-1).view(torch.uint8))


# --- double quantization ("nf4-dq") ----------------------------------------------------------

def test_dynamic_code_is_bitsandbytes_and_the_published_definition():
    code = dynamic_code().double()
    # Dettmers 2016: 0, 1, and per decade i = 0..6 the 2^i midpoints of [0.1, 1] cut in 2^i
    # equal bins, times 10^(i-6), with their negatives; float32 arithmetic leaves <= 1 ulp
    want = [0.0, 1.0]
    for i in range(7):
        for j in range(2 ** i):
            v = 10.0 ** (i - 6) * (0.1 + 0.9 * (j + 0.5) / 2 ** i)
            want += [v, -v]
    want = torch.tensor(sorted(want), dtype=torch.float64)
    assert torch.allclose(code, want, rtol=2 ** -22, atol=0)
    bnb = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(dynamic_code(), bnb.create_dynamic_map(signed=True).float())


def dq_weight(seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # 700 blocks of 64 (three blocks of 256 absmax, the last partial), scales over 3 decades
    return torch.randn(350, 128, generator=g) * torch.logspace(-2, 1, 128)


def test_double_quantization_equals_a_float64_reference():
    w = dq_weight()
    codes, packed = quantize(w, "nf4-dq")
    codes_nf4, absmax = quantize(w, "nf4")
    assert torch.equal(codes, codes_nf4)  # the 4-bit codes do not change
    nb = absmax.numel()
    # second level written here: offset = float32 mean; per 256 the absmax of absmax - offset;
    # each the nearest map value in float64 (argmin: the first of equals)
    offset = absmax.mean()
    centred = absmax - offset
    pad = torch.cat([centred, centred.new_zeros(-nb % DQ_BLOCK)]).view(-1, DQ_BLOCK)
    scale = pad.abs().amax(dim=1)
    y = (pad.double() / scale.double()[:, None]).reshape(-1)[:nb]
    book = torch.tensor(sorted(_published_dynamic()), dtype=torch.float64)
    assert torch.equal(book.float(), dynamic_code())
    q = (y[:, None] - book).abs().argmin(dim=1)
    assert packed.dtype == torch.uint8
    assert torch.equal(packed[:nb].long(), q)
    floats = packed[-(4 * (scale.numel() + 1)):].view(torch.float32)
    assert torch.equal(floats[:-1], scale) and floats[-1] == offset
    # read back: code * scale + offset in float32, then NF4
    want_absmax = (book[q].float() * scale.repeat_interleave(DQ_BLOCK)[:nb]) + offset
    assert torch.equal(expand_absmax(packed, nb), want_absmax)
    for dtype in DTYPES:
        want = float64_reference("nf4", codes, want_absmax, w.numel(), dtype).view(w.shape)
        assert torch.equal(dequantize(codes, packed, "nf4-dq", w.shape, dtype), want)
    err = (dequantize(codes, packed, "nf4-dq", w.shape, torch.float32) - w).abs().max()
    assert err / w.abs().max() < 0.3  # sanity: it is the weight
    assert (packed.numel() + codes.numel()) / w.numel() < 0.52


def _published_dynamic() -> list[float]:
    """The signed dynamic map's float32 values: bitsandbytes' create_dynamic_map(signed=True)
    where installed, else its definition written here (per decade i, the midpoints of
    ``torch.linspace(0.1, 1, 2^i + 1)`` times 10^(i-6), in float32): the codes depend on the
    exact float32 values."""
    try:
        import bitsandbytes.functional as bnb
        return bnb.create_dynamic_map(signed=True).float().tolist()
    except ImportError:
        pass
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2
        values += (mids * 10.0 ** (i - 6)).tolist() + (mids * -(10.0 ** (i - 6))).tolist()
    return values


def test_double_quantization_against_bitsandbytes():
    """bitsandbytes' quantize_4bit(compress_statistics=True): the same offset and second-level
    scales; its 8-bit codes where they differ from ours (its CPU quantizer sends values below
    ~2e-5 of the scale to a coarser code) are never nearer than ours; our dequantization of
    *its* nested state equals its dequantize_4bit bit for bit."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    for dtype in (torch.float32, torch.bfloat16):
        w = dq_weight().to(dtype)
        codes, packed = quantize(w, "nf4-dq")
        ref_codes, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                             compress_statistics=True)
        assert state.nested and state.state2.blocksize == DQ_BLOCK
        assert torch.equal(codes, ref_codes.reshape(-1))
        nb = codes.numel() // 32
        floats = packed[-(4 * (state.state2.absmax.numel() + 1)):].view(torch.float32)
        assert torch.equal(floats[:-1], state.state2.absmax) and floats[-1] == state.offset
        ours, theirs = packed[:nb].long(), state.absmax.long()
        code = dynamic_code().double()
        y = (expand_absmax(packed, nb).double() - state.offset.double())  # ~ target values
        scale = state.state2.absmax.double().repeat_interleave(DQ_BLOCK)[:nb]
        dist = lambda q: (code[q] * scale - y).abs()
        differ = ours != theirs
        assert torch.all(dist(ours)[differ] <= dist(theirs)[differ])
        # their nested state through our read-back
        bytes_ = packed.clone()
        bytes_[:nb] = state.absmax
        got = dequantize(ref_codes.reshape(-1), bytes_, "nf4-dq", w.shape, dtype)
        want = bnb.dequantize_4bit(ref_codes, state)
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
