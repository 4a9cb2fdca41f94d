"""Bad user input: the error types, and the checks of option values that raise them.

Every :class:`UserError` message reads ``<thing>: <problem>; <fix>``: the file or option at
fault, what is wrong with it, and what to do. The command-line entry points
(:mod:`med_ddpm.cli`) print such an error as one line and exit with status 2; a traceback is
for bugs. They subclass ``ValueError`` so library callers can catch them generically, while
the CLIs and tests can tell a broken data file from a broken checkpoint or option.

The checks run at the start of each entry point, before anything is built: a run never starts
with a value that the code would later change, ignore or divide by.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException


class UserError(ValueError):
    """Input the user can fix; the message names the thing, the problem and the fix."""


class DataError(UserError):
    """A data file (NIfTI image or mask) is missing, unreadable, or has the wrong shape, values or labels."""


class CheckpointError(UserError):
    """A checkpoint file is missing, unreadable, or lacks keys or shapes the model needs."""


class ConfigError(UserError):
    """An option has a value the code cannot run with."""


class OutputError(UserError):
    """The output directory already holds results that a run would overwrite or mix with its own."""


_COPY = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")  # an option that only copies another: ${data.num_workers}


def option_key(cfg: DictConfig, key: str) -> str:
    """The option a user sets for ``key``: ``key`` itself, or the option it only copies (``train.num_workers:
    ${data.num_workers}``), so that a refusal names what was typed."""
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not (isinstance(node, DictConfig) and leaf in node and OmegaConf.is_interpolation(node, leaf)):
        return key
    source = _COPY.fullmatch(OmegaConf.to_container(node)[leaf])
    return option_key(cfg, source[1]) if source else key


def _option(cfg: DictConfig, key: str) -> tuple[str, Any]:
    """(the option a user sets for ``key``, the value of ``cfg.<key>``)."""
    return option_key(cfg, key), OmegaConf.select(cfg, key, throw_on_missing=False)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(cfg: DictConfig, key: str, low: int, high: int | None = None, meaning: str = "") -> int:
    """``cfg.<key>`` must be an integer in [low, high]; ``meaning`` says what a special value does."""
    return check_int_value(*_option(cfg, key), low, high, meaning)


def check_int_value(key: str, value: Any, low: int, high: int | None = None, meaning: str = "") -> int:
    """``value`` (option ``key``) must be an integer in [low, high]; ``meaning`` says what a special value does."""
    span = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not is_int(value) or value < low or (high is not None and value > high):
        raise ConfigError(f"{key}={value!r}: must be an integer {span}{meaning}; pass {key}=N with N {span}")
    return value


def check_number(cfg: DictConfig, key: str, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """``cfg.<key>`` must be a finite number in [low, high] (``(low, high]`` when ``low_open``)."""
    return check_number_value(*_option(cfg, key), low, high, low_open)


def check_number_value(key: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """``value`` (option ``key``) must be a finite number in [low, high] (``(low, high]`` when ``low_open``)."""
    span = f"{'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (low_open and value == low) or value > high:
        raise ConfigError(f"{key}={value!r}: must be a number {span}; pass {key}=X with X {span}")
    return float(value)


def check_choice(cfg: DictConfig, key: str, choices: Sequence[str]) -> str:
    return check_one_of(*_option(cfg, key), choices)


def check_one_of(key: str, value: Any, choices: Sequence[str]) -> Any:
    """``value`` (option ``key``) must be one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: unknown value; pass one of {', '.join(choices)}")
    return value


def check_bool(cfg: DictConfig, key: str) -> bool:
    """``cfg.<key>`` must be true or false."""
    key, value = _option(cfg, key)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: must be true or false; pass {key}=true or {key}=false")
    return value


