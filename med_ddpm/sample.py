"""Sample volumes for masks: ``python -m med_ddpm.sample checkpoint=PATH masks=DIR output_dir=OUT``.

Accepts this project's checkpoints and original Med-DDPM ones (architecture inferred from
the weights). For every mask it writes ``<mask name>.nii.gz`` (``_k`` suffixes when
``num_samples > 1``) with that mask's affine and header, plus a PNG montage of mid-slices
(image | mask overlay). Fewer steps: ``sampler=ddim sampler.steps=50`` (or dpm_solver_pp, deis).
Recipes apply as in training: ``'recipe=[tf32,amp_bf16]'``; compiled ones load and save the compile cache
(``paths.compile_cache``, :mod:`med_ddpm.compile_cache`). A volume's files are written while the next mask
samples, and ``<output_dir>/timings.json`` says where the time went (docs/end-to-end.md); ``logger=wandb`` makes
it the summary of one W&B run that shows the montages.

Multi-GPU: ``torchrun --nproc_per_node=N -m med_ddpm.sample ...`` gives rank r the masks
r, r+N, ...; each output is written once, by the rank that owns its mask. Mask i's noise comes
from a generator keyed by (seed, i), so a volume does not depend on N or on the other masks.

Example:
    python -m med_ddpm.sample checkpoint=runs/last.pt masks=data/whole_head/mask output_dir=samples
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from med_ddpm import cli, compile_sidecar, distributed, sample_plan
from med_ddpm.checkpoint import Loaded, load_checkpoint
from med_ddpm.compile_cache import CompileCache, cache_status, precompiled_report, sample_workload
from med_ddpm.config_checks import (
    ConfigError,
    OutputError,
    check_checkpoint_options,
    check_divisible,
    check_int,
    check_one_of,
)
from med_ddpm.data.datasets import load_condition, without_monai_extras
from med_ddpm.data.masks import list_masks, native_size, sampling_geometry
from med_ddpm.data.phantoms import SyntheticPhantoms
from med_ddpm.data.volume_io import save_montage_png, save_volume_like
from med_ddpm.run_clock import TIMINGS_FILE, RunClock
from med_ddpm.samplers import check_sampler, sample, sampler_from_config
from med_ddpm.samplers.tuned import use_tuned
from med_ddpm.tracking import build_tracker, check_logger, log_images
from med_ddpm.utils import seed_everything
from optim import RecipeStack
from optim.compile import Compile

log = logging.getLogger("med_ddpm.sample")
T = TypeVar("T")
PHANTOM_MASKS = 2  # masks=null: masks of this many synthetic phantoms


class MaskConditions(torch.utils.data.Dataset):
    """This rank's masks; item k is (mask index, name, cond (C, D, H, W), reference NIfTI or None).

    Without ``masks``, two synthetic phantoms of the model size. A mask that cannot be read or preprocessed
    comes back as :class:`Raised`, so that :func:`prepared_masks` raises its error as it was, one line naming
    the file (a DataLoader would wrap it in the worker's traceback).
    """

    def __init__(self, cfg: DictConfig, variant: str, size: list[int] | None, resize_mode: str,
                 channel_mult: list[int]) -> None:
        self.variant, self.resize_mode, self.channel_mult = variant, resize_mode, list(channel_mult)
        self.seg_labels, self.seed = cfg.data.get("seg_labels", "auto"), cfg.seed
        if cfg.masks is None and size is None:  # an original checkpoint: phantoms of model.image_size
            size = check_divisible(f"model.image_size={list(cfg.model.image_size)} (the phantoms' size)",
                                   cfg.model.image_size, channel_mult, "image_size")
        self.size = size
        paths = [None] * PHANTOM_MASKS if cfg.masks is None else list_masks(cfg.masks)  # None: a phantom
        self.entries: list[tuple[int, Path | None]] = list(distributed.shard(list(enumerate(paths))))

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, k: int) -> tuple[int, str, torch.Tensor, Any] | Raised:
        i, path = self.entries[k]  # out of range: IndexError, as a sequence
        try:
            return self.phantom(i) if path is None else self.mask(i, path)
        except Exception as err:  # handed to the main process, raised there as it was
            return Raised(err)

    @functools.cached_property
    def phantom_set(self) -> SyntheticPhantoms:
        """Built in the worker, at its first phantom (generating both)."""
        return SyntheticPhantoms(num_volumes=PHANTOM_MASKS, image_size=self.size, variant=self.variant, seed=self.seed)

    def phantom(self, i: int) -> tuple[int, str, torch.Tensor, None]:
        return i, f"phantom_{i}", self.phantom_set[i]["cond"], None

    def mask(self, i: int, path: Path) -> tuple[int, str, torch.Tensor, Any]:
        cond, nifti = load_condition(path, self.variant, self.size or native_size(path, self.channel_mult),
                                     resize_mode=self.resize_mode, seg_labels=self.seg_labels)
        return i, path.name.removesuffix(".gz").removesuffix(".nii"), cond, nifti


@dataclass(frozen=True)
class Raised:
    """An error preparing one mask, carried from the worker process to the sampling loop."""

    error: Exception


def _as_is(item: T) -> T:
    return item


def _reads_volumes_only(worker_id: int) -> None:
    without_monai_extras()


def prepared_masks(masks: torch.utils.data.Dataset, workers: int) -> Iterator[Any]:
    """``masks``'s items in order, each read and preprocessed ahead by ``workers`` DataLoader processes (0: in this
    process, when asked). The workers start now: MONAI's import and the first masks' reads run beside the recipes,
    the compile cache's load and sampling, in another interpreter, so they do not take turns with them under one
    interpreter lock. A worker imports MONAI without the optional packages it would load and never use
    (:func:`~med_ddpm.data.datasets.without_monai_extras`). An item's error is raised when that item is due."""
    items = iter(torch.utils.data.DataLoader(masks, batch_size=None, num_workers=workers, collate_fn=_as_is,
                                             worker_init_fn=_reads_volumes_only))

    def stream() -> Iterator[Any]:
        nonlocal items
        try:
            for item in items:
                if isinstance(item, Raised):
                    raise item.error
                yield item
        finally:
            items = None  # the workers stop now, also when an error ends the stream early (a traceback keeps this frame)

    return stream()


