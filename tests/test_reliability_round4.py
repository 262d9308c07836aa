"""Reliability round 4 (issue 35): defects found by attacking RoundPipeTrainer, the habit guards
and the quantized base. Each test compares with an independent reference: plain
``transformers.Trainer`` (with PEFT) on the unwrapped model, ``torch.load`` of a plain tensor,
the dequantized weights before a round trip, a model that was never given the refused
arguments. Items 8 and 9 (a failing rank, the users'-collectives abort) are in
tests/test_distributed.py.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import roundpipe  # noqa: E402
import roundpipe.hf  # noqa: E402
from roundpipe.hf import RoundPipeTrainer  # noqa: E402

import trainer_cases as tc  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
            task_type="CAUSAL_LM")

# --- item 1: a trainer's own loss -------------------------------------------------------------


def _z_loss(logits, labels, num_items_in_batch):
    """Cross-entropy plus a z-loss (1e-2 * logsumexp^2), summed over the scored tokens and
    divided by Trainer's count for the accumulation window (HF's shift)."""
    logits = logits.float()
    target = F.pad(labels, (0, 1), value=-100)[..., 1:].to(logits.device)
    ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100,
                         reduction="sum")
    z = (torch.logsumexp(logits, -1).square() * (target != -100)).sum()
    return (ce + 1e-2 * z) / num_items_in_batch


class ZLoss:
    """A compute_loss override as the transformers docs write one (labels popped, the model
    called on the rest, the loss from the logits)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = _z_loss(outputs.logits, labels, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss


class RowMean:
    """A per-batch mean (over rows, of each row's token-mean cross-entropy), declared as not
    scaled for the accumulation window: Trainer divides it by the number of steps."""

    loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        logits = outputs.logits.float()
        target = F.pad(inputs["labels"], (0, 1), value=-100)[..., 1:].to(logits.device)
        ce = F.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="none")
        valid = (target != -100).float()
        loss = ((ce * valid).sum(1) / valid.sum(1).clamp(min=1)).mean()
        return (loss, outputs) if return_outputs else loss


class SuperPlusL2:
    """Trainer's own loss (super().compute_loss, the model's HF loss) plus a penalty on the
    logits: a mean over the batch that is no sum over tokens or mean over rows, so it is
    computed on the whole batch (one microbatch) to be plain Trainer's."""

    microbatches = 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        loss = loss + 10.0 * outputs.logits.float().square().mean()
        return (loss, outputs) if return_outputs else loss


def _run(cls, kind, out, rp_kwargs=None, **kw):
    tc.reset_accelerate()
    args = tc.training_args(out, max_steps=4, eval_steps=2, **kw.pop("args", {}))
    extra = {} if rp_kwargs is None else {"roundpipe_kwargs": {"num_microbatch": 2, "device": "cpu",
                                                               **rp_kwargs}}
    trainer = cls(model=tc.make_model(kind), args=args, train_dataset=tc.TokenData(16),
                  eval_dataset=tc.TokenData(8, 2), **kw, **extra)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def builtin_logs(tmp_path_factory):
    """Plain Trainer with HF's built-in loss: what an ignored override would train."""
    return tc.train_logs(_run(transformers.Trainer, "llama",
                              tmp_path_factory.mktemp("builtin")).state.log_history)


@pytest.mark.parametrize("loss,mode", [(ZLoss, "sync"), (RowMean, "exact"), (SuperPlusL2, "sync"),
                                       ("compute_loss_func", "async")])
def test_a_trainers_own_loss_trains_as_with_plain_trainer(loss, mode, builtin_logs, tmp_path):
    """Was: a compute_loss override silently ignored (HF's loss trained), compute_loss_func
    refused. Now called per microbatch: logs, eval_loss and weights are plain Trainer's."""
    kw = {}
    if loss == "compute_loss_func":
        plain_cls, our_cls = transformers.Trainer, RoundPipeTrainer
        kw["compute_loss_func"] = lambda out, labels, num_items_in_batch: _z_loss(
            out.logits, labels, num_items_in_batch)
    else:
        plain_cls = type("Plain", (loss, transformers.Trainer), {})
        our_cls = type("Ours", (loss, RoundPipeTrainer), {})
    ref = _run(plain_cls, "llama", tmp_path / "ref", **kw)
    ours = _run(our_cls, "llama", tmp_path / "ours",
                {"step_mode": mode, "num_microbatch": getattr(loss, "microbatches", 2)}, **kw)
    ref_logs, our_logs = tc.train_logs(ref.state.log_history), tc.train_logs(ours.state.log_history)
    tc.assert_same_logs(our_logs, ref_logs)
    ref_eval, our_eval = tc.eval_logs(ref.state.log_history), tc.eval_logs(ours.state.log_history)
    assert len(our_eval) == len(ref_eval) == 2
    for a, b in zip(our_eval, ref_eval):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=tc.REL)
    got = ours.model.state_dict()
    for name, want in ref.model.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)
    # the reference differs from HF's built-in loss, so an ignored override cannot pass
    assert any(a[k] != pytest.approx(b[k], rel=1e-2) for a, b in zip(builtin_logs, ref_logs)
               for k in ("loss", "grad_norm"))


