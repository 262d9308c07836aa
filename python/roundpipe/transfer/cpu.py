"""The CPU as compute device: every copy is synchronous and events are ``None``.

The next stage's weights are "prefetched" as on CUDA when ``prefetch`` is set (the same
fetcher logic runs, so what stays alive and what waits for what is tested here, without a GPU).
Parameters are used where they are (a new tensor object sharing the host model copy's memory,
so it can require grad on its own): no second copy of a stage's weights exists on the host;
so are the KV cache entries of generation (only read by the layer).
That is safe because nothing writes a layer's model copy while a pass may read it (the
optimizer side's layer gates). Buffers and stage inputs are copied (a layer may update them
in place, and a recomputation must not update them twice). Downloads hand the computed tensor
over without a copy (it is already in host memory and nothing else refers to it). Every
transfer is counted as if it crossed PCIe, so ``pipeline_stats()`` shows on the CPU what a
GPU would move.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..host_buffers import HostBuffers
from .base import DeviceIO, GradDownload, nbytes


class CpuIO(DeviceIO):
    """:class:`roundpipe.transfer.base.DeviceIO` for the CPU (see the module docstring)."""

    def __init__(self, device: torch.device, stats, pool: Optional[HostBuffers] = None,
                 prefetch: bool = False) -> None:
        super().__init__(device, stats)
        self.prefetch = prefetch
        self._pool = pool or HostBuffers()
        self._upload_start = 0.0

    def _new_sum(self, g: torch.Tensor) -> torch.Tensor:
        # in host memory: a reused buffer, handed over to the optimizer side as it is
        return self._pool.take(g.shape, torch.float32).copy_(g)

    def _copy_to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def _upload_parameter(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def _begin_upload(self) -> None:
        self._upload_start = time.perf_counter()

    def _end_upload(self, nbytes: int):
        seconds = time.perf_counter() - self._upload_start
        self.stats.add("upload_s", seconds)
        self.stats.add("weights_wait_s", seconds)  # the compute waited for the whole copy
        return None

    def kv_to_device(self, host: torch.Tensor, after) -> torch.Tensor:
        """The host KV entries themselves (counted as if copied): the layer only reads them,
        and nothing writes them during the pass."""
        self._moved("h2d", "kv", nbytes(host))
        return host

    def _download_grads(self, sources, norms_sq) -> GradDownload:
        return GradDownload(sources, norms_sq, None, True, self._grad_permits.release)

    def _write_back_buffers(self, changed) -> None:
        with torch.no_grad():
            for host, dev in changed:
                host.copy_(dev)
