"""bench.compare_profiles: named columns, the first-to-last change, notes, and errors naming the file."""

from __future__ import annotations

import json

import pytest

from bench import compare_profiles, kernels


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
    assert compare_profiles.main([f"out={tmp_path / 'out'}", f"before={a}", f"after={b}"]) == 0
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
    with pytest.raises(SystemExit, match="rows.json is not a bench.profile record"):
        compare_profiles.main([f"out={tmp_path}", f"a={good}", f"b={tmp_path / 'rows.json'}"])
    with pytest.raises(SystemExit, match="cannot read .*missing.json"):
        compare_profiles.main([f"out={tmp_path}", f"a={good}", f"b={tmp_path / 'missing.json'}"])
    with pytest.raises(SystemExit, match="usage"):
        compare_profiles.main([f"out={tmp_path}", f"a={good}"])
    with pytest.raises(SystemExit, match="bad argument"):
        compare_profiles.main([f"out={tmp_path}", "no-equals-sign", f"a={good}"])