def test_a_compute_loss_that_calls_the_model_on_other_inputs_is_refused(tmp_path):
    class Shifted(RoundPipeTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(input_ids=inputs["input_ids"].roll(1, 1),
                        attention_mask=inputs["attention_mask"])
            return out.logits.float().mean()

    with pytest.raises(ValueError, match="compute_loss called the model with other inputs"):
        _run(Shifted, "llama", tmp_path, {})


# --- item 2: load_best_model_at_end with a PEFT model ------------------------------------------

# a large constant learning rate on random tokens: the eval loss rises (4.5840, 4.5852,
# 4.5928), the best checkpoint is the first, not the last, so loading it changes the weights;
# Adam's eps near the updates (LoRA's A gets no gradient while B is 0: docs/design.md §5)
BEST = dict(max_steps=6, eval_steps=2, save_strategy="steps", save_steps=2,
            load_best_model_at_end=True, metric_for_best_model="eval_loss",
            learning_rate=0.05, warmup_steps=0, lr_scheduler_type="constant", adam_epsilon=1e-2)


def _lora_run(cls, out, **kw):
    peft = pytest.importorskip("peft")
    tc.reset_accelerate()
    model = peft.get_peft_model(tc.make_model("llama"), peft.LoraConfig(**LORA))
    trainer = cls(model=model, args=tc.training_args(out, **BEST, **kw),
                  train_dataset=tc.TokenData(16), eval_dataset=tc.TokenData(8, 2),
                  **({} if cls is transformers.Trainer else
                     {"roundpipe_kwargs": {"num_microbatch": 2, "device": "cpu"}}))
    trainer.train()
    return trainer, {k: v for k, v in trainer.model.state_dict().items() if "lora_" in k}


@pytest.fixture(scope="module")
def plain_lora_best(tmp_path_factory):
    return _lora_run(transformers.Trainer, tmp_path_factory.mktemp("plain"))


@pytest.mark.parametrize("save_only_model", [False, True])
def test_load_best_model_at_end_with_peft_loads_the_best_adapter_as_plain_trainer(
        save_only_model, plain_lora_best, tmp_path):
    """Was: FileNotFoundError (pytorch_model.bin) after the whole run. Now the best checkpoint's
    adapter (from its RoundPipe state, or with save_only_model=True its adapter file) is the
    model's at the end, as with plain Trainer + PEFT."""
    ref, want = plain_lora_best
    ours, got = _lora_run(RoundPipeTrainer, tmp_path, save_only_model=save_only_model)
    assert ref.state.best_model_checkpoint.endswith("checkpoint-2")
    assert ours.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert sorted(got) == sorted(want) and want
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


# --- item 3: a returned loss saved with torch.save ---------------------------------------------


def test_a_returned_loss_saved_with_torch_save_loads_with_weights_only():
    """Was: "Unsupported global: roundpipe.guards.Finished" from torch.load's default. Now it
    pickles as the plain tensor it is (the reference: torch.load of a plain tensor)."""
    import io

    model = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 2)), device="cpu")
    loss = model.forward_backward(input_args=(torch.ones(3, 4),),
                                  loss_fn=lambda o: o.square().mean())
    assert isinstance(loss, roundpipe.guards.Finished)
    saved, plain = io.BytesIO(), io.BytesIO()
    torch.save({"loss": loss, "history": [loss, loss * 2]}, saved)
    torch.save({"loss": loss.as_subclass(torch.Tensor)}, plain)
    assert b"roundpipe" not in saved.getvalue()  # loading needs no roundpipe
    saved.seek(0)
    plain.seek(0)
    got, want = torch.load(saved), torch.load(plain)   # weights_only=True (the default)
    assert type(got["loss"]) is torch.Tensor and torch.equal(got["loss"], want["loss"])
    assert torch.equal(got["history"][1], want["loss"] * 2)
    with pytest.raises(RuntimeError, match="forward_backward"):  # the guard itself is kept
        loss.backward()


# --- item 4: optim_args as transformers parses them ------------------------------------------


