"""DDP on the CPU (gloo, 2 processes through torchrun): same weights as one big-batch process.

N ranks with batch b must equal one process with batch N·b because the data stream is one
global permutation split round-robin and every sample's t/ε is keyed by its global position;
a resume with another world size continues that stream; sampling writes each mask once.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from test_train import SMALL, cfg_for

from med_ddpm import distributed
from med_ddpm.checkpoint import read_checkpoint
from med_ddpm.sample import run as run_sample
from med_ddpm.train import EpochSampler, build, fit

REPO = Path(__file__).resolve().parents[2]
# Adam at lr 1e-3 with EMA from step 2: every piece of state moves; 3 volumes: batches cross epochs.
COMMON = ["train.grad_accum=2", "train.ema_start=2", "train.ema_every=1", "train.save_every=100",
          "data.num_volumes=3"]
STEPS = 4
TOL = {"rtol": 1e-5, "atol": 1e-6}


def torchrun(module: str, out: Path, *overrides: str, nproc: int = 2) -> str:
    """``torchrun --standalone --nproc_per_node=2 -m module`` on the CPU; returns stdout + stderr."""
    quiet = "train.progress=false" if module.endswith("train") else "progress=false"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *SMALL, quiet, f"hydra.run.dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # 2 shared cores: one thread per rank
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def assert_same_state(a: dict, b: dict) -> None:
    for entry in ("model", "ema"):
        for k in a[entry]:
            torch.testing.assert_close(a[entry][k], b[entry][k], **TOL, msg=f"{entry}.{k}")
    for i, state in a["optimizer"]["state"].items():
        torch.testing.assert_close(state["exp_avg"], b["optimizer"]["state"][i]["exp_avg"], **TOL)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    """2 ranks x batch 1 for STEPS steps; its last.pt."""
    out = tmp_path_factory.mktemp("ddp")
    torchrun("med_ddpm.train", out, *COMMON, f"train.max_steps={STEPS}", "train.batch_size=1")
    return out / "checkpoints" / "last.pt"


def test_ranks_split_one_global_stream():
    single = iter(EpochSampler(5, seed=3, start=4))
    ranks = [iter(EpochSampler(5, seed=3, start=4, rank=r, world_size=2)) for r in range(2)]
    interleaved = [next(ranks[k % 2]) for k in range(12)]
    assert interleaved == [next(single) for _ in range(12)]


def test_shard_and_keyed_draws_without_a_process_group():
    assert distributed.world_size() == 1 and distributed.is_main()
    assert distributed.shard([3, 4, 5]) == [3, 4, 5]
    a = torch.randn(3, generator=distributed.keyed_generator(torch.device("cpu"), 0, 7))
    b = torch.randn(3, generator=distributed.keyed_generator(torch.device("cpu"), 0, 7))
    assert a.equal(b) and not a.equal(torch.randn(3, generator=distributed.keyed_generator("cpu", 0, 8)))


@pytest.mark.slow  # two torchrun ranks, each a training command
def test_two_ranks_equal_one_process_with_the_global_batch(ddp_run, tmp_path):
    fit(build(cfg_for("train", tmp_path, *COMMON, f"train.max_steps={STEPS}", "train.batch_size=2")))
    single = read_checkpoint(tmp_path / "checkpoints" / "last.pt")
    ddp = read_checkpoint(ddp_run)
    assert single["step"] == ddp["step"] == STEPS and ddp["world_size"] == 2
    assert_same_state(single, ddp)


@pytest.mark.slow  # a second torchrun launch; the default suite keeps the 2-rank run against one process
def test_resume_with_another_world_size(ddp_run, tmp_path):
    fit(build(cfg_for("train", tmp_path, *COMMON, f"train.max_steps={STEPS // 2}", "train.batch_size=2")))
    log = torchrun("med_ddpm.train", tmp_path, *COMMON, f"train.max_steps={STEPS}", "train.batch_size=1",
                   "resume=auto")
    assert f"at step {STEPS // 2}" in log and "from a 1-rank checkpoint" in log
    assert_same_state(read_checkpoint(ddp_run), read_checkpoint(tmp_path / "checkpoints" / "last.pt"))


@pytest.mark.slow  # a torchrun launch of the sampling command
def test_two_rank_sampling_writes_each_mask_once(ddp_run, whole_head_data, tmp_path):
    masks = whole_head_data / "mask"
    args = [f"checkpoint={ddp_run}", f"masks={masks}", "sampler=ddim", "sampler.steps=2"]
    log = torchrun("med_ddpm.sample", tmp_path / "ddp", *args)
    wrote = Counter(Path(p).name for p in re.findall(r"wrote (\S+\.nii\.gz)", log))
    names = [f"sample_{i}.nii.gz" for i in range(4)]
    assert sorted(wrote) == names and set(wrote.values()) == {1}, wrote
    assert "4 samples" in log
    # each mask's noise is keyed by its index: one process writes the very same volumes
    for path in run_sample(cfg_for("sample", tmp_path / "single", *args)):
        np.testing.assert_allclose(nib.load(path).get_fdata(), nib.load(tmp_path / "ddp" / path.name).get_fdata(),
                                   atol=1e-6)
