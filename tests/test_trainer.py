"""RoundPipeTrainer against the independent reference, plain ``transformers.Trainer`` training
the unwrapped model (tiny float32 Llama and Qwen3 built from a config, 20 steps, gradient
accumulation 2, warmup + cosine, clipping, weight-decay groups, AdamW):

- logged loss, grad_norm and learning_rate equal at every logging step (relative 1e-4), the
  same epochs, eval_loss equal, final weights equal; in sync and exact mode;
- arguments that cannot combine are refused before training, naming the argument;
- accelerate's hands stay off the model (a CUDA args.device and two GPUs faked: no DataParallel,
  no move of the model or the batches, the logs of plain Trainer with the batch of 2 GPUs).

Resume, save_model, the asynchronous step and fp16: tests/test_trainer_modes.py; TRL:
tests/test_trainer_sft.py; two gloo ranks: tests/test_trainer_distributed.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from roundpipe.hf import RoundPipeTrainer  # noqa: E402

import trainer_cases as tc  # noqa: E402
from trainer_cases import (REL, assert_same_logs, comparison_table,  # noqa: E402
                           reset_accelerate, run_ours, run_plain)


# clip: inside the range of the plain run's gradient norms (asserted below), on the newest
# transformers and on the declared floor (scripts/test_floors.sh) alike
@pytest.mark.parametrize("kind,mode,clip", [("llama", "sync", 1.1), ("qwen3", "sync", 1.15),
                                            ("llama", "exact", 1.1), ("qwen3", "exact", 0.0)])
def test_logs_and_weights_equal_plain_trainer(kind, mode, clip, tmp_path):
    """``clip`` 0: no clipping (exact mode then steps each stage during the backward)."""
    ref_trainer, ref_model = run_plain(kind, tmp_path / "ref", max_grad_norm=clip)
    ours = run_ours(kind, tmp_path / "ours", {"step_mode": mode}, max_grad_norm=clip)
    ref_logs, our_logs = tc.train_logs(ref_trainer.state.log_history), \
        tc.train_logs(ours.state.log_history)
    print(f"\n{kind} {mode}\n" + comparison_table(our_logs, ref_logs))
    assert len(ref_logs) == 20
    assert_same_logs(our_logs, ref_logs)
    # clipping happened on some steps and not on others, so both branches were compared
    norms = [h["grad_norm"] for h in ref_logs]
    assert clip == 0 or min(norms) < clip < max(norms)
    ref_eval, our_eval = tc.eval_logs(ref_trainer.state.log_history), \
        tc.eval_logs(ours.state.log_history)
    assert len(ref_eval) == len(our_eval) == 2
    for a, b in zip(our_eval, ref_eval):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=REL)
    got = ours.model.state_dict()
    for name, want in ref_model.state_dict().items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=name)
    if mode == "exact":   # stepped during the backward unless clipping needs the norm first
        deferred = ours.model.pipeline_stats().get("exact_deferred_calls", 0)
        assert (deferred == 0) == (clip == 0), deferred


@pytest.mark.parametrize("field,value", [("torch_compile", True), ("use_liger_kernel", True),
                                         ("label_smoothing_factor", 0.1),
                                         ("neftune_noise_alpha", 5.0), ("optim", "adamw_8bit")])
def test_arguments_that_cannot_combine_are_refused_naming_them(field, value, tmp_path):
    reset_accelerate()
    model = tc.make_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        args = tc.training_args(tmp_path, **{field: value})
    except (ValueError, ImportError) as e:   # TrainingArguments refuses it itself here
        pytest.skip(f"TrainingArguments refuses {field}={value!r} on this machine: {e}")
    with pytest.raises(ValueError, match=field):
        RoundPipeTrainer(model=model, args=args, train_dataset=tc.TokenData(8))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])       # nothing was modified


@pytest.mark.parametrize("field", ["model_init"])  # compute_loss_func: test_reliability_round4
def test_trainer_arguments_that_cannot_combine_are_refused(field, tmp_path):
    reset_accelerate()
    model = tc.make_model("llama")
    with pytest.raises(ValueError, match=field):
        RoundPipeTrainer(model=model, args=tc.training_args(tmp_path),
                         train_dataset=tc.TokenData(8), **{field: lambda *a, **k: None})
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def test_gradient_checkpointing_is_switched_off_with_a_warning(tmp_path):
    reset_accelerate()
    args = tc.training_args(tmp_path, gradient_checkpointing=True, max_steps=1,
                            eval_strategy="no")
    with pytest.warns(UserWarning, match="already\\s+recomputes"):
        trainer = RoundPipeTrainer(model=tc.make_model("llama"), args=args,
                                   train_dataset=tc.TokenData(8),
                                   roundpipe_kwargs={"device": "cpu"})
    trainer.train()
    assert not args.gradient_checkpointing
    assert not getattr(args, "activation_checkpointing", False)  # only newer transformers have it
    assert not any(getattr(m, "gradient_checkpointing", False)
                   for m in trainer.model.module.modules())


def test_an_optimizer_not_on_the_optimizer_copies_is_refused(tmp_path):
    reset_accelerate()
    model = tc.make_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = RoundPipeTrainer(model=model, args=tc.training_args(tmp_path, max_steps=1,
                                                                   eval_strategy="no"),
                               train_dataset=tc.TokenData(8), optimizers=(opt, None),
                               roundpipe_kwargs={"device": "cpu"})
    with pytest.raises(TypeError, match="optim_parameters"):
        trainer.train()


def test_import_roundpipe_imports_neither_trl_nor_the_trainer():
    import subprocess
    code = ("import sys, roundpipe; bad = [m for m in ('trl', 'transformers', "
            "'transformers.trainer', 'accelerate') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sft_trainer_without_trl_says_what_to_install():
    import subprocess
    code = ("import sys; sys.modules['trl'] = None\n"
            "import roundpipe.hf\n"
            "try:\n    roundpipe.hf.RoundPipeSFTTrainer\nexcept ImportError as e:\n"
            "    assert 'pip install trl' in str(e), e\nelse:\n    raise SystemExit('no error')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


class _FakeCuda(torch.overrides.TorchFunctionMode):
    """Every tensor asked for on a CUDA device is made on the CPU instead, and recorded (the
    function and the tensor's shape): what Trainer and accelerate send to ``args.device``."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: list = []

    @staticmethod
    def _cuda(x) -> bool:
        return (isinstance(x, torch.device) and x.type == "cuda") or \
            (isinstance(x, str) and x.startswith("cuda"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if any(self._cuda(a) for a in list(args) + list(kwargs.values())):
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            self.moved.append((getattr(func, "__name__", str(func)),
                               None if first is None else tuple(first.shape)))
            args = tuple("cpu" if self._cuda(a) else a for a in args)
            kwargs = {k: ("cpu" if self._cuda(v) else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def test_accelerate_keeps_its_hands_off_with_a_cuda_device_and_two_gpus(tmp_path, monkeypatch):
    """args.device faked as cuda:0 and n_gpu as 2 (as on a 2-GPU machine): no DataParallel, the
    model is never moved (RoundPipe refuses any move of its weights), the batches reach the
    pipeline on the host (only 0-dim loss/count tensors go to args.device) and the logs equal
    plain Trainer's on the CPU with the batch Trainer forms for 2 GPUs (2 x 4)."""
    steps = dict(max_steps=6, eval_strategy="no")
    ref_trainer, _ = run_plain("llama", tmp_path / "ref", per_device_train_batch_size=8, **steps)
    reset_accelerate()
    cuda = torch.device("cuda:0")   # made outside the fake (which turns cuda into cpu)
    monkeypatch.setattr(transformers.TrainingArguments, "device",
                        property(lambda self: (self._setup_devices, cuda)[1]))
    monkeypatch.setattr(transformers.TrainingArguments, "n_gpu", property(lambda self: 2))

    def no_data_parallel(*a, **k):
        raise AssertionError("DataParallel was built")

    monkeypatch.setattr(torch.nn.DataParallel, "__init__", no_data_parallel)
    fake = _FakeCuda()
    with fake:
        trainer = RoundPipeTrainer(model=tc.make_model("llama"),
                                   args=tc.training_args(tmp_path / "ours", **steps),
                                   train_dataset=tc.TokenData(48),
                                   roundpipe_kwargs={"num_microbatch": 2})
        assert trainer.args.train_batch_size == 8 and trainer.place_model_on_device
        trainer.train()
    assert all(p.device.type == "cpu" for p in trainer.model.module.parameters())
    assert fake.moved, "nothing was sent to args.device: the fake did not take effect"
    assert all(shape in (None, ()) for _, shape in fake.moved), fake.moved
    assert_same_logs(tc.train_logs(trainer.state.log_history),
                     tc.train_logs(ref_trainer.state.log_history))
