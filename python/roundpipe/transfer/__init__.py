"""Moving tensors between the host and compute devices: the interface and what every device
type shares (:mod:`.base`), the CPU device (:mod:`.cpu`) and CUDA devices (:mod:`.cuda`)."""

from .base import DeviceIO, GradDownload, StageWeights, TensorRef, current_io, io_scope
from .cpu import CpuIO

__all__ = ["CpuIO", "DeviceIO", "GradDownload", "StageWeights", "TensorRef", "current_io",
           "io_scope"]
