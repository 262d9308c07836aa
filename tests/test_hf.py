"""Hugging Face causal LMs through wrap_model_to_roundpipe, against the unwrapped HF / PEFT model.

Tiny fp32 models built from configs (random weights, no downloads); every reference is the HF
model itself (``model(**batch).loss`` and its autograd gradients, plain PyTorch / PEFT training).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import roundpipe  # noqa: E402
import roundpipe.optim  # noqa: E402
from roundpipe.hf import HFRoundPipe, chunked_cross_entropy_sum  # noqa: E402

from pipeline_models import HF_VOCAB as VOCAB  # noqa: E402
from pipeline_models import causal_lm  # noqa: E402


def make_model(kind: str, seed: int = 0) -> nn.Module:
    return causal_lm(kind, seed)


def make_batch(seed: int = 1, batch: int = 3, seq: int = 11):
    """Right padding in two rows, ignored label spans, as a tokenizer + collator would give."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 4:] = 0
    mask[2, seq - 7:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads_of(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_dicts(got: dict, want: dict, rtol=1e-5, atol=1e-6):
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


def wrapped_grads(w) -> dict:
    """The accumulated gradients, by name, as ``step`` hands them to the optimizer copies
    (the step itself changes nothing)."""
    return w.step(lambda: {n: p.grad.clone() for n, p in w.optim_named_parameters()
                           if p.grad is not None})


def train_both(ref, opt_ref, w, opt, seed: int, steps: int = 5) -> None:
    """``steps`` steps of the reference model (plain PyTorch) and of the wrapper on the same
    batches; the losses must agree at every step."""
    for step in range(steps):
        batch = make_batch(seed=seed + step)
        want = ref(**batch).loss
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = w.forward_backward(input_kwargs=batch)
        w.step(opt)
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


KINDS = ["llama", "qwen3_tied", "qwen3", "qwen3_moe", "mistral_sliding"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_microbatch", [1, 2, 3])
def test_loss_and_gradients_equal_hf(kind, num_microbatch):
    model = make_model(kind)
    batch = make_batch()
    ref = model(**batch)
    ref.loss.backward()
    want = grads_of(model)
    model.zero_grad()
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu",
                                          num_microbatch=num_microbatch, loss_chunk_size=5)
    assert isinstance(w, HFRoundPipe)
    loss = w.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-6, atol=1e-6)
    got = wrapped_grads(w)
    if kind == "qwen3_tied":  # one parameter, one optimizer copy, under the embedding's name
        assert "lm_head.weight" not in got and "model.embed_tokens.weight" in got
        want.pop("lm_head.weight", None)
    assert_close_dicts(got, want)
    out = w(**batch)
    torch.testing.assert_close(out.logits, ref.logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss.detach(), rtol=1e-6, atol=1e-6)


def test_moe_aux_loss_of_the_whole_batch_on_two_workers():
    """The router aux loss changes the gate gradients (so the comparison can fail), and with
    two CPU workers (stages running concurrently) the gradients are still HF's."""
    model = make_model("qwen3_moe")
    batch = make_batch()
    ref = model(**batch)
    assert ref.aux_loss > 0
    ref.loss.backward()
    want = grads_of(model)
    model.zero_grad()
    model.config.output_router_logits = False
    model(**batch).loss.backward()
    no_aux = grads_of(model)
    model.zero_grad()
    model.config.output_router_logits = True
    gate = "model.layers.0.mlp.gate.weight"
    assert (want[gate] - no_aux[gate]).abs().max() > 1e-4
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device=["cpu", "cpu"],
                                          num_microbatch=3)
    loss = w.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.loss.detach(), rtol=1e-6, atol=1e-6)
    assert_close_dicts(wrapped_grads(w), want)
    out = w(**batch)
    torch.testing.assert_close(out.aux_loss, ref.aux_loss.detach(), rtol=1e-6, atol=1e-7)


def test_moe_routing_kept_for_the_recomputation(monkeypatch):
    """The recomputation uses the forward pass's top-k choice, not a new one: a router whose
    choice would differ the second time still trains as the forward pass routed."""
    model = make_model("qwen3_moe")
    model.config.output_router_logits = False
    batch = make_batch()
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", num_microbatch=1)
    router_cls = type(model.model.layers[0].mlp.gate)
    original = router_cls.forward
    calls = {"n": 0}

    def flaky(self, hidden):
        logits, scores, idx = original(self, hidden)
        calls["n"] += 1
        if roundpipe.doing_recompute():
            idx = (idx + 1) % self.num_experts  # a different choice, if it were used
        return logits, scores, idx

    ref = copy.deepcopy(model)
    ref(**batch).loss.backward()
    want = grads_of(ref)
    monkeypatch.setattr(router_cls, "forward", flaky)
    w.forward_backward(input_kwargs=batch)
    assert calls["n"] == 4  # 2 layers, forward pass + recomputation
    assert_close_dicts(wrapped_grads(w), want)


