"""bench.profile profile.compare: named columns, the first-to-last change, notes, each profile's commit and GPU with
whether they come from one run, and one-line errors naming the option or the file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.core import kernels
from bench.profile import load_named, write_comparison
from med_ddpm.config_checks import ConfigError

REPO = Path(__file__).resolve().parents[2]
TUNING = REPO / "bench" / "results" / "h200" / "tuning"
FIX = r"pass profile\.compare=\{NAME: PROFILE\.json, NAME2: PROFILE2\.json\}$"


def _profile(path, label: str, conv_ms: float, note: str | None = None, **origin):
    """A saved GPU profile; ``origin``: the run_id, git_sha, dirty and env that bench.profile records."""
    cats = dict.fromkeys(kernels.CATEGORY_NAMES, 0.0) | {"convolution": conv_ms, "normalisation": 1.0}
    record = {"label": label, "scenario": "denoise_step", "batch_size": 1, "activity": "GPU kernels", "steps": 1,
              "categories_ms": cats, "total_ms": sum(cats.values()), "tensor_core_share": 0.5,
              "top": [{"name": "sm90_xmma_fprop_bf16", "time_us": conv_ms * 1e3, "share": 0.9, "calls": 1,
                       "category": "convolution", "tensor_core": True, "launched_by": ""}]}
    if note:
        record["note"] = note
    path.write_text(json.dumps(record | origin))
    return path


def _compare(tmp_path, value: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench.profile", f"profile.compare={value}", f"profile.out={tmp_path / 'out'}",
           f"hydra.run.dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def _origin(run: str, sha: str, gpu: str) -> dict:
    return {"run_id": run, "git_sha": sha * 40, "dirty": False, "env": {"device": "cuda", "gpu": gpu}}


@pytest.mark.e2e
def test_same_stack_at_two_commits_gets_named_columns_and_the_change(tmp_path) -> None:
    a = _profile(tmp_path / "a.json", "amp_bf16+compile", 12.0, **_origin("run-1", "a", "NVIDIA H200"))
    b = _profile(tmp_path / "b.json", "amp_bf16+compile", 9.5, note="corrected after the run",
                 **_origin("run-2", "b", "NVIDIA H100 80GB HBM3"))
    proc = _compare(tmp_path, f"{{before: {a}, after: {b}}}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / "out" / "profile_compare.md").read_text()
    assert "| category | before | after |" in text
    assert "| convolution | 12.000 | 9.500 | -2.500 |" in text
    assert "| **total** | **13.000** | **10.500** | **-2.500** |" in text
    assert (f"- **after**: `amp_bf16+compile`, denoise_step, batch 1, commit {'b' * 12}, NVIDIA H100 80GB HBM3, "
            f"run run-2 (`{b}`)") in text
    assert ("Provenance: The profiles come from separate runs: differences between them are between separately "
            f"profiled launches, not same-run comparisons. Commits differ: before {'a' * 12}, after {'b' * 12}. "
            "GPUs differ: before NVIDIA H200, after NVIDIA H100 80GB HBM3.") in text
    assert "## Change from before to after (separate runs, not a same-run comparison)" in text
    assert "- after: corrected after the run" in text
    assert (tmp_path / "out" / "profile_compare.png").stat().st_size > 1000


def test_profiles_of_one_run_say_so_and_name_their_shared_commit(tmp_path) -> None:
    origin = _origin("run-1", "c", "NVIDIA H200") | {"dirty": True}
    profiles = load_named({"x": str(_profile(tmp_path / "x.json", "fp32", 2.0, **origin)),
                           "y": str(_profile(tmp_path / "y.json", "tf32", 1.0, **origin))})
    text = write_comparison(tmp_path / "o", profiles).read_text()
    assert (f"Provenance: All profiles come from one run (run-1). Same commit for all: {'c' * 12}-dirty. "
            "Same GPU for all: NVIDIA H200.") in text
    assert "## Change from x to y\n" in text


def test_committed_profiles_without_provenance_say_it_was_not_recorded(tmp_path) -> None:
    """Profiles written before bench.profile recorded its commit, GPU and run still compare, and say so."""
    before, after = (next((TUNING / f"profile_channels_last_compiled_{c}").glob("denoise_step_*.json")) for c in ("d08bb6f", "895b99e"))
    text = write_comparison(tmp_path, load_named({"d08bb6f": str(before), "895b99e": str(after)})).read_text()
    assert "commit not recorded, GPU not recorded, run not recorded" in text
    assert ("Provenance: The profiles come from separate runs (or did not record theirs): differences between them "
            "are between separately profiled launches, not same-run comparisons. Commit not recorded for d08bb6f, "
            "895b99e. GPU not recorded for d08bb6f, 895b99e.") in text
    assert "## Change from d08bb6f to 895b99e (separate runs, not a same-run comparison)" in text


@pytest.mark.parametrize("value", [
    pytest.param("{a: PROFILE}", marks=pytest.mark.slow),  # its message: test_bad_input_names_the_file, in-process
    pytest.param("[PROFILE,PROFILE]", marks=pytest.mark.e2e)])
def test_one_entry_or_a_list_is_one_line_naming_the_option(tmp_path, value) -> None:
    """One NAME: PROFILE entry, or a list without names, ends in one line and exit 2, not a traceback."""
    good = _profile(tmp_path / "a.json", "fp32", 1.0)
    proc = _compare(tmp_path, value.replace("PROFILE", str(good)))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert re.fullmatch(r"error: profile\.compare: .*(names 1 profile, and a comparison needs two or more|is a list, "
                        r"not NAME: PROFILE\.json entries); " + FIX, lines[0]), lines[0]


def test_bad_input_names_the_file(tmp_path) -> None:
    good = _profile(tmp_path / "a.json", "fp32", 1.0)
    (tmp_path / "rows.json").write_text(json.dumps({"ms_median": 1.0}))
    with pytest.raises(ConfigError, match=r"^profile\.compare\.b=.*rows\.json: not a bench\.profile record"):
        load_named({"a": str(good), "b": str(tmp_path / "rows.json")})
    with pytest.raises(ConfigError, match=r"^profile\.compare\.b=.*missing\.json: cannot read \(No such file"):
        load_named({"a": str(good), "b": str(tmp_path / "missing.json")})
    with pytest.raises(ConfigError, match=r"^profile\.compare: \{'a': .*\} names 1 profile.*; " + FIX):
        load_named({"a": str(good)})
    with pytest.raises(ConfigError, match=r"^profile\.compare: b: 3 is not a file name; " + FIX):
        load_named({"a": str(good), "b": 3})
    assert write_comparison(tmp_path / "o", load_named({"x": str(good), "y": str(good)})).name == "profile_compare.md"
