"""bench.core.e2e: its jobs compose as the user's commands, the timing split is arithmetic on timings.json, and
(slow) the real CLIs run end to end on a CPU."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from bench.core import e2e, presets
from bench.core.e2e import (
    command,
    import_seconds,
    report,
    run,
    sample_split,
    spawn,
    split_job,
    train_split,
    workload,
)
from bench.core.records import read_rows
from bench.ladder import e2e_args
from med_ddpm.config_checks import ConfigError
from med_ddpm.data.phantoms import write_phantom_niftis

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
CHECKPOINT = REPO / "tests" / "data" / "reference" / "wholehead_small_ckpt.pt"  # original format, 32^3 architecture


def args_for(tmp_path: Path, data_root: Path, **extra: str) -> dict[str, str]:
    return {"out": str(tmp_path), "data_root": str(data_root), "checkpoint": str(CHECKPOINT),
            "brats_root": str(tmp_path / "brats"), **extra}


def test_every_e2e_job_is_a_command_that_composes(tmp_path):
    """The ladder's e2e jobs are the README's commands: fast_train takes data.root and trains graphed at
    batch 2 without accumulation; fast_sample samples the masks it is given (phantoms: composing reads none)."""
    write_phantom_niftis(tmp_path / "phantoms", 4, (8, 8, 8))
    rows = {}
    for n, job in enumerate(j.overrides for j in presets.jobs("e2e", {})):
        own, overrides = split_job(job)
        argv = command(own, overrides, args_for(tmp_path, tmp_path / "phantoms"), tmp_path / f"job{n}")
        rows[" ".join(job)] = workload(argv, None)
    assert len(rows) == 11 and sum("compile_cudagraphs.aot=true" in job for job in rows) == 4  # composed: key exists
    train = next(r for k, r in rows.items() if "fast_train" in k)
    assert train["model"] == "medddpm_whole_head" and train["batch_size"] == 2 and "compile_cudagraphs" in train["recipes"]
    sample = next(r for k, r in rows.items() if "masks=32" in k)
    assert sample["sampler"] == "dpm_solver_pp" and sample["steps"] == 100
    assert len(list((tmp_path / "job2" / "masks").iterdir())) == 32
    brats = [r for k, r in rows.items() if "brats" in k]
    assert [(r["model"], "checkpointing" in r["recipes"]) for r in brats] == [("medddpm_brats", True)] * 2


def test_the_split_is_read_off_the_marks():
    sample = {"run_start_s": 2.0, "device_ready_s": 2.5, "checkpoint_ready_s": 2.75, "recipes_ready_s": 3.25,
              "model_ready_s": 4.0, "first_mask_ready_s": 4.5, "first_volume_done_s": 14.0,
              "sampling_done_s": 20.0, "total_s": 20.5, "volume_s": [10.0, 2.0, 3.0, 2.5], "volumes": 4,
              "write_busy_s": 2.4, "write_wait_s": 0.1, "torch_compile_s": {"total_wall_time": 6.25}}
    split = sample_split(sample)
    assert split["torch_compile_s"] == 6.25 and split["precompiled"] is None  # no aot
    loaded = sample_split({**sample, "precompiled": {"status": "loaded", "lazy_calls": 0, "seconds": 1.5}})
    assert (loaded["precompiled"], loaded["precompile_s"]) == ("loaded", 1.5)
    assert (split["imports_s"], split["cuda_init_s"], split["startup_s"]) == (2.0, 0.5, 4.0)
    assert (split["checkpoint_s"], split["recipes_s"], split["model_prep_s"], split["mask_wait_s"]) == (0.25, 0.5, 0.75, 0.5)
    assert split["warmup_s"] is None  # no compiled stack: no warm-up call
    warmed = sample_split({**sample, "warmed_up_s": 4.25})
    assert (warmed["warmup_s"], warmed["mask_wait_s"], warmed["first_volume_s"]) == (0.25, 0.25, 10.0)
    assert warmed["compile_s"] == 7.75, "compiling moved into the warm-up still counts"
    assert sample_split({k: v for k, v in sample.items() if k != "recipes_ready_s"})["recipes_s"] is None  # older code
    assert (split["first_volume_s"], split["per_volume_s"], split["compile_s"]) == (10.0, 2.0, 7.5)
    assert split["write_exposed_s"] == 0.6 and split["sampling_s"] == 17.5
    train_marks = {"run_start_s": 3.0, "model_built_s": 5.0, "model_ready_s": 8.0, "data_ready_s": 8.5,
                   "data_build_s": 5.25, "loop_start_s": 9.0, "first_step_s": 30.0, "first_step_done_s": 39.0,
                   "ms_per_step": 120.0, "ms_per_volume": 60.0, "data_wait_pct": 1.5, "steady_steps": 57}
    train = train_split(train_marks)
    assert (train["imports_s"], train["model_s"], train["model_prep_s"]) == (3.0, 2.0, 3.0)
    assert (train["data_wait_s"], train["data_build_s"], train["loader_s"]) == (0.5, 5.25, 0.5)
    assert (train["time_to_first_step_s"], train["compile_s"], train["ms_per_volume"]) == (39.0, 29.88, 60.0)
    assert train["torch_compile_s"] is None, "a timings.json without Dynamo's counters: no figure, not zero"
    assert train["warmup_s"] is None  # no compiled stack: no warm-up passes
    warmed = train_split({**train_marks, "model_ready_s": 6.0, "warmed_up_s": 8.0, "first_step_s": 1.0,
                          "first_step_done_s": 10.0})
    assert (warmed["model_prep_s"], warmed["warmup_s"], warmed["data_wait_s"]) == (1.0, 2.0, 0.5)
    assert warmed["compile_s"] == 2.88, "compiling moved into the warm-up still counts"


def test_imports_are_timed_per_package_and_kept_out_of_the_log_tail(tmp_path):
    """A real ``python -X importtime`` run: its top-level imports add up per package, torch's subpackages apart,
    and the tail a failure row quotes holds the command's own lines, not the import log."""
    (tmp_path / "importer.py").write_text("import json, email.message\nimport sqlite3\nprint('done')\n")
    code, _, tail = spawn(["importer"], tmp_path / "cache", tmp_path / "run.log", timeout_s=60,
                          env_extra={"PYTHONPATH": str(tmp_path)}, importtime=True)
    log = (tmp_path / "run.log").read_text()
    assert code == 0 and "import time:" in log and tail.strip() == "done"
    assert {"json", "email", "sqlite3"} <= set(import_seconds(log)) and all(v >= 0 for v in import_seconds(log).values())
    synthetic = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       500 |     800000 | torch",
        "import time:       100 |     100000 |   torch._C",  # nested: inside torch's 0.8 s
        "import time:        50 |     300000 | torch._inductor.compile_fx",
        "import time:        10 |      20000 | torch._inductor.runtime.cache_dir_utils",
        "import time:        10 |     200000 | monai",
        *(f"import time:        10 |       1000 | pkg{i}" for i in range(9)),
        "[INFO] - a log line"])
    seconds = import_seconds(synthetic)
    assert list(seconds)[:3] == ["torch", "torch._inductor", "monai"] and seconds["torch._inductor"] == 0.32
    assert len(seconds) == 9 and seconds["other"] == 0.004  # 8 groups, then the 4 smallest summed


