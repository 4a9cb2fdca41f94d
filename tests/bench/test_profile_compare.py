"""bench.profile profile.compare: named columns, the first-to-last change, notes, and errors naming the file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import kernels
from bench.profile import load_named, write_comparison
from med_ddpm.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _profile(path, label: str, conv_ms: float, note: str | None = None):
    cats = dict.fromkeys(kernels.CATEGORY_NAMES, 0.0) | {"convolution": conv_ms, "normalisation": 1.0}
    record = {"label": label, "scenario": "denoise_step", "batch_size": 1, "activity": "GPU kernels", "steps": 1,
              "categories_ms": cats, "total_ms": sum(cats.values()), "tensor_core_share": 0.5,
              "top": [{"name": "sm90_xmma_fprop_bf16", "time_us": conv_ms * 1e3, "share": 0.9, "calls": 1,
                       "category": "convolution", "tensor_core": True, "launched_by": ""}]}
    if note:
        record["note"] = note
    path.write_text(json.dumps(record))
    return path


def test_same_stack_at_two_commits_gets_named_columns_and_the_change(tmp_path) -> None:
    a = _profile(tmp_path / "a.json", "amp_bf16+compile", 12.0)
    b = _profile(tmp_path / "b.json", "amp_bf16+compile", 9.5, note="corrected after the run")
    cmd = [sys.executable, "-m", "bench.profile", f"profile.compare={{before: {a}, after: {b}}}",
           f"profile.out={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / "out" / "profile_compare.md").read_text()
    assert "| category | before | after |" in text
    assert "| convolution | 12.000 | 9.500 | -2.500 |" in text
    assert "| **total** | **13.000** | **10.500** | **-2.500** |" in text
    assert "- **after**: `amp_bf16+compile`, denoise_step, batch 1" in text
    assert "- after: corrected after the run" in text
    assert (tmp_path / "out" / "profile_compare.png").stat().st_size > 1000


def test_bad_input_names_the_file(tmp_path) -> None:
    good = _profile(tmp_path / "a.json", "fp32", 1.0)
    (tmp_path / "rows.json").write_text(json.dumps({"ms_median": 1.0}))
    with pytest.raises(ConfigError, match=r"^profile\.compare\.b=.*rows\.json: not a bench\.profile record"):
        load_named({"a": str(good), "b": str(tmp_path / "rows.json")})
    with pytest.raises(ConfigError, match=r"^profile\.compare\.b=.*missing\.json: cannot read \(No such file"):
        load_named({"a": str(good), "b": str(tmp_path / "missing.json")})
    with pytest.raises(SystemExit, match="two or more"):
        load_named({"a": str(good)})
    assert write_comparison(tmp_path / "o", load_named({"x": str(good), "y": str(good)})).name == "profile_compare.md"
