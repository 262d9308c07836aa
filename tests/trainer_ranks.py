"""One rank of the 2-rank RoundPipeTrainer test (tests/test_trainer.py starts two of these as
torchrun would: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment).

    python tests/trainer_ranks.py OUTDIR PER_DEVICE_BATCH SHARD

Trains the comparison's Llama with RoundPipeTrainer over the gloo group TrainingArguments
initialises (``shard_optimizer`` as given), saving a checkpoint at step 10
(OUTDIR/run/checkpoint-10);
rank 0 writes the log history and the final weights (log.json, weights.pt) to OUTDIR.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import trainer_cases as tc  # noqa: E402

from roundpipe.hf import RoundPipeTrainer  # noqa: E402


def main() -> None:
    out, per_device, shard = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    torch.set_num_threads(1)
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
