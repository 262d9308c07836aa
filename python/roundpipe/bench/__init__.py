"""Benchmarks: ``python -m roundpipe.bench --help``."""
