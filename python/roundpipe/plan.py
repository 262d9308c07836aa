"""The plan: which layers form each stage, which compute device runs it, and what the
pipeline must know about modules shared between stages. Pure functions of the model's layers
(nothing here keeps state or starts threads)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

import torch
from torch import nn

from .torch_private import module_buffers


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


def device_index(stage: int, num_devices: int) -> int:
    """The device that runs stage ``stage`` of a pipeline over ``num_devices`` devices: stages
    go to the devices round-robin (``stage % num_devices``). The one place this rule lives: the
    stages' devices (:func:`make_stages`) and each device's order of visits
    (:func:`roundpipe.pipeline.schedule.device_orders`) both follow it."""
    return stage % num_devices


def uniform_sizes(num_layers: int, layers_per_stage: int) -> tuple[int, ...]:
    """Stages of ``layers_per_stage`` consecutive layers, the last one possibly shorter.

    Raises:
        ValueError: ``layers_per_stage`` < 1.
    """
    if layers_per_stage < 1:
        raise ValueError(f"RoundPipe: layers_per_stage must be >= 1, got {layers_per_stage}")
    full, rest = divmod(num_layers, layers_per_stage)
    return (layers_per_stage,) * full + ((rest,) if rest else ())


def make_stages(sizes: Sequence[int], devices: list[torch.device]) -> list[Stage]:
    """Consecutive stages of ``sizes[i]`` layers each, assigned to ``devices`` round-robin
    (:func:`device_index`)."""
    stages, start = [], 0
    for i, n in enumerate(sizes):
        stages.append(Stage(i, start, start + n, devices[device_index(i, len(devices))]))
        start += n
    return stages


def check_layers(model: nn.Module, layers: Sequence[nn.Module]) -> list[nn.Module]:
    """``RoundPipe(layers=...)`` as a list, checked: modules whose tensors all belong to
    ``model``.

    Raises:
        ValueError: ``layers`` is empty, or a parameter or buffer of a layer is not one of
            ``model``'s (the message names it and the layer's index).
        TypeError: an entry is not an ``nn.Module``.
    """
    layers = list(layers)
    if not layers:
        raise ValueError("RoundPipe: layers must not be empty")
    owned = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"RoundPipe: layers[{i}] must be an nn.Module, got {type(layer).__name__}")
        for name, t in list(layer.named_parameters()) + list(layer.named_buffers()):
            if id(t) not in owned:
                raise ValueError(f"RoundPipe: {name!r} of layers[{i}] is not a parameter or "
                                 "buffer of model; every layer must be a part of the model")
    return layers


@dataclass(frozen=True)
class SharedModules:
    """What the pipeline needs beyond the layers and stages (see :func:`shared_modules`).

    Attributes:
        locks: per layer, one ``threading.Lock`` shared by every layer of a group of layers
            that use a common module in different stages (``functional_call`` swaps a module's
            tensors while it runs), else None.
        buffer_deps: per stage, the earlier stages it must wait for because they share a
            module holding buffers (buffer updates happen in model order), ascending.
        stage_bytes: per stage, the bytes of its distinct parameters and buffers (what the
            device holds of it).
        grad_numels: per stage, the element counts of its distinct trainable parameters, in
            the order the stage's tensors are first met (layer by layer, parameters before
            buffers).
    """

    locks: list[Optional[threading.Lock]]
    buffer_deps: list[list[int]]
    stage_bytes: list[int]
    grad_numels: list[list[int]]


def shared_modules(layers: Sequence[nn.Module], stages: Sequence[Stage],
                   trainable: Collection[int]) -> SharedModules:
    """The locks, buffer dependencies and per-stage sizes of a pipeline over ``layers`` cut
    into ``stages``; ``trainable`` holds the ``id`` of every trainable parameter (those with
    an optimizer copy). A pure function of its arguments: it reads the modules, changes
    nothing (each call makes new locks)."""
    stage_of = {li: st.index for st in stages for li in st.layers}
    users: dict[int, set[int]] = {}        # module id -> layers using it
    has_buffers: set[int] = set()
    for li, layer in enumerate(layers):
        for m in layer.modules():
            users.setdefault(id(m), set()).add(li)
            if any(b is not None for b in module_buffers(m).values()):
                has_buffers.add(id(m))
    group = list(range(len(layers)))  # union-find over layers sharing a module

    def find(a):
        while group[a] != a:
            group[a] = group[group[a]]
            a = group[a]
        return a

    deps: list[set[int]] = [set() for _ in stages]
    for mid, lis in users.items():
        shared = sorted({stage_of[li] for li in lis})
        if len(shared) < 2:
            continue
        first = min(lis)
        for li in lis:
            group[find(li)] = find(first)
        if mid in has_buffers:
            for s in shared[1:]:
                deps[s].update(e for e in shared if e < s)
    roots = [find(li) for li in range(len(layers))]
    locks = {r: threading.Lock() for r in roots if roots.count(r) > 1}
    stage_bytes, grad_numels = [], []
    for st in stages:
        seen: dict[int, torch.Tensor] = {}
        for li in st.layers:
            for t in list(layers[li].parameters()) + list(layers[li].buffers()):
                seen[id(t)] = t
        stage_bytes.append(sum(t.numel() * t.element_size() for t in seen.values()))
        grad_numels.append([t.numel() for t in seen.values() if id(t) in trainable])
    return SharedModules([locks.get(r) for r in roots], [sorted(d) for d in deps], stage_bytes,
                         grad_numels)


def default_device() -> torch.device:
    """The first CUDA device when one is available, else the CPU. Called at construction, never
    at import, so importing roundpipe does not initialise CUDA."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


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
