"""CUDA checks, skipped without a GPU (``scripts/gpu_check.sh`` runs them on a GPU machine):

- the same training on the GPU as on the CPU path (synchronous, asynchronous, exact), inputs
  given on the host; two GPUs give the one-GPU results;
- device memory within its bound: two stages of weights, one stage's fp32 gradient sums, one
  parameter's model-dtype gradient and the activations of a microbatch — for allocated and for
  *reserved* memory, which must stay flat over 20 iterations (backpressure: the host never
  runs far enough ahead for freed blocks to pile up behind ``record_stream``);
- no host synchronisation in the steady state, with BatchNorm statistics and a rotary buffer
  in the model (changed buffers go back without blocking the compute stream);
- bytes moved equal their floors on CUDA as on the CPU device; pinned memory of exact size;
  the pinned-memory modes and their fallback;
- upload bandwidth measured;
- generation through the pipeline (KV cache pinned on the host or on the GPU, prefill chunks
  over two microbatches) gives transformers' tokens on the GPU, bytes at their floors.

    pytest tests/test_gpu.py        # on a machine with CUDA
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HIDDEN = 256


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(6)],
                         nn.Linear(HIDDEN, 8))


def _train(device, steps=5):
    model = RoundPipe(_model(), device=device, num_microbatch=3)
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x, y = torch.randn(12, HIDDEN, generator=g), torch.randn(12, 8, generator=g)  # on the host
        torch.manual_seed(step)
        loss = model.forward_backward(input_args=(x,), label=y,
                                      loss_fn=lambda o, t: ((o - t) ** 2).mean() / 3)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        losses.append(loss.item())
    return losses, model


def test_cuda_training_matches_the_cpu_path():
    cpu_losses, cpu_model = _train("cpu")
    gpu_losses, gpu_model = _train("cuda")
    assert gpu_losses == pytest.approx(cpu_losses, rel=1e-4)  # TF32 off by default for matmul
    for (_, a), (_, b) in zip(cpu_model.optim_named_parameters(), gpu_model.optim_named_parameters()):
        assert b.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def _train_mode(device, mode, steps=4, **kwargs):
    """plain: forward_backward + step(opt); async: step(opt, is_async=True); exact:
    forward_backward(optimizer=opt). bf16 model, fp32 master weights."""
    model = RoundPipe(_model().to(torch.bfloat16), optim_dtype=torch.float32, device=device,
                      num_microbatch=3, **kwargs)
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(12, HIDDEN, generator=g).bfloat16()
        y = torch.randn(12, 8, generator=g)
        torch.manual_seed(step)
        kw = dict(input_args=(x,), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean() / 3)
        if mode == "exact":
            loss = model.forward_backward(**kw, optimizer=opt)
        else:
            loss = model.forward_backward(**kw)
            model.step(opt, is_async=mode == "async")
        losses.append(loss.item())
    model.synchronize()
    return losses, model


@pytest.mark.parametrize("mode", ["plain", "async", "exact"])
def test_cuda_overlapped_modes_match_the_cpu_path(mode):
    """The same plan on both sides (one layer per stage): left to its default, CUDA would plan
    its stages ("auto") after the first call and every byte counter would differ."""
    cpu_losses, cpu = _train_mode("cpu", mode, layers_per_stage=1)
    gpu_losses, gpu = _train_mode("cuda", mode, layers_per_stage=1)
    assert gpu.pin_memory == "alloc"
    assert all(p.is_pinned() for p in gpu.module.parameters())
    assert gpu_losses == pytest.approx(cpu_losses, rel=2e-2)   # bf16 compute on two backends
    for (_, a), (_, b) in zip(cpu.optim_named_parameters(), gpu.optim_named_parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    for k, v in cpu.pipeline_stats().items():                  # the same bytes moved
        if k.endswith("_bytes") and k != "pinned_bytes":
            assert gpu.pipeline_stats()[k] == v, k


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_give_the_one_gpu_results():
    one_losses, one = _train_mode("cuda:0", "exact")
    two_losses, two = _train_mode(["cuda:0", "cuda:1"], "exact")
    assert two_losses == pytest.approx(one_losses, rel=1e-6)
    for (_, a), (_, b) in zip(one.optim_named_parameters(), two.optim_named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _plan_bound(net: nn.Sequential, sizes, activations: int) -> int:
    """The device-memory bound of a plan: the largest two neighbouring stages' weights (one
    computing, the next prefetched), the largest stage's fp32 gradient sums, one parameter's
    model-dtype gradient (before it is added into its sum) and a microbatch's activations."""
    layers, starts = list(net), [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    stages = [layers[a:b] for a, b in zip(starts, starts[1:])]
    weights = [sum(p.numel() * p.element_size() for m in st for p in m.parameters())
               for st in stages]
    grads = [sum(p.numel() * 4 for m in st for p in m.parameters()) for st in stages]
    pairs = max([a + b for a, b in zip(weights, weights[1:])] or weights)
    largest_param = max(p.numel() * p.element_size() for p in net.parameters())
    return pairs + max(grads) + largest_param + activations


@pytest.mark.parametrize("plan", [1, "auto"])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("mode", ["plain", "async", "exact"])
def test_device_memory_is_bounded_and_reserved_memory_stays_flat(prefetch, mode, plan):
    """The bound computed from the plan in effect (one layer per stage, or the automatic
    plan, settled during the warm-up), call after call: nothing outlives its stage visit."""
    net = _model().to(torch.bfloat16)
    model = RoundPipe(net, optim_dtype=torch.float32, device="cuda", num_microbatch=3,
                      prefetch=prefetch, layers_per_stage=plan)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-4)
    x, y = torch.randn(12, HIDDEN).bfloat16(), torch.randn(12, 8)
    kw = dict(input_args=(x,), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())

    def iteration():
        if mode == "exact":
            model.forward_backward(**kw, optimizer=opt)
        else:
            model.forward_backward(**kw)
            model.step(opt, is_async=mode == "async")

    for _ in range(6):                          # warm-up: streams, pinned buffers, the plan
        iteration()
    model.synchronize()
    torch.cuda.synchronize()
    assert model.pipeline_stats()["stages"] == len(model.plan().sizes)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    reserved = []
    for _ in range(20):
        iteration()
        reserved.append(torch.cuda.memory_reserved())
    model.synchronize()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    activations = 12 * HIDDEN * 4 * 16                  # generous: a microbatch's activations
    bound = _plan_bound(net, model.plan().sizes, activations)
    assert peak <= bound, (peak, bound, model.plan())
    assert reserved[-1] == reserved[4], reserved        # flat: nothing piles up
    assert torch.cuda.max_memory_reserved() - reserved[0] <= 2 << 20


