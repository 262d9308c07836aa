"""Starts the processes of the multi-process tests: N ranks of a script in tests/ as torchrun
would start them (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment, on this machine), bounded by a timeout,
and the environment of any child interpreter that imports the helpers of tests/ (tests/ on its
``PYTHONPATH``: no test edits ``sys.path``).

The rank scripts are tests/distributed_ranks.py (tests/test_distributed.py,
tests/test_checkpoint_compact.py) and tests/trainer_ranks.py (tests/test_trainer_distributed.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


def child_env(**extra: str) -> dict:
    """``os.environ`` plus ``extra``, with tests/ first on ``PYTHONPATH``: a child interpreter
    (``python -c CODE``, a rank script) imports ``pipeline_models``, ``conftest``, ... as the
    tests do."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, world: int, *args, timeout: float = 300, env: dict | None = None,
           omp_threads: str | None = "1") -> list[subprocess.CompletedProcess]:
    """Starts ``world`` ranks of ``tests/<script>`` with the command-line ``args`` and waits for
    all of them.

    Args:
        script: the file name of the rank script in tests/.
        world: the number of ranks (``WORLD_SIZE``; all local: ``LOCAL_WORLD_SIZE`` too).
        args: its command-line arguments (converted with ``str``).
        timeout: seconds for all ranks together; past it every rank is killed and the test
            fails, naming the script and its arguments (a hang).
        env: more environment variables.
        omp_threads: ``OMP_NUM_THREADS`` of each rank (None: as this process's environment).

    Returns:
        One ``CompletedProcess`` per rank, in rank order (``returncode``, ``stdout``,
        ``stderr`` as text).
    """
    base = child_env(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **(env or {}))
    if omp_threads is not None:
        base["OMP_NUM_THREADS"] = omp_threads
    command = [sys.executable, os.path.join(TESTS, script), *map(str, args)]
    procs = [subprocess.Popen(command, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{script} {' '.join(map(str, args))}: ranks still running after "
                    f"{timeout} s (hang)")
    return results
