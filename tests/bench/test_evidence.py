"""preset=evidence: every row of the contract, each workload one identity across its stacks, the headline rows first,
the estimates within one device call; a dry run lists it on a CPU, a simulated V100 gets fp16 variants and
unsupported rows with reasons, a cut run names what is missing and the command that finishes it, one run id."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from bench import evidence, ladder
from bench.core.records import RESULTS_FILE, RUN_ID_ENV, append_row, baseline_key, read_rows
from bench.core.worker import base_row
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError

STACKS = ("strict_fp32", "torch_defaults", "shipped")
WORKLOADS = ("forward", "train_step", "ddpm250", "fast_sampler", "sampler25")
CONTRACT = [f"{w}.{s}" for w in WORKLOADS for s in STACKS] + [
    "e2e.sample4_cold", "e2e.sample4_warm", "e2e.sample4_warm_tuned25", "e2e.sample32_warm_tuned25",
    "e2e.train_first_step_warm", "e2e.train_steady",
    "brats.memory_train_step", "counters.strict_fp32", "counters.tf32_channels_last_3d", "counters.shipped"]
HEADLINE = {f"{w}.{s}" for w in ("forward", "train_step") for s in STACKS} | {
    "sampler25.shipped", "fast_sampler.shipped", "ddpm250.strict_fp32", "ddpm250.torch_defaults"}
V100 = ["gpu.name='Tesla V100-SXM2-16GB'", "gpu.capability=[7,0]", "gpu.memory_gib=15.8"]
H100 = ["gpu.name='NVIDIA H100 80GB HBM3'", "gpu.capability=[9,0]", "gpu.memory_gib=79.2"]
JOBS, BUDGET_S = evidence.load("evidence")


def ladder_cfg(out, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("ladder", overrides=["preset=evidence", f"out={out}", *overrides])


def by_name() -> dict[str, evidence.Job]:
    return {name: job for job in JOBS for name in job.names}


def experiment(config: str, name: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        required = ["output_dir=."] if config == "train" else ["checkpoint=x.pt"]
        return compose(config, overrides=[f"experiment={name}", *required])


def test_the_preset_names_every_contract_row_once():
    names = [name for job in JOBS for name in job.names]
    assert sorted(names) == sorted(CONTRACT)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_a_workload_is_one_identity_across_its_stacks_at_the_shipped_experiments_settings(workload, tmp_path):
    """Every speed-up divides rows of one workload: scenario, model, size, batch, accumulation, sampler, steps."""
    jobs = by_name()
    rows = {s: base_row(evidence.step_spec(jobs[f"{workload}.{s}"].args, tmp_path / s, None)) for s in STACKS}
    assert len({baseline_key(row) for row in rows.values()}) == 1, {s: baseline_key(r) for s, r in rows.items()}
    shipped = experiment("train" if workload == "train_step" else "sample",
                         "fast_train" if workload == "train_step" else "fast_sample")
    assert rows["strict_fp32"]["recipes"] == [] and rows["torch_defaults"]["recipes"] == ["torch_defaults"]
    assert rows["shipped"]["recipes"] == list(shipped.recipe)
    if workload == "train_step":
        assert rows["shipped"]["batch_size"] == shipped.train.batch_size and rows["shipped"]["grad_accum"] == 1
    if workload == "fast_sampler":
        assert rows["shipped"]["config"]["sampler"] == dict(shipped.sampler)


def test_headline_rows_come_first_but_for_the_command_whose_compilation_they_load():
    """A row the README does not need runs before one it needs only as the first job of a compile cache that the
    later row loads, or at the end of a process whose headline rows ran before it (on its own it would start and
    warm up again)."""
    headline = [bool(set(job.names) & HEADLINE) for job in JOBS]
    first_of_cache = {job.cache: n for n, job in reversed(list(enumerate(JOBS))) if job.cache}
    last = max(n for n, is_headline in enumerate(headline) if is_headline)
    for n, job in enumerate(JOBS[:last]):
        if headline[n]:
            continue
        loaded_later = job.cache and any(headline[h] and JOBS[h].cache == job.cache for h in range(n + 1, len(JOBS)))
        closes_process = job.process and all(not headline[m] for m in range(n, len(JOBS))
                                             if JOBS[m].process == job.process)
        assert (loaded_later and first_of_cache[job.cache] == n) or closes_process, f"{job.label} delays the headline"


def test_each_slice_s_estimates_fit_one_device_call_and_every_step_row_states_its_iterations():
    """A fresh H100 ran every row at once over the budget: each slice fits one call with a margin of 15 % for a
    fresh machine's start-ups, bytecode and compiles, and the first has every headline row."""
    assert BUDGET_S <= 540 and all(job.estimate_s > 0 for job in JOBS)
    for n in {job.slice for job in JOBS}:
        assert 1.15 * sum(job.estimate_s for job in JOBS if job.slice == n) <= BUDGET_S, f"slice {n}"
    assert all(job.slice == 1 for job in JOBS if set(job.names) & HEADLINE)  # the first call has every headline row
    for job in JOBS:
        if job.kind == "overrides":
            assert any(a.startswith("bench.iters=") for a in job.args), f"{job.label}: its iterations are the preset's"


