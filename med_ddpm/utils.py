"""Small shared helpers: atomic file writes, seeding, device choice, environment capture.

Atomic writes matter because a killed training job or a sweep that crashes mid-write must
never leave a truncated checkpoint or results file where a good one used to be: we write
a temporary file in the same directory, fsync it, and ``os.replace`` it over the target.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.metadata
import io
import math
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch


def atomic_write(path: str | os.PathLike, writer: Callable[[IO[bytes]], None]) -> Path:
    """Call ``writer(fileobj)`` on a temp file beside ``path``, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def save_figure(fig: Any, path: str | os.PathLike, dpi: int | None = None) -> Path:
    """A matplotlib figure as a PNG (at ``dpi``, default the figure's own), written atomically: rendered to
    memory first, then renamed into place, so a reader never sees half a plot."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi or "figure")
    return atomic_write(Path(path), lambda f: f.write(buffer.getvalue()))


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: once, at import, before any writer thread
    os.umask(mask)
    return mask


UMASK = _read_umask()


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` atomically."""
    return atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write text atomically (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def json_safe(obj: Any) -> Any:
    """``obj`` as strict JSON accepts it: numpy scalars become Python numbers, tuples lists, keys strings, and
    inf/nan the strings "inf"/"nan" (``json.dumps`` would write the non-standard ``Infinity``/``NaN``)."""
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.floating | np.integer):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)  # "inf", "-inf", "nan": float() reads them back
    return obj


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line and fsync, so a crash loses at most the line being written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # concurrent writers (launchers on one file system) append whole lines
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a killed writer left a partial line: end it
            data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` picks CUDA when present, else CPU; an explicit ``cuda`` without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda was requested but no CUDA GPU is visible (use device=auto or cpu)")
    return device


def _version(package: str) -> str | None:
    """An installed package's version from its metadata: MONAI's own import takes seconds, and a worker that
    records the version does not otherwise import it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0] if out else None


def env_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """Everything a timing needs next to it to be comparable: GPU, driver, CUDA, cuDNN, versions, host.

    The commit is not here: :func:`bench.core.records.append_row` stamps every row with it (``git_sha``, ``dirty``)."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        # where compiled bytecode is read from: a start-up imports thousands of modules, compiled from source at
        # every start where no bytecode can be read or written (an install without .pyc on a read-only disk)
        "pycache_prefix": sys.pycache_prefix,
        "dont_write_bytecode": sys.flags.dont_write_bytecode,
        "torch": torch.__version__,
        "monai": _version("monai"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu_threads": torch.get_num_threads(),
        "device": str(device) if device is not None else None,
    }
    if torch.cuda.is_available():
        dev = torch.device(device) if device is not None else torch.device("cuda")
        props = torch.cuda.get_device_properties(dev.index or 0 if dev.type == "cuda" else 0)
        info.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            driver=_nvidia_driver(),
        )
    else:
        info.update(gpu=None, compute_capability=None, driver=None)
    return info
