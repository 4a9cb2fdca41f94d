"""``preset=evidence``: every row of one GPU's evidence, one run id, one commit, resumable (``make bench``).

The jobs are data, ``configs/ladder/preset/evidence.yaml``: each names its rows (``job_name``) and is a step-worker
job (``overrides``, :mod:`bench.worker`), a real command from process start (``e2e``, :mod:`bench.core.e2e`) or an Nsight
Compute job (``counters``, :mod:`bench.counters`). Every row lands in ``<out>/results.jsonl``.

- **One run.** A results folder whose evidence rows were written by this commit is continued under their run id, so
  rerunning the same command after a cut adds the missing rows to the same run; rows of another commit start a new
  run (their rows stay, each labelled with its commit and run).
- **Resumable.** A job whose rows are in the run is skipped. The time budget stops *starting* jobs; at the end the
  runner names the rows still missing and prints the command that finishes them.
- **No repeated warm-ups.** Step jobs naming one ``process`` are measured in one worker process (one start-up, one
  model, one compilation); jobs naming one ``cache`` share ``<out>/cache/<cache>``, the compile cache of that stack.
- **Any GPU.** :mod:`bench.gpu_fit` decides per job: as it is, as its experiment's fp16 variant, or an
  ``unsupported`` row with the reason (bf16 or TF32 below compute capability 8.0, too little memory).

The e2e commands need a whole-head data folder and a checkpoint; unless ``e2e.data_root`` and ``e2e.checkpoint`` are
given, the runner writes a phantom at the model's size and a seeded random-weight checkpoint into ``<out>/inputs``
(a volume's time does not depend on the weights' values).

Example:
    python -m bench.ladder preset=evidence out=bench/results/h100
    python -m bench.ladder preset=evidence dry_run=true gpu.name='Tesla V100-SXM2-16GB' 'gpu.capability=[7,0]' gpu.memory_gib=15.8
"""

from __future__ import annotations

import functools
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra import compose
from omegaconf import DictConfig, OmegaConf, open_dict

from bench.core import bytecode, e2e, presets
from bench.core.gpu_fit import Fit, Gpu, fit
from bench.core.presets import PRESET_DIR
from bench.core.records import RESULTS_FILE, RUN_ID_ENV, append_row, provenance, read_rows
from bench.core.runner import compose_job, job_spec, log_row, picked
from bench.core.worker import base_row, cut_by_budget, run_job
from med_ddpm import cli
from med_ddpm.checkpoint import save_checkpoint
from med_ddpm.config_checks import ConfigError
from med_ddpm.data.phantoms import write_phantom_niftis
from med_ddpm.model import build_model
from med_ddpm.utils import env_info
from optim import RecipeStack

KINDS = ("overrides", "e2e", "counters")
KEYS = {"name", "process", "cache", "needs_gib", "estimate_s", "slice", "note", *KINDS}


@dataclass(frozen=True)
class Job:
    """One entry of an evidence preset: the rows it writes and how it measures them."""

    names: tuple[str, ...]
    kind: str  # one of KINDS
    args: tuple[str, ...]
    process: str | None = None
    cache: str | None = None
    needs_gib: float | None = None
    estimate_s: float = 0.0
    slice: int = 1  # the device call it runs in (``slice=N``): each slice fits one ten-minute call
    note: str | None = None  # said in each of its rows (``note``): what the row measures beyond its name

    @property
    def label(self) -> str:
        return " + ".join(self.names)

    def command(self) -> str:
        return " ".join(self.args)


def load(preset: str, ladder: DictConfig | dict[str, Any] | None = None) -> tuple[list[Job], float | None]:
    """The jobs of ``configs/ladder/preset/<preset>.yaml`` (:func:`bench.core.presets.load`, with the ladder's
    options) and its default budget; a malformed entry is refused with one line naming the file and the entry."""
    path = PRESET_DIR / f"{preset}.yaml"
    node = OmegaConf.to_container(presets.load(preset, ladder or {}), resolve=True)
    jobs = []
    for n, entry in enumerate(node.get("jobs") or []):
        kinds = [k for k in KINDS if k in entry]
        unknown = sorted(set(entry) - KEYS)
        if len(kinds) != 1 or unknown or "name" not in entry:
            raise ConfigError(f"{path}: jobs[{n}] needs a name and exactly one of {', '.join(KINDS)}"
                              + (f"; unknown keys {unknown}" if unknown else ""))
        names = entry["name"] if isinstance(entry["name"], list) else [entry["name"]]
        jobs.append(Job(tuple(names), kinds[0], tuple(str(a) for a in entry[kinds[0]]), entry.get("process"),
                        entry.get("cache"), entry.get("needs_gib"), float(entry.get("estimate_s", 0)),
                        int(entry.get("slice", 1)), entry.get("note")))
    all_names = [name for job in jobs for name in job.names]
    if len(set(all_names)) != len(all_names):
        raise ConfigError(f"{path}: two jobs write a row of one name; each job_name is one row of the run")
    return jobs, node.get("budget_s")


