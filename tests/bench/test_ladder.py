"""The ladder presets: every job composes from the real configs, names only existing recipes,
has a unique identity, and the quality preset gates the quality model's architecture."""

from __future__ import annotations

import math

import pytest

from bench.ladder import DEFAULT_BEST, PRESETS, compose_job, missing_recipes, parse_args, quality_ladder
from bench.records import job_key, recipe_label
from bench.worker import base_row


def jobs_of(preset: str, tmp_path) -> list[list[str]]:
    ladder = PRESETS[preset]
    if ladder is quality_ladder:
        return list(ladder(DEFAULT_BEST, str(tmp_path / "quality_model.pt")))
    return list(ladder(DEFAULT_BEST))


@pytest.mark.parametrize("preset", sorted({ladder: name for name, ladder in sorted(PRESETS.items())}.values()))
def test_every_job_composes_and_is_unique(preset, tmp_path):
    jobs = jobs_of(preset, tmp_path)
    assert jobs and all(not missing_recipes(job) for job in jobs)
    keys = [job_key(base_row(compose_job(job, tmp_path / str(n)))) for n, job in enumerate(jobs)]
    assert len(set(keys)) == len(keys), "two jobs of one preset would overwrite each other's row"


def test_quality_preset_gates_the_quality_model_with_a_shared_reference(tmp_path):
    jobs = jobs_of("quality", tmp_path)
    configs = [compose_job(job, tmp_path / str(n))["config"] for n, job in enumerate(jobs)]
    assert all(c["bench"]["quality"] and c["model"]["image_size"] == [64, 64, 64] for c in configs)
    assert {c["quality"]["cache_dir"] for c in configs} == {str(tmp_path / "gate_cache")}
    swept = {(c["sampler"]["name"], c["sampler"]["steps"]) for c in configs if c["bench"]["scenario"] == "full_sample"}
    assert {(s, n) for s in ("ddim", "dpm_solver_pp", "deis") for n in (10, 25, 50, 100)} <= swept
    labels = {base_row(compose_job(job, tmp_path / str(n)))["sampler"] for n, job in enumerate(jobs)}
    assert {"ddpm", "ddim", "ddim(eta=1.0)", "dpm_solver_pp", "dpm_solver_pp(variant=sde)", "deis"} <= labels, "eta=1 rows are their own workload"
    with pytest.raises(SystemExit, match="checkpoint=PATH"):
        list(quality_ladder(DEFAULT_BEST, None))


def test_cuda_graphs_is_not_timed_on_training_steps(tmp_path):
    for job in jobs_of("gpu", tmp_path):
        assert not ("bench=train_step" in job and any("cuda_graphs" in o for o in job if o.startswith("recipe=")))


def test_args_are_checked():
    assert parse_args(["out=x", "preset=quality", "checkpoint=a.pt"])["checkpoint"] == "a.pt"
    with pytest.raises(SystemExit, match="bad argument"):
        parse_args(["out=x", "bogus=1"])


def test_refresh_remeasures_the_named_jobs_once_per_code_version(tmp_path, monkeypatch, capsys):
    """After a code change, ``refresh=REGEX`` reruns the jobs it names unless this commit has a row
    for them; other jobs and rows of this commit are still skipped (resumable)."""
    from bench.ladder import run_ladder
    from bench.records import RESULTS_FILE, append_row

    jobs = jobs_of("smoke", tmp_path)
    for n, job in enumerate(jobs):
        row = {**base_row(compose_job(job, tmp_path / str(n))), "status": "ok", "message": "",
               "env": {"git_sha": "old"}}
        append_row(tmp_path / RESULTS_FILE, row)
    monkeypatch.setenv("MED_DDPM_GIT_SHA", "new")

    def todo(refresh):
        capsys.readouterr()
        run_ladder(tmp_path, jobs, budget_s=0, dry_run=True, refresh=refresh)
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("[todo]")]

    assert todo(None) == []
    named = [" ".join(job) for job in jobs if "batch_size=2" in " ".join(job)]
    assert named and todo("batch_size=2") == [f"[todo] {j}" for j in named]
    first = next(job for job in jobs if "batch_size=2" in " ".join(job))
    row = {**base_row(compose_job(first, tmp_path / "x")), "status": "ok", "message": "", "env": {"git_sha": "new"}}
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


def test_only_runs_the_jobs_a_regex_names(tmp_path, capsys):
    from bench.ladder import main

    main([f"out={tmp_path}", "preset=smoke", "dry_run=true", "only=batch_size=2"])
    todo = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[todo]")]
    expected = [job for job in jobs_of("smoke", tmp_path) if "batch_size=2" in " ".join(job)]
    assert todo and len(todo) == len(expected) and all("batch_size=2" in line for line in todo)


