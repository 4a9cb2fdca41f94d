"""The standard benchmark ladders: a fixed, ordered list of jobs per preset into one results.jsonl.

Example (Hydra overrides of ``configs/ladder.yaml``):
    python -m bench.ladder preset=core out=results/h200            # the short whole-head 128^3 ladder
    python -m bench.ladder preset=targets out=results/h200 budget_s=540   # stop starting jobs after 9 min
    python -m bench.ladder preset=gpu out=results/h200 'best=[amp_bf16,compile]'  # choose the "best stack"
    python -m bench.ladder preset=smoke out=results/smoke          # tiny CPU ladder
    python -m bench.ladder preset=core out=results/h200 dry_run=true   # list the jobs and their status
    python -m bench.ladder preset=core out=results/h200 refresh=compile  # re-measure after a code change
    python -m bench.ladder preset=core out=results/h200 only=full_sample  # just the jobs a regex names
    python -m bench.ladder preset=core out=results/h200 "only='batch_size=(2|4)'"  # quote a regex with = ( | [
    python -m bench.ladder preset=quality out=results/h200/quality checkpoint=runs/quality_model/checkpoints/last.pt
    python -m bench.ladder preset=quality_training out=results/h200/quality/training budget_s=450
    python -m bench.ladder preset=e2e out=results/e2e e2e.data_root=DATA e2e.checkpoint=CKPT

Presets (:data:`PRESETS`): ``smoke`` (CPU), ``gpu`` (every recipe, sampling, batch scaling, BraTS memory,
fast samplers), ``core`` (the same evidence in one device session), ``targets`` (``experiment=fast_sample``
and ``experiment=fast_train`` against strict FP32), ``quality`` (the quality gate next to the time),
``quality_pair`` (the gate between two checkpoints), ``samplers`` (few-step samplers gated on the quality
model). :data:`COMMAND_PRESETS` run real commands in fresh
processes instead of step jobs: ``e2e`` (:mod:`bench.e2e`) and ``quality_training`` (:mod:`bench.quality.training`).

Resumable: a job whose row is already in ``<out>/results.jsonl`` is skipped, so a ladder longer
than one 10-minute device command is finished by running the same command again. The time
budget stops *starting* jobs once spent; a job cut by the budget leaves no row (it reruns next
time) unless it had the whole budget to itself, in which case it is recorded as a timeout so
the ladder moves on. Jobs run in importance order.

Each job is a list of Hydra overrides of ``configs/bench.yaml``, composed with Hydra's compose API
and measured by the same subprocess worker as ``bench.sweep``. A job that times an experiment's
stack names the experiment (``experiment=fast_train``), so the stack has one source: its config.
The strict-FP32 baseline of every workload is in the ladder (and :class:`bench.core.runner.EnsureBaseline`
adds any that a cut run missed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from bench.core.runner import Job, experiment_stack, recipe_override, run_ladder
from bench.core.subprocesses import stopped_together
from bench.e2e import run as run_commands
from bench.quality.training import quality_pair_ladder, visible_gpus
from bench.quality.training import run as train_and_gate
from bench.quality.training_report import write_training_report
from med_ddpm import cli
from med_ddpm.config_checks import ConfigError, check_int, check_number
from med_ddpm.model import INPUT_CONV

Stack = tuple[str, ...]
# Each single recipe, then the combinations the seed study asks about.
RECIPE_SETS: tuple[Stack, ...] = (
    (), ("tf32",), ("channels_last_3d",), ("tf32", "channels_last_3d"), ("cudnn_benchmark",),
    ("amp_bf16",), ("amp_bf16", "channels_last_3d"), ("amp_fp16",), ("amp_bf16", "sdpa_attention"),
    ("amp_bf16", "fused_groupnorm"), ("amp_bf16", "fused_groupnorm", "channels_last_3d"),
    ("amp_bf16", "compile"), ("tf32", "compile"),
)
BATCHES = (2, 4, 8)
FAST_SAMPLER_STEPS = (10, 25, 50)
DDPM_250 = ["sampler=ddpm", "sampler.steps=250", "~sampler.variant"]  # DDPM-250 in place of an experiment's sampler
FP32_SAMPLE = ["bench=full_sample", "sampler=ddpm", "recipe=[]", "bench.iters=1", "bench.warmup=0"]  # ~50 s at 128^3


def _unique(stacks: list[Stack]) -> list[Stack]:
    return list(dict.fromkeys(stacks))


def gpu_ladder(best: Stack) -> Iterator[Job]:
    """whole-head 128^3 (and a BraTS memory check), in importance order."""
    sets = _unique([*RECIPE_SETS, best])
    for scenario in ("denoise_step", "train_step"):
        for stack in sets:
            yield [f"bench={scenario}", recipe_override(stack)]
    for stack in _unique([(), ("tf32",), ("amp_bf16",), best]):
        yield ["bench=full_sample", "sampler=ddpm", recipe_override(stack), "bench.iters=3"]
    for scenario in ("train_step", "denoise_step"):
        for batch in BATCHES:
            for stack in _unique([(), ("amp_bf16",), best]):
                yield [f"bench={scenario}", f"bench.batch_size={batch}", recipe_override(stack)]
    brats_sets = [(), ("amp_bf16", "checkpointing"), (*best, "checkpointing"), best]
    for stack in _unique(brats_sets):
        yield ["model=medddpm_brats", "bench=train_step", recipe_override(stack)]
    for sampler in ("ddim", "dpm_solver_pp", "deis"):
        for steps in FAST_SAMPLER_STEPS:
            for stack in _unique([(), best]):
                yield ["bench=full_sample", f"sampler={sampler}", f"sampler.steps={steps}", recipe_override(stack)]


CORE_SETS: tuple[Stack, ...] = (
    (), ("tf32",), ("channels_last_3d",), ("tf32", "channels_last_3d"), ("amp_bf16",),
    ("amp_bf16", "channels_last_3d"), ("amp_fp16",), ("amp_bf16", "fused_groupnorm", "sdpa_attention"),
)


def core_ladder(best: Stack) -> Iterator[Job]:
    """The seed study's recipes + the best stack at batch 1, 250-step DDPM and fast samplers with the
    best stack, batch scaling and BraTS memory, in one device session."""
    for scenario in ("denoise_step", "train_step"):
        for stack in _unique([*CORE_SETS, best]):
            yield [f"bench={scenario}", recipe_override(stack)]
    yield ["bench=full_sample", "sampler=ddpm", recipe_override(best), "bench.iters=3"]
    for sampler, steps in (("dpm_solver_pp", 10), ("dpm_solver_pp", 25), ("ddim", 25)):
        yield ["bench=full_sample", f"sampler={sampler}", f"sampler.steps={steps}", recipe_override(best)]
    for scenario in ("train_step", "denoise_step"):
        for batch in BATCHES:
            yield [f"bench={scenario}", f"bench.batch_size={batch}", recipe_override(best)]
    yield ["model=medddpm_brats", "bench=train_step", recipe_override((*best, "checkpointing"))]
    yield ["model=medddpm_brats", "bench=train_step", recipe_override(("amp_bf16", "checkpointing"))]
    yield FP32_SAMPLE


# The fewest model calls that pass the N = 32 gate on the quality model: SDE-DPM-Solver++(2M) on the grid
# med_ddpm.step_search searched for it (bench/results/h200/quality/samplers).
FEW_CALLS = ["sampler=ays_quality_model_25", "sampler.steps=25"]


def targets_ladder() -> Iterator[Job]:
    """The two shipped experiments against the strict-FP32 baseline of each workload, 128^3, batch 1:
    ``experiment=fast_sample``'s forward and sample (its sampler, its stack on :data:`FEW_CALLS`' 25-call grid, and
    DDPM-250 with its stack), and
    ``experiment=fast_train``'s training step (at its batch and accumulation, read from its config), then
    ``fast_sample``'s forward and sample with bf16 in place of its fp16 and with bf16's input-convolution island
    (the precisions the quality gate tries). The FP32 250-step sample runs last, so a short budget cuts only it."""
    yield ["bench=denoise_step", "recipe=[]"]
    yield ["bench=train_step", "recipe=[]", *experiment_train_settings("fast_train")]
    yield ["experiment=fast_sample", "bench=denoise_step"]
    yield ["experiment=fast_train", "bench=train_step"]
    yield ["experiment=fast_sample", "bench=full_sample", *DDPM_250, "bench.iters=3"]  # the stack alone
    yield ["experiment=fast_sample", "bench=full_sample"]
    yield ["experiment=fast_sample", "bench=full_sample", *FEW_CALLS]
    for variant in fast_sample_precisions():  # the quality gate's other precisions, timed at 128^3 beside fp16
        yield ["experiment=fast_sample", "bench=denoise_step", *variant]
        yield ["experiment=fast_sample", "bench=full_sample", *variant]
    yield FP32_SAMPLE


def experiment_train_settings(experiment: str) -> list[str]:
    """``experiment``'s training batch and accumulation as overrides (read from its config, the one source), so
    a strict-FP32 baseline times the same step as the experiment's stack."""
    with cli.configs():
        train = compose("bench", overrides=[f"experiment={experiment}", "bench=train_step", "output_dir=."]).train
    return [f"train.batch_size={train.batch_size}", f"train.grad_accum={train.grad_accum}"]


