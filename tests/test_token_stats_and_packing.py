"""TRL's SFT metrics counted by the chunked loss, and padding-free (packed) batches split into
microbatches at sequence starts, against references written here from the full logits and
against the unwrapped HF model (``model(**batch).loss`` and its gradients):

- ``chunked_cross_entropy_sum(..., with_stats=True)``: top-1 hits as ``argmax`` counts them and
  the entropy of each scored token's distribution, in float64 from the full logits;
- ``last_token_stats()`` after ``forward_backward`` (several microbatches): the same from the
  unwrapped model's logits;
- a packed row (``position_ids`` restarting at each sequence, no ``attention_mask``, the first
  label of each sequence -100, as TRL's padding-free collator makes it) gives HF's loss and
  gradients with 1-4 microbatches, which are cut at sequence starts.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe.hf import chunked_cross_entropy_sum  # noqa: E402
from roundpipe.hf.packed import split_packed  # noqa: E402

from pipeline_models import HF_VOCAB as VOCAB  # noqa: E402
from pipeline_models import causal_lm  # noqa: E402


def reference_stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, int, float]:
    """(scored tokens, top-1 hits, summed entropy) in float64 from the full logits, the targets
    already shifted (-100 ignored)."""
    z = logits.detach().double().reshape(-1, logits.shape[-1])
    y = targets.reshape(-1)
    valid = y != -100
    p = torch.softmax(z, dim=-1)
    entropy = -(p * torch.log(p)).sum(-1)
    hits = valid & (z.argmax(-1) == y)
    return int(valid.sum()), int(hits.sum()), float(entropy[valid].sum())


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_stats_equal_the_full_logits(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=gen, requires_grad=True)
    weight = torch.randn(VOCAB, 16, generator=gen)
    labels = torch.randint(0, VOCAB, (2, 9), generator=gen)
    labels[1, :4] = -100
    logits = hidden @ weight.T
    labels[0, 3] = int(logits[0, 2].argmax())  # a hit or two, whatever the draw
    targets = shifted(labels)
    loss, hits, entropy = chunked_cross_entropy_sum(hidden, weight, None, targets, chunk,
                                                    with_stats=True)
    n, want_hits, want_entropy = reference_stats(logits, targets)
    assert hits.dtype == torch.int64 and not hits.requires_grad and not entropy.requires_grad
    assert int(hits) == want_hits and want_hits >= 1
    assert float(entropy) == pytest.approx(want_entropy, rel=1e-5)
    loss.backward()                               # the stats take no part in the backward
    assert hidden.grad is not None


@pytest.mark.parametrize("microbatches", [1, 3])
def test_last_token_stats_of_forward_backward_equal_the_hf_models_logits(microbatches):
    model = causal_lm("qwen3")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 10), generator=gen)
    labels = ids.clone()
    labels[2, :5] = -100
    want = reference_stats(model(input_ids=ids).logits, shifted(labels))
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu",
                                          num_microbatch=microbatches, loss_chunk_size=7)
    assert w.last_token_stats() is None
    w.forward_backward(input_kwargs={"input_ids": ids, "labels": labels})
    got = w.last_token_stats()
    assert (got.tokens, got.top1) == want[:2]
    assert got.entropy == pytest.approx(want[2], rel=1e-5)
    assert got.mean_token_accuracy == want[1] / want[0]


def packed_row(lengths, seed=2):
    """A padding-free batch as TRL's collator makes it: one row of the sequences, position ids
    restarting at 0, the first label of each sequence -100."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    labels[pos == 0] = -100
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def test_a_packed_row_is_cut_at_sequence_starts():
    batch = packed_row([5, 3, 7, 2, 6])           # starts at 0, 5, 8, 15, 17; 23 tokens
    pieces = split_packed((), batch, None, 3)
    bounds = [0]
    for _, kw, _ in pieces:
        assert kw["position_ids"][0, 0] == 0 and kw["labels"][0, 0] == -100
        assert kw["input_ids"].shape == kw["labels"].shape == kw["position_ids"].shape
        bounds.append(bounds[-1] + kw["input_ids"].shape[1])
    assert bounds == [0, 8, 15, 23]               # the starts nearest 23/3 and 46/3
    # not packed: rows are split as always; an attention mask means padded rows
    assert len(split_packed((), {**batch, "attention_mask": torch.ones(1, 23)}, None, 3)) == 1
    rows = {"input_ids": torch.zeros(4, 5, dtype=torch.long)}
    assert [kw["input_ids"].shape[0] for _, kw, _ in split_packed((), rows, None, 2)] == [2, 2]


@pytest.mark.parametrize("microbatches", [1, 2, 4])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_packed_row_gives_hf_loss_and_gradients(kind, microbatches):
    """The reference: the unwrapped model on the whole packed row without a cache, as TRL's
    SFTTrainer calls it (transformers then keeps attention within each sequence from the
    position ids); attention across the sequences would change the loss."""
    batch = packed_row([6, 4, 9, 3, 5])
    model = causal_lm(kind, initializer_range=0.3)    # attention far from uniform
    ref = model(**batch, use_cache=False).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.no_grad():      # the row as one sequence: attention across the sequences
        ones = torch.ones_like(batch["input_ids"])
        crossed = model(**batch, attention_mask=ones, use_cache=False).loss
    assert abs(float(crossed) - float(ref)) > 1e-2
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu",
                                          num_microbatch=microbatches)
    loss = w.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    got = w.step(lambda: {n: p.grad.clone() for n, p in w.optim_named_parameters()})
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_forward_of_a_packed_row_gives_hf_logits():
    batch = packed_row([6, 4, 9, 3, 5])
    model = causal_lm("llama", initializer_range=0.3)
    want = model(**batch, use_cache=False)
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", num_microbatch=3)
    with torch.no_grad():
        got = w(**batch)
    torch.testing.assert_close(got.logits, want.logits.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss.detach(), rtol=1e-5, atol=1e-6)
