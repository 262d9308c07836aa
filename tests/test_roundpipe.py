"""RoundPipe against plain PyTorch training of the same model (an independent reference loop
written here: microbatches with gradient accumulation, the documented per-layer seeds)."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe, layer_seed


# --- models --------------------------------------------------------------------------------

def mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def transformer():
    layer = lambda: nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1,  # noqa: E731
                                               batch_first=True)
    return nn.Sequential(nn.Linear(8, 16), layer(), layer(), nn.Dropout(0.1), nn.Linear(16, 4))


def batchnorm():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


MODELS = {"mlp": mlp, "transformer": transformer, "batchnorm": batchnorm}


def data(name, step, batch=6):
    g = torch.Generator().manual_seed(1000 + step)
    shape = (batch, 5, 8) if name == "transformer" else (batch, 8)
    x = torch.randn(shape, generator=g)
    y = torch.randn(shape[:-1] + (4,), generator=g)
    return x, y


def loss_fn(out, target):
    """Written as for plain PyTorch: the mean over the microbatch's rows (of each row's summed
    squared error); RoundPipe weights it by the microbatch's share of the batch."""
    return ((out.float() - target.float()) ** 2).flatten(1).sum(1).mean()


OPTIMIZERS = {
    "torch.SGD": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5),
    # eps near lr: see docs/design.md §5 (gradients that cancel to ~0 amplify summation-order noise)
    "roundpipe.Adam": lambda ps: rpo.Adam(ps, lr=1e-2, eps=1e-2),
}


# --- the reference: a plain PyTorch loop ------------------------------------------------------

def reference_forward_backward(net, x, y, num_microbatch, call_seed, after_microbatch=None):
    """Plain loop: each microbatch forward (every layer seeded as RoundPipe documents) and
    backward, gradients accumulated by autograd into .grad (or handed to after_microbatch)."""
    total = 0.0
    for m, (xm, ym) in enumerate(zip(torch.tensor_split(x, num_microbatch),
                                     torch.tensor_split(y, num_microbatch))):
        h = xm
        for i, layer in enumerate(net):
            with torch.random.fork_rng():
                torch.manual_seed(layer_seed(call_seed, i, m))
                h = layer(h)
        loss = loss_fn(h, ym) * (len(xm) / len(x))  # gradient accumulation of a batch mean
        loss.backward()
        total += loss.item()
        if after_microbatch:
            after_microbatch()
    return total


def assert_params_equal(model, ref, rtol=1e-5, atol=1e-6):
    for (name, p), (rname, r) in zip(model.optim_named_parameters(), ref.named_parameters()):
        assert name == rname
        torch.testing.assert_close(p.detach(), r.detach(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("num_microbatch", [1, 3])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_fp32_training_matches_plain_pytorch(model_name, num_microbatch, opt_name):
    torch.manual_seed(0)
    net = MODELS[model_name]()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=num_microbatch)
    with OptimizerCtx():
        opt = OPTIMIZERS[opt_name](model.parameters())
    ref_opt = OPTIMIZERS[opt_name](ref.parameters())
    for step in range(10):
        x, y = data(model_name, step)
        torch.manual_seed(step)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        torch.manual_seed(step)
        ref_loss = reference_forward_backward(ref, x, y, num_microbatch, roundpipe.pipeline.execute.draw_call_seed())
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.isfinite(loss) and loss.item() == pytest.approx(ref_loss, rel=1e-5)
        assert_params_equal(model, ref)
    # the model copy follows the optimizer copy; buffers (BatchNorm statistics) match too
    for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, rb, rtol=1e-5, atol=1e-6, msg=name)
    for p, (_, r) in zip(net.parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_over_calls():
    torch.manual_seed(0)
    net = mlp()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=2)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        for call in range(3):
            x, y = data("mlp", 10 * step + call)
            torch.manual_seed(call)
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
            torch.manual_seed(call)
            reference_forward_backward(ref, x, y, 2, roundpipe.pipeline.execute.draw_call_seed())
        model.step(opt.step)
        ref_opt.step()
        ref_opt.zero_grad()
        assert_params_equal(model, ref)


