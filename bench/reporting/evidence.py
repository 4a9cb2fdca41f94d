"""One evidence run of one GPU folder, and the figures the pages take from it.

``python -m bench.ladder preset=evidence out=bench/results/<gpu>`` writes every row of the evidence under one run
id, each named by its ``job_name``, ``<workload>.<stack>``: the contract between the ladder and this report. A
folder's results.jsonl may still hold several runs (an earlier one, one cut short, rows of other presets); a page
shows exactly one, so that every ratio on it divides two times of one run: the run ``run=`` names, else the newest
complete run (the last to start of those with every headline row ``ok`` or ``unsupported``). The folder's other
runs are named on the page, never mixed in.

The counters rows are set against the seed study's claims (ICPE 2026, "Performance Analysis and Optimization of 3D
Generative Diffusion Models across GPU Architectures": TF32 plus a channels-last 3-D layout "reduce SM cycles by up
to 100x, cut dynamic instructions by 100x, raise Tensor Core utilization 1.45-9.98x, and increase IPC by 7 % on
A100"), each stack against the strict-FP32 row of the same workload and run (:func:`compare`):

* reduction factors = baseline / stack, for kernel time, SM cycles and warp instructions summed over the step's
  kernels;
* tensor-pipe ratio = stack / baseline of the time-weighted tensor-pipe use (a strict-FP32 step runs its
  convolutions on the FMA pipe: under :data:`MIN_TENSOR_PCT` the baseline gives no ratio, only the stack's own
  percentage, since a ratio over a rounding-level baseline says nothing);
* IPC change = stack / baseline - 1.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from bench.core.records import RESULTS_FILE, code_label, read_results
from med_ddpm.config_checks import ConfigError, DataError
from med_ddpm.sample_plan import NOW, SIDECAR_SAYS

WORKLOADS = {"forward": "denoiser forward", "train_step": "train step", "ddpm250": "DDPM, 250 steps",
             "fast_sampler": "`fast_sample`'s own sampler", "sampler25": "the searched 25-call sampler"}
STACKS = ("strict_fp32", "torch_defaults", "shipped")
BASELINES = STACKS[:2]  # every speed-up is against both, of the same run
HEADLINE = (*(f"{w}.{s}" for w in ("forward", "train_step") for s in STACKS), "sampler25.shipped",
            "fast_sampler.shipped", "ddpm250.strict_fp32", "ddpm250.torch_defaults")


class E2EJob(NamedTuple):
    """A real command's figure: its row's field (``total_s`` divided by the volumes when ``per_volume``), what it
    times, the step job beside it and the project's target in ms (H100 class, issue targets of a fresh machine)."""

    field: str
    what: str
    step: str
    target_ms: float
    per_volume: bool = False


E2E = {
    "e2e.sample4_cold": E2EJob("total_s", "4 masks, cold compile cache", "fast_sampler.shipped", 25_000.0),
    "e2e.sample4_warm": E2EJob("total_s", "4 masks, warm compile cache", "fast_sampler.shipped", 15_000.0),
    "e2e.sample4_warm_tuned25": E2EJob("total_s", "4 masks, warm, the tuned 25-call grid", "sampler25.shipped",
                                       10_000.0),
    "e2e.sample32_warm_tuned25": E2EJob("total_s", "32 masks, warm, the tuned 25-call grid: the command's time a "
                                        "volume", "sampler25.shipped", 800.0, per_volume=True),
    "e2e.train_first_step_warm": E2EJob("time_to_first_step_s", "to the first step, warm compile cache",
                                        "train_step.shipped", 20_000.0),
    "e2e.train_steady": E2EJob("ms_per_volume", "a volume in the loop's steady state", "train_step.shipped", 60.0,
                               per_volume=True),
}
# Where a real command's time goes: its row's split (bench.core.e2e), phase by phase in the order they run; a row
# shows the phases its code marked (older rows: the dataset built before the model); an .aot file is read in the first
# call (sampling: the warm-up, where one ran).
SAMPLE_PHASES = (("imports_s", "interpreter, imports, Hydra"), ("cuda_init_s", "CUDA context"),
                 ("checkpoint_s", "checkpoint read, masks' worker started"), ("recipes_s", "recipes built"),
                 ("model_prep_s", "compile cache loaded, recipes applied"),
                 ("warmup_s", "warm-up call on zeros (autotuning, graph capture)"),
                 ("mask_wait_s", "waiting for the first mask"))