def fast_sample_precisions() -> tuple[list[str], ...]:
    """``experiment=fast_sample`` (fp16 autocast) with ``amp_bf16`` in its place, and that bf16 stack with its first
    convolution (which reads x_t) kept in fp32: the overrides of each."""
    bf16 = experiment_stack("fast_sample", {"amp_fp16": "amp_bf16"})
    return bf16, [*bf16, f"recipe.amp_bf16.fp32_modules=[{INPUT_CONV}]"]


# a full sample gated at batch N and timed at that batch, so the gate's compile of the same shapes is a cache hit
GATED_SAMPLING = ["bench=full_sample", "bench.batch_size=32", "bench.warmup=1", "bench.iters=2"]


def quality_model_gate(preset: str, checkpoint: str | None) -> Job:
    """The overrides every gated job on the quality model shares: its weights, the gate on, and one reference
    cache beside the weights for the whole ladder."""
    if checkpoint is None:
        raise ConfigError(f"checkpoint: not set, and preset={preset} gates the trained quality model; pass "
                          "checkpoint=PATH (python -m med_ddpm.train experiment=quality_model writes one)")
    return ["model=quality_model", "bench.quality=true", f"bench.checkpoint={checkpoint}",
            f"quality.cache_dir={Path(checkpoint).resolve().parent / 'gate_cache'}"]