def test_sgd_optim_args_train_as_plain_trainer_with_torch_sgd(tmp_path):
    """Was: the string 'False' reached roundpipe.optim.SGD and the first step failed in the
    binding. Now parsed as transformers parses them for torch.optim.SGD."""
    args = {"optim": "sgd", "optim_args": "momentum=0.9, nesterov=False", "learning_rate": 0.05}
    ref = _run(transformers.Trainer, "llama", tmp_path / "ref", args=args)
    ours = _run(RoundPipeTrainer, "llama", tmp_path / "ours", {}, args=args)
    assert type(ref.optimizer.optimizer).__name__ == "SGD"
    assert ours.optimizer.real.defaults["momentum"] == 0.9
    assert ours.optimizer.real.defaults["nesterov"] is False
    tc.assert_same_logs(tc.train_logs(ours.state.log_history),
                        tc.train_logs(ref.state.log_history))


@pytest.mark.parametrize("optim,optim_args,match", [
    ("sgd", "momentum=0.9,nesterov", "key=value"),      # not a pair
    ("sgd", "momentum=fast", "momentum|float"),          # not a number
    ("sgd", "momentum=0.9,betas=0.5", "ignores 'betas'"),
    ("adamw_torch", "amsgrad=True", "ignores 'amsgrad'"),
    ("sgd", "momentum=-0.5", "momentum"),                # refused by the optimizer
    ("sgd", "nesterov=True", "esterov"),                 # nesterov needs a momentum
])
def test_bad_optim_args_are_refused_at_construction_naming_them(optim, optim_args, match,
                                                                tmp_path):
    model = tc.make_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tc.reset_accelerate()
    with pytest.raises(ValueError, match="optim_args") as info:
        RoundPipeTrainer(model=model, args=tc.training_args(tmp_path, optim=optim,
                                                            optim_args=optim_args),
                         train_dataset=tc.TokenData(8))
    assert info.match(match)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# --- item 5: another RoundPipe's optimizer stepped inside a step function ------------------------


def test_stepping_another_models_optimizer_inside_a_step_function_raises_naming_both():
    """Was: an optimizer over RoundPipe B's copies stepped inside A's step function stepped
    nothing (B holds its gradients until its own step), silently. Now a RuntimeError naming
    both models; B's own step afterwards trains as torch.optim.SGD on B alone (reference)."""
    torch.manual_seed(0)
    net_b = torch.nn.Sequential(torch.nn.Linear(4, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3))
    ref.load_state_dict(net_b.state_dict())
    a = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4)), device="cpu")
    b = roundpipe.RoundPipe(net_b, device="cpu")
    opt_a = torch.optim.SGD(a.optim_parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.optim_parameters(), lr=0.1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    a.forward_backward(input_args=(x,), loss_fn=lambda o: o.square().mean())
    b.forward_backward(input_args=(x,), loss_fn=lambda o: o.square().mean())
    with pytest.raises(RuntimeError) as info:
        a.step(lambda: opt_b.step())
    message = str(info.value)
    assert f"at {id(a):#x}" in message and f"at {id(b):#x}" in message, message
    with pytest.raises(RuntimeError, match="max_grad_norm"):  # clipping B's there: the same
        a.step(lambda: torch.nn.utils.clip_grad_norm_(list(b.optim_parameters()), 1.0))
    b.step(opt_b)  # B's gradients were kept for its own step
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).square().mean().backward()
    ref_opt.step()
    for got, want in zip(b.optim_parameters(), ref.parameters()):
        torch.testing.assert_close(got, want)
    # B's step run from inside A's step function is B's own step: allowed
    a.forward_backward(input_args=(x,), loss_fn=lambda o: o.square().mean())
    b.forward_backward(input_args=(x,), loss_fn=lambda o: o.square().mean())
    a.step(lambda: (opt_a.step(), b.step(opt_b)))
    assert b.accumulated_grads() == {n: None for n in b.accumulated_grads()}


# --- item 6: state_dict round trips of the quantized base --------------------------------------


def _quantized_net(fmt, dtype):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.Tanh(),
                              torch.nn.Linear(200, 8)).to(dtype)
    net[0].weight.requires_grad_(False)  # the frozen base
    return roundpipe.RoundPipe(net, torch.float32, device="cpu", frozen_dtype=fmt)


def _hf_quantized(fmt, dtype):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tc.make_model("llama").to(dtype), peft.LoraConfig(**LORA))
    return roundpipe.wrap_model_to_roundpipe(model, torch.float32, device="cpu",
                                             frozen_dtype=fmt)


@pytest.mark.parametrize("fmt", ["nf4", "nf4-dq", "int8"])
@pytest.mark.parametrize("build,dtype", [(_quantized_net, torch.float32),
                                         (_quantized_net, torch.bfloat16),
                                         (_hf_quantized, torch.bfloat16)])
