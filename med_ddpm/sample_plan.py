"""How ``med_ddpm.sample`` runs a job: eager or compiled, and whether to compile for the next job in a sidecar.

The compiled stack runs each network call faster than the stack's eager form (its recipes that pay without a
compiler, :meth:`optim.RecipeStack.eager`), but its first call pays: about 45 s on a cold cache on the H100
(inductor, Triton, the ``.aot`` file; :data:`DEFAULTS`), several seconds on a warm one (the cache's and the file's
load, cuDNN autotuning, CUDA-graph capture). A 4-mask job on a cold cache would save about 1.5 s a mask by compiling
and spend those 45 s doing it. So with ``compile=auto`` the command estimates both and picks the cheaper:

* warm cache: compiled when ``load + calls x compiled`` beats ``eager first + calls x eager``;
* cold cache: compiled in this process when ``compile + calls x compiled`` beats ``eager first + calls x eager``;
  otherwise eager, and a separate process (``med_ddpm.compile_sidecar``) compiles into the cache, so the next job
  finds it warm. It starts with the job when its compile would end while switching to it still pays; the job then
  switches to the compiled stack at the next mask once the calls left repay the load:
  ``left x (eager - compiled) > load`` (:func:`switch_pays`). Otherwise it starts when the job's sampling ends
  (:func:`sidecar_start`), so that it does not share the GPU and the CPU with the job's calls; it then also times
  the eager form's first call for the next job (a job's own may include filling a cold Triton cache).

``compile=always`` compiles in this process (a cold cache: the first call compiles); ``compile=never`` runs the
eager form. Either side's first cost is the network's preparation and first call (eager: lazy kernel loading;
compiled: the compile or the load, autotuning, graph capture). The facts
are :class:`Known` values with where each came from: ``measured`` (this machine, recorded beside the cache by an
earlier run, :func:`record`; an eager time a call only from masks sampled while no sidecar compiled, since the
compile shares the GPU), ``row`` (a committed benchmark row's figure) or ``guess`` (no row of this stack: an
estimate, said so in the log).

This module is pure (no torch, no files but the record's): tests cover each choice on the CPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from med_ddpm.utils import atomic_write_text

MODES = ("auto", "always", "never")
NOW, AFTER = "now", "after"  # a sidecar starts with the job, or when the job's sampling ends
SIDECAR_SAYS = {NOW: "compiling for the next job in another process from the start",
                AFTER: "compiling for the next job in another process once sampling ends"}
REFERENCE_VOXELS = 128 ** 3  # the defaults' workload: one 128^3 whole-head volume per call


@dataclass(frozen=True)
class Known:
    """A fact of the cost model: seconds, and where the figure comes from (``measured``, ``row`` or ``guess``)."""

    s: float
    source: str

    def scaled(self, factor: float | None) -> Known:
        """Another workload's per-call time, proportional to its voxels (None: not known before the masks are read):
        an estimate unless measured for it."""
        return self if factor == 1 else Known(self.s * (factor or 1), "guess")

    def __str__(self) -> str:
        return f"{self.s:.4g} s [{self.source}]"


# Defaults for the shipped sampling stack on a 128^3 volume, used until this machine has measured its own: the H100
# rows of run 20261207T170003Z-293622 (bench/results/h100/results.jsonl, 51d99c6) and the eager probe of that call
# (bench/results/h100/eager/results.jsonl).
DEFAULTS = dict(
    # forward.shipped: 20.36 ms a call
    compiled_call_s=Known(0.0204, "row"),
    # the probe: the shipped stack's eager form, amp_fp16 + fused_groupnorm + sdpa_attention, 35.08 ms a call
    eager_call_s=Known(0.0351, "row"),
    # e2e.sample4_cold: the eager form's preparation and warm-up call on a fresh machine (a cold Triton cache for
    # fused_groupnorm's kernels among it) took 5.10 s
    eager_first_s=Known(5.10, "row"),
    # e2e.sample4_warm's plan: the sidecar's compile of that job's cache, alone, took 44.55 s
    compile_s=Known(44.55, "row"),
    # e2e.sample4_warm: preparing the network (the cache's load, the recipes) took 2.83 s, the warm-up call that
    # loads the .aot file, autotunes and captures the CUDA graphs 4.48 s
    load_s=Known(7.31, "row"),
)


@dataclass(frozen=True)
class Facts:
    """What the plan is made from: the cache's state, the job's network calls and the five costs."""

    cache: str  # warm | cold | off (the stack compiles nothing, or paths.compile_cache=null)
    calls: int  # network calls this process makes: masks x calls per volume (num_samples are one batch)
    eager_call_s: Known
    eager_first_s: Known  # the eager form's preparation and first call (lazy kernel loading)
    compiled_call_s: Known
    compile_s: Known  # a cold cache: the compiled stack's preparation and first call (build and save)
    load_s: Known  # a warm cache: the compiled stack's preparation (the cache's load) and first call (load, autotune,
    # capture)
    compiles: bool = True  # the stack has a compile recipe
    compiling: bool = False  # another process is compiling this cache now


@dataclass(frozen=True)
class Plan:
    """The stack a job runs (``compiled`` or ``eager``), when it starts a sidecar compile (:data:`NOW`,
    :data:`AFTER`; empty: none), and why."""

    stack: str
    sidecar: str
    reason: str
    eager_s: float | None = None
    compiled_s: float | None = None
    facts: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """The log's one line."""
        then = f"; {SIDECAR_SAYS[self.sidecar]}" if self.sidecar else ""
        return f"plan: {self.stack}{then} ({self.reason})"

    def record(self) -> dict[str, Any]:
        """For timings.json (and the e2e rows)."""
        return {k: v for k, v in asdict(self).items() if v is not None}


