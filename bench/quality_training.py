"""Does a training stack degrade the trained model? The quality model trained twice, then the two models gated.

``experiment=quality_model`` is trained for ``steps`` optimizer steps twice, in fresh processes
(``python -m med_ddpm.train``): once with strict FP32 (``recipe=[]``) and once with ``experiment``'s recipe
stack (default ``fast_train``; the stack and the options it sets on its recipes are read from its config,
:func:`bench.ladder.experiment_stack`). Everything else is the quality model's own config: the same seed,
so the same initial weights, data order and every (t, ε) draw; batch 4 x grad_accum 1 in both, which
``compile_cudagraphs`` takes. Then:

* ``<out>/loss_curves.json`` and ``loss_curves.png``: both runs' logged training loss (each run's
  ``loss.jsonl``) overlaid. The two runs see the same samples, t and ε at every step, so the curves differ
  only by the stack's numerics and what they did to the weights;
* ``<out>/training.json``: each run's command and ``timings.json`` (steady ms per step: a same-call ratio);
* one gated row in ``<out>/results.jsonl`` (``bench.ladder preset=quality_pair``): the FP32 run's EMA weights
  as the reference, the stack run's EMA weights as the candidate (``quality.candidate_checkpoint``), both
  strict-FP32 DDPM with the same masks and noise, so only the weights differ.

Run as a ladder preset (1000 steps each: the quality model's own 3000, twice, would not fit one 10-minute device
call; a call cut by ``budget_s`` is finished by running the same command again):
    python -m bench.ladder preset=quality_training out=bench/results/h200/quality/training budget_s=560

Options (``quality_training.*`` in configs/ladder.yaml): ``steps`` (1000), ``experiment`` (fast_train), ``runs``
(the two runs and their compile cache; default ``runs/quality_training``, git-ignored) and ``overrides``, a list of
Hydra overrides: ``train.*`` go to both training runs, ``quality.*`` and ``bench.*`` to the gate, the rest
(``model``, ``data``, ``diffusion``, ``sampler``, ``device``, ``seed``, ...) to all three. Resumable: a run is
continued from its last checkpoint (``resume=auto``), a finished run and a row already in results.jsonl are kept,
so a cut call is finished by the same command.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.e2e import spawn
from bench.ladder import experiment_stack, quality_pair_ladder, run_ladder
from med_ddpm.checkpoint import read_checkpoint
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.errors import ConfigError
from med_ddpm.timings import TIMINGS_FILE
from med_ddpm.train import read_loss_log
from med_ddpm.utils import atomic_write_text, save_figure

REFERENCE = "fp32"
TAIL = 0.25  # the loss summary averages the last quarter of the logged steps


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(training overrides, gate overrides): ``train.*`` trains only, ``quality.*`` / ``bench.*`` gate only."""
    def top(o: str) -> str:
        return o.lstrip("+~").split("=", 1)[0].split(".", 1)[0]

    return ([o for o in overrides if top(o) not in ("quality", "bench")],
            [o for o in overrides if top(o) != "train"])


def training_commands(steps: int, experiment: str, runs: Path, overrides: Sequence[str] = ()) -> dict[str, list[str]]:
    """Arm name -> ``python -m`` argv of its training run: strict FP32 and ``experiment``'s stack, nothing else apart."""
    if not (CONFIG_DIR / "experiment" / f"{experiment}.yaml").exists():
        raise ConfigError(f"quality_training.experiment={experiment}: no configs/experiment/{experiment}.yaml; "
                          "name an experiment whose recipe stack to train with (fast_train)")
    shipped = experiment_stack(experiment)
    stacks = {REFERENCE: ["recipe=[]"], experiment: shipped}
    return {arm: ["med_ddpm.train", "experiment=quality_model", *stack, f"train.max_steps={steps}", *overrides,
                  f"output_dir={runs / arm}", "resume=auto", "train.progress=false"]
            for arm, stack in stacks.items()}


def finished(run: Path, steps: int) -> bool:
    last = run / "checkpoints" / "last.pt"
    return last.exists() and int(read_checkpoint(last)["step"]) >= steps


