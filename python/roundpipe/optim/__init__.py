"""CPU optimizers with SIMD kernels, drop-in replacements for their ``torch.optim`` namesakes.

Each class takes the same arguments, keeps the same ``state`` and ``state_dict`` format and
produces the same results as the ``torch.optim`` class of the same name, for float32, CPU,
dense, contiguous parameters (anything else is an error raised before any tensor changes).

``active_isa()``, ``supported_isas()`` and ``set_isa()`` report and choose the instruction set
the kernels use (also settable with the environment variable ``ROUNDPIPE_ISA``);
``num_threads()`` / ``set_num_threads()`` control the worker threads of a step;
``prefetch_choice()`` reports how far ahead the kernels prefetch each array and how that was
chosen (a calibration by the first large steps, or the environment variable
``ROUNDPIPE_PREFETCH``), ``set_prefetch_distance()`` / ``calibrate_prefetch()`` fix or redo it;
no choice changes a result.
"""

from ._base import CpuOptimizer, StepStats, frozen_copy
from .._C import (active_isa, calibrate_prefetch, num_threads, prefetch_choice, set_isa,
                  set_num_threads, set_prefetch_distance, supported_isas)

# Reads ROUNDPIPE_ISA and ROUNDPIPE_PREFETCH now, so that an unknown or unsupported value fails
# at import (ValueError naming the variable) rather than at the first step.
active_isa()
prefetch_choice()
from .adadelta import Adadelta
from .adafactor import Adafactor
from .adagrad import Adagrad
from .adam import Adam
from .adamax import Adamax
from .adamw import AdamW
from .asgd import ASGD
from .nadam import NAdam
from .radam import RAdam
from .rmsprop import RMSprop
from .rprop import Rprop
from .sgd import SGD

__all__ = [
    "ASGD",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SGD",
    "CpuOptimizer",
    "StepStats",
    "frozen_copy",
    "active_isa",
    "calibrate_prefetch",
    "num_threads",
    "prefetch_choice",
    "set_isa",
    "set_num_threads",
    "set_prefetch_distance",
    "supported_isas",
]
