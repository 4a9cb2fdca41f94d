"""End-to-end scenarios: a user's command, timed from process start, with the real CLIs.

The step benchmarks (``bench.sweep``, ``bench.ladder``) time one warmed-up step. A user pays more: Python
and library imports, CUDA initialisation, loading data or a checkpoint, compilation and cuDNN autotuning,
writing NIfTI files, waiting for data. Each job here runs ``python -m med_ddpm.sample`` or
``python -m med_ddpm.train`` in a fresh process, as a user would, reads the ``timings.json`` the command
writes (:mod:`med_ddpm.run_clock`) and appends one row to ``<out>/results.jsonl``.

Example (the jobs of ``configs/ladder/preset/e2e.yaml``; ``only=REGEX`` picks some):
    python -m bench.ladder preset=e2e out=results/e2e e2e.data_root=DATA e2e.checkpoint=CKPT
    python -m bench.ladder preset=e2e out=results/e2e e2e.data_root=DATA only=e2e_train

A job is a list of strings: ``scenario=e2e_sample|e2e_train``, ``compile_cache=cold|warm``, for sampling
``masks=N`` and ``grid=PATH`` (the sampler of a ``med_ddpm.tune`` sampler.yaml, :func:`grid_overrides`), then the
command's own Hydra overrides. ``cold`` empties the job's compile-cache folder
(``paths.compile_cache``, inductor's and Triton's caches) first; ``warm`` runs the same command once
beforehand if that folder has no compile artifacts yet (untimed). Sampling gets N masks by cycling the files
of ``masks_dir`` (default ``<data_root>/mask``); training uses ``data_root``, and BraTS jobs phantom cases
written at the model size unless ``brats_root`` is given. ``<out>/e2e.md`` tabulates the rows (``bench.report`` rewrites it, and points report.md to it). Resumable: a job whose row is in results.jsonl is
skipped; ``budget_s`` stops starting jobs once spent, and a job it cuts short leaves no row.

Row fields beyond the common ones (:mod:`bench.core.records`), all seconds unless named otherwise:

=====================  ===================================================================================
e2e                    the job, as its strings joined by spaces (its identity)
compile_cache          ``cold`` | ``warm`` | ``off`` (no compiled recipe)
total_s                spawn to exit, measured here
startup_s              process start to the loop's start (imports, CUDA init, checkpoint or data, cache load)
imports_s, cuda_init_s  of which: to the command's first line (interpreter, imports, Hydra); CUDA context
checkpoint_s, ...      sampling: checkpoint_s, recipes_s, model_prep_s (cache load, recipes applied); training:
                       model_s, model_prep_s, data_wait_s (the dataset, built in another process since the start,
                       waited for), loader_s; data_build_s: that build's own seconds (docs/end-to-end.md: the marks)
warmup_s               a compiled stack's warm-up on zeros (loading or compiling, cuDNN autotuning, CUDA-graph capture):
                       sampling's one call while the masks' worker reads the first mask, training's passes while the
                       dataset builds
mask_wait_s            sampling: the model ready (and warmed up) to the first mask in hand
first_volume_s         sampling: the model ready to the first mask done (the warm-up and the wait included)
per_volume_s           sampling: every later mask, amortised (mask loading and queued writes included)
compile_s              the warm-up's seconds plus the first step's (sampling: the first mask's) excess over the steady
                       state
write_busy_s           sampling: the background writer's time; write_exposed_s: what sampling waited for it
first_step_s           training: the first optimizer step; time_to_first_step_s from process start
precompiled            with a compile recipe's ``aot``: ``loaded``, ``saved`` or ``lazy`` (:mod:`optim.precompile`);
                       precompile_s: the seconds its file took to load, or to build and save (not in torch_compile_s)
ms_per_volume          training: steady state; data_wait_pct: share of it the loop waited for batches
peak_mem_gib           ``max_memory_allocated``; peak_reserved_gib: the allocator's (what the GPU holds)
plan                   sampling: what ``compile=`` chose and why (:mod:`med_ddpm.sample_plan`); sidecar_wait_s: what the
                       job waited after the command for the compile it left running (:func:`wait_for_sidecars`);
                       plan_recipes: the recipes the plan's stack ran (an eager plan: the stack's eager form)
bytecode               where the commands read bytecode, and whether it was compiled at the run's start
                       (:mod:`bench.core.bytecode`)
import_s               with ``import_times=true``: seconds per package of the command's imports, lazy ones included
                       (:func:`import_seconds`; ``-X importtime`` lengthens the imports, so it is off by default)
=====================  ===================================================================================
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import textwrap
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose

from bench.core import bytecode
from bench.core.records import RESULTS_FILE, append_row, code_label, read_rows
from bench.core.subprocesses import spawn
from bench.core.worker import OOM_PATTERN
from med_ddpm import cli, compile_sidecar
from med_ddpm.config_checks import ConfigError
from med_ddpm.data.phantoms import write_phantom_niftis
from med_ddpm.run_clock import TIMINGS_FILE
from med_ddpm.samplers.tuned import read_tuned
from med_ddpm.utils import atomic_write_text, env_info

E2E_MD = "e2e.md"

JOB_KEYS = ("scenario", "compile_cache", "masks", "grid")
SCENARIOS = ("e2e_sample", "e2e_train")
BRATS_SIZE = (144, 192, 192)  # (D, H, W): the original BraTS model's size
JOB_LIMIT_S = 480.0  # one job's own time limit (its warm-up run and its timed run each)
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| (\s*)(\S+)\s*$")  # self us | cumulative us | name
IMPORT_GROUPS = 8  # packages listed in a row's import_s; the rest are summed as "other"


def split_job(job: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """(the job's own keys, the command's Hydra overrides)."""
    own = {k: v for k, _, v in (s.partition("=") for s in job) if k in JOB_KEYS}
    if own.get("scenario") not in SCENARIOS or own.get("compile_cache") not in ("cold", "warm"):
        raise SystemExit(f"bench.core.e2e: job {list(job)} needs scenario={'|'.join(SCENARIOS)} and compile_cache=cold|warm")
    return own, [s for s in job if s.partition("=")[0] not in JOB_KEYS]


def cycled_masks(source: Path, count: int, folder: Path) -> Path:
    """``folder`` with ``count`` masks, links to the files of ``source`` in turn (mask_000.nii.gz, ...)."""
    files = sorted(p for p in source.iterdir() if p.name.endswith((".nii.gz", ".nii")))
    if not files:
        raise ConfigError(f"bench.core.e2e: {source} has no .nii/.nii.gz masks (set e2e.masks_dir=DIR)")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for i in range(count):
        src = files[i % len(files)].resolve()
        (folder / f"mask_{i:03d}{'.nii.gz' if src.name.endswith('.gz') else '.nii'}").symlink_to(src)
    return folder


def brats_phantoms(folder: Path, cases: int = 2) -> Path:
    """BraTS-layout phantom cases at the model size (crop_or_pad keeps them as they are), written once."""
    if not (folder / f"phantom_{cases - 1:04d}").is_dir():
        write_phantom_niftis(folder, cases, BRATS_SIZE, variant="brats")
    return folder


def command(own: Mapping[str, str], overrides: list[str], args: Mapping[str, str], job_dir: Path) -> list[str]:
    """The user's command line for a job, with its data, output folder and quiet progress."""
    run_dir = job_dir / "run"
    if own["scenario"] == "e2e_sample":
        if "checkpoint" not in args:
            raise ConfigError("e2e.checkpoint: not set, and the sampling jobs load one; pass e2e.checkpoint=PATH (an "
                              "original Med-DDPM checkpoint or this project's)")
        masks = cycled_masks(Path(args.get("masks_dir") or Path(args["data_root"]) / "mask"), int(own.get("masks", 4)),
                             job_dir / "masks")
        grid = grid_overrides(Path(own["grid"])) if own.get("grid") else []
        return ["med_ddpm.sample", f"checkpoint={args['checkpoint']}", f"masks={masks}", *overrides, *grid,
                f"output_dir={run_dir}", "progress=false"]
    root = args["data_root"]
    if "experiment=brats" in overrides:
        root = args.get("brats_root") or brats_phantoms(Path(args["out"]) / "brats_phantoms")
    return ["med_ddpm.train", f"data.root={root}", *overrides, f"output_dir={run_dir}", "train.progress=false"]