def write_volume(x0: torch.Tensor, name: str, nifti, out_dir: Path, resize_mode: str) -> Path:
    """The sample as NIfTI with the mask's affine and header (an identity affine for phantoms)."""
    out = out_dir / f"{name}.nii.gz"
    reference = nifti if nifti is not None else (torch.eye(4).numpy(), None)
    save_volume_like(x0, reference, out, dtype="float32", resize_mode=resize_mode)
    log.info("wrote %s", out)
    return out


def write_montage(x0: torch.Tensor, cond: torch.Tensor, name: str, out_dir: Path) -> None:
    """A PNG montage of mid-slices (image | mask overlay)."""
    save_montage_png(x0, cond, out_dir / f"{name}.png", title=name)


def timed(fn: Callable[..., Path | None], *args: Any) -> tuple[Path | None, float]:
    """``fn(*args)`` and its seconds, in the writer's process."""
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


class BackgroundWriter:
    """Writes volumes' files in other processes while the device samples the next.

    A thread would share the interpreter lock with the sampling loop, whose steps would then wait while it runs
    Python (NIfTI's and the montage's); a process does not. ``workers`` processes are forked at construction,
    before the CUDA context exists, and never touch the device; with two, a volume's NIfTI and montage are written
    at once, and a 25-call volume is sampled faster than one process writes it. At most ``depth`` files are
    queued (each holds a CPU copy of its volume), so a slow disk slows sampling down instead of filling memory. A
    write's error is raised in the sampling loop at the next :meth:`submit` that has to wait, or at :meth:`close`;
    files are written atomically, so a failed write leaves no partial file.
    """

    def __init__(self, depth: int = 4, workers: int = 2) -> None:
        start = "fork" if sys.platform == "linux" else "spawn"
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(start),
                                        initializer=without_monai_extras)  # resampling a volume back imports MONAI
        for _ in range(workers):
            self.pool.submit(os.getpid)  # the processes start now
        self.pending: deque[Future] = deque()
        self.depth, self.written = depth, []
        self.busy_s = self.wait_s = 0.0  # seconds the processes wrote (summed); seconds sampling waited for them

    def submit(self, fn: Callable[..., Path | None], *args: Any) -> None:
        """Queue ``fn(*args)`` (a module-level function and picklable arguments); a path it returns is kept."""
        while len(self.pending) >= self.depth:
            self._collect_oldest()
        self.pending.append(self.pool.submit(timed, fn, *args))

    def _collect_oldest(self) -> None:
        start = time.perf_counter()
        try:
            path, seconds = self.pending.popleft().result()
            if path is not None:
                self.written.append(path)
            self.busy_s += seconds
        finally:
            self.wait_s += time.perf_counter() - start

    def close(self) -> list[Path]:
        """Wait for every queued write; returns the paths they returned, in submission order."""
        try:
            while self.pending:
                self._collect_oldest()
        finally:
            for future in self.pending:
                future.cancel()
            self.pool.shutdown(wait=True)
        return self.written


