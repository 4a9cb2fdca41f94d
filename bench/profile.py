"""Kernel-level runtime breakdown of one scenario under one recipe stack (``make profile``).

Example:
    python -m bench.profile 'recipe=[amp_bf16]' bench=train_step
    python -m bench.profile -m 'recipe=[],[tf32],[amp_bf16]' bench=denoise_step   # one bar per stack
    python -m bench.profile 'recipe=[amp_bf16]' profile.ncu=true                  # + Nsight Compute
    python -m bench.profile 'profile.compare={before: a/denoise_step_fp32.json, after: b/denoise_step_fp32.json}' \
        profile.out=results/compare                                             # saved profiles side by side

Runs the real step (:func:`bench.core.scenarios.prepared_step`) for ``profile.warmup`` untimed and
``profile.steps`` profiled calls under ``torch.profiler`` and attributes the time to kernel
categories (:mod:`bench.core.kernels`): on CUDA the GPU time of every kernel and memcpy/memset, on
CPU each operator call's self time; the top kernels' calls are counted per step on both. Writes into
``profile.out`` (Hydra's run and sweep dir follow it; unset: ``output_dir``, else ``results/bench/<time>``): ``<label>.json`` per
stack (with the network's config, the batch and the network calls per step, which ``bench.floor``
counts, and the launch's ``run_id``, commit ``git_sha``/``dirty`` and ``env``), then ``profile.md`` and
``profile_breakdown.png`` rebuilt from every JSON there, so a multirun gets one table and one
stacked bar per stack, and a line saying whether they come from one run and on which commits and GPUs.
Profiling runs in this process (multirun jobs share it; the stacks' sessions restore their flags and
compile caches): use ``bench.sweep`` for timings of record.

``profile.compare={NAME: PROFILE.json, ...}`` profiles nothing: it puts saved profiles side by side
under the given names (one stack profiled at two commits has one label), with the change from the
first to the last, in ``profile_compare.md`` and ``profile_compare.png``. The page names each profile's
commit, GPU and run (``not recorded`` for profiles written before bench.profile recorded them) and says
when they come from separate runs: their differences are then not same-run comparisons.

``profile.ncu=true`` re-runs the job under ``ncu --clock-control none`` (one warm-up and one
profiled call, the top kernels only) and adds IPC, tensor-pipe utilisation, achieved occupancy,
DRAM throughput and an instruction-pipe mix per kernel, parsed from ncu's CSV.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from bench.core import kernels, ncu
from bench.core.records import UNKNOWN, code_label, provenance, recipe_label, run_id
from bench.core.runner import job_spec
from bench.core.scenarios import batch_size, model_calls, prepared_step
from bench.sweep import sweep_dir_of
from med_ddpm import cli
from med_ddpm.config_checks import ConfigError
from med_ddpm.run_clock import synchronize
from med_ddpm.tracking import refuse_wandb
from med_ddpm.utils import atomic_write_text, env_info, resolve_device

SLUG_MAX = 160  # file names: 255 bytes at most, and atomic_write adds a dot, a random part and .json.tmp
COMPARE_FIX = "pass profile.compare={NAME: PROFILE.json, NAME2: PROFILE2.json}"


def _launchers(prof: torch.profiler.profile) -> dict[str, str]:
    """Kernel name -> the operator and input shapes that launched it most often.

    Says which layer a kernel serves: a name such as ``cutlass_80_simt_sgemm`` alone does not
    tell which matmul runs in fp32 under autocast. Inductor launches each Triton kernel inside a
    profiler range of the kernel's own name, so for those the entry is that name and its shapes.
    """
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            for k in e.kernels:
                seen[k.name][f"{e.name} {e.input_shapes}" if e.input_shapes else e.name] += 1
    return {name: c.most_common(1)[0][0] for name, c in seen.items()}


def _is_annotation(event: Any) -> bool:
    """A ``record_function`` range mirrored onto the GPU timeline (inductor's ``## Call
    CompiledFxGraph ... ##``): it spans kernels that are also listed, so counting it would count the
    step's GPU time twice."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("## ")


def _gpu_events(prof: torch.profiler.profile) -> list[Any]:
    """Every GPU kernel/memcpy/memset the profiler saw (CUDA-graph replays included), annotations left out."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not _is_annotation(e)]


def _cpu_events(prof: torch.profiler.profile) -> list[tuple[str, float]]:
    """(name, µs) of every operator call's self CPU time: the breakdown on a CPU, where there are no kernels.

    One pair per call, as :func:`_gpu_events` gives one per kernel launch, so that :func:`bench.core.kernels.aggregate`
    counts the calls (``key_averages()`` has one entry per name: every count would read 1)."""
    return [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]


def profile_step(cfg: dict[str, Any], device: torch.device) -> tuple[list[tuple[str, float]], dict[str, str],
                                                                     dict[str, float] | None]:
    """Warm up, then record ``profile.steps`` calls of the scenario's step: the events, per GPU
    kernel its launching operator, and (on CUDA) the steps' GPU timeline (:func:`bench.core.kernels.timeline`)."""
    p = cfg["profile"]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with prepared_step(cfg, device) as (step, _stack):
        for _ in range(int(p["warmup"])):
            step()
        synchronize(device)
        with torch.profiler.profile(activities=activities, record_shapes=device.type == "cuda") as prof:
            for _ in range(int(p["steps"])):
                step()
            synchronize(device)
    if device.type != "cuda":
        return _cpu_events(prof), {}, None
    gpu = _gpu_events(prof)  # (name, µs) of every kernel/memcpy, and their spans for the timeline
    events = [(e.name, e.time_range.elapsed_us()) for e in gpu]
    spans = [(e.time_range.start, e.time_range.end) for e in gpu]
    return events, _launchers(prof), kernels.timeline(spans, int(p["steps"]))


def summarise(events: list[tuple[str, float]], job: dict[str, Any], device: torch.device,
              launchers: dict[str, str] | None = None, timeline: dict[str, float] | None = None) -> dict:
    """The JSON record of one profiled stack: what ran (the network's config, the batch and the network
    calls per step), per-category ms/step, top kernels (with their launching operator where known),
    Tensor-Core share, the GPU timeline where there is one, and where it ran: this launch's ``run_id``, the
    commit (``git_sha``, ``dirty``: :func:`bench.core.records.provenance`) and the environment (``env``)."""
    cfg = job["config"]
    steps = int(cfg["profile"]["steps"])
    times, counts = kernels.aggregate(events)
    top = kernels.top_kernels(times, counts, int(cfg["profile"]["top"]))
    for k in top:
        k["launched_by"] = (launchers or {}).get(k["name"], "")
    return {
        "label": profile_label(job), "scenario": cfg["bench"]["scenario"], "batch_size": batch_size(cfg),
        "model": cfg["model"], "model_calls": model_calls(cfg),
        "activity": "GPU kernels" if device.type == "cuda" else "CPU operator self time",
        "steps": steps,
        "categories_ms": {k: v / 1e3 / steps for k, v in kernels.breakdown(times).items()},
        "total_ms": sum(times.values()) / 1e3 / steps,
        "tensor_core_share": kernels.tensor_core_share(times),
        "top": top,
        "timeline": timeline,
        "run_id": run_id(), **provenance(), "env": env_info(device),
    }


def profile_label(job: dict[str, Any]) -> str:
    """The stack's label (``fp32`` for none), with the batch size when it is not 1: profiles of one
    stack at two batch sizes are two columns of profile.md and two JSON files."""
    label = recipe_label(job, baseline="fp32")
    batch = batch_size(job["config"])
    return label if batch == 1 else f"{label} (batch {batch})"


def slug(record: dict) -> str:
    """``<scenario>_<label>`` with every character a file name should not hold replaced by ``_``; a label too long
    for a file name (255 bytes, the atomic write's temp prefix included) keeps its head and a hash of the whole."""
    name = re.sub(r"[^A-Za-z0-9_+-]+", "_", f"{record['scenario']}_{record['label']}").strip("_")
    return name if len(name) <= SLUG_MAX else f"{name[:SLUG_MAX - 13]}_{hashlib.sha1(name.encode()).hexdigest()[:12]}"


def write_outputs(out: Path, record: dict) -> Path:
    """Write ``<label>.json`` and rebuild profile.md + profile_breakdown.png from all JSONs in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{slug(record)}.json", json.dumps(record, indent=1))
    profiles = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    profiles = [p for p in profiles if "categories_ms" in p]
    kernels.stacked_bar_png(profiles, out / "profile_breakdown.png")
    text = kernels.markdown(profiles) + "".join(ncu_markdown(p) for p in profiles if p.get("ncu"))
    text += "\n" + provenance_note(profiles)
    return atomic_write_text(out / "profile.md", text + "\n![breakdown](profile_breakdown.png)\n")


def compare_problem(named: Any) -> str | None:
    """What is wrong with a ``profile.compare`` value (None: two or more names, each naming a file)."""
    if not isinstance(named, dict):
        return f"{named!r} is a {type(named).__name__}, not NAME: PROFILE.json entries"
    if len(named) < 2:
        return f"{named!r} names {len(named)} profile, and a comparison needs two or more"
    bad = [name for name, path in named.items() if not isinstance(path, str)]
    return f"{bad[0]}: {named[bad[0]]!r} is not a file name" if bad else None


def load_named(named: Any) -> list[dict]:
    """Saved profiles, each relabelled with its name (its recipes kept as ``stack``); a value that is not two or
    more named files, or a file that is not a profile, is a :class:`~med_ddpm.config_checks.ConfigError` naming it."""
    problem = compare_problem(named)
    if problem:
        raise ConfigError(f"profile.compare: {problem}; {COMPARE_FIX}")
    profiles = []
    for name, path in named.items():
        record = kernels.load_profile(Path(path), f"profile.compare.{name}")
        profiles.append({**record, "label": name, "stack": record["label"], "file": str(path)})
    return profiles


def commit_of(profile: dict) -> str | None:
    """The profile's commit (``-dirty`` when the tree differed), or None: not recorded (older profiles) or unknown."""
    label = code_label(profile) if "git_sha" in profile else UNKNOWN
    return None if label == UNKNOWN else label


def gpu_of(profile: dict) -> str | None:
    """The GPU the profile ran on (``no GPU (device cpu)`` on a CPU), or None: not recorded (older profiles)."""
    env = profile.get("env")
    return None if env is None else env.get("gpu") or f"no GPU (device {env.get('device')})"


def same_run(profiles: list[dict]) -> str | None:
    """The run id all ``profiles`` share, or None: they come from separate runs (or did not record theirs)."""
    runs = {p.get("run_id") for p in profiles}
    return runs.pop() if len(runs) == 1 else None


def agreement(what: str, values: dict[str, str | None]) -> str:
    """One sentence on ``what`` (per profile label): which profiles did not record it, the one value all share, or
    that they differ."""
    missing = [label for label, v in values.items() if v is None]
    distinct = set(values.values())
    if missing:
        return f"{what[0].upper()}{what[1:]} not recorded for {', '.join(missing)}."
    if len(distinct) == 1:
        return f"Same {what} for all: {distinct.pop()}."
    return f"{what[0].upper()}{what[1:]}s differ: " + ", ".join(f"{label} {v}" for label, v in values.items()) + "."


def provenance_note(profiles: list[dict]) -> str:
    """Whether the profiles come from one run, and their commits and GPUs: differences between profiles of separate
    runs are not same-run comparisons."""
    run = same_run(profiles)
    unrecorded = " (or did not record theirs)" if any("run_id" not in p for p in profiles) else ""
    runs = (f"All profiles come from one run ({run})." if run else
            f"The profiles come from separate runs{unrecorded}: differences between them are between separately "
            "profiled launches, not same-run comparisons.")
    commits = agreement("commit", {p["label"]: commit_of(p) for p in profiles})
    gpus = agreement("GPU", {p["label"]: gpu_of(p) for p in profiles})
    return f"Provenance: {runs} {commits} {gpus}\n"


def change_table(profiles: list[dict]) -> str:
    """Per category: ms/step of the first and last profile and the difference (last - first), the heading saying
    when the two come from separate runs."""
    first, last = profiles[0], profiles[-1]
    separate = "" if same_run([first, last]) else " (separate runs, not a same-run comparison)"
    lines = [f"## Change from {first['label']} to {last['label']}{separate}", "",
             "| category | first ms | last ms | change ms |", "|---|---|---|---|"]
    for cat in kernels.CATEGORY_NAMES:
        a, b = first["categories_ms"][cat], last["categories_ms"][cat]
        lines.append(f"| {cat} | {a:.3f} | {b:.3f} | {b - a:+.3f} |")
    a, b = first["total_ms"], last["total_ms"]
    lines.append(f"| **total** | **{a:.3f}** | **{b:.3f}** | **{b - a:+.3f}** |")
    return "\n".join(lines) + "\n"


def write_comparison(out: Path, profiles: list[dict]) -> Path:
    """``profile_compare.md`` (categories, top kernels, legend with each profile's commit and GPU, provenance,
    change) and ``profile_compare.png``."""
    legend = "".join(f"- **{p['label']}**: `{p['stack']}`, {p['scenario']}, batch {p['batch_size']}, commit "
                     f"{commit_of(p) or 'not recorded'}, {gpu_of(p) or 'GPU not recorded'}, run "
                     f"{p.get('run_id') or 'not recorded'} (`{p['file']}`)\n" for p in profiles)
    text = (kernels.markdown(profiles) + "\nProfiles:\n" + legend + "\n" + provenance_note(profiles) + "\n"
            + change_table(profiles)
            + "\n![breakdown](profile_compare.png)\n")
    out.mkdir(parents=True, exist_ok=True)
    kernels.stacked_bar_png(profiles, out / "profile_compare.png")
    return atomic_write_text(out / "profile_compare.md", text)


# ---------------------------------------------------------------------------- Nsight Compute
def ncu_kernel_regex(top: list[dict], k: int) -> str:
    """An ncu ``--kernel-name regex:`` matching the first identifier of the top ``k`` kernels."""
    heads = []
    for kern in top[:k]:
        m = re.search(r"[A-Za-z_][A-Za-z0-9_]*", kern["name"].split("<")[0].split("(")[0].split("::")[-1])
        if m and m.group(0) not in heads:
            heads.append(re.escape(m.group(0)))
    return "|".join(heads) or ".*"


def run_ncu(cfg: dict[str, Any], record: dict, out: Path) -> list[dict[str, str | float | None]]:
    """Profile the top kernels under ncu in a short subprocess run of the same job (:mod:`bench.core.ncu` runs it
    and reads its raw page: values in ns and plain counts)."""
    p = cfg["profile"]
    job = json.loads(json.dumps({"config": cfg, "model": record["label"], "recipes": []}))
    job["config"]["bench"].update(warmup=1, iters=1, quality=False)
    job_path = out / f"ncu_job_{slug(record)}.json"
    atomic_write_text(job_path, json.dumps(job))
    cmd = [ncu.find_ncu() or ncu.DEFAULT_NCU, "--clock-control", "none", "--target-processes", "all", "--csv",
           "--page", "raw", "--metrics", ",".join(p["ncu_metrics"]),
           "--kernel-name", f"regex:{ncu_kernel_regex(record['top'], int(p['ncu_kernels']))}",
           "--launch-count", str(int(p["ncu_launches"])),
           sys.executable, "-m", "bench.core.worker", str(job_path), str(out / f"ncu_row_{slug(record)}.json")]
    run = ncu.run(cmd, timeout_s=float(p["ncu_timeout_s"]), log_path=out / f"ncu_{slug(record)}.log")
    if run.returncode is None:
        raise TimeoutError(f"ncu ran past profile.ncu_timeout_s={p['ncu_timeout_s']}")
    return ncu.parse_raw(run.log)[0]


def ncu_markdown(record: dict) -> str:
    rows = record["ncu"]
    if isinstance(rows, str):
        return f"\n## Nsight Compute: {record['label']}\n\n{rows}\n"
    metrics = [k for k in rows[0] if k not in ("ID", "Kernel Name")] if rows else []
    metrics = [m for m in metrics if "__" in m]
    lines = ["", f"## Nsight Compute: {record['label']}", "",
             "| kernel | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for r in rows:
        name = kernels.short_name(r.get("Kernel Name", ""), 60).replace("|", "\\|")
        lines.append(f"| `{name}` | " + " | ".join("" if r.get(m) is None else f"{r[m]:.4g}" for m in metrics) + " |")
    return "\n".join(lines) + "\n"


@hydra.main(config_path=cli.CONFIG_PATH, config_name="bench", version_base="1.3")
@cli.entry
def main(cfg: DictConfig) -> None:
    refuse_wandb(cfg.logger, "bench.profile", "profile.json and the markdown are its record")
    hc = HydraConfig.get()
    job = job_spec(cfg, hc.runtime.choices.get("model") or "model")
    config = job["config"]
    out = Path(OmegaConf.select(cfg, "profile.out", throw_on_missing=False) or sweep_dir_of(hc))
    if config["profile"]["compare"]:
        print(write_comparison(out, load_named(config["profile"]["compare"])))
        return
    device = resolve_device(config["device"])
    events, launchers, timeline = profile_step(config, device)
    record = summarise(events, job, device, launchers, timeline)
    if config["profile"]["ncu"]:
        try:
            record["ncu"] = run_ncu(config, record, out)
        except (OSError, ValueError) as err:  # no ncu, a timeout (TimeoutError), or no CSV table
            record["ncu"] = f"ncu failed: {type(err).__name__}: {err}"
    print(write_outputs(out, record))


console = cli.console(main)  # the med-ddpm-profile command


if __name__ == "__main__":
    console()
