"""Does a training stack change the trained model more than retraining does? The quality model trained k + 3 times.

``experiment=quality_model`` (at ``image_size``, default 32³) is trained for ``steps`` optimizer steps in fresh
processes (``python -m med_ddpm.train``), batch 4 x grad_accum 1 in every run (``compile_cudagraphs`` takes it):

* ``fp32``: strict FP32 (``recipe=[]``), the reference;
* ``<experiment>``: ``experiment``'s recipe stack (default ``fast_train``; the stack and the options it sets on its
  recipes are read from its config, :func:`bench.core.runner.experiment_stack`), the reference's config otherwise: the
  same seed, so the same initial weights, data order and every (t, ε) draw;
* ``control``: strict FP32 with ``control``'s overrides (default a tenth of the learning rate), a training a user could
  get wrong, on the reference's seed: the verdict must fail it;
* ``fp32_seed1`` .. ``fp32_seed<k>`` (``seeds``, default 4): strict FP32 on the next k seeds. Two trainings differ
  even on one stack (nondeterministic cuDNN weight gradients, chaotic SGD), so these are the draws of what
  retraining alone changes: the band a stack is judged against (:mod:`bench.quality.training_verdict`).

Then each run's EMA weights but the reference's are gated against the reference's (``quality.candidate_checkpoint``,
strict-FP32 DDPM with the same masks and noise, so only the weights differ; :func:`quality_pair_ladder`),
one row per arm in ``<out>/results.jsonl``, the weights gated under names holding a digest of their bytes
(:func:`frozen_weights`). It writes:

* ``loss_curves.json`` / ``.png``: every run's logged loss and its mean over the last quarter; runs on the reference's
  seed see its samples, t and ε at every step, so their per-step difference from it is paired;
* ``training.json``: per run its command, ``timings.json`` and ``starts.json`` (the commit and GPU of every start);
* ``training_verdict.json`` (printed too): :func:`bench.quality.training_verdict.training_verdict` of the rows;
* ``training.md``: all of it as tables (:mod:`bench.quality.training_report`).
Each carries the commit of the code that wrote it, as every row does.

Run as a ladder preset (one device call on one H100 or H200, docs/quality.md; a call cut by ``budget_s`` is finished
by the same command, the runs being resumed from ``runs``):
    python -m bench.ladder preset=quality_training out=bench/results/h200/quality/training budget_s=450

Options (``quality_training.*`` in configs/ladder.yaml): ``steps``, ``experiment``, ``seeds``, ``control``,
``image_size``, ``runs`` (default ``runs/quality_training``, git-ignored), ``gpus`` (N > 1 trains the arms
concurrently, one per GPU, :func:`train_arms`), ``per_gpu`` (k > 1 runs k arms at once on each GPU: a 32³ run keeps an
H100 a few percent busy, so k = 7 trains all seven in the time of the slowest, their step times then shared-GPU
figures, not speeds) and ``overrides``, Hydra overrides: ``train.*`` go to the training
runs, ``quality.*`` and ``bench.*`` to the gates, the rest (``model``, ``data``, ``seed``, ...) to both (a ``seed=``
moves the reseeded runs to the seeds after it). Resumable: a run continues from its last checkpoint (``resume=auto``),
a finished run and a row already in results.jsonl are kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import queue
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from hydra import compose
from omegaconf import DictConfig

from bench.core import presets
from bench.core.records import RESULTS_FILE, candidate_checkpoint, provenance, read_rows
from bench.core.runner import Job, experiment_stack, run_ladder
from bench.core.subprocesses import spawn
from bench.quality.training_report import CONTROL, REFERENCE, VERDICT_FILE, arm_label
from bench.quality.training_verdict import training_verdict
from bench.quality.validation import held_out_phantoms, validation_loss
from med_ddpm.checkpoint import load_checkpoint, read_checkpoint
from med_ddpm.cli import CONFIG_DIR, configs
from med_ddpm.config_checks import ConfigError
from med_ddpm.data.encoding import VARIANT_BY_IMAGE_CHANNELS
from med_ddpm.run_clock import TIMINGS_FILE
from med_ddpm.train import read_loss_log
from med_ddpm.utils import atomic_write_text, resolve_device, save_figure
from optim import RecipeStack

STARTS_FILE = "starts.json"  # in each run's folder: every (re)start's commit and GPU
TAIL = 0.25  # the loss summary averages the last quarter of the logged steps
MIN_SEEDS = 4  # the fresh seed is judged against the other seeds: at least 3 of them (MIN_DRAWS)
VALIDATION_PHANTOMS, VALIDATION_DRAWS = 64, 8  # held-out phantoms and fixed (t, eps) draws of each for val_loss


def reseeds(seeds: int) -> list[str]:
    """The reseeded FP32 arms, in seed order: ``fp32_seed1`` .. ``fp32_seed<seeds>``."""
    return [f"{REFERENCE}_seed{i}" for i in range(1, seeds + 1)]


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(training overrides, gate overrides): ``train.*`` trains only, ``quality.*`` / ``bench.*`` gate only."""
    def top(o: str) -> str:
        return o.lstrip("+~").split("=", 1)[0].split(".", 1)[0]

    return ([o for o in overrides if top(o) not in ("quality", "bench")],
            [o for o in overrides if top(o) != "train"])