def test_bf16_model_with_fp32_master_weights_matches_mixed_precision_loop():
    torch.manual_seed(0)
    master = mlp()                                  # fp32 master weights of the reference,
    with torch.no_grad():                           # starting, like RoundPipe's optimizer
        for p in master.parameters():               # copies, from the bf16 model's values
            p.copy_(p.bfloat16())
    ref_model = copy.deepcopy(master).to(torch.bfloat16)
    model = RoundPipe(copy.deepcopy(master).to(torch.bfloat16), optim_dtype=torch.float32,
                      num_microbatch=2)
    with OptimizerCtx():
        opt = rpo.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    ref_opt = rpo.AdamW(master.parameters(), lr=1e-2, eps=1e-3)
    assert all(p.dtype == torch.float32 for p in model.optim_parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for step in range(10):
        x, y = data("mlp", step)
        torch.manual_seed(step)
        loss = model.forward_backward(input_args=(x.bfloat16(),), label=y, loss_fn=loss_fn)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        # hand-written mixed precision: bf16 compute, fp32 gradient sum, fp32 update, re-cast
        def add_to_master():
            for p, r in zip(master.parameters(), ref_model.parameters()):
                p.grad = r.grad.float() if p.grad is None else p.grad + r.grad.float()
                r.grad = None

        torch.manual_seed(step)
        reference_forward_backward(ref_model, x.bfloat16(), y, 2,
                                   roundpipe.pipeline.execute.draw_call_seed(), add_to_master)
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for p, r in zip(master.parameters(), ref_model.parameters()):
                r.copy_(p)
        assert_params_equal(model, master)
        for p, r in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, r, rtol=0, atol=0)


def test_only_one_stage_on_the_device_at_a_time(monkeypatch):
    alive: list[list] = []  # per upload, weakrefs to its device tensors
    peak = 0
    real = roundpipe.transfer.CpuIO.upload

    def tracking_upload(self, layers, with_grad):
        nonlocal peak
        gc.collect()
        resident = sum(1 for refs in alive if any(r() is not None for r in refs))
        peak = max(peak, resident)
        w, event = real(self, layers, with_grad)
        alive.append([weakref.ref(t) for d in w.layers for t in d.values()])
        return w, event

    monkeypatch.setattr(roundpipe.transfer.CpuIO, "upload", tracking_upload)
    model = RoundPipe(mlp(), num_microbatch=3)
    x, y = data("mlp", 0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model(x)
    assert len(alive) == 4 + 5 + 5  # forward pass (4 stages) + backward (5) + inference (5)
    assert peak == 0, "a previous stage's weights were still alive when the next was uploaded"
    gc.collect()
    assert all(r() is None for refs in alive for r in refs)


def test_inference_forward_and_eval_mode():
    torch.manual_seed(0)
    net = batchnorm()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=3)
    x, _ = data("batchnorm", 0)
    model.eval()
    ref.eval()
    assert not net.training
    torch.testing.assert_close(model(x), ref(x))
    # train-mode forward updates the host's BatchNorm statistics per microbatch
    model.train()
    ref.train()
    model(x)
    with torch.no_grad():
        for xm in torch.tensor_split(x, 3):
            ref(xm)
    torch.testing.assert_close(net[1].running_mean, ref[1].running_mean)


