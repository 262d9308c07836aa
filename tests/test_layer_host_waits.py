"""No decoder layer of a Hugging Face model makes the host wait for the device.

transformers' mask functions decide what a layer's mask is with a Python ``if`` on a device
tensor (``padding_mask.all()``, the packed-sequence check on the positions). On a GPU each such
read is a host wait for all the work issued so far, and RoundPipe calls the mask function in
every layer, for every microbatch, forward and recomputation: the host could not run ahead of
the device by more than a layer. ``roundpipe.hf.attention.describe`` decides it once per
microbatch from the host's tensors instead.

What is counted, on the CPU device where CI runs: every read of a tensor's value into Python
(``bool``, ``item``, ``tolist``, ``int``, ``float``, ``index``) made by any thread while it runs a
decoder layer. The outputs are compared with plain transformers on the same inputs.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pipeline_models import causal_lm

transformers = pytest.importorskip("transformers")

import roundpipe  # noqa: E402
from roundpipe.hf import attention as hf_attention  # noqa: E402
from roundpipe.hf import layers as hf_layers  # noqa: E402

READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


class LayerReads:
    """Counts the value reads made inside ``Decoder.forward``, on any thread."""

    def __init__(self, monkeypatch) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.count = 0
        self.layer_calls = 0
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))
        forward = hf_layers.Decoder.forward

        def counted_forward(layer, state):
            self.local.depth = getattr(self.local, "depth", 0) + 1
            with self.lock:
                self.layer_calls += 1
            try:
                return forward(layer, state)
            finally:
                self.local.depth -= 1

        monkeypatch.setattr(hf_layers.Decoder, "forward", counted_forward)

    def _counting(self, read):
        def counted(tensor, *args, **kwargs):
            if getattr(self.local, "depth", 0):
                with self.lock:
                    self.count += 1
            return read(tensor, *args, **kwargs)
        return counted

    def reset(self) -> None:
        with self.lock:
            self.count = self.layer_calls = 0


@pytest.fixture
def reads(monkeypatch):
    return LayerReads(monkeypatch)


def _pair(kind: str, layers: int = 3):
    """The same tiny model twice: plain transformers, and wrapped (3 microbatches)."""
    plain = causal_lm(kind, num_hidden_layers=layers).eval()
    wrapped = roundpipe.wrap_model_to_roundpipe(causal_lm(kind, num_hidden_layers=layers),
                                                torch.float32, num_microbatch=3, device="cpu")
    return plain, wrapped


def _ids(rows: int = 6, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, 101, (rows, seq), generator=torch.Generator().manual_seed(0))


def _right_padded(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    mask[4, -7:] = 0
    return mask


def _padding_without_a_look() -> bool:
    """Whether the installed transformers' mask functions take ``allow_is_causal_skip``."""
    import inspect

    from transformers import masking_utils
    return "allow_is_causal_skip" in inspect.signature(masking_utils.create_causal_mask).parameters


@pytest.mark.parametrize("kind", ["llama", "mistral_sliding"])
@pytest.mark.parametrize("inputs", ["no mask", "mask of ones", "right padding"])
def test_forward_reads_nothing_in_a_layer_and_equals_transformers(reads, kind, inputs):
    plain, wrapped = _pair(kind)
    ids = _ids()
    mask = {"no mask": None, "mask of ones": torch.ones_like(ids),
            "right padding": _right_padded(ids)}[inputs]
    with torch.no_grad():
        expected = plain(ids, attention_mask=mask, use_cache=False).logits
    reads.reset()
    got = wrapped(ids, attention_mask=mask).logits
    assert reads.layer_calls == 3 * 3  # 3 layers x 3 microbatches: the counter saw them
    if inputs != "right padding" or _padding_without_a_look():
        assert reads.count == 0
    if mask is not None:  # positions behind padding are not compared (HF's are arbitrary)
        keep = mask.bool()
        got, expected = got[keep], expected[keep]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask", [False, True])
def test_training_reads_nothing_in_a_layer_forward_or_recomputation(reads, mask):
    """forward_backward: each layer runs twice per microbatch (forward and recomputation)."""
    _, wrapped = _pair("llama")
    ids = _ids()
    kwargs = {"input_ids": ids, "labels": ids}
    if mask:
        kwargs["attention_mask"] = torch.ones_like(ids)
    reads.reset()
    loss = wrapped.forward_backward(input_kwargs=kwargs)
    assert reads.layer_calls == 2 * 3 * 3
    assert reads.count == 0
    assert torch.isfinite(loss)


