"""``python -m roundpipe.bench long`` runs end to end at a short sequence (its figures are not
asserted here: tests/test_long_sequences.py holds the memory per token flat in the sequence
with counted bytes)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_long_sequence_rows_run():
    """One RoundPipe cell, no transformers cell (``--transformers-at`` with no length)."""
    r = subprocess.run([sys.executable, "-m", "roundpipe.bench", "long", "--seq", "128",
                        "--shapes", "padded", "--layers", "1", "--transformers-at"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| sequence | padded |" in r.stdout
    assert "| 128 |" in r.stdout and "transformers sdpa" not in r.stdout