class Rotary(nn.Module):
    """A rotary-style layer: a non-persistent buffer read, never changed."""

    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)),
                             persistent=False)

    def forward(self, x):
        angles = torch.arange(x.shape[-1] // 2, device=x.device).float() * self.inv_freq
        return x * angles.cos().repeat(2).to(x.dtype)


def test_no_host_synchronisation_in_the_steady_state():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN), Rotary(HIDDEN),
                        nn.Linear(HIDDEN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Linear(HIDDEN, 8))
    model = RoundPipe(net.to(torch.bfloat16), optim_dtype=torch.float32, device="cuda",
                      num_microbatch=3)
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-3, eps=1e-3)
    x, y = torch.randn(12, HIDDEN).bfloat16(), torch.randn(12, 8)
    kw = dict(input_args=(x,), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())
    for _ in range(2):                                  # warm-up
        model.forward_backward(**kw)
        model.step(opt, is_async=True)
    model.synchronize()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")             # a synchronising CUDA call raises
    try:
        for _ in range(3):
            model.forward_backward(**kw)                # its errors reach us from the workers
            model.step(opt, is_async=True)
        model.forward_backward(**kw, optimizer=opt)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    model.synchronize()
    assert int(net[1].num_batches_tracked) == 6 * 3     # every microbatch's update arrived
    s = model.pipeline_stats()
    assert s["d2h_buffer_bytes"] > 0                    # BatchNorm statistics went back ...
    bn = sum(b.numel() * b.element_size() for m in (net[1], net[4]) for b in m.buffers())
    assert s["d2h_buffer_bytes"] == 6 * bn              # ... and only they (not inv_freq)


