"""RoundPipe as an nn.Module, against plain PyTorch: moves that change nothing are accepted,
real ones raise before anything changes; floating inputs are cast to the model copy's dtype
(labels are not); torch.compile of the wrapper runs it eagerly with a warning, while layers
compiled before wrapping run compiled inside the pipeline and train as the uncompiled model."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from roundpipe import RoundPipe


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_fn(out, y):
    return ((out.float() - y) ** 2).sum() / 6


def gradients(model):
    """The accumulated gradients, read where step_fn sees them (fp32 optimizer copies)."""
    grads = []
    model.step(lambda: grads.extend(p.grad.clone() for p in model.parameters()))
    return grads


# --- .to() and friends ---------------------------------------------------------------------------

def test_moves_that_change_nothing_return_the_model_unchanged():
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    model = RoundPipe(net, device="cpu")
    before = {k: (v, v.data_ptr()) for k, v in net.state_dict(keep_vars=True).items()}
    for call in (lambda: model.to("cpu"), lambda: model.to(torch.device("cpu")), model.cpu,
                 model.float, lambda: model.to(torch.float32),
                 lambda: model.to("cpu", torch.float32, non_blocking=True),
                 lambda: model.to(memory_format=torch.contiguous_format)):
        assert call() is model
    after = net.state_dict(keep_vars=True)
    assert all(after[k] is t and t.data_ptr() == ptr for k, (t, ptr) in before.items())
    half = RoundPipe(mlp().half(), device="cpu")
    assert half.half() is half and half.to(torch.float16) is half
    x, y = torch.randn(6, 8), torch.randn(6, 4)  # still trains
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, loss_reduction="sum")


@pytest.mark.parametrize("call", ["half", "double", "bfloat16", "meta", "cuda", "share_memory",
                                  "channels_last", "to_empty", "type"])
def test_real_moves_raise_before_anything_changes(call):
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    model = RoundPipe(net, device="cpu")
    before = {k: (v, v.dtype, v.data_ptr(), v.stride()) for k, v in
              net.state_dict(keep_vars=True).items()}
    calls = {"half": model.half, "double": model.double, "bfloat16": model.bfloat16,
             "meta": lambda: model.to("meta"), "cuda": lambda: model.cuda(),
             "share_memory": model.share_memory,
             "channels_last": lambda: model.to(memory_format=torch.channels_last),
             "to_empty": lambda: model.to_empty(device="cpu"),
             "type": lambda: model.type(torch.float32)}  # also converts the int64 counter
    if call == "cuda" and torch.cuda.is_available():
        pytest.skip("the message for .cuda() is checked where CUDA is absent")
    with pytest.raises(TypeError, match=r"before wrapping.*device=\.\.\."):
        calls[call]()
    after = net.state_dict(keep_vars=True)
    assert all(after[k] is t and (t.dtype, t.data_ptr(), t.stride()) == (dtype, ptr, stride)
               for k, (t, dtype, ptr, stride) in before.items())
    assert not any(t.is_shared() for t in after.values())


# --- who casts the inputs ------------------------------------------------------------------------

def test_floating_inputs_are_cast_to_the_model_dtype_and_labels_are_not():
    """A bf16 model given float32 inputs trains as plain PyTorch given the inputs cast to
    bf16; the label reaches loss_fn as given; the caller's tensors are not touched."""
    net = mlp().to(torch.bfloat16)
    ref = copy.deepcopy(net)
    model = RoundPipe(net, optim_dtype=torch.float32, device="cpu", num_microbatch=1)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    x_before = x.clone()
    seen = []

    def recording_loss(out, label):
        seen.append((out.dtype, label.dtype))
        return loss_fn(out, label)

    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=recording_loss, loss_reduction="sum")
    ref_loss = loss_fn(ref(x.to(torch.bfloat16)), y)
    ref_loss.backward()
    assert seen == [(torch.bfloat16, torch.float32)]
    assert loss.item() == ref_loss.item()
    for g, p in zip(gradients(model), ref.parameters()):
        assert torch.equal(g, p.grad.float())
    assert x.dtype == torch.float32 and torch.equal(x, x_before)
    with torch.no_grad():
        expected = ref(x.to(torch.bfloat16))
    assert torch.equal(model(x), expected)                      # inference too
    # float64 into an fp32 model, in kwargs; integer inputs are left alone
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, ids, *, scale):
            return self.emb(ids) * scale.unsqueeze(-1) + self.lin(scale.unsqueeze(-1).expand(-1, 4))

    two = Two()
    wrapped = RoundPipe(copy.deepcopy(two), device="cpu", num_microbatch=1)
    ids, scale = torch.randint(10, (6,)), torch.rand(6, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(wrapped(ids, scale=scale), two(ids, scale=scale.float()))


def test_the_dtype_is_that_of_the_first_floating_parameter_of_the_layers():
    seen = []

    class Record(nn.Module):
        def forward(self, x, extra):
            seen.append(extra.dtype)
            return x

    model = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), device="cpu", num_microbatch=1)
    model.module[0].register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    model(torch.randn(3, 4, dtype=torch.float64))
    assert seen == [torch.float32]
    seen.clear()
    rec = RoundPipe(nn.Sequential(Record(), nn.Linear(4, 4)).to(torch.bfloat16), device="cpu",
                    num_microbatch=1)
    rec(torch.randn(3, 4), torch.randn(3, 2, dtype=torch.float16))
    assert seen == [torch.bfloat16]   # the first floating parameter of the layers, in order


