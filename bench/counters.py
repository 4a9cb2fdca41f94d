"""Hardware counters of one scenario step per recipe stack, read with Nsight Compute (``make counters``).

Example:
    python -m bench.counters 'recipe=[tf32,channels_last_3d]' bench=train_step
    python -m bench.counters -m 'recipe=[],[tf32],[channels_last_3d],[tf32,channels_last_3d],[amp_bf16]' \\
        bench=denoise_step 'model.image_size=[64,64,64]'
    python -m bench.counters experiment=fast_train counters.rules=true

The job re-runs itself under ``ncu`` (:func:`bench.core.ncu.profile_command`): the child builds the real
step (:func:`bench.core.scenarios.prepared_step`), makes ``counters.warmup`` calls (cuDNN autotune,
compilation and CUDA-graph capture happen there, unprofiled), then ``counters.steps`` calls inside
the NVTX start/end range ``counters.range``; ncu replays every kernel launched in that range once
per metric pass. The parent reads the report's raw page (and, with ``counters.rules``, its rule
results) and writes into ``counters.out`` (Hydra's run and sweep dir follow it; unset: ``results/counters/<time>``):

* a row in ``counters.jsonl`` (:func:`bench.core.records.append_row`: identity, env, config) whose
  ``counters`` field holds, per step, the totals over all kernels and per kernel category
  (:func:`category`): SM cycles, warp instructions and their mix by pipe, IPC, tensor-pipe use,
  DRAM / L2 throughput, achieved occupancy, the top warp-stall reasons, ncu's rule speedups;
* ``<slug>_kernels.csv``, the same fields per kernel name;
* ``counters.md`` and ``counters_claims.png`` rebuilt from every row there (:mod:`bench.counter_claims`).

Where counters cannot be read (no ncu, no CUDA device, a sandbox such as gVisor that refuses the
profiler) the row has status ``unsupported`` and ncu's own message; no number is made up. A
multirun skips a stack that already has an ``ok`` row there, so an interrupted sweep resumes.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from statistics import median
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from bench import counter_claims
from bench.core import kernels, ncu
from bench.core.records import append_row, job_key, read_rows
from bench.core.runner import job_spec
from bench.core.scenarios import prepared_step
from bench.core.worker import base_row
from bench.counter_claims import ROWS_FILE
from bench.profile import profile_label, slug
from bench.sweep import sweep_dir_of
from med_ddpm import cli
from med_ddpm.config_checks import ConfigError
from med_ddpm.run_clock import synchronize
from med_ddpm.utils import atomic_write_text, env_info, resolve_device
from optim import RecipeStack

KILLED = "ncu run killed after"  # the message of a run its time limit ended
log = logging.getLogger(__name__)
STEP_FLAG = "--profiled-step"  # python -m bench.counters --profiled-step JOB.json: the program ncu runs
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
SUMMED = ("duration_ns", "sm_cycles", "inst_executed", "inst_fma", "inst_alu", "inst_lsu", "inst_hmma", "inst_gmma")
TIME_WEIGHTED = ("tensor_pipe_pct", "hmma_pipe_pct", "dram_pct", "l2_pct", "occupancy_pct")
FIELDS = (*SUMMED, "ipc", *TIME_WEIGHTED)
PIPES = ("tensor", "fma", "alu", "lsu")
CATEGORIES = ("conv fprop", "conv dgrad", "conv wgrad", "conv (direction not named)", "GEMM", "attention",
              "normalisation", "layout conversion", "up/down-sampling", "elementwise", "optimizer", "other")
# direction of a convolution kernel, from cuDNN/CUTLASS names (sm90_xmma_wgrad_..., dgrad2d_alg1,
# conv_depthwise3d_cuda_backward_weight_kernel, ..._fprop_implicit_gemm_...); first match wins
CONV_DIRECTIONS = (("conv wgrad", re.compile(r"wgrad|backward_weight|weight_kernel|bprop_filter|grad_?weight", re.I)),
                   ("conv dgrad", re.compile(r"dgrad|backward_input|input_kernel|bprop_data|grad_?input", re.I)),
                   ("conv fprop", re.compile(r"fprop|fwd|implicit_convolve|conv_depthwise3d_cuda_kernel|"
                                             r"convolve_?[23n]d|forward", re.I)))
OPTIMIZER = re.compile(r"adam|multi_tensor_apply|foreach", re.I)
ATTENTION = re.compile(r"sdpa|fmha|flash|attention|softmax|scaled_dot_product", re.I)
FROM_KERNELS = {"layout conversion": "layout conversion", "memory copies": "layout conversion",
                "elementwise / activation": "elementwise", "normalisation": "normalisation",
                "up/down-sampling": "up/down-sampling"}
_STARTED: list[float] = []  # when the first job of this process began (counters.budget_s)


# ---------------------------------------------------------------------------- kernel categories
def category(name: str) -> str:
    """Kernel category of one (demangled) kernel name: :func:`bench.core.kernels.categorise`, with convolutions
    split by direction, GEMM apart from attention, and the optimizer's kernels apart from elementwise."""
    if OPTIMIZER.search(name) and not kernels.INDUCTOR.search(name):
        return "optimizer"
    base = kernels.categorise(name)
    if base == "convolution":
        return next((cat for cat, rule in CONV_DIRECTIONS if rule.search(name)), "conv (direction not named)")
    if base == "GEMM and attention":
        return "attention" if ATTENTION.search(name) else "GEMM"
    return FROM_KERNELS.get(base, "other")


