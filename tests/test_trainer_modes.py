"""RoundPipeTrainer against plain ``transformers.Trainer`` (the reference, see
tests/test_trainer.py), continued:

- a run resumed from a mid-run checkpoint logs what the uninterrupted run logged (and what
  plain Trainer logged);
- save_model reloads with plain transformers;
- the asynchronous step mode logs every step, Trainer's learning rates, losses close to
  Trainer's (one step stale by design);
- fp16 with an injected overflow skips the same step as Trainer with torch's GradScaler (the
  scheduler held back the same way; 10 steps); a resumed fp16 run gets the grad scaler's state
  back from the checkpoint;
- the optimizer state on a disk (``roundpipe_kwargs={"optimizer_dir": ...}``, bf16 model copy
  with fp32 optimizer copies) logs and trains bit for bit as in memory, and resumes from its
  checkpoint as the uninterrupted run.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from roundpipe.hf import RoundPipeTrainer  # noqa: E402

import trainer_cases as tc  # noqa: E402
from trainer_cases import (REL, assert_same_logs, comparison_table, reset_accelerate,  # noqa: E402
                           run_ours, run_plain)


def test_resume_from_a_mid_run_checkpoint_logs_what_the_uninterrupted_run_logged(tmp_path):
    ref_trainer, _ = run_plain("llama", tmp_path / "ref")
    saving = dict(save_strategy="steps", save_steps=10, save_total_limit=2)
    full = run_ours("llama", tmp_path / "full", **saving)
    checkpoint = tmp_path / "full" / "checkpoint-10"
    assert (checkpoint / "roundpipe_state").is_dir()
    assert (checkpoint / "trainer_state.json").is_file()
    resumed = run_ours("llama", tmp_path / "resumed", resume=str(checkpoint), **saving)
    after = [h for h in tc.train_logs(full.state.log_history) if h["step"] > 10]
    # the resumed state's history starts with the checkpoint's (steps 1-10)
    got = [h for h in tc.train_logs(resumed.state.log_history) if h["step"] > 10]
    assert [h["step"] for h in got] == list(range(11, 21))
    assert_same_logs(got, after)            # as the uninterrupted run
    assert_same_logs(got, [h for h in tc.train_logs(ref_trainer.state.log_history)
                           if h["step"] > 10])   # and as plain Trainer
    assert tc.eval_logs(resumed.state.log_history)[-1]["eval_loss"] == pytest.approx(
        tc.eval_logs(full.state.log_history)[-1]["eval_loss"], rel=1e-6)
    full_sd, resumed_sd = full.model.state_dict(), resumed.model.state_dict()
    for name, t in full_sd.items():
        torch.testing.assert_close(resumed_sd[name], t, rtol=1e-6, atol=1e-7, msg=name)


def test_a_plain_trainer_checkpoint_resumes_with_its_weights_and_optimizer_state(tmp_path):
    """Plain Trainer saves checkpoint-10 (model.safetensors, optimizer.pt of torch's AdamW,
    scheduler, RNG); RoundPipeTrainer resumes from it and logs what plain Trainer's
    uninterrupted run logged for steps 11-20 (a resume without the optimizer state would
    not: Adam's moments restart)."""
    saving = dict(save_strategy="steps", save_steps=10)
    ref_trainer, _ = run_plain("llama", tmp_path / "ref", **saving)
    checkpoint = tmp_path / "ref" / "checkpoint-10"
    assert (checkpoint / "optimizer.pt").is_file() and not (checkpoint / "roundpipe_state").exists()
    resumed = run_ours("llama", tmp_path / "resumed", resume=str(checkpoint), **saving)
    got = [h for h in tc.train_logs(resumed.state.log_history) if h["step"] > 10]
    want = [h for h in tc.train_logs(ref_trainer.state.log_history) if h["step"] > 10]
    print("\nresumed from plain Trainer's checkpoint-10\n" + comparison_table(got, want))
    assert [h["step"] for h in got] == list(range(11, 21))
    assert_same_logs(got, want)
    got_sd = resumed.model.state_dict()
    for name, t in ref_trainer.model.state_dict().items():
        torch.testing.assert_close(got_sd[name], t, rtol=1e-4, atol=1e-5, msg=name)


def test_a_plain_trainer_checkpoint_of_a_lora_model_resumes(tmp_path):
    """A PEFT model's checkpoint holds the adapter (its names without the adapter's name) and
    the optimizer state of the adapters only."""
    peft = pytest.importorskip("peft")

    def lora_model():
        return peft.get_peft_model(tc.make_model("llama"), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    def train(cls, out, resume=None, **extra):
        reset_accelerate()
        trainer = cls(model=lora_model(), args=tc.training_args(
            out, save_strategy="steps", save_steps=10, eval_strategy="no"),
            train_dataset=tc.TokenData(48), **extra)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    ref = train(transformers.Trainer, tmp_path / "ref")
    checkpoint = tmp_path / "ref" / "checkpoint-10"
    assert (checkpoint / "adapter_model.safetensors").is_file()
    resumed = train(RoundPipeTrainer, tmp_path / "ours", resume=str(checkpoint),
                    roundpipe_kwargs={"num_microbatch": 2, "device": "cpu"})
    got = [h for h in tc.train_logs(resumed.state.log_history) if h["step"] > 10]
    want = [h for h in tc.train_logs(ref.state.log_history) if h["step"] > 10]
    assert_same_logs(got, want)


def test_a_checkpoint_without_optimizer_state_is_refused_with_the_way_forward(tmp_path):
    run_plain("llama", tmp_path / "ref", max_steps=2, save_strategy="steps", save_steps=2,
              eval_strategy="no")
    checkpoint = tmp_path / "ref" / "checkpoint-2"
    (checkpoint / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=r"optimizer\.pt.*from_pretrained\(.*checkpoint-2.*"
                                         r"without resume_from_checkpoint"):
        run_ours("llama", tmp_path / "ours", resume=str(checkpoint), max_steps=4)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither a roundpipe_state folder"):
        run_ours("llama", tmp_path / "ours2", resume=str(empty), max_steps=4)


def test_plain_trainer_resumes_a_roundpipe_trainer_checkpoint_as_the_uninterrupted_run(tmp_path):
    """RoundPipeTrainer saves checkpoint-4; plain ``transformers.Trainer`` resumes from it and
    logs what plain Trainer's uninterrupted run logged for steps 5-8. Was: the checkpoint had
    no optimizer.pt, so plain Trainer resumed without a word with fresh AdamW moments (and a
    fresh scheduler: it reads scheduler.pt only beside optimizer.pt)."""
    steps = dict(max_steps=8, eval_strategy="no", save_strategy="steps", save_steps=4)
    ref_trainer, _ = run_plain("llama", tmp_path / "ref", **steps)
    run_ours("llama", tmp_path / "ours", **steps)
    checkpoint = tmp_path / "ours" / "checkpoint-4"
    reset_accelerate()
    plain = transformers.Trainer(model=tc.make_model("llama"),
                                 args=tc.training_args(tmp_path / "plain", **steps),
                                 train_dataset=tc.TokenData(48))
    plain.train(resume_from_checkpoint=str(checkpoint))
    got = [h for h in tc.train_logs(plain.state.log_history) if h["step"] > 4]
    want = [h for h in tc.train_logs(ref_trainer.state.log_history) if h["step"] > 4]
    print("\nplain Trainer resumed from RoundPipeTrainer's checkpoint-4\n"
          + comparison_table(got, want))
    assert [h["step"] for h in got] == list(range(5, 9))
    assert_same_logs(got, want)
    assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "roundpipe_state").is_dir()


def test_a_mixed_precision_checkpoint_holds_the_full_precision_weights(tmp_path):
    """bf16=True: the checkpoint's model.safetensors (what plain Trainer and
    from_pretrained read) holds the fp32 optimizer copies, as plain Trainer's checkpoint of a
    bf16 run holds its fp32 parameters, not their bf16 rounding; save_model keeps the model
    copy's dtype."""
    from safetensors.torch import load_file

    steps = dict(max_steps=2, eval_strategy="no", save_strategy="steps", save_steps=2, bf16=True)
    ours = run_ours("llama", tmp_path / "ours", **steps)
    saved = load_file(str(tmp_path / "ours" / "checkpoint-2" / "model.safetensors"))
    copies = dict(ours.model.optim_named_parameters())
    assert copies
    for name, copy in copies.items():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], copy), name
    ours.save_model(str(tmp_path / "final"))
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in final.values())


