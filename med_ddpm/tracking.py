"""Experiment tracking: Weights & Biases (imported lazily) or nothing.

``logger=none`` needs no wandb install; ``logger=wandb`` makes W&B runs, offline by default so no network is
needed (``wandb sync <dir>/wandb/offline-run-*`` uploads later; ``logger.mode=online`` uploads as it goes).
:func:`check_logger` refuses, in one line and before any work, a ``logger=wandb`` that cannot run: no wandb package,
or a W&B folder that cannot be written. Training keeps one W&B run across resumes (:func:`training_tracker`); the
commands that gate or time (sample, tune, evaluate, the bench) log each result as its own run, its figures in the
run's summary, so dashboards compare runs by their config and summary keys (docs/wandb.md).

Example:
    >>> tracker = build_tracker(cfg.logger, config=resolved_cfg, name="job", group="sweep")
    >>> tracker.log({"loss": 0.12}, step=10); tracker.summarize({"ms_median": 3.1}); tracker.finish()
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError, OutputError
from med_ddpm.utils import append_line, atomic_write_text

MODES = ("offline", "online", "disabled")
RUN_ID_FILE = "wandb_run_id"  # beside a training run's checkpoints: the W&B run a resume continues
LOGGED_FILE = "wandb_runs.jsonl"  # beside results: one line per result logged as a W&B run (never logged twice)
STATUS_RANK = {"pass": 0, "warn": 1, "fail": 2}


class Tracker:
    """No-op tracker (``logger=none``); the W&B one overrides these."""

    id: str | None = None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        pass

    def log_image(self, key: str, path: str | Path, step: int | None = None, caption: str | None = None) -> None:
        pass

    def summarize(self, values: Mapping[str, Any]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


class WandbTracker(Tracker):
    """Thin wrapper over a ``wandb`` run; ``run`` (name, group, job_type, id, resume, dir) overrides the logger
    config's ``wandb.init`` arguments."""

    def __init__(self, cfg: Mapping[str, Any], config: Mapping[str, Any], **run: Any):
        import wandb

        self._wandb = wandb
        args = {"project": cfg.get("project", "med-ddpm-bench"), "entity": cfg.get("entity"),
                "mode": cfg.get("mode", "offline"), "group": cfg.get("group"), "job_type": cfg.get("job_type"),
                "tags": list(cfg.get("tags") or []), "dir": str(cfg.get("dir") or ".")} | run
        self.run = wandb.init(**args, config=dict(config), reinit="finish_previous")
        self.id = self.run.id

    def log(self, metrics, step=None):
        self.run.log(dict(metrics), step=step)

    def log_image(self, key, path, step=None, caption=None):
        self.run.log({key: self._wandb.Image(str(path), caption=caption)}, step=step)

    def summarize(self, values):
        self.run.summary.update({k: v for k, v in values.items() if v is not None})

    def finish(self, exit_code=0):
        self.run.finish(exit_code=exit_code)


