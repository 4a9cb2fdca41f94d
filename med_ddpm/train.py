"""Train Med-DDPM: ``python -m med_ddpm.train [experiment=whole_head] [data.root=...] ['recipe=[amp_bf16]']``.

Reads top to bottom: :func:`main` checks the options and calls :func:`build`, which turns the Hydra config
into objects; :func:`fit` is the loop and :func:`train_step` the one optimizer step (bench times it, tests call
it), with every recipe hook (session, prepare_model, prepare_input, forward_context, grad_scaler, non-finite
guard) visible in them; the helpers they call follow. Policy lives in modules named for it: the GPU memory cap
and its allocator setting in :mod:`med_ddpm.memory_cap`, the run's state and its exact save and restore in
:mod:`med_ddpm.train_state`. Defaults reproduce Med-DDPM's trainer: Adam 1e-5, batch 1, gradient
accumulation 2, EMA 0.995 every 10 steps from step 2000, L1.

Resumable: ``resume=auto`` continues from ``<output_dir>/checkpoints/last.pt``. The data
order and the t/noise draws are functions of the global sample position and the RNG states
are saved, so a killed-and-resumed run ends with exactly the weights of an uninterrupted one.

Multi-GPU: ``torchrun --nproc_per_node=N -m med_ddpm.train ...`` runs DistributedDataParallel.
Each rank takes every N-th position of one global sample stream (:class:`EpochSampler`), and
every sample's t and ε come from a generator keyed by (seed, global position), so N ranks
with ``train.batch_size=b`` compute the gradient of one rank with batch N·b (DDP averages
it). Resuming with a different N is therefore exact for weights, optimizer, EMA, data order
and t/ε; only the per-rank global RNG (dropout, if any) is re-seeded. EMA, logs,
checkpoints and previews happen on rank 0; the logged loss is the mean over ranks.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Sampler
from tqdm.auto import tqdm

from med_ddpm import cli, distributed
from med_ddpm.compile_cache import CompileCache, cache_status, precompiled_report, train_workload
from med_ddpm.config_checks import (
    ConfigError,
    OutputError,
    as_config_error,
    check_device,
    check_int,
    check_model_size,
    check_number,
)
from med_ddpm.data.background import DatasetBuild
from med_ddpm.data.datasets import dataset_variant
from med_ddpm.data.encoding import Variant
from med_ddpm.data.volume_io import save_montage_png
from med_ddpm.diffusion import NoiseSchedule, diffusion_loss
from med_ddpm.memory_cap import cap_memory, check_cap_held, expandable_segments_under_cap
from med_ddpm.model import UNet3D, build_model
from med_ddpm.preemption import Watch, resume_command
from med_ddpm.run_clock import LoopTimer, RunClock, TimedIterator, synchronize
from med_ddpm.samplers import check_sampler, sample, sampler_from_config
from med_ddpm.tracking import check_logger, finish_training, training_tracker
from med_ddpm.train_state import Job, TrainState, restore_state, resume_path, save_state
from med_ddpm.utils import append_line, seed_everything
from optim import RecipeStack

log = logging.getLogger("med_ddpm.train")
LOSS_LOG = "loss.jsonl"  # <output_dir>/loss.jsonl: every logged step's metrics, whatever the logger


@hydra.main(config_path=cli.CONFIG_PATH, config_name="train", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> float:
    """Hydra entry point; returns the final loss (so Optuna sweeps can minimise it)."""
    check_output_dir(cli.output_dir(cfg), cfg.resume)
    check_options(cfg)
    expandable_segments_under_cap(cfg.train.get("memory_cap_gib"))
    with as_config_error("options", "check the option it names (python -m med_ddpm.train --cfg job lists them)"):
        job = build(cfg)  # the data, model and recipe constructors check their own options
    summary = fit(job)
    if distributed.is_main():
        log.info("done: step %d loss %.5f, %.2f it/s; checkpoints in %s", summary["step"], summary["loss"],
                 summary["it_per_s"], Path(cfg.output_dir) / "checkpoints")
    distributed.cleanup()
    return summary["loss"]


def fit(job: Job) -> dict[str, Any]:
    """The training loop: resume, then steps with EMA, logging, previews and atomic checkpoints.

    Rank 0 writes where the time went to ``<output_dir>/timings.json``: start-up, the first step
    (compilation), the steady state per volume and the share of it spent waiting for data; and every
    logged step's metrics to ``<output_dir>/loss.jsonl``, one whole JSON line each (the tracker's, without
    one). A resumed run appends: a step logged twice, the later line counts.
    """
    cfg = job.cfg.train
    rank0 = distributed.is_main()
    cap_memory(job.device, cfg.get("memory_cap_gib"))
    with job.stack.session(), Watch() as stop:  # SIGTERM, Ctrl-C: last.pt at the next step's top, exit (preemption.py)
        cache = compile_cache(job)
        if cache is not None:
            cache.load()
        job.model = distributed.wrap_ddp(job.stack.prepare_model(job.net), job.device)
        if (path := resume_path(job)) is not None:
            restore_state(job, path)
        job.clock.mark("model_ready")
        if warm_up(job):
            job.clock.mark("warmed_up")
        wait_for_data(job)
        batches = batch_stream(job)
        if job.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(job.device)
        bar = tqdm(total=cfg.max_steps, initial=job.step, desc="train", disable=not (cfg.progress and rank0))
        timer = LoopTimer(job.clock, job.device, batches, cfg.batch_size * cfg.grad_accum)
        t0, start_step, loss = time.perf_counter(), job.step, torch.tensor(float("nan"))
        while job.step < cfg.max_steps:
            if stop.requested():
                stop.exit(lambda: save_state(job), job.step, resume_command(job.cfg.output_dir))
            loss = train_step(job, batches)
            bar.update(1)
            if timer.step_done(last=job.step == cfg.max_steps) and cache is not None and rank0:
                cache.save()
            if rank0 and (job.step % job.cfg.logger.get("log_every", 10) == 0 or job.step == cfg.max_steps):
                value = loss.item()  # the loop's one wait for the GPU between logs
                bar.set_postfix(loss=f"{value:.4f}")
                logged = metrics(job, value, t0, start_step)
                job.tracker.log(logged, step=job.step)
                append_line(job.out_dir / LOSS_LOG, json.dumps(logged))
            if rank0 and cfg.sample_every and job.step % cfg.sample_every == 0:
                png = sample_preview(job, job.dataset[0]["cond"][None].to(job.device))
                job.tracker.log_image("sample", png, step=job.step)
            if (cfg.save_every and job.step % cfg.save_every == 0) or job.step == cfg.max_steps:
                save_state(job)
        bar.close()
        summary = metrics(job, loss.item(), t0, start_step) | {"recipes": job.stack.describe()}
    if rank0:
        reserved = torch.cuda.max_memory_reserved(job.device) / 2**30 if job.device.type == "cuda" else None
        check_cap_held(cfg.get("memory_cap_gib"), reserved)
        timings = timer.write(job.out_dir, compile_cache=cache_status(cache), precompiled=precompiled_report(job.net),
                              recipes=job.stack.names,
                              peak_mem_gib=summary.get("peak_mem_gib"), peak_reserved_gib=reserved,
                              memory_cap_gib=cfg.get("memory_cap_gib"))
        finish_training(job.tracker, summary, timings)
    return summary


def train_step(job: TrainState, batches: Iterator[dict]) -> torch.Tensor:
    """One optimizer step of ``grad_accum`` micro-batches, then the EMA update; returns the mean loss
    over ranks (NaN if skipped) and counts the step.

    The loss comes back as a 0-d device tensor: reading it waits for the GPU, so :func:`fit` reads
    it only when it logs. Each micro-batch's loss, averaged over ranks, goes to the stack's guard
    *before* its backward. The default guard reads it on the host there: a non-finite loss skips
    the step's remaining backwards and its update on every rank, counted once (the remaining
    batches are still drawn: the data stream stays at step × grad_accum, as resume expects).
    Waiting before backward rather than after it lets the host queue Adam and the next forward
    while the GPU runs the backward. ``fused_adam(guard=device)`` does not wait at all: fused
    Adam skips a non-finite step's update on the GPU. Gradients are all-reduced once, on the
    last micro-step (``no_sync`` before it).
    """
    cfg = job.cfg.train
    world = distributed.world_size()
    job.optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    for micro in range(cfg.grad_accum):
        batch = next(batches)
        if len(losses) < micro:  # the guard skipped an earlier micro-batch: drawn, not trained on
            continue
        x = job.stack.prepare_input(batch["image"].to(job.device, non_blocking=True))
        cond = job.stack.prepare_input(batch["cond"].to(job.device, non_blocking=True))
        t, noise = draw_t_noise(job, x, first=(job.step * cfg.grad_accum + micro) * cfg.batch_size * world)
        with distributed.sync_context(job.model, sync=micro == cfg.grad_accum - 1):
            with job.stack.forward_context():
                loss = diffusion_loss(job.model, job.schedule, x, cond, t=t, noise=noise,
                                      loss_type=job.cfg.diffusion.loss_type)
            if cfg.divide_loss_by_batch_size:  # Med-DDPM's trainer: loss.sum() / batch_size of a mean
                loss = loss / (x.shape[0] * world)  # the global batch: N ranks of b == one rank of N·b
            mean = distributed.mean_over_ranks(loss.detach())  # NaN on any rank: NaN on all, all skip alike
            if job.stack.finite_or_skip(mean, job.optimizer):
                job.scaler.scale(loss / cfg.grad_accum).backward()
                losses.append(mean)
    trained = len(losses) == cfg.grad_accum
    if trained:
        job.scaler.step(job.optimizer)
        job.scaler.update()
    update_ema(job)
    job.step += 1
    return torch.stack(losses).sum() / cfg.grad_accum if trained else torch.tensor(float("nan"))


def draw_t_noise(job: TrainState, x: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t ~ U{0, T−1} and ε ~ N(0, I) of each sample, from a generator keyed by its global position.

    This rank's j-th sample of a micro-batch starting at global position ``first`` sits at
    first + rank + W·j (:class:`EpochSampler`). Keying by position makes a sample's draws
    independent of the rank and micro-batch it lands in, whatever the world size.
    """
    world, rank = distributed.world_size(), distributed.rank()
    ts, noises = [], []
    for j in range(x.shape[0]):
        gen = distributed.keyed_generator(job.device, job.cfg.seed, first + rank + world * j)
        ts.append(torch.randint(0, job.schedule.num_train_timesteps, (1,), device=job.device, generator=gen))
        noises.append(torch.randn(x.shape[1:], device=job.device, generator=gen, dtype=torch.float32))
    return torch.cat(ts), torch.stack(noises)