def quality_ladder(checkpoint: str | None) -> Iterator[Job]:
    """The gate's verdict next to the time on the quality model (``experiment=quality_model`` weights, 64^3),
    N = ``quality.n_samples`` (32: 8 masks x 4 seeds) against strict-FP32 DDPM-250, the reference cached for the
    whole ladder. First what proves the gate (strict FP32 with another seed must pass; the negative controls of
    :mod:`bench.quality.controls`, probed on the reference's x_t, must fail from a 2 % eps scale on), then the exact FP32
    recipes, ``experiment=fast_sample`` exactly as shipped (fp16), its bf16 variant, that bf16 stack with the
    first convolution (which reads x_t) kept in fp32, and DDPM without the x0 clipping.
    The gate's cost is its trajectories at batch N, so the cheap probe-only controls run early and a short budget
    cuts the last jobs, which a rerun finishes."""
    common = quality_model_gate("quality", checkpoint)
    stepping = [*common, "bench=denoise_step", "bench.batch_size=4"]
    yield [*stepping, "recipe=[]", "quality.candidate_seed=1"]
    controls = (("eps_scale", "factor", 1.01), ("eps_scale", "factor", 1.02), ("eps_scale", "factor", 1.05),
                ("eps_scale", "factor", 1.10), ("eps_noise", "sigma", 0.04), ("eps_noise", "sigma", 0.05),
                ("skip_groupnorm", "index", 0))
    for control, option, value in controls:
        yield [*stepping, "recipe=[]", f"+control={control}", f"recipe.{control}.{option}={value}",
               "quality.trajectory=false"]
    for stack in (("tf32",), ("channels_last_3d",)):
        yield [*stepping, recipe_override(stack)]
    sampling = [*common, *GATED_SAMPLING]
    yield [*sampling, "experiment=fast_sample"]
    for variant in fast_sample_precisions():
        yield [*sampling, "experiment=fast_sample", *variant]
    yield [*common, "bench=full_sample", "bench.batch_size=4", "bench.warmup=0", "bench.iters=1", "sampler=ddpm",
           "+sampler.clip_denoised=false", "recipe=[]"]


# Restart sampling on the 13-step quadratic main pass (t_min is one of its points), 25 model calls each:
# (t_min, t_max, restarts, restart_steps); the first is configs/sampler/restart.yaml's.
RESTARTS = ((28, 111, 2, 6), (16, 85, 3, 4), (62, 173, 2, 6))
SA_ORDERS = (2, 3)  # SA-Solver's predictor and corrector orders


