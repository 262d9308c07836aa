"""Long sequences: attention within segments (``roundpipe.hf.attention``) equals transformers'
masked attention, and a training call's memory grows linearly with the sequence for every
batch shape the wrapper accepts (plain, right and left padded, packed rows, TRL's padding-free
row, a sliding-window layer longer than its window).

References: a float64 attention written here from the definition of transformers' masks, and
the unwrapped transformers model (``attn_implementation="sdpa"``, its dense masks) for loss and
gradients. Memory: the bytes of tensors alive at once during ``forward_backward`` on the CPU
device, counted exactly (``live_bytes.LiveBytes``); a dense ``(S, S)`` mask anywhere makes the
bytes per token grow with ``S``.
"""

from __future__ import annotations

import pytest
import torch

from live_bytes import LiveBytes
from pipeline_models import HF_VOCAB as VOCAB
from pipeline_models import causal_lm

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe.hf import attention  # noqa: E402


# --- the attention function against the definition ---------------------------------------------

def reference(q, k, v, mask, pos, window):
    """float64 attention with transformers' mask: ``k <= q``, the key valid (2D ``mask``), the
    same packed sequence (a new one wherever ``pos`` does not count up by one; only without a
    mask), ``q - k < window``; a query with no key gets 0 (sdpa's fully masked row)."""
    B, H, S, D = q.shape
    qi, ki = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (ki <= qi).expand(B, S, S).clone()
    if window is not None:
        allowed &= qi - ki < window
    if mask is not None:
        allowed &= mask.bool()[:, None, :]
    elif pos is not None:
        p = pos.expand(B, -1)
        starts = torch.cat([torch.zeros(B, 1, dtype=torch.long),
                            (torch.diff(p, dim=-1) != 1).long()], dim=1)
        seq = starts.cumsum(-1)
        allowed &= seq[:, :, None] == seq[:, None, :]
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / D ** 0.5
    weights = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), -1)
    return (weights.nan_to_num(0.0) @ v).transpose(1, 2)


S = 37


def _patterns():
    gap = torch.ones(3, S, dtype=torch.long)
    gap[0, 30:] = 0          # right padded
    gap[1, :9] = 0           # left padded
    gap[2, 5:8] = 0          # gaps
    gap[2, 20:22] = 0
    empty = torch.ones(2, S, dtype=torch.long)
    empty[1] = 0             # a row of padding only
    one_row = torch.cat([torch.arange(10), torch.arange(20), torch.arange(7)]).unsqueeze(0)
    two_rows = torch.stack([torch.cat([torch.arange(10), torch.arange(27)]),
                            torch.cat([torch.arange(5, 20), torch.arange(3), torch.arange(19)])])
    return {"padded": (gap, None), "empty row": (empty, None), "packed (1, S)": (None, one_row),
            "packed (B, S)": (None, two_rows), "plain": (None, None)}


@pytest.mark.parametrize("window", [None, 4, 12, 100])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("pattern", list(_patterns()))
def test_segment_attention_equals_the_masked_definition(monkeypatch, pattern, heads, window):
    """Output and gradients of query, key and value, in several query chunks (a chunk's mask
    budget of one element: chunks of 16 queries)."""
    monkeypatch.setattr(attention, "CHUNK_MASK_ELEMENTS", 1)
    mask, pos = _patterns()[pattern]
    rows = 2 if mask is None and pos is None else (mask if mask is not None else pos).shape[0]
    rows = max(rows, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, h, S, 8, generator=gen, dtype=torch.float64)
               for h in (heads[0], heads[1], heads[1]))
    inputs = {"input_ids": torch.zeros(rows, S, dtype=torch.long)}
    if mask is not None:
        inputs["attention_mask"] = mask
    if pos is not None:
        inputs["position_ids"] = pos
    segment_mask = attention.describe(inputs).mask(window, mask)
    if pattern == "plain" and (window is None or window >= S):
        assert segment_mask is None   # plain causal: transformers' own sdpa call, no mask
        return
    grad = torch.randn(rows, S, heads[0], 8, generator=gen, dtype=torch.float64)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    out, weights = attention.segment_attention(None, *ours, segment_mask)
    assert weights is None and out.shape == (rows, S, heads[0], 8)
    (out * grad).sum().backward()
    theirs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference(*theirs, mask, pos, window)
    (want * grad).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


# --- training: loss and gradients against transformers ----------------------------------------

SEQ = 24


