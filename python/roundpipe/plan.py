"""The plan: which layers form each stage and which compute device runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def split_layers(model: nn.Module) -> list[nn.Module]:
    """An ``nn.Sequential``'s entries are the layers, in order, a module repeated in it counted
    each time it appears (as ``nn.Sequential.forward`` runs it). Any other module, including a
    Sequential subclass that defines its own ``forward``, is one layer."""
    if isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward:
        layers = list(model)
        if not layers:
            raise ValueError("RoundPipe: the nn.Sequential model has no layers")
        return layers
    return [model]


@dataclass(frozen=True)
class Stage:
    """Consecutive layers ``[start, stop)`` that run together on one device."""

    index: int
    start: int
    stop: int
    device: torch.device

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


def make_stages(num_layers: int, layers_per_stage: int, devices: list[torch.device]) -> list[Stage]:
    """Groups layers into stages of ``layers_per_stage`` (the last may be shorter) and assigns
    them to ``devices`` round-robin."""
    if layers_per_stage < 1:
        raise ValueError(f"RoundPipe: layers_per_stage must be >= 1, got {layers_per_stage}")
    starts = range(0, num_layers, layers_per_stage)
    return [Stage(i, s, min(s + layers_per_stage, num_layers), devices[i % len(devices)])
            for i, s in enumerate(starts)]


def default_device() -> torch.device:
    """The first CUDA device when one is available, else the CPU. Called at construction, never
    at import, so importing roundpipe does not initialise CUDA."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


PIN_MODES = ("auto", "alloc", "register", "off")


def parse_devices(device) -> list[torch.device]:
    """The compute devices from ``RoundPipe(device=...)``: ``None`` (the default device), one
    device (``"cpu"``, ``"cuda:1"``, ``torch.device``) or a non-empty list or tuple of them.
    The same device may be listed several times (e.g. ``["cpu", "cpu"]``: two CPU workers).
    ``"cuda"`` without an index means ``cuda:0``.

    Raises:
        ValueError: an empty list, a device type other than ``cpu``/``cuda``, CPU and CUDA
            devices mixed, or a CUDA device this machine does not have.
        TypeError: an entry that is not a string or ``torch.device``.
    """
    if device is None:
        return [default_device()]
    items = list(device) if isinstance(device, (list, tuple)) else [device]
    if not items:
        raise ValueError("RoundPipe: device must not be an empty list")
    devices = []
    for d in items:
        if not isinstance(d, (str, torch.device)):
            raise TypeError(f"RoundPipe: device entries must be str or torch.device, got {d!r}")
        d = torch.device(d)
        if d.type not in ("cpu", "cuda"):
            raise ValueError(f"RoundPipe: device {d} is not supported (cpu or cuda)")
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", 0)
        devices.append(d)
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"RoundPipe: device mixes CPU and CUDA devices ({items!r}); use "
                         "either CPU workers or CUDA devices")
    if devices[0].type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for d in devices:
            if d.index >= count:
                raise ValueError(f"RoundPipe: device {d} is not available (this machine has "
                                 f"{count} CUDA device{'s' if count != 1 else ''})")
    return devices