def test_save_model_reloads_with_plain_transformers(tmp_path):
    _, ref_model = run_plain("qwen3", tmp_path / "ref", eval_strategy="no")
    ours = run_ours("qwen3", tmp_path / "ours", eval_strategy="no")
    ours.save_model(str(tmp_path / "saved"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert reloaded.dtype == torch.float32
    got = reloaded.state_dict()
    for name, want in ref_model.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)


def test_async_step_mode_trains_and_logs_every_step(tmp_path):
    """The asynchronous step is one step stale by design (documented), so not equal to
    Trainer's numbers: it logs the same keys at the same steps, and its logged loss follows
    plain Trainer's closely; the learning rates are exactly Trainer's."""
    ref_trainer, _ = run_plain("llama", tmp_path / "ref", eval_strategy="no")
    ours = run_ours("llama", tmp_path / "ours", {"step_mode": "async"}, eval_strategy="no")
    ref_logs, our_logs = tc.train_logs(ref_trainer.state.log_history), \
        tc.train_logs(ours.state.log_history)
    assert [h["step"] for h in our_logs] == [h["step"] for h in ref_logs]
    assert_same_logs(our_logs, ref_logs, keys=("learning_rate",))
    assert our_logs[0]["loss"] == pytest.approx(ref_logs[0]["loss"], rel=REL)
    for a, b in zip(our_logs, ref_logs):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.02)
        assert 0 < a["grad_norm"] < 10


