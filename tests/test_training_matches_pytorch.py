"""RoundPipe against plain PyTorch training of the same model (an independent reference loop,
tests/pipeline_models.py: microbatches with gradient accumulation, the documented per-layer
seeds): fp32 and bf16 models with fp32 master weights, over several calls per step, a step
function that clips, and errors that leave the next step exact."""

from __future__ import annotations

import copy

import pytest
import torch

import roundpipe
import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe

from pipeline_models import (MODELS, assert_params_equal, data, loss_fn, mlp,
                             reference_forward_backward)

OPTIMIZERS = {
    "torch.SGD": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.5),
    # eps near lr: see docs/design.md §5 (gradients that cancel to ~0 amplify summation-order noise)
    "roundpipe.Adam": lambda ps: rpo.Adam(ps, lr=1e-2, eps=1e-2),
}


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
