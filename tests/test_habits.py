"""What a PyTorch user does by habit either works or raises an error that says what to do
(issue 22); each of these trained nothing, or the wrong amount, without a word before.

References are plain PyTorch loops written here on the whole batch (never RoundPipe output).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
import roundpipe.optim as rpo
from roundpipe import OptimizerCtx, RoundPipe

from pipeline_models import tanh_net

LR = 0.1


def net(dtype=torch.float32):
    return tanh_net(dtype)


def batch(rows=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g)


def mse(out, y):
    return F.mse_loss(out.float(), y)


def reference_sgd_step(model: nn.Module, x, y, steps=1):
    """Plain PyTorch: SGD on the whole batch's mean loss, in float32."""
    ref = copy.deepcopy(model).float()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for _ in range(steps):
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def assert_weights(model: RoundPipe, ref: nn.Module, tol=1e-6):
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol, msg=name)


# --- 1. the optimizer must reach the optimizer copies ---------------------------------------

# (model dtype, optim_dtype): whether model.parameters() outside OptimizerCtx are the optimizer
# copies themselves (one copy), else the model copies that an optimizer cannot train
COMBINATIONS = [
    (torch.float32, torch.float32, True),     # one copy: trains
    (torch.float32, None, False),             # a separate float32 copy
    (torch.bfloat16, torch.float32, False),
    (torch.bfloat16, None, False),
    (torch.bfloat16, torch.bfloat16, True),   # one copy (bf16 master weights)
]


@pytest.mark.parametrize("model_dtype,optim_dtype,one_copy", COMBINATIONS)
@pytest.mark.parametrize("optimizer", ["torch", "roundpipe"])
@pytest.mark.parametrize("mode", ["step", "exact", "step_fn"])
def test_an_optimizer_on_model_parameters_trains_or_raises(model_dtype, optim_dtype, one_copy,
                                                           optimizer, mode):
    model = RoundPipe(net(model_dtype), optim_dtype=optim_dtype, device="cpu", num_microbatch=2)
    if optimizer == "torch":
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        opt = rpo.SGD(model.parameters(), lr=LR, stochastic_rounding=model_dtype == torch.bfloat16)
    x, y = batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def run():
        if mode == "exact":
            model.forward_backward(input_args=(x,), label=y, loss_fn=mse, optimizer=opt)
        else:
            model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
            model.step(opt if mode == "step" else lambda: (opt.step(), opt.zero_grad()))
        model.synchronize()

    if not one_copy:
        with pytest.raises((TypeError, RuntimeError),
                           match="optim_parameters|OptimizerCtx") as info:
            run()
        assert "model copies" in str(info.value) or "model copy" in str(info.value)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        return
    run()
    if model_dtype == torch.float32:
        assert_weights(model, reference_sgd_step(net(), x, y))
    else:  # bf16 master weights: trained (stochastic rounding), close to the float32 step
        ref = reference_sgd_step(net(torch.bfloat16).float(), x, y)
        changed = sum(int(not torch.equal(before[k], v)) for k, v in model.state_dict().items())
        assert changed == len(before)
        assert_weights(model, ref, tol=2e-2)


def test_a_bf16_hf_model_with_torch_adamw_on_model_parameters_raises():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model = roundpipe.wrap_model_to_roundpipe(hf, optim_dtype=torch.float32, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    with pytest.raises(TypeError, match="optim_parameters"):
        model.step(opt)
    opt = torch.optim.AdamW(model.optim_parameters(), lr=1e-3)
    model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
    before = [p.clone() for p in model.optim_parameters()]
    model.step(opt)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.optim_parameters()))


def test_an_optimizer_over_another_models_parameters_raises():
    model = RoundPipe(net(), optim_dtype=torch.float32, device="cpu")
    other = RoundPipe(net(), optim_dtype=torch.float32, device="cpu")
    opt = rpo.SGD(other.optim_parameters(), lr=LR)
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    with pytest.raises(TypeError, match="none of this model's optimizer copies"):
        model.step(opt)
    with pytest.raises(TypeError, match="none of this model's optimizer copies"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, optimizer=opt)


