"""Shared fixtures and the comparison harness against torch.optim. The pipeline tests' models
and reference loop are in tests/pipeline_models.py, the multi-process launcher in
tests/launcher.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import roundpipe.optim as rpo

# The helper modules of tests/ (imported by name: pytest puts tests/ on sys.path) get pytest's
# assertion messages too.
pytest.register_assert_rewrite("launcher", "pipeline_models", "quant_reference", "trainer_cases")

SHAPES = [(), (0,), (1,), (17,), (4097,), (33, 65)]


@pytest.fixture(params=rpo.supported_isas())
def isa(request):
    """Runs the test once per ISA this machine supports, with that ISA forced."""
    before = rpo.active_isa()
    rpo.set_isa(request.param)
    yield request.param
    rpo.set_isa(before)


class ieee_sqrt(TorchFunctionMode):
    """Within it, torch's square roots of float32 CPU tensors (torch.sqrt, Tensor.sqrt,
    Tensor.sqrt_) are correctly rounded, as IEEE 754 defines sqrt (numpy's, which is that).

    The torch.optim references run in it. torch's own CPU sqrt is MKL's vsSqrt (faithful, not
    correctly rounded), and MKL picks its code path from its own CPU detection, vendor included,
    whatever ATEN_CPU_CAPABILITY says. Off by one ulp on 1M random floats: 0.7% on an AVX-512
    Xeon, none on an AVX2 Intel CPU, about 15% on an AMD EPYC. Our kernels take the IEEE square
    root everywhere; RMSprop's centered variance (square_avg - grad_avg**2) amplifies that ulp
    into a failure on some CPUs and not on others. With this, a comparison is the same on every
    CPU (and ours and torch agree bit for bit wherever both round the same way).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.sqrt, torch.Tensor.sqrt, torch.Tensor.sqrt_) and not kwargs:
            (x,) = args
            if x.dtype == torch.float32 and x.device.type == "cpu":
                out = x if func is torch.Tensor.sqrt_ else torch.empty_like(x)
                np.sqrt(x.detach().numpy(), out=out.detach().numpy())
                return out
        return func(*args, **kwargs)


def make_params(shapes=SHAPES, seed=0, as_views=False):
    """Float32 leaf parameters of the given shapes; with as_views, views into one flat buffer."""
    gen = torch.Generator().manual_seed(seed)
    if not as_views:
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    sizes = [torch.Size(s).numel() for s in shapes]
    flat = torch.randn(sum(sizes), generator=gen)
    out, offset = [], 0
    for s, n in zip(shapes, sizes):
        out.append(torch.nn.Parameter(flat[offset : offset + n].view(s)))
        offset += n
    return out


def assert_same_training(ours_cls, torch_cls, kwargs, *, steps=20, grad_scale=1.0, seed=0,
                         shapes=SHAPES, as_views=False, scheduler=None, rtol=1e-5, atol=1e-6):
    """Trains identical parameters with both optimizers on identical gradients and checks that
    parameters and every state tensor agree after each step (rtol 1e-5; atol 1e-6 for
    parameters, 1e-6 times the tensor's magnitude for state); the reference steps in ieee_sqrt.
    Returns both optimizers."""
    ours_params = make_params(shapes, seed, as_views)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    ours = ours_cls(ours_params, **copy.deepcopy(kwargs))
    ref = torch_cls(ref_params, foreach=False, **copy.deepcopy(kwargs))
    scheds = [scheduler(o) for o in (ours, ref)] if scheduler else []
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        for a, b in zip(ours_params, ref_params):
            g = torch.randn(a.shape, generator=gen) * grad_scale
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        with ieee_sqrt():
            ref.step()
        for s in scheds:
            s.step()
        for i, (a, b) in enumerate(zip(ours_params, ref_params)):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol,
                                       msg=lambda m: f"param {i} after step {step + 1}: {m}")
            sa, sb = ours.state[a], ref.state[b]
            assert sa.keys() == sb.keys(), f"state keys {sorted(sa)} vs {sorted(sb)}"
            for k in sb:
                va, vb = sa[k], sb[k]
                if torch.is_tensor(vb):
                    assert va.dtype == vb.dtype and va.shape == vb.shape, f"state {k!r}"
                    # State tensors live at the gradient's scale (1e-20 gradients give 1e-40
                    # second moments), so their absolute tolerance is atol times the tensor's
                    # own magnitude: as strict at 1e-20 as at 1, where a fixed 1e-6 could not
                    # fail. Elements that cancel to ~0 (exp_avg crossing zero) differ by a
                    # rounding of the operands, not of the result, hence the atol term.
                    scale = vb.abs().max().item() if vb.numel() else 0.0
                    torch.testing.assert_close(va, vb, rtol=rtol, atol=atol * max(scale, 1e-38),
                                               msg=lambda m: f"state {k!r} of param {i}: {m}")
                else:
                    assert va == vb, f"state {k!r} of param {i}"
    return ours, ref


# --- CUDA faked on the CPU: the CUDA transfer code runs, every copy happens on the host -------

class FakeEvent:
    """torch.cuda.Event stand-in: checks that nothing waits for an event never recorded."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def synchronize(self):
        assert self.recorded, "waited for an event that was never recorded"

    def query(self):
        return self.recorded

    def elapsed_time(self, other):
        assert self.recorded and other.recorded
        return 1.0  # ms


class FakeStream:
    def __init__(self, device=None):
        self.waited: list = []

    def wait_event(self, event):
        assert event.recorded, "a stream waits for an event never recorded"
        self.waited.append(event)

    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """Replaces CUDA streams, events, pinned allocation and registration by CPU stand-ins;
    returns the ``roundpipe.transfer.cuda`` module (build ``CudaIO`` objects on CPU devices)."""
    import contextlib

    import roundpipe.transfer.cuda as ct

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    monkeypatch.setattr(ct, "_pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr(ct, "_register", lambda ptr, size: 0)
    monkeypatch.setattr(ct, "_unregister", lambda pointers: None)
    return ct


def use_fake_cuda_io(model, ct, prefetch=True):
    """Gives a RoundPipe on CPU devices the CUDA transfer code (with ``fake_cuda`` active)."""
    writes = ct.HostWrites()
    model._ios = [ct.CudaIO(d, model._stats, prefetch, model._grad_numels, writes)
                  for d in model.devices]
    return model
