"""``tuned=auto``: the newest passing ``sampler.yaml`` of the checkpoint's weights beside it is used and named; a
failed, edited or foreign one is passed over with its reason; ``med_ddpm.tune install=true`` puts it there."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from med_ddpm.samplers.tuned import file_sha256, install, read_tuned, use_tuned, write_tuned

GRID = {"name": "dpm_solver_pp", "steps": 3, "timesteps": [9, 5, 1]}


def sealed(path: Path, checkpoint: Path, verdict: str = "pass", calls: int = 3) -> Path:
    record = {"sampler": {**GRID, "steps": calls}, "calls": calls, "verdict": verdict,
              "gate": {"statistics": {"reasons": ["x0_nrmse -> fail"]}},
              "checkpoint": {"path": str(checkpoint), "sha256": file_sha256(checkpoint), "weights": "ema"},
              "recipe": {}}
    return write_tuned(path, record)


def cfg_for(checkpoint: Path):
    return OmegaConf.create({"tuned": "auto", "checkpoint": str(checkpoint), "weights": "ema", "recipe": None,
                             "sampler": {"name": "ddpm", "steps": 250}})


@pytest.fixture
def run(tmp_path) -> Path:
    """A training run's folder: ``checkpoints/last.pt`` (any bytes: only their hash counts here)."""
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.pt").write_bytes(b"weights")
    return tmp_path / "run"


def test_a_passing_file_beside_the_checkpoint_is_used_and_named(run, caplog):
    checkpoint = run / "checkpoints" / "last.pt"
    found = sealed(run / "sampler.yaml", checkpoint)  # the run's output_dir, above checkpoints/
    cfg = cfg_for(checkpoint)
    with caplog.at_level(logging.INFO, "med_ddpm.samplers.tuned"):
        use_tuned(cfg)
    assert cfg.tuned == str(found) and cfg.sampler.steps == 3 and str(found) in caplog.text


@pytest.mark.parametrize(("spoil", "why"), [
    ("fail", "its gate verdict is fail"),
    ("edited", "edited since med_ddpm.tune wrote it"),
    ("foreign", "tuned for the ema weights of"),
])
def test_a_failed_edited_or_foreign_file_is_passed_over_in_one_line(run, tmp_path, caplog, spoil, why):
    checkpoint = run / "checkpoints" / "last.pt"
    other = tmp_path / "other.pt"
    other.write_bytes(b"other weights")
    path = sealed(run / "checkpoints" / "sampler.yaml", other if spoil == "foreign" else checkpoint,
                  "fail" if spoil == "fail" else "pass")
    if spoil == "edited":
        path.write_text(path.read_text().replace("- 5", "- 6"))
    cfg = cfg_for(checkpoint)
    with caplog.at_level(logging.INFO, "med_ddpm.samplers.tuned"):
        use_tuned(cfg)
    assert cfg.tuned is None and cfg.sampler.steps == 250  # the configured sampler
    (line,) = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert why in line and "\n" not in line
    assert "no passing sampler.yaml" in caplog.text


def test_of_several_passing_files_the_newest_is_used_and_named(run, caplog):
    checkpoint = run / "checkpoints" / "last.pt"
    old = sealed(run / "sampler.yaml", checkpoint, calls=3)
    new = sealed(run / "checkpoints" / "sampler.yaml", checkpoint, calls=2)
    os.utime(old, ns=(2_000_000_000_000_000_000, 2_000_000_000_000_000_000))
    os.utime(new, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))  # old is newer now
    cfg = cfg_for(checkpoint)
    with caplog.at_level(logging.INFO, "med_ddpm.samplers.tuned"):
        use_tuned(cfg)
    assert cfg.tuned == str(old) and cfg.sampler.steps == 3
    assert f"the newest: {old}" in caplog.text


def test_install_puts_a_sealed_copy_beside_the_checkpoint(run, tmp_path):
    checkpoint = run / "checkpoints" / "last.pt"
    tuned = sealed(tmp_path / "tune_out" / "sampler.yaml", checkpoint)
    installed = install(tuned, checkpoint)
    assert installed == checkpoint.parent / "sampler.yaml" and read_tuned(installed) == read_tuned(tuned)
    cfg = cfg_for(checkpoint)
    use_tuned(cfg)
    assert cfg.tuned == str(installed)
