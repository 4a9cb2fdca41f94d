"""Tune a few-step sampler for a checkpoint: ``python -m med_ddpm.tune checkpoint=CKPT masks=MASKS output_dir=DIR``.

The fewest model calls per sample whose grid, searched for this checkpoint on ``data``, passes the quality gate
with ``experiment=fast_sample``'s stack against the checkpoint's own strict-FP32 DDPM, on masks and noise the
search never saw (:mod:`med_ddpm.tuning`). Writes ``DIR/sampler.yaml``, which
``python -m med_ddpm.sample experiment=fast_sample checkpoint=CKPT masks=MASKS tuned=DIR/sampler.yaml`` samples
with, ``DIR/report.md`` and ``DIR/calls_vs_quality.png``. Interrupted, the same command resumes. ``logger=wandb``: each
budget gated is also a W&B run. ``install=true`` copies a passing ``sampler.yaml`` beside the
checkpoint, where ``experiment=fast_sample`` (``tuned=auto``) uses it.

Example:
    python -m med_ddpm.tune checkpoint=runs/whole_head/checkpoints/last.pt masks=DATA/mask \\
        data=whole_head data.root=DATA output_dir=runs/tuned
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from med_ddpm import cli
from med_ddpm.samplers.tuned import install
from med_ddpm.tracking import (
    build_tracker,
    check_logger,
    gate_summary,
    log_images,
    logged,
    mark_logged,
    recipe_config,
)
from med_ddpm.tuning.report import SAMPLE_HINT
from med_ddpm.tuning.run import run
from med_ddpm.tuning.state import RESULT, STATE


def log_budgets(cfg: DictConfig, out_dir: Path) -> None:
    """With ``logger=wandb``, each budget gated is one W&B run (once: ``wandb_runs.jsonl`` lists those logged),
    grouped by the tuning's folder: the stack as recipe booleans, the calls and sampler as config; the gate's
    verdict, worst p-value and deciding check as summary; the last one also carries calls_vs_quality.png."""
    if not check_logger(cfg.logger):
        return
    state = json.loads((out_dir / STATE).read_text(encoding="utf-8"))
    done, budgets = logged(out_dir), sorted(state["budgets"].items(), key=lambda kv: int(kv[0]))
    for n, (calls, result) in enumerate(budgets):
        key = f"budget {calls}"  # an output_dir holds one tuning's settings (tune.json's key)
        if key in done:
            continue
        config = {"workload": "tune", "checkpoint": str(cfg.checkpoint), "calls": int(calls),
                  "sampler": result["sampler"].get("name"), **recipe_config(state["key"]["recipe"])}
        tracker = build_tracker(cfg.logger, config, name=f"tune.{calls}_calls",
                                group=cfg.logger.get("group") or out_dir.name, job_type="tune")
        tracker.summarize({"calls": int(calls), "sampling_s": result.get("sampling_s"), "gate_s": result.get("gate_s"),
                           "kl_bound": result.get("bound"), **gate_summary(result["report"])})
        if n == len(budgets) - 1:
            log_images(tracker, "tune", [out_dir / "calls_vs_quality.png"])
        tracker.finish()
        mark_logged(out_dir, key, tracker.id)


@hydra.main(config_path=cli.CONFIG_PATH, config_name="tune", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    out_dir = cli.output_dir(cfg)
    check_logger(cfg.logger)
    record = run(cfg, out_dir)
    log_budgets(cfg, out_dir)
    tuned = out_dir / RESULT
    if record["verdict"] == "pass" and cfg.get("install"):
        print(f"{record['calls']} model calls pass the gate: {tuned}, installed as {install(tuned, cfg.checkpoint)}; "
              f"experiment=fast_sample samples with it (tuned=auto)")
    elif record["verdict"] == "pass":
        print(f"{record['calls']} model calls pass the gate: {tuned}; sample with: "
              + SAMPLE_HINT.format(checkpoint=cfg.checkpoint, tuned=tuned))
    else:
        print(f"no budget up to {record['calls']} model calls passed the gate ({tuned} records it; med_ddpm.sample "
              "refuses it); pass larger budgets=[...]")


console = cli.console(main)  # the med-ddpm-tune command


if __name__ == "__main__":
    console()
