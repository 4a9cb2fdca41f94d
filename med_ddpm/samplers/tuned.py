"""``sampler.yaml``: the sampler ``med_ddpm.tune`` found for one checkpoint, with its evidence, sealed by a hash.

The file holds the sampler node (``name``, ``steps``, the searched ``timesteps``, ...), the gate's verdict with
its statistics, the checkpoint's sha256 and weights, the recipe stack it was gated with and torch's version.
Its last line, ``content_sha256: <hex>``, is the sha256 of every line above it: a verdict is evidence about the
grid as written for one set of weights, so ``python -m med_ddpm.sample ... tuned=DIR/sampler.yaml`` refuses a
file edited by hand, a verdict other than pass, and another checkpoint, each in one line saying how to tune.
``tuned=auto`` (``experiment=fast_sample``'s) uses the newest such file beside the checkpoint that passes these
checks, where ``med_ddpm.tune ... install=true`` puts it, and says in one line why it passes over any other.

This module reads and writes the file only (``med_ddpm.sample`` imports it; the tuning is
:mod:`med_ddpm.tuning`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from med_ddpm.config_checks import ConfigError
from med_ddpm.utils import atomic_write_text, json_safe

log = logging.getLogger("med_ddpm.samplers.tuned")
SEAL = "content_sha256: "


def tune_command(checkpoint: str = "CKPT") -> str:
    return f"python -m med_ddpm.tune checkpoint={checkpoint} masks=MASKS output_dir=DIR"


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, read in chunks (a 128^3 checkpoint is hundreds of MB) once per version of the file
    (``tuned=auto`` checks several ``sampler.yaml`` against one checkpoint)."""
    stat = Path(path).stat()
    return _sha256(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


def seal(record: Mapping[str, Any], header: str = "") -> str:
    """The file's text: ``header`` comment lines, ``record`` as YAML, then the seal over both."""
    body = header + yaml.safe_dump(json_safe(dict(record)), sort_keys=False, width=120, allow_unicode=True)
    return f"{body}{SEAL}{_digest(body)}\n"


def write_tuned(path: str | Path, record: Mapping[str, Any], header: str = "") -> Path:
    """Write the sealed file atomically: a reader finds the old file or the new one, never half of it."""
    return atomic_write_text(path, seal(record, header))


def read_tuned(path: str | Path, option: str = "tuned", checkpoint: str = "CKPT") -> dict[str, Any]:
    """The record of a sealed file; a file that cannot be read, lacks the seal or fails it is refused in one line
    naming ``option=path``, with the command that tunes ``checkpoint``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        problem = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise ConfigError(f"{option}={path}: cannot read ({problem}); pass the sampler.yaml that "
                          f"{tune_command(checkpoint)} wrote") from err
    body, _, last = text.rstrip("\n").rpartition("\n")
    if not last.startswith(SEAL):
        raise ConfigError(f"{option}={path}: no {SEAL.rstrip(': ')} line, so not a file med_ddpm.tune wrote; pass "
                          f"the sampler.yaml it wrote, or tune: {tune_command(checkpoint)}")
    if _digest(body + "\n") != last.removeprefix(SEAL).strip():
        raise ConfigError(f"{option}={path}: edited since med_ddpm.tune wrote it (its content_sha256 no longer "
                          "matches); the verdict holds for the file as written: restore it, or tune again: "
                          f"{tune_command(checkpoint)}")
    return yaml.safe_load(body)


def check_usable(record: Mapping[str, Any], path: str | Path, checkpoint: str, weights: str) -> None:
    """Refuse a grid whose gate did not pass, or that was tuned for other weights."""
    if record["verdict"] != "pass":
        reason = (record["gate"]["statistics"].get("reasons") or ["no reason recorded"])[0]
        raise ConfigError(f"tuned={path}: its gate verdict is {record['verdict']} at {record['calls']} model calls "
                          f"({reason}), so it is no sampler to use; tune with larger budgets: "
                          f"{tune_command(checkpoint)} budgets=[{2 * record['calls']},{3 * record['calls']}]")
    tuned_for = record["checkpoint"]
    if file_sha256(checkpoint) != tuned_for["sha256"] or weights != tuned_for["weights"]:
        raise ConfigError(f"tuned={path}: tuned for the {tuned_for['weights']} weights of {tuned_for['path']} "
                          f"(sha256 {tuned_for['sha256'][:12]}), not the {weights} weights of checkpoint={checkpoint}; "
                          f"tune this checkpoint: {tune_command(checkpoint)}")


def candidates(checkpoint: str | Path) -> list[Path]:
    """Where ``tuned=auto`` looks: ``sampler*.yaml`` in the checkpoint's folder and, for a training run's
    ``<run>/checkpoints/`` folder, in the run's ``output_dir`` too."""
    folder = Path(checkpoint).resolve().parent
    folders = [folder, folder.parent] if folder.name == "checkpoints" else [folder]
    return sorted({p for f in folders for p in f.glob("sampler*.yaml") if p.is_file()})


def refusal(path: Path, checkpoint: str, weights: str) -> str | None:
    """Why ``tuned=auto`` passes over the file at ``path`` (None: it is usable): unreadable or edited, a verdict
    other than pass, or tuned for other weights."""
    try:
        record = read_tuned(path, checkpoint=checkpoint)
        check_usable(record, path, checkpoint, weights)
    except ConfigError as err:
        return str(err).partition(": ")[2].partition(";")[0]
    return None


def find_tuned(cfg: DictConfig) -> Path | None:
    """``tuned=auto``: the newest passing ``sampler.yaml`` of this checkpoint's weights beside it (:func:`candidates`),
    each file passed over said in one line."""
    usable = []
    for path in candidates(cfg.checkpoint):
        why = refusal(path, cfg.checkpoint, cfg.weights)
        if why is None:
            usable.append(path)
        else:
            log.info("tuned=auto: not %s: %s", path, why)
    if not usable:
        log.info("tuned=auto: no passing sampler.yaml of this checkpoint beside it; sampling with sampler=%s "
                 "(to tune: %s install=true)", cfg.sampler.get("name"), tune_command(cfg.checkpoint))
        return None
    newest = max(usable, key=lambda p: p.stat().st_mtime_ns)
    if len(usable) > 1:
        log.info("tuned=auto: %d passing files of this checkpoint (%s); the newest: %s", len(usable),
                 ", ".join(str(p) for p in usable), newest)
    return newest


def install(tuned: str | Path, checkpoint: str | Path) -> Path:
    """Copy a sealed ``sampler.yaml`` beside ``checkpoint`` (atomically), where ``tuned=auto`` finds it."""
    return atomic_write_text(Path(checkpoint).resolve().parent / "sampler.yaml", Path(tuned).read_text(encoding="utf-8"))


def use_tuned(cfg: DictConfig) -> None:
    """Replace ``cfg.sampler`` with the checked grid of ``cfg.tuned`` (``med_ddpm.sample``); a recipe stack other
    than the one it was gated with is allowed, with a warning: the verdict is the gated stack's. ``tuned=auto``:
    the file :func:`find_tuned` picks, if any."""
    if cfg.tuned == "auto":
        cfg.tuned = find_tuned(cfg)
        if cfg.tuned is None:
            return
        cfg.tuned = str(cfg.tuned)
    record = read_tuned(cfg.tuned, checkpoint=cfg.checkpoint)
    check_usable(record, cfg.tuned, cfg.checkpoint, cfg.weights)
    cfg.sampler = OmegaConf.create(record["sampler"])
    stack = OmegaConf.to_container(cfg.recipe, resolve=True) if cfg.get("recipe") is not None else {}
    if stack != (record.get("recipe") or {}):
        log.warning("tuned=%s was gated with recipes %s; this run uses %s (the verdict is the gated stack's)",
                    cfg.tuned, sorted(record.get("recipe") or {}), sorted(stack))
    log.info("sampling with the %d-call grid of %s (gate: %s)", record["calls"], cfg.tuned, record["verdict"])