# ---------------------------------------------------------------------------- composing a job
def _compose(config: str, overrides: Sequence[str], hydra: bool = False) -> DictConfig:
    with cli.configs():
        return compose(config, overrides=[*overrides, "output_dir=."], return_hydra_config=hydra)


def step_spec(args: Sequence[str], job_dir: Path, cache: Path | None) -> dict[str, Any]:
    """The worker's job for a step job, its compile cache the run's ``cache``."""
    return compose_job([*args, *([f"bench.compile_cache={cache / 'compile'}"] if cache else [])], job_dir)


def counters_spec(args: Sequence[str], out: Path, cache: Path | None) -> dict[str, Any]:
    extra = [f"bench.compile_cache={cache / 'compile'}"] if cache else []
    cfg = _compose("counters", [*args, *extra, f"counters.out={out}"], hydra=True)
    choices = cfg.hydra.runtime.choices
    with open_dict(cfg):
        del cfg["hydra"]
    return {**job_spec(cfg, choices.get("model") or "model"), "experiment": choices.get("experiment")}


def stack_of(job: Job) -> Callable[[Sequence[str]], RecipeStack]:
    """The recipe stack of ``job`` run with other arguments (an fp16 variant's), from the config it composes."""
    return functools.partial(_stack, job.kind)


@functools.lru_cache(maxsize=256)
def _stack(kind: str, args: tuple[str, ...]) -> RecipeStack:
    if kind == "e2e":
        own, overrides = e2e.split_job(args)
        name = "sample" if own["scenario"] == "e2e_sample" else "train"
        cfg = _compose(name, [*overrides, *(["checkpoint=x.pt"] if name == "sample" else [])])
    else:
        cfg = _compose("bench" if kind == "overrides" else "counters", args)
    return RecipeStack.from_config(cfg.get("recipe"))


# ---------------------------------------------------------------------------- the run
def evidence_rows(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_rows(out) if r.get("job_name")] if (out / RESULTS_FILE).exists() else []


def continue_run(out: Path) -> str | None:
    """Continue the latest evidence run in ``out`` when this clean commit wrote it: its run id becomes this
    launch's (``$MED_DDPM_RUN_ID``), unless the command was started inside a run already. Returns the run id."""
    if os.environ.get(RUN_ID_ENV):
        return os.environ[RUN_ID_ENV]
    rows = evidence_rows(out)
    code = provenance()
    if rows and rows[-1].get("git_sha") == code["git_sha"] and not rows[-1].get("dirty") and not code["dirty"]:
        os.environ[RUN_ID_ENV] = rows[-1]["run_id"]
        return rows[-1]["run_id"]
    return None


def done_names(out: Path, run: str | None) -> set[str]:
    return {r["job_name"] for r in evidence_rows(out) if run and r.get("run_id") == run}


def finish_command(argv: Sequence[str]) -> str:
    """The command that was run (and finishes a cut run: it continues the run in its ``out``)."""
    return "python -m bench.ladder " + " ".join(shlex.quote(a) for a in argv)


def run(cfg: DictConfig, argv: Sequence[str] | None = None) -> int:
    """Run (or with ``dry_run`` list) the evidence jobs ``cfg.preset`` names into ``cfg.out``; return the rows left."""
    jobs, preset_budget = load(cfg.preset, cfg)
    slices = sorted({job.slice for job in jobs})
    if cfg.only:  # a regex over a job's names and arguments
        texts = [[*job.names, *job.args] for job in jobs]
        kept = {id(text) for text in picked(texts, cfg.only, cfg.preset)}
        jobs = [job for job, text in zip(jobs, texts, strict=True) if id(text) in kept]
    if cfg.get("slice") is not None:  # one device call's share of the preset
        jobs = [job for job in jobs if job.slice == int(cfg.slice)]
    budget = cfg.budget_s if cfg.budget_s is not None else preset_budget
    budget_s = math.inf if budget is None else float(budget)
    out = Path(cfg.out)
    gpu = Gpu.detect(OmegaConf.to_container(cfg.gpu))
    if gpu is not None and (note := gpu.peak_note()):
        print(note)
    run_id = continue_run(out) if not cfg.dry_run else None
    if not cfg.dry_run and provenance()["dirty"]:
        print("note: the tree differs from its commit: the rows are marked dirty, and a rerun starts a new run")
    done = done_names(out, run_id)
    todo = [(job, fit(job.args, stack_of(job), gpu, job.needs_gib)) for job in jobs
            if not set(job.names) <= done]
    if cfg.dry_run:
        return list_jobs(todo, gpu, budget_s)
    runner = Runner(out, cfg, time.monotonic(), budget_s, bytecode.prepare(out))
    for job, chosen in todo:
        runner.measure(job, chosen, todo)
    missing = [name for job in jobs for name in job.names if name not in done_names(out, os.environ.get(RUN_ID_ENV))]
    if missing:
        print(f"evidence: {len(missing)} row(s) missing from run {os.environ.get(RUN_ID_ENV)}: {', '.join(missing)}")
        print(f"finish them (the same command continues the run): {finish_command(argv or sys.argv[1:])}")
    else:
        print(f"evidence: every row of run {os.environ[RUN_ID_ENV]} is in {out / RESULTS_FILE}")
        later = [n for n in slices if cfg.get("slice") is not None and n > int(cfg.slice)]
        if later:
            print(f"evidence: slice {cfg.slice} done; next, in another device call: slice={later[0]}")
    return len(missing)


