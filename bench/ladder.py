"""The standard benchmark ladders: a fixed, ordered list of jobs per preset into one results.jsonl.

Example (Hydra overrides of ``configs/ladder.yaml``):
    python -m bench.ladder preset=evidence out=bench/results/h100  # every row of one GPU's evidence (make bench)
    python -m bench.ladder preset=core out=results/h200            # the short whole-head 128^3 ladder
    python -m bench.ladder preset=targets out=results/h200 budget_s=540   # stop starting jobs after 9 min
    python -m bench.ladder preset=gpu out=results/h200 'best=[amp_bf16,compile]'  # choose the "best stack"
    python -m bench.ladder preset=smoke out=results/smoke          # tiny CPU ladder
    python -m bench.ladder preset=smoke out=results/smoke logger=wandb  # and one offline W&B run per job
    python -m bench.ladder preset=core out=results/h200 dry_run=true   # list the jobs and their status
    python -m bench.ladder preset=core out=results/h200 refresh=compile  # re-measure after a code change
    python -m bench.ladder preset=core out=results/h200 only=full_sample  # just the jobs a regex names
    python -m bench.ladder preset=core out=results/h200 "only='batch_size=(2|4)'"  # quote a regex with = ( | [
    python -m bench.ladder preset=quality out=results/h200/quality checkpoint=runs/quality_model/checkpoints/last.pt
    python -m bench.ladder preset=quality_training out=results/h200/quality/training budget_s=450
    python -m bench.ladder preset=quality_128 out=results/h100/quality/gates_128 checkpoint=CKPT budget_s=480
    python -m bench.ladder preset=e2e out=results/e2e e2e.data_root=DATA e2e.checkpoint=CKPT

The presets are config files, ``configs/ladder/preset/<name>.yaml`` (:mod:`bench.core.presets`): each an ordered list
of jobs, a name and Hydra overrides of ``configs/bench.yaml`` each, composed with Hydra's compose API and measured by
the same subprocess worker as ``bench.sweep``. A job that times an experiment's stack names the experiment
(``experiment=fast_train``), so the stack has one source: its config. :data:`COMMAND_PRESETS` run otherwise:
``e2e`` (the real commands in fresh processes, :mod:`bench.core.e2e`), ``quality_training`` (:mod:`bench.quality.training`),
``quality_128`` (gates without timings, :mod:`bench.quality.gates`) and ``evidence`` (every kind of job, one run,
:mod:`bench.evidence`).

Resumable: a job whose row is already in ``<out>/results.jsonl`` is skipped, so a ladder longer
than one 10-minute device command is finished by running the same command again. The time
budget stops *starting* jobs once spent; a job cut by the budget leaves no row (it reruns next
time) unless it had the whole budget to itself, in which case it is recorded as a timeout so
the ladder moves on. Jobs run in importance order. The strict-FP32 baseline of every workload is in the ladder
(and :class:`bench.core.runner.EnsureBaseline` adds any that a cut run missed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from bench import evidence
from bench.core import presets
from bench.core.e2e import run as run_commands
from bench.core.runner import Job, picked, run_ladder
from bench.core.subprocesses import stopped_together
from bench.core.wandb_runs import log_unlogged
from bench.quality.gates import run as gate_jobs
from bench.quality.training import run as train_and_gate
from bench.quality.training import visible_gpus
from bench.quality.training_report import write_training_report
from med_ddpm import cli
from med_ddpm.config_checks import ConfigError, check_int, check_number
from med_ddpm.tracking import check_logger


def e2e_args(cfg: DictConfig) -> dict[str, str]:
    """The ``e2e:`` block of configs/ladder.yaml and the shared keys, as :func:`bench.core.e2e.run` takes them."""
    if not cfg.e2e.data_root and not cfg.dry_run:  # a dry run lists the jobs and reads no data
        raise ConfigError("e2e.data_root: not set, and preset=e2e trains and samples on real files; pass "
                          "e2e.data_root=DIR (a whole-head DATA folder with image/ and mask/) and e2e.checkpoint=PATH")
    args = {"out": cfg.out, **{k: v for k, v in cfg.e2e.items() if v is not None}}
    if cfg.budget_s is not None:
        args["budget_s"] = cfg.budget_s
    if cfg.dry_run:
        args["budget_s"] = 0  # no time to run one: every job without a row is listed as to do
    return {k: str(v) for k, v in args.items()}


def run_e2e(cfg: DictConfig) -> int:
    args, jobs = e2e_args(cfg), ladder_jobs(cfg)
    if not cfg.dry_run:
        require_gpu(cfg.preset)
    return run_commands(jobs, args)


def run_quality_training(cfg: DictConfig) -> int:
    q = cfg.quality_training
    steps = check_int(cfg, "quality_training.steps", 1)
    gpus = check_int(cfg, "quality_training.gpus", 1)
    seeds = check_int(cfg, "quality_training.seeds", 1)
    per_gpu = check_int(cfg, "quality_training.per_gpu", 1)
    budget_s = math.inf if cfg.budget_s is None else float(cfg.budget_s)
    size = [] if q.image_size is None else [f"model.image_size=[{','.join(str(int(n)) for n in q.image_size)}]"]
    slots = () if cfg.dry_run or gpus * per_gpu == 1 else [g for g in visible_gpus(gpus) for _ in range(per_gpu)]
    left = train_and_gate(Path(cfg.out), steps, list(q.control), q.experiment, Path(q.runs), budget_s,
                          [*size, *q.overrides], slots,
                          dry_run=cfg.dry_run, seeds=seeds)
    if not cfg.dry_run:
        write_training_report(Path(cfg.out))
    return left


def run_gates(cfg: DictConfig) -> int:
    if not cfg.dry_run:
        require_gpu(cfg.preset)
    return gate_jobs(cfg)


def run_evidence(cfg: DictConfig) -> int:
    if not cfg.dry_run:
        require_gpu(cfg.preset)
    return evidence.run(cfg)


# The step presets a machine without a CUDA GPU runs; every other one, and e2e, times GPU workloads.
# (quality_training trains what its overrides say: a tiny model trains on a CPU.)
CPU_PRESETS = ("smoke",)
# Presets that run otherwise than the step worker's list of jobs.
COMMAND_PRESETS: dict[str, Callable[[DictConfig], int]] = {
    "e2e": run_e2e, "quality_training": run_quality_training, "evidence": run_evidence, "quality_128": run_gates}


def ladder_jobs(cfg: DictConfig) -> list[Job]:
    """The jobs of ``cfg.preset`` (:func:`run` checked its name), only those ``cfg.only`` (a regex over a job's
    overrides) names if set."""
    jobs = [job.overrides for job in presets.jobs(cfg.preset, cfg)]
    return picked(jobs, cfg.only, cfg.preset) if cfg.only else jobs


def check_preset(preset: str) -> None:
    known = dict.fromkeys([*presets.names(), *COMMAND_PRESETS])
    if preset not in known:
        raise ConfigError(f"bench.ladder: unknown preset={preset}; known: {', '.join(known)}")


def require_gpu(preset: str) -> None:
    """Refuse to run a GPU preset's jobs on a machine without CUDA: its 128³ jobs would run for hours on the CPU
    (or time out one by one) and leave error rows. Called after the options are checked and not for a dry run,
    which lists the jobs."""
    import torch

    if preset not in CPU_PRESETS and not torch.cuda.is_available():
        raise ConfigError(f"preset={preset}: times GPU workloads and this machine shows no CUDA GPU; run it on "
                          f"a GPU machine, pass preset={' or '.join(CPU_PRESETS)} here, or dry_run=true to list its jobs")


def run(cfg: DictConfig) -> int:
    """Run the ladder ``cfg`` (configs/ladder.yaml) describes; return the jobs left.

    ``preset=e2e`` runs the real CLIs from process start (:mod:`bench.core.e2e`), not the step worker."""
    check_preset(cfg.preset)
    if cfg.budget_s is not None:
        check_number(cfg, "budget_s", 0.0)
    wandb = check_logger(cfg.logger)
    if cfg.preset in COMMAND_PRESETS:
        left = COMMAND_PRESETS[cfg.preset](cfg)
        if wandb and not cfg.dry_run:  # its jobs are commands of their own: their rows are logged once they are in
            log_unlogged(Path(cfg.out), str(cfg.logger.mode))
        return left
    budget_s = math.inf if cfg.budget_s is None else float(cfg.budget_s)
    jobs = ladder_jobs(cfg)
    if not cfg.dry_run:
        require_gpu(cfg.preset)  # after the options: a bad one is named on any machine
    # only= runs just the jobs it names: the missing baselines are not among them
    return run_ladder(Path(cfg.out), jobs, budget_s, cfg.dry_run, cfg.refresh, complete_baselines=not cfg.only,
                      logger=OmegaConf.to_container(cfg.logger, resolve=True) if wandb else None)


@hydra.main(config_path=cli.CONFIG_PATH, config_name="ladder", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> int:
    with stopped_together():  # Ctrl-C or an outer timeout also stops the commands e2e and quality_training run
        return run(cfg)


console = cli.console(main)  # the med-ddpm-ladder command


if __name__ == "__main__":
    console()