def test_the_report_has_a_line_per_row_and_names_failures():
    rows = [{"e2e": "scenario=e2e_sample masks=4 compile_cache=warm", "status": "ok", "message": "", "total_s": 14.2,
             "per_volume_s": 1.95, "compile_cache": "warm", "git_sha": "48d1474d04cc", "dirty": True},
            {"e2e": "scenario=e2e_train compile_cache=cold", "status": "oom",
             "message": "exit code 3; log tail:\n[...] data.cache=auto: memory\nerror: CUDA out of memory. Tried to "
                        "allocate 1.27 GiB. ...; lower train.batch_size or num_samples\n"}]
    lines = report(rows).splitlines()
    assert len(lines) == 4 and "| 48d1474d04cc-dirty | warm |  | 14.2 |" in lines[2] and "| 1.95 |" in lines[2] and lines[2].endswith("| ok |")
    assert lines[3].endswith("| oom: exit code 3: error: CUDA out of memory. Tried to allocate 1.27 GiB. ...; lower "
                             "train.batch_size or num_samples |")
    timed = report([{**rows[0], "import_s": {"torch": 4.25, "torch._inductor": 3.5, "other": 0.25}}]).splitlines()
    assert timed[-1] == "| `scenario=e2e_sample masks=4 compile_cache=warm` | 8.00 | torch 4.25, torch._inductor 3.50, other 0.25 |"


