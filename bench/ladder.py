"""The standard benchmark ladder (``make bench``): a fixed, ordered list of jobs into one results.jsonl.

Example:
    python -m bench.ladder out=results/h200                       # whole-head 128^3 ladder
    python -m bench.ladder out=results/h200 budget_s=540          # stop starting jobs after 9 min
    python -m bench.ladder out=results/h200 best=amp_bf16,compile # choose the "best stack" rows
    python -m bench.ladder out=results/smoke preset=smoke         # tiny CPU ladder
    python -m bench.ladder out=results/h200 dry_run=true          # list the jobs and their status
    python -m bench.ladder out=results/h200 refresh='channels_last_3d.*compile'  # re-measure after a code change
    python -m bench.ladder out=results/h200 preset=tuning only='max_autotune'   # just the jobs a regex names (no baselines added)
    python -m bench.ladder out=results/h200 preset=core           # the short issue-8 ladder (one device session)
    python -m bench.ladder out=results/h200 preset=tuning         # issue 8, round 2: layout, graphs, batch, BraTS
    python -m bench.ladder out=results/h200/quality preset=quality checkpoint=runs/quality_model/checkpoints/last.pt

Resumable: a job whose row is already in ``<out>/results.jsonl`` is skipped, so a ladder longer
than one 10-minute device command is finished by running the same command again. The time
budget stops *starting* jobs once spent; a job cut by the budget leaves no row (it reruns next
time) unless it had the whole budget to itself, in which case it is recorded as a timeout so
the ladder moves on. Jobs run in importance order: batch-1 steps for every recipe first, then
sampling, throughput vs batch size, BraTS memory, fast samplers.

Each job is composed from ``configs/bench.yaml`` with Hydra's compose API and measured by the
same subprocess worker as ``bench.sweep``; the strict-FP32 baseline of every workload is in
the ladder (and :class:`bench.sweep.EnsureBaseline` adds any that a cut run missed).
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from bench.records import RESULTS_FILE, append_row, job_key, read_rows
from bench.sweep import CONFIG_DIR, EnsureBaseline, job_spec, log_row
from bench.worker import base_row, cut_by_budget, run_job
from med_ddpm.utils import git_sha

DEFAULT_MODEL = "medddpm_whole_head"
DEFAULT_BEST = ("amp_bf16", "fused_groupnorm", "sdpa_attention", "cudnn_benchmark", "compile")
# Each single recipe, then the combinations the seed study and issue 8 ask about.
RECIPE_SETS: tuple[tuple[str, ...], ...] = (
    (), ("tf32",), ("channels_last_3d",), ("tf32", "channels_last_3d"), ("cudnn_benchmark",),
    ("amp_bf16",), ("amp_bf16", "channels_last_3d"), ("amp_fp16",), ("amp_bf16", "sdpa_attention"),
    ("amp_bf16", "fused_groupnorm"), ("amp_bf16", "fused_groupnorm", "channels_last_3d"),
    ("amp_bf16", "compile"), ("tf32", "compile"), ("amp_bf16", "cuda_graphs"),
)
BATCHES = (2, 4, 8)
FAST_SAMPLER_STEPS = (10, 25, 50)
Job = list[str]  # Hydra overrides


def _recipe(stack: tuple[str, ...]) -> str:
    return f"recipe=[{','.join(stack)}]"


def _unique(stacks: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    return list(dict.fromkeys(stacks))


def _with(stack: tuple[str, ...], name: str, after: str = "amp_bf16") -> tuple[str, ...]:
    """``stack`` with ``name`` inserted after ``after`` (or first): labels read in a fixed order."""
    at = stack.index(after) + 1 if after in stack else 0
    return (*stack[:at], name, *stack[at:])


def _swap(stack: tuple[str, ...], old: str, new: str) -> tuple[str, ...]:
    return tuple(new if name == old else name for name in stack)


_gathered = functools.partial(_with, name="gather_upsample", after="sdpa_attention")


def fast_sample_stack(best: tuple[str, ...]) -> tuple[str, ...]:
    """``experiment=fast_sample``'s recipes (with ``recipe.gather_upsample.forward=gather``): ``best`` in
    channels-last with CUDA-graph trees, the upsampling as a gather (round 8) and the output conv as a
    GEMM + col2im (round 9)."""
    graphs = _swap(_with(best, "channels_last_3d"), "compile", "compile_cudagraphs")
    return _gathered(_with(graphs, "narrow_conv_gemm", after="sdpa_attention"))


def gpu_ladder(best: tuple[str, ...]) -> Iterator[Job]:
    """whole-head 128^3 (and a BraTS memory check), in importance order."""
    sets = _unique([*RECIPE_SETS, best])
    for scenario in ("denoise_step", "train_step"):
        for stack in sets:
            if scenario == "train_step" and "cuda_graphs" in stack:
                continue  # cuda_graphs graphs no-grad sampling only: under autograd it is eager
            yield [f"bench={scenario}", _recipe(stack)]
    for stack in _unique([(), ("tf32",), ("amp_bf16",), best]):
        yield ["bench=full_sample", "sampler=ddpm", _recipe(stack), "bench.iters=3"]
    for scenario in ("train_step", "denoise_step"):
        for batch in BATCHES:
            for stack in _unique([(), ("amp_bf16",), best]):
                yield [f"bench={scenario}", f"bench.batch_size={batch}", _recipe(stack)]
    brats_sets = [(), ("amp_bf16", "checkpointing"), (*best, "checkpointing"), best]
    for stack in _unique(brats_sets):
        yield ["model=medddpm_brats", "bench=train_step", _recipe(stack)]
    for sampler in ("ddim", "dpm_solver_pp", "deis"):
        if (CONFIG_DIR / "sampler" / f"{sampler}.yaml").exists():
            for steps in FAST_SAMPLER_STEPS:
                for stack in _unique([(), best]):
                    yield ["bench=full_sample", f"sampler={sampler}", f"sampler.steps={steps}", _recipe(stack)]


CORE_SETS: tuple[tuple[str, ...], ...] = (
    (), ("tf32",), ("channels_last_3d",), ("tf32", "channels_last_3d"), ("amp_bf16",),
    ("amp_bf16", "channels_last_3d"), ("amp_fp16",), ("amp_bf16", "fused_groupnorm", "sdpa_attention"),
)


def core_ladder(best: tuple[str, ...]) -> Iterator[Job]:
    """The issue-8 evidence in one device session: the seed study's recipes + the best stack at
    batch 1, 250-step DDPM and fast samplers with the best stack, batch scaling, BraTS memory."""
    for scenario in ("denoise_step", "train_step"):
        for stack in _unique([*CORE_SETS, best]):
            yield [f"bench={scenario}", _recipe(stack)]
    yield ["bench=full_sample", "sampler=ddpm", _recipe(best), "bench.iters=3"]
    for sampler, steps in (("dpm_solver_pp", 10), ("dpm_solver_pp", 25), ("ddim", 25)):
        yield ["bench=full_sample", f"sampler={sampler}", f"sampler.steps={steps}", _recipe(best)]
    for scenario in ("train_step", "denoise_step"):
        for batch in BATCHES:
            yield [f"bench={scenario}", f"bench.batch_size={batch}", _recipe(best)]
    yield ["model=medddpm_brats", "bench=train_step", _recipe((*best, "checkpointing"))]
    yield ["model=medddpm_brats", "bench=train_step", _recipe(("amp_bf16", "checkpointing"))]
    yield ["bench=full_sample", "sampler=ddpm", "recipe=[]", "bench.iters=1", "bench.warmup=0"]


def tuning_ladder(best: tuple[str, ...]) -> Iterator[Job]:
    """Issue 8, second round, against the strict-FP32 baseline in the same run: one layout end
    to end (channels-last with compiled GroupNorm and upsampling), launch overhead (inductor's
    CUDA-graph trees), conv autotuning, BraTS memory, and throughput against batch size (eager and
    the fastest compiled stacks)."""
    layout = _with(best, "channels_last_3d")
    graphs = _swap(layout, "compile", "compile_cudagraphs")
    eager = tuple(name for name in best if name != "compile")
    for stack in _unique([(), best, layout, _with(eager, "channels_last_3d")]):
        yield ["bench=denoise_step", _recipe(stack)]
    yield ["model=medddpm_brats", "bench=train_step", _recipe((*eager, "checkpointing"))]
    for batch in BATCHES:
        for scenario in ("train_step", "denoise_step"):
            yield [f"bench={scenario}", f"bench.batch_size={batch}", _recipe(eager)]
    yield ["bench=full_sample", "sampler=ddpm", "recipe=[]", "bench.iters=1", "bench.warmup=0"]
    yield ["bench=denoise_step", _recipe(graphs)]
    for stack in _unique([(), best, layout]):
        yield ["bench=train_step", _recipe(stack)]
    yield ["bench=full_sample", "sampler=ddpm", _recipe(graphs), "bench.iters=3"]
    yield ["bench=full_sample", "sampler=dpm_solver_pp", "sampler.steps=10", _recipe(graphs)]
    # the sampler that passes the quality gate (experiment=fast_sample), at 128^3 with the fastest stack
    yield ["bench=full_sample", "sampler=dpm_solver_pp", "sampler.variant=sde", "sampler.steps=100", _recipe(graphs)]
    padded = _with(layout, "pad_conv_channels", after="sdpa_attention")  # the 64 -> 1 output conv, 8-aligned
    # the trilinear backward as a gather, not atomics: in the channels-last step the atomic scatter takes
    # 16.4 of 75.6 ms of kernels (profile_train_channels_last_4fe4200), in NCDHW 1.9 ms (round 5)
    yield ["bench=train_step", _recipe(_gathered(layout))]
    # that step's kernels take 58.9 ms of its 66.3 (profile_train_gather_0effe44): graph fwd + bwd as well
    yield ["bench=train_step", _recipe(_swap(_gathered(layout), "compile", "compile_cudagraphs"))]
    # cuDNN times only its heuristics' top 10 engine configs, and the forward's convs reach about 450 TFLOP/s,
    # 58 % of the measured matmul rate (round 7 floors). Time them all (round 7: no gain for the forward).
    exhaustive = "recipe.cudnn_benchmark.limit=0"
    yield ["bench=denoise_step", _recipe(graphs), exhaustive]
    yield ["bench=train_step", _recipe(_gathered(layout)), exhaustive]
    yield ["bench=full_sample", "sampler=ddpm", _recipe(graphs), exhaustive, "bench.iters=3"]
    # the 64 -> 1 output conv's wgrad + dgrad take 2.4 ms of the gather train step's 58.9 ms of kernels (round 7)
    both = "recipe.gather_upsample.forward=gather"
    yield ["bench=train_step", _recipe(_swap(_gathered(padded), "compile", "compile_cudagraphs")), both]
    yield ["bench=denoise_step", _recipe(_gathered(_swap(padded, "compile", "compile_cudagraphs"))), both]
    # the 64 -> 1 output conv as a GEMM + col2im: cuDNN runs it at a few % of the tensor cores' rate (its wgrad +
    # dgrad take 2.4 ms of the step, round 7)
    narrow = fast_sample_stack(best)
    yield ["bench=train_step", _recipe(narrow), both]
    yield ["bench=denoise_step", _recipe(narrow), both]
    yield ["bench=full_sample", "sampler=ddpm", _recipe(narrow), both, "bench.iters=3"]
    # inductor's GroupNorm and pointwise kernels (17.7 ms of the train step's 58.9 ms of kernels, at 36-58 % of the
    # copy bandwidth: round 7 profile) tuned by coordinate descent; Adam's update, eager after the graphed step, fused
    tuned = "+recipe.compile_cudagraphs.inductor.coordinate_descent_tuning=true"
    fused = (*narrow, "fused_adam")
    yield ["bench=denoise_step", _recipe(narrow), both, tuned]
    yield ["bench=train_step", _recipe(fused), both]
    # 41 aten::copy_ a step (3.1 ms, round 7) come from cuDNN making strided gradients dense inside convolution_backward
    yield ["bench=train_step", _recipe(_with(fused, "dense_conv_grads", after="narrow_conv_gemm")), both]
    # the NDHWC GroupNorm backward in closed form (optim/groupnorm_ndhwc.py): one reduction and one pass over (dy, x),
    # without the float32 pre-activation autograd's form writes, when inductor keeps it inline (threshold 6; round 11
    # measured it at inductor's default too: no gain, so the recipe now asks compile for 6 itself)
    closed = "recipe.fused_groupnorm.ndhwc_backward=closed_form"
    yield ["bench=train_step", _recipe(fused), both, closed, "+recipe.compile_cudagraphs.inductor.realize_reads_threshold=6"]
    # round 11: each of the two above alone is faster (-2.4 and -3.2 ms); round 12: together -3.4 ms (= experiment=fast_train)
    final = _recipe(_with(fused, "dense_conv_grads", after="narrow_conv_gemm"))
    yield ["bench=train_step", final, both, closed]
    # the non-finite guard without a host sync (fused Adam skips on the GPU): round 13, bench.guard_order on one
    # compiled model: 54.9 ms against 56.1 ms with the host read before backward (= experiment=fast_train)
    yield ["bench=train_step", final, both, closed, "recipe.fused_adam.guard=device"]
    yield ["bench=train_step", _recipe(fused), both, tuned]
    yield ["bench=full_sample", "sampler=ddpm", _recipe(narrow), both, tuned, "bench.iters=3"]
    yield ["bench=train_step", _recipe(_gathered(best))]
    # the 25-step samplers at 128^3: SDE on the linspace grid that ends at t = 0 (quality ladder), and ODE
    yield ["bench=full_sample", "sampler=dpm_solver_pp", "sampler.variant=sde", "sampler.steps=25",
           "sampler.spacing=linspace", _recipe(graphs)]
    yield ["bench=full_sample", "sampler=dpm_solver_pp", "sampler.steps=25", _recipe(graphs)]
    # compiled + checkpointed: the cuDNN SDPA backend fails in inductor's recomputation (optim/CARDS.md)
    yield ["model=medddpm_brats", "bench=train_step", _recipe((*best, "checkpointing")),
           "recipe.sdpa_attention.backends=[flash,efficient]"]
    # where the fastest stacks saturate the GPU. Inductor's compiled F.interpolate in channels-last takes 10.5 ms
    # a call at batch 4 against 0.16 at batch 1 (round 8 profiles): the upsampling forward as a gather too
    for batch in (1, *BATCHES):
        yield ["bench=denoise_step", f"bench.batch_size={batch}", _recipe(_gathered(graphs)), both]
    for batch in (1, *BATCHES):
        yield ["bench=train_step", f"bench.batch_size={batch}", _recipe(_swap(_gathered(layout), "compile",
                                                                                 "compile_cudagraphs")), both]
    # max-autotune (coordinate-descent tuning of inductor's GroupNorm kernels) with graphs: without
    # them this forward is host-bound (round 5: 23.6 ms a call for 19.35 ms of kernels). Minutes to compile: last.
    yield ["bench=denoise_step", _recipe((*_swap(layout, "compile", "compile_max_autotune"), "cuda_graphs")),
           "bench.timeout_s=420"]


def fast_train_stack(best: tuple[str, ...]) -> tuple[str, ...]:
    """``experiment=fast_train``'s recipes (with :data:`FAST_TRAIN_OPTIONS`) with CUDA-graph trees in place of
    ``compile``: the fastest measured train step (round 14: 53.2 ms). The experiment ships ``compile``: CUDA-graph
    trees cannot accumulate its 2 micro-batches (:meth:`optim.compile.Compile.supports_training`)."""
    return _with(_with(fast_sample_stack(best), "dense_conv_grads", after="narrow_conv_gemm"), "fused_adam",
                 after="compile_cudagraphs")


FAST_SAMPLE_OPTIONS = ("recipe.gather_upsample.forward=gather",)
FAST_TRAIN_OPTIONS = (*FAST_SAMPLE_OPTIONS, "recipe.fused_groupnorm.ndhwc_backward=closed_form",
                      "recipe.fused_adam.guard=device")


def targets_ladder(best: tuple[str, ...]) -> Iterator[Job]:
    """Issue 8's target table in one call: the final stacks (``experiment=fast_sample``'s and ``fast_train``'s,
    graphed) against the strict-FP32 baseline of each workload, 128^3, batch 1. The FP32 250-step sample
    (about 50 s on an H200) runs last, so a short budget cuts only it."""
    sample = [_recipe(fast_sample_stack(best)), *FAST_SAMPLE_OPTIONS]
    train = [_recipe(fast_train_stack(best)), *FAST_TRAIN_OPTIONS]
    yield ["bench=denoise_step", "recipe=[]"]
    yield ["bench=train_step", "recipe=[]"]
    yield ["bench=denoise_step", *sample]
    yield ["bench=train_step", *train]
    yield ["bench=full_sample", "sampler=ddpm", *sample, "bench.iters=3"]
    yield ["bench=full_sample", "sampler=dpm_solver_pp", "sampler.variant=sde", "sampler.steps=100", *sample]
    yield ["bench=full_sample", "sampler=ddpm", "recipe=[]", "bench.iters=1", "bench.warmup=0"]


def quality_ladder(best: tuple[str, ...], checkpoint: str | None) -> Iterator[Job]:
    """Issue 26: the gate's verdict next to the time on the quality model (``experiment=quality_model`` weights,
    64^3), N = ``quality.n_samples`` (32: 8 masks x 4 seeds) against strict-FP32 DDPM-250, the reference cached
    for the whole ladder. First what proves the gate (strict FP32 with another seed must pass; the negative
    controls of :mod:`bench.controls`, probed on the reference's x_t, must fail from a 2 % eps scale on), then
    the exact FP32 recipes, ``experiment=fast_sample`` exactly as shipped, its fp16 variant, and DDPM without
    the x0 clipping. The gate's cost is its trajectories at batch N, so the cheap probe-only controls run early
    and a short budget cuts the last jobs, which a rerun finishes."""
    if checkpoint is None:
        raise SystemExit("bench.ladder preset=quality needs checkpoint=PATH (python -m med_ddpm.train "
                         "experiment=quality_model writes one)")
    common = ["model=quality_model", "bench.quality=true", f"bench.checkpoint={checkpoint}",
              f"quality.cache_dir={Path(checkpoint).resolve().parent / 'gate_cache'}"]
    stepping = [*common, "bench=denoise_step", "bench.batch_size=4"]
    yield [*stepping, "recipe=[]", "quality.candidate_seed=1"]
    controls = (("eps_scale", "factor", 1.01), ("eps_scale", "factor", 1.02), ("eps_scale", "factor", 1.05),
                ("eps_scale", "factor", 1.10), ("eps_noise", "sigma", 0.05), ("skip_groupnorm", "index", 0))
    for control, option, value in controls:
        yield [*stepping, "recipe=[]", f"+control={control}", f"recipe.{control}.{option}={value}",
               "quality.trajectory=false"]
    for stack in (("tf32",), ("channels_last_3d",)):
        yield [*stepping, _recipe(stack)]
    # timed at batch N as gated, so the gate's compile of the same shapes is an inductor cache hit
    sampling = [*common, "bench=full_sample", "bench.batch_size=32", "bench.warmup=1", "bench.iters=2"]
    fast = fast_sample_stack(best)
    sde = ["sampler=dpm_solver_pp", "sampler.variant=sde", "sampler.steps=100"]
    yield [*sampling, *sde, _recipe(fast), *FAST_SAMPLE_OPTIONS]  # = experiment=fast_sample
    yield [*sampling, *sde, _recipe(_swap(fast, "amp_bf16", "amp_fp16")), *FAST_SAMPLE_OPTIONS]
    yield [*common, "bench=full_sample", "bench.batch_size=4", "bench.warmup=0", "bench.iters=1", "sampler=ddpm",
           "+sampler.clip_denoised=false", "recipe=[]"]


def smoke_ladder(best: tuple[str, ...]) -> Iterator[Job]:
    """The same shape on the tiny CPU model: every scenario, two stacks, two batch sizes."""
    for scenario in ("train_step", "denoise_step"):
        for stack in _unique([(), best]):
            for batch in (1, 2):
                yield ["experiment=bench_smoke", f"bench={scenario}", f"bench.batch_size={batch}", _recipe(stack)]


PRESETS = {"gpu": gpu_ladder, "h200": gpu_ladder, "core": core_ladder, "tuning": tuning_ladder,
           "targets": targets_ladder, "quality": quality_ladder, "smoke": smoke_ladder}


def compose_job(overrides: Job, job_dir: Path) -> dict[str, Any]:
    """Compose one ladder entry into a worker job (the same config ``bench.sweep`` would build)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=[*overrides, f"output_dir={job_dir}"])
    model = next((o.split("=", 1)[1] for o in overrides if o.startswith("model=")), None)
    if model is None:
        model = "tiny" if "experiment=bench_smoke" in overrides else DEFAULT_MODEL
    return job_spec(cfg, model)