@pytest.mark.parametrize("only", [False, True])
def test_only_adds_no_missing_baselines(tmp_path, monkeypatch, only):
    """A full ladder spends its leftover budget on missing strict-FP32 baselines; ``only=`` runs just its jobs."""
    from bench import ladder, sweep
    from bench.records import RESULTS_FILE, append_row

    job = ["experiment=bench_smoke", "bench=train_step", "recipe=[amp_bf16]"]
    append_row(tmp_path / RESULTS_FILE, {**base_row(compose_job(job, tmp_path / "job")), "status": "ok", "message": ""})
    completed = []
    monkeypatch.setattr(sweep.EnsureBaseline, "complete", lambda out, budget_s: completed.append(out))
    monkeypatch.setattr(ladder, "PRESETS", {**ladder.PRESETS, "smoke": lambda best: iter([job])})
    ladder.main([f"out={tmp_path}", "preset=smoke", "budget_s=60", *(["only=amp_bf16"] if only else [])])
    assert completed == ([] if only else [tmp_path])


@pytest.mark.parametrize(("budget_s", "kept"), [(10.0, False), (math.inf, True)])
def test_a_baseline_cut_by_the_budget_leaves_no_row(tmp_path, monkeypatch, budget_s, kept):
    """EnsureBaseline at the end of a ladder: a strict-FP32 job killed because the run's budget shortened
    its limit is no measurement (round 8 wrote such an error row for BraTS); one past its own limit is."""
    from bench import sweep
    from bench.records import RESULTS_FILE, append_row, read_rows
    from bench.worker import TIMEOUT_PREFIX

    job = compose_job(["bench=train_step", "recipe=[amp_bf16]"], tmp_path / "job")
    append_row(tmp_path / RESULTS_FILE, {**base_row(job), "status": "ok", "message": ""})
    seen = []

    def timed_out(job, job_dir, timeout_s):
        seen.append(timeout_s)
        return {**base_row(job), "status": "error", "message": f"{TIMEOUT_PREFIX} after {timeout_s:.0f} s"}

    monkeypatch.setattr(sweep, "run_job", timed_out)
    sweep.EnsureBaseline.complete(tmp_path, budget_s)
    rows = read_rows(tmp_path)
    assert len(seen) == 1 and (seen[0] < 10.0) == (not kept)
    assert [r["recipes"] for r in rows] == ([["amp_bf16"], []] if kept else [["amp_bf16"]])


def test_quality_preset_ends_with_the_fast_sample_experiment(tmp_path):
    """The gate's last job is exactly ``experiment=fast_sample``'s sampler and recipe stack (options included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from bench.sweep import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        experiment = compose("sample", overrides=["experiment=fast_sample", "checkpoint=x.pt"])
    gated = compose_job(jobs_of("quality", tmp_path)[-1], tmp_path / "last")["config"]
    assert gated["recipe"] == OmegaConf.to_container(experiment.recipe, resolve=True)
    assert gated["sampler"] == OmegaConf.to_container(experiment.sampler, resolve=True)


def test_targets_preset_times_the_two_experiments_against_strict_fp32(tmp_path):
    """``preset=targets`` times exactly ``experiment=fast_sample``'s stack and ``fast_train``'s, each workload next
    to its strict-FP32 baseline."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from bench.sweep import CONFIG_DIR

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        sample = compose("sample", overrides=["experiment=fast_sample", "checkpoint=x.pt"])
        train = compose("train", overrides=["experiment=fast_train", "output_dir=/tmp/x"])
    configs = [compose_job(job, tmp_path / str(n))["config"] for n, job in enumerate(jobs_of("targets", tmp_path))]
    workloads = [(c["bench"]["scenario"], c["sampler"]["name"]) for c in configs]
    baselines = {w for w, c in zip(workloads, configs, strict=True) if not c.get("recipe")}
    assert baselines == set(workloads) - {("full_sample", "dpm_solver_pp")}  # DDPM-250 is the fast sampler's baseline
    sample_recipes = OmegaConf.to_container(sample.recipe, resolve=True)
    train_recipes = OmegaConf.to_container(train.recipe, resolve=True)
    fast = [c for c in configs if c.get("recipe")]
    assert [c["bench"]["scenario"] for c in fast] == ["denoise_step", "train_step", "full_sample", "full_sample"]
    assert fast[1]["recipe"] == train_recipes
    assert all(c["recipe"] == sample_recipes for c in (fast[0], *fast[2:]))
    assert fast[3]["sampler"] == OmegaConf.to_container(sample.sampler, resolve=True)
