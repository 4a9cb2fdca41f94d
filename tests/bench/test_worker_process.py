"""Several jobs of one stack in one worker process (the ladder's ``process``): one model, each job its own inputs,
iterations and row, a failure its own row; a job timed once; and the compile-cache key a bench job shares with the
command of the same workload."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra import compose
from omegaconf import OmegaConf

from bench.core import scenarios, worker
from bench.core.runner import compose_job
from med_ddpm import cli, train
from med_ddpm.checkpoint import load_checkpoint, save_checkpoint
from med_ddpm.data.masks import sampling_geometry
from med_ddpm.model import build_model
from med_ddpm.sample import compile_cache as sample_cache
from optim import RecipeStack

pytestmark = pytest.mark.filterwarnings("ignore:noisy timing")


def job(tmp_path, *overrides: str) -> dict:
    return compose_job(["experiment=bench_smoke", "bench.warmup=0", "bench.iters=2", *overrides], tmp_path)


def test_jobs_of_one_process_share_the_model_and_keep_their_own_rows(tmp_path, monkeypatch):
    built = []
    init, inputs, batches = scenarios.randomize_zero_init, scenarios.make_inputs, []
    monkeypatch.setattr(scenarios, "randomize_zero_init", lambda net, seed: built.append(1) or init(net, seed))
    monkeypatch.setattr(scenarios, "make_inputs", lambda m, batch, *a: batches.append(batch) or inputs(m, batch, *a))
    jobs = [job(tmp_path, "bench=denoise_step"), job(tmp_path, "bench=train_step", "bench.batch_size=2"),
            job(tmp_path, "bench=train_step", "bench.inject=error"),
            job(tmp_path, "bench=full_sample", "sampler=ddim", "sampler.steps=2", "bench.time_first_call=false",
                "bench.iters=1")]
    rows = worker.measure(jobs, tmp_path / "rows.json")
    assert len(built) == 1 and batches == [1, 2, 1, 1], "one model for the process, each job its own inputs"
    assert [r["status"] for r in rows] == ["ok", "ok", "error", "ok"] and "injected failure" in rows[2]["message"]
    assert [r["scenario"] for r in rows] == ["denoise_step", "train_step", "train_step", "full_sample"]
    assert rows[1]["batch_size"] == 2 and rows[1]["iters"] == 2 and rows[0]["first_call_s"] > 0
    assert rows[3]["iters"] == 1 and rows[3]["warmup"] == 0 and rows[3]["first_call_s"] is None
    assert rows[3]["compile_s"] is None and rows[3]["ms_median"] > 0


def test_a_stack_the_process_cannot_prepare_is_every_row_s_reason(tmp_path):
    jobs = [job(tmp_path, "bench=denoise_step", "recipe=[amp_fp16]"), job(tmp_path, "bench=train_step",
                                                                          "recipe=[amp_fp16]")]
    rows = worker.measure(jobs, tmp_path / "rows.json")
    assert {r["status"] for r in rows} == {"unsupported"} and all("amp_fp16" in r["message"] for r in rows)


def stack_and_net(cfg: dict):
    return RecipeStack.from_config(cfg["recipe"]), build_model(cfg["model"])


def test_a_bench_train_step_names_the_compile_cache_file_the_training_command_names(tmp_path):
    cfg = compose_job(["model=tiny", "bench=train_step", "recipe=[compile]", "bench.batch_size=2",
                       f"bench.compile_cache={tmp_path}"], tmp_path)["config"]
    stack, net = stack_and_net(cfg)
    bench_cache = scenarios.compile_cache(cfg, stack, net, torch.device("cpu"))
    with cli.configs():
        command = compose("train", overrides=["model=tiny", "recipe=[compile]", "train.batch_size=2",
                                              "train.grad_accum=1", f"paths.compile_cache={tmp_path}",
                                              f"output_dir={tmp_path}"])
    cli_cache = train.compile_cache(SimpleNamespace(cfg=command, stack=stack, device=torch.device("cpu")))
    assert bench_cache.path == cli_cache.path
    other = compose_job(["model=tiny", "bench=train_step", "recipe=[compile]", f"bench.compile_cache={tmp_path}"],
                        tmp_path)["config"]
    assert scenarios.compile_cache(other, stack, net, torch.device("cpu")).path != cli_cache.path  # batch 1


def test_a_bench_sample_names_the_compile_cache_file_the_sampling_command_names(tmp_path):
    cfg = compose_job(["model=tiny", "bench=full_sample", "recipe=[compile]", f"bench.compile_cache={tmp_path}"],
                      tmp_path)["config"]
    stack, net = stack_and_net(cfg)
    checkpoint = tmp_path / "tiny.pt"
    save_checkpoint(checkpoint, model_state=net.state_dict(), ema_state=net.state_dict(), step=0,
                    config={"model": cfg["model"], "diffusion": cfg["diffusion"], "data": {}})
    with cli.configs():
        command = compose("sample", overrides=[f"checkpoint={checkpoint}", "recipe=[compile]",
                                               f"paths.compile_cache={tmp_path}"])
    loaded = load_checkpoint(checkpoint)
    cli_cache = sample_cache(command, loaded, stack, torch.device("cpu"), sampling_geometry(loaded, command)[1])
    assert scenarios.compile_cache(cfg, stack, net, torch.device("cpu")).path == cli_cache.path
    assert OmegaConf.select(command, "num_samples") == cfg["bench"]["batch_size"] == 1