def missing_recipes(overrides: Job) -> list[str]:
    """Recipe names of a job that have no ``configs/recipe/<name>.yaml`` (the job is skipped)."""
    stack = next((o for o in overrides if o.startswith("recipe=")), "recipe=[]")
    names = [n for n in stack.removeprefix("recipe=[").removesuffix("]").split(",") if n]
    return [n for n in names if not (CONFIG_DIR / "recipe" / f"{n}.yaml").exists()]


def finished_jobs(out: Path, refresh: str | None) -> tuple[set[str], set[str]]:
    """Job keys with a row in ``out``: any row, and rows measured by this code (``git_sha``).

    ``refresh`` jobs count as done only with a row of this code, so after a code change
    ``refresh=REGEX`` re-measures the jobs it names (old rows stay, each labelled with its
    commit in the report) and a resumed run does not measure them twice.
    """
    rows = read_rows(out) if (out / RESULTS_FILE).exists() else []
    sha = git_sha()
    return ({job_key(r) for r in rows},
            {job_key(r) for r in rows if refresh and (r.get("env") or {}).get("git_sha") == sha})


def run_ladder(out: Path, jobs: list[Job], budget_s: float, dry_run: bool = False, refresh: str | None = None,
               complete_baselines: bool = True) -> int:
    """Run the jobs not yet in ``out/results.jsonl`` until the budget is spent; return jobs left.

    ``refresh``: a regex over a job's overrides; matching jobs rerun unless this code measured them.
    ``complete_baselines``: spend what is left of the budget on strict-FP32 baselines the results miss.
    """
    out.mkdir(parents=True, exist_ok=True)
    done, current = finished_jobs(out, refresh)
    start, left = time.monotonic(), 0
    for n, overrides in enumerate(jobs):
        if missing := missing_recipes(overrides):
            print(f"[skip] {' '.join(overrides)}: no recipe config for {missing}")
            continue
        job_dir = out / "jobs" / f"{n:03d}"
        job = compose_job(overrides, job_dir)
        stale_ok = not (refresh and re.search(refresh, " ".join(overrides)))
        if job_key(base_row(job)) in (done if stale_ok else current):
            continue
        remaining = budget_s - (time.monotonic() - start)
        if dry_run or remaining <= 0:
            left += 1
            print(f"[todo] {' '.join(overrides)}")
            continue
        full = float(job["config"]["bench"]["timeout_s"])
        timeout = min(full, remaining)
        row = run_job(job, job_dir, timeout)
        if cut_by_budget(row, timeout, full, budget_s):
            left += 1  # no row: a rerun measures it
            print(f"[cut] {' '.join(overrides)}: the time budget ran out; rerun to measure it")
            continue
        append_row(out / RESULTS_FILE, row)
        log_row(row)
    if complete_baselines and not dry_run and budget_s - (time.monotonic() - start) > 0:
        EnsureBaseline.complete(out, budget_s - (time.monotonic() - start))
    print(f"ladder: {left} job(s) left{' (rerun the same command to continue)' if left else ''}")
    return left