def grid_overrides(path: Path) -> list[str]:
    """The sampler of a ``sampler.yaml`` of ``med_ddpm.tune`` (its seal checked, not its checkpoint: a job with
    ``grid=PATH`` times that grid on the job's own weights, whatever they are) as the command's overrides."""
    node = read_tuned(path, option="grid")["sampler"]
    return [f"sampler={node['name']}", *(f"sampler.{key}={json.dumps(value).replace(' ', '')}"
                                          for key, value in node.items() if key != "name")]


def prepare_cache(own: Mapping[str, str], cache_dir: Path, run: Any) -> None:
    """``cold``: an empty cache folder. ``warm``: one untimed run first if the folder has no artifacts."""
    if own["compile_cache"] == "cold":
        shutil.rmtree(cache_dir, ignore_errors=True)
    elif not any((cache_dir / "compile").glob("*.bin")):
        run(timed=False)


def wait_for_sidecars(folder: Path, limit_s: float) -> float | None:
    """Wait (at most ``limit_s``) for a compile the command left running for the next job
    (:mod:`med_ddpm.compile_sidecar`), so that the next job finds its cache and does not share the GPU with it;
    the seconds waited, None when there was none."""
    markers = list(folder.glob(f"*{compile_sidecar.MARKER}")) if folder.is_dir() else []
    if not any(compile_sidecar.compiling(m) for m in markers):
        return None
    start = time.monotonic()
    while any(compile_sidecar.compiling(m) for m in markers) and time.monotonic() - start < limit_s:
        time.sleep(0.5)
    return round(time.monotonic() - start, 2)