def samplers_ladder(checkpoint: str | None) -> Iterator[Job]:
    """Few-step stochastic samplers gated on the quality model, each timed with ``experiment=fast_sample``'s stack
    exactly as the quality preset gates it (batch N, the same reference cache): SDE-DPM-Solver++ 2M and 3M on the
    trailing and quadratic grids at 25, 10 and 50 model calls, then every searched grid in
    ``configs/sampler/ays_*.yaml`` (written by :mod:`med_ddpm.step_search`), then restart sampling
    (:mod:`med_ddpm.samplers.restart_sampler`) at 25 calls over the ODE and the SDE solver (``RESTARTS``), then SA-Solver
    (:mod:`med_ddpm.samplers.sa_solver`, τ = 1) at 25 and 10 calls with predictor and corrector of order 2 and 3, and last
    ``experiment=fast_sample``'s own 100-step sampler, so the calls-vs-quality plot spans what ships. The aim: a
    sampler that passes at 25 calls or fewer."""
    gated = [*quality_model_gate("samplers", checkpoint), *GATED_SAMPLING, "experiment=fast_sample"]
    for steps in (25, 10, 50):
        for order in (2, 3):
            for spacing in ("trailing", "quadratic"):
                yield [*gated, f"sampler.steps={steps}", f"sampler.order={order}", f"sampler.spacing={spacing}"]
    for path in sorted((cli.CONFIG_DIR / "sampler").glob("ays_*.yaml")):
        yield [*gated, f"sampler={path.stem}", f"sampler.steps={len(OmegaConf.load(path).timesteps)}"]
    for variant in ("ode", "sde"):
        for t_min, t_max, restarts, restart_steps in RESTARTS:
            yield [*gated, "sampler=restart", "sampler.steps=13", f"sampler.variant={variant}", f"sampler.t_min={t_min}",
                   f"sampler.t_max={t_max}", f"sampler.restarts={restarts}", f"sampler.restart_steps={restart_steps}"]
    for steps, spacing in (25, "quadratic"), (10, "trailing"):  # the grid each did best with on the CPU toy
        for order in SA_ORDERS:
            yield [*gated, "sampler=sa_solver", "~sampler.variant", f"sampler.steps={steps}",  # variant: fast_sample's
                   f"sampler.spacing={spacing}", f"sampler.predictor_order={order}", f"sampler.corrector_order={order}"]
    yield gated


def smoke_ladder(best: Stack) -> Iterator[Job]:
    """The same shape on the tiny CPU model: both step scenarios, two stacks, two batch sizes."""
    for scenario in ("train_step", "denoise_step"):
        for stack in _unique([(), best]):
            for batch in (1, 2):
                yield ["experiment=bench_smoke", f"bench={scenario}", f"bench.batch_size={batch}", recipe_override(stack)]


AOT = "recipe.compile_cudagraphs.aot=true"  # both fast experiments compile with compile_cudagraphs


def e2e_ladder() -> Iterator[Job]:
    """Run by :func:`bench.e2e.run` (the real CLIs in a fresh process, not the step worker): the
    README's sampling and training commands from process start with a cold and a warm compile cache, sampling
    many masks, BraTS training with the memory stack, uncapped (its time per volume) and under a 16 GiB cap with
    EMA averaging and checkpoints, and last both fast commands with their compiled forward kept ahead of time
    (``aot=true``, :mod:`optim.precompile`), cold then warm.
    Each job: ``scenario=``, ``compile_cache=``, ``masks=`` (sampling), then the command's overrides (composed by
    ``configs/train.yaml`` or ``sample.yaml``, not ``bench.yaml``)."""
    sample = ["scenario=e2e_sample", "experiment=fast_sample"]
    yield [*sample, "masks=4", "compile_cache=cold"]
    yield [*sample, "masks=4", "compile_cache=warm"]
    yield [*sample, "masks=32", "compile_cache=warm"]
    train = ["scenario=e2e_train", "experiment=fast_train", "train.max_steps=60"]
    yield [*train, "compile_cache=cold"]
    yield [*train, "compile_cache=warm"]
    memory = "recipe=[amp_bf16,fused_groupnorm,sdpa_attention,cudnn_benchmark,checkpointing]"
    yield ["scenario=e2e_train", "experiment=brats", memory, "train.max_steps=20", "train.sample_every=0",
           "compile_cache=cold"]  # the BraTS loop's time per volume, uncapped (a cap may stop the next one)
    yield ["scenario=e2e_train", "experiment=brats", memory, "train.max_steps=50", "train.ema_start=0",
           "train.save_every=25", "train.sample_every=0", "train.memory_cap_gib=16", "compile_cache=cold"]
    for command in ([*sample, "masks=4"], train):
        for cache in ("cold", "warm"):
            yield [*command, AOT, f"compile_cache={cache}"]


