"""Compare two folders of NIfTI volumes: ``python -m med_ddpm.evaluate real=DIR generated=DIR output_dir=OUT``.

Writes ``metrics.json``, ``summary.md`` and ``montage.png`` to ``output_dir``; what each metric is and how it is
computed: :mod:`med_ddpm.quality.evaluate`. ``logger=wandb``: also one W&B run with the metrics as its summary.

Example:
    python -m med_ddpm.evaluate real=data/whole_head/image generated=samples masks=data/whole_head/mask output_dir=eval
"""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from med_ddpm import cli
from med_ddpm.config_checks import ConfigError, check_choice, check_int
from med_ddpm.quality.evaluate import evaluate, summary_markdown
from med_ddpm.tracking import build_tracker, check_logger, log_images


def check_options(cfg: DictConfig) -> None:
    """The counts and choices, refused before any volume is read."""
    check_choice(cfg, "intensity", ("none", "minmax"))
    check_int(cfg, "n_perm", 1)
    check_int(cfg, "max_pairs", 1)
    check_int(cfg, "ssim_kernel", 1)
    check_logger(cfg.logger)
    if not (OmegaConf.is_dict(cfg.extractor) and "_target_" in cfg.extractor):
        raise ConfigError(f"extractor={cfg.extractor!r}: not a feature extractor config; pass "
                          "extractor={_target_: med_ddpm.quality.features.RandomConv3dFeatures} or see configs/evaluate.yaml")


def log_run(cfg: DictConfig, config: dict, metrics: dict, out: Path) -> None:
    """With ``logger=wandb``: one run, metrics.json as its summary and the montage as an image (after the files
    are written)."""
    tracker = build_tracker(cfg.logger, config, name=out.name, job_type="evaluate")
    tracker.summarize(metrics)
    log_images(tracker, "evaluate", [out / "montage.png"])
    tracker.finish()


@hydra.main(config_path=cli.CONFIG_PATH, config_name="evaluate", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    out = cli.output_dir(cfg)
    cli.refuse_earlier_results(out, "metrics.json", "an evaluation")
    check_options(cfg)
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    metrics = evaluate(config)
    log_run(cfg, config, metrics, out)
    print(summary_markdown(metrics), end="")
    print(f"metrics.json, summary.md and montage.png in {out.resolve()}")


console = cli.console(main)  # the med-ddpm-evaluate command


if __name__ == "__main__":
    console()