def import_seconds(log: str) -> dict[str, float]:
    """Seconds per package of a command's imports, from the ``-X importtime`` lines in its log.

    Each top-level line is one import statement as it ran (at start-up, or later inside a function, as MONAI's),
    its cumulative time including the packages it pulled in first; so the groups add up to all the import time.
    A group is the module's root package, with torch's subpackages apart (``torch._inductor``, ``torch._dynamo``:
    a compiled recipe's imports). An import on another thread may nest under the main thread's and count there;
    the sampling command's mask worker (another process, on the same stderr) adds its own, MONAI's among them.
    """
    totals: dict[str, float] = {}
    for line in log.splitlines():
        found = IMPORT_LINE.match(line)
        if found and not found.group(2):
            parts = found.group(3).split(".")
            group = ".".join(parts[:2]) if parts[0] == "torch" and len(parts) > 1 else parts[0]
            totals[group] = totals.get(group, 0.0) + int(found.group(1)) / 1e6
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    grouped = dict(ranked[:IMPORT_GROUPS])
    if len(ranked) > IMPORT_GROUPS:
        grouped["other"] = sum(seconds for _, seconds in ranked[IMPORT_GROUPS:])
    return {name: round(seconds, 3) for name, seconds in grouped.items()}


def torch_compile_s(t: Mapping[str, Any]) -> float | None:
    """Seconds torch.compile itself took in the command (Dynamo's counter): the part of ``compile_s`` that is
    compiling, the rest being autotuning and graph capture."""
    return (t.get("torch_compile_s") or {}).get("total_wall_time")


