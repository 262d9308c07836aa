"""What generation uploads ahead, when, and what stays alive (issue 34 item 3), on the CPU
device: the logic a GPU run only times.

- weights: every pass of ``generate`` but the last uploads the first stage of the next pass as
  it ends (so on CUDA the copy overlaps transformers' choice of the next tokens), and that pass
  uploads it no second time; nothing carried outlives ``generate``;
- KV (host cache): each decoder layer uploads the cached positions the next layer will attend
  to, so every layer but the first takes its keys and values uploaded ahead; every upload made
  ahead is taken, and none outlives its pass.

The tokens are transformers' (greedy, the unwrapped model), and the byte counters stay at their
floors, counted from the model's sizes here.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe.pipeline.fetch import WeightFetcher  # noqa: E402
from roundpipe.transfer import CpuIO, DeviceIO  # noqa: E402

from pipeline_models import HF_VOCAB as VOCAB  # noqa: E402
from pipeline_models import causal_lm  # noqa: E402

LAYERS = 3


def models():
    model = causal_lm("llama", 0, num_hidden_layers=LAYERS, pad_token_id=0).eval()
    model.generation_config.pad_token_id = 0
    ref = copy.deepcopy(model)
    return ref, roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu")


def prompts(batch=2, seq=7):
    ids = torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_each_pass_but_the_last_uploads_the_next_ones_first_stage(monkeypatch):
    ref, w = models()
    events, carried = [], []
    real_upload, real_ahead = DeviceIO.upload, WeightFetcher.upload_ahead

    def upload(self, layers, with_grad):
        out = real_upload(self, layers, with_grad)
        events.append(("upload", id(layers[0][0].host)))
        return out

    def ahead(self):
        item = real_ahead(self)
        events.append(("ahead", item[0].stage))
        carried.append(weakref.ref(item[1][0]))
        return item

    monkeypatch.setattr(DeviceIO, "upload", upload)
    monkeypatch.setattr(WeightFetcher, "upload_ahead", ahead)
    batch = prompts()
    new = 5
    want = ref.generate(**batch, max_new_tokens=new, do_sample=False)
    w.pipeline_stats(reset=True)
    got = w.generate(**batch, max_new_tokens=new, do_sample=False)
    assert torch.equal(got, want)
    stages = len(w._stages)
    first = events[0][1]  # the host tensor identifying stage 0's upload
    # pass 1: every stage; then, per further pass: stage 0 uploaded ahead at the end of the
    # pass before, the others during the pass
    kinds = [e[0] for e in events]
    assert kinds.count("ahead") == new - 1 and carried
    assert kinds.count("upload") == new * stages  # each stage once per pass, ahead included
    assert sum(1 for e in events if e == ("upload", first)) == new
    for i, e in enumerate(events):
        if e[0] == "ahead":
            assert events[i - 1] == ("upload", first)  # the ahead upload is stage 0's
            assert e[1] == 0
    # passes: prefill + new - 1 decoding steps; the last pass uploads nothing ahead
    assert events[-1][0] == "upload" and events[-1][1] != first
    stats = w.pipeline_stats()
    weights = sum(p.numel() * p.element_size() for p in w.module.parameters())
    assert stats["h2d_weight_bytes"] == stats["weight_floor_bytes"] == new * weights
    gc.collect()
    assert all(r() is None for r in carried)  # nothing carried outlives generate


def test_an_early_stop_drops_the_upload_made_ahead(monkeypatch):
    """With no max_new_tokens (passes unknown) the last pass uploads ahead too: the upload is
    dropped when generate returns, counted in the bytes moved and in their floor alike."""
    ref, w = models()
    carried = []
    real_ahead = WeightFetcher.upload_ahead

    def ahead(self):
        item = real_ahead(self)
        carried.append(weakref.ref(item[1][0]))
        return item

    monkeypatch.setattr(WeightFetcher, "upload_ahead", ahead)
    batch = prompts(seq=4)
    want = ref.generate(**batch, max_length=7, do_sample=False)
    w.pipeline_stats(reset=True)
    got = w.generate(**batch, max_length=7, do_sample=False)
    assert torch.equal(got, want)
    stats = w.pipeline_stats()
    assert len(carried) == stats["generate_steps"] == 3
    stage0 = sum(p.numel() * p.element_size() for p in w._layers[0].parameters())
    weights = sum(p.numel() * p.element_size() for p in w.module.parameters())
    assert stats["h2d_weight_bytes"] == stats["weight_floor_bytes"] == 3 * weights + stage0
    gc.collect()
    assert all(r() is None for r in carried)


def test_generate_waits_for_the_dropped_upload_before_it_returns(monkeypatch):
    """The upload made ahead by the last pass is still copying from the host model copy when
    generate drops it (on CUDA: a DMA reading pinned memory): generate waits for its event
    before returning, so the caller may write or free the model at once. The CPU device's
    copies are done at once; its upload events stand in for CUDA's here."""
    ref, w = models()
    made, waited = [], []
    real_ahead = WeightFetcher.upload_ahead

    def ahead(self):
        visit, (weights, _) = real_ahead(self)
        event = object()                               # what CUDA's weights stream records
        made.append(event)
        return visit, (weights, event)

    monkeypatch.setattr(WeightFetcher, "upload_ahead", ahead)
    monkeypatch.setattr(CpuIO, "host_wait", lambda self, event: waited.append(event))
    batch = prompts(seq=4)
    want = ref.generate(**batch, max_length=7, do_sample=False)
    got = w.generate(**batch, max_length=7, do_sample=False)
    assert torch.equal(got, want)
    assert len(made) == 3 and made[-1] in waited       # the one no pass took


@pytest.mark.parametrize("num_microbatch", [1, 2])
def test_each_layer_uploads_the_next_layers_keys_and_values_ahead(monkeypatch, num_microbatch):
    ref, w = models()
    direct, ahead, ready, inside = [], [], [], []
    real_direct, real_ahead = CpuIO.kv_to_device, CpuIO.kv_prefetch

    def to_device(self, host, after):
        if not inside:
            direct.append(host.shape[0])
        return real_direct(self, host, after)

    def prefetch(self, host, after):
        ahead.append(host.shape[0])
        inside.append(True)
        try:
            return real_ahead(self, host, after)
        finally:
            inside.pop()

    monkeypatch.setattr(CpuIO, "kv_to_device", to_device)
    monkeypatch.setattr(CpuIO, "kv_prefetch", prefetch)
    monkeypatch.setattr(CpuIO, "kv_ready", lambda self, event: ready.append(event))
    batch = prompts(batch=2, seq=6)
    new = 4
    want = ref.generate(**batch, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    w.pipeline_stats(reset=True)
    got = w.generate(**batch, max_new_tokens=new, do_sample=False, kv_cache="host",
                     num_microbatch=num_microbatch, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    parts = num_microbatch
    # the prefill reads nothing cached; each decoding step: the first decoder layer uploads its
    # own positions, and uploads the second's ahead, which uploads the third's
    steps = new - 1
    assert direct == [6 + s for s in range(steps) for _ in range(parts)]
    assert sorted(ahead) == sorted([6 + s for s in range(steps) for _ in range(parts)]
                                   * (LAYERS - 1))
    assert len(ready) == len(ahead)  # every upload made ahead was taken
    stats = w.pipeline_stats()
    assert stats["h2d_kv_bytes"] + stats["d2h_kv_bytes"] == stats["kv_floor_bytes"]
    cache = got.past_key_values if hasattr(got, "past_key_values") else got.cache
    assert all(part.ahead is None for layer in cache.layers for part in layer.parts)
