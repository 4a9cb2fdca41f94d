"""Benchmark harness: the commands (``python -m bench.<name>``) at this level, their library in :mod:`bench.core`
(jobs, rows, timing, profiling), :mod:`bench.quality` (negative controls, the training-stack verdict) and
:mod:`bench.reporting` (the evidence pages)."""
