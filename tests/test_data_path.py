"""The data path, measured without a GPU: the per-device schedule, the bytes moved by kind
against their floor (formulas written here from the model's shapes), gradients summed on the
device equal to plain host summation, host memory per parameter, buffers copied back only
when changed, which stage inputs require grad, and the CUDA transfer code (faked) moving the
same bytes into exactly sized pinned memory."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import RoundPipe, layer_seed
from roundpipe.bench.memory import CONFIGS, measure_memory
from roundpipe.pipeline.schedule import Visit, device_orders, pass_order

from conftest import use_fake_cuda_io


# --- the schedule ----------------------------------------------------------------------------

def test_pass_order_and_device_orders():
    assert pass_order(3, training=False) == [Visit(0, False), Visit(1, False), Visit(2, False)]
    assert pass_order(3, training=True) == [Visit(0, False), Visit(1, False), Visit(2, True),
                                           Visit(1, True), Visit(0, True)]
    # stages below the first trainable one get no backward visit; the last stage always runs
    assert pass_order(4, training=True, first_backward=2) == [
        Visit(0, False), Visit(1, False), Visit(2, False), Visit(3, True), Visit(2, True)]
    assert pass_order(2, training=True, first_backward=9) == [Visit(0, False), Visit(1, True)]
    assert pass_order(1, training=True) == [Visit(0, True)]
    with pytest.raises(ValueError, match="num_stages"):
        pass_order(0, training=True)
    for stages in range(1, 7):
        for first in range(stages):
            order = pass_order(stages, True, first)
            for devices in range(1, 4):
                per_device = device_orders(order, devices)
                assert sorted(v for vs in per_device for v in vs) == sorted(order)
                for d, visits in enumerate(per_device):
                    assert all(v.stage % devices == d for v in visits)
                    positions = [order.index(v) for v in visits]
                    assert positions == sorted(positions)  # a subsequence of the global order
            # every visit comes after what it depends on
            for k, v in enumerate(order):
                deps = []
                if not v.backward and v.stage > 0:
                    deps.append(Visit(v.stage - 1, False))
                if v.backward and v.stage < stages - 1:
                    deps.append(Visit(v.stage + 1, True))
                if v.backward and v.stage > 0:
                    deps.append(Visit(v.stage - 1, False))
                assert all(order.index(d) < k for d in deps), (order, v)


# --- bytes moved against the floor -------------------------------------------------------------

def _mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("M", [1, 2, 4, 10])
def test_transfer_counters_equal_the_formulas(M, devices, dtype):
    net = _mlp(dtype)
    model = RoundPipe(net, optim_dtype=torch.float32, device=["cpu"] * devices, num_microbatch=M)
    batch = 10
    x, y = torch.randn(batch, 8, dtype=dtype), torch.randn(batch, 4)
    model.forward_backward(input_args=(x,), label=y,
                           loss_fn=lambda o, t: ((o.float() - t) ** 2).sum(), loss_reduction="sum")
    model.synchronize()
    s = model.pipeline_stats()
    item = torch.tensor([], dtype=dtype).element_size()
    P = [sum(p.numel() for p in layer.parameters()) for layer in net]  # per stage (one layer)
    S = len(P)
    # weights: every stage once forward (stages 0..S-2), once backward (all S)
    weights = item * (sum(P[:-1]) + sum(P))
    assert s["h2d_weight_bytes"] == s["weight_floor_bytes"] == weights
    # parameter gradients: once per stage and call, model dtype for one microbatch else fp32
    grads = sum(P) * min(M * item, 4)
    assert s["d2h_param_grad_bytes"] == s["param_grad_floor_bytes"] == grads
    # activations: stage inputs up in both passes, stage outputs down in the forward pass
    width = [8, 16, 16, 16, 16]                # input width of each stage
    up = sum(width[:-1]) + sum(width)
    assert s["h2d_activation_bytes"] == batch * item * up
    assert s["d2h_activation_bytes"] == batch * item * sum(width[1:])
    # input gradients of stages 1..S-1 down, and up into stages 0..S-2
    assert s["d2h_input_grad_bytes"] == s["h2d_input_grad_bytes"] == batch * item * sum(width[1:])
    assert s["h2d_label_bytes"] == batch * 4 * 4
    # one float64 loss per microbatch (no gradient norms: nothing clips or scales)
    assert s["d2h_output_bytes"] == 8 * min(M, batch)
    assert s["h2d_buffer_bytes"] == s["d2h_buffer_bytes"] == 0
    assert S == 5


def test_gradients_summed_on_the_device_equal_plain_host_summation():
    """bf16 model, 3 microbatches, 1 and 3 devices: the accumulated fp32 gradients are bit for
    bit the per-microbatch bf16 gradients of plain PyTorch converted and added in order."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 32),
                        nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16)
    x, y = torch.randn(9, 8).bfloat16(), torch.randn(9, 4)

    def loss_fn(o, t):
        return ((o.float() - t) ** 2).sum() / 9

    ref = copy.deepcopy(net)
    torch.manual_seed(7)
    seed = roundpipe.pipeline.execute.draw_call_seed()
    sums = [None] * len(list(ref.parameters()))
    for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, 3), torch.tensor_split(y, 3))):
        h = xm
        for i, layer in enumerate(ref):
            with torch.random.fork_rng():
                torch.manual_seed(layer_seed(seed, i, m))
                h = layer(h)
        loss_fn(h, ym).backward()
        for k, p in enumerate(ref.parameters()):
            g = p.grad.float()
            sums[k] = g if sums[k] is None else sums[k] + g
            p.grad = None
    for devices in (1, 3):
        model = RoundPipe(copy.deepcopy(net), optim_dtype=torch.float32,
                          device=["cpu"] * devices, num_microbatch=3)
        torch.manual_seed(7)
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, loss_reduction="sum")
        for k, (g, r) in enumerate(zip(model.accumulated_grads().values(), sums)):
            assert g.dtype == torch.float32 and torch.equal(g, r), k