# --- torch.compile -------------------------------------------------------------------------------

def test_import_does_not_import_dynamo():
    r = subprocess.run([sys.executable, "-c", "import sys, roundpipe, roundpipe.optim; "
                        "print('torch._dynamo' in sys.modules)"], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "False", r.stderr


def test_torch_compile_of_the_wrapper_runs_it_eagerly_and_says_so():
    torch._dynamo.reset()
    counters.clear()
    model = RoundPipe(mlp(), device=["cpu", "cpu"])
    x = torch.randn(6, 8)
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match="do not compile a RoundPipe.*Compile the layers"):
        out = compiled(x)
    assert torch.equal(out, model(x))
    # nothing of the pipeline was traced: the only graph breaks are making the disabled
    # eager call (torch.compiler.disable, called once) and calling it
    breaks = list(counters["graph_break"])
    assert breaks and all("`disable`" in b or "torch.compiler.disable" in b for b in breaks), breaks
    model.compile()                                             # nn.Module.compile: the same
    with pytest.warns(UserWarning, match="do not compile a RoundPipe"):
        assert torch.equal(model(x), out)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def test_layers_compiled_before_wrapping_train_as_plain_pytorch():
    """Two blocks compiled with Module.compile() and a torch.nn.Linear compiled through its
    forward (Module.compile() leaves torch.nn's own modules uncompiled in torch 2.13,
    pytorch/pytorch#150915): three SGD steps on two CPU workers with three microbatches match
    plain uncompiled PyTorch; the compiled code is what runs (graphs captured) and is compiled
    once, not per step. The aot_eager backend (dynamo's capture and AOTAutograd's joint graph,
    run eagerly) keeps the test fast on two cores; docs/training.md's torch.compile block, run by
    tests/test_readme.py, covers the default backend (inductor)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    torch._dynamo.reset()
    counters.clear()
    net[1].compile(backend="aot_eager")
    net[2].compile(backend="aot_eager")
    net[3].forward = torch.compile(net[3].forward, backend="aot_eager")
    model = RoundPipe(net, device=["cpu", "cpu"], num_microbatch=3)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    graphs = []
    for step in range(3):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, loss_reduction="sum")
        model.step(opt)
        ref_loss = sum(loss_fn(ref(xm), ym) for xm, ym in zip(torch.tensor_split(x, 3),
                                                               torch.tensor_split(y, 3)))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
