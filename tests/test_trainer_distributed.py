"""RoundPipeTrainer under two gloo ranks (started as torchrun would, tests/trainer_ranks.py)
against plain ``transformers.Trainer`` in one process on the whole batch (each rank gets half
of it): the logged loss, grad_norm and learning_rate equal at every step (relative 1e-4),
eval_loss equal, final weights equal, with the optimizer sharded over the ranks; the
checkpoint the two ranks saved at step 10 resumes in one process and logs what the plain
Trainer logged (plain Trainer refuses its sharded optimizer state)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
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
    # plain Trainer cannot take its optimizer state (each rank wrote only its rows): it
    # refuses the checkpoint's optimizer.pt rather than resuming with fresh moments
    tc.reset_accelerate()
    plain = transformers.Trainer(model=tc.make_model("llama"),
                                 args=tc.training_args(tmp_path / "plain", eval_strategy="no"),
                                 train_dataset=tc.TokenData(48))
    with pytest.raises(ValueError, match="parameter group"):
        plain.train(resume_from_checkpoint=str(checkpoint))
    note = torch.load(checkpoint / "optimizer.pt")["param_groups"][0]["roundpipe"]
    assert "sharded" in note and "RoundPipeTrainer" in note


@pytest.mark.parametrize("shard", [False, True])
def test_bf16_optimizer_copies_start_at_rank_0s_fp32_weights_on_every_rank(tmp_path, shard):
    """bf16=True under two ranks whose models start from different weights: the wrapper takes
    rank 0's model copy on every rank (as DDP), and every rank's fp32 optimizer copies (its
    rows, sharded) hold rank 0's fp32 weights, not its own and not their bf16 rounding."""
    for r in launcher.launch("trainer_ranks.py", 2, tmp_path, 1, "1" if shard else "0",
                             "bf16-start", timeout=300):
        assert r.returncode == 0, r.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    origin = ranks[0]["before"]
    assert any(not torch.equal(origin[n], ranks[1]["before"][n]) for n in origin)
    for got in ranks:
        assert got["copies"]
        for name, copy in got["copies"].items():
            rows = got["rows"][name]
            want = origin[name] if rows is None else origin[name][rows[0]:rows[1]]
            assert copy.dtype == torch.float32 and torch.equal(copy, want), name