def precompiled(t: Mapping[str, Any]) -> dict[str, Any]:
    """What the ahead-of-time compiled forward did (``loaded``, ``saved``, ``lazy``) and the seconds its file took
    to load or to build and save (Dynamo's counters in ``torch_compile_s`` miss ``aot_compile``); both None without
    ``aot``."""
    report = t.get("precompiled") or {}
    return {"precompiled": report.get("status"), "precompile_s": report.get("seconds")}


def gap(t: Mapping[str, Any], start: str, end: str) -> float | None:
    """Seconds between two marks of a timings.json, None where one is missing (a command of older code)."""
    return round(t[end] - t[start], 4) if start in t and end in t else None


def sample_split(t: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling's timings.json -> startup (imports, CUDA, checkpoint, recipes, compile cache and model preparation,
    the warm-up call of a compiled stack, the wait for the first mask) / compile / sampling / writing (seconds)."""
    volumes = t["volume_s"]
    steady = statistics.median(volumes[1:]) if len(volumes) > 1 else None
    later = len(volumes) - 1
    return {
        "imports_s": t["run_start_s"], "cuda_init_s": gap(t, "run_start_s", "device_ready_s"),
        "checkpoint_s": gap(t, "device_ready_s", "checkpoint_ready_s"),
        "recipes_s": gap(t, "checkpoint_ready_s", "recipes_ready_s"),
        "model_prep_s": gap(t, "recipes_ready_s", "model_ready_s"), "warmup_s": gap(t, "model_ready_s", "warmed_up_s"),
        "mask_wait_s": gap(t, "warmed_up_s" if "warmed_up_s" in t else "model_ready_s", "first_mask_ready_s"),
        "startup_s": t["model_ready_s"],
        "first_volume_s": round(t["first_volume_done_s"] - t["model_ready_s"], 4),
        "per_volume_s": round((t["sampling_done_s"] - t["first_volume_done_s"]) / later, 4) if later else None,
        "compile_s": round((gap(t, "model_ready_s", "warmed_up_s") or 0.0) + volumes[0] - steady, 4)
        if steady is not None else None,
        "sampling_s": round(sum(volumes), 4), "volumes": t["volumes"],
        "write_busy_s": t["write_busy_s"], "write_exposed_s": round(t["total_s"] - t["sampling_done_s"] + t["write_wait_s"], 4),
        "torch_compile_s": torch_compile_s(t), **precompiled(t), "plan_recipes": t.get("plan_recipes"),
    }


def train_split(t: Mapping[str, Any]) -> dict[str, Any]:
    """Training's timings.json -> start-up (imports, model and recipes, a compiled stack's warm-up passes, the wait
    for the dataset built beside them, the loop's preparation), first step, steady state, data wait."""
    steady_s = t["ms_per_step"] / 1e3 if t.get("ms_per_step") is not None else None
    return {
        "imports_s": t.get("run_start_s"), "model_s": gap(t, "run_start_s", "model_built_s"),
        "model_prep_s": gap(t, "model_built_s", "model_ready_s"), "warmup_s": gap(t, "model_ready_s", "warmed_up_s"),
        "data_wait_s": gap(t, "warmed_up_s" if "warmed_up_s" in t else "model_ready_s", "data_ready_s"),
        "data_build_s": t.get("data_build_s"), "loader_s": gap(t, "data_ready_s", "loop_start_s"),
        "startup_s": t["loop_start_s"], "first_step_s": t["first_step_s"], "time_to_first_step_s": t["first_step_done_s"],
        "compile_s": round((gap(t, "model_ready_s", "warmed_up_s") or 0.0) + t["first_step_s"] - steady_s, 4)
        if steady_s is not None else None,
        "torch_compile_s": torch_compile_s(t), **precompiled(t),
        **{k: t.get(k) for k in ("ms_per_step", "ms_per_volume", "data_wait_pct", "steady_steps", "peak_mem_gib",
                                 "peak_reserved_gib", "memory_cap_gib")},
    }


