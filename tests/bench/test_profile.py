"""bench.profile's record: on a CPU one event per operator call, so the top table counts the calls per step; and
every record carries its run, commit and environment."""

from __future__ import annotations

import re

import torch
from hydra import compose, initialize_config_dir

from bench import profile
from bench.core import kernels
from bench.core.records import RUN_ID_ENV, provenance
from bench.core.runner import job_spec
from med_ddpm.cli import CONFIG_DIR

STEPS = 3


def profiled_convolutions() -> torch.profiler.profile:
    """``STEPS`` steps of two 3-D convolutions each, profiled on the CPU."""
    conv, x = torch.nn.Conv3d(1, 1, 3), torch.randn(1, 1, 6, 6, 6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        for _ in range(STEPS):
            conv(conv(x))
    return prof


def tiny_job() -> dict:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["model=tiny", "device=cpu", f"profile.steps={STEPS}"])
    return job_spec(cfg, "tiny")


def test_cpu_events_count_every_operator_call_and_the_table_shows_calls_per_step(monkeypatch) -> None:
    """key_averages() has one entry per operator, which read as one call each; the events have one per call."""
    monkeypatch.setenv(RUN_ID_ENV, "run-test")
    events = profile._cpu_events(profiled_convolutions())
    assert kernels.aggregate(events)[1]["aten::conv3d"] == 2 * STEPS
    record = profile.summarise(events, tiny_job(), torch.device("cpu"))
    (conv,) = [k for k in record["top"] if k["name"] == "aten::conv3d"]
    assert conv["calls"] == 2 * STEPS and record["steps"] == STEPS
    assert re.search(r"\| `aten::conv3d` \| convolution \|  \| 2 \| \d+\.\d{3} \|", kernels.markdown([record]))


def test_a_record_carries_its_run_commit_and_environment(monkeypatch) -> None:
    monkeypatch.setenv(RUN_ID_ENV, "run-test")
    record = profile.summarise([("aten::silu", 5.0)], tiny_job(), torch.device("cpu"))
    assert record["run_id"] == "run-test"
    assert {k: record[k] for k in ("git_sha", "dirty")} == provenance()
    assert record["env"]["device"] == "cpu" and record["env"]["torch"] == torch.__version__
    note = profile.provenance_note([record])
    assert note.startswith("Provenance: All profiles come from one run (run-test). Same commit for all: ")
    assert note.endswith("Same GPU for all: no GPU (device cpu).\n")