# ---------------------------------------------------------------------------- aggregation
def launch_values(launch: Mapping[str, Any], metrics: Mapping[str, str | None],
                  stalls: Iterable[str]) -> dict[str, Any]:
    """One profiled launch as row fields: its name and category, each configured field (None where ncu
    had no value or the field is switched off) and its stall reasons (cycles per issued instruction)."""
    name = str(launch.get("Kernel Name", ""))
    values: dict[str, Any] = {"kernel": name, "category": category(name), "id": str(launch.get("ID", ""))}
    values.update({field: launch.get(metric) if metric else None for field, metric in metrics.items()})
    values["stalls"] = {r: launch.get(STALL_METRIC.format(r)) for r in stalls
                        if launch.get(STALL_METRIC.format(r)) is not None}
    return values


def _sum(launches: list[dict], field: str) -> float | None:
    known = [x[field] for x in launches if x.get(field) is not None]
    return sum(known) if known else None


def _weighted(launches: list[dict], field: str, weight: str) -> float | None:
    pairs = [(x[field], x[weight]) for x in launches if x.get(field) is not None and x.get(weight)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def totals(launches: list[dict], steps: int = 1, top_stalls: int = 3) -> dict[str, Any]:
    """Fields of a set of launches, per step: counts summed; percentages weighted by kernel time; IPC as
    all instructions over all active cycles (each launch's inst / ipc); stall reasons weighted by
    instructions (total stall cycles per issued instruction), the ``top_stalls`` largest as [reason, value]
    pairs. A field no launch had is None."""
    out: dict[str, Any] = {"launches": len(launches) / steps}
    for field in SUMMED:
        value = _sum(launches, field)
        out[field] = None if value is None else value / steps
    for field in TIME_WEIGHTED:
        out[field] = _weighted(launches, field, "duration_ns")
    timed = [(x["inst_executed"], x["ipc"]) for x in launches if x.get("inst_executed") and x.get("ipc")]
    out["ipc"] = sum(i for i, _ in timed) / sum(i / ipc for i, ipc in timed) if timed else None
    tensor = [out[f] for f in ("inst_hmma", "inst_gmma") if out[f] is not None]
    out["inst_tensor"] = sum(tensor) if tensor else None
    inst = out["inst_executed"]
    out["pipe_mix"] = {p: out[f"inst_{p}"] / inst for p in PIPES if inst and out[f"inst_{p}"] is not None}
    cycles: dict[str, float] = defaultdict(float)
    counted = sum(x["inst_executed"] for x in launches if x.get("inst_executed") and x["stalls"])
    for x in launches:
        for reason, per_inst in x["stalls"].items():
            cycles[reason] += per_inst * (x.get("inst_executed") or 0)
    ranked = sorted(((r, c) for r, c in cycles.items() if c > 0), key=lambda kv: -kv[1])[:top_stalls]
    out["top_stalls"] = [[r, c / counted] for r, c in ranked]  # a list: the row's JSON sorts dict keys
    return out


def rule_savings(rules: list[dict], launches: list[dict], steps: int, top: int = 8) -> list[dict[str, Any]]:
    """ncu's rule results as priorities: per (rule, speedup type) the kernel time it estimates could be
    saved (speedup % of each launch's duration, summed, ms per step), its share of the step's kernel
    time, how many launches it fired on, and the category where it saves most."""
    by_id = {x["id"]: x for x in launches}
    total_ns = sum(x.get("duration_ns") or 0 for x in launches) or 1.0
    saved: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rules:
        launch = by_id.get(str(r["id"]))
        if r["speedup_pct"] is None or launch is None or not launch.get("duration_ns"):
            continue
        ns = r["speedup_pct"] / 100 * launch["duration_ns"]
        entry = saved.setdefault((r["rule"], r["speedup_type"]), {"ns": 0.0, "launches": 0, "by_cat": defaultdict(float)})
        entry["ns"] += ns
        entry["launches"] += 1
        entry["by_cat"][launch["category"]] += ns
    ranked = sorted(saved.items(), key=lambda kv: -kv[1]["ns"])[:top]
    return [{"rule": rule, "speedup_type": kind, "saved_ms": e["ns"] / 1e6 / steps, "share": e["ns"] / total_ns,
             "launches": e["launches"] / steps, "top_category": max(e["by_cat"], key=e["by_cat"].get)}
            for (rule, kind), e in ranked]


def summarise(launches: list[dict], rules: list[dict] | None, steps: int, top_stalls: int) -> dict[str, Any]:
    """The row's ``counters`` field: totals overall and per category (every category present), and the rule
    savings (None when rules were not collected)."""
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for x in launches:
        by_cat[x["category"]].append(x)
    return {"steps": steps, "overall": totals(launches, steps, top_stalls),
            "categories": {c: totals(by_cat[c], steps, top_stalls) for c in CATEGORIES},
            "rules": None if rules is None else rule_savings(rules, launches, steps)}


def kernel_table(launches: list[dict], top_stalls: int = 1) -> str:
    """CSV of the profiled launches grouped by kernel name (over all profiled steps), longest first."""
    by_name: dict[str, list[dict]] = defaultdict(list)
    for x in launches:
        by_name[x["kernel"]].append(x)
    cols = ["kernel", "category", "launches", *FIELDS, "inst_tensor", "top_stall"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    writer.writeheader()
    rows = [{**totals(group, 1, top_stalls), "kernel": kernels.short_name(name, 200), "category": group[0]["category"]}
            for name, group in by_name.items()]
    for row in sorted(rows, key=lambda r: -(r["duration_ns"] or 0)):
        row["top_stall"] = row["top_stalls"][0][0] if row["top_stalls"] else ""
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return buf.getvalue()


# ---------------------------------------------------------------------------- the profiled program
def profiled_step(job_path: Path) -> int:
    """The program ncu runs: warm up outside the NVTX range, then ``counters.steps`` calls inside it.

    The range is an NVTX start/end (process) range, not a push/pop (thread) range: autograd launches
    the backward's kernels from its own device thread, which a push/pop range on this thread misses.
    """
    cfg = json.loads(job_path.read_text())["config"]
    c = cfg["counters"]
    device = resolve_device(cfg["device"])
    with prepared_step(cfg, device) as (step, _stack):
        for _ in range(int(c["warmup"])):
            step()
        synchronize(device)
        range_id = torch.cuda.nvtx.range_start(c["range"])
        for _ in range(int(c["steps"])):
            step()
        synchronize(device)
        torch.cuda.nvtx.range_end(range_id)
    return 0


# ---------------------------------------------------------------------------- one job
def kernel_regex(c: Mapping[str, Any]) -> str | None:
    """``counters.kernel_filter`` as ncu's regex: the named filter of ``counters.kernel_filters``, else itself."""
    value = c["kernel_filter"]
    return (c.get("kernel_filters") or {}).get(value, value) if value else None


def chosen_metrics(c: Mapping[str, Any]) -> dict[str, str | None]:
    """``counters.metrics`` with the fields ``counters.fields`` leaves out set to null (not collected): fewer
    metrics, fewer replay passes of every kernel."""
    keep = c.get("fields")
    return {field: metric if keep is None or field in keep else None for field, metric in c["metrics"].items()}


def check_options(c: Mapping[str, Any]) -> None:
    """Bad ``counters.*`` values end the command with one line that names the option (SystemExit)."""
    regex = kernel_regex(c)
    try:
        re.compile(regex or "")
    except re.error as err:
        raise ConfigError(f"counters.kernel_filter={c['kernel_filter']}: not a regular expression ({err}); pass a "
                          f"regex on kernel names or one of {', '.join(c.get('kernel_filters') or {}) or 'none'}") from None
    unknown = sorted(set(c["metrics"]) - set(FIELDS))
    if c.get("fields") is not None and (not_metrics := sorted(set(c["fields"]) - set(c["metrics"]))):
        raise ConfigError(f"counters.fields: {not_metrics[0]} is not a field of counters.metrics; use some of "
                          f"{', '.join(c['metrics'])}")
    if unknown:
        raise ConfigError(f"configs/counters.yaml: counters.metrics.{unknown[0]} is not a field this tool aggregates; "
                         f"use one of {', '.join(FIELDS)}")
    if c["replay"] not in ncu.REPLAY_MODES:
        raise ConfigError(f"counters.replay={c['replay']}: must be one of {', '.join(ncu.REPLAY_MODES)}")
    if int(c["steps"]) < 1 or int(c["warmup"]) < 0:
        raise ConfigError(f"counters.steps={c['steps']} / counters.warmup={c['warmup']}: need steps >= 1 and warmup >= 0")


def platform_fields() -> dict[str, Any]:
    """The kernel release (``uname -r``) and whether it is a Firecracker guest's (``-fc-``): Firecracker
    guests expose the GPU's counters, gVisor sandboxes do not."""
    release = os.uname().release
    return {"kernel_release": release, "firecracker": "-fc-" in release}


def refusal(ncu_path: str | None, cfg: Mapping[str, Any], device: torch.device) -> str | None:
    """Why this job cannot be profiled here, before anything runs, or None."""
    c = cfg["counters"]
    if ncu_path is None:
        where = f"counters.ncu={c['ncu']} is not an executable" if c["ncu"] else \
            f"no ncu on PATH nor at {ncu.DEFAULT_NCU}"
        return f"Nsight Compute not found: {where} (install Nsight Compute or set counters.ncu=PATH)"
    if device.type != "cuda":
        return f"hardware counters need a CUDA device; device={cfg['device']} resolved to {device}"
    ok, reason = RecipeStack.from_config(cfg.get("recipe") or {}).supported(device)
    return None if ok else f"recipe stack refused: {reason}"


def outcome(run: ncu.Run, timeout_s: float) -> tuple[str, str] | None:
    """(status, message) of a failed profiling run, in ncu's words; None when it finished."""
    if run.returncode is None:
        return "error", f"{KILLED} {timeout_s:.0f} s (counters.timeout_s / budget_s)"
    reason = ncu.unavailable_reason(run.log)
    if reason:
        return "unsupported", f"ncu cannot read counters on this machine: {reason}"
    if run.returncode != 0:
        errors = ncu.error_lines(run.log)
        return "error", f"ncu exited with code {run.returncode}: " + ("; ".join(errors) or run.log[-1500:])
    return None


def collect(job: dict[str, Any], out: Path, ncu_path: str, timeout_s: float) -> dict[str, Any]:
    """Profile the job under ncu and read the report: the row's status, message and counter fields."""
    cfg = job["config"]
    c = cfg["counters"]
    name = file_slug(job)
    job_path, report = out / f"{name}.job.json", out / f"{name}.ncu-rep"
    atomic_write_text(job_path, json.dumps(job, default=str))
    metrics = [m for m in chosen_metrics(c).values() if m] + [STALL_METRIC.format(r) for r in c["stalls"]]
    cmd = ncu.profile_command(ncu_path, metrics, report, [sys.executable, "-m", "bench.counters", STEP_FLAG,
                                                          str(job_path)],
                              nvtx_range=c["range"], sections=c["sections"] if c["rules"] else (),
                              kernel_filter=kernel_regex(c), max_kernels=c["max_kernels"], replay=c["replay"])
    run = ncu.run(cmd, timeout_s, out / f"{name}.ncu.log")
    passes = ncu.replay_passes(run.log)
    fields: dict[str, Any] = {"ncu_command": cmd, "ncu_wall_s": run.wall_s, "replay": c["replay"],
                              "replay_passes": median(passes) if passes else None}
    failed = outcome(run, timeout_s)
    if failed is None and not report.exists():
        said = ncu.error_lines(run.log) + ncu.error_lines(run.log, "WARNING")
        failed = "error", f"ncu wrote no report {report.name}: {'; '.join(said) or f'see {name}.ncu.log'}"
    if failed:
        return {**fields, "status": failed[0], "message": failed[1]}
    return {**fields, **read_report(ncu_path, report, c, timeout_s)}


def read_report(ncu_path: str, report: Path, c: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
    """The counter fields of an exported report (its raw page, and its rule results with ``counters.rules``);
    writes the kernel table beside it and deletes the report unless ``counters.keep_report``."""
    keep = c["keep_report"]
    raw, _units = ncu.parse_raw(page(ncu_path, report, "raw", timeout_s, keep))
    launches = [launch_values(x, chosen_metrics(c), c["stalls"]) for x in raw]
    if not launches:
        return {"status": "error", "message": f"no kernel launch inside NVTX range {c['range']!r} was profiled "
                f"(kernel_filter={c['kernel_filter']}); see {report.stem}.ncu.log"}
    rules = ncu.parse_rules(page(ncu_path, report, "details", timeout_s, keep)) if c["rules"] else None
    if not keep:
        report.unlink()
    table = report.with_name(f"{report.stem}_kernels.csv")
    atomic_write_text(table, kernel_table(launches))
    return {"status": "ok", "message": "", "kernels_csv": table.name,
            "counters": summarise(launches, rules, int(c["steps"]), int(c["top_stalls"]))}


def page(ncu_path: str, report: Path, kind: str, timeout_s: float, keep: bool) -> str:
    """One CSV page (``raw``, ``details``) of the report, kept as ``<slug>_<kind>.csv`` when ``keep``
    (the source of the test fixtures)."""
    saved = report.with_name(f"{report.stem}_{kind}.csv") if keep else None
    return ncu.run(ncu.import_command(ncu_path, report, kind), timeout_s, saved).log


def file_slug(job: Mapping[str, Any]) -> str:
    """``<scenario>_<stack>_<D>x<H>x<W>``: rows of one stack at two sizes keep two kernel tables."""
    cfg = job["config"]
    size = "x".join(str(s) for s in cfg["model"]["image_size"])
    return slug({"scenario": cfg["bench"]["scenario"], "label": f"{profile_label(job)}_{size}"})


def measure(job: dict[str, Any], out: Path, timeout_s: float) -> dict[str, Any]:
    """The results row of one job: identity and env from the worker's schema, then the counters or the
    reason there are none."""
    cfg = job["config"]
    device = resolve_device(cfg["device"])
    row = {**base_row(job), "experiment": job.get("experiment"), "env": env_info(device), **platform_fields(),
           "counters": None,
           "ncu_version": None, "nvtx_range": cfg["counters"]["range"], "kernel_filter": cfg["counters"]["kernel_filter"]}
    ncu_path = ncu.find_ncu(cfg["counters"]["ncu"])
    reason = refusal(ncu_path, cfg, device)
    if reason:
        return {**row, "status": "unsupported", "message": reason}
    row["ncu_version"] = ncu.version(ncu_path)
    try:
        return {**row, **collect(job, out, ncu_path, timeout_s)}
    except (OSError, ValueError) as err:  # an unreadable report is a row, not a crash of the sweep
        return {**row, "status": "error", "message": f"{type(err).__name__}: {err}"}


def already_measured(out: Path, job: Mapping[str, Any]) -> bool:
    """True when ``out`` has an ``ok`` row for this job (an interrupted multirun resumes)."""
    path = out / ROWS_FILE
    if not path.exists():
        return False
    key = job_key(base_row(job))
    return any(r.get("status") == "ok" and job_key(r) == key for r in read_rows(path))


def time_left(budget_s: float | None) -> float:
    """Seconds of ``counters.budget_s`` left since this process's first job began (inf without a budget)."""
    if not _STARTED:
        _STARTED.append(time.monotonic())
    return float("inf") if budget_s is None else float(budget_s) - (time.monotonic() - _STARTED[0])


@hydra.main(config_path=cli.CONFIG_PATH, config_name="counters", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    job = {**job_spec(cfg, hc.runtime.choices.get("model") or "model"), "experiment": hc.runtime.choices.get("experiment")}
    c = job["config"]["counters"]
    check_options(c)
    out = Path(OmegaConf.select(cfg, "counters.out", throw_on_missing=False) or sweep_dir_of(hc))
    label = f"{job['config']['bench']['scenario']} {profile_label(job)}"
    left = time_left(c["budget_s"])
    if already_measured(out, job):
        log.info("%s: an ok row is already in %s, skipped", label, out / ROWS_FILE)
        return
    if left <= 0:
        log.info("%s: counters.budget_s spent, not profiled (rerun to add it)", label)
        return
    row = measure(job, out, min(float(c["timeout_s"]), left))
    append_row(out / ROWS_FILE, row)
    log.info("%s -> %s %s", label, row["status"], row["message"].splitlines()[0] if row["message"] else "")
    print(counter_claims.write(out))


if __name__ == "__main__":
    if sys.argv[1:2] == [STEP_FLAG]:
        sys.exit(profiled_step(Path(sys.argv[2])))
    cli.run(main)
