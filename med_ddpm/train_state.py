"""A training run's state, and saving and restoring it exactly: ``resume=auto`` continues from
``<output_dir>/checkpoints/last.pt`` with the weights, EMA, optimizer, grad scaler, step and every rank's RNG
state, so a killed-and-resumed run ends with the weights of an uninterrupted one (:mod:`med_ddpm.train`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import Dataset

from med_ddpm import distributed
from med_ddpm.checkpoint import load_into, read_checkpoint, save_checkpoint
from med_ddpm.config_checks import CheckpointError
from med_ddpm.data.background import DatasetBuild
from med_ddpm.diffusion import NoiseSchedule
from med_ddpm.model import UNet3D
from med_ddpm.run_clock import RunClock
from med_ddpm.tracking import Tracker
from med_ddpm.utils import seed_everything
from optim import RecipeStack

log = logging.getLogger("med_ddpm.train")


@dataclass(kw_only=True)
class TrainState:
    """What one optimizer step (:func:`med_ddpm.train.train_step`) reads and updates.

    ``cfg`` needs ``seed``, ``diffusion.loss_type`` and the ``train`` keys ``batch_size``,
    ``grad_accum``, ``divide_loss_by_batch_size``, ``ema_every`` and ``ema_start``. :class:`Job`
    adds the data, logging and output folder of a run; ``bench.core.scenarios`` times this state alone.
    """

    cfg: DictConfig
    device: torch.device
    net: UNet3D  # the parameter holder (checkpoints, EMA); `model` may wrap it (recipes, DDP)
    model: torch.nn.Module
    ema: AveragedModel | None  # rank 0 only
    schedule: NoiseSchedule
    stack: RecipeStack
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    step: int = 0


@dataclass(kw_only=True)
class Job(TrainState):
    """Everything :func:`med_ddpm.train.fit` needs, built once from the config (:func:`med_ddpm.train.build`)."""

    data: DatasetBuild  # the dataset, built in another process while the model is prepared
    tracker: Tracker
    out_dir: Path
    clock: RunClock  # start-up marks (timings.json), from the process's start

    @property
    def dataset(self) -> Dataset:
        """The training dataset; the first use waits for its build (:func:`med_ddpm.train.wait_for_data`)."""
        return self.data.result()


def resume_path(job: Job) -> Path | None:
    """The checkpoint ``resume`` points at: ``auto`` = last.pt if present, else a path."""
    resume = job.cfg.get("resume")
    if not resume:
        return None
    path = job.out_dir / "checkpoints" / "last.pt" if resume == "auto" else Path(resume)
    if resume == "auto" and not path.exists():
        log.info("resume=auto: no %s yet, starting from step 0", path)
        return None
    return path


def rng_state(job: Job) -> dict[str, torch.Tensor | None]:
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(job.device) if job.device.type == "cuda" else None}


def save_state(job: Job) -> None:
    """last.pt every save (atomic), plus step_<N>.pt at the save_every cadence.

    Called on every rank (each contributes its RNG state); rank 0 writes, the rest wait.
    """
    rng = distributed.all_gather_object(rng_state(job))  # one entry per rank
    if distributed.is_main():
        write_checkpoints(job, rng)
    distributed.barrier()


def write_checkpoints(job: Job, rng: list[dict]) -> None:
    state = dict(
        model_state=job.net.state_dict(),
        ema_state=job.ema.module.state_dict(),
        config=OmegaConf.to_container(job.cfg, resolve=True),
        step=job.step,
        optimizer=job.optimizer.state_dict(),
        scaler=job.scaler.state_dict(),
        ema_n_averaged=job.ema.n_averaged.clone(),
        rng=rng,
        world_size=len(rng),
        skipped_steps=job.stack.guard.skipped,
    )
    ckpt_dir = job.out_dir / "checkpoints"
    save_checkpoint(ckpt_dir / "last.pt", **state)
    if job.cfg.train.save_every and job.step % job.cfg.train.save_every == 0:
        save_checkpoint(ckpt_dir / f"step_{job.step:07d}.pt", **state)


RESUME_KEYS = ("model", "ema", "optimizer", "scaler", "ema_n_averaged", "rng", "step")


def restore_state(job: Job, path: Path) -> None:
    """Load weights, EMA, optimizer, scaler, step and RNG states for an exact continuation."""
    ckpt = read_checkpoint(path, option="resume", fix="pass resume=auto, or a checkpoint written by med_ddpm.train")
    missing = [k for k in RESUME_KEYS if ckpt.get(k) is None]
    if missing or "model" not in (ckpt.get("config") or {}):
        raise CheckpointError(f"{path}: not a training checkpoint of this project (missing {missing or ['config.model']}); "
                              "resume needs one written by med_ddpm.train")
    if ckpt["config"]["model"] != OmegaConf.to_container(job.cfg.model, resolve=True):
        raise CheckpointError(f"{path}: model config differs from this run's (model={ckpt['config']['model']})")
    load_into(job.net, ckpt["model"], f"{path} [model]")
    if job.ema is not None:
        load_into(job.ema.module, ckpt["ema"], f"{path} [ema]")
        job.ema.n_averaged.copy_(ckpt["ema_n_averaged"])
    job.optimizer.load_state_dict(ckpt["optimizer"])
    job.scaler.load_state_dict(ckpt["scaler"])
    job.stack.guard.skipped = ckpt.get("skipped_steps", 0)
    job.step = int(ckpt["step"])
    restore_rng(job, ckpt["rng"])
    log.info("resumed from %s at step %d", path, job.step)


def restore_rng(job: Job, rng: list[dict]) -> None:
    """Each rank's own RNG state; with another world size, re-seed (only dropout draws from it)."""
    if len(rng) != distributed.world_size():
        log.info("resuming %d ranks from a %d-rank checkpoint: per-rank RNG re-seeded (data order and t/noise "
                 "stay exact)", distributed.world_size(), len(rng))
        seed_everything(distributed.derived_seed(job.cfg.seed, distributed.rank(), job.step))
        return
    mine = rng[distributed.rank()]
    torch.set_rng_state(mine["torch"])
    if mine["cuda"] is not None:
        torch.cuda.set_rng_state(mine["cuda"], job.device)
