"""Stop training cleanly when asked: SIGTERM (a scheduler's preemption, ``scancel``, ``docker stop``) or Ctrl-C.

Killed between checkpoints, a run would lose every step since the last ``save_every``. Under :class:`Watch` the
two signals only set a flag; the loop checks it at the top of each step (:meth:`Watch.requested`), where the run's
state is whole, writes ``last.pt`` at the current step through the checkpoint writer (atomically) and exits with a
line saying how to resume; ``resume=auto`` then continues exactly (:mod:`med_ddpm.train_state`). A second signal
before that check stops at once (a step that hangs can still be interrupted). A process forked under it (a data
loader's worker) ends on the signal as it would without it.

Under torchrun every rank gets the signal, perhaps at different steps, so the ranks agree each step on whether any
was asked (one small gather; a single process checks its flag only).

Example:
    >>> with Watch() as stop:
    ...     while step < max_steps:
    ...         if stop.requested():
    ...             stop.exit(save, step, resume_command(out_dir))
    ...         step += 1
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from collections.abc import Callable
from typing import Any

from med_ddpm import distributed

SIGNALS = (signal.SIGTERM, signal.SIGINT)
log = logging.getLogger("med_ddpm.train")


class Watch:
    """The flag the signals set, and the handlers it replaced (restored by :meth:`release`)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}
        self.pid = os.getpid()
        if threading.current_thread() is threading.main_thread():  # handlers belong to the main thread
            self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.pid:  # a process forked meanwhile (a loader worker) inherited this: act as before
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is not None:  # asked twice: stop now
            self.release()
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        self.signum = signum

    def requested(self) -> bool:
        """Whether any rank was signalled (all ranks stop at the same step)."""
        if not distributed.is_distributed():
            return self.signum is not None
        asked = [s for s in distributed.all_gather_object(self.signum) if s is not None]
        self.signum = self.signum or (asked[0] if asked else None)
        return bool(asked)

    def exit(self, save: Callable[[], None], step: int, resume: str) -> None:
        """Save, say how to resume and exit as the signal would (128 + its number)."""
        save()
        name = signal.Signals(self.signum).name
        if distributed.is_main():
            log.warning("stopped by %s at step %d: checkpoints/last.pt holds it; resume with: %s", name, step, resume)
        self.release()
        raise SystemExit(128 + self.signum)

    def release(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def resume_command(output_dir: Any) -> str:
    """This run's command line with ``resume=auto`` (its Hydra overrides; the bare command outside ``@hydra.main``)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    kept = [o for o in overrides if not o.startswith(("resume=", "output_dir="))]
    return shlex.join(["python", "-m", "med_ddpm.train", *kept, f"output_dir={output_dir}", "resume=auto"])