def test_a_step_function_that_changes_no_optimizer_copy_warns_once():
    """It may only read the gradients (a legitimate use), so a warning, not an error."""
    model = RoundPipe(net(), device="cpu")
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    with pytest.warns(UserWarning, match="changed none of the optimizer copies"):
        model.step(lambda: None)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.step(lambda: None)


def test_a_plain_loop_over_the_model_copies_raises():
    """The habit of a plain loop: opt over model.parameters(), forward_backward, opt.step()."""
    model = RoundPipe(net(torch.bfloat16), optim_dtype=torch.float32, device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    before = [p.clone() for p in model.module.parameters()]
    with pytest.raises(TypeError, match="model copies.*optim_parameters"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.module.parameters()))


# --- 2. opt.step() outside model.step -----------------------------------------------------------

@pytest.mark.parametrize("optimizer", ["torch", "roundpipe"])
def test_opt_step_outside_model_step_raises_and_keeps_the_gradients(optimizer):
    model = RoundPipe(net(), optim_dtype=torch.float32, device="cpu", num_microbatch=3)
    make = torch.optim.SGD if optimizer == "torch" else rpo.SGD
    opt = make(model.optim_parameters(), lr=LR)
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"model\.step\(opt\)"):
            opt.step()
        opt.zero_grad()
    model.step(opt)  # exactly one batch's gradient: neither lost nor applied twice
    assert_weights(model, reference_sgd_step(net(), x, y))
    # inside a step function, stepping the optimizer is the point
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    model.step(lambda: (opt.step(), opt.zero_grad()))
    assert_weights(model, reference_sgd_step(net(), x, y, steps=2))


def test_an_optimizer_of_another_model_steps_freely():
    model = RoundPipe(net(), device="cpu")
    assert model is not None
    plain = net()
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    x, y = batch()
    F.mse_loss(plain(x), y).backward()
    before = plain[0].weight.clone()
    opt.step()
    assert not torch.equal(before, plain[0].weight)


# --- 3. a loss_fn written as for plain PyTorch gives plain PyTorch's result ----------------------

@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4])
def test_a_mean_loss_fn_gives_the_whole_batch_mean(microbatches, devices):
    model = RoundPipe(net(), optim_dtype=torch.float32, device=["cpu"] * devices)
    opt = rpo.SGD(model.optim_parameters(), lr=LR)
    x, y = batch(rows=10)  # 10 rows: uneven microbatches for 3 and 4
    ref = net()
    expected = F.mse_loss(ref(x), y)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse,
                                  num_microbatch=microbatches)
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
    model.step(opt)
    assert_weights(model, reference_sgd_step(net(), x, y))


