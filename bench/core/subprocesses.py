"""Commands that bench runs in a process group of their own, and that stop when bench is stopped.

``bench.core.e2e`` (the real CLIs, the training arms) and ``bench.core.ncu`` (ncu and the program it profiles) start each
command in a new session, so that a timeout kills the command together with every worker it started (data
loaders, inductor's compile workers, the profiled program). A new session also takes the command out of
bench's own process group, so neither Ctrl-C at the terminal nor an outer ``timeout`` (which signals its whole
process group) reaches it: bench would exit and leave the command running, holding the GPU that the next
command then shares. So every running command is recorded here, and while :func:`stopped_together` is active,
SIGTERM and SIGINT kill every recorded group before bench exits (as 128 + the signal, or KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

LIVE: set[int] = set()  # process-group ids of the commands running now

CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")  # a cold job's caches must be its own
STDERR_TAIL = 2000  # characters of a failed command's output that its row keeps


def kill(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (a group that has already gone is fine)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def _started(cmd: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """``cmd`` started in a new session and recorded while the block runs; an exception in the block kills its
    group."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)
    LIVE.add(proc.pid)
    try:
        yield proc
    except BaseException:
        kill(proc.pid)
        raise
    finally:
        LIVE.discard(proc.pid)


def run(cmd: Sequence[str], timeout_s: float | None, **popen: Any) -> tuple[int | None, Any]:
    """Run ``cmd`` in a process group of its own to its end (``popen``: Popen's stdout, env, ...); (its exit
    code, or None when ``timeout_s`` ran out and its whole group was killed; its stdout when piped, else None).
    Under :func:`stopped_together`, entered here when this is the main thread."""
    with stopped_together(), _started(cmd, **popen) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            return proc.returncode, out
        except subprocess.TimeoutExpired:
            kill(proc.pid)
            return None, proc.communicate()[0]


def _stop(signum: int, frame: Any) -> None:
    for pid in list(LIVE):
        kill(pid)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def stopped_together() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT first kill every running command's group, then end bench.
    Signal handlers belong to the main thread; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def spawn(argv: list[str], cache_dir: Path, log: Path, timeout_s: float | None,
          env_extra: Mapping[str, str] | None = None, importtime: bool = False) -> tuple[int | None, float, str]:
    """Run ``python -m <argv>`` with its caches in ``cache_dir`` (and ``env_extra`` set, e.g. the GPU it may see);
    (exit code or None on timeout, wall s, log tail). The command runs in its own process group, so a timeout
    kills its compile and data-loader workers with it, and no orphan keeps a GPU busy
    (:func:`stopped_together` also stops it when bench is stopped).

    ``importtime``: the command logs each import's time (``python -X importtime``: a flag, not the environment
    variable, so torch.compile's worker processes do not log theirs); the tail leaves those lines out."""
    env = {k: v for k, v in os.environ.items() if k not in CACHE_ENV}
    env.update(MED_DDPM_CACHE_DIR=str(cache_dir), TRITON_CACHE_DIR=str(cache_dir / "triton"))
    env.update(env_extra or {})
    start = time.time()
    with log.open("w") as out:
        code, _ = run([sys.executable, *(["-X", "importtime"] if importtime else []), "-m", *argv],
                                    timeout_s, stdout=out, stderr=subprocess.STDOUT, env=env)
    said = [line for line in log.read_text(errors="replace").splitlines(True) if not line.startswith("import time:")]
    return code, time.time() - start, "".join(said)[-STDERR_TAIL:]