class _Overflow(transformers.TrainerCallback):
    """Makes the final norm's output infinite during the optimizer step ``at`` (a forward hook:
    the loss and every gradient of that step overflow)."""

    def __init__(self, model, at: int) -> None:
        self.at, self.on = at, False
        norm = model.model.norm
        norm.register_forward_hook(lambda m, i, out: out * float("inf") if self.on else out)

    def on_step_begin(self, args, state, control, **kwargs):
        self.on = state.global_step + 1 == self.at

    def on_step_end(self, args, state, control, **kwargs):
        self.on = False


def test_fp16_with_an_injected_overflow_skips_the_same_step_as_trainer(tmp_path):
    """Plain Trainer as on a GPU with fp16 (accelerate's fp16 path: torch's GradScaler, autocast;
    a CPU run of Trainer has no scaler, so the accelerator is given the one it makes on CUDA)
    against RoundPipeTrainer(fp16=True): fp16 model copy, roundpipe.GradScaler."""
    at = 4
    # adamw_torch: with the default adamw_torch_fused, torch's GradScaler lets the fused kernel
    # skip the update itself, accelerate does not see the skip and Trainer advances the
    # scheduler anyway; with a non-fused optimizer Trainer does what it means to do
    args = dict(fp16=False, eval_strategy="no", optim="adamw_torch", max_steps=10)
    reset_accelerate()
    ref_model = tc.make_model("llama")
    ref = transformers.Trainer(model=ref_model, args=tc.training_args(tmp_path / "ref", **args),
                               train_dataset=tc.TokenData(48))
    ref.add_callback(_Overflow(ref_model, at))
    acc = ref.accelerator
    acc.scaler, acc.native_amp = torch.amp.GradScaler("cpu"), True
    acc.state._mixed_precision = "fp16"       # what Accelerator(mixed_precision="fp16") sets
    ref.train()
    reset_accelerate()
    model = tc.make_model("llama")
    hook = _Overflow(model, at)
    ours = RoundPipeTrainer(model=model, args=tc.training_args(tmp_path / "ours", **dict(
                                args, fp16=True)),
                            train_dataset=tc.TokenData(48),
                            roundpipe_kwargs={"num_microbatch": 2, "device": "cpu"})
    ours.add_callback(hook)
    assert ours.model.module.dtype == torch.float16
    ours.train()
    ref_logs, our_logs = tc.train_logs(ref.state.log_history), tc.train_logs(ours.state.log_history)
    print("\nfp16\n" + comparison_table(our_logs, ref_logs))
    skipped = [h["step"] for h in ref_logs if not torch.isfinite(torch.tensor(h["grad_norm"]))]
    assert skipped == [at]
    assert [h["step"] for h in our_logs
            if not torch.isfinite(torch.tensor(h["grad_norm"]))] == skipped
    # the skipped step did not advance the scheduler, in both: the same rates at every step
    assert_same_logs(our_logs, ref_logs, keys=("learning_rate",))
    assert our_logs[at]["learning_rate"] == our_logs[at - 1]["learning_rate"]
    for a, b in zip(our_logs, ref_logs):        # fp16 compute on both sides, not bit for bit
        if a["step"] != at:
            assert a["loss"] == pytest.approx(b["loss"], rel=5e-3)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=5e-2)
    assert ours._rp_scaler.get_scale() == acc.scaler.get_scale() == 2.0 ** 15