def quality_model_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The quality model's training config under ``overrides`` (its config is the one source of its seed and
    device)."""
    with configs():
        return compose("train", overrides=["experiment=quality_model", *overrides, "output_dir=."])


def training_commands(steps: int, experiment: str, runs: Path, control: Sequence[str], overrides: Sequence[str] = (),
                      seeds: int = MIN_SEEDS) -> dict[str, list[str]]:
    """Arm name -> ``python -m`` argv of its training run: strict FP32 on the quality model's seed s (the reference),
    strict FP32 on seeds s + 1 .. s + ``seeds`` (the band), ``experiment``'s stack on s + seeds + 1 and strict FP32
    with the ``control`` overrides on s + seeds + 2. Every arm but the reference is on a seed of its own, so under
    "harmless" the stack and the control are one more draw of retraining, as each band run is."""
    if not (CONFIG_DIR / "experiment" / f"{experiment}.yaml").exists():
        raise ConfigError(f"quality_training.experiment={experiment}: no configs/experiment/{experiment}.yaml; "
                          "name an experiment whose recipe stack to train with (fast_train)")
    if seeds < MIN_SEEDS:
        raise ConfigError(f"quality_training.seeds={seeds}: the fresh seed is judged against the band of the other "
                          f"seeds, which needs {MIN_SEEDS - 1} of them; pass quality_training.seeds>={MIN_SEEDS}")
    stacks = {REFERENCE: ["recipe=[]"], **{arm: ["recipe=[]"] for arm in reseeds(seeds)},
              experiment: experiment_stack(experiment), CONTROL: ["recipe=[]", *control]}
    seed = int(quality_model_config(overrides).seed)
    # after the overrides, so that it wins over a seed= there
    moved = {arm: [f"seed={seed + offset}"] for offset, arm in enumerate(stacks) if offset}
    return {arm: ["med_ddpm.train", "experiment=quality_model", *stack, f"train.max_steps={steps}", *overrides,
                  *moved.get(arm, []), f"output_dir={runs / arm}", "resume=auto", "train.progress=false"]
            for arm, stack in stacks.items()}


def visible_gpus(count: int) -> list[str]:
    """The first ``count`` GPUs this process may see, as CUDA_VISIBLE_DEVICES entries for the runs (the user's own
    CUDA_VISIBLE_DEVICES, if set, picks which)."""
    import torch

    found = torch.cuda.device_count()
    if found < count:
        raise ConfigError(f"quality_training.gpus={count}: this machine shows {found} CUDA GPU(s); pass "
                          f"quality_training.gpus={max(found, 1)}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[:count] if visible else [str(i) for i in range(count)]


def finished(run: Path, steps: int) -> bool:
    last = run / "checkpoints" / "last.pt"
    return last.exists() and int(read_checkpoint(last)["step"]) >= steps


def record_start(run: Path, gpu: str | None, sharing: int = 1) -> None:
    """Append this start of the run to ``<run>/starts.json``: the commit of the code that trains (a run resumed
    in a later call may run other code), the GPU it was given (set: the arms trained at once) and how many runs
    shared that GPU (``sharing`` > 1: its step times are not a speed)."""
    path = run / STARTS_FILE
    starts = json.loads(path.read_text()) if path.exists() else []
    atomic_write_text(path, json.dumps([*starts, {**provenance(), "gpu": gpu, "runs_per_gpu": sharing,
                                                  "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]))


def train_arm(argv: list[str], run: Path, steps: int, timeout_s: float | None, gpu: str | None = None,
              sharing: int = 1) -> str:
    """Run (or continue) one unfinished training run, on ``gpu`` (a CUDA_VISIBLE_DEVICES entry) when given, beside
    ``sharing - 1`` other runs; its status: done | cut | error."""
    run.mkdir(parents=True, exist_ok=True)
    record_start(run, gpu, sharing)
    print(f"[train] {run.name}: to step {steps}{'' if gpu is None else f' on GPU {gpu}'}, log in "
          f"{run / 'train.log'}", flush=True)
    code, wall, tail = spawn(argv, run.parent / "cache", run / "train.log", timeout_s,
                             None if gpu is None else {"CUDA_VISIBLE_DEVICES": gpu})
    print(f"[train] {' '.join(argv[1:])}: {'timed out' if code is None else f'exit {code}'} after {wall:.0f} s",
          flush=True)
    if code is None:
        return "cut"
    if code != 0 or not finished(run, steps):
        print(tail, file=sys.stderr)
        return "error"
    return "done"


def train_arms(commands: dict[str, list[str]], runs: Path, steps: int, budget_s: float = math.inf,
               gpus: Sequence[str] = ()) -> dict[str, str]:
    """Each arm's status (:func:`train_arm`), the arms started in order. With several ``gpus``
    (CUDA_VISIBLE_DEVICES entries, a GPU listed k times taking k runs at once) they run concurrently, a slot taking
    the next arm when its run ends, and ``starts.json`` records the GPU and how many runs shared it; with none
    given they run one after another on the default device.
    An arm that fails does not stop the others (its status says so)."""
    start, free = time.monotonic(), queue.SimpleQueue()
    for gpu in gpus or [None]:
        free.put(gpu)
    to_train = {arm for arm in commands if not finished(runs / arm, steps)}  # at most these share a GPU

    def one(arm: str) -> str:
        if arm not in to_train:
            return "done"
        gpu = free.get()
        try:
            remaining = budget_s - (time.monotonic() - start)
            if remaining <= 0:
                return "cut"
            return train_arm(commands[arm], runs / arm, steps, remaining if math.isfinite(remaining) else None, gpu,
                             min(gpus.count(gpu), len(to_train)) if gpu is not None else 1)
        finally:
            free.put(gpu)

    with ThreadPoolExecutor(max_workers=max(1, len(gpus))) as pool:
        return dict(zip(commands, pool.map(one, commands)))


def tail_losses(curves: dict[str, tuple[list[int], list[float]]]) -> dict[str, Any]:
    """Each run's mean training loss over the last quarter of its logged steps (every run draws its own samples,
    t and ε: the runs' curves are compared unpaired)."""
    out: dict[str, Any] = {"tail_fraction": TAIL}
    for arm, (steps, losses) in curves.items():
        tail = losses[math.floor(len(losses) * (1 - TAIL)):]
        out[arm] = {"logged_steps": len(steps), "last_step": steps[-1] if steps else None,
                    "tail_mean_loss": sum(tail) / len(tail) if tail else None}
    return out


