"""RoundPipeTrainer on CUDA (scripts/gpu_check.sh runs it; skipped without a GPU): the device
paths a CPU run cannot reach. Plain ``transformers.Trainer`` on the GPU (the model moved there,
as Trainer does) against RoundPipeTrainer with ``args.device`` = cuda:0 and the pipeline on
cuda:0 (the weights stay on the host, pinned): logged loss, grad_norm and learning rate agree
at every step, eval_loss too, in sync and exact mode, and in bf16 the run trains (its loss
falls) without autocast or torch's GradScaler."""

from __future__ import annotations


import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from roundpipe.hf import RoundPipeTrainer  # noqa: E402

import trainer_cases as tc  # noqa: E402
from trainer_cases import assert_same_logs, comparison_table, reset_accelerate  # noqa: E402


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _args(out, **kw):
    return tc.training_args(out, use_cpu=False, **kw)


@pytest.mark.parametrize("mode", ["sync", "exact"])
def test_trainer_on_cuda_equals_plain_trainer_on_the_gpu(mode, tmp_path):
    reset_accelerate()
    ref = transformers.Trainer(model=tc.make_model("llama"), args=_args(tmp_path / "ref"),
                               train_dataset=tc.TokenData(48), eval_dataset=tc.TokenData(8, 2))
    ref.train()
    reset_accelerate()
    ours = RoundPipeTrainer(model=tc.make_model("llama"), args=_args(tmp_path / "ours"),
                            train_dataset=tc.TokenData(48), eval_dataset=tc.TokenData(8, 2),
                            roundpipe_kwargs={"num_microbatch": 2, "step_mode": mode})
    assert ours.args.device.type == "cuda" and ours.model.device.type == "cuda"
    ours.train()
    assert all(p.device.type == "cpu" for p in ours.model.module.parameters())
    a, b = tc.train_logs(ours.state.log_history), tc.train_logs(ref.state.log_history)
    print("\n" + comparison_table(a, b))
    assert_same_logs(a, b)
    for x, y in zip(tc.eval_logs(ours.state.log_history), tc.eval_logs(ref.state.log_history)):
        assert x["eval_loss"] == pytest.approx(y["eval_loss"], rel=1e-4)


def test_bf16_on_cuda_trains_without_autocast(tmp_path):
    reset_accelerate()
    ours = RoundPipeTrainer(model=tc.make_model("qwen3"),
                            args=_args(tmp_path, bf16=True, eval_strategy="no"),
                            train_dataset=tc.TokenData(48), roundpipe_kwargs={"num_microbatch": 2})
    assert ours.model.module.dtype == torch.bfloat16 and ours.accelerator.scaler is None
    ours.train()
    logs = tc.train_logs(ours.state.log_history)
    assert logs[-1]["loss"] < logs[0]["loss"]