def writable_dir(path: Path, key: str) -> Path:
    """``path``, created if needed; refused in one line naming ``key`` when no file can be written there."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise OutputError(f"{key}={path}: W&B cannot write there ({err.strerror or err}); pass {key}=A_WRITABLE_FOLDER "
                          "or logger=none") from None
    return path


def check_logger(cfg: Mapping[str, Any] | None) -> bool:
    """Whether ``cfg`` (the ``logger`` node) asks for W&B; a ``logger=wandb`` that cannot run is refused here, in
    one line, before any work: no wandb package, an unknown mode, or a folder W&B cannot write."""
    name = (cfg or {}).get("name", "none")
    if name == "none":
        return False
    if name != "wandb":
        raise ConfigError(f"logger.name={name}: unknown logger; pass logger=none or logger=wandb")
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("logger=wandb: the wandb package is not installed; pip install 'wandb>=0.19.10', "
                          "or pass logger=none") from None
    if cfg.get("mode", "offline") not in MODES:
        raise ConfigError(f"logger.mode={cfg.get('mode')}: not a W&B mode; pass one of {', '.join(MODES)}")
    writable_dir(Path(cfg.get("dir") or "."), "logger.dir")
    return True


def build_tracker(cfg: Mapping[str, Any] | None, config: Mapping[str, Any] | None = None, **run: Any) -> Tracker:
    """Tracker for the ``logger`` config node (``name: none | wandb``); ``run``: ``wandb.init`` arguments."""
    if not check_logger(cfg):
        return Tracker()
    return WandbTracker(cfg, config or {}, **run)


def refuse_wandb(cfg: Mapping[str, Any] | None, command: str, instead: str) -> None:
    """A command that logs nothing refuses ``logger=wandb`` rather than ignore it."""
    if (cfg or {}).get("name", "none") != "none":
        raise ConfigError(f"logger={cfg.get('name')}: {command} logs no W&B run; {instead}, or pass logger=none")


def training_tracker(logger: Mapping[str, Any] | None, config: Mapping[str, Any], out_dir: Path,
                     resume: str | None, experiment: str | None) -> Tracker:
    """Training's tracker: grouped by the experiment (unless ``logger.group`` says otherwise), and one W&B run
    across resumes: its id is kept beside the checkpoints (``checkpoints/wandb_run_id``, written atomically) and a
    run resumed from them continues it."""
    if not check_logger(logger):
        return Tracker()
    id_file = out_dir / "checkpoints" / RUN_ID_FILE
    source = Path(resume).parent / RUN_ID_FILE if resume and resume != "auto" else id_file
    previous = source.read_text(encoding="utf-8").strip() if resume and source.is_file() else None
    tracker = WandbTracker(logger, config, group=logger.get("group") or experiment,
                           **({"id": previous, "resume": "allow"} if previous else {}))
    atomic_write_text(id_file, tracker.id)
    return tracker


def finish_training(tracker: Tracker, summary: Mapping[str, Any], timings: Path | None) -> None:
    """The run's summary: the final step's figures (loss, lr, it/s, peak memory) and ``timings.json``."""
    values = {k: v for k, v in summary.items() if isinstance(v, int | float | str)}
    if timings is not None and timings.is_file():
        values["timings"] = json.loads(timings.read_text(encoding="utf-8"))
    tracker.summarize(values)
    tracker.finish()


def recipe_config(chosen: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """A stack as run config: ``recipe.<name>`` true or false for every recipe of configs/recipe/ (one boolean axis
    each in a parallel-coordinates panel) and ``recipe_options.<name>.<key>`` for each chosen recipe's options."""
    names = {p.stem for p in (CONFIG_DIR / "recipe").glob("*.yaml")} | set(chosen)
    return {"recipe": {name: name in chosen for name in sorted(names)},
            "recipe_options": {name: {k: v for k, v in (options or {}).items() if not k.startswith("_")}
                               for name, options in chosen.items()}}


def deciding_check(checks: Mapping[str, Mapping[str, Any]], verdict: str | None) -> tuple[str | None, float | None]:
    """The check that decided a gate's verdict and the smallest p-value of the gate: among the checks whose status
    is the verdict (the worst status wins), the one with the smallest p-value (a check without one comes last)."""
    p_values = [c["p_value"] for c in checks.values() if c.get("p_value") is not None]
    worst = min(p_values) if p_values else None
    status = [name for name, c in checks.items() if c.get("status") == verdict] or list(checks)
    ranked = sorted(status, key=lambda name: (checks[name].get("p_value") is None, checks[name].get("p_value") or 0))
    return (ranked[0] if ranked else None), worst


def gate_summary(report: Mapping[str, Any] | None) -> dict[str, Any]:
    """What a run's summary carries of a quality gate's report: verdict (``not gated`` without one), the gate's
    worst p-value, the check that decided it and the smallest eps bias the gate could have detected."""
    if not report:
        return {"verdict": "not gated"}
    check, worst = deciding_check(report.get("checks") or {}, report.get("verdict"))
    return {"verdict": report.get("verdict"), "worst_p": worst, "deciding_check": check,
            "min_detectable_eps_bias": report.get("min_detectable_eps_bias")}


def logged(folder: Path) -> set[str]:
    """The keys of the results already logged as W&B runs from ``folder`` (its ``wandb_runs.jsonl``)."""
    path = folder / LOGGED_FILE
    if not path.is_file():
        return set()
    return {json.loads(line)["key"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()}


def mark_logged(folder: Path, key: str, run_id: str | None) -> None:
    """Record (one fsynced line) that the result ``key`` of ``folder`` is W&B run ``run_id``."""
    append_line(folder / LOGGED_FILE, json.dumps({"key": key, "wandb_id": run_id}))


def log_images(tracker: Tracker, key: str, paths: Iterable[Path]) -> None:
    """Each PNG of ``paths`` under ``key/<file stem>``."""
    for path in paths:
        tracker.log_image(f"{key}/{path.stem}", path)
