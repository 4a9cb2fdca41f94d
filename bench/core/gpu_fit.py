"""What the visible GPU can run: a job's recipe stack against the GPU's compute capability, its memory against the
GPU's size.

The ladder asks before it starts a job. A job the GPU cannot make gets an ``unsupported`` row with the reason, not a
refusal deep in a worker or an out-of-memory error minutes in; a job that names an experiment whose stack the GPU
refuses (bf16 below compute capability 8.0) runs that experiment's fp16 variant, ``configs/experiment/<name>_fp16.yaml``
(``fast_train_fp16``: fp16 autocast and a loss scaler), and its row says so. ``gpu.*`` in configs/ladder.yaml
replaces what torch reports, so a dry run on any machine shows what a V100 or a 16 GB card would run.

Example:
    >>> gpu = Gpu.detect({"name": "Tesla V100-SXM2-16GB", "capability": [7, 0], "memory_gib": 15.8})
    >>> fit(["experiment=fast_train", "bench=train_step"], stack_of, gpu).overrides
    ('experiment=fast_train_fp16', 'bench=train_step')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench.core.timing import GIB, datasheet_peak_tflops
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.config_checks import ConfigError, check_number_value, is_int
from optim import DeviceInfo, RecipeStack

EXPERIMENT_DIR = CONFIG_DIR / "experiment"
FIELDS = ("name", "capability", "memory_gib")
FP16_SUFFIX = "_fp16"


@dataclass(frozen=True)
class Gpu:
    """The GPU the jobs run on: its name, compute capability and memory (GiB)."""

    name: str
    capability: tuple[int, int]
    memory_gib: float

    @property
    def device(self) -> DeviceInfo:
        return DeviceInfo("cuda", self.capability, self.name)

    @classmethod
    def detect(cls, simulate: Mapping[str, Any] | None = None) -> Gpu | None:
        """GPU 0 as torch reports it, with each field ``simulate`` sets (``name``, ``capability``, ``memory_gib``)
        in its place; None on a machine without CUDA, unless ``simulate`` sets all three."""
        given = {k: v for k, v in (simulate or {}).items() if k in FIELDS and v is not None}
        if "memory_gib" in given:
            check_number_value("gpu.memory_gib", given["memory_gib"], 0.0, low_open=True)
        capability = given.get("capability")
        if capability is not None and not (isinstance(capability, list | tuple) and len(capability) == 2
                                           and all(is_int(x) for x in capability)):
            raise ConfigError(f"gpu.capability={capability}: not a compute capability; pass [major, minor], "
                              "e.g. 'gpu.capability=[7,0]' for a V100")
        if len(given) < len(FIELDS) and not torch.cuda.is_available():
            return None
        reported = {} if len(given) == len(FIELDS) else {
            "name": torch.cuda.get_device_name(0), "capability": torch.cuda.get_device_capability(0),
            "memory_gib": torch.cuda.get_device_properties(0).total_memory / GIB}
        found = {**reported, **given}
        major, minor = (int(x) for x in found["capability"])
        return cls(str(found["name"]), (major, minor), float(found["memory_gib"]))

    def peak_note(self) -> str | None:
        """One line when this GPU is not in the datasheet peak table: its rows leave ``peak_fraction`` empty."""
        if datasheet_peak_tflops(self.name, "fp32") is not None:
            return None
        return (f"note: {self.name} is not in bench/timing.py's peak table (DATASHEET_PEAK_TFLOPS): every row is "
                "measured, and its peak_fraction is left empty")


@dataclass(frozen=True)
class Fit:
    """What to run for a job on a GPU: ``overrides`` (the fp16 variant's where ``variant`` names it), or nothing
    and the ``reason`` the row is unsupported."""

    overrides: tuple[str, ...]
    reason: str = ""
    variant: str = ""

    def note(self) -> str:
        """What the row's message says about the choice: the variant run in the job's place, or nothing."""
        return f"ran experiment={self.variant}: this GPU refuses the job's own stack" if self.variant else ""


def fp16_variant(overrides: Sequence[str]) -> tuple[str, ...] | None:
    """``overrides`` with ``experiment=X`` replaced by ``experiment=X_fp16`` when that config exists, else None."""
    for n, override in enumerate(overrides):
        key, _, name = override.partition("=")
        if key == "experiment" and (EXPERIMENT_DIR / f"{name}{FP16_SUFFIX}.yaml").exists():
            return (*overrides[:n], f"experiment={name}{FP16_SUFFIX}", *overrides[n + 1:])
    return None


def fit(overrides: Sequence[str], stack_of: Callable[[Sequence[str]], RecipeStack], gpu: Gpu | None,
        needs_gib: float | None = None) -> Fit:
    """Whether ``gpu`` can make the job of ``overrides`` (``stack_of`` composes its recipe stack) needing
    ``needs_gib`` GiB: as it is, as its experiment's fp16 variant, or not at all (a reason). Without a GPU to ask
    (a dry run on a CPU), the job as it is."""
    overrides = tuple(overrides)
    if gpu is None:
        return Fit(overrides)
    if needs_gib is not None and gpu.memory_gib < float(needs_gib):
        return Fit(overrides, f"needs {float(needs_gib):g} GiB of GPU memory (its measured peak); {gpu.name} has "
                              f"{gpu.memory_gib:.1f} GiB")
    ok, reason = stack_of(overrides).supported(gpu.device)
    if ok:
        return Fit(overrides)
    variant = fp16_variant(overrides)
    if variant is not None and stack_of(variant).supported(gpu.device)[0]:
        return Fit(variant, variant=next(o for o in variant if o.startswith("experiment=")).partition("=")[2])
    return Fit(overrides, reason)