# --- host memory per parameter ------------------------------------------------------------------

FP32_ADAMW = CONFIGS[0]  # bf16 model copy, fp32 optimizer copies, fp32 AdamW


@pytest.mark.parametrize("mode,bound", [("step", 19.5), ("async", 19.5), ("exact", 15.5)])
def test_host_bytes_per_parameter(mode, bound):
    """bf16 model copy (2 B), fp32 optimizer copy (4), AdamW state (8), fp32 gradient (4,
    none kept in exact mode): peak RSS over the parameter count of a 12-layer, 157M-parameter
    model trained 3 steps on the CPU device, after a warm-up of the fixed costs."""
    per_param = measure_memory(FP32_ADAMW, 1280, mode)   # as python -m roundpipe.bench memory
    floor = 14 if mode == "exact" else 18
    assert floor <= per_param <= bound, per_param


# --- buffers, stage inputs ------------------------------------------------------------------------

class Scale(nn.Module):
    """Multiplies by a buffer it never changes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((16,), 2.0))

    def forward(self, x):
        return x * self.scale


def test_buffers_go_back_only_when_a_layer_changed_them():
    model = RoundPipe(nn.Sequential(nn.Linear(8, 16), Scale(), nn.Linear(16, 4)), num_microbatch=2)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum(), loss_reduction="sum")
    s = model.pipeline_stats(reset=True)
    assert s["h2d_buffer_bytes"] == 2 * 16 * 4   # uploaded with the stage, forward and backward
    assert s["d2h_buffer_bytes"] == 0            # never copied back
    bn = nn.BatchNorm1d(16)
    model = RoundPipe(nn.Sequential(nn.Linear(8, 16), bn, nn.Linear(16, 4)), num_microbatch=2)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum(), loss_reduction="sum")
    s = model.pipeline_stats(reset=True)
    buffer_bytes = sum(b.numel() * b.element_size() for b in bn.buffers())
    assert s["d2h_buffer_bytes"] == buffer_bytes  # once, after the forward visit
    assert int(bn.num_batches_tracked) == 2       # one update per microbatch, none on recompute
    model.eval()
    model(x)
    assert model.pipeline_stats()["d2h_buffer_bytes"] == 0  # eval mode changes nothing


class Probe(nn.Module):
    """Records whether its input requires grad in the recomputation."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        if roundpipe.doing_recompute():
            self.seen.append(x.requires_grad)
        return x


def test_stage_inputs_require_grad_only_when_an_earlier_stage_trains():
    frozen = nn.Linear(8, 8).requires_grad_(False)
    probe1, probe2 = Probe(), Probe()
    net = nn.Sequential(frozen, probe1, nn.Linear(8, 8), probe2, nn.Linear(8, 4))
    model = RoundPipe(net, num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    model.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum(), loss_reduction="sum")
    s = model.pipeline_stats()
    # stages 0 and 1 hold nothing trainable and feed nothing trainable: no backward visit,
    # so probe1 is never recomputed; probe2 follows a trainable stage: its input requires grad
    assert probe1.seen == [] and probe2.seen == [True, True]
    P = [sum(p.numel() for p in m.parameters()) for m in net]
    assert s["weight_floor_bytes"] == 4 * (sum(P[:-1]) + sum(P[2:]))
    assert s["d2h_input_grad_bytes"] == 4 * 4 * 8 * 2  # stages 3 and 4 only
    assert frozen.weight.grad is None