TRAIN_PHASES = (("imports_s", "interpreter, imports, Hydra"), ("data_s", "the dataset built, before the model"),
                ("model_s", "recipes built, network and EMA on the device"),
                ("model_prep_s", "compile cache loaded, recipes applied, resumed"),
                ("loop_prep_s", "compile cache loaded, recipes applied, loader started"),
                ("warmup_s", "warm-up passes on zeros (the `.aot` file read, autotuning, graph capture)"),
                ("data_wait_s", "waiting for the dataset built beside them"), ("loader_s", "loader started"),
                ("first_step_s", "the first optimizer step (without a warm-up: the `.aot` file read, autotuning, graph capture "
                                 "too)"))
BRATS = "brats.memory_train_step"
COUNTERS_BASE = "counters.strict_fp32"
COUNTERS = ("counters.tf32_channels_last_3d", "counters.shipped")
SETTLED = ("ok", "unsupported")  # a headline row in either state is there: measured, or the GPU cannot make it
LADDER = "python -m bench.ladder preset=evidence out={folder}"
STUDY = {"label": "study (A100, TF32 + channels-last 3-D)", "sm_cycles": "up to 100x", "inst": "100x",
         "tensor": "1.45-9.98x", "ipc": "+7 %"}
CLAIM_FACTOR = 100.0  # the study's SM-cycle and instruction reduction, drawn as a line on the plot
MIN_TENSOR_PCT = 0.1  # tensor-pipe use (%) under which a baseline gives no ratio
COUNTER_COLUMNS = ("kernel time reduction", "SM cycles reduction", "instruction reduction", "tensor-pipe use",
                   "IPC change")


def sig(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, trailing zeros kept (``10.0``, ``0.982``, ``2411``)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    places = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{places}f}"


def fmt_ms(ms: float | None) -> str:
    """A time given in ms: ``20.02 ms`` under a second, ``2.411 s`` from one; ``""`` for none."""
    if ms is None:
        return ""
    return f"{sig(ms, 4)} ms" if ms < 1000 else f"{sig(ms / 1000, 4)} s"


def fmt_x(ratio: float | None) -> str:
    """A speed-up, ``10.0×``; ``""`` for none."""
    return "" if ratio is None else f"{sig(ratio, 3)}×"


def env_summary(rows: list[dict[str, Any]]) -> str:
    """The environment of the rows; a key whose value differs between rows lists every value
    (a results file merged from several runs must not claim one git commit for all)."""
    envs = [r["env"] for r in rows if r.get("env")]
    keys = ("gpu", "compute_capability", "driver", "cuda", "cudnn", "torch", "monai", "git_sha", "hostname")
    values = {k: list(dict.fromkeys(str(e[k]) for e in envs if e.get(k) is not None)) for k in keys}
    return ", ".join(f"{k} {' / '.join(v)}" for k, v in values.items() if v) or "unknown environment"