def list_jobs(todo: list[tuple[Job, Fit]], gpu: Gpu | None, budget_s: float) -> int:
    """A dry run: each job still to run with its estimate, or the reason this GPU cannot make its rows."""
    for job, chosen in todo:
        if chosen.reason:
            print(f"[unsupported] {job.label}: {chosen.reason}")
        else:
            variant = f" (fp16 variant {chosen.variant})" if chosen.variant else ""
            print(f"[todo] {job.label} ~{job.estimate_s:g} s, slice {job.slice}{variant}: {' '.join(chosen.overrides)}")
    total = sum(job.estimate_s for job, chosen in todo if not chosen.reason)
    where = f"on {gpu.name}" if gpu else "here (no GPU to ask: every job listed as it is)"
    print(f"evidence: {len(todo)} job(s) to run {where}, about {total:g} s on an H100 (the preset's estimates); "
          f"budget {budget_s:g} s")
    return len(todo)


def cut(job: Job, budget_ended: bool) -> bool:
    """``budget_ended``, said: the run's budget, not the job's own limit, ended ``job``, so it has no row (a rerun
    measures it)."""
    if budget_ended:
        print(f"[cut] {job.label}: the time budget ran out; rerun to measure it")
    return budget_ended


class Runner:
    """Measures the jobs of one launch in order, within the budget; groups step jobs by process."""

    def __init__(self, out: Path, cfg: DictConfig, start: float, budget_s: float,
                 bytecode: dict[str, Any] | None = None) -> None:
        self.out, self.cfg, self.start, self.budget_s, self.bytecode = out, cfg, start, budget_s, bytecode
        self.launch = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())  # this launch of the run (a rerun is another)
        self.ran: set[str] = set()
        self._inputs: dict[str, str] | None = None

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def cache(self, job: Job) -> Path | None:
        return self.out / "cache" / job.cache if job.cache else None

    def triton_env(self, job: Job) -> dict[str, str]:
        """Triton's kernel cache inside the job's compile cache, for the processes that compile its stack."""
        return {"TRITON_CACHE_DIR": str(self.cache(job) / "triton")} if job.cache else {}

    def append(self, job: Job, row: dict[str, Any], chosen: Fit, name: str | None = None) -> None:
        """One row per name of ``job`` (one measurement), each with its ``job_name``, the variant run, its launch and
        the launch's seconds so far (``launch_s``: the ladder's own time between jobs included)."""
        launch = {"launch": self.launch, "launch_s": round(time.monotonic() - self.start, 1)}
        for row_name in [name] if name else job.names:
            append_row(self.out / RESULTS_FILE, {**row, "job_name": row_name, "variant": chosen.variant or None,
                                                 "bytecode": self.bytecode, "note": job.note, "slice": job.slice,
                                                 **launch})
        self.ran.update([name] if name else job.names)

    def measure(self, job: Job, chosen: Fit, todo: list[tuple[Job, Fit]]) -> None:
        if set(job.names) <= self.ran:
            return
        if chosen.reason:
            self.append(job, self.unsupported(job, chosen), chosen)
            print(f"[unsupported] {job.label}: {chosen.reason}")
            return
        if self.left_s() <= 0:
            print(f"[todo] {job.label}: the time budget ran out")
            return
        began = time.monotonic()
        if job.kind == "overrides":
            ran = self.step(job, chosen, todo)
        else:
            (self.command if job.kind == "e2e" else self.counters)(job, chosen)
            ran = [job]
        estimate = sum(j.estimate_s for j in ran)
        print(f"[done] {' + '.join(j.label for j in ran)}: {time.monotonic() - began:.0f} s (estimate {estimate:g} s)")

    def unsupported(self, job: Job, chosen: Fit) -> dict[str, Any]:
        """The row of a job this GPU cannot make: its identity where the job names one, the reason, the env."""
        if job.kind == "e2e":
            identity = {"scenario": e2e.split_job(chosen.overrides)[0]["scenario"], "e2e": " ".join(chosen.overrides)}
        elif job.kind == "overrides":
            identity = base_row(step_spec(chosen.overrides, self.out / "jobs" / job.names[0], None))
        else:
            identity = base_row(counters_spec(chosen.overrides, self.out / "counters", None))
        return {**identity, "status": "unsupported", "message": chosen.reason, "env": env_info()}

    def step(self, job: Job, chosen: Fit, todo: list[tuple[Job, Fit]]) -> list[Job]:
        """The job, or with a ``process`` every job of it still to run that the GPU can make, in one worker; returns
        the jobs run."""
        group = [(j, f) for j, f in todo if j is job or (job.process and j.process == job.process and not f.reason
                                                          and not set(j.names) <= self.ran)]
        folder = self.out / "jobs" / (job.process or job.names[0])
        specs = [step_spec(f.overrides, folder / j.names[0], self.cache(j)) for j, f in group]
        env = self.triton_env(job)
        full = max(float(spec["config"]["bench"]["timeout_s"]) for spec in specs)
        timeout = min(full, self.left_s())
        rows = run_job(specs, folder, timeout, env)
        for (member, fitted), row in zip(group, rows, strict=True):
            if cut(member, cut_by_budget(row, timeout, full, self.budget_s)):
                continue
            log_row(row)
            self.append(member, row, fitted)
        return [member for member, _ in group]

    def inputs(self) -> dict[str, str]:
        """The e2e commands' data folder, masks and checkpoint: the ``e2e.*`` given, else written once here."""
        if self._inputs is None:
            given = self.cfg.e2e
            data = given.data_root or str(write_phantom_data(self.out / "inputs" / "whole_head"))
            checkpoint = given.checkpoint or str(write_random_checkpoint(self.out / "inputs" / "random_weights.pt"))
            self._inputs = {"data_root": data, "checkpoint": checkpoint,
                            "masks_dir": given.masks_dir or str(Path(data) / "mask")}
        return self._inputs

    def command(self, job: Job, chosen: Fit) -> None:
        args = {"out": str(self.out), **self.inputs()}
        timeout = min(e2e.JOB_LIMIT_S, self.left_s())
        row = e2e.run_job(chosen.overrides, args, self.out / "jobs" / job.names[0], timeout, self.cache(job))
        if cut(job, row["message"].startswith("timed out") and timeout < e2e.JOB_LIMIT_S):
            return
        print(json.dumps({k: row.get(k) for k in ("e2e", "status", "total_s", "time_to_first_step_s",
                                                   "ms_per_volume")}))
        self.append(job, row, chosen)

    def counters(self, job: Job, chosen: Fit) -> None:
        from bench import counters

        folder = self.out / "counters"
        folder.mkdir(parents=True, exist_ok=True)
        spec = counters_spec(chosen.overrides, folder, self.cache(job))
        own_limit = float(spec["config"]["counters"]["timeout_s"])
        timeout = min(own_limit, self.left_s())
        env = self.triton_env(job)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            row = counters.measure(spec, folder, timeout)
        finally:
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
        if cut(job, row["message"].startswith(counters.KILLED) and timeout < own_limit):
            return
        self.append(job, row, chosen)


def write_phantom_data(folder: Path, model: str = "medddpm_whole_head") -> Path:
    """One whole-head phantom (image and mask) at ``model``'s size, written once."""
    if not (folder / "mask").is_dir():
        write_phantom_niftis(folder, 1, list(_compose("train", [f"model={model}"]).model.image_size))
    return folder


def write_random_checkpoint(path: Path, model: str = "medddpm_whole_head") -> Path:
    """``model`` with seeded random weights in this project's checkpoint format, trained (as it says) on whole-head
    data at its size, written once."""
    if not path.exists():
        cfg = OmegaConf.to_container(_compose("train", [f"model={model}", "data=whole_head"]), resolve=True)
        torch.manual_seed(0)
        state = build_model(cfg["model"]).state_dict()
        save_checkpoint(path, model_state=state, ema_state=state, step=0,
                        config={k: cfg[k] for k in ("model", "diffusion", "data")})
    return path