def test_pinned_memory_is_exact_and_reported():
    net = _model().to(torch.bfloat16)
    model = RoundPipe(net, optim_dtype=torch.float32, device="cuda", num_microbatch=2,
                      layers_per_stage=1)
    tensors = list(net.parameters())
    expected = sum((t.numel() * t.element_size() + 511) // 512 * 512 for t in tensors)
    assert model.pipeline_stats()["pinned_bytes"] == expected
    x, y = torch.randn(4, HIDDEN).bfloat16(), torch.randn(4, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())
    ring = max(sum((4 * p.numel() + 511) // 512 * 512 for p in layer.parameters()) for layer in net)
    assert model.pipeline_stats()["pinned_bytes"] == expected + 2 * ring


def test_a_roundpipe_leaves_nothing_on_the_device_after_del():
    """Three wrappers built, trained and deleted one after the other: device memory goes back
    to what it was after the first (which made the shared streams' cuBLAS workspaces); each
    wrapper used to leave about 70 MB (new streams, new workspaces)."""
    import gc

    def one():
        model = RoundPipe(_model().to(torch.bfloat16), optim_dtype=torch.float32, device="cuda",
                          num_microbatch=3)
        opt = rpo.AdamW(model.optim_parameters(), lr=1e-4)
        x, y = torch.randn(12, HIDDEN).bfloat16(), torch.randn(12, 8)
        for _ in range(2):
            model.forward_backward(input_args=(x,), label=y,
                                   loss_fn=lambda o, t: ((o.float() - t) ** 2).mean())
            model.step(opt)
        model.synchronize()

    after = []
    for _ in range(3):
        one()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        after.append(torch.cuda.memory_allocated())
    assert after[2] - after[0] <= 1 << 20, after


def test_a_1_8b_geometry_trains_under_a_memory_cap():
    """The 1.82B Llama's layer geometry (hidden 2560, MLP 6912, 20 heads, 4 KV heads, a 32k
    vocabulary) at 4 layers (0.47B parameters, bf16 weights 0.94 GB; plain training with AdamW
    needs about 5.6 GB) under a 3 GiB cap (``set_per_process_memory_fraction``): RoundPipe
    trains in sync, async and exact modes with the automatic plan, its first loss equal to
    plain HF's on the GPU, its peak within the cap.

    Why 3 GiB: the last layer (final norm, ``lm_head``, chunked loss) alone holds 0.83 GB in
    a backward visit — its bf16 weight (0.16 GB), the weight's fp32 gradient sum over the
    microbatches (0.33 GB) and the loss's fp32 gradient of the weight, made in its forward
    (0.33 GB) — and a stage may take half of the default budget (0.6 of the device): 2.5 GiB
    gives 0.81 GB, so the planner refuses the layer; 3 GiB gives 0.97 GB."""
    transformers = pytest.importorskip("transformers")
    import copy

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2560, intermediate_size=6912,
                                   num_hidden_layers=4, num_attention_heads=20,
                                   num_key_value_heads=4, max_position_embeddings=1024)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (4, 512), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(input_ids=ids.cuda(), labels=ids.cuda()).loss.item()
    host = ref.cpu()
    del ref
    torch.cuda.empty_cache()
    cap = 3 << 30
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    try:
        for mode in ("plain", "async", "exact"):
            torch.cuda.reset_peak_memory_stats()
            model = roundpipe_wrap(copy.deepcopy(host), num_microbatch=4)
            opt = rpo.AdamW(model.optim_parameters(), lr=1e-5)
            losses = []
            for _ in range(3):
                kw = {"input_kwargs": {"input_ids": ids, "labels": ids}}
                if mode == "exact":
                    losses.append(model.forward_backward(**kw, optimizer=opt).item())
                else:
                    losses.append(model.forward_backward(**kw).item())
                    model.step(opt, is_async=mode == "async")
            model.synchronize()
            assert losses[0] == pytest.approx(want, rel=2e-3), (mode, losses, want)
            assert torch.cuda.max_memory_allocated() <= cap, (mode, model.plan())
            del model, opt
            torch.cuda.empty_cache()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def roundpipe_wrap(model, **kwargs):
    import roundpipe

    return roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cuda", **kwargs)


@pytest.mark.parametrize("mode", ["alloc", "register", "off"])
def test_pin_memory_modes(mode):
    net = _model()
    model = RoundPipe(net, device="cuda", pin_memory=mode)
    assert model.pin_memory == mode
    assert all(p.is_pinned() == (mode != "off") for p in net.parameters())
    x, y = torch.randn(4, HIDDEN), torch.randn(4, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())


def test_pinning_failure_falls_back_to_pageable_with_a_warning(monkeypatch):
    import roundpipe.transfer.cuda as ct

    monkeypatch.setattr(ct, "_register", lambda ptr, size: 2)  # cudaErrorMemoryAllocation
    with pytest.warns(UserWarning, match="pageable"):
        model = RoundPipe(_model(), device="cuda")
    assert model.pin_memory == "off"
    x, y = torch.randn(4, HIDDEN), torch.randn(4, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())


def test_upload_bandwidth_is_measured():
    model = RoundPipe(_model(), device="cuda")
    x, y = torch.randn(4, HIDDEN), torch.randn(4, 8)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean())
    stats = model.pipeline_stats()
    assert stats["h2d_weight_bytes"] == stats["weight_floor_bytes"] > 0 and stats["upload_s"] > 0


# --- generation through the pipeline (roundpipe.hf.generate) ------------------------------------


def _hf_pair(kind: str):
    """A tiny fp32 transformers model (random weights) and a deep copy of it on cuda:0."""
    import copy

    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=0)
    torch.manual_seed(0)
    if kind == "mistral_sliding":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common,
                                                                           sliding_window=4))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model = model.float().eval()
    model.generation_config.pad_token_id = 0
    return model, copy.deepcopy(model).to("cuda:0")


