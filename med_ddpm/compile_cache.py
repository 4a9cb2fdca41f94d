"""Compile once per machine: the project's cache of ``torch.compile`` results.

A compiled recipe (``compile``, ``compile_cudagraphs``) makes the first step of
every new process pay inductor's code generation and Triton's kernel compilation: about a minute for the
128^3 U-Net. Two layers keep that to the first run on a machine:

* inductor's own on-disk caches (FX graph, AOTAutograd, autotuning, Triton kernels) live under
  ``<dir>/inductor`` (``TORCHINDUCTOR_CACHE_DIR``, unless already set) instead of a ``/tmp`` folder that
  a reboot or a fresh container loses;
* ``torch.compiler.save_cache_artifacts()`` after the first step writes those results as one portable file,
  ``<dir>/<workload>-<key>.bin``, keyed by the torch version, the GPU, the recipe stack with its options
  and the workload (model config, batch and volume size); ``torch.compiler.load_cache_artifacts`` loads it
  before the next run's first compile. The file can be copied to another machine with the same torch and GPU.

Dynamo still traces the model in every process (seconds), and CUDA-graph trees record their graphs again;
what the cache removes is inductor's code generation and kernel compilation. A key beside each file
(``.json``) says what it was built for. A compile recipe with ``aot=true`` also keeps its compiled forward,
Dynamo's work included, in ``<workload>-<key>-<code>.aot`` (:mod:`optim.precompile`); ``<code>`` is a digest
of this project's source, because torch checks its own version when it loads the file but not the code it traced.

Example:
    >>> cache = CompileCache.for_run(cfg.paths.compile_cache, stack, device, {"model": ..., "batch": 1})
    >>> status = cache.load()       # "warm" or "cold"; None-cache (no compile recipe) means "off"
    >>> ...first step...
    >>> cache.save()
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from med_ddpm.utils import atomic_write, atomic_write_text
from optim import RecipeStack
from optim.compile import Compile
from optim.precompile import precompiled_forward

PROJECT_PACKAGES = ("med_ddpm", "optim")  # the source an ahead-of-time compiled forward may have traced

log = logging.getLogger("med_ddpm.compile_cache")


def device_name(device: torch.device) -> str:
    """The GPU's marketing name (compiled kernels are per architecture), or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def code_digest() -> str:
    """A digest of the Python files of :data:`PROJECT_PACKAGES`: any edit there names a new ``.aot`` file."""
    digest = hashlib.sha256()
    for package in PROJECT_PACKAGES:
        for path in sorted((Path(__file__).resolve().parents[1] / package).glob("*.py")):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def sample_workload(model: Mapping[str, Any], batch: int, size: list[int] | None) -> dict[str, Any]:
    """A sampling run's workload in its cache key: the network's hyperparameters (``UNet3D.config``), samples per
    mask and the volume size (``med_ddpm.sample``; a bench job of the same workload names the same file)."""
    return {"model": dict(model), "batch": int(batch), "size": size}


def train_workload(model: Mapping[str, Any], batch: int, grad_accum: int, world_size: int) -> dict[str, Any]:
    """A training run's workload in its cache key: the model config, micro-batch, accumulation, processes."""
    return {"model": dict(model), "batch": int(batch), "grad_accum": int(grad_accum), "world_size": int(world_size)}