def test_in_place_operations_on_stage_inputs_train_as_in_plain_pytorch():
    class AddInPlace(nn.Module):
        def forward(self, x):
            return x.mul_(2).add_(1)

    torch.manual_seed(0)
    net = nn.Sequential(AddInPlace(), nn.Linear(8, 8), AddInPlace(), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    x_before = x.clone()
    loss = model.forward_backward(input_args=(x,), label=y,
                                  loss_fn=lambda o, t: ((o - t) ** 2).sum(), loss_reduction="sum")
    assert torch.equal(x, x_before)                     # the caller's batch is untouched
    grads = model.accumulated_grads()
    ref_loss = 0
    for xm, ym in zip(torch.tensor_split(x.clone(), 2), torch.tensor_split(y, 2)):
        out = ref(xm)
        loss_m = ((out - ym) ** 2).sum()
        loss_m.backward()
        ref_loss += loss_m.item()
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    for g, (name, p) in zip(grads.values(), ref.named_parameters()):
        torch.testing.assert_close(g, p.grad, msg=name)


# --- the CUDA transfer code, faked: the same bytes, exact pinned sizes ------------------------------

def test_faked_cuda_moves_the_same_bytes_and_pins_exact_sizes(fake_cuda):
    results = []
    for cuda in (False, True):
        net = _mlp(torch.bfloat16)
        model = RoundPipe(net, optim_dtype=torch.float32, device=["cpu", "cpu"], num_microbatch=4)
        if cuda:
            use_fake_cuda_io(model, fake_cuda)
        x, y = torch.randn(8, 8).bfloat16(), torch.randn(8, 4)
        opt = rpo.SGD(model.optim_parameters(), lr=0.1)
        model.forward_backward(input_args=(x,), label=y,
                               loss_fn=lambda o, t: ((o.float() - t) ** 2).sum(), optimizer=opt, loss_reduction="sum")
        model.synchronize()
        stats = model.pipeline_stats()
        # bytes moved and their floors; not the gauges (host_stage_input_bytes: the most held at
        # once, which depends on how the two workers interleave)
        gauges = ("pinned_bytes", "host_stage_input_bytes", "disk_window_bytes")
        results.append(({k: v for k, v in stats.items() if k.endswith("bytes") and k not in gauges},
                        [p.detach().clone() for p in model.optim_parameters()]))
        if cuda:
            align = fake_cuda._align
            slot = max(sum(align(4 * p.numel()) for p in layer.parameters()) for layer in net)
            # stages 0, 2, 4 (the trainable ones) run on device 0; device 1 never downloads
            assert model._ios[0]._ring.size == 2 * slot and model._ios[1]._ring is None
    (bytes_cpu, params_cpu), (bytes_cuda, params_cuda) = results
    assert bytes_cpu == bytes_cuda
    for a, b in zip(params_cpu, params_cuda):
        assert torch.equal(a, b)
    # the pinned model copy: one arena of exactly the aligned sizes, the tensors views into it
    net = _mlp(torch.bfloat16).append(nn.BatchNorm1d(4))
    values = {k: v.clone() for k, v in net.state_dict().items()}
    mode, pinned = fake_cuda.pin_host_model(net, "alloc", torch.device("cpu"))
    tensors = list(net.parameters()) + [b for b in net.buffers()]
    assert mode == "alloc"
    assert pinned == sum(fake_cuda._align(t.numel() * t.element_size()) for t in tensors)
    for k, v in net.state_dict().items():
        assert torch.equal(v, values[k]), k
    arena = net._roundpipe_pinned_arenas[0].buffer
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert all(start <= t.data_ptr() < end for t in tensors)


def test_the_callers_autocast_reaches_the_layers_on_every_worker():
    seen = []

    class Check(nn.Module):
        def forward(self, x):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return x

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), Check(), nn.Linear(8, 8), Check(), nn.Linear(8, 4))
    ref = copy.deepcopy(net)
    model = RoundPipe(net, device=["cpu", "cpu"], num_microbatch=2)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        loss = model.forward_backward(input_args=(x,), label=y,
                                      loss_fn=lambda o, t: ((o.float() - t) ** 2).sum(), loss_reduction="sum")
        ref_loss = sum(((ref(xm).float() - ym) ** 2).sum()
                       for xm, ym in zip(torch.tensor_split(x, 2), torch.tensor_split(y, 2)))
    assert out.dtype == torch.bfloat16
    assert seen and all(s == (True, torch.bfloat16) for s in seen)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    seen.clear()
    model(x)                                   # outside autocast: off on the workers too
    assert seen and all(not enabled for enabled, _ in seen)
