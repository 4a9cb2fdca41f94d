"""Tune a few-step sampler for a checkpoint: ``python -m med_ddpm.tune checkpoint=CKPT masks=MASKS output_dir=DIR``.

The fewest model calls per sample whose grid, searched for this checkpoint on ``data``, passes the quality gate
with ``experiment=fast_sample``'s stack against the checkpoint's own strict-FP32 DDPM, on masks and noise the
search never saw (:mod:`med_ddpm.samplers.tuning`). Writes ``DIR/sampler.yaml``, which
``python -m med_ddpm.sample experiment=fast_sample checkpoint=CKPT masks=MASKS tuned=DIR/sampler.yaml`` samples
with, ``DIR/report.md`` and ``DIR/calls_vs_quality.png``; ``install=true`` copies a passing ``sampler.yaml`` beside the
checkpoint, where ``experiment=fast_sample`` (``tuned=auto``) uses it. Interrupted, the same command resumes.

Example:
    python -m med_ddpm.tune checkpoint=runs/whole_head/checkpoints/last.pt masks=DATA/mask \\
        data=whole_head data.root=DATA output_dir=runs/tuned
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from med_ddpm import cli
from med_ddpm.samplers.tuned import install
from med_ddpm.samplers.tuning import RESULT, SAMPLE_HINT, run

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")


@hydra.main(config_path=CONFIG_DIR, config_name="tune", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    out_dir = cli.output_dir(cfg)
    record = run(cfg, out_dir)
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


if __name__ == "__main__":
    cli.run(main)
