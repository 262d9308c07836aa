"""What ``RoundPipe.pipeline_stats()`` reports: seconds, bytes moved by kind and direction, and
the byte floors of the work that was run. Counted identically on every device type (on the
CPU device, its copies count as if they crossed PCIe).

Keys (all floats, accumulated since construction or the last reset):

- ``wall_s``: time in ``forward`` / ``forward_backward`` passes; ``device_s``: the same times the
  number of devices the pass used;
- ``weights_wait_s``: compute waiting for weight uploads (CPU: the copies themselves; CUDA:
  measured on the device with events, folded in when they complete);
- ``optimizer_wait_s``: passes waiting for layers still being written by the optimizer side;
- ``optimizer_s``: time in fused optimizer steps; ``upload_s``: weight uploads (CUDA: timed on
  the upload stream); ``comm_s``: the optimizer thread waiting for collectives across ranks
  (``process_group``: the part of the communication not hidden behind its other work);
- ``h2d_<kind>_bytes`` / ``d2h_<kind>_bytes`` for ``kind`` in :data:`KINDS`: bytes moved host
  to device and device to host;
- ``weight_floor_bytes``: the weights every visit of a stage must upload (each unique
  parameter of the stage once per forward visit and once per backward visit);
- ``param_grad_floor_bytes``: parameter gradients down, once per backward visit:
  ``P_stage * min(M * itemsize, 4)`` per stage (the model-dtype gradient for one microbatch,
  else the fp32 sum over ``M`` microbatches);
- ``h2d_kv_bytes`` / ``d2h_kv_bytes`` (kind ``kv``): the KV cache of generation with
  ``kv_cache="host"`` (see :mod:`roundpipe.hf.kv_cache`): each layer's cached keys and values
  up to the device once per pass (a sliding-window layer: only its window), the new ones down
  once;
- ``kv_floor_bytes``: what those must move, from the cache's lengths: per layer and pass, the
  keys and values the layer attends to that were cached before the pass, plus the new ones;
- ``generate_steps``: forward passes run by ``generate`` (each gives every row its next token:
  weights are streamed once per step, so ``weight_floor_bytes`` grows by the model's weight
  bytes per step); ``generated_tokens``: the rows of those passes summed (tokens generated,
  finished rows included, as transformers computes them). Weight bytes per generated token:
  ``h2d_weight_bytes / generated_tokens``;
- ``exact_deferred_calls``: exact-mode calls whose step waited for the end of the backward
  (a loss scaler or clipping needs every gradient's verdict first);
- ``disk_read_bytes`` / ``disk_write_bytes``: bytes of optimizer copies and state read from
  and written to ``optimizer_dir`` (direct I/O, read ahead included); ``disk_wait_s``: step
  calls waiting for those reads (or for room in the window); ``disk_window_bytes``: the most
  host memory the window held (not reset); all 0 without ``optimizer_dir``;
- ``pinned_bytes``: page-locked host memory held now (CUDA; not reset);
- ``host_stage_input_bytes``: the most bytes of stage inputs (what a stage's forward visit
  hands to the next stage, kept on the host for that stage's backward: the activations of
  every stage boundary and, for a Hugging Face model, the state travelling with them) held at
  once by the last pass (a ``forward`` or ``forward_backward`` call, or one step of
  ``generate``; not reset; on the CPU device counted as if copied to the host);
- ``stages``: the stages of the plan in effect (not reset; ``RoundPipe.plan()`` says which
  and why); ``plan_revisions``: how many times ``layers_per_stage="auto"`` changed the plan.
"""

from __future__ import annotations

import threading

KINDS = ("weight", "activation", "input_grad", "param_grad", "buffer", "label", "output", "kv")
TIME_KEYS = ("wall_s", "device_s", "weights_wait_s", "optimizer_wait_s", "optimizer_s", "upload_s",
             "comm_s", "disk_wait_s")
BYTE_KEYS = (tuple(f"h2d_{k}_bytes" for k in KINDS) + tuple(f"d2h_{k}_bytes" for k in KINDS)
             + ("weight_floor_bytes", "param_grad_floor_bytes", "kv_floor_bytes",
                "disk_read_bytes", "disk_write_bytes"))
COUNT_KEYS = ("exact_deferred_calls", "generate_steps", "generated_tokens", "plan_revisions")
GAUGES = ("pinned_bytes", "host_stage_input_bytes", "stages", "disk_window_bytes")
KEYS = TIME_KEYS + BYTE_KEYS + COUNT_KEYS + GAUGES


class Stats:
    """Thread-safe accumulators for :data:`KEYS`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(KEYS, 0.0)

    def add(self, key: str, value: float) -> None:
        """Adds ``value`` to ``key`` (a KeyError for an unknown key: a typo must not vanish)."""
        if value:
            with self._lock:
                self._values[key] += value

    def moved(self, direction: str, kind: str, nbytes: int) -> None:
        """Counts ``nbytes`` moved ``"h2d"`` or ``"d2h"`` as ``kind``."""
        self.add(f"{direction}_{kind}_bytes", nbytes)

    def set(self, key: str, value: float) -> None:
        with self._lock:
            self._values[key] = float(value)

    def snapshot(self, reset: bool = False) -> dict[str, float]:
        """The values; with ``reset``, every accumulator (not the gauges) restarts at 0."""
        with self._lock:
            out = dict(self._values)
            if reset:
                for k in TIME_KEYS + BYTE_KEYS + COUNT_KEYS:
                    self._values[k] = 0.0
        return out
