"""One rank of the 2-rank RoundPipeTrainer test (tests/test_trainer.py starts two of these as
torchrun would: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).

    python tests/trainer_ranks.py OUTDIR PER_DEVICE_BATCH SHARD [bf16-start]

Trains the comparison's Llama with RoundPipeTrainer over the gloo group TrainingArguments
initialises (``shard_optimizer`` as given), saving a checkpoint at step 10
(OUTDIR/run/checkpoint-10);
rank 0 writes the log history and the final weights (log.json, weights.pt) to OUTDIR.

With ``bf16-start``: each rank builds the Llama from a seed of its own (weights that differ
between ranks), constructs the trainer with ``bf16=True`` and writes, without training, its
weights before the trainer and its optimizer copies with their rows (OUTDIR/rank<R>.pt).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import trainer_cases as tc  # noqa: E402

from roundpipe.hf import RoundPipeTrainer  # noqa: E402


def bf16_start(out: str, shard: bool) -> None:
    rank = int(os.environ["RANK"])
    model = tc.make_model("llama", seed=rank)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = tc.training_args(os.path.join(out, "run"), ddp_backend="gloo", bf16=True,
                            eval_strategy="no")
    trainer = RoundPipeTrainer(model=model, args=args, train_dataset=tc.TokenData(8),
                               roundpipe_kwargs={"device": "cpu", "shard_optimizer": shard})
    copies = {n: p.detach().clone() for n, p in trainer.model.optim_named_parameters()}
    torch.save({"before": before, "copies": copies, "rows": trainer.model.optim_shard_rows()},
               os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    out, per_device, shard = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    torch.set_num_threads(1)
    if sys.argv[4:] == ["bf16-start"]:
        return bf16_start(out, shard)
    args = tc.training_args(os.path.join(out, "run"), per_device_train_batch_size=per_device,
                            per_device_eval_batch_size=per_device, ddp_backend="gloo",
                            save_strategy="steps", save_steps=10)
    trainer = RoundPipeTrainer(model=tc.make_model("llama"), args=args,
                               train_dataset=tc.TokenData(48), eval_dataset=tc.TokenData(8, 2),
                               roundpipe_kwargs={"device": "cpu", "num_microbatch": 2,
                                                 "shard_optimizer": shard})
    assert torch.distributed.get_world_size() == 2, "not started as two ranks"
    trainer.train()
    weights = trainer.model.state_dict()       # a collective when sharded
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "log.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
        torch.save(weights, os.path.join(out, "weights.pt"))


if __name__ == "__main__":
    main()