def read_json_option(key: str, path: Any, fix: str) -> Any:
    """The JSON file that option ``key`` names; a file that is missing, unreadable or not JSON is a
    :class:`ConfigError` naming the option, the file and ``fix``."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        problem = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise ConfigError(f"{key}={path}: cannot read ({problem}); {fix}") from err


def check_size(cfg: DictConfig, key: str, optional: bool = False) -> list[int] | None:
    """``cfg.<key>`` must be three positive integers (D, H, W), or null when ``optional``."""
    key, value = _option(cfg, key)
    if value is None and optional:
        return None
    items = list(value) if OmegaConf.is_list(value) or isinstance(value, list | tuple) else None
    if items is None or len(items) != 3 or any(not is_int(s) or s < 1 for s in items):
        raise ConfigError(f"{key}={value!r}: must be three positive integers (D, H, W); pass {key}=[D,H,W]"
                          + (f" or {key}=null" if optional else ""))
    return items


def check_device(cfg: DictConfig) -> None:
    """``device`` must name a device this machine has (``auto`` picks CUDA when there is one)."""
    import torch

    value = str(OmegaConf.select(cfg, "device", throw_on_missing=False))
    try:
        kind = "auto" if value == "auto" else torch.device(value).type
    except RuntimeError:
        kind = None
    if kind not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={value}: unknown device; pass device=auto, cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={value}: no CUDA GPU is visible on this machine; pass device=auto or device=cpu")


@contextmanager
def as_config_error(key: str, fix: str, errors: tuple[type[Exception], ...] | None = None) -> Iterator[None]:
    """Turn ``errors`` raised while building objects from config node ``key`` into a :class:`ConfigError` naming
    that node. The default is what a config itself can be wrong with (a missing or mistyped key, a failed Hydra
    instantiate), so that a bug in the code that builds keeps its traceback; around one constructor whose
    arguments are the options and which checks them itself, ``errors=(ValueError, TypeError)``."""
    from hydra.errors import InstantiationException  # here: importing this module stays free of Hydra

    from optim.base import RecipeConflictError

    errors = errors or (OmegaConfBaseException, InstantiationException)

    try:
        yield
    except (UserError, RecipeConflictError, MissingMandatoryValue):  # med_ddpm.cli reports these as they are
        raise
    except errors as err:
        raise ConfigError(f"{key}: {err}; {fix}") from err


def check_divisible(thing: str, size: Sequence[int], channel_mult: Sequence[int], key: str,
                    error: type[UserError] = ConfigError) -> list[int]:
    """Each side of ``size`` (D, H, W) must halve once per U-Net level below the top (a multiple of
    2^(levels - 1)) for the skips to line up; returns ``size``. ``thing`` names the option or file at fault and
    its size, ``key`` the option that fixes it."""
    levels = len(channel_mult)
    step = 2 ** (levels - 1)
    if any(s % step for s in size):
        fit = ",".join(str(max(step, round(s / step) * step)) for s in size)
        raise error(f"{thing}: not divisible by {step} on every side, as channel_mult {list(channel_mult)} has "
                    f"{levels} levels (2^(levels-1)); pass e.g. {key}=[{fit}]")
    if math.prod(size) // step ** 3 < 2:
        raise error(f"{thing}: one voxel at the U-Net's coarsest level, where GroupNorm has a single value per group "
                    f"to normalise; pass a larger size, e.g. {key}=[{','.join(str(2 * step) for _ in size)}]")
    return list(size)


def check_model_size(cfg: DictConfig) -> list[int]:
    """``model.image_size``: three positive integers that the U-Net of ``model.channel_mult`` halves at every level."""
    size = check_size(cfg, "model.image_size")
    if OmegaConf.is_list(cfg.model.channel_mult):  # anything else: the U-Net's constructor refuses it
        check_divisible(f"model.image_size={size}", size, cfg.model.channel_mult, "model.image_size")
    return size


def check_checkpoint_options(cfg: DictConfig) -> None:
    """The options of a command that runs a checkpoint's network (sampling, the step search): ``checkpoint`` set,
    ``weights``, ``image_size`` (null: the checkpoint's own) and ``device``."""
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise ConfigError("checkpoint: not set; pass checkpoint=PATH (a checkpoint written by med_ddpm.train, "
                          "or the published Med-DDPM weights)")
    check_choice(cfg, "weights", ("ema", "model"))
    check_size(cfg, "image_size", optional=True)
    check_device(cfg)