@dataclass
class SamplingJob:
    """Everything :func:`sample_all` needs, built once from the config by :func:`prepare`."""

    cfg: DictConfig
    device: torch.device
    loaded: Loaded
    sampler: Any
    stack: RecipeStack
    geometry: tuple[str, list[int] | None, str]  # (data variant, model image size, resize mode)
    out_dir: Path
    cache: CompileCache | None
    masks: Iterator[tuple[int, str, torch.Tensor, Any]]  # (index, name, cond, NIfTI), prepared ahead by a worker
    plan: sample_plan.Plan = sample_plan.Plan("compiled", "", "compile=always")  # the stack as configured
    facts: sample_plan.Facts | None = None
    sidecar: compile_sidecar.Sidecar | None = None  # compiling the cache for the next job

    running: RecipeStack | None = None  # the stack the network runs now: the plan's, the whole one once switched

    def __post_init__(self) -> None:
        if self.running is None:
            self.running = self.stack if self.plan.stack == "compiled" else self.stack.eager()


def prepare(cfg: DictConfig, clock: RunClock) -> SamplingJob:
    """Join torchrun's process group (if any), create the CUDA context, load the checkpoint and recipes."""
    device = distributed.init_from_env(cfg.device)
    torch.empty(1, device=device)  # creates the CUDA context here, so its cost is timed on its own
    clock.mark("device_ready")
    seed_everything(cfg.seed)
    loaded = load_checkpoint(cfg.checkpoint, weights=cfg.weights)
    loaded.model.to(device)
    geometry = sampling_geometry(loaded, cfg)
    conditions = MaskConditions(cfg, *geometry, channel_mult=loaded.model.config["channel_mult"])
    masks = prepared_masks(conditions, cfg.mask_workers)
    clock.mark("checkpoint_ready")
    stack = RecipeStack.from_config(cfg.get("recipe"))
    stack.require(device)
    cache = compile_cache(cfg, loaded, stack, device, geometry[1])
    sampler = sampler_from_config(cfg.sampler, loaded.schedule.to(device))
    facts = job_facts(cfg, loaded, stack, cache, len(conditions) * len(sampler.timesteps), geometry[1])
    plan = sample_plan.plan_job(cfg.get("compile", "always"), facts)
    job = SamplingJob(cfg, device, loaded, sampler, stack, geometry,
                      Path(distributed.broadcast_object(str(cfg.output_dir))), cache,  # Hydra's dir may differ per rank
                      masks, plan, facts)
    log.info("%s; recipes %s", plan.line(), ", ".join(job.running.names) or "none")
    clock.set(plan_recipes=job.running.names)
    start_sidecar(job, sample_plan.NOW)
    clock.mark("recipes_ready")
    return job