def ce(logits, y):
    """A token mean, as in plain PyTorch."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def token_model(microbatches):
    """A tiny token model and RoundPipe over a copy of it, with SGD on its optimizer copies."""
    torch.manual_seed(0)
    emb = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    model = RoundPipe(copy.deepcopy(emb), optim_dtype=torch.float32, device="cpu",
                      num_microbatch=microbatches)
    return emb, model, rpo.SGD(model.optim_parameters(), lr=LR)


def test_token_mean_weights_by_the_labels_counted_tokens():
    emb, model, opt = token_model(3)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (6, 5), generator=g)
    labels = torch.randint(0, 11, (6, 5), generator=g)
    labels[0, 1:] = -100          # microbatches with very different token counts
    labels[1, :] = -100
    labels[4, 2:] = -100
    loss = model.forward_backward(input_args=(ids,), label=labels, loss_fn=ce,
                                  loss_reduction="token_mean")
    ref = copy.deepcopy(emb)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    expected = ce(ref(ids), labels)
    expected.backward()
    ref_opt.step()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
    model.step(opt)
    assert_weights(model, ref)


def test_token_mean_with_a_microbatch_of_no_token_stays_finite():
    emb, model, opt = token_model(2)
    ids = torch.randint(0, 11, (4, 3))
    labels = torch.randint(0, 11, (4, 3))
    labels[:2] = -100                        # the first microbatch scores nothing: NaN mean
    loss = model.forward_backward(input_args=(ids,), label=labels, loss_fn=ce,
                                  loss_reduction="token_mean")
    ref = copy.deepcopy(emb)
    ce(ref(ids[2:]), labels[2:]).backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    assert torch.isfinite(loss)
    model.step(opt)
    assert_weights(model, ref)


def test_sum_keeps_the_sum_of_the_microbatch_losses():
    model = RoundPipe(net(), optim_dtype=torch.float32, device="cpu", num_microbatch=3)
    opt = rpo.SGD(model.optim_parameters(), lr=LR)
    x, y = batch()
    # a share of the batch, computed by the caller: the convention before loss_reduction
    loss = model.forward_backward(input_args=(x,), label=y, loss_reduction="sum",
                                  loss_fn=lambda o, t: ((o - t) ** 2).sum() / y.numel())
    torch.testing.assert_close(loss.detach(), F.mse_loss(net()(x), y).detach(), rtol=1e-6,
                               atol=1e-7)
    model.step(opt)
    assert_weights(model, reference_sgd_step(net(), x, y))


def test_a_callable_counts_items():
    model = RoundPipe(net(), optim_dtype=torch.float32, device="cpu", num_microbatch=2)
    x, y = batch(rows=6)
    keep = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # rows that count: 3 and 1
    seen = []

    def count(label):
        seen.append(label.shape[0])
        return label[:, 3].sum()                      # a 0-dim tensor

    def masked(o, t):                                  # mean over the rows that count
        m = t[:, 3]
        return (((o - t[:, :3]) ** 2).mean(-1) * m).sum() / m.sum().clamp(min=1)

    loss = model.forward_backward(input_args=(x,), label=torch.cat([y, keep[:, None]], 1),
                                  loss_fn=masked, loss_reduction=count)
    expected = ((net()(x[:4]) - y[:4]) ** 2).mean()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
    assert seen == [3, 3]


def test_mean_counts_the_labels_rows_when_an_input_is_passed_whole():
    """A custom split_fn passing a table whole to every microbatch, ahead of the batch: the
    shares are the label's rows (2 and 8), not the table's."""
    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)

        def forward(self, table, x):
            return self.lin(x) + table.sum(0)

    def split(args, kwargs, label, n):
        table, x = args
        return [((table, x[:2]), {}, label[:2]), ((table, x[2:]), {}, label[2:])]

    torch.manual_seed(0)
    plain = WithTable()
    model = RoundPipe(copy.deepcopy(plain), optim_dtype=torch.float32, device="cpu",
                      split_fn=split, layers=None)
    table = torch.randn(3, 3)
    x, y = batch(rows=10)
    loss = model.forward_backward(input_args=(table, x), label=y, loss_fn=mse)
    torch.testing.assert_close(loss, F.mse_loss(plain(table, x), y).detach(), rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("count", [float("nan"), float("inf"), -1])
def test_a_callable_count_that_is_not_a_finite_number_is_refused(count):
    model = RoundPipe(net(), device="cpu", num_microbatch=2)
    x, y = batch()
    with pytest.raises(ValueError, match="finite number >= 0"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse,
                               loss_reduction=lambda t: count)
    assert all(g is None for g in model.accumulated_grads().values())


def test_a_callable_count_may_be_a_numpy_number():
    import numpy as np
    model = RoundPipe(net(), device="cpu", num_microbatch=2)
    x, y = batch()
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse,
                                  loss_reduction=lambda t: np.int64(t.shape[0]))
    torch.testing.assert_close(loss, F.mse_loss(net()(x), y).detach(), rtol=1e-6, atol=1e-7)


def test_an_async_step_of_a_torch_optimizer_uses_the_lr_of_its_own_step():
    """scheduler.step() right after model.step(opt, is_async=True) affects the next step only,
    also for a torch.optim optimizer (the scheduler wraps opt.step on the instance)."""
    model = RoundPipe(net(), optim_dtype=torch.float32, device="cpu")
    opt = torch.optim.SGD(model.optim_parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s == 0 else 0.0)
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    model.step(opt, is_async=True)
    sched.step()                                  # lr 0 from the next step on
    model.synchronize()
    assert_weights(model, reference_sgd_step(net(), x, y))


def test_a_step_function_writing_through_data_does_not_warn():
    import warnings
    model = RoundPipe(net(), optim_dtype=torch.float32, device="cpu")
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.step(lambda: [p.data.add_(p.grad, alpha=-LR) for p in model.parameters()])
    assert_weights(model, reference_sgd_step(net(), x, y))


@pytest.mark.parametrize("bad", ["avg", 3, None])
def test_a_bad_loss_reduction_is_refused_before_anything_runs(bad):
    model = RoundPipe(net(), device="cpu")
    x, y = batch()
    calls = []
    with pytest.raises(ValueError, match="loss_reduction"):
        model.forward_backward(input_args=(x,), label=y, loss_reduction=bad,
                               loss_fn=lambda o, t: calls.append(1) or mse(o, t))
    assert not calls


def test_token_mean_needs_a_tensor_label():
    model = RoundPipe(net(), device="cpu")
    x, _ = batch()
    with pytest.raises(TypeError, match="token_mean"):
        model.forward_backward(input_args=(x,), loss_fn=lambda o: o.square().mean(),
                               loss_reduction="token_mean")


# --- 4. torch habits get errors that name forward_backward ----------------------------------

def test_backward_on_the_returned_loss_names_forward_backward():
    model = RoundPipe(net(), device="cpu")
    x, y = batch()
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    assert not loss.requires_grad and loss.dtype == torch.float32 and loss.dim() == 0
    with pytest.raises(RuntimeError, match="forward_backward"):
        loss.backward()
    with pytest.raises(RuntimeError, match="forward_backward"):
        (loss * 2).backward()
    # otherwise a plain detached tensor: what loops do with losses keeps working
    import numpy as np
    assert isinstance(loss.item(), float) and loss.numpy().shape == ()
    assert f"{loss:.3f}" == f"{loss.item():.3f}"
    assert np.mean([loss, loss]) == pytest.approx(loss.item())
    running = 0.0
    for _ in range(3):
        running += loss
    assert not running.requires_grad and running.grad_fn is None
    assert copy.deepcopy(loss).item() == loss.item()


def test_backward_from_model_outputs_in_training_names_forward_backward():
    model = RoundPipe(net(), device="cpu")
    x, y = batch()
    out = model(x)
    with pytest.raises(RuntimeError, match="forward_backward"):
        F.mse_loss(out, y).backward()
    with pytest.raises(RuntimeError, match="forward_backward"):
        out.sum().backward()
    torch.testing.assert_close(out.detach(), net()(x), rtol=1e-6, atol=1e-6)
    out.add_(1.0)                                  # in-place, .numpy(), deepcopy: as before
    out[:, 0] = 0.0
    assert out.numpy().shape == (12, 3) and copy.deepcopy(out).shape == (12, 3)
    with torch.no_grad():
        assert type(model(x)) is torch.Tensor
    model.eval()
    assert type(model(x)) is torch.Tensor


def test_a_roundpipe_teacher_in_training_mode_feeds_a_students_loss():
    """Distillation: a frozen teacher's outputs (it trains nothing) in the loss of a RoundPipe
    student and of a plain PyTorch student: both train as with a plain teacher."""
    teacher = RoundPipe(net().requires_grad_(False), device="cpu")   # left in training mode
    plain_teacher = net()
    torch.manual_seed(1)
    student = nn.Sequential(nn.Linear(6, 3))
    ref = copy.deepcopy(student)
    wrapped = RoundPipe(copy.deepcopy(student), optim_dtype=torch.float32, device="cpu",
                        num_microbatch=2)
    opt = rpo.SGD(wrapped.optim_parameters(), lr=LR)
    x, _ = batch()
    wrapped.forward_backward(input_args=(x,), label=x, loss_fn=lambda o, t: F.mse_loss(o, teacher(t)))
    wrapped.step(opt)
    F.mse_loss(ref(x), plain_teacher(x)).backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    assert_weights(wrapped, ref)
    plain = copy.deepcopy(student)                       # a plain student, RoundPipe teacher
    F.mse_loss(plain(x), teacher(x)).backward()
    assert plain[0].weight.grad is not None


def test_grad_scaler_scale_backward_names_forward_backward():
    model = RoundPipe(net(), device="cpu")
    x, y = batch()
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    with pytest.raises(RuntimeError, match="forward_backward"):
        roundpipe.GradScaler().scale(loss)
    with pytest.raises(RuntimeError, match="model.step"):
        roundpipe.GradScaler().step(None)
    torch_scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="forward_backward"):
        torch_scaler.scale(loss).backward()


def test_a_failed_habit_leaves_training_intact():
    """After each refused habit the normal loop still trains exactly as plain PyTorch."""
    model = RoundPipe(net(), optim_dtype=torch.float32, device="cpu", num_microbatch=2)
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = batch()
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    with pytest.raises(RuntimeError):
        loss.backward()
    with pytest.raises(RuntimeError):
        opt.step()
    model.step(opt)
    assert_weights(model, reference_sgd_step(net(), x, y))


def test_accumulated_grads_reads_what_the_step_will_apply_without_consuming_it():
    model = RoundPipe(net(), optim_dtype=torch.float32, device=["cpu", "cpu"], num_microbatch=3)
    opt = rpo.SGD(model.optim_parameters(), lr=LR)
    assert all(g is None for g in model.accumulated_grads().values())
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    grads = model.accumulated_grads()
    ref = net()
    F.mse_loss(ref(x), y).backward()
    assert list(grads) == [n for n, _ in ref.named_parameters()]
    for (name, p) in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    grads["0.weight"].zero_()                 # a copy: the step is not affected
    model.step(opt)
    assert_weights(model, reference_sgd_step(net(), x, y))


# --- 5. clip_grad_norm_ before model.step; a positional tensor to an HF forward_backward ----------

def reference_clipped_sgd_step(x, y, max_norm):
    """Plain PyTorch: the whole batch's mean loss, clip_grad_norm_, SGD, in float32."""
    ref = net()
    F.mse_loss(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    return ref, norm


@pytest.mark.parametrize("params", ["parameters", "optim_parameters"])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_clip_grad_norm_before_model_step_raises_naming_max_grad_norm(params, model_dtype):
    """Before the guard torch measured 0 over these parameters and clipped nothing, silently;
    the gradients survive the refused call and max_grad_norm= gives plain PyTorch's step."""
    model = RoundPipe(net(model_dtype), optim_dtype=torch.float32, device="cpu", num_microbatch=2)
    opt = torch.optim.SGD(model.optim_parameters(), lr=LR)
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    for clip in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_):
        with pytest.raises(RuntimeError, match=r"max_grad_norm="):
            clip(getattr(model, params)(), 0.05)
    if model_dtype != torch.float32:
        return
    model.step(opt, max_grad_norm=0.05)
    ref, norm = reference_clipped_sgd_step(x, y, 0.05)
    assert norm > 0.05 * 2                            # the clip did clip
    assert model.last_step_stats().grad_norm == pytest.approx(float(norm), rel=1e-5)
    assert_weights(model, ref)


