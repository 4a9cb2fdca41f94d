"""The wrapper of every Hydra entry point: one line for a user error, a traceback for a bug.

Usage, in an entry module::

    @hydra.main(config_path=..., config_name="train", version_base="1.3")
    @cli.entry
    def main(cfg): ...

    if __name__ == "__main__":
        cli.run(main)

:func:`entry` reports the errors raised by the task itself (as a ``SystemExit``, which Hydra
passes through without a second "Error executing job" message); :func:`run` reports the
errors of composing the config, which happen before the task starts.

A user error prints ``error: <thing>: <problem>; <fix>`` to stderr and exits with status 2:

- :class:`med_ddpm.config_checks.UserError` (bad data, checkpoint, option value or output directory),
- a recipe refusal (:class:`optim.UnsupportedRecipeError`, :class:`optim.RecipeConflictError`),
- Hydra's config errors (unknown config name, with the valid names listed; unknown key; bad
  override syntax) and a mandatory option left unset,
- an ``OSError`` on a user path: missing, not permitted, read-only, disk full.

Running out of GPU memory prints ``error: CUDA out of memory. ...; <fix>`` and exits with status 3: not a bug,
and the fix is the user's (a smaller batch, memory-saving recipes, a larger card).

Any other exception is a bug and keeps its traceback (exit status 1). ``HYDRA_FULL_ERROR=1``
shows the full traceback of every error, user errors included.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from med_ddpm.config_checks import OutputError, UserError
from optim.base import RecipeConflictError, UnsupportedRecipeError

# configs/ of this install: the copy the wheel ships in the package, or in a checkout (editable or `python -m` from
# its root) the link med_ddpm/configs to the top-level folder, resolved so paths name configs/ itself.
CONFIG_DIR = Path(str(resources.files("med_ddpm") / "configs")).resolve()
CONFIG_PATH = str(CONFIG_DIR)  # as @hydra.main's config_path takes it
EXIT_USER_ERROR = 2
EXIT_OUT_OF_MEMORY = 3
OOM_FIX = ("lower train.batch_size or num_samples, add memory-saving recipes (amp_bf16, checkpointing) or use a "
           "larger GPU; docs/troubleshooting.md")
OS_FIXES = {
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "check the path",
    errno.EISDIR: "pass a file, not a folder",
    errno.EACCES: "fix its permissions or choose another output_dir=",
    errno.EPERM: "fix its permissions or choose another output_dir=",
    errno.EROFS: "choose an output_dir= on a writable file system",
    errno.ENOSPC: "free some space or choose an output_dir= on another disk",
    errno.EDQUOT: "free some space or choose an output_dir= on another disk",
}


NOT_A_FOLDER = "a file, not a folder; pass a folder (a new or an existing one), or remove the file"
UNKNOWN_KEY = re.compile(r"Could not override '([^']+)'\. To append to your config use \+")


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def missing_config_line(err: MissingConfigException) -> str:
    """``recipe=tf23: no configs/recipe/tf23.yaml; valid names: ...`` (Hydra lists them only for
    a plain ``group=name``, not for a name inside a list such as ``recipe=[tf23]``)."""
    group, _, name = (err.missing_cfg_file or "").rpartition("/")
    names = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")) if group else []
    if not names:
        return _one_line(str(err).split("Config search path")[0])
    return f"{group}={name}: no configs/{group}/{name}.yaml; valid names: {', '.join(names)}"


def os_error_line(err: OSError, where: str = "output") -> str | None:
    """``<path>: <strerror>; <fix>`` for an OSError a user can fix, else None (a bug).

    ``where`` names the thing when the error has no file name (a full disk fails a write, not an open).
    """
    if isinstance(err, FileExistsError) and err.filename is not None and Path(err.filename).is_file():
        return f"{err.filename}: {NOT_A_FOLDER}"  # Hydra creating the run's output_dir where a file is
    fix = OS_FIXES.get(err.errno) if err.errno is not None else None
    if fix is None and isinstance(err, FileNotFoundError | PermissionError):
        fix = "check the path"  # raised by our own code with a message and no errno
    if fix is None:
        return None
    if err.errno is None:  # our own message names the file already
        return f"{_one_line(str(err))}; {fix}"
    thing = err.filename if err.filename is not None else where
    return f"{thing}: {err.strerror or err}; {fix}"


def user_error_line(err: BaseException, where: str = "output") -> str | None:
    """The one line a user error prints (without ``error: ``), or None when ``err`` is a bug."""
    if isinstance(err, UserError | UnsupportedRecipeError | RecipeConflictError):
        return _one_line(str(err))
    if isinstance(err, MissingConfigException):
        return missing_config_line(err)
    if isinstance(err, HydraException):
        cause = f" ({_one_line(err.__cause__).split(' full_key:')[0]})" if err.__cause__ else ""
        unknown = UNKNOWN_KEY.match(_one_line(str(err)))
        if unknown:  # not Hydra's advice to add the key with +, which would only add an option nothing reads
            key = unknown[1]
            return f"{key}: no such option{cause}; check its spelling (--cfg job lists every option)"
        return _one_line(str(err)) + cause
    if isinstance(err, MissingMandatoryValue):
        key = err.full_key or "option"
        return f"{key}: has no value; pass {key}=..."
    if isinstance(err, OSError):
        return os_error_line(err, where)
    return None


def out_of_memory_line(err: BaseException) -> str | None:
    """torch's out-of-memory message up to the figures (what was asked, allowed, allocated and cached), with the
    fix; None for any other error."""
    if not isinstance(err, torch.OutOfMemoryError):
        return None
    figures = _one_line(str(err)).split(" If reserved but unallocated")[0].split(" See documentation")[0]
    return f"{figures.rstrip('. ')}; {OOM_FIX}"


_SET_BY_RUN = "MED_DDPM_CLI_SET_FULL_ERROR"  # marks a HYDRA_FULL_ERROR=1 that run() set, not the user


def full_error() -> bool:
    """Whether the user asked for full tracebacks (``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" and not os.environ.get(_SET_BY_RUN)


def _report(err: Exception, where: str = "output") -> None:
    """Exit with one line for a user error or running out of GPU memory; return (the caller re-raises) for a bug or
    under HYDRA_FULL_ERROR=1."""
    if full_error():
        return
    for line, status in ((user_error_line(err, where), EXIT_USER_ERROR), (out_of_memory_line(err), EXIT_OUT_OF_MEMORY)):
        if line is not None:
            print(f"error: {line}", file=sys.stderr)
            raise SystemExit(status) from None


def entry(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Decorate a Hydra task function (under ``@hydra.main``): its user errors end in one line."""

    @functools.wraps(task)
    def wrapped(cfg: DictConfig) -> Any:
        try:
            return task(cfg)
        except Exception as err:
            out = OmegaConf.select(cfg, "output_dir", throw_on_missing=False)
            _report(err, f"output_dir={out}" if out and not OmegaConf.is_missing(cfg, "output_dir") else "output")
            raise

    return wrapped


def run(main: Callable[[], Any], *, teardown: bool = True) -> None:
    """Call a ``@hydra.main`` entry point; a config error ends in one stderr line and exit status 2, Ctrl-C in
    ``interrupted`` and exit status 130 (``HYDRA_FULL_ERROR=1`` keeps the tracebacks).

    ``teardown=False`` ends a successful run with :func:`exit_without_teardown`: for a command whose
    results are all written and closed when ``main`` returns.
    """
    if full_error():
        main()
    else:
        os.environ.update({"HYDRA_FULL_ERROR": "1", _SET_BY_RUN: "1"})  # Hydra re-raises a composition error
        try:
            main()
        except KeyboardInterrupt:  # Ctrl-C: what was written is complete (files are written atomically)
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        except Exception as err:
            _report(err)
            raise
    if not teardown:
        exit_without_teardown()


def console(main: Callable[[], Any], *, teardown: bool = True) -> Callable[[], None]:
    """``main`` run by :func:`run`: a module's console script (pyproject's ``[project.scripts]``), which its
    ``python -m`` calls too, so both report errors alike."""
    return functools.partial(run, main, teardown=teardown)


def exit_without_teardown() -> None:
    """Exit with status 0 now: run the ``atexit`` handlers and flush, then skip the interpreter's teardown.

    Python's normal exit then frees every object and module one by one, and the CUDA driver destroys the
    context; after sampling that takes seconds and writes nothing (the OS reclaims the memory either way).
    The ``atexit`` handlers still run (logging flushes and closes its files, torch stops its compile
    workers). With a non-daemon thread still alive this returns instead, so the normal exit waits for it.
    """
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def output_dir(cfg: DictConfig) -> Path:
    """The run's ``output_dir``: the option when given, else Hydra's run (or sweep job) directory.

    The configs leave ``output_dir`` unset (``???``) by default and point ``hydra.run.dir`` at it
    when it is given, so Hydra's log and ``.hydra/`` (the resolved config) land beside the run's
    results either way; this fills the option in for the code that reads it.
    """
    if OmegaConf.is_missing(cfg, "output_dir"):
        cfg.output_dir = HydraConfig.get().runtime.output_dir
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise OutputError(f"output_dir={out}: {NOT_A_FOLDER}")
    return out


def refuse_earlier_results(out_dir: Path, marker: str, what: str) -> None:
    """A run must not replace an earlier run's results without a word: ``marker`` in ``out_dir`` says one ran."""
    if (out_dir / marker).exists():
        raise OutputError(f"output_dir={out_dir}: already holds {what} ({marker}); choose another output_dir=, or "
                          "remove it")


@contextlib.contextmanager
def configs() -> Iterator[None]:
    """Hydra's compose API over configs/, also from inside a running Hydra app (a command that composes
    another command's config: the app has already initialised it, and a second initialisation is refused)."""
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        yield
