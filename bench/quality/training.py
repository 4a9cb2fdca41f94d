"""Does a training stack degrade the trained model? The quality model trained three times, then gated twice.

``experiment=quality_model`` is trained for ``steps`` optimizer steps three times, in fresh processes
(``python -m med_ddpm.train``): with strict FP32 (``recipe=[]``, arm ``fp32``), with ``experiment``'s recipe stack
(default ``fast_train``; the stack and the options it sets on its recipes are read from its config,
:func:`bench.core.runner.experiment_stack`), and with strict FP32 and the next seed (``fp32_reseed``: ``seed=`` the
quality model's + 1). The stack's run is the quality model's own config otherwise: the same seed, so the same
initial weights, data order and every (t, ε) draw; batch 4 x grad_accum 1 in all three, which
``compile_cudagraphs`` takes. Two training runs diverge even on one recipe stack (nondeterministic cuDNN weight
gradients, chaotic SGD), so the reseeded run is what retraining alone changes: the null a stack is judged against.
Then:

* ``<out>/loss_curves.json`` and ``loss_curves.png``: the three runs' logged training loss (each run's
  ``loss.jsonl``) overlaid, each with its mean over the last quarter of the steps. The stack's run sees FP32's
  samples, t and ε at every step, so its per-step difference from FP32 is paired; the reseeded run's is not;
* ``<out>/training.json``: per run (``arms``) its command, ``timings.json`` (steady ms per step; the runs may
  come from several calls, so their ratio is not a same-run one) and ``starts.json`` (the commit of the code
  that trained, and the GPU, at every start); it and ``loss_curves.json`` carry the commit (``git_sha``,
  ``dirty``) of the code that wrote them, as every row does;
* two gated rows in ``<out>/results.jsonl`` (:func:`quality_pair_ladder`): the FP32 run's EMA weights
  as the reference, the stack's (the stack row) and the reseeded run's (the training-noise row) as the candidate
  (``quality.candidate_checkpoint``, which names the row in its key and label), strict-FP32 DDPM with the same
  masks and noise, so only the weights differ. The weights are gated under names holding a digest of their bytes
  (:func:`frozen_weights`): a row gated before a run was retrained does not stand for the new weights;
* ``<out>/training_verdict.json`` (printed too): per distribution check of the gate (intensity histogram W1, KID,
  MMD, diversity gap), the stack row's value and p-value beside the training-noise row's, and ``within`` (training
  noise) when the stack's statistic is no further from the reference than the reseeded model's (the magnitude for
  the two-sided diversity gap), else ``further``. The verdict is ``pass`` when every check is
  within, else ``inconclusive``, never ``fail``: with ONE draw of training noise (one reseed) a harmless stack
  lands beyond that draw on a given check about half the time, so only a pass carries information (the stack
  moved the samples no further than one retraining did). The reseeded run also starts from other weights and
  sees another data order than the stack's run, a wider null than FP32 re-run on its seed, so a pass is a
  lenient one. The paired and ε checks between two trained models measure how far apart their weights are, not
  degradation: reported (``weight_differences``), not deciding. With the three runs' loss tail means. Without
  both rows (a gate job cut by the budget or failed), or with a statistic that is not a number, the verdict is
  ``undecided`` and says why. It carries the commit of the code that wrote it, as every row does;
* ``<out>/training.md``: all of it as tables (:mod:`bench.quality.training_report`).

Run as a ladder preset (1000 steps each: three runs and two gates take several 10-minute device calls,
docs/quality.md; a call cut by ``budget_s`` is finished by running the same command again while ``runs`` is there):
    python -m bench.ladder preset=quality_training out=bench/results/h200/quality/training budget_s=560

Options (``quality_training.*`` in configs/ladder.yaml): ``steps`` (1000), ``experiment`` (fast_train), ``runs``
(the three runs and their compile cache; default ``runs/quality_training``, git-ignored), ``gpus`` (1; N > 1
trains the arms concurrently, one per GPU, :func:`train_arms`) and ``overrides``, a list
of Hydra overrides: ``train.*`` go to the training runs, ``quality.*`` and ``bench.*`` to the gate, the rest
(``model``, ``data``, ``diffusion``, ``sampler``, ``device``, ``seed``, ...) to both (a ``seed=`` there moves the
reseeded run to that seed + 1). Resumable: a run is continued from its last checkpoint (``resume=auto``), a
finished run and a row already in results.jsonl are kept, so a cut call is finished by the same command.
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
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hydra import compose

from bench.core import presets
from bench.core.records import RESULTS_FILE, candidate_checkpoint, provenance, read_rows
from bench.core.runner import Job, experiment_stack, run_ladder
from bench.core.subprocesses import spawn
from bench.quality.training_report import NOISE, REFERENCE, RESEED, VERDICT_FILE, arm_label
from med_ddpm.checkpoint import read_checkpoint
from med_ddpm.cli import CONFIG_DIR, configs
from med_ddpm.config_checks import ConfigError
from med_ddpm.run_clock import TIMINGS_FILE
from med_ddpm.train import read_loss_log
from med_ddpm.utils import atomic_write_text, save_figure

TWO_SIDED = ("diversity_gap",)  # the gate tests it two-sided (med_ddpm.quality.gate): its magnitude is the distance
PAIRED = {"stack": f"{REFERENCE} vs the stack", NOISE: f"{REFERENCE} vs {RESEED}"}  # what each gated row compares
STARTS_FILE = "starts.json"  # in each run's folder: every (re)start's commit and GPU
NOTE = ("one draw of training noise (one reseeded FP32 run): a pass means no check moved further from FP32 than one "
        "retraining did; a check beyond that one draw is not evidence of harm (a harmless stack lands there about "
        "half the time), hence inconclusive. The paired and eps checks between two trained models measure how far "
        "apart their weights are, not degradation: reported, not deciding.")
TAIL = 0.25  # the loss summary averages the last quarter of the logged steps


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(training overrides, gate overrides): ``train.*`` trains only, ``quality.*`` / ``bench.*`` gate only."""
    def top(o: str) -> str:
        return o.lstrip("+~").split("=", 1)[0].split(".", 1)[0]

    return ([o for o in overrides if top(o) not in ("quality", "bench")],
            [o for o in overrides if top(o) != "train"])


