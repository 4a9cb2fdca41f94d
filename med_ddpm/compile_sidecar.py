"""Compile a sampling job's stack into its compile cache in another process, for the next job.

``med_ddpm.sample`` with ``compile=auto`` on a cold cache samples a small job with the stack's eager form
(:mod:`med_ddpm.sample_plan`) and starts ``python -m med_ddpm.compile_sidecar SPEC.json``: with the job when the
job may switch to its compile (:class:`Sidecar`), else when the job's sampling ends (then it first times the eager
form's first call for the next job's plan). It loads the same checkpoint, builds the same stack for the same
workload, makes the stack's first call on zeros (the compile) and saves the cache, so the next job finds it warm.

Killed half-way, it leaves no half-written entry: the cache file, its ``.aot`` file and the plan's record are each
written to a temporary file and renamed. While it runs, ``<cache>.compiling`` holds its pid, so another job does
not start a second compile of the same key, and ``bench.core.e2e`` waits for it before the next job.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from med_ddpm.checkpoint import load_checkpoint
from med_ddpm.compile_cache import CompileCache, sample_workload
from med_ddpm.run_clock import synchronize
from med_ddpm.sample_plan import record
from med_ddpm.samplers import model_input
from med_ddpm.utils import atomic_write_text
from optim import RecipeStack

MARKER = ".compiling"  # beside the cache file, while a sidecar compiles it: the sidecar's pid


def first_call_on_zeros(model: torch.nn.Module, stack: RecipeStack, net: torch.nn.Module, n: int, size: list[int],
                        device: torch.device) -> None:
    """One network call on zeros laid out as a mask's input of ``n`` samples at ``size``: the call a compile recipe
    compiles (or loads) on, with cuDNN's autotuning and CUDA-graph capture."""
    x = torch.zeros((n, net.out_channels, *size), device=device)
    cond = torch.zeros((1, net.in_channels - net.out_channels, *size), device=device).expand(n, -1, -1, -1, -1)
    t = torch.zeros((n,), dtype=torch.long, device=device)
    with torch.no_grad(), stack.forward_context():
        model(model_input(x, stack.prepare_input(cond)), t)
    synchronize(device)


def marker(cache: CompileCache) -> Path:
    return cache.path.with_name(cache.path.name + MARKER)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def compiling(path: Path) -> bool:
    """A sidecar's marker whose process still runs (a killed sidecar's marker counts as gone)."""
    try:
        return pid_alive(int(path.read_text().strip()))
    except (OSError, ValueError):
        return False


class Sidecar:
    """A started sidecar: :meth:`ready` once it has exited having saved the cache."""

    def __init__(self, proc: subprocess.Popen, cache: CompileCache) -> None:
        self.proc, self.cache = proc, cache

    def ready(self) -> bool:
        return self.proc.poll() == 0 and self.cache.path.exists()

    def running(self) -> bool:
        """Still compiling: it shares the GPU with the job, whose eager calls it slows."""
        return self.proc.poll() is None


def start(spec: dict[str, Any], cache: CompileCache, module: str = "med_ddpm.compile_sidecar") -> Sidecar:
    """Start ``python -m module SPEC`` (the sidecar) on ``spec`` (:func:`run`'s keys), its output in
    ``<cache>.sidecar.log``. It stays in this process group, so whatever stops the job's group stops it."""
    spec_path = atomic_write_text(cache.path.with_name(cache.path.stem + ".sidecar.json"), json.dumps(spec))
    log = cache.path.with_name(cache.path.stem + ".sidecar.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", module, str(spec_path)], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)
    log.close()
    atomic_write_text(marker(cache), str(proc.pid))
    return Sidecar(proc, cache)


def spec_of(checkpoint: str, weights: str, recipe: Any, num_samples: int, size: list[int], device: torch.device,
            cache_root: str, time_eager: bool = False) -> dict[str, Any]:
    return {"checkpoint": str(checkpoint), "weights": weights, "recipe": recipe, "num_samples": int(num_samples),
            "size": list(size), "device": str(device), "cache_root": str(cache_root), "time_eager": time_eager}


def eager_first_s(stack: RecipeStack, net: torch.nn.Module, n: int, size: list[int], device: torch.device) -> float:
    """Seconds of the eager form's preparation (on a copy of ``net``) and first call in this fresh process: what the
    next job pays for them. The job that started the sidecar may have paid more (a cold Triton cache it filled)."""
    eager = stack.eager()
    start = time.perf_counter()
    with eager.session():
        first_call_on_zeros(eager.prepare_model(copy.deepcopy(net)), eager, net, n, size, device)
    return time.perf_counter() - start


def run(spec: dict[str, Any]) -> Path | None:
    """Build the job's compiled stack, call it once on zeros and save the cache; returns the saved file. It runs at
    niceness 10 (inductor's compile workers inherit it), so that a job sampling beside it keeps the CPU it needs to
    launch its kernels. With ``time_eager`` (a sidecar started after the job's sampling, alone) it first times the
    eager form's first call for the next job's plan (:func:`eager_first_s`)."""
    os.nice(10)
    device = torch.device(spec["device"])
    net = load_checkpoint(spec["checkpoint"], weights=spec["weights"]).model.to(device)
    stack = RecipeStack.from_config(spec["recipe"])
    cache = CompileCache.for_run(spec["cache_root"], "sample", stack, device,
                                 sample_workload(net.config, spec["num_samples"], spec["size"]))
    try:
        if spec.get("time_eager"):  # before the compile, which would warm this process's kernels for it
            seconds = eager_first_s(stack, net, spec["num_samples"], spec["size"], device)
            record(cache.plan_path, eager_first_s=seconds)
            print(f"eager form's first call: {seconds:.2f} s", flush=True)
        start_s = time.perf_counter()
        with stack.session():
            cache.load()
            model = stack.prepare_model(net)
            first_call_on_zeros(model, stack, net, spec["num_samples"], spec["size"], device)
            saved = cache.save()
        record(cache.plan_path, compile_s=time.perf_counter() - start_s)
        return saved
    finally:
        with contextlib.suppress(FileNotFoundError):
            marker(cache).unlink()


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
