"""Quantized frozen weights (frozen_dtype="nf4" / "nf4-dq" / "int8", issue 25 item 1).

References are independent of roundpipe.quant: the NF4 code book is copied here from QLoRA
(Dettmers et al. 2023, appendix / bitsandbytes' ``get_4bit_type("nf4")``), quantization and
dequantization are written here in float64 (argmin over distances, not midpoints); training
is compared with plain PEFT on the same model whose frozen weights were replaced by their
dequantized values. Where bitsandbytes is installed (requirements-peers.txt pins it), its CPU
``quantize_4bit`` / ``dequantize_4bit`` are a second reference, bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim
from roundpipe.quant import (QuantizedLinear, dequantize, host_bytes, quantize,
                             quantize_frozen_linears)

from pipeline_models import causal_lm
from quant_reference import PUBLISHED_NF4, make_batch, reference_int8, reference_nf4

def sample_weight(dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=gen)  # 1961 values: a padded last block
    w[3] *= 50.0  # blocks of very different scales
    w.view(-1)[128:192] = 0.0  # an all-zero block
    w.view(-1)[200] = -w.view(-1)[192:256].abs().max() * 2  # a negative absmax
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_codes_and_values_equal_the_float64_reference(kind, dtype):
    w = sample_weight(dtype)
    codes, scales = quantize(w, kind)
    want_codes, want_scales, want_values = (reference_nf4 if kind == "nf4" else reference_int8)(w)
    assert codes.dtype == (torch.uint8 if kind == "nf4" else torch.int8)
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales, want_scales)
    got = dequantize(codes, scales, kind, w.shape, torch.float32)
    assert torch.equal(got, want_values)
    assert torch.equal(dequantize(codes, scales, kind, w.shape, dtype), want_values.to(dtype))
    err = (got - w.float()).abs().max() / w.float().abs().max()
    assert err < (0.3 if kind == "nf4" else 0.01)  # sanity: it is the weight


def test_nf4_code_book_is_the_published_one():
    from roundpipe.quant import NF4_CODE
    assert list(NF4_CODE) == PUBLISHED_NF4
    # every code point quantizes to itself; the high nibble is the first value of a pair
    w = torch.tensor(PUBLISHED_NF4 * 4)
    codes, scales = quantize(w, "nf4")
    assert codes[0] == 0x01 and codes[7] == 0xEF and torch.equal(scales, torch.ones(1))


def test_quantized_linear_forward_and_gradient_through_the_dequantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(64, 24).requires_grad_(False)
    lin.bias.requires_grad_(True)
    q = QuantizedLinear(lin, "nf4")
    assert q.bias is lin.bias and not q.weight_codes.requires_grad
    x = torch.randn(5, 64, requires_grad=True)
    w = dequantize(q.weight_codes, q.weight_scales.view(torch.float32), "nf4", (24, 64),
                   torch.float32)
    x_ref = x.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x_ref, w, lin.bias).square().sum().backward()
    lin.bias.grad = None
    q(x).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and lin.bias.grad is not None
    # the scales are kept as int32 bits: a dtype cast of the model leaves them exact
    scales = q.weight_scales.clone()
    q.to(torch.bfloat16)
    assert torch.equal(q.weight_scales, scales) and q.bias.dtype == torch.bfloat16
    assert next(p for p in q.parameters() if p.is_floating_point()) is q.bias
    assert q.weight.dtype == torch.bfloat16 and q(x.detach().bfloat16()).dtype == torch.bfloat16


def tiny_llama(seed: int = 0):
    return causal_lm("llama", seed, hidden_size=64, intermediate_size=128)


def lora_pair(kind: str):
    """(wrapped PEFT model on a quantized base, plain PEFT model on the dequantized base)."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
    base = tiny_llama()
    ref = peft.get_peft_model(copy.deepcopy(base), lora)
    model = peft.get_peft_model(copy.deepcopy(base), lora)
    model.load_state_dict(ref.state_dict())
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", num_microbatch=2,
                                          frozen_dtype=kind)
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    with torch.no_grad():
        for n, m in quantized.items():
            ref.get_submodule(n).weight.copy_(m.weight)
    return w, model, ref, quantized