def test_moe_layer_in_the_last_stage_with_aux_loss_is_refused():
    model = make_model("qwen3_moe")
    with pytest.raises(ValueError, match="last stage"):
        roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", layers_per_stage=2)
    roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", layers_per_stage=3)


@pytest.mark.parametrize("kind", ["llama", "qwen3_tied", "qwen3_moe"])
def test_training_equals_plain_pytorch(kind):
    """5 steps of AdamW (eps near lr: see docs/design.md §5) on the same batches."""
    ref = make_model(kind)
    model = copy.deepcopy(ref)
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", num_microbatch=2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-3, weight_decay=0.01)
    opt = roundpipe.optim.AdamW(w.optim_parameters(), lr=1e-3, eps=1e-3, weight_decay=0.01)
    train_both(ref, opt_ref, w, opt, seed=10)
    sd = w.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("kind", ["qwen3_tied", "qwen3"])
def test_save_pretrained_reloads_with_plain_transformers(kind, tmp_path):
    model = make_model(kind)
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu")
    opt = torch.optim.SGD(w.optim_parameters(), lr=0.5)
    w.forward_backward(input_kwargs=make_batch())
    w.step(opt)
    batch = make_batch(seed=5)
    logits = w(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    w.save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(back) is type(model)
    torch.testing.assert_close(back(input_ids=batch["input_ids"],
                                    attention_mask=batch["attention_mask"]).logits,
                               logits, rtol=1e-5, atol=1e-6)
    assert back.config.tie_word_embeddings == (kind == "qwen3_tied")
    # the state dict moves between the wrapper and the unwrapped model both ways
    w.load_state_dict(back.state_dict())
    back.load_state_dict(w.state_dict())
    w.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert half.dtype == torch.bfloat16


def test_lora_equals_plain_peft_and_leaves_the_base_untouched(tmp_path):
    base = make_model("llama")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
    ref = peft.get_peft_model(copy.deepcopy(base), lora)
    model = peft.get_peft_model(copy.deepcopy(base), lora)
    model.load_state_dict(ref.state_dict())
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", num_microbatch=3)
    trainable = [n for n, _ in w.optim_named_parameters()]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == sum(p.requires_grad for p in ref.parameters())
    frozen_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=1e-2)
    opt = roundpipe.optim.AdamW(w.optim_parameters(), lr=1e-2, eps=1e-2)
    train_both(ref, opt_ref, w, opt, seed=20)
    sd, sd_ref = w.state_dict(), ref.state_dict()
    assert set(sd) == set(sd_ref)
    for k in sd_ref:
        torch.testing.assert_close(sd[k], sd_ref[k], rtol=1e-5, atol=1e-6)
    for k, v in frozen_before.items():
        assert torch.equal(model.state_dict()[k], v), k
    batch = make_batch(seed=99)
    want = ref(input_ids=batch["input_ids"]).logits
    w.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    back = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter")
    torch.testing.assert_close(back(input_ids=batch["input_ids"]).logits, want, rtol=1e-5, atol=1e-5)
    w.save_pretrained(tmp_path / "merged", merged=True)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(input_ids=batch["input_ids"]).logits, want, rtol=1e-5, atol=1e-5)