def check_mode(mode: Any) -> str:
    """``compile=`` must be one of :data:`MODES` (a one-line ConfigError otherwise)."""
    from med_ddpm.config_checks import check_one_of

    return check_one_of("compile", mode, MODES)


def plan_job(mode: str, facts: Facts) -> Plan:
    """The cheaper of eager and compiled for ``facts`` under ``compile=mode`` (:data:`MODES`)."""
    if not facts.compiles:
        return Plan("eager", "", "the stack has no compile recipe")
    if mode == "never":
        return Plan("eager", "", "compile=never")
    if mode == "always":
        return Plan("compiled", "", "compile=always")
    eager = facts.eager_first_s.s + facts.calls * facts.eager_call_s.s
    first = facts.load_s if facts.cache == "warm" else facts.compile_s
    compiled = first.s + facts.calls * facts.compiled_call_s.s
    sums = (f"{facts.calls} calls: eager {eager:.1f} s, first call {facts.eager_first_s} + {facts.eager_call_s} a "
            f"call; compiled {compiled:.1f} s, "
            f"{'load' if facts.cache == 'warm' else 'compile'} {first} + {facts.compiled_call_s} a call")
    known = {k: asdict(v) if isinstance(v, Known) else v for k, v in asdict(facts).items()}
    if facts.compiling:
        return Plan("eager", "", f"another process is compiling this cache now; {sums}", eager, compiled, known)
    if compiled < eager:
        return Plan("compiled", "", f"{facts.cache} cache, compiling pays; {sums}", eager, compiled, known)
    sidecar = sidecar_start(facts) if facts.cache == "cold" else ""
    return Plan("eager", sidecar, f"{facts.cache} cache, compiling does not pay; {sums}", eager, compiled, known)


def switch_pays(facts: Facts, calls_left: int) -> bool:
    """With a compile just finished elsewhere: loading it now repays its load over the calls left."""
    return calls_left * (facts.eager_call_s.s - facts.compiled_call_s.s) > facts.load_s.s


def sidecar_start(facts: Facts) -> str:
    """:data:`NOW` when a compile started with the job ends while switching to it still pays, else :data:`AFTER`.
    The calls made meanwhile are counted at the eager time a call measured alone; beside the compile they run
    slower, so the count overstates the calls made and understates those left: it leans to :data:`AFTER`."""
    made = max(0.0, facts.compile_s.s - facts.eager_first_s.s) / facts.eager_call_s.s
    return NOW if switch_pays(facts, facts.calls - math.ceil(made)) else AFTER


def known_facts(path: Path | None, voxels: int | None) -> dict[str, Known]:
    """The five costs: measured on this machine where ``path`` (:func:`record`) has them, else :data:`DEFAULTS`
    (per-call ones scaled to ``voxels`` per call; None: each mask samples at its own size)."""
    factor = None if voxels is None else voxels / REFERENCE_VOXELS
    known = {k: v.scaled(factor) if k.endswith("call_s") else v for k, v in DEFAULTS.items()}
    try:
        measured = json.loads(path.read_text()) if path is not None and path.exists() else {}
    except (OSError, ValueError):  # a record torn by hand: the defaults
        measured = {}
    known.update({k: Known(float(v), "measured") for k, v in measured.items()
                  if k in DEFAULTS and isinstance(v, (int, float)) and math.isfinite(v) and v > 0})
    return known


def record(path: Path | None, **seconds: float | None) -> None:
    """Keep measured costs (keys of :data:`DEFAULTS`) for the next plan of this cache key (atomically)."""
    values = {k: round(float(v), 6) for k, v in seconds.items() if v is not None and k in DEFAULTS and v > 0}
    if path is None or not values:
        return
    try:
        old = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        old = {}
    atomic_write_text(path, json.dumps({**old, **values}, indent=1, sort_keys=True))


def facts_from(known: Mapping[str, Known], cache: str, calls: int, compiles: bool, compiling: bool) -> Facts:
    return Facts(cache=cache, calls=calls, compiles=compiles, compiling=compiling, **known)
