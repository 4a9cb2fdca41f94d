"""The 128³ quality model's GPU plan, priced from one GPU's evidence run (docs/quality.md, "The gate at 128³").

Each stage's minutes are the work it does times the run's own rows: training is ``experiment=quality_model_128``'s
steps × the shipped train step; the card and the tuning's reference are N volumes × strict-FP32 DDPM-250; each gate
is N volumes × its sampler and stack. A stage runs in device calls of :data:`CALL_WORK_MIN` minutes of work
(``budget_s=480`` in a ten-minute call), so its calls are its minutes over that. Compile and the tuning's search are
not priced: no row times them at this size, and the page says so.
"""

from __future__ import annotations

import math

import torch
from hydra import compose
from omegaconf import OmegaConf

from bench.reporting.evidence import Run
from med_ddpm.cli import configs
from med_ddpm.model import build_model

N = 32  # the gate's volumes per arm (configs/quality/default.yaml)
CARD_N = 16  # the card's DDPM-250 samples
CALL_WORK_MIN = 8.0  # minutes of work a ten-minute device call holds (budget_s=480)
GATES = (  # (what is judged, the job whose time per volume a gate arm costs)
    ("fp16 stack, strict reference", "fast_sampler.strict_fp32"),
    ("fp16 stack", "fast_sampler.shipped"),
    ("bf16 stack", "fast_sampler.shipped"),
    ("torch_defaults stack", "fast_sampler.torch_defaults"),
    ("100-call sampler", "fast_sampler.shipped"),
    ("DDPM-250, shipped", "ddpm250.shipped"),
)
TRAIN = "python -m med_ddpm.train experiment=quality_model_128 output_dir=runs/quality_model_128 resume=auto"
CARD = ("python -m bench.quality_model run=runs/quality_model_128 out={folder}/quality/model_128 n=16 "
        "batch=8")
TUNE = ("python -m med_ddpm.tune checkpoint=CKPT output_dir=runs/tuned_128 "
        "paths.reference_cache=runs/quality_model_128/checkpoints/gate_cache gate.batch=8")
LADDER = ("python -m bench.ladder preset=quality_128 checkpoint=CKPT tuned=runs/tuned_128/sampler.yaml "
          "out={folder}/quality/gates_128 budget_s=480")


def model_facts() -> tuple[int, int]:
    """``experiment=quality_model_128``'s training steps and its network's parameters (built on the meta device:
    no memory)."""
    with configs():
        cfg = compose("train", overrides=["experiment=quality_model_128", "output_dir=x"])
    with torch.device("meta"):
        params = sum(p.numel() for p in build_model(OmegaConf.to_container(cfg.model)).parameters())
    return int(cfg.train.max_steps), params


def stage_minutes(run: Run, steps: int) -> list[tuple[str, list[float]]] | None:
    """Each stage's command and its priced parts in minutes; None where the run lacks a row it needs."""
    per_volume = {job: run.ms_per_volume(job) for job in {j for _, j in GATES} | {"ddpm250.strict_fp32"}}
    step = run.ms("train_step.shipped")
    if step is None or None in per_volume.values():
        return None
    minutes = {job: ms / 60_000 for job, ms in per_volume.items()}
    return [(TRAIN, [steps * step / 60_000]), (CARD, [CARD_N * minutes["ddpm250.strict_fp32"]]),
            (TUNE, [N * minutes["ddpm250.strict_fp32"]]), (LADDER, [N * minutes[job] for _, job in GATES])]


def plan_lines(run: Run) -> list[str]:
    """The plan's section of a GPU page: one row per stage (calls, command, minutes, what it leaves), its total."""
    steps, params = model_facts()
    stages = stage_minutes(run, steps)
    lines = ["## The 128³ quality model's plan", ""]
    if stages is None:
        return lines + ["This run lacks a row the plan is priced from (`train_step.shipped`, `ddpm250.*`, "
                        "`fast_sampler.*`).", ""]
    leaves = ("`checkpoints/`", "the card", "the DDPM-250 reference, `sampler.yaml`", "`gate_cache/`, the rows")
    extra = (" + compile", "", " + the search", "")
    lines += [f"`experiment=quality_model_128` trains the timed network ({params / 1e6:.1f} M parameters, "
              f"{steps} steps) and the gates judge it at N = {N}; minutes are this run's rows times the work "
              f"(`bench/reporting/plan128.py`), calls hold {CALL_WORK_MIN:.0f} minutes of work each.", "",
              "| calls | command | min | leaves |", "| --- | --- | --- | --- |"]
    first, total = 1, 0.0
    for (command, parts), left, more in zip(stages, leaves, extra, strict=True):
        calls = math.ceil(sum(parts) / CALL_WORK_MIN)
        priced = " + ".join(f"{p:.1f}" for p in parts)
        lines.append(f"| {first}-{first + calls - 1} | `{command.format(folder=run.folder.as_posix())}` | "
                     f"{priced}{more} | {left} |")
        first, total = first + calls, total + sum(parts)
    gib = params * 4 / 2**30
    lines += ["", f"{total:.0f} minutes priced, in {first - 1} calls. A checkpoint holds the parameters four times "
              f"(weights, EMA, Adam's two moments: {4 * gib:.2f} GiB; the EMA alone {gib:.2f} GiB): more than a "
              "device call brings back or carries, so the plan needs one machine that keeps its disk for all of it.",
              ""]
    return lines

