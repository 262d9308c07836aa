"""RoundPipe: train models far larger than GPU memory on ordinary GPUs.

Model state lives in CPU memory; layers stream to the compute device for forward and backward;
the optimizer runs on the CPU in fp32 with SIMD kernels (``roundpipe.optim``).
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .context import OptimizerCtx
from .distributed import global_num_items
from .grad_scaler import GradScaler
from .hf import wrap_model_to_roundpipe
from .pipeline.execute import layer_seed
from .microbatch import merge_outputs, split_microbatches
from .recompute import doing_recompute, get_recompute_data, save_for_recompute
from .steps import StepReport
from .wrapper import RoundPipe

__version__ = "0.1.0"
__all__ = [
    "GradScaler",
    "OptimizerCtx",
    "RoundPipe",
    "StepReport",
    "__version__",
    "doing_recompute",
    "get_recompute_data",
    "global_num_items",
    "load_checkpoint",
    "layer_seed",
    "merge_outputs",
    "save_checkpoint",
    "save_for_recompute",
    "split_microbatches",
    "wrap_model_to_roundpipe",
]