def update_ema(job: TrainState) -> None:
    """Med-DDPM's ``step_ema`` after the optimizer step of step ``job.step`` (before it is counted):
    every ``ema_every`` steps, a plain copy of the weights before ``ema_start``, an average from then on
    (rank 0 only)."""
    if job.ema is None or job.step % job.cfg.train.ema_every:
        return
    if job.step < job.cfg.train.ema_start:
        job.ema.module.load_state_dict(job.net.state_dict())
    else:
        job.ema.update_parameters(job.net)


def build(cfg: DictConfig) -> Job:
    """Instantiate data, network, EMA, schedule, recipes, optimizer and tracker from ``cfg``.

    Under torchrun this joins the process group first and takes this rank's GPU.
    """
    clock = RunClock("train")
    clock.mark("run_start")
    check_compatible(dataset_variant(cfg.data), cfg.model)
    data = DatasetBuild(OmegaConf.to_container(cfg.data, resolve=True, throw_on_missing=True), cfg.model.image_size)
    device = distributed.init_from_env(cfg.device)
    seed_everything(cfg.seed)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    stack = RecipeStack.from_config(cfg.get("recipe"))
    stack.require(device)
    stack.require_training(cfg.train.grad_accum)
    with as_config_error("model", "see configs/model/ for valid settings", errors=(ValueError, TypeError)):
        net = build_model(cfg.model)  # the U-Net checks its own options (e.g. num_heads divides the channels)
    net = net.to(device)
    rank0 = distributed.is_main()
    ema = new_ema(net, cfg.train.ema_decay) if rank0 else None
    seed_everything(cfg.seed + distributed.rank())  # per-rank dropout masks
    schedule = NoiseSchedule.from_config(cfg.diffusion).to(device)
    out_dir = Path(distributed.broadcast_object(str(cfg.output_dir)))  # Hydra's timestamped dir may differ per rank
    resolved = OmegaConf.to_container(cfg, resolve=True)
    clock.mark("model_built")  # recipes built, network and EMA on the device
    return Job(
        cfg=cfg,
        device=device,
        data=data,
        net=net,
        model=net,  # fit() applies stack.prepare_model inside the recipe session
        ema=ema,
        schedule=schedule,
        stack=stack,
        optimizer=torch.optim.Adam(net.parameters(), lr=cfg.train.lr, **stack.optimizer_options()),
        scaler=stack.grad_scaler(device.type),
        tracker=training_tracker(cfg.get("logger") if rank0 else None, resolved, out_dir, cfg.get("resume"),
                                 experiment_name()),
        out_dir=out_dir,
        clock=clock,
    )