def cache_key(stack: RecipeStack, device: torch.device, workload: Mapping[str, Any]) -> dict[str, Any]:
    """Everything a compiled graph depends on that this project chooses: torch, GPU, recipes, workload."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device_name(device),
            "recipes": [[r.name, r.options()] for r in stack.recipes], "workload": dict(workload)}


class CompileCache:
    """One cache file for one key, in ``root``.

    Args:
        root: the cache folder (``paths.compile_cache``); ``~`` is expanded, the folder created.
        name: a readable prefix for the file (``sample``, ``train``).
        key: JSON-able; its hash names the file.
    """

    def __init__(self, root: str | Path, name: str, key: Mapping[str, Any]) -> None:
        self.root = Path(root).expanduser()
        self.key = dict(key)
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.path = self.root / f"{name}-{digest}.bin"
        self.status = "cold"

    @functools.cached_property
    def aot_path(self) -> Path:
        """The ``.aot`` file of a compile recipe with ``aot``: named by the source digest, which reads every project
        file, so it is computed only for a run that uses it."""
        return self.path.with_name(f"{self.path.stem}-{code_digest()}.aot")

    @property
    def plan_path(self) -> Path:
        """What runs of this key measured on this machine (:mod:`med_ddpm.sample_plan`): per-call seconds of the
        compiled and eager stacks, the first compiled call's on a cold and on a warm cache."""
        return self.path.with_suffix(".plan.json")

    @classmethod
    def for_run(cls, root: str | Path | None, name: str, stack: RecipeStack, device: torch.device,
                workload: Mapping[str, Any]) -> CompileCache | None:
        """The cache of a run, or None when its stack compiles nothing or ``root`` is null (cache off). A compile
        recipe with ``aot`` gets the cache's ``.aot`` file."""
        if root is None or not stack.slow_first_call:
            return None
        cache = cls(root, name, cache_key(stack, device, workload))
        cache.use_inductor_dir()
        for recipe in stack.recipes:
            if isinstance(recipe, Compile) and recipe.aot:
                recipe.aot_file = cache.aot_path
                cache.remove_stale_aot()
        return cache

    def remove_stale_aot(self) -> None:
        """Delete this key's ``.aot`` files of other code digests: no later run can load them."""
        for stale in self.aot_path.parent.glob(self.path.stem + "-*.aot"):
            if stale != self.aot_path:
                stale.unlink(missing_ok=True)

    def use_inductor_dir(self) -> None:
        """Point inductor's on-disk caches into the cache folder, unless the user chose a folder already.

        Importing inductor sets ``TORCHINDUCTOR_CACHE_DIR`` to its ``/tmp`` default, so that value counts as unset.
        """
        current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if current is None or os.path.abspath(current) == os.path.abspath(_inductor_default_dir()):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.root / "inductor")

    def load(self) -> str:
        """Hot-load the saved artifacts, if any; returns and remembers ``warm`` or ``cold``.

        A file torch cannot read (another torch build, a torn copy) is logged and ignored: the run compiles.
        """
        if not self.path.exists():
            return self.status
        info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        if info is None:
            log.warning("%s: torch could not load these compile artifacts; compiling from scratch", self.path)
            return self.status
        self.status = "warm"
        log.info("compile cache warm: %s (%d inductor, %d AOTAutograd artifacts)", self.path,
                 len(info.inductor_artifacts), len(info.aot_autograd_artifacts))
        return self.status

    def save(self) -> Path | None:
        """After the first compiled step of a cold run: write this process's artifacts (atomically)."""
        if self.status == "warm":
            return None
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return None
        atomic_write(self.path, lambda f: f.write(saved[0]))
        atomic_write_text(self.path.with_suffix(".json"), json.dumps(self.key, indent=1, sort_keys=True, default=str))
        log.info("compile cache saved: %s", self.path)
        return self.path


def _inductor_default_dir() -> str:
    """Inductor's default cache folder; imported only where the variable is set (inductor takes a second to import,
    which a job that samples without compiling never pays)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return default_cache_dir()


def precompiled_report(model: torch.nn.Module) -> dict[str, Any] | None:
    """What the ahead-of-time compiled forward did (``loaded``, ``saved`` or ``lazy``, how many calls took the
    lazy path, and the seconds its file took to load or to build and save), for timings.json; None without a
    compile recipe with ``aot``."""
    forward = precompiled_forward(model)
    if forward is None:
        return None
    return {"status": forward.status, "lazy_calls": forward.lazy_calls, "seconds": round(forward.seconds, 4)}


def cache_status(cache: CompileCache | None) -> str:
    """``off`` (no compile recipe, or the cache switched off), else the cache's ``cold`` / ``warm``."""
    return "off" if cache is None else cache.status