def start_sidecar(job: SamplingJob, when: str) -> None:
    """Start the plan's sidecar compile (:mod:`med_ddpm.compile_sidecar`) on the main rank, if it starts ``when``
    (:data:`~med_ddpm.sample_plan.NOW`, :data:`~med_ddpm.sample_plan.AFTER`)."""
    if job.plan.sidecar != when or not distributed.is_main():
        return
    cfg = job.cfg
    job.sidecar = compile_sidecar.start(compile_sidecar.spec_of(
        cfg.checkpoint, cfg.weights, OmegaConf.to_container(cfg.recipe, resolve=True), cfg.num_samples,
        job.geometry[1], job.device, cfg.paths.compile_cache, time_eager=when == sample_plan.AFTER), job.cache)


def job_facts(cfg: DictConfig, loaded: Loaded, stack: RecipeStack, cache: CompileCache | None, calls: int,
              size: list[int] | None) -> sample_plan.Facts:
    """What :func:`med_ddpm.sample_plan.plan_job` decides on: the cache's state (a file there: warm), whether a
    sidecar compiles it now, this rank's network calls and the costs measured beside the cache (else defaults)."""
    voxels = math.prod(size) * cfg.num_samples if size else None  # None: an original checkpoint, each mask's size
    state = "off" if cache is None else "warm" if cache.path.exists() else "cold"
    compiling = cache is not None and compile_sidecar.compiling(compile_sidecar.marker(cache))
    known = sample_plan.known_facts(None if cache is None else cache.plan_path, voxels)
    return sample_plan.facts_from(known, state, calls, any(isinstance(r, Compile) for r in stack.recipes), compiling)


def compile_cache(cfg: DictConfig, loaded: Loaded, stack: RecipeStack, device: torch.device,
                  size: list[int] | None) -> CompileCache | None:
    """The project's compile cache for this run's stack and workload (None without a compile recipe)."""
    return CompileCache.for_run(cfg.get("paths", {}).get("compile_cache"), "sample", stack, device,
                                sample_workload(loaded.model.config, cfg.num_samples, size))


def warm_up(job: SamplingJob, model: torch.nn.Module) -> bool:
    """One network call on zeros laid out as the first mask's input, where the stack's first call is slow (a compile
    recipe: loading or compiling the forward; on a GPU any stack: lazy kernel loading, cuDNN autotuning, CUDA-graph
    capture), so that it runs while the masks' worker still reads the first mask. Skipped (False) without a fixed
    size: an original checkpoint samples each mask at its own."""
    size = job.geometry[1]
    if not (job.running.slow_first_call or job.device.type == "cuda") or size is None:
        return False
    compile_sidecar.first_call_on_zeros(model, job.running, job.loaded.model, job.cfg.num_samples, size, job.device)
    return True


def switched(job: SamplingJob, sessions: contextlib.ExitStack, calls_done: int) -> torch.nn.Module | None:
    """The whole stack's network, once the sidecar has saved the cache and its load repays over the calls left
    (:func:`med_ddpm.sample_plan.switch_pays`); None otherwise. The whole stack's session opens inside the eager
    one's (``sessions`` closes both), and it prepares the checkpoint's network, which the eager form left as loaded
    (:func:`network_for`)."""
    if job.sidecar is None or not job.sidecar.ready() or not sample_plan.switch_pays(job.facts,
                                                                                      job.facts.calls - calls_done):
        return None
    job.sidecar, job.running = None, job.stack
    sessions.enter_context(job.stack.session())
    job.cache.load()
    return job.stack.prepare_model(job.loaded.model)


def network_for(job: SamplingJob) -> torch.nn.Module:
    """The network the plan's stack prepares. A recipe may change the network it prepares in place, so where the job
    may switch to the whole stack later, the eager form prepares a copy and the loaded network stays as it was."""
    switches = job.running is not job.stack and job.plan.sidecar == sample_plan.NOW
    return job.running.prepare_model(copy.deepcopy(job.loaded.model) if switches else job.loaded.model)


