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

import contextlib
import time
from typing import Optional

import torch

from ..host_buffers import HostBuffers
from .base import DeviceIO, Done, GradDownload, nbytes


class CpuIO(DeviceIO):
    """:class:`roundpipe.transfer.base.DeviceIO` for the CPU (see the module docstring)."""

    def __init__(self, device: torch.device, stats, pool: Optional[HostBuffers] = None,
                 prefetch: bool = False) -> None:
        super().__init__(device, stats)
        self.prefetch = prefetch
        self._pool = pool or HostBuffers()

    def _new_sum(self, g: torch.Tensor) -> torch.Tensor:
        # in host memory: a reused buffer, handed over to the optimizer side as it is
        return self._pool.take(g.shape, torch.float32).copy_(g)

    def _device_like(self, host: torch.Tensor, parameter: bool) -> torch.Tensor:
        # a parameter is used where it is (see the module docstring)
        return host.detach() if parameter else torch.empty_like(host)

    def _fill(self, dev: torch.Tensor, host: torch.Tensor, parameter: bool) -> None:
        if not parameter:
            with torch.no_grad():
                dev.copy_(host)

    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @contextlib.contextmanager
    def _upload_stream(self):
        start = time.perf_counter()
        yield Done()
        # the compute waited for the whole upload: copies and dequantization
        self.stats.add("weights_wait_s", time.perf_counter() - start)

    @contextlib.contextmanager
    def _timed_copies(self, nbytes: int):
        start = time.perf_counter()
        yield
        self.stats.add("upload_s", time.perf_counter() - start)

    def kv_to_device(self, host: torch.Tensor, after) -> torch.Tensor:
        """The host KV entries themselves (counted as if copied): the layer only reads them,
        and nothing writes them during the pass."""
        self._moved("h2d", "kv", nbytes(host))
        return host

    def _download_grads(self, sources, norms_sq, abort=None) -> GradDownload:
        return GradDownload(sources, norms_sq, None, True, self._grad_permits.release)

    def _write_back_buffers(self, changed) -> None:
        with torch.no_grad():
            for host, dev in changed:
                host.copy_(dev)