def validation_losses(runs: Path, arms: Sequence[str], device: torch.device) -> dict[str, float]:
    """Each run's EMA weights' ε-MSE on :data:`VALIDATION_PHANTOMS` held-out phantoms, :data:`VALIDATION_DRAWS` fixed
    (t, ε) each, the same for every run (:func:`bench.quality.validation.validation_loss`)."""
    out, phantoms = {}, None
    for arm in arms:
        loaded = load_checkpoint(runs / arm / "checkpoints" / "last.pt", weights="ema")
        model, schedule = loaded.model.to(device).eval(), loaded.schedule.to(device)
        if phantoms is None:  # every run is the quality model at one size: the same phantoms for all
            variant = VARIANT_BY_IMAGE_CHANNELS[model.out_channels]
            phantoms = held_out_phantoms(VALIDATION_PHANTOMS, tuple(loaded.config["model"]["image_size"]), variant)
        with RecipeStack([]).session():
            out[arm] = validation_loss(model, schedule, *phantoms, device, draws=VALIDATION_DRAWS)
    return out


def plot_losses(curves: dict[str, tuple[list[int], list[float]]], path: Path, title: str) -> Path:
    """Every run's logged losses (thin) and their running means over 10 logged steps (thick), log scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for colour, (arm, (steps, losses)) in zip((f"C{i}" for i in range(10)), curves.items()):
        window = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(steps, losses, color=colour, lw=0.6, alpha=0.4)
        ax.plot(steps, window, color=colour, lw=1.8, label=arm_label(arm))
    ax.set(xlabel="optimizer step", ylabel="training loss", yscale="log")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def write_curves(out: Path, runs: Path, commands: dict[str, list[str]], steps: int,
                 device: torch.device) -> dict[str, Any]:
    """loss_curves.json / .png and training.json from the finished runs; the summary: each run's training-loss tail
    and validation loss."""
    curves = {arm: read_loss_log(runs / arm) for arm in commands}
    summary = tail_losses(curves)
    for arm, value in validation_losses(runs, list(commands), device).items():
        summary[arm]["val_loss"] = value
    code = provenance()
    atomic_write_text(out / "loss_curves.json", json.dumps(
        {"summary": summary, "curves": {arm: {"step": s, "loss": v} for arm, (s, v) in curves.items()}, **code},
        indent=1))
    plot_losses(curves, out / "loss_curves.png", f"quality model, {steps} steps each, every run on its own seed")

    def read(arm: str, name: str) -> Any:
        return json.loads(p.read_text()) if (p := runs / arm / name).exists() else None

    arms = {arm: {"argv": commands[arm], "timings": read(arm, TIMINGS_FILE), "starts": read(arm, STARTS_FILE)}
            for arm in commands}
    atomic_write_text(out / "training.json", json.dumps({"arms": arms, **code}, indent=1))
    return summary


def frozen_weights(checkpoint: Path) -> str:
    """``checkpoint`` under a name holding a digest of its bytes (a hard link beside it, a copy where links fail).
    A gated row names the weights it saw, so a row gated before a run was retrained never stands for the new
    weights, in a resumed call or in a results folder carried from another machine."""
    with checkpoint.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:12]
    frozen = checkpoint.with_name(f"{checkpoint.stem}-{digest}.pt")
    if not frozen.exists():
        try:
            os.link(checkpoint, frozen)
        except OSError:
            shutil.copyfile(checkpoint, frozen)
    return str(frozen)


def quality_pair_ladder(reference: str | None, candidate: str | None) -> list[Job]:
    """The jobs of ``preset=quality_pair`` (``configs/ladder/preset/quality_pair.yaml``) for two checkpoints of the
    quality model: the reference's and the candidate's EMA weights gated against each other."""
    return [job.overrides for job in presets.jobs("quality_pair", {"checkpoint": reference,
                                                                   "candidate_checkpoint": candidate})]


def gated_pairs(runs: Path, arms: Sequence[str]) -> dict[str, tuple[str, str]]:
    """Arm -> (reference, candidate) EMA weights of the finished runs, by content, for every arm but the
    reference."""
    weights = {arm: frozen_weights(runs / arm / "checkpoints" / "last.pt") for arm in arms}
    return {arm: (weights[REFERENCE], weights[arm]) for arm in arms if arm != REFERENCE}


def gate_jobs(pairs: dict[str, tuple[str, str]], runs: Path, overrides: Sequence[str] = ()) -> list[list[str]]:
    """The ladder jobs of the gated pairs. They share the FP32 reference arm, so one reference cache (in ``runs``,
    keyed by the reference's weights) serves them all: its DDPM samples are computed once."""
    cache = f"quality.cache_dir={runs / 'gate_cache'}"
    return [[*job, cache, *overrides] for pair in pairs.values() for job in quality_pair_ladder(*pair)]


def gated_row(rows: list[dict[str, Any]], pair: tuple[str, str]) -> dict[str, Any] | None:
    """The latest row that gated ``pair`` (reference, candidate weights), or None when there is none or it failed."""
    found = [r for r in rows if candidate_checkpoint(r) == pair[1]
             and ((r.get("config") or {}).get("bench") or {}).get("checkpoint") == pair[0]]
    last = found[-1] if found else {}
    return last if last.get("status") == "ok" and (last.get("quality") or {}).get("checks") else None


def write_verdict(out: Path, pairs: dict[str, tuple[str, str]], experiment: str, seeds: int,
                  summary: dict[str, Any]) -> dict[str, Any]:
    rows = read_rows(out) if (out / RESULTS_FILE).exists() else []
    val_losses = {arm: v["val_loss"] for arm, v in summary.items() if isinstance(v, dict)}
    verdict = {**training_verdict({arm: gated_row(rows, pair) for arm, pair in pairs.items()}, val_losses, REFERENCE,
                                  experiment, CONTROL, reseeds(seeds)),
               "tail_mean_loss": {arm: v["tail_mean_loss"] for arm, v in summary.items() if isinstance(v, dict)},
               **provenance()}
    atomic_write_text(out / VERDICT_FILE, json.dumps(verdict, indent=1))
    print(json.dumps({k: verdict.get(k) for k in ("verdict", "why", "controls_ok", "val_loss")}, indent=1))
    return verdict


def list_left(out: Path, commands: dict[str, list[str]], runs: Path, steps: int, gate_overrides: Sequence[str]) -> int:
    """``dry_run``: print each run as done or to do and, once all are finished, the gate jobs (the ladder's
    listing); train and gate nothing. Returns the runs and gate jobs left."""
    left = [arm for arm in commands if not finished(runs / arm, steps)]
    for arm, argv in commands.items():
        print(f"[{'todo' if arm in left else 'done'}] python -m {' '.join(argv)}")
    if left:
        print(f"[todo] the {len(commands) - 1} gates, once the {len(commands)} runs are finished")
        return len(left) + len(commands) - 1
    return run_ladder(out, gate_jobs(gated_pairs(runs, list(commands)), runs, gate_overrides), 0, dry_run=True,
                      complete_baselines=False)


def run(out: Path, steps: int, control: Sequence[str], experiment: str = "fast_train",
        runs: Path = Path("runs/quality_training"), budget_s: float = math.inf, overrides: Sequence[str] = (),
        gpus: Sequence[str] = (), dry_run: bool = False, seeds: int = MIN_SEEDS) -> int:
    """Train the arms (concurrently on ``gpus``, :func:`train_arms`), write the loss curves, gate every arm's EMA
    model against FP32's and write the training verdict. Returns the gate jobs left (0: done), or before the gates 1
    when a run failed and 2 when the budget cut one. ``dry_run`` lists what is left instead (:func:`list_left`)."""
    start = time.monotonic()
    train_overrides, gate_overrides = split_overrides(overrides)
    runs = runs.resolve()
    commands = training_commands(steps, experiment, runs, control, train_overrides, seeds)
    if dry_run:
        return list_left(out, commands, runs, steps, gate_overrides)
    statuses = train_arms(commands, runs, steps, budget_s, gpus)
    unfinished = {arm: status for arm, status in statuses.items() if status != "done"}
    for arm, status in unfinished.items():
        print(f"quality_training: the {arm} run is not finished ({status}); rerun the same command to continue")
    if unfinished:
        return 1 if "error" in unfinished.values() else 2
    out.mkdir(parents=True, exist_ok=True)
    summary = write_curves(out, runs, commands, steps, resolve_device(str(quality_model_config(train_overrides).device)))
    pairs = gated_pairs(runs, list(commands))
    left = run_ladder(out, gate_jobs(pairs, runs, gate_overrides), budget_s - (time.monotonic() - start),
                      complete_baselines=False)
    write_verdict(out, pairs, experiment, seeds, summary)
    return left