@pytest.mark.parametrize("kind", ["nf4", "nf4-dq", "int8"])
def test_lora_on_a_quantized_base_equals_peft_on_the_dequantized_base(kind):
    w, model, ref, quantized = lora_pair(kind)
    # every frozen linear of the decoder is quantized; lm_head, embeddings, norms, LoRA are not
    assert len(quantized) == 2 * 7
    assert isinstance(model.get_output_embeddings(), nn.Linear)
    assert all(not isinstance(m, nn.Linear) or m.weight.requires_grad
               or m is model.get_output_embeddings() for m in model.modules())
    codes_before = {n: m.weight_codes.clone() for n, m in quantized.items()}
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad],
                                lr=1e-2, eps=1e-2)
    opt = roundpipe.optim.AdamW(w.optim_parameters(), lr=1e-2, eps=1e-2)
    for step in range(10):
        batch = make_batch(seed=100 + step)
        want = ref(**batch).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = w.forward_backward(input_kwargs=batch)
        w.step(opt)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    sd, sd_ref = w.state_dict(), ref.state_dict()
    assert set(sd) == set(sd_ref)  # the original names; the quantized ones dequantized
    for k in sd_ref:
        torch.testing.assert_close(sd[k], sd_ref[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")
    for n, m in quantized.items():
        assert torch.equal(m.weight_codes, codes_before[n]), n


def dq_bytes(m: QuantizedLinear) -> int:
    """nf4-dq's bytes of one linear: 4-bit codes, one 8-bit code per block of 64 (padded to 4
    bytes), a float32 scale per 256 blocks and the offset."""
    nb = -(-m.in_features * m.out_features // 64)
    return nb * 32 + -(-nb // 4) * 4 + 4 * (-(-nb // 256) + 1)


@pytest.mark.parametrize("kind, per_value", [("nf4", 0.5625), ("nf4-dq", None),
                                             ("int8", 1.0625)])
def test_host_bytes_and_uploads_are_the_packed_sizes(kind, per_value):
    w, model, ref, quantized = lora_pair(kind)
    packed, values = host_bytes(model)
    if per_value is None:
        assert packed == sum(dq_bytes(m) for m in quantized.values())
    else:
        assert packed == values * per_value
    assert packed / values <= (1.15 if kind == "int8" else 0.6)  # the targets
    w.pipeline_stats(reset=True)
    with torch.no_grad():
        w(input_ids=make_batch(0)["input_ids"])  # forward only: each stage uploaded once
    stats = w.pipeline_stats()
    unique = {id(p): p for p in model.parameters()}.values()
    want = sum(p.numel() * p.element_size() for p in unique)
    assert stats["h2d_weight_bytes"] == stats["weight_floor_bytes"] == want
    # = the plain model's weight bytes, with each quantized weight's dense bytes replaced by
    # its packed bytes
    dense = sum(m.in_features * m.out_features * 4 for m in quantized.values())
    plain = sum(p.numel() * p.element_size() for p in ref.parameters())
    assert want == plain - dense + packed


def test_trainable_weights_are_never_quantized():
    model = tiny_llama()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="trainable"):
        quantize_frozen_linears(model, "nf4", modules=["model.layers.0.self_attn.q_proj"])
    with pytest.raises(ValueError, match="no frozen nn.Linear"):
        roundpipe.wrap_model_to_roundpipe(model, device="cpu", frozen_dtype="nf4")
    with pytest.raises(ValueError, match="frozen_dtype"):
        roundpipe.wrap_model_to_roundpipe(model, device="cpu", frozen_dtype="fp4")
    with pytest.raises(ValueError, match="requires grad"):
        QuantizedLinear(model.model.layers[0].mlp.up_proj, "int8")
    assert all(isinstance(m, nn.Linear) for n, m in model.named_modules() if n.endswith("_proj"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_save_and_checkpoint_of_a_quantized_base(tmp_path):
    peft = pytest.importorskip("peft")
    w, model, ref, quantized = lora_pair("nf4")
    opt = roundpipe.optim.AdamW(w.optim_parameters(), lr=1e-2)
    w.forward_backward(input_kwargs=make_batch(1))
    w.step(opt)
    # the adapter, loadable by PEFT onto the dequantized base
    w.save_pretrained(tmp_path / "adapter")
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    w.save_pretrained(tmp_path / "merged", merged=True)
    base = tiny_llama()  # the plain model, its quantized weights replaced by their values
    with torch.no_grad():
        for n, m in quantized.items():
            plain = n.removeprefix("base_model.model.").removesuffix(".base_layer")
            base.get_submodule(plain).weight.copy_(m.weight)
    back = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids = make_batch(2)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, w(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    # merged: a plain transformers checkpoint of the dequantized base + adapter, no PEFT
    transformers = pytest.importorskip("transformers")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert isinstance(merged.model.layers[0].self_attn.q_proj, nn.Linear)
    assert merged.dtype == torch.float32 and not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, back(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
        # the merge worked on a copy: the wrapped model is unchanged
        torch.testing.assert_close(w(input_ids=ids).logits, back(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    assert all(isinstance(w.hf_model.get_submodule(n.removeprefix("base_model.model.")),
                          QuantizedLinear) for n in quantized)
    # a state dict round trip re-quantizes to the same codes
    codes = {n: m.weight_codes.clone() for n, m in quantized.items()}
    w.load_state_dict(w.state_dict())
    assert all(torch.equal(m.weight_codes, codes[n]) for n, m in quantized.items())
    # checkpoints leave the frozen base out
    roundpipe.save_checkpoint(str(tmp_path / "ckpt"), w, opt)
    import torch.distributed.checkpoint as dcp
    keys = set(dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata)
    assert not any(k.startswith("model.") and k[len("model."):] in
                   {f"{n}.weight" for n in quantized} for k in keys)
    assert any("lora_A" in k for k in keys)
    roundpipe.load_checkpoint(str(tmp_path / "ckpt"), w, opt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_roundpipe_on_a_plain_module(dtype):
    """RoundPipe(frozen_dtype=...) on an nn.Sequential (a frozen linear first, so the inputs'
    dtype comes from the bias, not from a scale) equals the plain module on the dequantized
    weight, for 3 SGD steps of the trainable linear."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).to(dtype)
    net[0].weight.requires_grad_(False)
    ref = copy.deepcopy(net)
    w = roundpipe.RoundPipe(net, torch.float32, device="cpu", num_microbatch=2,
                            frozen_dtype="int8")
    assert isinstance(net[0], QuantizedLinear) and isinstance(net[2], nn.Linear)
    with torch.no_grad():
        ref[0].weight.copy_(net[0].weight)
    opt_ref = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    opt = torch.optim.SGD(w.optim_parameters(), lr=0.1)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
        want = ref(x.to(dtype)).float().square().mean()
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = w.forward_backward((x,), loss_fn=lambda y: y.float().square().mean())
        w.step(opt)
        torch.testing.assert_close(got.detach(), want.detach(), **tol)


def test_the_dense_weights_are_released():
    import gc
    import weakref
    model = tiny_llama().requires_grad_(False)
    refs = [weakref.ref(m.weight) for n, m in model.named_modules() if n.endswith("_proj")]
    quantize_frozen_linears(model, "nf4")
    gc.collect()
    assert refs and all(r() is None for r in refs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_equals_bitsandbytes_bit_for_bit(dtype):
    """Where bitsandbytes is installed (requirements-peers.txt pins it), its CPU quantize_4bit
    (NF4, blocks of 64) is the independent reference: the same packed codes and block maxima,
    and dequantize_4bit gives our dequantized values."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(96, 128, generator=g) * torch.logspace(-3, 1, 128)).to(dtype)
    w[3, :64] = 0.0                                    # an all-zero block
    codes, scales = quantize(w, "nf4")
    ref_codes, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    ref_absmax = state.absmax.float()
    assert torch.equal(scales, ref_absmax)
    mismatch = (codes != ref_codes.reshape(-1)).sum().item()
    assert mismatch == 0, f"{mismatch} of {codes.numel()} packed bytes differ"
    ours = dequantize(codes, scales, "nf4", w.shape, dtype)  # in the weight's dtype, as theirs
    theirs = bnb.dequantize_4bit(ref_codes, state)
    assert theirs.dtype == dtype
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