def test_fp16_resume_restores_the_grad_scaler(tmp_path):
    """A checkpoint after an overflow holds the backed-off scale: the resumed run logs what the
    uninterrupted one logged and ends with the same scale (not torch's initial 2**16)."""
    at, kw = 3, dict(fp16=True, optim="adamw_torch", max_steps=8, eval_strategy="no",
                     save_strategy="steps", save_steps=4)

    def run(out, resume=None):
        reset_accelerate()
        model = tc.make_model("llama")
        trainer = RoundPipeTrainer(model=model, args=tc.training_args(out, **kw),
                                   train_dataset=tc.TokenData(48),
                                   roundpipe_kwargs={"num_microbatch": 2, "device": "cpu"})
        trainer.add_callback(_Overflow(model, at))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", str(tmp_path / "full" / "checkpoint-4"))
    after = [h for h in tc.train_logs(full.state.log_history) if h["step"] > 4]
    got = [h for h in tc.train_logs(resumed.state.log_history) if h["step"] > 4]
    assert_same_logs(got, after)
    assert resumed._rp_scaler.get_scale() == full._rp_scaler.get_scale() == 2.0 ** 15


@pytest.mark.parametrize("flag, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_starts_the_optimizer_copies_at_the_users_weights(tmp_path, flag, dtype):
    """bf16=True / fp16=True: the model copy is rounded to that dtype, but the fp32 optimizer
    copies start at the user's fp32 weights, as plain Trainer's fp32 parameters do under
    mixed precision, not at their rounding (which would move every weight by up to half a
    bf16 step before training starts, and updates smaller than that step would then
    accumulate from the wrong value)."""
    model = tc.make_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    reset_accelerate()
    trainer = RoundPipeTrainer(model=model, args=tc.training_args(
                                   tmp_path, **{flag: True}, eval_strategy="no", max_steps=1),
                               train_dataset=tc.TokenData(8),
                               roundpipe_kwargs={"device": "cpu"})
    assert trainer.model.module.dtype == dtype
    copies = dict(trainer.model.optim_named_parameters())
    assert copies and set(copies) <= set(before)
    for name, copy in copies.items():
        assert copy.dtype == torch.float32
        assert torch.equal(copy, before[name]), name
    # the rounding would have changed them: the test tells the two apart
    assert not all(torch.equal(before[n].to(dtype).float(), before[n]) for n in copies)


@pytest.mark.parametrize("mode", ["sync", "exact"])
def test_the_optimizer_state_on_a_disk_is_one_argument_and_changes_nothing(tmp_path, mode):
    """One argument, ``optimizer_dir``: the logs (loss, grad_norm, learning rate) and the final
    weights are those of the same run in memory, bit for bit; a run resumed from its step-5
    checkpoint ends where the uninterrupted one did."""
    common = dict(max_steps=10, eval_strategy="no", bf16=True, save_strategy="steps",
                  save_steps=5)
    ram = run_ours("llama", tmp_path / "ram", {"step_mode": mode}, **common)
    disk = run_ours("llama", tmp_path / "disk", {"step_mode": mode,
                                                  "optimizer_dir": str(tmp_path / "state")},
                    **common)
    assert os.listdir(tmp_path / "state" / "rank0")  # the state is there while it lives
    ram_logs, disk_logs = (tc.train_logs(t.state.log_history) for t in (ram, disk))
    assert [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in disk_logs] == \
        [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in ram_logs]
    want = ram.model.state_dict()
    for name, t in disk.model.state_dict().items():
        assert torch.equal(t, want[name]), name
    resumed = run_ours("llama", tmp_path / "resumed", {"step_mode": mode,
                                                       "optimizer_dir": str(tmp_path / "s2")},
                       resume=str(tmp_path / "disk" / "checkpoint-5"), **common)
    for name, t in resumed.model.state_dict().items():
        assert torch.equal(t, want[name]), name
    # the checkpoint's optimizer.pt holds no state (that would need it whole in memory): a
    # torch optimizer, what plain Trainer resumes, refuses it instead of starting afresh
    saved = torch.load(tmp_path / "disk" / "checkpoint-5" / "optimizer.pt")
    assert "optimizer_dir" in saved["param_groups"][0]["roundpipe"]
    with pytest.raises(ValueError, match="parameter group"):
        torch.optim.AdamW(tc.make_model("llama").parameters()).load_state_dict(saved)
