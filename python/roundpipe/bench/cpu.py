"""The machine a benchmark ran on, for its header: the CPU's vendor and model, and the kernels'
machine-dependent choices (ISA, prefetch distance)."""

from __future__ import annotations

import pathlib
import platform


def _cpuinfo(*keys: str) -> str | None:
    """The first value of any of ``keys`` in /proc/cpuinfo (Linux), else None."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys and value.strip():
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    return (_cpuinfo("model name", "Model", "Hardware") or platform.processor()
            or platform.machine() or "unknown CPU")


def cpu_vendor() -> str:
    """The CPU's vendor as the CPU reports it (x86: ``GenuineIntel``, ``AuthenticAMD``; Arm:
    ``CPU implementer 0x41``), or ``unknown vendor``."""
    vendor = _cpuinfo("vendor_id")
    if vendor:
        return vendor
    implementer = _cpuinfo("CPU implementer")
    return f"CPU implementer {implementer}" if implementer else "unknown vendor"


def describe_prefetch(choice: dict) -> str:
    """``roundpipe.optim.prefetch_choice()`` in words: the distance, how it was chosen and, once
    calibrated, each candidate's median time relative to its round's."""
    text = f"{choice['bytes']} B ahead ({choice['source']}"
    if choice["relative_time"]:
        text += "; relative time per candidate: " + ", ".join(
            f"{c} B {r:.3f}" for c, r in zip(choice["candidates"], choice["relative_time"]))
        text += f"; {choice['rounds']} rounds"
    return text + ")"