def test_a_dry_run_lists_every_job_and_the_estimate_on_a_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert evidence.run(ladder_cfg(tmp_path, "dry_run=true")) == len(JOBS)
    said = capsys.readouterr().out.splitlines()
    assert [line.split(" ~")[0] for line in said[:-1]] == [f"[todo] {job.label}" for job in JOBS]
    assert said[-1].startswith(f"evidence: {len(JOBS)} job(s) to run here") and f"about {sum(job.estimate_s for job in JOBS):g} s" in said[-1]
    assert not (tmp_path / RESULTS_FILE).exists()


def test_a_simulated_v100_runs_the_fp16_variant_and_lists_what_it_cannot_make(tmp_path, capsys):
    evidence.run(ladder_cfg(tmp_path, "dry_run=true", *V100, "only='train_step|tf32|brats|forward|e2e.train'"))
    said = capsys.readouterr().out
    assert "[todo] train_step.shipped ~138 s, slice 1 (fp16 variant fast_train_fp16): experiment=fast_train_fp16" in said
    assert "(fp16 variant fast_train_fp16): scenario=e2e_train experiment=fast_train_fp16" in said
    assert ("[unsupported] train_step.strict_fp32: needs 37.1 GiB of GPU memory (its measured peak); "
            "Tesla V100-SXM2-16GB has 15.8 GiB") in said
    assert "[unsupported] counters.tf32_channels_last_3d: recipe 'tf32' is unsupported on this device: TF32" in said
    assert "[unsupported] brats.memory_train_step: recipe 'amp_bf16' is unsupported" in said
    assert "[todo] forward.shipped" in said and "[todo] forward.torch_defaults" in said