def test_a_job_without_its_keys_and_bad_arguments_are_refused():
    with pytest.raises(SystemExit, match="compile_cache=cold"):
        split_job(["scenario=e2e_sample", "experiment=fast_sample"])
    with pytest.raises(ConfigError, match=r"^e2e.data_root: not set, and preset=e2e trains and samples on real files; pass e2e.data_root=DIR"):
        e2e_args(OmegaConf.create({"out": "x", "budget_s": None, "dry_run": False, "e2e": {"data_root": None}}))
    cfg = {"out": "x", "budget_s": 60, "dry_run": False, "e2e": {"data_root": "d", "checkpoint": None}}
    assert e2e_args(OmegaConf.create(cfg)) == {"out": "x", "data_root": "d", "budget_s": "60"}
    assert e2e_args(OmegaConf.create({**cfg, "dry_run": True}))["budget_s"] == "0"  # lists the jobs, runs none
    listing = {**cfg, "dry_run": True, "e2e": {"data_root": None}}  # and needs no data to list them
    assert e2e_args(OmegaConf.create(listing)) == {"out": "x", "budget_s": "0"}
    with pytest.raises(ConfigError, match=r"^e2e.checkpoint: not set, and the sampling jobs load one; pass "):
        command({"scenario": "e2e_sample"}, [], {"out": "x", "data_root": "d"}, Path("job"))


@pytest.mark.slow
def test_the_real_clis_run_and_leave_rows(whole_head_data, tmp_path):
    """Sampling 3 masks (32^3, 2 DDIM steps) and 6 training steps of a 2-level 16^3 net, in fresh processes."""
    jobs = [["scenario=e2e_sample", "masks=3", "compile_cache=cold", "image_size=[32,32,32]", "sampler=ddim",
             "sampler.steps=2"],
            ["scenario=e2e_train", "compile_cache=cold", "experiment=whole_head", "model=tiny",
             "model.image_size=[16,16,16]", "model.channel_mult=[1,2]", "model.attention_ds=[2]", "train.max_steps=6",
             "data.num_workers=1"]]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):  # as inside bench.ladder's Hydra app
        assert run(iter(jobs), args_for(tmp_path, whole_head_data, import_times="True")) == 0
    sample, train = read_rows(tmp_path)
    assert sample["status"] == train["status"] == "ok", (sample["message"], train["message"])
    assert sample["volumes"] == 3 and sample["image_size"] == [32, 32, 32] and sample["compile_cache"] == "off"
    assert 0 < sample["startup_s"] < sample["total_s"] and sample["per_volume_s"] > 0 and sample["env"]["torch"]
    assert sample["import_s"]["torch"] > 0 and "monai" in train["import_s"]  # training builds MONAI transforms
    assert len(list((tmp_path / "jobs" / "e2e_00" / "run").glob("mask_*.nii.gz"))) == 3
    assert train["steady_steps"] == 3 and train["ms_per_volume"] > 0 and 0 <= train["data_wait_pct"] < 100
    timings = json.loads((tmp_path / "jobs" / "e2e_01" / "run" / "timings.json").read_text())
    assert timings["steps"] == 6 and timings["volumes_per_step"] == 2
    assert run(iter(jobs), args_for(tmp_path, whole_head_data)) == 0 and len(read_rows(tmp_path)) == 2  # resumed: nothing reruns
    table = (tmp_path / "e2e.md").read_text().splitlines()
    assert f"| {sample['total_s']} |" in table[2] and table[3].endswith("| ok |") and table[4] == ""
    assert table[5].startswith("Imports by package") and len(table) == 11  # then a line per row with import_s


