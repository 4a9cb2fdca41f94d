"""The ladder presets: every job composes from the real configs, names only existing recipes,
has a unique identity, the experiments' stacks come from their configs, and the CLI is Hydra's."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import bench.quality.training as quality_training
from bench.core import presets
from bench.core.records import baseline_key, job_key, recipe_label
from bench.core.runner import compose_job, missing_recipes
from bench.core.worker import base_row
from bench.ladder import COMMAND_PRESETS, ladder_jobs, run
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError

REPO = CONFIG_DIR.parent


def ladder_cfg(tmp_path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("ladder", overrides=[f"out={tmp_path}", *overrides])


def jobs_of(preset: str, tmp_path) -> list[list[str]]:
    return ladder_jobs(ladder_cfg(tmp_path, f"preset={preset}", f"checkpoint={tmp_path / 'quality_model.pt'}",
                                  f"candidate_checkpoint={tmp_path / 'other.pt'}"))


def experiment(config: str, name: str):
    """``experiment=name`` composed on the training or sampling config, as its users run it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        required = "output_dir=/tmp/x" if config == "train" else "checkpoint=x.pt"
        return compose(config, overrides=[f"experiment={name}", required])


# e2e and evidence jobs are CLI runs (test_e2e, test_evidence); a GPU preset's 10 to 70 jobs take a composition each
GPU_PRESETS = {"core", "gpu", "samplers", "targets"}


@pytest.mark.parametrize("preset", [pytest.param(p, marks=[pytest.mark.slow] if p in GPU_PRESETS else [])
                                    for p in sorted(set(presets.names()) - {"e2e", "evidence"})])
def test_every_job_composes_and_is_unique(preset, tmp_path):
    jobs = jobs_of(preset, tmp_path)
    assert jobs and all(not missing_recipes(job) for job in jobs)
    keys = [job_key(base_row(compose_job(job, tmp_path / str(n)))) for n, job in enumerate(jobs)]
    assert len(set(keys)) == len(keys), "two jobs of one preset would overwrite each other's row"


def test_quality_preset_gates_the_shipped_sampling_experiment_and_its_bf16_variant(tmp_path):
    """The gate runs ``experiment=fast_sample`` exactly as shipped (sampler and stack with options), a variant
    that swaps only amp_fp16 for amp_bf16, and that variant with its input convolution in fp32; every job shares
    one reference cache next to the checkpoint."""
    sample = experiment("sample", "fast_sample")
    configs = [compose_job(job, tmp_path / str(n))["config"] for n, job in enumerate(jobs_of("quality", tmp_path))]
    assert all(c["bench"]["quality"] and c["model"]["image_size"] == [64, 64, 64] for c in configs)
    assert {c["quality"]["cache_dir"] for c in configs} == {str(tmp_path / "gate_cache")}
    shipped = OmegaConf.to_container(sample.recipe, resolve=True)
    fast = [c for c in configs if c["sampler"] == OmegaConf.to_container(sample.sampler, resolve=True)]
    assert [c["recipe"] for c in fast][0] == shipped
    assert list(shipped)[0] == "amp_fp16" and shipped["amp_fp16"]["fp32_modules"] == []
    bf16, island = fast[1]["recipe"], fast[2]["recipe"]
    assert list(bf16) == ["amp_bf16", *list(shipped)[1:]] and bf16["amp_bf16"]["dtype"] == "bfloat16"
    assert all(bf16[k] == v for k, v in shipped.items() if k != "amp_fp16")
    assert island == {**bf16, "amp_bf16": {**bf16["amp_bf16"], "fp32_modules": ["input_blocks.0.0"]}}
    with pytest.raises(ConfigError, match="checkpoint=PATH"):
        ladder_jobs(ladder_cfg(tmp_path, "preset=quality"))


