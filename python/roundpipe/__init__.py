"""RoundPipe: train models far larger than GPU memory on ordinary GPUs.

Model state lives in CPU memory; layers stream to the compute device for forward and backward;
the optimizer runs on the CPU in fp32 with SIMD kernels (``roundpipe.optim``).

The package face is lazy (PEP 562): each name below is imported from its module on first
use, so ``import roundpipe.optim`` loads the optimizers alone (not the wrapper, the pipeline,
Hugging Face support or ``torch.distributed.checkpoint``), and ``import roundpipe`` costs
nothing beyond torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "GradScaler": ".grad_scaler",
    "OptimizerCtx": ".context",
    "RoundPipe": ".wrapper",
    "StepReport": ".steps",
    "doing_recompute": ".recompute",
    "get_recompute_data": ".recompute",
    "global_num_items": ".distributed",
    "layer_seed": ".pipeline.execute",
    "load_checkpoint": ".checkpoint",
    "merge_outputs": ".microbatch",
    "save_checkpoint": ".checkpoint",
    "save_for_recompute": ".recompute",
    "split_microbatches": ".microbatch",
    "will_recompute": ".recompute",
    "wrap_model_to_roundpipe": ".hf",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

# other libraries' warnings about their own code, not the user's (see the module)
importlib.import_module(".known_warnings", __name__).install()


def __getattr__(name: str) -> Any:
    """``roundpipe.X``: a public name from its module, or a subpackage (``roundpipe.optim``,
    ``roundpipe.hf``, ...) imported on first use."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    else:
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
