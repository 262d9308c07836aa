"""generate() of wrapped Hugging Face models through the pipeline, against transformers'
generate of the unwrapped model (tiny fp32 models from configs; the reference is always a
deep copy of the model taken before wrapping, generating with a plain DynamicCache)."""

from __future__ import annotations

import copy
import inspect
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import roundpipe  # noqa: E402
import roundpipe.optim  # noqa: E402
from roundpipe.hf import PipelineCache  # noqa: E402

from pipeline_models import HF_VOCAB as VOCAB  # noqa: E402
from pipeline_models import causal_lm  # noqa: E402

# transformers' name for the cache: its forward's keyword and its outputs' field
# ("past_key_values" until 5.23, "cache" from 5.24)
CACHE = ("cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters
         else "past_key_values")


def cache_of(out):
    return getattr(out, CACHE)


def make_model(kind: str, seed: int = 0):
    """Three decoder layers, padding token 0, in eval mode."""
    model = causal_lm(kind, seed, num_hidden_layers=3, pad_token_id=0)
    model = model.eval()
    model.generation_config.pad_token_id = 0
    return model


def prompts(batch: int = 3, seq: int = 9, seed: int = 1) -> dict:
    """Left-padded prompts of different lengths (seq, seq - 3, seq - 6 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(1, batch):
        mask[row, :3 * row] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def wrap(model, **kwargs):
    kwargs.setdefault("device", "cpu")
    return roundpipe.wrap_model_to_roundpipe(model, torch.float32, **kwargs)


def both(kind: str, **wrap_kwargs):
    model = make_model(kind)
    ref = copy.deepcopy(model)
    # transformers' own decoding steps fail computing the router auxiliary loss against the
    # whole attention mask; it changes no logit (the wrapped model keeps it on)
    ref.config.output_router_logits = False
    return ref, wrap(model, **wrap_kwargs)


GREEDY = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)


def assert_same_generation(got, want):
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_tied", "qwen3_moe",
                                  "mistral_sliding"])
def test_greedy_equals_transformers(kind):
    ref, w = both(kind)
    batch = prompts()
    want = ref.generate(**batch, **GREEDY)
    got = w.generate(**batch, **GREEDY)
    assert_same_generation(got, want)
    assert isinstance(cache_of(got), PipelineCache)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "mistral_sliding"])
def test_greedy_on_two_devices(kind):
    """Two CPU device workers, stages alternating between them; with two microbatches the
    devices work on different stages at once."""
    ref, w = both(kind, device=["cpu", "cpu"])
    batch = prompts()
    want = ref.generate(**batch, **GREEDY)
    assert_same_generation(w.generate(**batch, **GREEDY), want)
    assert_same_generation(w.generate(**batch, **GREEDY, num_microbatch=2), want)


def test_without_a_cache_equals_transformers_without_one():
    ref, w = both("qwen3")
    batch = prompts()
    kw = dict(GREEDY, max_new_tokens=4, use_cache=False)
    w.pipeline_stats(reset=True)
    assert_same_generation(w.generate(**batch, **kw), ref.generate(**batch, **kw))
    stats = w.pipeline_stats()
    assert stats["generate_steps"] == 4 and stats["kv_floor_bytes"] == 0


@pytest.mark.parametrize("device", ["cpu", ["cpu", "cpu"]], ids=["one", "two"])
def test_sampling_with_a_seed_equals_transformers(device):
    ref, w = both("qwen3", device=device)
    batch = prompts()
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=30, top_p=0.9,
              num_return_sequences=2)
    torch.manual_seed(123)
    want = ref.generate(**batch, **kw)
    after_ref = torch.random.get_rng_state()
    torch.manual_seed(123)
    got = w.generate(**batch, **kw)
    assert got.shape == (6, 9 + 6)
    assert torch.equal(got, want)
    assert torch.equal(torch.random.get_rng_state(), after_ref)  # no draws of its own


def test_prefill_chunks_microbatches_and_bytes():
    """Prompt prefilled in chunks of 4 (transformers' prefill_chunk_size) and the batch in two
    microbatches: the tokens of transformers' chunked prefill, every weight streamed once per
    step, the KV bytes at their floor."""
    ref, w = both("mistral_sliding")
    batch = prompts()
    kw = dict(GREEDY, prefill_chunk_size=4)
    want = ref.generate(**batch, **kw)
    w.pipeline_stats(reset=True)
    got = w.generate(**batch, **kw, num_microbatch=2)
    assert_same_generation(got, want)
    stats = w.pipeline_stats()
    steps = got.sequences.shape[1] - 9
    assert stats["generate_steps"] == steps and stats["generated_tokens"] == 3 * steps
    weights = sum(p.numel() * p.element_size() for p in w.module.parameters())
    assert stats["h2d_weight_bytes"] == stats["weight_floor_bytes"] == steps * weights
    # KV floor from the lengths: per layer and step, the cached positions the layer attends to
    # (its last W - 1 = 3, sliding window 4) up, the new ones down; keys and values fp32,
    # 2 kv heads of 8 dims, 3 rows
    per_position = 2 * 3 * 2 * 8 * 4
    want_kv, length = 0, 0
    for new in [9] + [1] * (steps - 1):
        if new == 9:  # prefill: chunks 4, 4, 1, each attending to the window before it
            for a, e in ((0, 4), (4, 8), (8, 9)):
                want_kv += (min(a, 3) + e - a) * per_position
        else:
            want_kv += (min(length, 3) + 1) * per_position
        length += new
    want_kv *= 3  # decoder layers
    assert stats["h2d_kv_bytes"] + stats["d2h_kv_bytes"] == stats["kv_floor_bytes"] == want_kv


def test_eos_streamer_and_generation_config():
    ref, w = both("llama")
    batch = prompts()
    free = ref.generate(**batch, max_new_tokens=8, do_sample=False)
    eos = int(free[0, 9 + 2])  # row 0 stops after three new tokens
    config = copy.deepcopy(ref.generation_config)
    config.max_new_tokens, config.do_sample, config.eos_token_id = 8, False, eos

    class Recorder(transformers.generation.BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            self.chunks.append("end")

    want_stream, got_stream = Recorder(), Recorder()
    want = ref.generate(**batch, generation_config=config, streamer=want_stream)
    got = w.generate(**batch, generation_config=config, streamer=got_stream)
    assert torch.equal(got, want) and (got == 0).any()  # finished rows padded
    assert len(got_stream.chunks) == len(want_stream.chunks)
    for g, x in zip(got_stream.chunks, want_stream.chunks):
        assert (g == x) if isinstance(x, str) else torch.equal(g, x)


def test_peft_lora_equals_peft_generate():
    model = make_model("qwen3")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                           lora_dropout=0.0)
    pm = peft.get_peft_model(model, lora)
    with torch.no_grad():  # non-zero adapters, so they change the tokens
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    pm.eval()
    ref = copy.deepcopy(pm)
    w = wrap(pm)
    batch = prompts()
    got = w.generate(**batch, **GREEDY)
    assert_same_generation(got, ref.generate(**batch, **GREEDY))
    with ref.disable_adapter():  # the adapters matter: without them the logits differ
        plain = ref.generate(**batch, **GREEDY)
    assert (got.logits[0] - plain.logits[0]).abs().max() > 1e-3


def test_device_kv_cache_moves_no_kv_bytes():
    ref, w = both("qwen3")
    batch = prompts()
    w.pipeline_stats(reset=True)
    assert_same_generation(w.generate(**batch, **GREEDY, kv_cache="device"),
                           ref.generate(**batch, **GREEDY))
    stats = w.pipeline_stats()
    assert stats["h2d_kv_bytes"] == stats["d2h_kv_bytes"] == stats["kv_floor_bytes"] == 0


def test_forward_with_a_cache_equals_transformers_and_continues():
    ref, w = both("mistral_sliding")
    batch = prompts()
    hf_cache = transformers.DynamicCache(config=ref.config)
    pos = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    want = ref(**batch, position_ids=pos, use_cache=True, **{CACHE: hf_cache})
    got = w(**batch, position_ids=pos, use_cache=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    nxt = want.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([batch["attention_mask"], torch.ones(3, 1, dtype=torch.long)], dim=1)
    want2 = ref(input_ids=nxt, attention_mask=mask, position_ids=pos[:, -1:] + 1,
                use_cache=True, **{CACHE: hf_cache})
    with pytest.raises(ValueError, match="cache_position"):
        w(input_ids=nxt, cache=cache_of(got), cache_position=torch.tensor([3]))
    got2 = w(input_ids=nxt, attention_mask=mask, position_ids=pos[:, -1:] + 1, cache=cache_of(got),
             cache_position=torch.tensor([9]))
    torch.testing.assert_close(got2.logits, want2.logits, rtol=0, atol=0)
    for i, layer in enumerate(hf_cache.layers):  # HF keeps the window (last 3), we keep all
        keys, values = cache_of(got2).key_value(i)
        assert torch.equal(keys[:, :, -layer.keys.shape[2]:], layer.keys)
        assert torch.equal(values[:, :, -layer.values.shape[2]:], layer.values)


def test_errors_name_the_argument_and_change_nothing():
    _, w = both("llama")
    batch = prompts()
    with pytest.raises(ValueError, match="kv_cache"):
        w.generate(**batch, kv_cache="disk")
    with pytest.raises(ValueError, match="num_beams"):
        w.generate(**batch, num_beams=2)
    with pytest.raises(ValueError, match="num_microbatch"):
        w.generate(**batch, num_microbatch=0)
    with pytest.raises(TypeError, match="PipelineCache"):
        w.generate(**batch, cache=transformers.DynamicCache())
    with pytest.raises(TypeError, match="PipelineCache"):
        w(**batch, cache=transformers.DynamicCache())
    assert "forward" not in w.hf_model.__dict__ and w.module.training is False


def test_generate_after_an_asynchronous_step_uses_the_current_weights():
    model = make_model("llama")
    w = wrap(model)
    opt = roundpipe.optim.SGD(w.optim_parameters(), lr=0.5)
    _train(w, opt, 1)  # an asynchronous step, still pending or not: generate waits for it
    got = w.generate(**prompts(), **GREEDY)
    ref = make_model("llama")
    ref.load_state_dict(w.state_dict())  # the weights after the step
    assert_same_generation(got, ref.generate(**prompts(), **GREEDY))
    before = make_model("llama")  # the step changed the tokens: the test can fail
    assert not torch.equal(got.sequences, before.generate(**prompts(), **GREEDY).sequences)


def _train(w, opt, seed: int, is_async: bool = True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
    loss = w.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    w.step(opt, is_async=is_async)
    return loss


def test_training_after_generation_computes_what_it_would_have():
    """Two identical runs of asynchronous steps; one generates between steps (which
    synchronizes), the other calls synchronize() instead: the next training calls compute
    exactly the same losses and weights, and the modes are restored."""
    runs = []
    for generate in (False, True):
        model = make_model("llama")
        model.train()
        w = wrap(model, num_microbatch=2)
        opt = roundpipe.optim.SGD(w.optim_parameters(), lr=0.05)
        losses = [_train(w, opt, 1), _train(w, opt, 2)]
        if generate:
            w.generate(**prompts(), max_new_tokens=4, do_sample=False)
            assert all(m.training for m in w.module.modules())
        else:
            w.synchronize()
        # gradients accumulated before a generation stay theirs
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(1, VOCAB, (2, 7), generator=gen)
        losses.append(w.forward_backward(input_kwargs={"input_ids": ids, "labels": ids}))
        if generate:
            w.generate(**prompts(), max_new_tokens=2, do_sample=False)
        w.step(opt)
        losses.append(_train(w, opt, 4, is_async=False))
        w.synchronize()
        runs.append((losses, {k: v.clone() for k, v in w.state_dict().items()}))
    (l0, s0), (l1, s1) = runs
    for a, b in zip(l0, l1):
        assert torch.equal(a, b)
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)


def test_training_thread_waits_for_the_whole_generation():
    """A forward_backward started from another thread while generate runs waits until the
    generation is over (no step mixes weights) and then computes what it computes alone."""
    ref, w = both("llama")
    opt = roundpipe.optim.SGD(w.optim_parameters(), lr=0.05)
    batch = prompts()
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    want_loss = ref(input_ids=ids, labels=ids).loss.detach()
    done = threading.Event()
    result = {}
    thread = None
    overlaps = []

    def train():
        result["loss"] = w.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        w.step(opt)
        done.set()

    class StartTraining(transformers.generation.BaseStreamer):
        def put(self, value):
            nonlocal thread
            if thread is None:
                thread = threading.Thread(target=train)
                thread.start()
            overlaps.append(done.is_set())

        def end(self):
            overlaps.append(done.is_set())

    want = ref.generate(**batch, max_new_tokens=6, do_sample=False)
    got = w.generate(**batch, max_new_tokens=6, do_sample=False, streamer=StartTraining())
    thread.join(timeout=120)
    assert done.is_set() and not any(overlaps)
    assert torch.equal(got, want)
    torch.testing.assert_close(result["loss"], want_loss, rtol=1e-6, atol=1e-6)


def test_generate_from_inside_a_call_raises():
    _, w = both("llama")
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))

    def loss_fn(logits):
        w.generate(input_ids=ids[:, :3], max_new_tokens=1)
        return logits.float().sum()

    with pytest.raises(RuntimeError, match="inside this model"):
        w.forward_backward(input_kwargs={"input_ids": ids}, loss_fn=loss_fn)


def test_moe_generation_keeps_no_routing_and_sums_none():
    """Generation passes (with or without a cache) neither keep routing for a recomputation
    nor add to the router statistics of the auxiliary loss."""
    _, w = both("qwen3_moe")
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    w.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    stats = w._routing.stats
    before = (stats.counts.clone(), stats.probs.clone(), stats.rows.clone())
    for use_cache in (True, False):
        w.generate(**prompts(), max_new_tokens=3, do_sample=False, use_cache=use_cache)
    assert w._routing.stats is stats
    assert all(torch.equal(a, b) for a, b in zip(before, (stats.counts, stats.probs, stats.rows)))


def test_generation_continues_from_a_returned_cache():
    """A second generate from the returned cache (the first call's sequences plus new tokens,
    as a chat's next turn) equals transformers continuing from its own cache."""
    ref, w = both("llama")
    batch = prompts()
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    want, got = ref.generate(**batch, **kw), w.generate(**batch, **kw)
    assert torch.equal(got.sequences, want.sequences)
    more = torch.randint(1, VOCAB, (3, 3), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([want.sequences, more], dim=1)
    mask = torch.cat([batch["attention_mask"], torch.ones(3, 4 + 3, dtype=torch.long)], dim=1)
    want2 = ref.generate(input_ids=ids, attention_mask=mask, **{CACHE: cache_of(want)}, **kw)
    got2 = w.generate(input_ids=ids, attention_mask=mask, cache=cache_of(got), **kw)
    assert torch.equal(got2.sequences, want2.sequences)
    assert cache_of(got2) is cache_of(got) and cache_of(got).get_seq_length() == ids.shape[1] + 3