def test_parameters_and_optimizer_ctx():
    net = mlp().to(torch.bfloat16)
    model = RoundPipe(net, optim_dtype=torch.float32)
    names = [n for n, _ in net.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == names
    assert [n for n, _ in model.optim_named_parameters()] == names
    with OptimizerCtx():
        inside = list(model.parameters())
        named = dict(model.named_parameters())
    assert all(a is b for a, b in zip(inside, model.optim_parameters()))
    assert list(named) == names and all(p.dtype == torch.float32 for p in inside)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    # both ways of the guide build the same optimizer
    with OptimizerCtx():
        a = torch.optim.AdamW(model.parameters())
    b = torch.optim.AdamW(model.optim_parameters())
    assert [p for g in a.param_groups for p in g["params"]] == \
        [p for g in b.param_groups for p in g["params"]]


def test_step_fn_sees_fp32_gradients_and_clip_grad_norm_works():
    torch.manual_seed(0)
    net = mlp()
    ref = copy.deepcopy(net)
    model = RoundPipe(net.to(torch.bfloat16), optim_dtype=torch.float32, num_microbatch=1)
    x, y = data("mlp", 0)
    model.forward_backward(input_args=(x.bfloat16(),), label=y, loss_fn=loss_fn)
    seen = {}

    def step_fn():
        grads = [p.grad for p in model.parameters()]
        seen["dtypes"] = {g.dtype for g in grads}
        seen["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        seen["after"] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))

    model.step(step_fn)
    assert seen["dtypes"] == {torch.float32}
    assert seen["norm"] > 1e-3 and seen["after"] == pytest.approx(1e-3, rel=1e-3)
    assert all(p.grad is None for p in model.optim_parameters())


class Boom(RuntimeError):
    pass


def test_errors_reach_the_caller_and_the_wrapper_stays_usable():
    torch.manual_seed(0)
    net = mlp()
    ref = copy.deepcopy(net)
    model = RoundPipe(net, num_microbatch=2)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data("mlp", 0)

    def bad_loss(out, target):
        raise Boom("in loss_fn")

    with pytest.raises(Boom, match="in loss_fn"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=bad_loss)
    hook = net[2].register_forward_hook(lambda *a: (_ for _ in ()).throw(Boom("in a layer")))
    with pytest.raises(Boom, match="in a layer"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    hook.remove()
    with pytest.raises(Boom, match="in step_fn"):
        model.step(lambda: (_ for _ in ()).throw(Boom("in step_fn")))
    with pytest.raises(TypeError, match="loss_fn"):
        model.forward_backward(input_args=(x,), label=y)
    # nothing was applied; the next iteration trains exactly like the reference
    torch.manual_seed(5)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(opt.step)
    torch.manual_seed(5)
    reference_forward_backward(ref, x, y, 2, roundpipe.pipeline.execute.draw_call_seed())
    ref_opt.step()
    assert_params_equal(model, ref)


def test_weights_loaded_after_wrapping_are_trained():
    net = mlp()
    model = RoundPipe(net)
    other = mlp()
    net.load_state_dict(other.state_dict())   # behind the wrapper's back
    for (_, o), (_, p) in zip(model.optim_named_parameters(), other.named_parameters()):
        assert not torch.equal(o, p)          # stale until the wrapper runs
    x, y = data("mlp", 0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(lambda: None)                  # a no-op step must not restore stale weights
    for (_, o), (_, p) in zip(model.optim_named_parameters(), other.named_parameters()):
        assert torch.equal(o, p)
    # load_state_dict on the wrapper keeps full precision in the optimizer copies
    bf = RoundPipe(mlp().to(torch.bfloat16), optim_dtype=torch.float32)
    sd = mlp().state_dict()
    bf.load_state_dict(sd)
    for (name, o) in bf.optim_named_parameters():
        assert torch.equal(o, sd[name])
    assert torch.equal(bf.state_dict()["0.weight"], sd["0.weight"])


_RESUME = r"""
import sys, torch, roundpipe, roundpipe.optim as rpo
sys.path.insert(0, sys.argv[1])
from test_roundpipe import transformer, data, loss_fn
path, start, steps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = roundpipe.RoundPipe(transformer(), num_microbatch=2)
with roundpipe.OptimizerCtx():
    opt = rpo.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
if start:
    ckpt = torch.load(path, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
for step in range(start, start + steps):
    x, y = data("transformer", step)
    torch.manual_seed(step)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    model.step(lambda: (opt.step(), opt.zero_grad()))
    print(repr(loss.item()))
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
"""


def test_checkpoint_resume_in_a_fresh_process_gives_the_same_losses(tmp_path):
    def run(start, steps, path):
        r = subprocess.run([sys.executable, "-c", _RESUME, os.path.dirname(__file__), str(path),
                            str(start), str(steps)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return [float(v) for v in r.stdout.split()]

    straight = run(0, 6, tmp_path / "a.pt")
    resumed = run(0, 3, tmp_path / "b.pt") + run(3, 3, tmp_path / "b.pt")
    assert resumed == straight


class Router(nn.Module):
    """Takes one of two paths, chosen by a counter that changes on every call: the
    recomputation must reuse the first run's choice, which it keeps with save_for_recompute."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        if roundpipe.doing_recompute():
            (choice,) = roundpipe.get_recompute_data()
        else:
            self.calls += 1
            choice = self.calls % 2
            roundpipe.save_for_recompute(choice)
        return self.a(x) if choice else self.b(x)


def test_recompute_helpers_keep_layer_decisions():
    net = nn.Sequential(Router(), nn.ReLU(), nn.Linear(8, 4))
    model = RoundPipe(net, num_microbatch=2)
    x, y = data("mlp", 0)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
    grads = model.accumulated_grads()
    # microbatch 0 took path a (calls=1), microbatch 1 path b (calls=2): both got gradients
    assert grads["0.a.weight"] is not None and grads["0.b.weight"] is not None
    with pytest.raises(RuntimeError, match="outside"):
        roundpipe.save_for_recompute(1)
    with pytest.raises(RuntimeError, match="outside"):
        roundpipe.get_recompute_data()
    assert not roundpipe.doing_recompute()


def test_microbatch_split_and_merge_and_custom_split():
    args = (torch.arange(10).reshape(5, 2), "flag", torch.ones(3))
    parts = roundpipe.split_microbatches(args, {"mask": torch.zeros(5)}, torch.arange(5), 2)
    assert [p[0][0].shape[0] for p in parts] == [3, 2]
    assert parts[1][0][1] == "flag" and parts[1][0][2].shape == (3,)   # not batched: replicated
    assert torch.equal(parts[1][2], torch.tensor([3, 4]))
    assert len(roundpipe.split_microbatches(args, {}, None, 9)) == 5     # at most one row each
    merged = roundpipe.merge_outputs([{"a": torch.ones(2, 1)}, {"a": torch.zeros(1, 1)}])
    assert merged["a"].shape == (3, 1)
    seen = []

    def split_fn(a, k, label, n):
        seen.append(n)
        return roundpipe.split_microbatches(a, k, label, n)

    model = RoundPipe(mlp(), split_fn=split_fn, num_microbatch=3)
    x, y = data("mlp", 0)
    loss, out = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn,
                                       return_outputs=True)
    assert seen == [3] and out.shape == (6, 4)


def test_bad_construction_and_device_moves():
    with pytest.raises(ValueError, match="optim_dtype"):
        RoundPipe(mlp(), optim_dtype=torch.int32)
    with pytest.raises(ValueError, match="num_microbatch"):
        RoundPipe(mlp(), num_microbatch=0)
    with pytest.raises(TypeError, match="nn.Module"):
        RoundPipe(lambda x: x)
    model = RoundPipe(mlp())
    with pytest.raises(TypeError, match="host"):
        model.to(torch.float16)


def test_import_does_not_initialise_cuda():
    r = subprocess.run([sys.executable, "-c", "import torch, roundpipe, roundpipe.optim; "
                        "print(torch.cuda.is_initialized())"], capture_output=True, text=True)
    assert r.stdout.strip() == "False", r.stderr


def test_repeated_layers_sequential_subclasses_and_tied_weights():
    x = torch.randn(4, 8)
    shared = nn.Linear(8, 8)
    net = nn.Sequential(shared, nn.Tanh(), shared)            # one module, run twice
    model = RoundPipe(net)
    model.eval()
    torch.testing.assert_close(model(x), net(x))

    class Residual(nn.Sequential):                             # its own forward: one layer
        def forward(self, x):
            return x + super().forward(x)

    res = Residual(nn.Linear(8, 8), nn.Tanh())
    model = RoundPipe(res)
    model.eval()
    torch.testing.assert_close(model(x), res(x))

    emb = nn.Embedding(16, 8)
    head = nn.Linear(8, 16, bias=False)
    head.weight = emb.weight                                   # tied across stages
    model = RoundPipe(nn.Sequential(emb, nn.Tanh(), head).to(torch.bfloat16),
                      optim_dtype=torch.float32)
    with torch.no_grad():
        next(model.optim_parameters()).add_(1e-3)              # not representable in bf16
    sd = model.state_dict()
    assert sd["0.weight"].dtype == torch.float32 and torch.equal(sd["0.weight"], sd["2.weight"])


def test_deepcopy_and_unfreezing_after_wrapping():
    torch.manual_seed(0)
    model = RoundPipe(mlp())
    twin = copy.deepcopy(model)
    x, y = data("mlp", 0)
    for m in (model, twin):
        torch.manual_seed(1)
        m.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        m.step(lambda: None)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    net[1].requires_grad_(False)
    model = RoundPipe(net)
    net[1].requires_grad_(True)
    with pytest.raises(RuntimeError, match="frozen when the model was wrapped"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
