"""bench.ladder preset=quality_128: gates without timings, each row naming the timed 128^3 workload it judges, resumed
by the same command; its stack gates share one reference, its sampler gates another."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from bench.core import presets
from bench.core.records import RESULTS_FILE, read_rows
from bench.core.runner import compose_job
from bench.core.worker import base_row
from bench.quality import gates
from bench.reporting.evidence import choose_run
from bench.reporting.verdicts import row_stack
from med_ddpm.quality import probe

ROOT = Path(__file__).resolve().parents[2]
IDENTITY = ("scenario", "image_size", "sampler", "steps")
JUDGES = {"stack.fast_sample": "fast_sampler.shipped", "stack.torch_defaults": "fast_sampler.torch_defaults",
          "sampler.fast_sample": "fast_sampler.shipped", "sampler.ddpm250": "ddpm250.shipped"}


def options(**more):
    return OmegaConf.create({"preset": "quality_128", "checkpoint": "/tmp/w/last.pt", "tuned": None, "only": None,
                             **more})


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    out = tmp_path_factory.mktemp("jobs")
    return {j.name: compose_job(j.overrides, out / j.name) for j in presets.jobs("quality_128", options())}


def test_each_gate_row_names_the_timed_workload_it_judges(specs):
    timed = choose_run(ROOT / "bench" / "results" / "h100", [])
    for name, job in JUDGES.items():
        row, want = base_row(specs[name]), timed.ok(job)
        assert {k: row[k] for k in IDENTITY} == {k: want[k] for k in IDENTITY}, name
        assert row_stack(row) == row_stack(want), name  # the stack, options that change no numerics aside
        assert specs[name]["config"]["model"] == want["config"]["model"], name


def test_the_stack_gates_share_one_reference_on_fast_samples_sampler(specs):
    stacks = [specs[n]["config"] for n in specs if n.startswith("stack.")]
    assert len(stacks) == 3 and all(c["quality"]["reference_sampler"] == "same" for c in stacks)
    assert all(c["sampler"] == stacks[0]["sampler"] for c in stacks), "one sampler node: one cached reference"
    assert stacks[0]["sampler"]["name"] == "dpm_solver_pp" and stacks[0]["sampler"]["steps"] == 100
    samplers = [specs[n]["config"] for n in specs if n.startswith("sampler.")]
    assert all(c["quality"]["reference_sampler"] is None for c in samplers)
    cfgs = [*stacks, *samplers]
    assert {(c["seed"], c["quality"]["n_samples"], c["quality"]["batch_size"]) for c in cfgs} == {(1, 32, 8)}
    assert {c["quality"]["cache_dir"] for c in cfgs} == {"/tmp/w/gate_cache"}


def test_the_tuned_grid_is_gated_once_med_ddpm_tune_wrote_it(tmp_path):
    assert "sampler.tuned" not in {j.name for j in presets.jobs("quality_128", options())}
    tuned = tmp_path / "sampler.yaml"
    tuned.write_text("sampler: {name: dpm_solver_pp, order: 2, variant: sde, spacing: trailing, steps: 3,\n"
                     "          timesteps: [249, 120, 1]}\ncalls: 3\n")
    job = {j.name: j for j in presets.jobs("quality_128", options(tuned=str(tuned)))}["sampler.tuned"]
    cfg = compose_job(job.overrides, tmp_path / "job")["config"]
    assert cfg["sampler"]["timesteps"] == [249, 120, 1] and cfg["sampler"]["steps"] == 3
    assert cfg["quality"]["reference_sampler"] is None and cfg["recipe"]  # the shipped stack vs DDPM-250


def test_a_cut_run_is_finished_by_the_same_command_and_a_failed_gate_runs_again(tmp_path, monkeypatch):
    tiny = ["experiment=bench_smoke", "diffusion.timesteps=4", "sampler.steps=4", "quality.n_samples=16",
            "quality.n_masks=4", "bench=full_sample", "bench.quality=true", f"quality.cache_dir={tmp_path}/cache"]
    jobs = [presets.PresetJob("a", [*tiny, "recipe=[]"]), presets.PresetJob("b", [*tiny, "recipe=[channels_last_3d]"])]
    monkeypatch.setattr(presets, "jobs", lambda preset, cfg: jobs)
    cfg = options(out=str(tmp_path / "out"), budget_s=0, dry_run=False)
    assert gates.run(cfg) == 2 and not (tmp_path / "out" / RESULTS_FILE).exists(), "no budget: nothing started"
    real, calls = probe.gate_from_config, []

    def failing_once(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(*args, **kw)

    monkeypatch.setattr(gates, "gate_from_config", failing_once)
    cfg.budget_s = None
    assert gates.run(cfg) == 1
    rows = read_rows(tmp_path / "out" / RESULTS_FILE)
    assert [(r["job_name"], r["status"]) for r in rows] == [("a", "ok"), ("b", "oom")]
    assert rows[0]["quality"]["verdict"] == "pass" and rows[0]["scenario"] == "full_sample"
    assert gates.run(cfg) == 0 and len(calls) == 3, "only the failed gate ran again"


def test_the_gpu_plan_takes_its_minutes_from_the_committed_h100_rows():
    """docs/results/h100.md, "The 128³ quality model's plan": each figure is N (or the steps) times a committed row's
    time, and the stages' calls hold at most a call's work."""
    from hydra import compose, initialize_config_dir

    from med_ddpm.model import build_model

    page = (ROOT / "docs" / "results" / "h100.md").read_text()
    section = page.split("## The 128³ quality model's plan")[1].split("\n## ")[0]
    run = choose_run(ROOT / "bench" / "results" / "h100", [])
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=quality_model_128", "output_dir=x"])
    per_volume = {job: run.ms_per_volume(job) / 60_000 for job in
                  ("ddpm250.strict_fp32", "fast_sampler.strict_fp32", "fast_sampler.shipped",
                   "fast_sampler.torch_defaults", "ddpm250.shipped")}
    train = f"{cfg.train.max_steps * run.ms('train_step.shipped') / 60_000:.1f} + compile"
    card = f"{16 * per_volume['ddpm250.strict_fp32']:.1f}"
    tune = f"{32 * per_volume['ddpm250.strict_fp32']:.1f} + the search"
    gates = " + ".join(f"{32 * per_volume[j]:.1f}" for j in ("fast_sampler.strict_fp32", "fast_sampler.shipped",
                                                             "fast_sampler.shipped", "fast_sampler.torch_defaults",
                                                             "fast_sampler.shipped", "ddpm250.shipped"))
    for figure in (train, card, tune, gates):
        assert f"| {figure} |" in section, figure
    assert "| 1-3 | `python -m med_ddpm.train experiment=quality_model_128" in section
    params = sum(p.numel() for p in build_model(OmegaConf.to_container(cfg.model)).parameters())
    assert f"({params / 1e6:.1f} M parameters, {cfg.train.max_steps} steps)" in section