def quality_model_seed(overrides: Sequence[str] = ()) -> int:
    """The quality model's run seed under ``overrides`` (its config is the one source)."""
    with configs():
        return int(compose("train", overrides=["experiment=quality_model", *overrides, "output_dir=."]).seed)


def training_commands(steps: int, experiment: str, runs: Path, overrides: Sequence[str] = ()) -> dict[str, list[str]]:
    """Arm name -> ``python -m`` argv of its training run: strict FP32, ``experiment``'s stack (nothing else apart)
    and strict FP32 with the next seed (the run seed alone apart: another draw of the training noise)."""
    if not (CONFIG_DIR / "experiment" / f"{experiment}.yaml").exists():
        raise ConfigError(f"quality_training.experiment={experiment}: no configs/experiment/{experiment}.yaml; "
                          "name an experiment whose recipe stack to train with (fast_train)")
    stacks = {REFERENCE: ["recipe=[]"], experiment: experiment_stack(experiment), RESEED: ["recipe=[]"]}
    reseed = {RESEED: [f"seed={quality_model_seed(overrides) + 1}"]}  # after the overrides: it wins over a seed= there
    return {arm: ["med_ddpm.train", "experiment=quality_model", *stack, f"train.max_steps={steps}", *overrides,
                  *reseed.get(arm, []), f"output_dir={runs / arm}", "resume=auto", "train.progress=false"]
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


def record_start(run: Path, gpu: str | None) -> None:
    """Append this start of the run to ``<run>/starts.json``: the commit of the code that trains (a run resumed
    in a later call may run other code) and the GPU it was given (set: the arms trained at once, one per GPU)."""
    path = run / STARTS_FILE
    starts = json.loads(path.read_text()) if path.exists() else []
    atomic_write_text(path, json.dumps([*starts, {**provenance(), "gpu": gpu,
                                                  "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]))


def train_arm(argv: list[str], run: Path, steps: int, timeout_s: float | None, gpu: str | None = None) -> str:
    """Run (or continue) one training run unless it is finished, on ``gpu`` (a CUDA_VISIBLE_DEVICES entry) when
    given; its status: done | cut | error."""
    if finished(run, steps):
        return "done"
    run.mkdir(parents=True, exist_ok=True)
    record_start(run, gpu)
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
    (CUDA_VISIBLE_DEVICES entries) they run concurrently, one per GPU, a GPU taking the next arm when its run
    ends: on three GPUs the three runs take the time of the longest one. Each run has a GPU of its own (the CPU
    is shared), and ``starts.json`` records which; with none given they run one after another on the default
    device.
    An arm that fails does not stop the others (its status says so)."""
    start, free = time.monotonic(), queue.SimpleQueue()
    for gpu in gpus or [None]:
        free.put(gpu)

    def one(arm: str) -> str:
        gpu = free.get()
        try:
            remaining = budget_s - (time.monotonic() - start)
            if remaining <= 0:
                return "done" if finished(runs / arm, steps) else "cut"
            return train_arm(commands[arm], runs / arm, steps, remaining if math.isfinite(remaining) else None, gpu)
        finally:
            free.put(gpu)

    with ThreadPoolExecutor(max_workers=max(1, len(gpus))) as pool:
        return dict(zip(commands, pool.map(one, commands)))


def compare_losses(curves: dict[str, tuple[list[int], list[float]]], reference: str,
                   unpaired: Collection[str] = ()) -> dict[str, Any]:
    """Each run's mean loss over the last quarter of its logged steps and, for a run on the reference's data order,
    its paired difference there (same steps, so the same samples, t and ε: the difference is the stack's alone).
    An ``unpaired`` run (another seed: other samples, t and ε at each step) gets no per-step difference."""
    ref = dict(zip(*curves[reference]))
    out: dict[str, Any] = {"tail_fraction": TAIL}
    for arm, (steps, losses) in curves.items():
        tail = steps[math.floor(len(steps) * (1 - TAIL)):]
        mine = dict(zip(steps, losses))
        out[arm] = {"logged_steps": len(steps), "last_step": steps[-1] if steps else None,
                    "tail_mean_loss": sum(mine[s] for s in tail) / len(tail) if tail else None}
        if arm == reference:
            continue
        out[arm]["paired"] = arm not in unpaired
        shared = [s for s in tail if s in ref]
        if out[arm]["paired"] and shared:
            out[arm]["tail_mean_difference"] = sum(mine[s] - ref[s] for s in shared) / len(shared)
    return out


def plot_losses(curves: dict[str, tuple[list[int], list[float]]], path: Path, title: str) -> Path:
    """Every run's logged losses (thin) and their running means over 10 logged steps (thick), log scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for colour, (arm, (steps, losses)) in zip(("tab:blue", "tab:orange", "tab:green"), curves.items()):
        window = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(steps, losses, color=colour, lw=0.6, alpha=0.4)
        ax.plot(steps, window, color=colour, lw=1.8, label=arm_label(arm))
    ax.set(xlabel="optimizer step", ylabel="training loss", yscale="log")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def write_curves(out: Path, runs: Path, commands: dict[str, list[str]], steps: int) -> dict[str, Any]:
    """loss_curves.json / .png and training.json from the finished runs."""
    curves = {arm: read_loss_log(runs / arm) for arm in commands}
    summary = compare_losses(curves, REFERENCE, unpaired=(RESEED,))
    code = provenance()
    atomic_write_text(out / "loss_curves.json", json.dumps(
        {"summary": summary, "curves": {arm: {"step": s, "loss": v} for arm, (s, v) in curves.items()}, **code},
        indent=1))
    plot_losses(curves, out / "loss_curves.png", f"quality model, {steps} steps each:\nthe stack on FP32's seed and "
                "data order, the reseeded FP32 run on its own")

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


def gated_pairs(runs: Path, experiment: str) -> dict[str, tuple[str, str]]:
    """Row name -> (reference, candidate) EMA weights of the finished runs, by content: the stack's row and the
    training-noise row."""
    weights = {arm: frozen_weights(runs / arm / "checkpoints" / "last.pt") for arm in (REFERENCE, experiment, RESEED)}
    return {"stack": (weights[REFERENCE], weights[experiment]), NOISE: (weights[REFERENCE], weights[RESEED])}


def gate_jobs(pairs: dict[str, tuple[str, str]], runs: Path, overrides: Sequence[str] = ()) -> list[list[str]]:
    """The ladder jobs of the gated pairs. They share the FP32 reference arm, so one reference cache (in ``runs``,
    keyed by the reference's weights) serves both: its DDPM-250 samples are computed once."""
    cache = f"quality.cache_dir={runs / 'gate_cache'}"
    return [[*job, cache, *overrides] for pair in pairs.values() for job in quality_pair_ladder(*pair)]


def gated_row(rows: list[dict[str, Any]], pair: tuple[str, str]) -> dict[str, Any] | None:
    """The latest row that gated ``pair`` (reference, candidate weights), or None when there is none or it failed."""
    found = [r for r in rows if candidate_checkpoint(r) == pair[1]
             and ((r.get("config") or {}).get("bench") or {}).get("checkpoint") == pair[0]]
    last = found[-1] if found else {}
    return last if last.get("status") == "ok" and (last.get("quality") or {}).get("checks") else None


def distance(name: str, value: Any) -> float:
    """How far a check's statistic puts the candidate from the reference: the value, or its magnitude for a
    two-sided check (``diversity_gap`` may go either way). JSON keeps a NaN as a string; float() reads it."""
    return abs(float(value)) if name in TWO_SIDED else float(value)


def compare_checks(stack: dict[str, Any], noise: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per distribution check: both rows' value and p-value, and ``within`` when the stack is no further from the
    reference than the training noise, ``further`` when it is, ``undecided`` when either is not a number."""
    out = {}
    for name, check in stack["quality"]["checks"].items():
        other = noise["quality"]["checks"].get(name)
        if check.get("kind") != "distribution" or other is None:
            continue
        mine, theirs = distance(name, check["value"]), distance(name, other["value"])
        finite = math.isfinite(mine) and math.isfinite(theirs)
        out[name] = {"stack": {k: check.get(k) for k in ("value", "p_value", "status")},
                     NOISE: {k: other.get(k) for k in ("value", "p_value", "status")},
                     "verdict": "undecided" if not finite else "within" if mine <= theirs else "further"}
    return out


def weight_differences(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The paired and ε checks of each row: how far apart two trained networks are, reported, not deciding."""
    names = [n for n, c in rows["stack"]["quality"]["checks"].items() if c.get("kind") != "distribution"]
    return {n: {arm: row["quality"]["checks"].get(n, {}).get("value") for arm, row in rows.items()} for n in names}


def training_verdict(stack: dict[str, Any] | None, noise: dict[str, Any] | None,
                     losses: dict[str, Any]) -> dict[str, Any]:
    """The stack's row judged against the training-noise row (module docstring); ``undecided`` without both."""
    out: dict[str, Any] = {"note": NOTE, "tail_mean_loss": {arm: v["tail_mean_loss"] for arm, v in losses.items()
                                                            if isinstance(v, dict)}}
    rows = {"stack": stack, NOISE: noise}
    missing = [f"{name} row ({PAIRED[name]})" for name, row in rows.items() if row is None]
    if missing:
        return {"verdict": "undecided", "why": f"no gated {' and no '.join(missing)} in results.jsonl (cut by the "
                "budget or failed): rerun the same command", **out}
    checks = compare_checks(stack, noise)
    found = {state: [f"{n}: stack {float(c['stack']['value']):.3g} vs training noise {float(c[NOISE]['value']):.3g}"
                     for n, c in checks.items() if c["verdict"] == state] for state in ("undecided", "further")}
    if not checks or found["undecided"]:
        verdict, why = "undecided", "; ".join(found["undecided"]) or "the rows hold no distribution check"
    elif found["further"]:
        verdict, why = "inconclusive", "further than one draw of training noise on " + "; ".join(found["further"])
    else:
        verdict, why = "pass", "within training noise"
    return {"verdict": verdict, "why": why, "checks": checks,
            "gate": {name: row["quality"]["verdict"] for name, row in rows.items()},
            "weight_differences": weight_differences(rows), **out}


def write_verdict(out: Path, pairs: dict[str, tuple[str, str]], losses: dict[str, Any]) -> dict[str, Any]:
    rows = read_rows(out) if (out / RESULTS_FILE).exists() else []
    verdict = {**training_verdict(gated_row(rows, pairs["stack"]), gated_row(rows, pairs[NOISE]), losses),
               **provenance()}
    atomic_write_text(out / VERDICT_FILE, json.dumps(verdict, indent=1))
    print(json.dumps({k: verdict[k] for k in ("verdict", "why", "tail_mean_loss")}, indent=1))
    return verdict


def list_left(out: Path, commands: dict[str, list[str]], runs: Path, steps: int, experiment: str,
              gate_overrides: Sequence[str]) -> int:
    """``dry_run``: print each run as done or to do and, once all are finished, the gate jobs (the ladder's
    listing); train and gate nothing. Returns the runs and gate jobs left."""
    left = [arm for arm in commands if not finished(runs / arm, steps)]
    for arm, argv in commands.items():
        print(f"[{'todo' if arm in left else 'done'}] python -m {' '.join(argv)}")
    if left:
        print(f"[todo] the two gates, once the {len(commands)} runs are finished")
        return len(left) + len(PAIRED)
    return run_ladder(out, gate_jobs(gated_pairs(runs, experiment), runs, gate_overrides), 0, dry_run=True,
                      complete_baselines=False)


def run(out: Path, steps: int = 1000, experiment: str = "fast_train", runs: Path = Path("runs/quality_training"),
        budget_s: float = math.inf, overrides: Sequence[str] = (), gpus: Sequence[str] = (),
        dry_run: bool = False) -> int:
    """Train the three arms (concurrently on ``gpus``, :func:`train_arms`), write the loss curves, gate the
    stack's and the reseeded EMA models against FP32's and write the training verdict. Returns the gate jobs
    left (0: done), or before the gates 1 when a run failed and 2 when the budget cut one. ``dry_run`` lists
    what is left instead (:func:`list_left`)."""
    start = time.monotonic()
    train_overrides, gate_overrides = split_overrides(overrides)
    runs = runs.resolve()
    commands = training_commands(steps, experiment, runs, train_overrides)
    if dry_run:
        return list_left(out, commands, runs, steps, experiment, gate_overrides)
    statuses = train_arms(commands, runs, steps, budget_s, gpus)
    unfinished = {arm: status for arm, status in statuses.items() if status != "done"}
    for arm, status in unfinished.items():
        print(f"quality_training: the {arm} run is not finished ({status}); rerun the same command to continue")
    if unfinished:
        return 1 if "error" in unfinished.values() else 2
    out.mkdir(parents=True, exist_ok=True)
    losses = write_curves(out, runs, commands, steps)
    print(json.dumps(losses))
    pairs = gated_pairs(runs, experiment)
    left = run_ladder(out, gate_jobs(pairs, runs, gate_overrides), budget_s - (time.monotonic() - start),
                      complete_baselines=False)
    write_verdict(out, pairs, losses)
    return left