def test_a_slice_runs_only_its_jobs_and_the_tuned_rows_say_what_they_time(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    second = [job for job in JOBS if job.slice == 2]
    assert evidence.run(ladder_cfg(tmp_path, "dry_run=true", "slice=2")) == len(second)
    said = capsys.readouterr().out.splitlines()
    assert [line.split(" ~")[0] for line in said[:-1]] == [f"[todo] {job.label}" for job in second]
    tuned = [job for job in JOBS if "tuned25" in job.label]
    assert len(tuned) == 2 and all("gated for that 64^3 model only" in job.note for job in tuned)
    assert all(any(a.startswith("grid=bench/results/h100/tuned/") for a in job.args) for job in tuned)


@pytest.fixture
def measured(monkeypatch):
    """A GPU run on the CPU: CUDA shown as present, each measurement recorded instead of run."""
    ran = []
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(evidence, "env_info", lambda: {"gpu": "the machine's"})
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    monkeypatch.setattr(evidence.bytecode, "prepare", lambda out: {"mode": "written", "prefix": str(out)})
    for kind in ("step", "command", "counters"):
        monkeypatch.setattr(evidence.Runner, kind, lambda self, job, chosen, *rest: ran.append(job.label) or [job])
    return ran


def test_a_gpu_s_unsupported_rows_carry_the_reason_and_the_run_and_the_rest_is_measured(tmp_path, measured, capsys):
    evidence.run(ladder_cfg(tmp_path, *V100, "only='train_step|tf32|brats'"), argv=[])
    rows = read_rows(tmp_path)
    memory = "needs 37.1 GiB of GPU memory (its measured peak); Tesla V100-SXM2-16GB has 15.8 GiB"
    capability = "needs CUDA compute capability >= 8.0; Tesla V100-SXM2-16GB has 7.0"
    assert {r["job_name"]: r["message"] for r in rows} == {
        "train_step.strict_fp32": memory, "train_step.torch_defaults": memory,
        "counters.tf32_channels_last_3d": f"recipe 'tf32' is unsupported on this device: TF32: {capability}; drop "
                                          "tf32 on this GPU",
        "brats.memory_train_step": f"recipe 'amp_bf16' is unsupported on this device: bfloat16 autocast: {capability}; "
                                   "use amp_fp16 on this GPU"}
    said = capsys.readouterr().out
    assert all(r["status"] == "unsupported" and f"[unsupported] {r['job_name']}: {r['message']}\n" in said for r in rows)
    assert len({r["run_id"] for r in rows}) == 1
    assert len({r["launch"] for r in rows}) == 1 and all(r["launch_s"] >= 0 for r in rows)
    brats = next(r for r in rows if r["job_name"] == "brats.memory_train_step")
    assert brats["model"] == "medddpm_brats" and brats["scenario"] == "train_step" and brats["env"]
    assert brats["slice"] == 2 and all(r["bytecode"] == {"mode": "written", "prefix": str(tmp_path)} for r in rows)
    assert measured == ["train_step.shipped"], "the rest runs: fast_train_fp16 in fast_train's place"


def test_a_cut_run_names_the_missing_rows_and_the_command_that_continues_its_run(tmp_path, measured, capsys,
                                                                               monkeypatch):
    argv = ["preset=evidence", f"out={tmp_path}", "budget_s=0", "only=forward"]
    assert evidence.run(ladder_cfg(tmp_path, *H100, "budget_s=0", "only=forward"), argv=argv) == 3 and not measured
    said = capsys.readouterr().out.splitlines()
    assert said[-2].startswith("evidence: 3 row(s) missing from run ")
    assert said[-2].endswith(": forward.strict_fp32, forward.torch_defaults, forward.shipped")
    assert said[-1] == f"finish them (the same command continues the run): python -m bench.ladder {' '.join(argv)}"


def test_a_job_the_budget_ended_has_no_row_and_is_listed_missing(tmp_path, monkeypatch, capsys):
    """ncu killed at the budget's end is no measurement (a rerun makes the row); killed at its own limit, it is."""
    from bench import counters

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(evidence, "env_info", lambda: {"gpu": "the machine's"})
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    monkeypatch.setattr(evidence.bytecode, "prepare", lambda out: None)
    monkeypatch.setattr(evidence.Runner, "left_s", lambda self: 11.0)
    killed = {"status": "error", "message": f"{counters.KILLED} 11 s (counters.timeout_s / budget_s)"}
    monkeypatch.setattr(counters, "measure", lambda spec, folder, timeout: {**base_row(spec), **killed})
    assert evidence.run(ladder_cfg(tmp_path, *H100, "only=counters.shipped"), argv=[]) == 1
    assert "[cut] counters.shipped: the time budget ran out" in capsys.readouterr().out
    assert not (tmp_path / RESULTS_FILE).exists()
    monkeypatch.setattr(evidence.Runner, "left_s", lambda self: 1e6)  # its own limit ended it: an error row
    assert evidence.run(ladder_cfg(tmp_path, *H100, "only=counters.shipped"), argv=[]) == 0
    assert read_rows(tmp_path)[0]["status"] == "error"


def test_a_rerun_continues_the_run_of_this_commit_and_a_new_commit_starts_its_own(tmp_path, measured, monkeypatch):
    """The rows a rerun measures join the run its commit started; another commit's rerun measures every job again
    under a new run id."""

    def step(self, job, chosen, *rest):
        measured.append(job.label)
        self.append(job, {"status": "ok", "message": ""}, chosen)
        return [job]

    monkeypatch.setattr(evidence.Runner, "step", step)
    code = {"git_sha": "a" * 40, "dirty": False}
    monkeypatch.setattr(evidence, "provenance", lambda: code)
    monkeypatch.setattr("bench.core.records.provenance", lambda: code)
    monkeypatch.setenv(RUN_ID_ENV, "first-run")
    append_row(tmp_path / RESULTS_FILE, {"status": "ok", "message": "", "job_name": "forward.strict_fp32"})
    monkeypatch.delenv(RUN_ID_ENV)
    evidence.run(ladder_cfg(tmp_path, *H100, "only=forward"), argv=[])
    assert measured == ["forward.torch_defaults", "forward.shipped"]
    assert [(r["job_name"], r["run_id"]) for r in read_rows(tmp_path)] == [
        ("forward.strict_fp32", "first-run"), ("forward.torch_defaults", "first-run"), ("forward.shipped", "first-run")]

    code["git_sha"] = "b" * 40
    measured.clear()
    monkeypatch.delenv(RUN_ID_ENV)
    evidence.run(ladder_cfg(tmp_path, *H100, "only=forward"), argv=[])
    assert measured == ["forward.strict_fp32", "forward.torch_defaults", "forward.shipped"]
    new = read_rows(tmp_path)[3:]
    assert len(new) == 3 and len({r["run_id"] for r in new}) == 1 and new[0]["run_id"] != "first-run"
    assert all(r["git_sha"] == "b" * 40 for r in new)


@pytest.mark.e2e
def test_the_command_lists_the_jobs_on_a_cpu(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.ladder", "preset=evidence", f"out={tmp_path}", "dry_run=true"],
                          cwd=CONFIG_DIR.parent, capture_output=True, text=True, timeout=120)
    todo = [line for line in done.stdout.splitlines() if line.startswith("[todo]")]
    assert done.returncode == 0 and len(todo) == len(JOBS) and todo[0].startswith("[todo] forward.strict_fp32 ~")


def test_a_run_on_a_machine_without_cuda_is_one_line(tmp_path, monkeypatch):
    """The command's error (one line, exit 2: tests/bench/test_ladder.py runs bench.ladder's CLI), in-process."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^preset=evidence: times GPU workloads and this machine shows no CUDA GPU; "
                                          r"run it on a GPU machine, pass preset=smoke here, or dry_run=true to list "
                                          r"its jobs$"):
        ladder.run(ladder_cfg(tmp_path))
    assert not (tmp_path / RESULTS_FILE).exists()


def test_make_bench_runs_the_evidence_preset_then_its_report():
    recipe = subprocess.run(["make", "--no-print-directory", "-n", "bench", "SWEEP_DIR=out", "BIN=bin"], cwd=CONFIG_DIR.parent,
                            capture_output=True, text=True, timeout=60).stdout.splitlines()
    assert recipe[-2:] == ["bin/python -m bench.ladder preset=evidence out=out ", "bin/python -m bench.report dir=out"]


def test_the_commands_inputs_are_a_phantom_and_a_checkpoint_the_sampling_command_loads(tmp_path):
    from med_ddpm.checkpoint import load_checkpoint
    from med_ddpm.data.masks import sampling_geometry

    data = evidence.write_phantom_data(tmp_path / "data", model="tiny")
    checkpoint = evidence.write_random_checkpoint(tmp_path / "ckpt.pt", model="tiny")
    assert [p.name for p in (data / "mask").iterdir()] == [p.name for p in (data / "image").iterdir()] != []
    loaded = load_checkpoint(checkpoint)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        command = compose("sample", overrides=[f"checkpoint={checkpoint}", f"masks={data / 'mask'}"])
    assert sampling_geometry(loaded, command)[:2] == ("whole_head", [32, 32, 32])
    assert evidence.write_random_checkpoint(checkpoint).stat().st_mtime == checkpoint.stat().st_mtime  # once


@pytest.mark.slow  # two worker processes
def test_a_cpu_run_of_a_small_preset_writes_its_rows_once_one_process_per_process_name(tmp_path, monkeypatch):
    """The runner end to end with the real worker on the tiny model: a process's jobs in one worker, each row with
    its job_name and the run's id; the same command again measures nothing."""
    from bench.core import presets

    folder = tmp_path / "presets"
    folder.mkdir()
    smoke = '[experiment=bench_smoke, bench.warmup=0, bench.iters=2'
    (folder / "tiny_evidence.yaml").write_text(f"""
jobs:
  - {{name: forward.strict_fp32, process: fp32, overrides: {smoke}, bench=denoise_step, "recipe=[]"]}}
  - {{name: train_step.strict_fp32, process: fp32, overrides: {smoke}, bench=train_step, "recipe=[]"]}}
  - {{name: forward.torch_defaults, overrides: {smoke}, bench=denoise_step, "recipe=[torch_defaults]"]}}
""")
    monkeypatch.setattr(presets, "PRESET_DIR", folder)
    monkeypatch.setattr(evidence, "PRESET_DIR", folder)
    code = {"git_sha": "c" * 40, "dirty": False}  # a clean commit: the same command continues its run
    for module in ("bench.evidence", "bench.core.records", "bench.core.worker"):
        monkeypatch.setattr(f"{module}.provenance", lambda: code)
    monkeypatch.delenv(RUN_ID_ENV, raising=False)
    out = tmp_path / "out"
    cfg = ladder_cfg(out, "preset=tiny_evidence", *H100)
    assert evidence.run(cfg, argv=[]) == 0
    rows = read_rows(out)
    assert [r["job_name"] for r in rows] == ["forward.strict_fp32", "train_step.strict_fp32", "forward.torch_defaults"]
    assert all(r["status"] == "ok" for r in rows) and len({r["run_id"] for r in rows}) == 1
    assert sorted(p.name for p in (out / "jobs").iterdir()) == ["forward.torch_defaults", "fp32"]
    assert rows[0]["wall_s"] == rows[1]["wall_s"] != rows[2]["wall_s"], "one worker for the fp32 process"
    monkeypatch.delenv(RUN_ID_ENV)
    assert evidence.run(cfg, argv=[]) == 0 and len(read_rows(out)) == 3


def test_a_gpu_missing_from_the_peak_table_gets_its_rows_and_one_note(tmp_path, capsys):
    evidence.run(ladder_cfg(tmp_path, "dry_run=true", "gpu.name='NVIDIA RTX PRO 6000 Blackwell'",
                            "gpu.capability=[12,0]", "gpu.memory_gib=95", "only=forward"))
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("note: NVIDIA RTX PRO 6000 Blackwell is not in") and sum("note:" in s for s in said) == 1
    assert [s.split(" ~")[0] for s in said[1:4]] == [f"[todo] forward.{s}" for s in STACKS]