@pytest.mark.slow
def test_a_warm_compile_cache_reaches_the_training_loop(whole_head_data, tmp_path):
    """Cold, then warm: the second training run loads the artifacts the first saved after its first step."""
    train = ["scenario=e2e_train", "experiment=whole_head", "model=tiny", "model.image_size=[16,16,16]",
             "model.channel_mult=[1,2]", "model.attention_ds=[2]", "train.max_steps=4", "train.grad_accum=1",
             "data.num_workers=0", "recipe=[compile]"]
    assert run(iter([[*train, "compile_cache=cold"], [*train, "compile_cache=warm"]]), args_for(tmp_path, whole_head_data)) == 0
    cold, warm = read_rows(tmp_path)
    assert (cold["status"], warm["status"]) == ("ok", "ok"), (cold["message"], warm["message"])
    assert (cold["compile_cache"], warm["compile_cache"]) == ("cold", "warm")
    assert "import_s" not in cold and "import time:" not in (tmp_path / "jobs" / "e2e_00" / "run.log").read_text()
    assert len(list((tmp_path / "cache").rglob("train-*.bin"))) == 1
    assert not (tmp_path / "jobs" / "e2e_01" / "prime.log").exists()  # the cold job's cache was reused


def running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (killed, waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.e2e
def test_a_timed_out_command_is_killed_with_its_workers(tmp_path):
    """spawn's timeout kills the command's whole process group: a worker it started does not outlive it."""
    (tmp_path / "sleeper.py").write_text(
        "import subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(tmp_path / 'worker.pid')!r}, 'w').write(str(worker.pid))\n"
        "time.sleep(60)\n")
    code, wall, _ = spawn(["sleeper"], tmp_path / "cache", tmp_path / "run.log", timeout_s=3,
                          env_extra={"PYTHONPATH": str(tmp_path)})
    assert code is None and wall < 30
    worker = int((tmp_path / "worker.pid").read_text())
    deadline = time.time() + 10
    while running(worker) and time.time() < deadline:
        time.sleep(0.1)
    assert not running(worker)


def test_a_grid_job_samples_with_the_sealed_grid_and_refuses_an_edited_one(tmp_path):
    tuned = Path(__file__).parents[2] / "bench" / "results" / "h100" / "tuned" / "quality_model_seed1" / "sampler.yaml"
    overrides = e2e.grid_overrides(tuned)
    assert overrides[0] == "sampler=dpm_solver_pp" and "sampler.steps=25" in overrides
    assert any(o.startswith("sampler.timesteps=[249,") for o in overrides)
    edited = tmp_path / "sampler.yaml"
    edited.write_text(tuned.read_text().replace("steps: 25", "steps: 24"))
    with pytest.raises(ConfigError, match=r"^grid=\S+: edited since med_ddpm.tune wrote it"):
        e2e.grid_overrides(edited)


@pytest.mark.e2e
def test_the_job_waits_for_the_compile_its_command_left_running(tmp_path):
    import subprocess
    import threading

    from med_ddpm.compile_sidecar import MARKER

    assert e2e.wait_for_sidecars(tmp_path, 10) is None  # none: no wait
    sidecar = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    threading.Thread(target=sidecar.wait).start()  # reaped when it ends, as init reaps a finished command's sidecar
    (tmp_path / f"sample-0{MARKER}").write_text(str(sidecar.pid))
    waited = e2e.wait_for_sidecars(tmp_path, 60)
    assert sidecar.poll() is not None and waited is not None and waited > 0
