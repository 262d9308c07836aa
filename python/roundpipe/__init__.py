"""RoundPipe: train models far larger than GPU memory on ordinary GPUs.

Model state lives in CPU memory; layers stream to the compute device for forward and backward;
the optimizer runs on the CPU in fp32 with SIMD kernels (``roundpipe.optim``).
"""

from .context import OptimizerCtx

__version__ = "0.1.0"
__all__ = ["OptimizerCtx", "__version__"]