def workload(argv: list[str], timings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The common row fields, from the command's composed config (what the CLI itself composes)."""
    name, overrides = argv[0].removeprefix("med_ddpm."), [o for o in argv[1:] if not o.startswith("output_dir=")]
    with cli.configs():
        cfg = compose(name, overrides=[*overrides, "output_dir=."], return_hydra_config=True)
    choices = cfg.hydra.runtime.choices
    training = name == "train"
    return {
        "model": choices.get("model") if training else Path(str(cfg.checkpoint)).name,
        "image_size": list(cfg.model.image_size) if training else (timings or {}).get("image_size"),
        "batch_size": int(cfg.train.batch_size) if training else int(cfg.num_samples),
        "sampler": None if training else str(cfg.sampler.name),
        "steps": None if training else cfg.sampler.get("steps"),
        "recipes": list((timings or {}).get("recipes") or cfg.get("recipe") or []),
        "recipe_options": [],
    }


def run_job(job: Sequence[str], args: Mapping[str, str], job_dir: Path, timeout_s: float,
            cache_dir: Path | None = None) -> dict[str, Any]:
    """Run one job (after its cache preparation) and return its row, whatever happened. ``cache_dir``: the command's
    compile-cache folder (default: one per command under ``args["cache_dir"]``, or ``<out>/cache``)."""
    own, overrides = split_job(job)
    job_dir.mkdir(parents=True, exist_ok=True)
    argv = command(own, overrides, args, job_dir)
    cache_dir = cache_dir or Path(args.get("cache_dir") or Path(args["out"]) / "cache") / own["scenario"] / re.sub(
        r"\W+", "_", " ".join(o for o in overrides if not o.startswith("train.max_steps")))[:120]
    prepare_cache(own, cache_dir, lambda timed: (spawn(argv, cache_dir, job_dir / "prime.log", timeout_s),
                                                 wait_for_sidecars(cache_dir / "compile", timeout_s)))
    shutil.rmtree(job_dir / "run", ignore_errors=True)  # no stale timings.json from the warm-up run
    importtime = args.get("import_times", "").lower() == "true"
    code, wall, tail = spawn(argv, cache_dir, job_dir / "run.log", timeout_s, importtime=importtime)
    sidecar_wait_s = wait_for_sidecars(cache_dir / "compile", timeout_s - wall)
    timings_path = job_dir / "run" / TIMINGS_FILE
    timings = json.loads(timings_path.read_text()) if code == 0 and timings_path.exists() else None
    row = {"scenario": own["scenario"], "e2e": " ".join(job), "status": "ok", "message": "", "wall_s": round(wall, 3),
           "total_s": round(wall, 3), "compile_cache": (timings or {}).get("compile_cache"), "masks": int(own.get("masks", 0)) or None,
           "config": {"argv": argv}, "env": env_info(), **workload(argv, timings),
           "plan": (timings or {}).get("plan"), "sidecar_wait_s": sidecar_wait_s}
    if timings is None:
        why = "timed out" if code is None else f"exit code {code}"
        row.update(status="oom" if OOM_PATTERN.search(tail) else "error", message=f"{why}; log tail:\n{tail}")
        return row
    row.update(sample_split(timings) if own["scenario"] == "e2e_sample" else train_split(timings))
    if importtime:
        row["import_s"] = import_seconds((job_dir / "run.log").read_text(errors="replace"))
    row["exit_s"] = round(wall - timings["total_s"], 4)  # from the command's last mark to the end of its process
    return row


TABLE = (("compile_cache", "cache"), ("precompiled", "aot"), ("total_s", "total s"), ("startup_s", "start-up s"),
         ("warmup_s", "warm-up s"), ("mask_wait_s", "mask wait s"),
         ("first_volume_s", "first mask s"), ("compile_s", "compiling and capture s"), ("torch_compile_s", "torch.compile s"),
         ("precompile_s", "aot file s"),
         ("per_volume_s", "s per later mask"), ("write_exposed_s", "writing shown s"),
         ("time_to_first_step_s", "to first step s"), ("ms_per_volume", "ms per volume"),
         ("data_wait_pct", "data wait %"), ("peak_reserved_gib", "peak reserved GiB"))


def failure(row: Mapping[str, Any]) -> str:
    """``status: why: the log's last line`` (a command's one-line error, or a traceback's exception)."""
    lines = [line.strip() for line in row["message"].splitlines() if line.strip()]
    why = lines[0].removesuffix("; log tail:") if lines else ""
    last = f": {lines[-1]}" if len(lines) > 1 else ""
    return textwrap.shorten(f"{row['status']}: {why}{last}".replace("|", "/"), 240)


def report(rows: list[Mapping[str, Any]]) -> str:
    """A markdown table of the e2e rows (one line each, a failure with its reason and the log's last line), then
    the imports of each row that has them, by package."""
    lines = ["| job | commit | " + " | ".join(title for _, title in TABLE) + " | status |",
             "| --- |" + " --- |" * (len(TABLE) + 2)]
    for row in rows:
        cells = ["" if row.get(key) is None else str(row[key]) for key, _ in TABLE]
        status = row["status"] if row["status"] == "ok" else failure(row)
        lines.append(f"| `{row['e2e']}` | {code_label(row)} | " + " | ".join(cells) + f" | {status} |")
    timed = [row for row in rows if row.get("import_s")]
    if timed:
        lines += ["", "Imports by package, seconds (`python -X importtime`; an import on another thread may count "
                  "under the main thread's):", "", "| job | all | by package |", "| --- | --- | --- |"]
        lines += [f"| `{row['e2e']}` | {sum(row['import_s'].values()):.2f} | "
                  + ", ".join(f"{name} {seconds:.2f}" for name, seconds in row["import_s"].items()) + " |"
                  for row in timed]
    return "\n".join(lines) + "\n"


def write_page(out: Path, rows: list[Mapping[str, Any]]) -> Path | None:
    """``<out>/e2e.md`` from the e2e rows among ``rows`` (:func:`report`); None when there are none."""
    rows = [row for row in rows if row.get("e2e")]
    return atomic_write_text(out / E2E_MD, report(rows)) if rows else None


def done_jobs(out: Path) -> set[str]:
    return {r.get("e2e") for r in read_rows(out)} if (out / RESULTS_FILE).exists() else set()


def run(jobs: Iterator[Sequence[str]], args: Mapping[str, str]) -> int:
    """Run the jobs without a row until ``budget_s`` is spent; returns how many are left."""
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    pyc = bytecode.prepare(out) if float(args.get("budget_s", "inf")) > 0 else None  # a dry run's budget is 0
    budget, start, left, done = float(args.get("budget_s", "inf")), time.monotonic(), 0, done_jobs(out)
    for n, job in enumerate(jobs):
        if " ".join(job) in done or (args.get("only") and not re.search(args["only"], " ".join(job))):
            continue
        remaining = budget - (time.monotonic() - start)
        if remaining <= 0:
            left += 1
            print(f"[todo] {' '.join(job)}")
            continue
        row = run_job(job, args, out / "jobs" / f"e2e_{n:02d}", timeout_s=min(remaining, JOB_LIMIT_S))
        if row["message"].startswith("timed out") and remaining < JOB_LIMIT_S:
            left += 1  # cut by the budget, not its own limit: no row, a rerun measures it
            print(f"[cut] {' '.join(job)}: the time budget ran out; rerun to measure it")
            continue
        append_row(out / RESULTS_FILE, {**row, "bytecode": pyc})
        print(json.dumps({k: row.get(k) for k in ("e2e", "status", "compile_cache", "total_s", "first_volume_s",
                                                   "per_volume_s", "time_to_first_step_s", "ms_per_volume",
                                                   "data_wait_pct")}))
    if (out / RESULTS_FILE).exists():
        write_page(out, read_rows(out))
    print(f"e2e: {left} job(s) left{' (rerun the same command to continue)' if left else ''}")
    return left