def experiment_name() -> str | None:
    """The ``experiment=`` chosen (the W&B run's default group), None outside a Hydra run or without one."""
    return HydraConfig.get().runtime.choices.get("experiment") if HydraConfig.initialized() else None


def warm_up(job: Job, passes: int = 2) -> bool:
    """Forward and backward passes on zeros shaped as the first batch, where the stack's first calls are slow (a
    compile recipe: loading the compiled graphs, cuDNN autotuning, and CUDA-graph trees, which record a function at
    its second call), so that they run while the dataset is still being built instead of in the first step.

    Nothing a step depends on changes: the gradients are dropped, the random state is restored, and no batch is
    drawn. Skipped (False) for a stack whose first call is not slow."""
    if not job.stack.slow_first_call:
        return False
    cfg, variant = job.cfg, dataset_variant(job.cfg.data)
    shape = (cfg.train.batch_size, variant.image_channels, *cfg.model.image_size)
    x = job.stack.prepare_input(torch.zeros(shape, device=job.device))
    cond = job.stack.prepare_input(torch.zeros((shape[0], variant.cond_channels, *shape[2:]), device=job.device))
    t, noise = torch.zeros(shape[0], dtype=torch.long, device=job.device), torch.zeros(shape, device=job.device)
    with torch.random.fork_rng(devices=[job.device] if job.device.type == "cuda" else []):
        for _ in range(passes):
            with job.stack.forward_context():
                loss = diffusion_loss(job.model, job.schedule, x, cond, t=t, noise=noise, loss_type=cfg.diffusion.loss_type)
            loss.backward()
            job.optimizer.zero_grad(set_to_none=True)  # as a step starts: no gradient accumulates into a graph output
    synchronize(job.device)
    return True


