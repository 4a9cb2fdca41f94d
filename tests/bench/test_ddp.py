"""bench.ddp under a 2-process CPU torchrun: one results row with per-rank times and scaling efficiency."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.core.records import MEASURED_FIELDS, read_rows

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model=tiny", "model.image_size=[16,16,16]", "model.channel_mult=[1,2]", "model.attention_ds=[2]",
         "device=cpu", "train.grad_accum=1"]


@pytest.mark.slow
def test_ddp_bench_writes_a_scaling_row(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "bench.ddp",
           f"ddp.out={tmp_path}", "ddp.warmup=0", "ddp.iters=2", "ddp.baseline=2.0", *SMALL]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = read_rows(tmp_path)
    assert row["scenario"] == "ddp_train_step" and row["status"] == "ok" and row["world_size"] == 2
    assert set(MEASURED_FIELDS) <= row.keys() and len(row["ms_median_per_rank"]) == 2
    assert row["volumes_per_s"] == pytest.approx(2 * row["volumes_per_s_per_gpu"])
    assert row["scaling_efficiency"] == pytest.approx(row["volumes_per_s"] / (2 * 2.0))
    assert row["baseline_source"] == "ddp.baseline"
    assert row["env"]["torch"] and row["config"]["train"]["batch_size"] == 1


def test_rows_record_recipe_options_and_baselines_match_them(tmp_path):
    """Two stacks that differ only in an option are two workloads; a row from before options were recorded
    is the baseline of a stack without options only."""
    from hydra import compose

    from bench.core.records import append_row
    from bench.ddp import base_row, baseline_volumes_per_s
    from med_ddpm import cli

    with cli.configs():
        plain_cfg, device_cfg = (compose("ddp", overrides=[*SMALL, "recipe=[fused_adam]", *extra])
                                 for extra in ([], ["recipe.fused_adam.guard=device"]))
        plain, guarded = base_row(plain_cfg, "tiny", 1), base_row(device_cfg, "tiny", 1)
    assert plain["scenario"] == "ddp_train_step" and plain["world_size"] == 1 and plain["grad_accum"] == 1
    assert plain["batch_size"] == plain_cfg.train.batch_size and plain["sampler"] is None and plain["message"] == ""
    assert plain["recipe_options"] == [] and guarded["recipe_options"] == ['fused_adam.guard="device"']
    old = {k: v for k, v in plain.items() if k != "recipe_options"}  # a row written before this field existed
    append_row(tmp_path / "results.jsonl", old | {"status": "ok", "volumes_per_s": 3.0})
    value, source = baseline_volumes_per_s(tmp_path / "results.jsonl", plain)
    (written,) = read_rows(tmp_path / "results.jsonl")
    assert value == 3.0 and source == {"run_id": written["run_id"], "git_sha": written["git_sha"]}  # another launch
    assert baseline_volumes_per_s(tmp_path / "results.jsonl", guarded) == (None, None)


@pytest.mark.e2e
def test_a_bad_option_is_one_line_before_any_rank_builds(tmp_path):
    """The training command's checks run first: a size the U-Net cannot take is one line and exit 2, not a
    traceback per rank and an error row each."""
    cmd = [sys.executable, "-m", "bench.ddp", f"ddp.out={tmp_path}", *SMALL, "model.image_size=[15,16,16]"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: model.image_size=[15, 16, 16]: not divisible by 2 on every side, as channel_mult [1, 2] has 2 levels "
        "(2^(levels-1)); pass e.g. model.image_size=[16,16,16]"]
    assert not (tmp_path / "results.jsonl").exists()