def _prompts():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 101, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :6] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.mark.parametrize("kind", ["llama", "mistral_sliding"])
@pytest.mark.parametrize("kv_cache", ["host", "device"])
def test_cuda_generation_equals_transformers_on_the_gpu(kind, kv_cache):
    """Greedy generation through the pipeline on CUDA (KV cache pinned on the host, or on the
    GPU) gives the tokens of transformers' generate on the GPU; prefill in chunks over two
    microbatches (chunk c's upload waits for chunk c-1's download); bytes at their floors."""
    import roundpipe

    model, ref = _hf_pair(kind)
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cuda:0")
    batch = _prompts()
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
              output_logits=True, prefill_chunk_size=4)
    want = ref.generate(**{k: v.cuda() for k, v in batch.items()}, **kw)
    w.pipeline_stats(reset=True)
    got = w.generate(**batch, **kw, kv_cache=kv_cache, num_microbatch=2)
    assert torch.equal(got.sequences, want.sequences.cpu())
    for g, x in zip(got.logits, want.logits):
        torch.testing.assert_close(g, x.cpu(), rtol=1e-4, atol=1e-4)
    stats = w.pipeline_stats()
    assert stats["h2d_weight_bytes"] == stats["weight_floor_bytes"]
    assert stats["h2d_kv_bytes"] + stats["d2h_kv_bytes"] == stats["kv_floor_bytes"]
    assert (stats["kv_floor_bytes"] > 0) == (kv_cache == "host")
    assert stats["generated_tokens"] == 3 * 8
