"""The stage planner on a GPU (issue 38, item 4): the 1.82B Llama's tokens/s in exact mode with
the automatic plan against layers_per_stage=1 and hand-picked values, at 4k and 64k tokens per
step (4 x 1024 in 4 microbatches; 64 x 1024 in 16), each after its plan settled (5 calls), the
median of 3 timed calls; and the peak device memory of each. Writes plans.json under $OUT."""

from __future__ import annotations

import copy
import gc
import os
import statistics
import time

import torch

import roundpipe
import roundpipe.optim as rpo
from common import (DEVICE, SMOKE, batch, build, empty_cache, llama_config, peak_gib, reset_peak,
                    save, sync)

PLANS = os.environ.get("PLANS", "auto,1,4,12").split(",")
cfg = llama_config()
host = build(cfg)
result = {}
SETTLE, TIMED = (1, 1) if SMOKE else (5, 3)  # calls: the plan settles, then timed
for rows, microbatches in ((2, 2), (4, 2)) if SMOKE else ((4, 4), (64, 16)):
    ids = batch(cfg, rows, 1024)
    tokens = ids.numel()
    for plan in PLANS:
        lps = plan if plan == "auto" else int(plan)
        reset_peak()
        model = roundpipe.wrap_model_to_roundpipe(copy.deepcopy(host), torch.float32,
                                                  device=DEVICE, num_microbatch=microbatches,
                                                  layers_per_stage=lps)
        opt = rpo.AdamW(model.optim_parameters(), lr=1e-5)
        kw = {"input_kwargs": {"input_ids": ids, "labels": ids}, "optimizer": opt}
        for _ in range(SETTLE):
            model.forward_backward(**kw)
        model.synchronize()
        sync()
        seconds = []
        for _ in range(TIMED):
            start = time.time()
            model.forward_backward(**kw)
            model.synchronize()
            sync()
            seconds.append(time.time() - start)
        tps = tokens / statistics.median(seconds)
        key = f"{tokens}-{plan}"
        result[key] = {"tokens_per_s": tps, "seconds": seconds, "peak_gib": peak_gib(),
                       "plan": list(model.plan().sizes), "reason": model.plan().reason}
        print(f"{tokens:>6} tokens/step, layers_per_stage={plan!s:>4}: {tps:9.0f} tokens/s "
              f"({[round(s, 3) for s in seconds]} s), peak {peak_gib():.2f} GiB, stages "
              f"{list(model.plan().sizes)}", flush=True)
        del model, opt
        gc.collect()
        empty_cache()
save("plans.json", result)