def batch_of(shape: str, rows: int = 3) -> dict:
    """``shape``'s batch of ``rows`` x SEQ tokens, every token scored (padding too: its output
    must equal transformers' as well)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone()}
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    if shape == "right padded":
        mask[1, -6:] = 0
        mask[2, -17:] = 0
    elif shape == "left padded":
        mask[0, :5] = 0
        mask[2, :11] = 0
    elif shape == "gaps":
        mask[1, 4:7] = 0
        mask[2, 10:] = 0
        mask[2, :2] = 0
    elif shape == "packed rows":
        batch["position_ids"] = torch.stack([
            torch.cat([torch.arange(9), torch.arange(15)]),
            torch.cat([torch.arange(4), torch.arange(12), torch.arange(8)]),
            torch.arange(SEQ)])
    elif shape == "padding-free":   # TRL's: one row, positions restart, first labels -100
        pos = torch.cat([torch.arange(n) for n in (7, 5, 9, 3)]).unsqueeze(0)
        batch = {"input_ids": ids[:1], "position_ids": pos,
                 "labels": ids[:1].masked_fill(pos == 0, -100)}
    if shape in ("right padded", "left padded", "gaps"):
        batch["attention_mask"] = mask
    return batch


SHAPES = ["plain", "right padded", "left padded", "gaps", "packed rows", "padding-free"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral_sliding", "gemma3"])
def test_training_equals_transformers(kind, shape):
    """Loss and gradients of ``forward_backward`` (two microbatches) against the unwrapped
    model on transformers' ``"sdpa"`` (dense masks); sliding windows of 4 tokens (Mistral,
    Gemma 3's first layer) are shorter than every segment."""
    batch = batch_of(shape)
    model = causal_lm(kind, initializer_range=0.3)      # attention far from uniform
    assert model.config._attn_implementation == "sdpa"
    ref = model(**batch, use_cache=False).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu", num_microbatch=2)
    assert w.config._attn_implementation == attention.NAME
    loss = w.forward_backward(input_kwargs=batch)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    got = w.step(lambda: {n: p.grad.clone() for n, p in w.optim_named_parameters()})
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_other_implementations_are_kept_and_sdpa_can_be_chosen_back():
    """``"eager"`` stays the user's choice; ``set_attn_implementation("sdpa")`` after wrapping
    gives transformers' masks again (the same loss)."""
    batch = batch_of("right padded")
    eager = causal_lm("llama", attn_implementation="eager")
    w = roundpipe.wrap_model_to_roundpipe(eager, torch.float32, device="cpu")
    assert w.config._attn_implementation == "eager"
    model = causal_lm("llama")
    with torch.no_grad():
        want = model(**batch, use_cache=False).loss
    w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu")
    with torch.no_grad():
        ours = w(**batch).loss
        w.hf_model.set_attn_implementation("sdpa")
        back = w(**batch).loss
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(back, want, rtol=1e-6, atol=1e-6)


def test_a_model_whose_attention_reads_its_mask_keeps_sdpa_with_a_warning(monkeypatch):
    """An attention module that reads its mask as a tensor (here: its dtype) fails under
    segments at the wrap-time check: the model goes back to transformers' "sdpa" with a
    warning, and trains as transformers does."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaAttention.forward

    def reads_its_mask(self, hidden_states, position_embeddings, attention_mask, *args, **kw):
        if attention_mask is not None:
            assert attention_mask.dtype == torch.bool
        return forward(self, hidden_states, position_embeddings, attention_mask, *args, **kw)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", reads_its_mask)
    batch = batch_of("right padded")
    model = causal_lm("llama")
    with torch.no_grad():
        want = model(**batch, use_cache=False).loss
    with pytest.warns(UserWarning, match="keeps transformers' 'sdpa' attention"):
        w = roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu")
    assert w.config._attn_implementation == "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(w(**batch).loss, want, rtol=1e-6, atol=1e-6)


# --- memory linear in the sequence ------------------------------------------------------------

DOC = 512   # tokens per document (packed) or per row's valid run (padded)


def narrow_model(window=None):
    """One decoder layer, 16 wide, two query heads on one key/value head (GQA), vocabulary 64;
    with ``window``: a Mistral whose sliding window is shorter than the sequence."""
    torch.manual_seed(0)
    c = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    if window is not None:
        return transformers.MistralForCausalLM(transformers.MistralConfig(**c, sliding_window=window))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**c))


def long_batch(shape: str, seq: int) -> dict:
    """Two rows (one for padding-free) of ``seq`` tokens; padded rows hold DOC valid tokens,
    packed rows documents of DOC tokens (attention costs ``seq * DOC``, not ``seq**2``)."""
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(seq))
    batch = {"input_ids": ids, "labels": ids}
    if shape in ("right padded", "left padded"):
        mask = torch.zeros(2, seq, dtype=torch.long)
        mask[:, :DOC] = 1
        batch["attention_mask"] = mask if shape == "right padded" else mask.flip(1)
    elif shape == "packed rows":
        batch["position_ids"] = (torch.arange(seq) % DOC).expand(2, seq)
    elif shape == "padding-free":
        batch = {"input_ids": ids[:1], "labels": ids[:1],
                 "position_ids": (torch.arange(seq) % DOC).unsqueeze(0)}
    return batch


LONG = {"right padded": (4096, 8192, 16384), "left padded": (4096, 8192, 16384),
        "packed rows": (4096, 8192, 16384), "padding-free": (4096, 8192, 16384),
        "sliding window": (4096, 8192, 16384),
        # plain causal over the whole row costs seq**2 in time: shorter
        "plain": (2048, 4096, 8192)}


@pytest.mark.parametrize("shape", list(LONG))
def test_memory_per_microbatch_is_linear_in_the_sequence(shape):
    """The most bytes alive at once during one ``forward_backward`` of one microbatch, per
    token, stays flat as the sequence doubles (a quadratic term doubles it each time: a dense
    mask of two 16K rows would be 512 MiB); the stage inputs kept on the host are reported."""
    w = roundpipe.wrap_model_to_roundpipe(
        narrow_model(DOC // 2 if shape == "sliding window" else None), torch.float32,
        device="cpu", num_microbatch=1)
    per_token = []
    for seq in LONG[shape]:
        batch = long_batch("plain" if shape == "sliding window" else shape, seq)
        with LiveBytes() as counted:
            w.forward_backward(input_kwargs=batch)
        per_token.append(counted.peak / seq)
        stats = w.pipeline_stats()
        tokens = batch["input_ids"].numel()
        # every layer boundary's state (hidden 16 x 4 bytes, rotary, positions, labels, mask)
        assert 64 * tokens <= stats["host_stage_input_bytes"] <= 3 * 4 * 64 * tokens
    print(shape, [f"{b:.0f}" for b in per_token], "bytes per token")
    for shorter, longer in zip(per_token, per_token[1:]):
        assert longer <= 1.15 * shorter, per_token
