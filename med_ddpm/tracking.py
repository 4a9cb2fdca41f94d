"""Experiment tracking: Weights & Biases (imported lazily) or nothing.

``logger=none`` needs no wandb install; ``logger=wandb`` logs the resolved config, scalars
and slice images, offline by default so no network is needed (``wandb sync`` uploads later).
Each Hydra multirun job calls :meth:`Tracker.finish`, so every job is its own W&B run.

Example:
    >>> tracker = build_tracker(cfg.logger, config=resolved_cfg)
    >>> tracker.log({"loss": 0.12}, step=10); tracker.finish()
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from med_ddpm.config_checks import ConfigError


class Tracker:
    """No-op tracker (``logger=none``); the W&B one overrides these."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def log_image(self, key: str, path: str | Path, step: int, caption: str | None = None) -> None:
        pass

    def log_table(self, key: str, rows: list[Mapping[str, Any]]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker(Tracker):
    """Thin wrapper over a ``wandb`` run."""

    def __init__(self, cfg: Mapping[str, Any], config: Mapping[str, Any]):
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - wandb is a runtime dependency
            raise RuntimeError("logger=wandb needs the wandb package (pip install wandb) or use logger=none") from e
        self._wandb = wandb
        Path(cfg.get("dir") or ".").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.get("project", "med-ddpm-bench"),
            entity=cfg.get("entity"),
            mode=cfg.get("mode", "offline"),
            group=cfg.get("group"),
            job_type=cfg.get("job_type"),
            tags=list(cfg.get("tags") or []),
            dir=str(cfg.get("dir") or "."),
            config=dict(config),
            reinit="finish_previous",
        )

    def log(self, metrics, step):
        self.run.log(dict(metrics), step=step)

    def log_image(self, key, path, step, caption=None):
        self.run.log({key: self._wandb.Image(str(path), caption=caption)}, step=step)

    def log_table(self, key, rows):
        if rows:
            columns = sorted({k for r in rows for k in r})
            table = self._wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
            self.run.log({key: table})

    def finish(self):
        self.run.finish()


def build_tracker(cfg: Mapping[str, Any] | None, config: Mapping[str, Any] | None = None) -> Tracker:
    """Tracker for the ``logger`` config node (``name: none | wandb``)."""
    name = (cfg or {}).get("name", "none")
    if name == "none":
        return Tracker()
    if name == "wandb":
        return WandbTracker(cfg, config or {})
    raise ConfigError(f"logger.name={name}: unknown logger; pass logger=none or logger=wandb")
