"""Shared fixtures: the golden reference (tests/data/reference), the real sample MRI volumes (outside the
clone, skipped when absent) and tiny models.

The suite runs on one CPU thread, here and in every command a test starts: on a 2-core box shared with other
work, two OpenMP threads spin-wait for each other (a 16³ training step of the tiny model took 4 to 8 s on two
threads, 0.2 s on one); on an idle box the test-sized tensors gain little from a second thread.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "data" / "reference"
# The Med-DDPM repository's sample volumes (GPL v3) stay out of the clone; CI keeps them in ../shared/data.
SAMPLE_DATA_ENV = "MED_DDPM_SAMPLE_DATA"
SAMPLE_DATA = Path(os.environ.get(SAMPLE_DATA_ENV) or REPO.parent / "shared" / "data")
WHOLE_HEAD = SAMPLE_DATA / "whole_head"
NO_SAMPLE_DATA = (f"the real sample MRI volumes are not at {WHOLE_HEAD}: set {SAMPLE_DATA_ENV} to the folder "
                  "holding whole_head/ (the Med-DDPM repository's dataset/)")

# torch's own choice (the CPU's cores, or $OMP_NUM_THREADS), kept in the environment for pytest-xdist's workers,
# which start with the OMP_NUM_THREADS=1 set below
TORCH_THREADS = int(os.environ.setdefault("TESTS_TORCH_THREADS", str(torch.get_num_threads())))
os.environ["OMP_NUM_THREADS"] = "1"  # the commands the tests start read it when torch loads
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def whole_head_data() -> Path:
    """The real whole-head sample (``image/``, ``mask/``); a test using it is skipped, always with the one reason
    :data:`NO_SAMPLE_DATA`, where it is absent."""
    if not WHOLE_HEAD.is_dir():
        pytest.skip(NO_SAMPLE_DATA)
    return WHOLE_HEAD


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """The original-format checkpoint and the original code's tensors (tests/data/reference/README.md)."""
    return REFERENCE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def torch_threads():
    """torch's own thread count for a module whose bit-exact or 1e-4 comparisons hold in the summation order it
    gives: one thread sums convolutions in another order (the dense_conv_grads contract then differs by 2e-10, the
    parity chain's first step by 1.1e-4)."""
    torch.set_num_threads(TORCH_THREADS)
    yield
    torch.set_num_threads(1)


WANDB_WRITE_S = 30.0  # how long W&B's service may take to write a finished run's file


def wandb_records(data: bytes) -> tuple[list[bytes], bool]:
    """The records of a ``run-<id>.wandb`` file's bytes, and whether they end where a record ends: the file is W&B's
    LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB blocks of chunks, each a 7-byte header: CRC32C, length,
    type 1 full / 2 first / 3 middle / 4 last; a block's tail too short for a header is padding)."""
    import struct

    pos, block, chunks, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            return records, False
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(chunks)
            chunks = b""
    return records, not chunks


def wandb_run(records: list[bytes]) -> dict | None:
    """A run read from its records with W&B's own record protobuf, at its ``exit`` record (the last W&B writes);
    None when the records hold none."""
    import json

    from wandb.proto import wandb_internal_pb2

    def items(update) -> dict:
        return {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in update}

    run: dict = {"config": {}, "summary": {}, "exit_code": None}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(id=r.run_id, name=r.display_name, group=r.run_group, job_type=r.job_type)
            run["config"].update(items(r.config.update))
        elif kind == "config":
            run["config"].update(items(record.config.update))
        elif kind == "summary":
            run["summary"].update(items(record.summary.update))
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
            return run
    return None


def finished_wandb_run(run_dir: Path) -> dict | None:
    """The run of an ``offline-run-*`` folder once its ``run-<id>.wandb`` file holds the whole run; None before."""
    files = list(run_dir.glob("run-*.wandb"))
    records, whole = wandb_records(files[0].read_bytes()) if len(files) == 1 else ([], False)
    return wandb_run(records) if whole else None


def read_wandb_runs(folder: Path, wait_s: float = WANDB_WRITE_S) -> list[dict]:
    """Every offline W&B run under ``folder`` (its ``offline-run-*`` folders in order): its id, name, group, job_type,
    config and summary (JSON values) and exit code.

    ``Run.finish()`` returns before the run's file is written: W&B's service keeps the file's last 32 KiB block in
    memory until it closes the run, on a request ``finish()`` sends without waiting. So each run is read again until
    its file holds the ``exit`` record, for up to ``wait_s`` seconds, then refused."""
    import time

    runs = []
    for run_dir in sorted(p for p in folder.rglob("offline-run-*") if p.is_dir()):
        deadline = time.monotonic() + wait_s
        while (run := finished_wandb_run(run_dir)) is None:
            assert time.monotonic() < deadline, f"{run_dir}: no finished W&B run file after {wait_s:g} s"
            time.sleep(0.05)
        runs.append(run)
    return runs


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """W&B offline, its settings, cache and data folders in the test's tmp_path (nothing reaches the network or
    $HOME), here and in the commands a test starts; returns :func:`read_wandb_runs`."""
    home = tmp_path / "wandb_home"
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("WANDB_DIR", str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return read_wandb_runs