def evidence_runs(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """run id -> {job name -> row} for the rows that carry a job name, runs in the order they started (their first
    row in the file). A job measured twice in a run keeps its last ``ok`` row, else its last row."""
    runs: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if not row.get("job_name") or not row.get("run_id"):
            continue
        jobs = runs.setdefault(row["run_id"], {})
        old = jobs.get(row["job_name"])
        if old is None or row.get("status") == "ok" or old.get("status") != "ok":
            jobs[row["job_name"]] = row
    return runs


def missing_headline(jobs: dict[str, dict[str, Any]]) -> list[str]:
    """The headline jobs a run lacks, each with why: ``forward.shipped (no row)``, ``ddpm250.strict_fp32 (oom)``."""
    return [f"{name} ({jobs[name].get('status')})" if name in jobs else f"{name} (no row)"
            for name in HEADLINE if (jobs.get(name) or {}).get("status") not in SETTLED]


@dataclass(frozen=True)
class Run:
    """The rows of one run of one GPU folder, by job name, and where it came from."""

    folder: Path
    run_id: str
    jobs: dict[str, dict[str, Any]]
    why: str = "the newest complete run"
    others: tuple[str, ...] = ()  # the folder's other runs: on no table
    skipped: tuple[str, ...] = ()  # lines of results.jsonl cut short

    @property
    def gpu(self) -> str:
        """The folder's short name as the tables head a column: ``H100`` for bench/results/h100."""
        return self.folder.name.upper()

    @property
    def device(self) -> str:
        """The GPU the rows name (``NVIDIA H100 80GB HBM3``), or the folder's name when none does."""
        return next((r["env"]["gpu"] for r in self.jobs.values() if (r.get("env") or {}).get("gpu")), self.gpu)

    @property
    def commits(self) -> list[str]:
        """Each commit the run's rows record (12 hex digits, ``-dirty`` for a tree that differed), in row order."""
        return list(dict.fromkeys(code_label(r) for r in self.jobs.values()))

    def caption(self) -> str:
        """``run `ID` at commit `abc```: what every table of the run is named by, read from its rows."""
        commits = ", ".join(f"`{c}`" for c in self.commits)
        return f"run `{self.run_id}` at commit{'s' if len(self.commits) > 1 else ''} {commits}"

    def row(self, job: str) -> dict[str, Any] | None:
        return self.jobs.get(job)

    def ok(self, job: str) -> dict[str, Any] | None:
        """The job's row when it measured (status ``ok``), else None."""
        row = self.jobs.get(job)
        return row if row and row.get("status") == "ok" else None

    def ms(self, job: str) -> float | None:
        """The job's median time per call in ms (``ms_median``), None when it has no ``ok`` row."""
        row = self.ok(job)
        return None if row is None or row.get("ms_median") is None else float(row["ms_median"])

    def ms_per_volume(self, job: str) -> float | None:
        """The median time per call over the volumes of a call (a train step of 2 volumes: half the step)."""
        ms, row = self.ms(job), self.ok(job)
        return None if ms is None else ms / int(row.get("batch_size") or 1)

    def speedup(self, job: str, baseline: str) -> float | None:
        """``<workload>.<baseline>``'s time over ``job``'s, both of this run; None where either did not measure."""
        workload = job.split(".")[0]
        base, ms = self.ms(f"{workload}.{baseline}"), self.ms(job)
        return base / ms if base and ms else None

    def e2e_ms(self, job: str) -> float | None:
        """An end-to-end job's figure (:data:`E2E`) in ms, None when it has no ``ok`` row."""
        row, spec = self.ok(job), E2E[job]
        if row is None or row.get(spec.field) is None:
            return None
        ms = float(row[spec.field]) * (1.0 if spec.field.startswith("ms_") else 1000.0)
        return ms / int(row["volumes"]) if spec.per_volume and not spec.field.startswith("ms_") else ms

    def plan(self, job: str) -> str:
        """The stack ``compile=auto`` chose for a sampling job (:mod:`med_ddpm.sample_plan`), ``""`` without one."""
        plan = (self.ok(job) or {}).get("plan") or {}
        if not plan:
            return ""
        when = NOW if plan.get("sidecar") is True else plan.get("sidecar")  # true: a row that started it with the job
        return plan["stack"] + (f", {SIDECAR_SAYS[when]}" if when in SIDECAR_SAYS else "")

    def variant(self, job: str) -> str:
        """`` (`fast_train_fp16`)`` when the GPU ran the job as its experiment's fp16 variant (the ladder's ``variant``
        field: this GPU refuses the job's own stack), else ``""``."""
        name = (self.jobs.get(job) or {}).get("variant")
        return f" (`{name}`)" if name else ""

    def status(self, job: str) -> str:
        """The job's status (``ok``, ``unsupported``, ``oom``, ...), or ``no row``."""
        return str((self.jobs.get(job) or {}).get("status") or "no row")

    def status_note(self, job: str) -> str:
        """What a table says for a job without an ``ok`` row: ``no row``, or its status and the first line of its
        message (an ``unsupported`` row's reason)."""
        row = self.jobs.get(job)
        if row is None:
            return "no row"
        why = (row.get("reason") or row.get("message") or "").strip().splitlines()
        return f"{row.get('status')}: {why[0][:160].replace('|', '/')}" if why else str(row.get("status"))


def choose_run(folder: Path, wanted: Collection[str] = ()) -> Run:
    """The run of ``folder`` that its pages show: the one of ``wanted`` it holds, else its newest complete run.
    Refused (one line naming the folder and what is missing) when there is none, or the named one lacks a headline
    row."""
    rows, skipped = read_results(folder)
    path, fix = folder / RESULTS_FILE, LADDER.format(folder=folder)
    runs = evidence_runs(rows)
    if not runs:
        raise DataError(f"{path}: no evidence rows (rows with a job_name); write them with {fix}")
    named = [r for r in wanted if r in runs]
    if len(named) > 1:
        raise ConfigError(f"run={','.join(named)}: {len(named)} runs of {folder}; name one run per folder")
    if named:
        pick, why = named[0], "named by run="
    else:
        complete = [r for r, jobs in runs.items() if not missing_headline(jobs)]
        pick, why = (complete[-1], "the newest complete run") if complete else (list(runs)[-1], "the newest run")
    gaps = missing_headline(runs[pick])
    if gaps:
        complete = [r for r, jobs in runs.items() if r != pick and not missing_headline(jobs)]
        alternatives = f", or pass run= one of the complete runs {', '.join(complete)}" if complete else ""
        raise DataError(f"{path}: run {pick} ({why}) lacks headline rows {', '.join(gaps)}; finish it: rerun "
                        f"{fix}{alternatives}")
    return Run(folder, pick, runs[pick], why, tuple(r for r in runs if r != pick), tuple(skipped))


def runs_note(run: Run) -> str:
    """Which run the tables use and why, and the folder's runs they leave out (printed, and on the page)."""
    note = f"{run.caption()}, {run.why}"
    if run.others:
        note += f"; not shown: the folder's other run{'s' if len(run.others) > 1 else ''} " + ", ".join(run.others)
    return note




def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def compare(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    """The study's four quantities (and kernel time) of ``row`` against the strict-FP32 ``base``."""
    a, b = row["counters"]["overall"], base["counters"]["overall"]
    ipc = _ratio(a["ipc"], b["ipc"])
    return {"time": _ratio(b["duration_ns"], a["duration_ns"]), "sm_cycles": _ratio(b["sm_cycles"], a["sm_cycles"]),
            "inst": _ratio(b["inst_executed"], a["inst_executed"]),
            "tensor": _ratio(a["tensor_pipe_pct"], b["tensor_pipe_pct"]) if (b["tensor_pipe_pct"] or 0) >= MIN_TENSOR_PCT
            else None, "tensor_pct": a["tensor_pipe_pct"],
            "ipc": None if ipc is None else ipc - 1}


def counter_cells(base: dict[str, Any] | None, row: dict[str, Any] | None) -> list[str]:
    """A counters row's factors against the strict-FP32 row (:func:`compare`), as :data:`COUNTER_COLUMNS` cells."""
    if base is None or row is None:
        return [""] * len(COUNTER_COLUMNS)
    c = compare(row, base)
    pct = "" if c["tensor_pct"] is None else f"{c['tensor_pct']:.2f} %"
    tensor = f"{fmt_x(c['tensor'])} ({pct})" if c["tensor"] is not None else pct
    ipc = "" if c["ipc"] is None else f"{c['ipc']:+.1%}"
    return [fmt_x(c["time"]), fmt_x(c["sm_cycles"]), fmt_x(c["inst"]), tensor, ipc]


def study_line() -> str:
    return f"| {STUDY['label']} | | {STUDY['sm_cycles']} | {STUDY['inst']} | {STUDY['tensor']} | {STUDY['ipc']} |"
