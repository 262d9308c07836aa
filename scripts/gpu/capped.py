"""The 1.82B Llama under a device-memory cap (CAP_GB, default 3; plain HF with AdamW needs 14 GB
for weights, gradients and optimizer state, and cannot even load its weights and gradients
under 3 GB): RoundPipe trains it in sync, async and exact modes with the automatic plan, its
first loss equal to plain HF's on the uncapped GPU, its peak within the cap. Prints one line per
mode and writes capped.json under $OUT."""

from __future__ import annotations

import copy
import gc
import os
import time

import torch

import roundpipe
import roundpipe.optim as rpo
from common import (DEVICE, SMOKE, allocated_gib, batch, build, empty_cache, llama_config,
                    peak_gib, reset_peak, save, sync, train_step)

CAP_GB = float(os.environ.get("CAP_GB", "3"))
cfg = llama_config()
host = build(cfg)
ids = batch(cfg, 4, 1024)
with torch.no_grad():
    ref = copy.deepcopy(host).to(DEVICE)
    want = ref(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE)).loss.item()
    del ref
empty_cache()
print(f"plain HF first loss (uncapped): {want:.6f}", flush=True)
if not SMOKE:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(CAP_GB * 2**30 / total, 0)
result = {"cap_gib": CAP_GB, "plain_first_loss": want, "modes": {}}
for mode in ("sync", "async", "exact"):
    reset_peak()
    model = roundpipe.wrap_model_to_roundpipe(copy.deepcopy(host), torch.float32, device=DEVICE,
                                              num_microbatch=4)
    opt = rpo.AdamW(model.optim_parameters(), lr=1e-4)
    losses, seconds, live = [], [], []
    try:
        for _ in range(2 if SMOKE else 5):
            start = time.time()
            losses.append(train_step(model, opt, ids, mode).item())
            sync()
            seconds.append(time.time() - start)
            live.append(allocated_gib())  # after each call: flat, or something is kept
        model.synchronize()
        error = None
    except torch.cuda.OutOfMemoryError as e:
        error = str(e).splitlines()[0]
    # a cap makes the allocator free cached blocks and retry (a device-wide synchronisation)
    # when an allocation does not fit the pool of its stream: how often it did
    retries = 0 if SMOKE else torch.cuda.memory_stats().get("num_alloc_retries", 0)
    row = {"losses": losses, "seconds": seconds, "peak_gib": peak_gib(), "live_gib": live,
           "alloc_retries": retries,
           "plan": list(model.plan().sizes), "error": error,
           "first_loss_equal": bool(losses) and abs(losses[0] - want) <= 2e-3 * abs(want)}
    result["modes"][mode] = row
    print(f"{mode:>6}: first loss {losses[0] if losses else float('nan'):.6f} (plain {want:.6f}); "
          f"losses {[round(x, 4) for x in losses]}; peak {row['peak_gib']:.2f} GiB of {CAP_GB} "
          f"GiB; allocated after each call {[round(x, 3) for x in live]} GiB; {retries} allocator "
          f"retries; "
          f"{[round(s, 2) for s in seconds]} s per call; stages {row['plan']}"
          + (f"; FAILED: {error}" if error else ""), flush=True)
    del model, opt
    gc.collect()
    empty_cache()
save("capped.json", result)
