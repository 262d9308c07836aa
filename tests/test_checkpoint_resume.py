"""Weights that change outside training reach it (loaded into the wrapped model after
wrapping, or through the wrapper's load_state_dict at full precision), and a run saved with
state_dict() and resumed in a fresh process gives the losses of the uninterrupted run."""

from __future__ import annotations

import subprocess
import sys

import torch

from roundpipe import RoundPipe

from launcher import child_env
from pipeline_models import data, loss_fn, mlp


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
from pipeline_models import transformer, data, loss_fn
path, start, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
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
        r = subprocess.run([sys.executable, "-c", _RESUME, str(path), str(start), str(steps)],
                           env=child_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return [float(v) for v in r.stdout.split()]

    straight = run(0, 6, tmp_path / "a.pt")
    resumed = run(0, 3, tmp_path / "b.pt") + run(3, 3, tmp_path / "b.pt")
    assert resumed == straight
