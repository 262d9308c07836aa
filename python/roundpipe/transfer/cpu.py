"""The CPU as compute device: every copy is synchronous and events are ``None``.

Uploads are real copies (a layer computes on its own copy of the weights and inputs, as on a
GPU, and may modify them in place); downloads hand the computed tensor over without a copy
(it is already in host memory and nothing else refers to it). Both are counted as if they
crossed PCIe, so ``pipeline_stats()`` shows on the CPU what a GPU would move.
"""

from __future__ import annotations

import time

import torch

from .base import DeviceIO, GradDownload


class CpuIO(DeviceIO):
    """:class:`roundpipe.transfer.base.DeviceIO` for the CPU (see the module docstring)."""

    def __init__(self, device: torch.device, stats) -> None:
        super().__init__(device, stats)
        self._upload_start = 0.0

    def _copy_to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def _copy_to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def _begin_upload(self) -> None:
        self._upload_start = time.perf_counter()

    def _end_upload(self, nbytes: int):
        seconds = time.perf_counter() - self._upload_start
        self.stats.add("upload_s", seconds)
        self.stats.add("weights_wait_s", seconds)  # the compute waited for the whole copy
        return None

    def _download_grads(self, sources) -> GradDownload:
        return GradDownload(sources, None, True, self._grad_permits.release)

    def _write_back_buffers(self, changed) -> None:
        with torch.no_grad():
            for host, dev in changed:
                host.copy_(dev)