def test_clip_grad_norm_inside_a_step_function_clips_as_plain_pytorch():
    model = RoundPipe(net(), optim_dtype=torch.float32, device="cpu", num_microbatch=2)
    opt = torch.optim.SGD(model.optim_parameters(), lr=LR)
    x, y = batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    norms = []
    model.step(lambda: (norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)),
                        opt.step(), opt.zero_grad()))
    ref, norm = reference_clipped_sgd_step(x, y, 0.05)
    torch.testing.assert_close(norms[0], norm, rtol=1e-5, atol=0)
    assert_weights(model, ref)


def test_clip_grad_norm_of_a_plain_model_is_torchs():
    model = RoundPipe(net(), device="cpu")
    assert model is not None                           # the guard is installed
    plain, (x, y) = net(), batch()
    F.mse_loss(plain(x), y).backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    norm = torch.nn.utils.clip_grad_norm_((p for p in plain.parameters()), 0.05)  # a generator
    want = torch.cat([g.flatten() for g in grads]).norm()
    torch.testing.assert_close(norm, want)
    for p, g in zip(plain.parameters(), grads):
        torch.testing.assert_close(p.grad, g * (0.05 / (want + 1e-6)))


def test_a_tensor_as_input_args_of_an_hf_forward_backward_names_input_kwargs():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)
    model = roundpipe.wrap_model_to_roundpipe(
        transformers.AutoModelForCausalLM.from_config(config), torch.float32, device="cpu")
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(TypeError, match=r"input_kwargs=\{'input_ids': ids, 'labels': ids\}"):
        model.forward_backward(ids)
    with pytest.raises(TypeError, match="input_kwargs"):
        model.forward_backward(ids, loss_fn=lambda out: out.float().mean())
