"""Where a training call of the 1.82B Llama spends its time and device memory (MODE: sync,
async or exact, default exact; batch 4 x 1024, 4 microbatches, the automatic plan): after the
plan settles, one call under torch.profiler (CPU and CUDA activities: a Chrome trace), one
under cProfile (the calling thread, which issues a one-device pass: its 40 most expensive
functions), one with CUDA's sync debug mode (how many calls made the host wait for the
device, and where), and two calls with the CUDA memory history recorded (a snapshot for
pytorch.org/memory_viz). Everything goes into $OUT/profile.tar (traces gzipped)."""

from __future__ import annotations

import collections
import cProfile
import gzip
import io
import os
import pickle
import pstats
import shutil
import tarfile
import time
import warnings

import torch

import roundpipe
import roundpipe.optim as rpo
from common import DEVICE, OUT, SMOKE, batch, build, llama_config, save, sync, train_step

MODE = os.environ.get("MODE", "exact")
cfg = llama_config()
model = roundpipe.wrap_model_to_roundpipe(build(cfg), torch.float32, device=DEVICE,
                                          num_microbatch=4)
opt = rpo.AdamW(model.optim_parameters(), lr=1e-4)
ids = batch(cfg, 4, 1024)


def call():
    return train_step(model, opt, ids, MODE)


times = []
for _ in range(6):  # the plan settles
    start = time.time()
    call()
    sync()
    times.append(time.time() - start)
model.synchronize()
print(f"{MODE}: seconds per call {[round(t, 3) for t in times]}; plan {model.plan()}", flush=True)
if not SMOKE:  # what in one call makes the host wait for the device (item(), .cpu(), ...)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
        model.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught)
    print(f"{MODE}: {len(caught)} synchronizing CUDA calls in one call (no decoder layer should "
          f"make one); most frequent {sites.most_common(6)}", flush=True)
work = os.path.join(OUT, "profile")
os.makedirs(work, exist_ok=True)
activities = [torch.profiler.ProfilerActivity.CPU]
if not SMOKE:
    activities.append(torch.profiler.ProfilerActivity.CUDA)
with torch.profiler.profile(activities=activities, record_shapes=False) as prof:
    call()
    model.synchronize()
    sync()
trace = os.path.join(work, "trace.json")
prof.export_chrome_trace(trace)
with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as g:
    shutil.copyfileobj(f, g)
os.remove(trace)
with open(os.path.join(work, "profiler_table.txt"), "w") as f:
    f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
profiler = cProfile.Profile()
profiler.enable()
call()
model.synchronize()
sync()
profiler.disable()
text = io.StringIO()
pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
with open(os.path.join(work, "cprofile.txt"), "w") as f:
    f.write(text.getvalue())
if not SMOKE:
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    for _ in range(2):
        call()
    model.synchronize()
    sync()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    with gzip.open(os.path.join(work, "memory.pickle.gz"), "wb") as f:
        pickle.dump(snap, f)
save("profile_summary.json", {"mode": MODE, "seconds": times, "plan": list(model.plan().sizes),
                              "stats": model.pipeline_stats()})
with tarfile.open(os.path.join(OUT, "profile.tar"), "w") as tar:
    tar.add(work, arcname="profile")
shutil.rmtree(work)
print(open(os.path.join(OUT, "profile_summary.json")).read()[:2000])