def sample_all(job: SamplingJob, writer: BackgroundWriter, clock: RunClock, sessions: contextlib.ExitStack
               ) -> list[float]:
    """Sample this rank's masks inside the running stack's session (in ``sessions``), handing each volume to
    ``writer``; returns the seconds each mask took (the first includes compilation, cuDNN autotuning and CUDA-graph
    capture, unless :func:`warm_up` took them before it)."""
    cfg, resize_mode = job.cfg, job.geometry[2]
    compiled = job.plan.stack == "compiled"
    if job.cache is not None and compiled:
        job.cache.load()
    model = network_for(job)
    clock.mark("model_ready")
    if warm_up(job, model):
        clock.mark("warmed_up")
    volume_s, alone, calls = [], [], len(job.sampler.timesteps)
    for index, name, cond, nifti in job.masks:
        if (faster := switched(job, sessions, len(volume_s) * calls)) is not None:
            model = faster
            clock.set(switched_at_mask=len(volume_s))
            log.info("the sidecar's compile is in the cache: the masks from %d on sample compiled", len(volume_s))
        if not volume_s:
            clock.mark("first_mask_ready")  # the first mask in hand: read by a worker since the checkpoint loaded
        start, beside = time.perf_counter(), sidecar_running(job)
        c = job.running.prepare_input(cond[None].to(job.device).expand(cfg.num_samples, *cond.shape))
        generator = distributed.keyed_generator(job.device, cfg.seed, index)
        x0 = sample(model, job.sampler, c, generator=generator, progress=cfg.progress and distributed.is_main(),
                    forward_context=job.running.forward_context, out_channels=job.loaded.model.out_channels).cpu()
        volume_s.append(time.perf_counter() - start)
        alone.append(not (beside or sidecar_running(job)))
        if len(volume_s) == 1:
            clock.mark("first_volume_done")
            clock.set(image_size=list(cond.shape[1:]), precompiled=precompiled_report(model))
            if job.cache is not None and compiled:
                job.cache.save()
        for k in range(cfg.num_samples):
            suffix = f"_{k}" if cfg.num_samples > 1 else ""
            writer.submit(write_volume, x0[k], name + suffix, nifti, job.out_dir, resize_mode)
            writer.submit(write_montage, x0[k], cond, name + suffix, job.out_dir)
    clock.mark("sampling_done")
    clock.set(masks_beside_compile=alone.count(False))
    record_costs(job, clock, volume_s, alone, calls)
    start_sidecar(job, sample_plan.AFTER)  # after the record: the sidecar adds its compile seconds to it
    return volume_s


def sidecar_running(job: SamplingJob) -> bool:
    return job.sidecar is not None and job.sidecar.running()


def record_costs(job: SamplingJob, clock: RunClock, volume_s: list[float], alone: list[bool], calls: int) -> None:
    """Keep what this run measured beside the cache, for the next job's plan: seconds per call of the stack it ran
    (the median of the later masks sampled while no sidecar compiled, when no switch mixed two stacks) and its
    first cost (the network's preparation and warm-up call, when they ran alone)."""
    if job.cache is None or not distributed.is_main():
        return
    compiled = job.plan.stack == "compiled"
    later = [s for s, quiet in zip(volume_s[1:], alone[1:], strict=True) if quiet]
    per_call = statistics.median(later) / calls if later and calls else None
    first = ("load_s" if job.cache.status == "warm" else "compile_s") if compiled else "eager_first_s"
    warmed = "warmed_up_s" in clock.values and (compiled or job.plan.sidecar != sample_plan.NOW)
    warm_up_s = clock.values.get("warmed_up_s", 0.0) - clock.values.get("recipes_ready_s", 0.0)  # prepared, called
    sample_plan.record(job.cache.plan_path,
                       **{"compiled_call_s" if compiled else "eager_call_s":
                          None if "switched_at_mask" in clock.values else per_call},
                       **({first: warm_up_s} if warmed else {}))


