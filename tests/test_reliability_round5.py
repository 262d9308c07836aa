"""Reliability round 5 (issue 45): defects found by attacking the planner, the HF families, the
Trainer's checkpoints, clipping and data parallel. Each test compares with an independent
reference: plain transformers' training loss under the same seed, the planner's own
``check_sizes``, plain PyTorch's clipping, a model that was never given the refused arguments.
Item 2 (a RoundPipeTrainer checkpoint in plain Trainer) is in tests/test_trainer_modes.py, item 6
(a rank whose exception ends its process) in tests/test_distributed.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe
from roundpipe.planner import LayerCost, Link, check_sizes, plan_stages, predict

LINK = Link(upload_bytes_per_s=50e9, download_bytes_per_s=40e9, visit_s=2e-4, chunk_s=5e-5)
LAYERS = [LayerCost(10**6, 2 * 10**6, 10**6, 1e-3, 2e-3, True) for _ in range(4)]


# --- item 1: dropouts a model's forward applies outside its decoder layers ---------------------


def _hf(kind: str, **config):
    """A tiny float32 ``kind`` causal LM (transformers' class, ``HF_COMMON`` sizes updated by
    ``config``); skips when the installed transformers lacks the family."""
    transformers = pytest.importorskip("transformers")
    from pipeline_models import HF_COMMON

    names = {"starcoder2": "Starcoder2", "phi": "Phi", "granite_swa": "GraniteSWA",
             "llama": "Llama"}[kind]
    model_cls = getattr(transformers, f"{names}ForCausalLM", None)
    if model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {names}")
    torch.manual_seed(0)
    return model_cls(getattr(transformers, f"{names}Config")(**{**HF_COMMON, **config})).float()


def _seeded_as_roundpipe(hf: nn.Module, call_seed: int) -> list:
    """Forward pre-hooks that run the unwrapped model's parts under the seeds RoundPipe's
    documented rule gives its layers (docs/training.md: ``roundpipe.layer_seed(call_seed,
    layer, microbatch)``; one microbatch): the embeddings (and what the model's forward does
    before its first decoder layer) as layer 0, decoder layer i as layer i + 1."""
    def at(i):
        def hook(module, args):
            torch.manual_seed(roundpipe.layer_seed(call_seed, i, 0))
        return hook

    parts = [hf.model.embed_tokens] + list(hf.model.layers)
    return [m.register_forward_pre_hook(at(i)) for i, m in enumerate(parts)]


@pytest.mark.parametrize("kind,attr,inner", [
    ("starcoder2", "embedding_dropout", "residual_dropout"), ("phi", "embd_pdrop", "resid_pdrop")])
def test_a_models_embedding_dropout_trains_as_transformers_applies_it(kind, attr, inner):
    """Was: the embedding dropout of Starcoder2's and Phi's model forward was skipped, the
    training loss with p=0.5 bit-identical to p=0. The reference: transformers' training loss
    and gradients on the unwrapped model, each part under the seed RoundPipe gives it (one
    microbatch); the decoder layers' own dropout on too."""
    for p in (0.5, 0.0):
        hf = _hf(kind, **{attr: p, inner: 0.1})
        ref = copy.deepcopy(hf).train()
        model = roundpipe.wrap_model_to_roundpipe(hf, None, device="cpu", num_microbatch=1)
        ids = torch.randint(0, 101, (2, 10), generator=torch.Generator().manual_seed(3))
        torch.manual_seed(7)
        loss = model.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        torch.manual_seed(7)
        hooks = _seeded_as_roundpipe(ref, int(torch.randint(2**62, ()).item()))
        want = ref(input_ids=ids, labels=ids).loss
        want.backward()
        for h in hooks:
            h.remove()
        assert float(loss) == pytest.approx(want.item(), rel=1e-5), (kind, p)
        grads = model.accumulated_grads()
        for name, param in ref.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
        model.eval()
        with torch.no_grad():  # eval mode: no dropout, as transformers'
            torch.testing.assert_close(model(input_ids=ids).logits,
                                       ref.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_an_unknown_dropout_of_the_models_forward_is_refused_naming_the_config_value():
    """A base model whose forward applies a dropout after its final norm
    (``config.final_dropout``), which no decoder layer holds: a family RoundPipe does not know.
    Was: wrapped without a word (the wrap-time check ran in eval mode, where dropout is off),
    and trained without that dropout. Now the check also runs in training mode under a fixed
    seed and refuses it; with the value 0 it is wrapped."""
    transformers = pytest.importorskip("transformers")

    class FinalDropout(transformers.LlamaModel):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.last_hidden_state = F.dropout(out.last_hidden_state, self.config.final_dropout,
                                              self.training)
            return out

    for p in (0.3, 0.0):
        hf = _hf("llama", final_dropout=p)
        hf.model = FinalDropout(hf.config)
        if p:
            with pytest.raises(TypeError, match=r"in training mode \(with dropout: "
                                                r"final_dropout=0\.3\)"):
                roundpipe.wrap_model_to_roundpipe(hf, None, device="cpu")
            assert hf.training and hf.model.training  # its modes as they were
        else:
            roundpipe.wrap_model_to_roundpipe(hf, None, device="cpu")


def test_the_wrap_check_draws_no_random_numbers_and_keeps_modes():
    """The training-mode check runs under its own seed: the user's generator is where it was,
    every module's mode as it was."""
    hf = _hf("starcoder2", embedding_dropout=0.2)
    hf.model.layers[0].eval()
    torch.manual_seed(11)
    roundpipe.wrap_model_to_roundpipe(hf, None, device="cpu")
    after = torch.rand(3)
    torch.manual_seed(11)
    torch.testing.assert_close(after, torch.rand(3))
    assert hf.training and hf.model.training and not hf.model.layers[0].training


def test_a_rotary_base_per_layer_is_refused_naming_layer_rope_theta():
    """GraniteSWA's forward gives each decoder layer the rotary embedding of its base in
    ``config.layer_rope_theta`` (0: none); the pipeline computes one. Was: wrapped without a
    word when the first two layers had the model's base (the wrap-time check runs two layers),
    the later ones then computed with the wrong rotary embedding."""
    kinds = ["full_attention", "sliding_attention"] * 2
    ok = _hf("granite_swa", num_hidden_layers=4, layer_types=kinds, sliding_window=4)
    roundpipe.wrap_model_to_roundpipe(ok, None, device="cpu")  # one base everywhere: fine
    theta = ok.config.rope_parameters["rope_theta"]
    hf = _hf("granite_swa", num_hidden_layers=4, layer_types=kinds, sliding_window=4,
             layer_rope_theta=[theta, theta, 0.0, 0.0])
    with pytest.raises(TypeError, match=r"config\.layer_rope_theta"):
        roundpipe.wrap_model_to_roundpipe(hf, None, device="cpu")


# --- item 3: predict checks its sizes as plan_stages does --------------------------------------


@pytest.mark.parametrize("sizes", [[1], [5], [0, 4], [2, -1, 3], [2.0, 2], [True, 3], []])
def test_predict_refuses_sizes_that_are_not_a_plan_of_the_layers(sizes):
    """Was: a time for each of these (4 layers). The reference: check_sizes, which plan_stages
    and RoundPipe(layers_per_stage=...) apply, refuses every one of them."""
    with pytest.raises(ValueError):
        check_sizes(sizes, len(LAYERS), "reference")
    with pytest.raises(ValueError, match="predict: sizes"):
        predict(LAYERS, sizes, 2, 1, LINK)
    with pytest.raises(ValueError, match="num_microbatch and num_devices"):
        predict(LAYERS, [2, 2], 0, 1, LINK)
    assert predict(LAYERS, (2, 2), 2, 1, LINK) > 0  # a plan still has its time


# --- item 4: budgets that are no number, NaN or infinite; memory_budget=1 ----------------------


def test_an_infinite_budget_plans_without_a_cap():
    """Was: ``min() arg is an empty sequence``. The reference: the same layers under a budget
    that holds the whole model many times over (no layer or stage comes near its half)."""
    for devices in (1, 2):
        roomy = plan_stages(LAYERS, 2, devices, 10**15, LINK)
        free = plan_stages(LAYERS, 2, devices, math.inf, LINK)
        assert free.sizes == roomy.sizes and free.predicted_s == pytest.approx(roomy.predicted_s)
        assert free.budget_bytes == math.inf


@pytest.mark.parametrize("budget", [math.nan, -math.inf, 0, -5, "1e9", None, True, 1j])
def test_a_budget_that_is_not_a_number_of_bytes_is_refused_naming_it(budget):
    with pytest.raises(ValueError, match=r"budget_bytes must be a number of bytes > 0"):
        plan_stages(LAYERS, 2, 1, budget, LINK)


def test_an_int_memory_budget_below_a_mebibyte_is_refused_saying_fractions_are_floats():
    """``memory_budget=1`` (the int) meant "all of it" and was one byte: every layer was later
    refused as "more than half of the memory budget (0.0 kB of 0.0 kB)". Refused at
    construction now; 1.0 (the float) and a real byte count are accepted."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for budget in (1, 2, 1000, (1 << 20) - 1):
        with pytest.raises(ValueError, match=r"memory_budget=.* is an int, so bytes.*written as "
                                             r"a float \(memory_budget=1\.0"):
            roundpipe.RoundPipe(net, device="cpu", layers_per_stage="auto", memory_budget=budget)
    for budget in (1.0, 1 << 20, 2**30):
        model = roundpipe.RoundPipe(net, device="cpu", layers_per_stage="auto",
                                    memory_budget=budget)
        model.forward_backward(input_args=(torch.randn(3, 4),), loss_fn=lambda o: o.sum())


# --- item 5: torch.nn.utils' gradient functions outside a step function ------------------------


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


GRAD_UTILS = {  # name: (call on the parameters, where the message says it belongs)
    "clip_grad_value_": (lambda f, ps: f(ps, 0.01), r"inside a step function|model\.step\(lambda"),
    "clip_grads_with_norm_": (lambda f, ps: f(ps, 0.5, torch.tensor(2.0)), "max_grad_norm="),
    "clip_grad_norm_": (lambda f, ps: f(ps, 0.5), "max_grad_norm="),
}


@pytest.mark.parametrize("name", sorted(GRAD_UTILS))
@pytest.mark.parametrize("params", ["parameters", "optim_parameters"])
def test_gradient_utilities_outside_a_step_raise_naming_where_they_belong(name, params):
    """Was (clip_grad_value_): torch's internal ``Expected !nested_tensorlist[0].empty()``
    (clip_grads_with_norm_: nothing, silently). Now the call raises before reading anything,
    naming the step function; the accumulated gradients are kept, and the same call inside a
    step function is plain PyTorch's (the reference: the unwrapped model, clipped and stepped
    with torch's functions)."""
    call, where = GRAD_UTILS[name]
    fn = getattr(torch.nn.utils, name, None)
    if fn is None:
        pytest.skip(f"torch.nn.utils.{name} is not in this torch")
    model = roundpipe.RoundPipe(_net(), optim_dtype=torch.float32, device="cpu",
                                num_microbatch=2)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.5)
    x, y = _batch()
    model.forward_backward(input_args=(x,), label=y, loss_fn=F.mse_loss)
    with pytest.raises(RuntimeError, match=rf"torch\.nn\.utils\.{name} was called on a RoundPipe"
                                           rf".*outside model\.step\(\).*{where}"):
        call(fn, getattr(model, params)())
    # inside the step function: torch's function on the step's gradients
    model.step(lambda: (call(getattr(torch.nn.utils, name), model.optim_parameters()),
                        opt.step(), opt.zero_grad()))
    ref = _net()
    F.mse_loss(ref(x), y).backward()
    call(fn, list(ref.parameters()))
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for got, want in zip(model.optim_parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gradient_utilities_on_a_plain_model_are_torchs():
    roundpipe.RoundPipe(_net(), device="cpu")  # the guards are installed
    plain, (x, y) = _net(), _batch()
    F.mse_loss(plain(x), y).backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    torch.nn.utils.clip_grad_value_((p for p in plain.parameters()), 0.01)  # a generator
    for p, g in zip(plain.parameters(), grads):
        torch.testing.assert_close(p.grad, g.clamp(-0.01, 0.01))