def wait_for_data(job: Job) -> None:
    """The dataset, built in another process since the run started (:class:`DatasetBuild`); marks ``data_ready``
    and records the build's own seconds."""
    job.data.result()  # a user error raised as it was; another keeps the build's traceback in its notes
    job.clock.mark("data_ready")
    job.clock.set(data_build_s=round(job.data.seconds, 4))


def check_compatible(v: Variant, model_cfg: DictConfig) -> None:
    """Image + mask channels of the data (its variant ``v``) must be what the network takes and predicts."""
    if (v.image_channels, v.image_channels + v.cond_channels) != (model_cfg.out_channels, model_cfg.in_channels):
        raise ConfigError(
            f"data variant {v.name!r} has {v.image_channels} image + {v.cond_channels} mask channels but the model "
            f"takes in_channels={model_cfg.in_channels}, out_channels={model_cfg.out_channels}; "
            "pick a matching model= / data.variant="
        )


def new_ema(net: UNet3D, decay: float) -> AveragedModel:
    """EMA θ' ← decay·θ' + (1 − decay)·θ. Its initial copy counts as one average (``n_averaged = 1``),
    so the first update averages, as Med-DDPM's ``update_model_average`` does, instead of copying."""
    ema = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    ema.n_averaged.fill_(1)
    return ema


def batch_stream(job: Job) -> TimedIterator:
    """This rank's batches from the current step on, timed: the seconds the loop waits for data.

    Workers (``data.num_workers``) prepare batches ahead (``prefetch_factor`` each) and the loader pins them,
    so ``train_step``'s ``non_blocking`` copies overlap; with ``data.cache=memory`` a worker only collates.
    """
    cfg, world = job.cfg.train, distributed.world_size()
    start = job.step * cfg.grad_accum * cfg.batch_size * world  # global sample position
    sampler = EpochSampler(len(job.dataset), job.cfg.seed, start, distributed.rank(), world)
    loader = DataLoader(job.dataset, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        num_workers=cfg.num_workers, pin_memory=job.device.type == "cuda",
                        prefetch_factor=4 if cfg.num_workers else None)
    return TimedIterator(iter(loader))