def test_num_items_in_batch_overrides_the_count():
    """Gradient accumulation over two calls as HF's Trainer does it: each call divides by the
    token count of both; the summed gradients are those of the concatenated batch."""
    model = make_model("qwen3")
    a, b = make_batch(seed=3), make_batch(seed=4)
    both = {k: torch.cat([a[k], b[k]]) for k in a}
    model(**both).loss.backward()
    want = grads_of(model)
    model.zero_grad()
    count = sum(int((x["labels"][:, 1:] != -100).sum()) for x in (a, b))
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu")
    la = w.forward_backward(input_kwargs={**a, "num_items_in_batch": count})
    lb = w.forward_backward(input_kwargs={**b, "num_items_in_batch": torch.tensor(count)})
    torch.testing.assert_close(la + lb, model(**both).loss.detach(), rtol=1e-6, atol=1e-6)
    assert_close_dicts(wrapped_grads(w), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_unchunked(dtype):
    """Chunks of 3 tokens against HF's ForCausalLMLoss on the full logits (sum reduction),
    values and gradients; bf16 within bf16 rounding of the gradient."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 16, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, 16, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(VOCAB, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, 7), generator=gen)
    labels[1, :2] = -100
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    got = chunked_cross_entropy_sum(hidden, weight, bias, targets, chunk_size=3)
    (got * 0.5).backward()
    g = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    logits = torch.nn.functional.linear(hidden, weight, bias)
    want = ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=torch.tensor(1))
    (want * 0.5).backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want.detach().float(), **tol)
    for a, t in zip(g, (hidden, weight, bias)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), t.grad.float(), **tol)


def test_unsupported_models_and_fallback():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=32))
    with pytest.raises(TypeError, match="decoder layers .* do not take position_embeddings"):
        roundpipe.wrap_model_to_roundpipe(gpt2, device="cpu")
    model = make_model("llama")
    del model.model.rotary_emb
    with pytest.raises(TypeError, match="no rotary embedding found"):
        roundpipe.wrap_model_to_roundpipe(model, device="cpu")
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    w = roundpipe.wrap_model_to_roundpipe(plain, torch.float32, device="cpu")
    assert type(w) is roundpipe.RoundPipe
    x = torch.randn(5, 4)
    torch.testing.assert_close(w(x), plain(x))


def test_hf_attributes_checkpointing_and_input_errors():
    model = make_model("qwen3")
    model.gradient_checkpointing_enable()
    w = roundpipe.wrap_model_to_roundpipe(model, device="cpu")
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert w.config is model.config and w.generation_config is model.generation_config
    assert w.vocab_size == VOCAB
    batch = make_batch()
    with pytest.raises(TypeError, match="labels"):
        w.forward_backward(input_kwargs={"input_ids": batch["input_ids"]})
    with pytest.raises(TypeError, match="output_attentions"):
        w(input_ids=batch["input_ids"], output_attentions=True)
    with pytest.raises(TypeError, match="PipelineCache"):  # a KV cache: tests/test_generate.py
        w(input_ids=batch["input_ids"], cache=transformers.DynamicCache())
    with pytest.raises(ValueError, match="loss_chunk_size"):
        roundpipe.wrap_model_to_roundpipe(model, device="cpu", loss_chunk_size=0)
    # a custom loss_fn receives the logits of each microbatch
    logits = w(input_ids=batch["input_ids"]).logits
    target = torch.zeros_like(logits)
    loss = w.forward_backward(input_kwargs={"input_ids": batch["input_ids"]}, label=target,
                              loss_fn=lambda out, y: (out - y).square().sum() / target.numel(),
                              num_microbatch=3, loss_reduction="sum")
    torch.testing.assert_close(loss, (logits - target).square().mean(), rtol=1e-5, atol=1e-6)


def test_layers_must_belong_to_the_model():
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"'weight' of layers\[1\] is not a parameter"):
        roundpipe.RoundPipe(net, layers=[net[0], nn.Linear(3, 3)], device="cpu")
    with pytest.raises(ValueError, match="must not be empty"):
        roundpipe.RoundPipe(net, layers=[], device="cpu")
    w = roundpipe.RoundPipe(net, layers=[net[1], net[0]], device="cpu")  # order as given
    x = torch.randn(2, 3)
    torch.testing.assert_close(w(x), net[0](net[1](x)))
    assert list(w.state_dict()) == list(net.state_dict())


def test_decoder_layers_compiled_before_wrapping_train_as_hf():
    """Decoder layers compiled (Module.compile, before wrapping) run compiled inside the
    pipeline (graphs captured once, not per step) and train as the uncompiled HF model.
    The aot_eager backend keeps the test fast; what is tested is the capture through the
    pipeline's functional calls, threads and recomputation, not inductor's code."""
    from torch._dynamo.utils import counters

    ref = make_model("qwen3")
    model = copy.deepcopy(ref)
    torch._dynamo.reset()
    counters.clear()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device=["cpu", "cpu"],
                                          num_microbatch=2)
    train_both(ref, torch.optim.SGD(ref.parameters(), lr=0.1), w,
               torch.optim.SGD(w.optim_parameters(), lr=0.1), seed=3, steps=1)
    graphs = counters["stats"]["unique_graphs"]
    train_both(ref, torch.optim.SGD(ref.parameters(), lr=0.1), w,
               torch.optim.SGD(w.optim_parameters(), lr=0.1), seed=4, steps=2)
    assert graphs > 0 and counters["stats"]["unique_graphs"] == graphs


def test_torch_compile_of_the_wrapped_model_runs_it_eagerly_and_to_cpu_is_a_no_op():
    ref = make_model("qwen3")
    w = roundpipe.wrap_model_to_roundpipe(copy.deepcopy(ref), torch.float32, device="cpu")
    assert w.to("cpu") is w and w.cpu() is w
    with pytest.raises(TypeError, match="device="):
        w.half()
    batch = make_batch()
    with pytest.warns(UserWarning, match="do not compile a RoundPipe"):
        out = torch.compile(w)(**batch)
    want = ref(**batch)
    torch.testing.assert_close(out.logits, want.logits.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, want.loss.detach(), rtol=1e-6, atol=1e-6)