def parse_args(argv: list[str]) -> dict[str, str]:
    """``key=value`` arguments (Hydra-style, without Hydra: the ladder composes each job itself)."""
    args = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in ("out", "preset", "budget_s", "best", "dry_run", "checkpoint", "refresh", "only"):
            raise SystemExit(f"bench.ladder: bad argument {arg!r}; expected out=DIR [preset={'|'.join(PRESETS)}] "
                             "[budget_s=SECONDS] [best=r1,r2,...] [dry_run=true] [checkpoint=PATH] [refresh=REGEX] "
                             "[only=REGEX]")
        args[key] = value
    if "out" not in args:
        raise SystemExit("bench.ladder: out=DIR is required")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    preset = args.get("preset", "gpu")
    if preset not in PRESETS:
        raise SystemExit(f"bench.ladder: unknown preset {preset!r}; known: {sorted(PRESETS)}")
    best = tuple(n for n in args.get("best", ",".join(DEFAULT_BEST)).split(",") if n)
    ladder = PRESETS[preset]
    jobs = list(ladder(best, args.get("checkpoint")) if ladder is quality_ladder else ladder(best))
    if "only" in args:  # a regex over each job's overrides, as refresh
        jobs = [job for job in jobs if re.search(args["only"], " ".join(job))]
    # only= runs just the jobs it names: the missing baselines are not among them (round 9 lost a run's budget to them)
    run_ladder(Path(args["out"]), jobs, float(args.get("budget_s", "inf")), args.get("dry_run") == "true",
               args.get("refresh"), complete_baselines="only" not in args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