class EpochSampler(Sampler[int]):
    """Endless, seeded shuffling that can start at any global sample position, sharded over ranks.

    Global position p is sample ``perm_e[p % n]`` of epoch e = p // n, with perm_e drawn from
    seed + e, so resuming at p replays exactly the order an uninterrupted run would see. Rank r
    of W takes positions start + r, start + r + W, ...: the W ranks' k-th batches of b together
    are global positions [start + k·W·b, start + (k+1)·W·b), one big batch split round-robin.
    """

    def __init__(self, n: int, seed: int, start: int = 0, rank: int = 0, world_size: int = 1):
        self.n, self.seed, self.start, self.rank, self.world_size = n, seed, start, rank, world_size

    def __iter__(self) -> Iterator[int]:
        p, epoch, perm = self.start + self.rank, None, []
        while True:
            e, offset = divmod(p, self.n)
            if e != epoch:
                epoch, perm = e, torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + e)).tolist()
            yield perm[offset]
            p += self.world_size


def compile_cache(job: Job) -> CompileCache | None:
    """The project's compile cache for this run's stack and workload (None without a compile recipe)."""
    workload = train_workload(OmegaConf.to_container(job.cfg.model, resolve=True), job.cfg.train.batch_size,
                              job.cfg.train.grad_accum, distributed.world_size())
    return CompileCache.for_run(job.cfg.get("paths", {}).get("compile_cache"), "train", job.stack, job.device, workload)


@torch.no_grad()
def sample_preview(job: Job, cond: torch.Tensor) -> Path:
    """Sample one volume with the EMA weights for the first training mask; write a PNG montage."""
    sampler = sampler_from_config(job.cfg.sampler, job.schedule)
    x0 = sample(job.ema.module, sampler, cond[:1], progress=False, forward_context=job.stack.forward_context)
    path = job.out_dir / "samples" / f"step_{job.step:07d}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_montage_png(x0[0].cpu(), cond[0].cpu(), path, title=f"EMA sample, step {job.step}")
    return path


def metrics(job: Job, loss: float, t0: float, start_step: int) -> dict[str, Any]:
    elapsed = max(time.perf_counter() - t0, 1e-9)
    out = {"loss": loss, "lr": job.optimizer.param_groups[0]["lr"], "step": job.step,
           "it_per_s": (job.step - start_step) / elapsed, "skipped_steps": job.stack.guard.skipped,
           "world_size": distributed.world_size()}
    if job.device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(job.device) / 2**30
    return out


def read_loss_log(run: Path) -> tuple[list[int], list[float]]:
    """(steps, losses) of a run's ``loss.jsonl``; a step logged twice (a resumed run) keeps its last line."""
    path = Path(run) / LOSS_LOG
    by_step = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a killed writer's last line
            continue
        by_step[int(record["step"])] = float(record["loss"])
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def check_options(cfg: DictConfig) -> None:
    """Refuse, before anything is built, a value the loop would divide by, ignore or change."""
    for key in ("train.max_steps", "train.batch_size", "train.grad_accum", "train.ema_every"):
        check_int(cfg, key, 1)
    check_int(cfg, "train.save_every", 0, meaning=" (0: only last.pt, written at the end)")
    check_int(cfg, "train.sample_every", 0, meaning=" (0: off)")
    for key in ("train.ema_start", "train.num_workers", "seed"):
        check_int(cfg, key, 0)
    check_number(cfg, "train.lr", 0.0, low_open=True)
    check_number(cfg, "train.ema_decay", 0.0, 1.0)
    if "log_every" in cfg.logger:
        check_int(cfg, "logger.log_every", 1)
    check_logger(cfg.logger)
    check_model_size(cfg)
    check_device(cfg)
    check_sampler(cfg.sampler, cfg.diffusion)


def check_output_dir(out_dir: Path, resume: str | None) -> None:
    """A run that does not resume must not overwrite another run's checkpoints."""
    if not resume and (out_dir / "checkpoints" / "last.pt").exists():
        raise OutputError(f"output_dir={out_dir}: already holds a training run (checkpoints/last.pt); pass "
                          "resume=auto to continue it, or choose another output_dir=")


console = cli.console(main)  # the med-ddpm-train command


if __name__ == "__main__":
    console()
