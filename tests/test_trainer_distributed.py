"""RoundPipeTrainer under two gloo ranks (started as torchrun would, tests/trainer_ranks.py)
against plain ``transformers.Trainer`` in one process on the whole batch (each rank gets half
of it): the logged loss, grad_norm and learning_rate equal at every step (relative 1e-4),
eval_loss equal, final weights equal, with the optimizer sharded over the ranks; the
checkpoint the two ranks saved at step 10 resumes in one process and logs what the plain
Trainer logged."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import trainer_cases as tc  # noqa: E402
import launcher  # noqa: E402
from trainer_cases import REL, assert_same_logs, run_ours, run_plain  # noqa: E402


def launch_two(out, per_device: int, shard: bool, timeout: float = 300) -> None:
    for r in launcher.launch("trainer_ranks.py", 2, out, per_device, "1" if shard else "0",
                             timeout=timeout):
        assert r.returncode == 0, r.stderr[-4000:]


def test_two_gloo_ranks_equal_plain_trainer_on_the_whole_batch_and_resume_in_one(tmp_path):
    ref_trainer, ref_model = run_plain("llama", tmp_path / "ref")      # batch 4, one process
    launch_two(tmp_path / "ranks", per_device=2, shard=True)            # 2 ranks x 2
    logs = json.loads((tmp_path / "ranks" / "log.json").read_text())
    ref_logs = tc.train_logs(ref_trainer.state.log_history)
    assert_same_logs(tc.train_logs(logs), ref_logs)
    for a, b in zip(tc.eval_logs(logs), tc.eval_logs(ref_trainer.state.log_history)):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=REL)
    weights = torch.load(tmp_path / "ranks" / "weights.pt")
    for name, want in ref_model.state_dict().items():
        torch.testing.assert_close(weights[name], want, rtol=1e-4, atol=1e-5, msg=name)
    # the checkpoint written by 2 ranks (sharded optimizer) resumes in one process
    checkpoint = tmp_path / "ranks" / "run" / "checkpoint-10"
    resumed = run_ours("llama", tmp_path / "resumed", resume=str(checkpoint))
    got = [h for h in tc.train_logs(resumed.state.log_history) if h["step"] > 10]
    assert_same_logs(got, [h for h in ref_logs if h["step"] > 10])