def run(cfg: DictConfig) -> list[Path]:
    """Load the checkpoint, then sample ``num_samples`` volumes for each of this rank's masks; returns its files.

    Writing overlaps the next volume's sampling (:class:`BackgroundWriter`); where the time went is
    written to ``<output_dir>/timings.json`` (:mod:`med_ddpm.run_clock`).
    """
    clock = RunClock("sample")
    clock.mark("run_start")
    writer = BackgroundWriter()  # its process forks before the CUDA context exists
    try:
        job = prepare(cfg, clock)
        with contextlib.ExitStack() as sessions:
            sessions.enter_context(job.running.session())
            volume_s = sample_all(job, writer, clock, sessions)
    finally:
        written = writer.close()  # raises a write's error
    clock.set(volumes=len(volume_s) * cfg.num_samples, volume_s=[round(s, 4) for s in volume_s],
              write_busy_s=round(writer.busy_s, 4), write_wait_s=round(writer.wait_s, 4),
              compile_cache=cache_found(job), recipes=job.stack.names, plan=job.plan.record())
    if distributed.is_main():
        clock.write(job.out_dir)
    return written


def cache_found(job: SamplingJob) -> str:
    """The compile cache as the job found it (``warm``, ``cold``, ``off``): what its load found where the whole stack
    ran, else what the plan saw (an eager job never loads the cache, however warm)."""
    return cache_status(job.cache) if job.running is job.stack else job.facts.cache


def check_options(cfg: DictConfig) -> None:
    """Refuse, before the checkpoint is loaded, a value sampling would ignore or fail on; ``tuned``: sample with the
    checked grid of a ``sampler.yaml`` of med_ddpm.tune."""
    check_checkpoint_options(cfg)
    sample_plan.check_mode(cfg.get("compile", "always"))
    if cfg.tuned is not None:
        use_tuned(cfg)
    check_int(cfg, "num_samples", 1)
    check_int(cfg, "mask_workers", 0)
    check_logger(cfg.logger)
    check_int(cfg, "seed", 0)
    check_sampler(cfg.sampler, cfg.diffusion, steps=False)  # the steps' range: the checkpoint's schedule's
    seg_labels = cfg.data.get("seg_labels", "auto")
    if seg_labels == "raw":
        raise ConfigError("data.seg_labels=raw: sampling takes no raw BraTS labels (0, 1, 2, 4): their healthy-brain "
                          "label 4 comes from each case's t1 volume; pass masks with Med-DDPM's labels 0..4 "
                          "(docs/troubleshooting.md) and data.seg_labels=medddpm or auto")
    check_one_of("data.seg_labels", seg_labels, ("auto", "medddpm"))


def check_output_dir(out_dir: Path) -> None:
    """Samples of two runs must not mix in one folder (nor a new run overwrite the old one's)."""
    found = sorted(out_dir.glob("*.nii.gz"))
    if found:
        raise OutputError(f"output_dir={out_dir}: already holds {len(found)} sample(s) ({found[0].name}, ...); "
                          "choose another output_dir=, or remove them")


def log_run(cfg: DictConfig, out_dir: Path) -> None:
    """With ``logger=wandb``: one run, timings.json as its summary and the samples' PNG montages as images."""
    tracker = build_tracker(cfg.logger, OmegaConf.to_container(cfg, resolve=True), name=out_dir.name,
                            job_type="sample")
    tracker.summarize(json.loads((out_dir / TIMINGS_FILE).read_text(encoding="utf-8")))
    log_images(tracker, "samples", sorted(out_dir.glob("*.png")))
    tracker.finish()


@hydra.main(config_path=cli.CONFIG_PATH, config_name="sample", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    check_output_dir(cli.output_dir(cfg))
    check_options(cfg)
    written = run(cfg)
    total = sum(distributed.all_gather_object(len(written)))  # also waits for every rank's files
    if distributed.is_main():
        log_run(cfg, Path(cfg.output_dir))
        print(f"{total} samples (NIfTI + PNG) in {Path(cfg.output_dir).resolve()}")
    distributed.cleanup()


console = cli.console(main, teardown=False)  # med-ddpm-sample; every file is written and closed when main returns


if __name__ == "__main__":
    console()