def train_arm(argv: list[str], run: Path, steps: int, timeout_s: float | None) -> str:
    """Run (or continue) one training run unless it is finished; its status: done | cut | error."""
    if finished(run, steps):
        return "done"
    run.mkdir(parents=True, exist_ok=True)
    print(f"[train] {run.name}: to step {steps}, log in {run / 'train.log'}", flush=True)
    code, wall, tail = spawn(argv, run.parent / "cache", run / "train.log", timeout_s)
    print(f"[train] {' '.join(argv[1:])}: {'timed out' if code is None else f'exit {code}'} after {wall:.0f} s",
          flush=True)
    if code is None:
        return "cut"
    if code != 0 or not finished(run, steps):
        print(tail, file=sys.stderr)
        return "error"
    return "done"


def compare_losses(curves: dict[str, tuple[list[int], list[float]]], reference: str) -> dict[str, Any]:
    """Each run's mean loss over the last quarter of its logged steps, and the candidate's paired difference
    there (same steps, so the same samples, t and ε: the difference is the stack's alone)."""
    ref = dict(zip(*curves[reference]))
    out: dict[str, Any] = {"tail_fraction": TAIL}
    for arm, (steps, losses) in curves.items():
        tail = steps[math.floor(len(steps) * (1 - TAIL)):]
        mine = dict(zip(steps, losses))
        out[arm] = {"logged_steps": len(steps), "last_step": steps[-1] if steps else None,
                    "tail_mean_loss": sum(mine[s] for s in tail) / len(tail) if tail else None}
        shared = [s for s in tail if s in ref]
        if arm != reference and shared:
            out[arm]["tail_mean_difference"] = sum(mine[s] - ref[s] for s in shared) / len(shared)
    return out


def plot_losses(curves: dict[str, tuple[list[int], list[float]]], path: Path, title: str) -> Path:
    """Both runs' logged losses (thin) and their running means over 10 logged steps (thick), log scale."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for colour, (arm, (steps, losses)) in zip(("tab:blue", "tab:orange"), curves.items()):
        window = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(steps, losses, color=colour, lw=0.6, alpha=0.4)
        ax.plot(steps, window, color=colour, lw=1.8,
                label="strict FP32 (recipe=[])" if arm == REFERENCE else f"experiment={arm}'s stack")
    ax.set(xlabel="optimizer step", ylabel="training loss", yscale="log")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


def write_curves(out: Path, runs: Path, commands: dict[str, list[str]], steps: int) -> dict[str, Any]:
    """loss_curves.json / .png and training.json from the two finished runs."""
    curves = {arm: read_loss_log(runs / arm) for arm in commands}
    summary = compare_losses(curves, REFERENCE)
    atomic_write_text(out / "loss_curves.json", json.dumps(
        {"summary": summary, "curves": {arm: {"step": s, "loss": v} for arm, (s, v) in curves.items()}}, indent=1))
    plot_losses(curves, out / "loss_curves.png", f"quality model, {steps} steps each, same seed and data order")
    timings = {arm: json.loads(p.read_text()) if (p := runs / arm / TIMINGS_FILE).exists() else None
               for arm in commands}
    atomic_write_text(out / "training.json", json.dumps(
        {arm: {"argv": commands[arm], "timings": timings[arm]} for arm in commands}, indent=1))
    return summary


def run(out: Path, steps: int = 1000, experiment: str = "fast_train", runs: Path = Path("runs/quality_training"),
        budget_s: float = math.inf, overrides: Sequence[str] = ()) -> int:
    """Train both arms, write the loss curves, gate the two EMA models; returns the steps left (0: done)."""
    start = time.monotonic()
    train_overrides, gate_overrides = split_overrides(overrides)
    commands = training_commands(steps, experiment, runs.resolve(), train_overrides)
    for arm, argv in commands.items():
        remaining = budget_s - (time.monotonic() - start)
        timeout = remaining if math.isfinite(remaining) else None
        status = train_arm(argv, runs.resolve() / arm, steps, timeout) if remaining > 0 else "cut"
        if status != "done":
            print(f"quality_training: the {arm} run is not finished ({status}); rerun the same command to continue")
            return 2 if status == "cut" else 1
    out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(write_curves(out, runs.resolve(), commands, steps)))
    checkpoints = [str(runs.resolve() / arm / "checkpoints" / "last.pt") for arm in commands]
    jobs = [[*job, *gate_overrides] for job in quality_pair_ladder(*checkpoints)]
    return run_ladder(out, jobs, budget_s - (time.monotonic() - start), complete_baselines=False)