def test_state_dict_round_trips_keep_the_quantized_base_exact(fmt, build, dtype):
    """Was: nf4-dq's absmax re-quantized from its own lossy values at every
    load_state_dict(state_dict()), the frozen base (and the logits) moving each time. Now the
    dequantized weights and the outputs are those before the round trips, bit for bit."""
    model = build(fmt, dtype)
    before = model.state_dict()  # the reference: dequantized weights before any round trip
    if build is _quantized_net:
        inputs = {"input_args": (torch.randn(4, 64, generator=torch.Generator().manual_seed(1)),)}
    else:
        inputs = {"input_kwargs": {"input_ids": torch.arange(24).view(2, 12) % tc.VOCAB}}
    model.eval()
    with torch.no_grad():
        out = model(*inputs.get("input_args", ()), **inputs.get("input_kwargs", {}))
    for _ in range(3):
        model.load_state_dict(model.state_dict())
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    with torch.no_grad():
        again = model(*inputs.get("input_args", ()), **inputs.get("input_kwargs", {}))
    if not isinstance(out, torch.Tensor):
        out, again = out.logits, again.logits
    assert torch.equal(again, out)


# --- item 7: bf16 / fp16 and the model the trainer wraps ---------------------------------------


@pytest.mark.parametrize("rp_kwargs,error", [({"num_microbatch": 0}, ValueError),
                                             ({"pin_memory": "always"}, ValueError),
                                             ({"microbatches": 2}, TypeError)])
def test_refused_roundpipe_kwargs_leave_the_model_as_it_was(rp_kwargs, error, tmp_path):
    """Was: bf16=True had already cast the user's model to bf16 in place when the wrapper
    refused its arguments. Now the model is the one given (reference: its state before)."""
    tc.reset_accelerate()
    model = tc.make_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    with pytest.raises(error):
        RoundPipeTrainer(model=model, args=tc.training_args(tmp_path, bf16=True),
                         train_dataset=tc.TokenData(8), roundpipe_kwargs=rp_kwargs)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    assert all(a is b for a, b in zip(model.parameters(), params))


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_a_model_wrapped_before_the_trainer_says_it_ignores_bf16_and_fp16(flag, tmp_path):
    """Was: the float32 model copy trained in float32 without a word. Now a warning naming the
    flag and the dtype; a model wrapped in the asked dtype gets none."""
    tc.reset_accelerate()
    wrapped = roundpipe.wrap_model_to_roundpipe(tc.make_model("llama"), device="cpu")
    args = {flag: True, "eval_strategy": "no"}
    with pytest.warns(UserWarning, match=f"{flag}=True is ignored.*torch.float32 model copy"):
        RoundPipeTrainer(model=wrapped, args=tc.training_args(tmp_path, **args),
                         train_dataset=tc.TokenData(8))
    tc.reset_accelerate()
    dtype = torch.bfloat16 if flag == "bf16" else torch.float16
    same = roundpipe.wrap_model_to_roundpipe(tc.make_model("llama").to(dtype), torch.float32,
                                             device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        RoundPipeTrainer(model=same, args=tc.training_args(tmp_path, **args),
                         train_dataset=tc.TokenData(8))


# --- item 7: from_pretrained's dtypes and corrupt shards -----------------------------------------


def _saved_llama(path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.q_proj.weight"
    return name, path / index[name]


def _lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0, init_lora_weights=False)


def test_from_pretrained_refuses_an_integer_tensor_for_a_floating_weight_naming_it(tmp_path):
    """Was: an int32 tensor cast to the model dtype and quantized, silently. Now refused before
    any weight is read, naming the tensor and its shard."""
    from safetensors.torch import load_file, save_file

    name, shard = _saved_llama(tmp_path)
    tensors = load_file(shard)
    tensors[name] = (tensors[name] * 1000).to(torch.int32)
    save_file(tensors, shard, metadata={"format": "pt"})
    for kw in ({}, {"frozen_dtype": "nf4", "peft_config": _lora()}):
        with pytest.raises(ValueError, match=f"{name} in {shard.name} is I32"):
            roundpipe.hf.from_pretrained(tmp_path, device="cpu", **kw)


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_from_pretrained_names_a_corrupt_shard(tmp_path, damage):
    """Was: safetensors' own "Error while deserializing header" without the file. Now a
    ValueError naming the shard."""
    _, shard = _saved_llama(tmp_path)
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2] if damage == "truncated"
                      else data[:8] + b"{" + b"x" * 30 + data[39:])
    with pytest.raises(ValueError, match=f"{shard}.* not a readable safetensors file"):
        roundpipe.hf.from_pretrained(tmp_path, device="cpu")