@pytest.mark.e2e
def test_the_cli_is_hydras_and_a_bad_preset_is_one_line(tmp_path):
    listed = subprocess.run([sys.executable, "-m", "bench.ladder", "preset=smoke", f"out={tmp_path}", "dry_run=true",
                             "best=[amp_bf16]"], cwd=REPO, capture_output=True, text=True, timeout=120)
    todo = [line for line in listed.stdout.splitlines() if line.startswith("[todo]")]
    assert listed.returncode == 0 and len(todo) == 8 and sum("recipe=[amp_bf16]" in line for line in todo) == 4
    bad = subprocess.run([sys.executable, "-m", "bench.ladder", "preset=tuning", f"out={tmp_path}"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        f"error: bench.ladder: unknown preset=tuning; known: "
        f"{', '.join(dict.fromkeys([*presets.names(), *COMMAND_PRESETS]))}")
    assert {"smoke", "gpu", "core", "targets", "quality", "quality_pair", "samplers", "e2e", "evidence"} <= set(
        presets.names())
    assert set(COMMAND_PRESETS) == {"e2e", "quality_training", "evidence", "quality_128"}


def test_refresh_remeasures_the_named_jobs_once_per_code_version(tmp_path, monkeypatch, capsys):
    """After a code change, ``refresh=REGEX`` reruns the jobs it names unless this commit has a row
    for them; other jobs and rows of this commit are still skipped (resumable)."""
    from bench.core.records import RESULTS_FILE, append_row
    from bench.core.runner import run_ladder

    jobs = jobs_of("smoke", tmp_path)
    for n, job in enumerate(jobs):
        row = {**base_row(compose_job(job, tmp_path / str(n))), "status": "ok", "message": "", "git_sha": "old", "dirty": False}
        append_row(tmp_path / RESULTS_FILE, row)
    monkeypatch.setattr("bench.core.runner.provenance", lambda: {"git_sha": "new", "dirty": False})

    def todo(refresh):
        capsys.readouterr()
        run_ladder(tmp_path, jobs, budget_s=0, dry_run=True, refresh=refresh)
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[todo]")]

    assert todo(None) == []
    named = [" ".join(job) for job in jobs if "batch_size=2" in " ".join(job)]
    assert named and todo("batch_size=2") == [f"[todo] {j}" for j in named]
    first = next(job for job in jobs if "batch_size=2" in " ".join(job))
    row = {**base_row(compose_job(first, tmp_path / "x")), "status": "ok", "message": "", "git_sha": "new", "dirty": False}
    append_row(tmp_path / RESULTS_FILE, row)
    assert len(todo("batch_size=2")) == len(named) - 1


def test_recipe_options_are_part_of_the_job_and_its_label(tmp_path):
    stack = "recipe=[amp_bf16,cudnn_benchmark]"
    plain, exhaustive = (base_row(compose_job(["bench=denoise_step", stack, *extra], tmp_path / str(n)))
                         for n, extra in enumerate(([], ["recipe.cudnn_benchmark.limit=0"])))
    assert plain["recipe_options"] == [] and exhaustive["recipe_options"] == ["cudnn_benchmark.limit=0"]
    assert job_key(plain) != job_key(exhaustive)
    assert recipe_label(exhaustive) == "amp_bf16+cudnn_benchmark [cudnn_benchmark.limit=0]"
    legacy = {k: v for k, v in plain.items() if k != "recipe_options"}  # rows written before options were
    assert job_key(legacy) == job_key(plain) and recipe_label(legacy) == "amp_bf16+cudnn_benchmark"


def test_a_dry_run_of_the_e2e_preset_lists_its_commands_and_runs_none(tmp_path, capsys):
    out = tmp_path / "e2e"
    left = run(ladder_cfg(out, "preset=e2e", "dry_run=true", f"e2e.data_root={tmp_path}",
                          f"e2e.checkpoint={tmp_path / 'model.pt'}"))
    todo = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[todo]")]
    assert left == len(todo) == len(presets.jobs("e2e", {})) and "experiment=fast_train" in todo[3]
    assert not (out / "results.jsonl").exists() and not (out / "jobs").exists()


@pytest.mark.parametrize("preset", ["targets", "gpu", "core", "e2e"])
def test_a_gpu_preset_without_a_cuda_gpu_is_a_one_line_error(preset, tmp_path, monkeypatch):
    """Not hours of 128³ jobs on the CPU, each ending in a timeout row, and exit status 0."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match=rf"^preset={preset}: times GPU workloads and this machine shows no CUDA GPU; "
                                          r"run it on a GPU machine, pass preset=smoke here, or dry_run=true"):
        run(ladder_cfg(tmp_path, f"preset={preset}", f"e2e.data_root={tmp_path}"))
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "results.jsonl").exists()


def test_a_dry_run_of_quality_training_lists_the_runs_then_the_gates_and_trains_none(tmp_path, capsys, monkeypatch):
    runs, out = tmp_path / "runs", tmp_path / "out"
    cfg = ladder_cfg(out, "preset=quality_training", "dry_run=true", f"quality_training.runs={runs}")
    assert run(cfg) == 13 and not runs.exists()  # seven runs and six gates left, nothing started
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split()[:3] for line in listed[:7]] == [["[todo]", "python", "-m"]] * 7
    assert all("model.image_size=[32,32,32]" in line for line in listed[:7])  # the preset's size, to every run
    assert listed[7] == "[todo] the 6 gates, once the 7 runs are finished"
    for arm in ("fp32", "fp32_seed1", "fp32_seed2", "fp32_seed3", "fp32_seed4", "fast_train", "control"):
        (runs / arm / "checkpoints").mkdir(parents=True)  # finished runs: their weights exist
        (runs / arm / "checkpoints" / "last.pt").write_bytes(arm.encode())
    monkeypatch.setattr(quality_training, "finished", lambda run, steps: True)
    assert run(cfg) == 6 and not (out / "results.jsonl").exists()
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert [line.split()[0] for line in listed] == ["[done]"] * 7 + ["[todo]"] * 6
    assert all("model.image_size=[32,32,32]" in line for line in listed[7:])  # and to every gate


@pytest.mark.parametrize("args, pattern", [
    (["only='(x'"], r"^only=\(x: not a regular expression \(missing \), unterminated subpattern"),
    (["only=nomatch"], r"^only=nomatch: names none of preset=smoke's 8 jobs; pass a regex"),
    (["budget_s=-1"], r"^budget_s=-1: must be a number >= 0"),
], ids=["not-a-regex", "no-job", "negative-budget"])
def test_bad_only_or_budget_is_one_line(tmp_path, args, pattern):
    with pytest.raises(ConfigError, match=pattern):
        run(ladder_cfg(tmp_path, "preset=smoke", "dry_run=true", *args))


def test_only_runs_the_jobs_a_regex_names(tmp_path, capsys):
    run(ladder_cfg(tmp_path, "preset=smoke", "dry_run=true", "only='batch_size=2'"))
    todo = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[todo]")]
    expected = [job for job in jobs_of("smoke", tmp_path) if "batch_size=2" in " ".join(job)]
    assert todo and len(todo) == len(expected) and all("batch_size=2" in line for line in todo)


@pytest.mark.parametrize("only", [False, True])
def test_only_adds_no_missing_baselines(tmp_path, monkeypatch, only):
    """A full ladder spends its leftover budget on missing strict-FP32 baselines; ``only=`` runs just its jobs."""
    from bench import ladder
    from bench.core import runner
    from bench.core.records import RESULTS_FILE, append_row

    job = ["experiment=bench_smoke", "bench=train_step", "recipe=[amp_bf16]"]
    append_row(tmp_path / RESULTS_FILE, {**base_row(compose_job(job, tmp_path / "job")), "status": "ok", "message": ""})
    completed = []
    monkeypatch.setattr(runner.EnsureBaseline, "complete", lambda out, budget_s: completed.append(out))
    monkeypatch.setattr(ladder.presets, "jobs", lambda name, cfg: [presets.PresetJob("amp_bf16", job)])
    run(ladder_cfg(tmp_path, "preset=smoke", "budget_s=60", *(["only=amp_bf16"] if only else [])))
    assert completed == ([] if only else [tmp_path])


@pytest.mark.parametrize(("budget_s", "kept"), [(10.0, False), (math.inf, True)])
def test_a_baseline_cut_by_the_budget_leaves_no_row(tmp_path, monkeypatch, budget_s, kept):
    """EnsureBaseline at the end of a ladder: a strict-FP32 job killed because the run's budget shortened
    its limit is no measurement; one past its own limit is."""
    from bench.core import runner
    from bench.core.records import RESULTS_FILE, append_row, read_rows
    from bench.core.worker import TIMEOUT_PREFIX

    job = compose_job(["bench=train_step", "recipe=[amp_bf16]"], tmp_path / "job")
    append_row(tmp_path / RESULTS_FILE, {**base_row(job), "status": "ok", "message": ""})
    seen = []

    def timed_out(job, job_dir, timeout_s):
        seen.append(timeout_s)
        return {**base_row(job), "status": "error", "message": f"{TIMEOUT_PREFIX} after {timeout_s:.0f} s"}

    monkeypatch.setattr(runner, "run_job", timed_out)
    runner.EnsureBaseline.complete(tmp_path, budget_s)
    rows = read_rows(tmp_path)
    assert len(seen) == 1 and (seen[0] < 10.0) == (not kept)
    assert [r["recipes"] for r in rows] == ([["amp_bf16"], []] if kept else [["amp_bf16"]])


def test_targets_preset_times_the_two_experiments_against_strict_fp32(tmp_path):
    """``preset=targets`` composes ``experiment=fast_sample`` and ``experiment=fast_train`` (their stacks are
    not rewritten in Python): each workload next to its strict-FP32 baseline; then fast_sample's bf16 and
    bf16-island variants, each differing from the shipped stack in its autocast only."""
    jobs = jobs_of("targets", tmp_path)
    shipped = [job for job in jobs if not any("amp_bf16" in o for o in job)]
    variants = [compose_job(job, tmp_path / f"v{n}")["config"] for n, job in enumerate(jobs) if job not in shipped]
    assert [c["bench"]["scenario"] for c in variants] == ["denoise_step", "full_sample"] * 2
    assert [list(c["recipe"])[0] for c in variants] == ["amp_bf16"] * 4
    assert [c["recipe"]["amp_bf16"]["fp32_modules"] for c in variants] == [[], [], ["input_blocks.0.0"], ["input_blocks.0.0"]]
    jobs = shipped
    assert not any(o.startswith("recipe=[") and o != "recipe=[]" for job in jobs for o in job)
    specs = [compose_job(job, tmp_path / str(n)) for n, job in enumerate(jobs)]
    baselines = {baseline_key(base_row(s)) for s in specs if not s["recipes"]}
    fast = [s["config"] for s in specs if s["recipes"]]
    sample, train = experiment("sample", "fast_sample"), experiment("train", "fast_train")
    assert [c["bench"]["scenario"] for c in fast] == ["denoise_step", "train_step"] + ["full_sample"] * 3
    assert fast[1]["recipe"] == OmegaConf.to_container(train.recipe, resolve=True)
    assert all(c["recipe"] == OmegaConf.to_container(sample.recipe, resolve=True) for c in (fast[0], *fast[2:]))
    assert fast[3]["sampler"] == OmegaConf.to_container(sample.sampler, resolve=True)
    few = fast[4]["sampler"]  # the 25-call grid that passes the gate on the quality model, timed at 128^3
    assert (few["steps"], len(few["timesteps"]), few["variant"]) == (25, 25, "sde")
    # every workload has its strict-FP32 baseline but the few-step samplers, whose baseline is DDPM-250
    unmatched = [s["config"]["sampler"]["name"] for s in specs if s["recipes"] and baseline_key(base_row(s)) not in baselines]
    assert unmatched == ["dpm_solver_pp"] * 2


def test_a_resumed_ladder_measures_each_workload_s_baseline_in_its_own_run(tmp_path, monkeypatch):
    """A cut ladder's baseline row belongs to the earlier launch: the resumed launch measures the baseline of
    every workload it times again, first, so each speed-up is against a baseline of the same run."""
    from bench.core import runner
    from bench.core.records import RESULTS_FILE, append_row, new_run, read_rows

    jobs = [["experiment=bench_smoke", "bench=train_step", "recipe=[]"],
            ["experiment=bench_smoke", "bench=train_step", "recipe=[amp_bf16]"],
            ["experiment=bench_smoke", "bench=denoise_step", "recipe=[]"]]
    ran: list[list[str]] = []

    def fake_run_job(job, job_dir, timeout):
        ran.append(job["recipes"] and job["recipes"] or [])
        return {**base_row(job), "status": "ok", "message": "", "ms_median": 1.0}

    monkeypatch.setattr(runner, "run_job", fake_run_job)
    new_run()
    first = compose_job(jobs[0], tmp_path / "a")
    append_row(tmp_path / RESULTS_FILE, {**base_row(first), "status": "ok", "message": ""})  # the cut launch's row
    new_run()
    assert runner.run_ladder(tmp_path, jobs, budget_s=math.inf, complete_baselines=False) == 0
    assert ran == [[], ["amp_bf16"], []]  # train_step's baseline again (before amp_bf16), then denoise's
    rows = read_rows(tmp_path)
    latest = {r["run_id"] for r in rows[1:]}
    assert len(latest) == 1 and rows[0]["run_id"] not in latest
    ran.clear()
    assert runner.run_ladder(tmp_path, jobs, budget_s=math.inf, complete_baselines=False) == 0 and ran == []


def test_two_checkpoints_gated_against_one_reference_are_each_measured_once(tmp_path, monkeypatch):
    """Both rows are strict FP32 on one workload, told apart by the candidate's weights: neither is measured as the
    other's baseline, and a resumed ladder measures only the one that is missing."""
    from bench.core import runner
    from bench.core.records import RESULTS_FILE, append_row, candidate_checkpoint, read_rows

    jobs = [job for c in ("stack.pt", "reseed.pt") for job in quality_training.quality_pair_ladder("fp32.pt", c)]
    ran: list[str] = []

    def fake_run_job(job, job_dir, timeout):
        ran.append(job["config"]["quality"]["candidate_checkpoint"])
        return {**base_row(job), "status": "ok", "message": "", "ms_median": 1.0}

    monkeypatch.setattr(runner, "run_job", fake_run_job)
    append_row(tmp_path / RESULTS_FILE, {**base_row(compose_job(jobs[1], tmp_path / "a")), "status": "ok"})
    assert runner.run_ladder(tmp_path, jobs, budget_s=math.inf, complete_baselines=False) == 0
    assert ran == ["stack.pt"] and [candidate_checkpoint(r) for r in read_rows(tmp_path)] == ["reseed.pt", "stack.pt"]
    (tmp_path / RESULTS_FILE).unlink()
    ran.clear()
    assert runner.run_ladder(tmp_path, jobs, budget_s=math.inf, complete_baselines=False) == 0
    assert ran == ["stack.pt", "reseed.pt"]


def test_a_dirty_row_is_not_a_row_of_this_commit(tmp_path, monkeypatch):
    """``refresh=`` reruns a job unless this commit measured it on a clean tree: a row measured with uncommitted
    code changes is not this commit's measurement."""
    from bench.core import runner
    from bench.core.records import RESULTS_FILE, append_row

    job = jobs_of("smoke", tmp_path)[0]
    row = {**base_row(compose_job(job, tmp_path / "a")), "status": "ok", "message": "", "git_sha": "abc", "dirty": True}
    append_row(tmp_path / RESULTS_FILE, row)
    monkeypatch.setattr(runner, "provenance", lambda: {"git_sha": "abc", "dirty": False})
    done, current = runner.finished_jobs(tmp_path, refresh=".")
    assert job_key(row) in done and job_key(row) not in current
