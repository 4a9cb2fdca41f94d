"""Atomic writes and the results-line append survive interrupted writers; json_safe output is strict JSON."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from med_ddpm.utils import append_line, atomic_write_text, json_safe


def test_append_after_a_killed_writer_keeps_the_next_row(tmp_path):
    path = tmp_path / "results.jsonl"
    append_line(path, '{"a": 1}')
    with open(path, "a") as f:
        f.write('{"a": 2, "trunc')  # a writer killed mid-line
    append_line(path, '{"a": 3}')
    assert path.read_text().splitlines() == ['{"a": 1}', '{"a": 2, "trunc', '{"a": 3}']


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path):
    path = tmp_path / "report.md"
    atomic_write_text(path, "old")

    def broken(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    from med_ddpm.utils import atomic_write

    with pytest.raises(RuntimeError):
        atomic_write(path, broken)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["report.md"]
    assert stat.S_IMODE(path.stat().st_mode) & 0o044  # not mkstemp's 0600


def test_json_safe_writes_strict_json_that_reads_back():
    safe = json_safe({1: (np.float32(0.5), float("inf")), "n": np.int64(3), "x": float("nan")})
    assert json.loads(json.dumps(safe, allow_nan=False)) == {"1": [0.5, "inf"], "n": 3, "x": "nan"}