# preset= name -> its jobs, from the ladder config (configs/ladder.yaml: best, checkpoint). One line per preset.
PRESETS: dict[str, Callable[[DictConfig], Iterable[Job]]] = {
    "smoke": lambda cfg: smoke_ladder(tuple(cfg.best)),
    "gpu": lambda cfg: gpu_ladder(tuple(cfg.best)),
    "core": lambda cfg: core_ladder(tuple(cfg.best)),
    "targets": lambda cfg: targets_ladder(),
    "quality": lambda cfg: quality_ladder(cfg.checkpoint),
    "quality_pair": lambda cfg: quality_pair_ladder(cfg.checkpoint, cfg.candidate_checkpoint),
    "samplers": lambda cfg: samplers_ladder(cfg.checkpoint),
    "e2e": lambda cfg: e2e_ladder(),
}


def e2e_args(cfg: DictConfig) -> dict[str, str]:
    """The ``e2e:`` block of configs/ladder.yaml and the shared keys, as :func:`bench.e2e.run` takes them."""
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
    budget_s = math.inf if cfg.budget_s is None else float(cfg.budget_s)
    size = [] if q.image_size is None else [f"model.image_size=[{','.join(str(int(n)) for n in q.image_size)}]"]
    left = train_and_gate(Path(cfg.out), steps, list(q.control), q.experiment, Path(q.runs), budget_s,
                          [*size, *q.overrides], visible_gpus(gpus) if gpus > 1 and not cfg.dry_run else (),
                          dry_run=cfg.dry_run, seeds=seeds)
    if not cfg.dry_run:
        write_training_report(Path(cfg.out))
    return left


# The step presets a machine without a CUDA GPU runs; every other one, and e2e, times GPU workloads.
# (quality_training trains what its overrides say: a tiny model trains on a CPU.)
CPU_PRESETS = ("smoke",)
# Presets that run real commands in fresh processes rather than the step worker's jobs.
COMMAND_PRESETS: dict[str, Callable[[DictConfig], int]] = {"e2e": run_e2e, "quality_training": run_quality_training}


def ladder_jobs(cfg: DictConfig) -> list[Job]:
    """The jobs of ``cfg.preset`` (:func:`run` checked its name), only those ``cfg.only`` (a regex over a job's
    overrides) names if set."""
    jobs = list(PRESETS[cfg.preset](cfg))
    return picked(jobs, cfg.only, cfg.preset) if cfg.only else jobs


def picked(jobs: list[Job], only: str, preset: str) -> list[Job]:
    """The jobs the regex ``only`` finds in their overrides; a pattern that is no regex, or names no job, is refused
    (not a ladder that reports 0 jobs left)."""
    try:
        pattern = re.compile(str(only))
    except re.error as err:
        raise ConfigError(f"only={only}: not a regular expression ({err}); quote it on the command line: "
                          "\"only='...'\"") from err
    chosen = [job for job in jobs if pattern.search(" ".join(job))]
    if not chosen:
        raise ConfigError(f"only={only}: names none of preset={preset}'s {len(jobs)} jobs; pass a regex over their "
                          f"overrides (preset={preset} dry_run=true lists them)")
    return chosen


def check_preset(preset: str) -> None:
    known = {**PRESETS, **COMMAND_PRESETS}
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

    ``preset=e2e`` runs the real CLIs from process start (:mod:`bench.e2e`), not the step worker."""
    check_preset(cfg.preset)
    if cfg.budget_s is not None:
        check_number(cfg, "budget_s", 0.0)
    if cfg.preset in COMMAND_PRESETS:
        return COMMAND_PRESETS[cfg.preset](cfg)
    budget_s = math.inf if cfg.budget_s is None else float(cfg.budget_s)
    jobs = ladder_jobs(cfg)
    if not cfg.dry_run:
        require_gpu(cfg.preset)  # after the options: a bad one is named on any machine
    # only= runs just the jobs it names: the missing baselines are not among them
    return run_ladder(Path(cfg.out), jobs, budget_s, cfg.dry_run, cfg.refresh, complete_baselines=not cfg.only)


@hydra.main(config_path="../configs", config_name="ladder", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> int:
    with stopped_together():  # Ctrl-C or an outer timeout also stops the commands e2e and quality_training run
        return run(cfg)


if __name__ == "__main__":
    cli.run(main)
