"""Building a RoundPipe: its parameters and OptimizerCtx, refused arguments and device moves,
no CUDA initialised at import, deepcopy, and parameters unfrozen after wrapping."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

from roundpipe import OptimizerCtx, RoundPipe

from pipeline_models import data, loss_fn, mlp


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