def test_a_packed_row_reads_nothing_in_a_layer(reads):
    """A padding-free row (positions restarting, no mask): its sequences are found once per
    microbatch on the host (``describe``), not by transformers' per-layer check on the device,
    and the logits keep attention within each sequence."""
    plain, wrapped = _pair("llama")
    ids = _ids(rows=1, seq=12)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        expected = plain(ids, position_ids=pos, use_cache=False).logits
    reads.reset()
    got = wrapped(ids, position_ids=pos).logits
    assert reads.layer_calls > 0
    assert reads.count == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2])
def test_generation_reads_nothing_in_a_layer(reads, rows):
    """Greedy decoding, one row, or two left-padded rows (a mask with zeros in every pass):
    the same tokens as transformers, no read in any layer of the prefill or of any decoding
    step (with padding: where transformers takes ``allow_is_causal_skip``)."""
    plain, wrapped = _pair("llama")
    ids = _ids(rows=rows, seq=6)
    mask = torch.ones_like(ids)
    mask[1:, :2] = 0  # the second row, left-padded
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = plain.generate(ids, **kwargs)
    reads.reset()
    got = wrapped.generate(ids, **kwargs)
    assert reads.layer_calls >= 3 * 6
    if rows == 1 or _padding_without_a_look():
        assert reads.count == 0
    assert torch.equal(got, expected)


@pytest.mark.parametrize("inputs, kind", [
    ({}, "causal"),
    ({"attention_mask": torch.ones(2, 5, dtype=torch.long)}, "causal"),
    ({"attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1] * 5])}, "padded"),
    ({"attention_mask": torch.tensor([[0, 1, 1]]), "kv": object()}, "padded"),
    ({"attention_mask": torch.ones(1, 1, 3, 3)}, None),
    ({"position_ids": torch.tensor([[3, 4, 5, 6]])}, "causal"),
    ({"position_ids": torch.tensor([[0, 1, 0, 1]])}, "packed"),
    ({"position_ids": torch.tensor([[0, 1, 0, 1]]), "kv": object()}, "causal"),
    ({"position_ids": torch.tensor([[0, 1, 0, 1]]),
      "attention_mask": torch.ones(1, 4, dtype=torch.long)}, "causal"),
])
def test_mask_kind(inputs, kind):
    """transformers looks for packed sequences only without a mask and a cache, and treats a
    mask of ones as no mask."""
    assert hf_attention.describe(inputs).kind == kind


class HostCopies:
    """Counts the copies to the host (``Tensor.cpu()``, ``Tensor.to`` a CPU device) made by any
    thread while it runs a decoder layer's forward pass (not its recomputation). On a GPU
    each is a synchronous device-to-host copy: the host waits for the device."""

    def __init__(self, monkeypatch) -> None:
        from roundpipe import recompute

        self.count = 0
        self.lock = threading.Lock()
        self.local = threading.local()
        to, cpu = torch.Tensor.to, torch.Tensor.cpu

        def inside() -> bool:
            return getattr(self.local, "depth", 0) > 0 and not recompute.doing_recompute()

        def counted_to(tensor, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if inside() and isinstance(target, (str, torch.device)) \
                    and torch.device(target).type == "cpu":
                with self.lock:
                    self.count += 1
            return to(tensor, *args, **kwargs)

        def counted_cpu(tensor, *args, **kwargs):
            if inside():
                with self.lock:
                    self.count += 1
            return cpu(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", counted_to)
        monkeypatch.setattr(torch.Tensor, "cpu", counted_cpu)
        forward = hf_layers.Decoder.forward

        def counted_forward(layer, state):
            self.local.depth = getattr(self.local, "depth", 0) + 1
            try:
                return forward(layer, state)
            finally:
                self.local.depth -= 1

        monkeypatch.setattr(hf_layers.Decoder, "forward", counted_forward)


def test_moe_routing_copies_nothing_to_the_host_in_a_layer(monkeypatch):
    """A MoE layer keeps its routing for the recomputation and adds its router statistics for
    the auxiliary loss: both go through the device I/O (asynchronous on CUDA, with an event),
    never a synchronous copy to the host inside the layer. Loss as transformers'."""
    from pipeline_models import causal_lm

    plain = causal_lm("qwen3_moe", num_hidden_layers=3)
    wrapped = roundpipe.wrap_model_to_roundpipe(causal_lm("qwen3_moe", num_hidden_layers=3),
                                                torch.float32, num_microbatch=3, device="cpu")
    ids = _ids()
    copies = HostCopies(monkeypatch)
    loss = wrapped.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    assert copies.count == 0
    monkeypatch.undo()
    want = plain(input_ids=ids, labels=ids).loss
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
