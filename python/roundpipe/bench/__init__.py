"""Benchmarks: ``python -m roundpipe.bench`` (optimizer steps, :mod:`.optim`),
``python -m roundpipe.bench pipeline`` (RoundPipe training, :mod:`.pipeline`) and
``python -m roundpipe.bench overhead`` (the fixed cost of a call, :mod:`.overhead`).

Every figure they print is the median over at least five interleaved repeats (each round runs
every contender once, in rotated order) with its min-max range; a ratio is computed per round
(both sides measured in the same round) and called "within noise" when its range includes 1.
Each prints the threads it runs with: torch's intra-op threads, the ``roundpipe.optim`` pool,
RoundPipe's device workers.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence


def write_json(path: str, result: Any) -> None:
    """Saves a benchmark's ``result`` (its configuration and every repeat's values) as JSON
    at ``path`` (``--json``) and says so."""
    import json

    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def writable_path(text: str) -> str:
    """argparse type: a file path whose folder exists (checked before a long run)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist")
    return text


# --- measuring: interleaved repeats, medians with their min-max range -------------------------

MIN_REPEATS = 5


def repeats_arg(text: str) -> int:
    """argparse type: the number of interleaved repeats, at least :data:`MIN_REPEATS` (a median
    and a min-max range over fewer rounds would tell little about the noise)."""
    value = positive_int(text)
    if value < MIN_REPEATS:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_REPEATS} repeats, got {value}")
    return value


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def thread_plan(threads: int, workers: int, cuda: bool) -> dict:
    """The CPUs each part gets: on CPU devices the W workers share ``threads`` (threads // W
    torch intra-op threads each, at least 1) and the torch reference, which runs alone, gets
    them all; on CUDA the host side of both gets them all. The roundpipe.optim pool gets them
    all (its steps overlap the workers in the async and exact modes)."""
    per_worker = threads if cuda else max(1, threads // workers)
    return {"cpus_available": available_cpus(), "threads_arg": threads,
            "device_workers": workers, "torch_per_worker": per_worker,
            "torch_reference": threads, "roundpipe_pool": threads}


@dataclass(frozen=True)
class Figure:
    """A measured quantity over interleaved repeats: the median and the min-max range of its
    per-repeat values (compute a derived quantity, tokens/s or a ratio, per repeat first)."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Figure":
        if not samples:
            raise ValueError("Figure.of: no samples")
        return cls(statistics.median(samples), min(samples), max(samples))

    @property
    def spread(self) -> float:
        """(max - min) / median: the range relative to the median (0 for a zero median)."""
        return (self.high - self.low) / self.median if self.median else 0.0

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high}

    @classmethod
    def from_dict(cls, d: dict) -> "Figure":
        """The inverse of :meth:`as_dict` (e.g. a figure read back from the JSON)."""
        return cls(d["median"], d["min"], d["max"])

    def text(self, digits: int = 1, unit: str = "") -> str:
        """``median<unit> (min-max)``."""
        return (f"{self.median:.{digits}f}{unit} ({self.low:.{digits}f}-"
                f"{self.high:.{digits}f})")


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> Figure:
    """``a[i] / b[i]`` per repeat (measured in the same round, so slow drift of the machine
    hits both), as a :class:`Figure`."""
    return Figure.of([x / y for x, y in zip(a, b)])


def compare(ratio: Figure, what: str) -> str:
    """``1.23x <what> (1.10-1.31 over the repeats)``, and ``: within noise`` when the range of
    the per-repeat ratios includes 1 (the two differ by less than their spread)."""
    text = f"{ratio.median:.2f}x {what} ({ratio.low:.2f}-{ratio.high:.2f} over the repeats)"
    return text + (": within noise" if ratio.contains(1.0) else "")


def interleave(contenders: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list]:
    """Runs every contender once per round, ``repeats`` rounds, rotating which goes first, so
    the machine's drift and the cache state after the previous contender hit all alike.
    Returns each contender's results (what it returned), in round order."""
    results: dict[str, list] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(repeats):
        for k in names[r % len(names):] + names[: r % len(names)]:
            results[k].append(contenders[k]())
    return results


def timed(fn: Callable[[], Any]) -> Callable[[], float]:
    """``fn`` as a contender returning its wall time in seconds."""
    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return run


def human(n: float) -> str:
    """An element count as in the layout names: 50M, 250k, 1k, 12.5k, 7."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:g}"
