"""The fused dequantization kernel (issue 34 item 1: roundpipe.fused_dequant, one torch.compile'd
kernel per format and dtype) and the dequantization of a quantized base once per stage visit,
right after its upload (roundpipe.quant.dequantize_uploaded).

The kernel is what CUDA runs (Triton); here torch.compile generates C++ from the same graph
(``ROUNDPIPE_DEQUANT=compiled`` forces it on the CPU). References are independent of the code
under test: the float64 computation of the published formats written here (the exact product
of code-book value and scale, rounded to float32, then by torch to the output dtype), as in
tests/test_dequant.py; the torch-op path must give the same bits too.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import fused_dequant, quant
from roundpipe.quant import QuantizedLinear, dequantize, dequantize_torch, quantize
from roundpipe.transfer import DeviceIO

from quant_reference import PUBLISHED_NF4


def published_dynamic() -> torch.Tensor:
    """The signed dynamic map (bitsandbytes' create_dynamic_map(signed=True)) written from its
    definition: 0, 1 and per decade i the midpoints of linspace(0.1, 1, 2^i + 1) (float32)
    times 10^(i-6), and their negatives; float64 of the float32 values, ascending."""
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2
        values += (mids * 10.0 ** (i - 6)).tolist() + (mids * -(10.0 ** (i - 6))).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32).double()


def float64_reference(kind: str, codes, scales, shape, dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    nb = -(-n // 64)
    if kind == "int8":
        values = codes.double()
        absmax = scales.double()
    else:
        book = torch.tensor(PUBLISHED_NF4, dtype=torch.float64)
        values = book[torch.stack((codes.long() // 16, codes.long() % 16), -1).reshape(-1)]
        if kind == "nf4":
            absmax = scales.double()
        else:  # bytes: nb codes, padding to 4, float32 scale per 256 blocks, float32 offset
            q = scales[:nb].long()
            floats = scales[-(-nb // 4) * 4:].view(torch.float32)
            scale = floats[:-1].double().repeat_interleave(256)[:nb]
            product = (published_dynamic()[q] * scale).float()  # exact, rounded once
            absmax = (product + floats[-1]).double()          # float32 add: rounded again
    exact = values.view(-1, 64) * absmax[:, None]  # 24 x 24 bits: exact in float64
    return exact.reshape(-1)[:n].float().to(dtype).view(shape)


def weight(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])
    w.view(-1)[64:128] = 0.0  # an all-zero block
    return w


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setenv(fused_dequant.ENV, "compiled")


@pytest.mark.parametrize("kind, dtype", [("nf4", torch.bfloat16), ("nf4", torch.float16),
                                         ("nf4", torch.float32), ("nf4-dq", torch.bfloat16),
                                         ("nf4-dq", torch.float16), ("int8", torch.bfloat16),
                                         ("int8", torch.float16)])
def test_compiled_kernel_equals_the_float64_reference_and_the_torch_ops(kind, dtype, compiled):
    """Shapes with a partial last block and 1100 blocks (5 blocks of nf4-dq's second level):
    the compiled kernel (checked against the torch ops on its probe first), the float64
    reference and the torch-op path agree bit for bit, for every size with one compilation."""
    for shape, seed in (((37, 53), 1), ((550, 128), 2), ((3, 1000), 3)):
        w = weight(shape, seed)
        codes, scales = quantize(w, kind)
        got = dequantize(codes, scales, kind, shape, dtype)
        want = float64_reference(kind, codes, scales, shape, dtype)
        assert same_bits(got, want), (kind, dtype, shape)
        expanded = (quant.expand_absmax(scales, -(-w.numel() // 64)) if kind == "nf4-dq"
                    else scales)
        assert same_bits(dequantize_torch(codes, expanded, kind, shape, dtype), want)
    fn = fused_dequant.kernel(kind, dtype, torch.device("cpu"), {}, None)
    assert fn is not None  # cached: the same checked kernel, no second probe


@pytest.mark.parametrize("kind", ["nf4", "nf4-dq", "int8"])
def test_the_kernel_compiled_on_its_probe_serves_real_weights_without_recompiling(kind):
    """The kernel is compiled (and checked) on the probe; real weights must hit that
    compilation: a recompilation happens on the upload path (on CUDA a Triton compile, seconds)
    and gives a variant nobody checked. The arguments are what a model's upload gives
    (``nf4-dq``'s second level: views into its packed bytes at an offset), over weight shapes
    from 768 to 1.3M elements; counted by dynamo with a backend that compiles nothing."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    fn = fused_dequant.compile_body(kind, torch.bfloat16, backend=counter)
    with torch.no_grad():
        fn(*fused_dequant.probe(kind, torch.device("cpu"), quant._TABLES))
        for shape in ((64, 12), (37, 53), (550, 128), (3, 1000), (256, 257), (1024, 1280)):
            codes, scales = quantize(weight(shape, 5), kind)
            n = shape[0] * shape[1]
            got = fn(*quant._kernel_args(codes, scales, kind, -(-n // 64)), n)
            assert same_bits(got, dequantize_torch(
                codes, quant.expand_absmax(scales, -(-n // 64)) if kind == "nf4-dq" else scales,
                kind, (n,), torch.bfloat16))
    assert counter.frame_count == 1, kind
    torch._dynamo.reset()


def broken_compile(kind, dtype):
    """What compile_body gives where no compiler runs: torch.compile with a backend that fails
    (as inductor does without Triton or a C++ compiler)."""

    def no_compiler(gm, example_inputs):
        raise RuntimeError("no compiler on this machine")

    compiled = torch.compile(fused_dequant.BODIES[kind], backend=no_compiler, dynamic=True,
                             fullgraph=True)
    return lambda *args: compiled(*args, dtype)


def off_by_one_ulp(kind, dtype):
    """A kernel that compiles but is wrong by one unit in the last place somewhere."""
    body = fused_dequant.BODIES[kind]

    def wrong(*args):
        out = body(*args, dtype).clone()
        out.view(torch.int16)[7] += 1
        return out

    return wrong


@pytest.fixture
def fresh_kernels():
    fused_dequant.clear()
    yield
    fused_dequant.clear()


@pytest.mark.parametrize("make, why", [(broken_compile, "could not be compiled"),
                                       (off_by_one_ulp, "differs from the torch-op path")])
def test_the_torch_ops_are_chosen_where_the_kernel_fails(make, why, monkeypatch, fresh_kernels):
    """auto (what a CUDA device gets): the fallback, with one warning saying why, and the
    dequantized values are the torch ops'; compiled: a RuntimeError naming the variable."""
    monkeypatch.setattr(fused_dequant, "compile_body", make)
    cpu = torch.device("cpu")
    monkeypatch.setenv(fused_dequant.ENV, "auto")
    with pytest.warns(UserWarning, match=why):
        assert fused_dequant.kernel("nf4", torch.bfloat16, cpu, quant._TABLES,
                                    quant._torch_ops) is None
    with warnings_as_errors():  # decided once: no second compilation, no second warning
        assert fused_dequant.kernel("nf4", torch.bfloat16, cpu, quant._TABLES,
                                    quant._torch_ops) is None
    w = weight((9, 64), 0)
    codes, scales = quantize(w, "nf4")
    monkeypatch.setenv(fused_dequant.ENV, "compiled")
    with pytest.raises(RuntimeError, match=f"ROUNDPIPE_DEQUANT=compiled.*{why}"):
        dequantize(codes, scales, "nf4", w.shape, torch.bfloat16)


class warnings_as_errors:
    def __enter__(self):
        import warnings
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_which_path_each_mode_takes(monkeypatch, fresh_kernels):
    """auto on the CPU: the SIMD kernels, never a compilation; torch: the torch ops, on the CPU
    too; an unknown value: ValueError naming the variable."""
    w = weight((5, 128), 4)
    codes, scales = quantize(w, "int8")
    calls = []
    monkeypatch.setattr(fused_dequant, "compile_body",
                        lambda kind, dtype: calls.append(kind) or broken_compile(kind, dtype))
    simd = quant._C.dequantize_int8
    monkeypatch.setattr(quant._C, "dequantize_int8",
                        lambda *a: calls.append("simd") or simd(*a))
    monkeypatch.delenv(fused_dequant.ENV, raising=False)
    want = float64_reference("int8", codes, scales, w.shape, torch.bfloat16)
    assert same_bits(dequantize(codes, scales, "int8", w.shape, torch.bfloat16), want)
    assert calls == ["simd"]
    monkeypatch.setenv(fused_dequant.ENV, "torch")
    assert same_bits(dequantize(codes, scales, "int8", w.shape, torch.bfloat16), want)
    assert calls == ["simd"]
    monkeypatch.setenv(fused_dequant.ENV, "Compiled")
    with pytest.raises(ValueError, match="ROUNDPIPE_DEQUANT"):
        dequantize(codes, scales, "int8", w.shape, torch.bfloat16)


# --- dequantized once per stage visit, right after the upload ----------------------------------

def quantized_net() -> nn.Sequential:
    """Four layers, the weights of the two first linears frozen (their biases train)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 8))
    for m in (net[0], net[2]):
        m.weight.requires_grad_(False)
    return net


def test_a_stage_visit_dequantizes_each_weight_once_after_its_upload(monkeypatch):
    """Three microbatches, one layer per stage: each quantized weight is dequantized once per
    stage visit (forward and backward), not once per microbatch and recomputation; the dense
    weights go to the device I/O's keep-alive hook (CUDA: record_stream on the compute stream),
    are the values the layers compute with (loss and gradients equal plain PyTorch on the
    dequantized weights), and none outlives the call."""
    import copy

    net = quantized_net()
    ref = copy.deepcopy(net)
    w = roundpipe.RoundPipe(net, torch.float32, device="cpu", num_microbatch=3,
                            frozen_dtype="nf4")
    q = [m for m in net.modules() if isinstance(m, QuantizedLinear)]
    assert len(q) == 2
    with torch.no_grad():
        for i, m in ((0, q[0]), (2, q[1])):
            ref[i].weight.copy_(m.weight)
    counted, kept = [], []
    real = quant.dequantize
    monkeypatch.setattr(quant, "dequantize", lambda *a: counted.append(a[3]) or real(*a))
    monkeypatch.setattr(DeviceIO, "_keep_for_compute",
                        lambda self, t: kept.append(weakref.ref(t)))
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
    loss = w.forward_backward((x,), label=y, loss_fn=torch.nn.functional.mse_loss)
    # stages: 4 layers; the two quantized ones get a forward and a backward visit each
    assert sorted(counted) == sorted([m.weight_shape for m in q] * 2)
    assert len(kept) == 4
    gc.collect()
    assert all(r() is None for r in kept)
    assert all(getattr(m.weight_codes, quant._DENSE, None) is None for m in q)
    want = torch.nn.functional.mse_loss(ref(x), y)  # each microbatch weighs its share
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    grads = w.accumulated_grads()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)


def test_outside_a_visit_the_weight_is_dequantized_anew():
    """A QuantizedLinear used as a plain module (no stage visit) dequantizes at each access:
    a new tensor each time, writing to it changes nothing."""
    lin = nn.Linear(64, 8).requires_grad_(False)
    m = QuantizedLinear(lin, "int8")
    a, b = m.weight, m.weight
    assert a is not b and torch.equal(a, b)
    a.zero_()
    assert torch.equal(m.weight, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["nf4", "nf4-dq", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_fused_kernel_is_chosen_and_equals_the_float64_reference(kind, dtype, monkeypatch):
    """On CUDA (auto, as RoundPipe runs): the compiled Triton kernel passes its check (no
    warning, not refused) and gives the float64 reference's bits, as the torch ops do there."""
    import warnings

    monkeypatch.delenv(fused_dequant.ENV, raising=False)
    cuda = torch.device("cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refused kernel warns
        for shape, seed in (((37, 53), 1), ((550, 128), 2), ((4096, 1100), 3)):
            w = weight(shape, seed)
            codes, scales = quantize(w, kind)
            want = float64_reference(kind, codes, scales, shape, dtype)
            got = dequantize(codes.to(cuda), scales.to(cuda), kind, shape, dtype)
            assert same_bits(got.cpu(), want), (kind, dtype, shape)
    assert fused_dequant.why_not(kind, dtype, cuda) is None
    assert fused_dequant.kernel(kind, dtype, cuda, {}, None) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["nf4", "nf4-dq"])
def test_cuda_lora_on_a_quantized_base_equals_peft_on_the_dequantized_base(kind):
    """Through the pipeline on CUDA (the weights dequantized on the upload stream behind their
    copies, prefetched a stage ahead, three microbatches): 4 AdamW steps give plain PEFT's
    losses on the same GPU, the base holding the dequantized weights."""
    import copy

    peft = pytest.importorskip("peft")
    import roundpipe.optim
    from pipeline_models import causal_lm
    from quant_reference import make_batch

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
    base = causal_lm("llama", 0, hidden_size=64, intermediate_size=128)
    ref = peft.get_peft_model(copy.deepcopy(base), lora)
    model = peft.get_peft_model(copy.deepcopy(base), lora)
    model.load_state_dict(ref.state_dict())
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cuda:0",
                                          num_microbatch=3, frozen_dtype=kind)
    with torch.no_grad():
        for n, m in model.named_modules():
            if isinstance(m, QuantizedLinear):
                ref.get_submodule(n).weight.copy_(m.weight)
    ref = ref.cuda()
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                eps=1e-2)
    opt = roundpipe.optim.AdamW(w.optim_parameters(), lr=1e-2, eps=1e-2)
    for step in range(4):
        batch = make_batch(seed=100 + step)
        want = ref(**{k: v.cuda() for k, v in batch.items()}).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = w.forward_backward(input_kwargs=batch)
        w.step(opt)
        torch.testing.assert_close(got.cpu().float(), want.detach().cpu().float(),
                                   rtol=1e-4, atol=1e-5)
