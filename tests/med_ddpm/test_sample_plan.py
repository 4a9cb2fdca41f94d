"""``compile=auto``: the cost model's choices, its record of measured costs, the switch to a sidecar's compile, and
the sidecar's process (a kill leaves no cache entry)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from med_ddpm import compile_sidecar, sample_plan
from med_ddpm.compile_cache import CompileCache
from med_ddpm.config_checks import ConfigError
from med_ddpm.sample_plan import DEFAULTS, Facts, Known, plan_job, switch_pays

VOLUME = 128 ** 3


def facts(cache: str = "cold", masks: int = 4, calls: int = 100, **changes) -> Facts:
    return sample_plan.facts_from(sample_plan.known_facts(None, VOLUME), cache, masks * calls,
                                  changes.pop("compiles", True), changes.pop("compiling", False))


@pytest.mark.parametrize(("mode", "cache", "masks", "calls", "stack", "sidecar"), [
    ("auto", "cold", 4, 100, "eager", "after"),  # a minute of compiling to save about 1.5 s a mask, after the job
    ("auto", "cold", 24, 100, "eager", "now"),  # the job switches to the compile for its last masks
    ("auto", "cold", 64, 100, "compiled", ""),  # 64 masks repay the compile within the job
    ("auto", "warm", 8, 100, "compiled", ""),  # the load repays over 800 calls
    ("auto", "warm", 4, 100, "compiled", ""),  # the load repays over 400 calls, against a fresh machine's eager call
    ("auto", "warm", 1, 25, "eager", ""),  # 25 calls do not repay the load, even against that first call
    ("auto", "off", 4, 100, "eager", ""),  # no cache to warm for the next job: no sidecar
    ("always", "cold", 1, 25, "compiled", ""),
    ("never", "warm", 64, 100, "eager", ""),
])
def test_the_plan_takes_the_cheaper_stack_and_compiles_for_the_next_job_only_on_a_cold_cache(
        mode, cache, masks, calls, stack, sidecar):
    plan = plan_job(mode, facts(cache, masks, calls))
    assert (plan.stack, plan.sidecar) == (stack, sidecar), plan.line()
    assert "\n" not in plan.line() and plan.line().startswith(f"plan: {stack}")


def test_the_eager_first_call_is_priced_and_a_cheap_one_makes_a_short_warm_job_eager(tmp_path):
    path = tmp_path / "k.plan.json"
    sample_plan.record(path, eager_first_s=0.5, eager_call_s=0.03)
    quick = sample_plan.facts_from(sample_plan.known_facts(path, VOLUME), "warm", 25, True, False)
    plan = plan_job("auto", quick)
    assert plan.stack == "eager" and plan.eager_s == pytest.approx(0.5 + 25 * 0.03)
    assert "first call 0.5 s [measured] + 0.03 s [measured] a call" in plan.line()


def test_the_plan_starts_no_second_compile_and_compiles_nothing_without_a_compile_recipe():
    assert (plan_job("auto", facts(compiling=True)).stack, plan_job("auto", facts(compiling=True)).sidecar) == (
        "eager", "")
    assert plan_job("always", facts(compiles=False)).stack == "eager"


def test_the_log_line_says_which_figures_are_guesses():
    line = plan_job("auto", facts("cold")).line()
    assert "[row]" in line and "[guess]" not in line  # the 128^3 rows time both stacks
    other = sample_plan.facts_from(sample_plan.known_facts(None, VOLUME // 8), "cold", 400, True, False)
    assert "[guess]" in plan_job("auto", other).line()  # another size: the per-call times scaled


def test_the_record_is_what_timings_json_carries():
    record = plan_job("auto", facts("cold")).record()
    assert record["stack"] == "eager" and record["sidecar"] == "after" and record["eager_s"] < record["compiled_s"]
    assert record["facts"]["eager_call_s"] == {"s": DEFAULTS["eager_call_s"].s, "source": "row"}


def test_switching_pays_only_while_the_calls_left_repay_the_load():
    f = facts("cold")
    per_call = f.eager_call_s.s - f.compiled_call_s.s
    calls = int(f.load_s.s / per_call)
    assert switch_pays(f, calls + 1) and not switch_pays(f, calls)


def test_a_sidecar_starts_with_the_job_only_if_its_compile_ends_while_switching_still_pays():
    f = facts("cold")
    made = math.ceil((f.compile_s.s - f.eager_first_s.s) / f.eager_call_s.s)  # eager calls while it compiles
    repaid = int(f.load_s.s / (f.eager_call_s.s - f.compiled_call_s.s))  # calls left that repay the load
    assert sample_plan.sidecar_start(replace(f, calls=made + repaid + 1)) == sample_plan.NOW
    assert sample_plan.sidecar_start(replace(f, calls=made + repaid)) == sample_plan.AFTER
    slow = replace(f, compile_s=Known(1e4, "measured"))  # a compile no job of these calls outlasts
    assert sample_plan.sidecar_start(replace(slow, calls=made + repaid + 1)) == sample_plan.AFTER


def test_the_job_starts_its_sidecar_when_the_plan_says(tmp_path, monkeypatch):
    from med_ddpm.sample import start_sidecar

    started = []
    monkeypatch.setattr(compile_sidecar, "start", lambda spec, cache: started.append(spec) or FakeSidecar(False))
    job = job_with(tmp_path, sample_plan.Plan("eager", sample_plan.AFTER, "test"))
    job.cfg = OmegaConf.create({"checkpoint": "c.pt", "weights": "ema", "recipe": {"compile": {}}, "num_samples": 1,
                                "paths": {"compile_cache": str(tmp_path)}})
    start_sidecar(job, sample_plan.NOW)
    assert not started and job.sidecar is None  # not with the job
    start_sidecar(job, sample_plan.AFTER)
    assert [s["size"] for s in started] == [[8, 8, 8]] and job.sidecar is not None


def test_an_unknown_compile_mode_is_one_line():
    with pytest.raises(ConfigError, match=r"^compile='sometimes': unknown value; pass one of auto, always, never$"):
        sample_plan.check_mode("sometimes")


def test_measured_costs_replace_the_defaults_and_other_sizes_are_guesses(tmp_path):
    path = tmp_path / "k.plan.json"
    sample_plan.record(path, eager_call_s=0.03, compiled_call_s=None, bogus=1.0)
    sample_plan.record(path, compile_s=12.0)
    known = sample_plan.known_facts(path, VOLUME)
    assert known["eager_call_s"] == Known(0.03, "measured") and known["compile_s"] == Known(12.0, "measured")
    assert known["compiled_call_s"] == DEFAULTS["compiled_call_s"]
    half = sample_plan.known_facts(None, VOLUME // 2)["compiled_call_s"]
    assert half == Known(DEFAULTS["compiled_call_s"].s / 2, "guess")
    assert sample_plan.known_facts(None, None)["compiled_call_s"].source == "guess"  # each mask at its own size
    path.write_text("{torn")
    assert sample_plan.known_facts(path, VOLUME) == sample_plan.known_facts(None, VOLUME)


# ------------------------------------------------------------------------------------------------ the wiring
class FakeSidecar:
    def __init__(self, ready: bool, running: bool = False) -> None:
        self._ready, self._running = ready, running

    def ready(self) -> bool:
        return self._ready

    def running(self) -> bool:
        return self._running


def job_with(tmp_path: Path, plan: sample_plan.Plan, sidecar=None, calls: int = 400, net=None):
    """A job of a stack with a recipe that pays eagerly, one that does not and a compile recipe."""
    from med_ddpm.cli import CONFIG_DIR
    from med_ddpm.sample import SamplingJob
    from optim import RecipeStack

    recipes = OmegaConf.merge(*(OmegaConf.load(CONFIG_DIR / "recipe" / f"{n}.yaml") for n in (
        "cudnn_benchmark", "channels_last_3d", "compile")))
    stack = RecipeStack.from_config(recipes)
    cache = CompileCache(tmp_path, "sample", {"k": 1})
    loaded = type("Loaded", (), {"model": net})()
    return SamplingJob(OmegaConf.create({}), torch.device("cpu"), loaded, None, stack, ("whole_head", [8, 8, 8], ""),
                       tmp_path, cache, iter(()), plan, facts("cold", 1, calls), sidecar)


def test_an_eager_plan_runs_the_stack_s_eager_form_and_a_compiled_one_the_whole_stack(tmp_path):
    eager = job_with(tmp_path, plan_job("auto", facts("cold")))
    assert eager.running.names == [] and not eager.running.session_flags().get("cudnn.benchmark")
    whole = job_with(tmp_path, plan_job("always", facts())).running
    assert whole.names == ["cudnn_benchmark", "channels_last_3d", "compile"]


def test_the_cache_is_reported_as_the_job_found_it_whether_or_not_it_loaded_it(tmp_path):
    from med_ddpm.sample import cache_found

    eager, compiled = (job_with(tmp_path, sample_plan.Plan(stack, "", "test")) for stack in ("eager", "compiled"))
    eager.facts = compiled.facts = facts("warm")
    assert cache_found(eager) == "warm"  # warm, and left unloaded
    assert cache_found(compiled) == "cold"  # what its load found: no file in tmp_path


def test_the_job_switches_to_the_whole_stack_once_the_sidecar_s_compile_is_ready_and_only_if_it_pays(tmp_path):
    """The eager form prepares a copy (a recipe may change the network it prepares in place); the switch prepares
    the loaded network with the whole stack, inside its session."""
    from med_ddpm.sample import network_for, switched

    plan = sample_plan.Plan("eager", sample_plan.NOW, "test")
    with contextlib.ExitStack() as sessions:
        assert switched(job_with(tmp_path, plan, FakeSidecar(False), 1000), sessions, 0) is None  # still compiling
        assert switched(job_with(tmp_path, plan, FakeSidecar(True), 1000), sessions, 900) is None  # too few left
    net = torch.nn.Conv3d(2, 4, 3)
    job = job_with(tmp_path, plan, FakeSidecar(True), 1000, net=net)
    eager = network_for(job)
    assert eager is not net and not net.weight.is_contiguous(memory_format=torch.channels_last_3d)
    with contextlib.ExitStack() as sessions:
        compiled = switched(job, sessions, 0)
        assert torch.backends.cudnn.benchmark  # the whole stack's session
        assert compiled is net and net.weight.is_contiguous(memory_format=torch.channels_last_3d)
        assert job.running is job.stack and job.sidecar is None
    assert not torch.backends.cudnn.benchmark  # both sessions closed


@pytest.mark.parametrize(("stack", "sidecar", "alone", "recorded"), [
    ("eager", None, [True, True, True], {"eager_call_s": 0.375, "eager_first_s": 2.0}),  # median 1.5 s / 4
    ("eager", "running", [True, False, True], {"eager_call_s": 0.25}),  # the masks beside the compile are not
    ("eager", "running", [False, False, False], {}),  # one beside the compile times the compile's load too
    ("compiled", None, [True, True, True], {"compiled_call_s": 0.375, "compile_s": 2.0}),
])
def test_the_job_keeps_only_what_it_measured_without_a_compile_beside_it(tmp_path, stack, sidecar, alone, recorded):
    from med_ddpm.run_clock import RunClock
    from med_ddpm.sample import record_costs

    started = FakeSidecar(False, running=True) if sidecar else None
    plan = sample_plan.Plan(stack, sample_plan.NOW if sidecar else "", "test")
    job = job_with(tmp_path, plan, started, calls=4)
    clock = RunClock("sample")
    clock.set(recipes_ready_s=0.5, model_ready_s=1.0, warmed_up_s=2.5)  # prepared in 0.5 s, called in 1.5 s
    record_costs(job, clock, [9.0, 2.0, 1.0], alone, 4)
    kept = sample_plan.known_facts(job.cache.plan_path, VOLUME)
    assert {k: v.s for k, v in kept.items() if v.source == "measured"} == recorded


@pytest.mark.parametrize(("stack", "device", "warms"), [
    ("eager", "cpu", False), ("compiled", "cpu", True), ("eager", "cuda", True), ("compiled", "cuda", True)])
def test_the_first_call_runs_on_zeros_beside_the_first_mask_s_read_where_it_is_slow(tmp_path, monkeypatch, stack,
                                                                                     device, warms):
    """On a GPU any stack's first call loads kernels and autotunes: it warms up while the first mask is read."""
    from med_ddpm.sample import warm_up

    calls = []
    monkeypatch.setattr(compile_sidecar, "first_call_on_zeros", lambda *args: calls.append(args))
    job = job_with(tmp_path, sample_plan.Plan(stack, "", "test"))
    job.device = torch.device(device)
    job.loaded, job.cfg = type("Loaded", (), {"model": None})(), OmegaConf.create({"num_samples": 1})
    assert warm_up(job, torch.nn.Identity()) is warms and len(calls) == warms


STANDIN = """
import json, sys, time
from pathlib import Path
from med_ddpm.utils import atomic_write
spec = json.loads(Path(sys.argv[1]).read_text())
def slow(f):
    f.write(b"half")
    Path(spec["started"]).write_text("writing")
    time.sleep(60)
    f.write(b"the rest")
atomic_write(spec["target"], slow)
"""


@pytest.mark.e2e
def test_a_sidecar_killed_while_it_writes_leaves_no_cache_entry_and_no_live_marker(tmp_path, monkeypatch):
    """The stand-in writes the cache file as the sidecar does (a temporary file renamed at the end), started and
    marked by the same :func:`compile_sidecar.start`; SIGKILL half-way leaves no file where the next job looks."""
    (tmp_path / "standin_sidecar.py").write_text(STANDIN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    cache = CompileCache(tmp_path / "cache", "sample", {"k": 1})
    cache.root.mkdir()
    started = tmp_path / "started"
    sidecar = compile_sidecar.start({"target": str(cache.path), "started": str(started)}, cache,
                                    module="standin_sidecar")
    assert compile_sidecar.compiling(compile_sidecar.marker(cache))
    deadline = time.monotonic() + 120
    while not started.exists() and sidecar.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), (tmp_path / "cache").joinpath(cache.path.stem + ".sidecar.log").read_text()
    os.kill(sidecar.proc.pid, signal.SIGKILL)
    sidecar.proc.wait()
    assert not cache.path.exists() and not sidecar.ready()
    assert not compile_sidecar.compiling(compile_sidecar.marker(cache))  # its pid is gone: a new job may compile


@pytest.mark.slow
@pytest.mark.e2e
def test_a_small_job_on_a_cold_cache_samples_eagerly_and_its_sidecar_then_fills_the_cache(tmp_path):
    """The sampling command with ``compile=auto`` and the ``compile`` recipe (CPU inductor: slow) on a tiny model: it
    samples without compiling, says so in timings.json, and its sidecar, started when sampling ends, saves the file a
    later job's cache names, records its compile seconds beside the job's eager ones and removes its marker."""
    import json
    import subprocess

    from test_train import cfg_for

    from med_ddpm.checkpoint import save_checkpoint
    from med_ddpm.cli import CONFIG_DIR
    from med_ddpm.compile_cache import sample_workload
    from med_ddpm.model import build_model
    from optim import RecipeStack

    trained = OmegaConf.to_container(cfg_for("train", tmp_path / "run"), resolve=True)  # the 8^3 test model
    model_cfg = trained["model"]
    net = build_model(model_cfg)
    save_checkpoint(tmp_path / "m.pt", model_state=net.state_dict(), ema_state=net.state_dict(), step=0,
                    config={k: trained[k] for k in ("model", "diffusion", "data")})
    cache_root = tmp_path / "cache"
    subprocess.run([sys.executable, "-m", "med_ddpm.sample", f"checkpoint={tmp_path / 'm.pt'}", "recipe=[compile]",
                    "compile=auto", f"paths.compile_cache={cache_root}", "sampler=ddim", "sampler.steps=2",
                    "device=cpu", "progress=false", f"output_dir={tmp_path / 'out'}"], check=True, timeout=900)
    plan = json.loads((tmp_path / "out" / "timings.json").read_text())["plan"]
    assert plan["stack"] == "eager" and plan["sidecar"] == "after" and "compiling does not pay" in plan["reason"]
    size = list(model_cfg["image_size"])
    recipe = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "recipe" / "compile.yaml"), resolve=True)
    cache = CompileCache.for_run(cache_root, "sample", RecipeStack.from_config(recipe),
                                 torch.device("cpu"), sample_workload(net.config, 1, size))
    deadline = time.monotonic() + 900
    while compile_sidecar.compiling(compile_sidecar.marker(cache)) and time.monotonic() < deadline:
        time.sleep(1)
    log = cache.path.with_suffix(".sidecar.log")
    assert cache.path.exists() and not compile_sidecar.marker(cache).exists(), log.read_text()
    known = sample_plan.known_facts(cache.plan_path, 1)
    assert json.loads((tmp_path / "out" / "timings.json").read_text())["masks_beside_compile"] == 0  # started after
    assert known["compile_s"].source == known["eager_call_s"].source == "measured"
    assert "eager form's first call" in log.read_text()  # the sidecar, started after sampling, timed it for the next job


def test_the_sidecar_s_spec_is_what_the_job_s_cache_key_is_built_from():
    spec = compile_sidecar.spec_of(Path("c.pt"), "ema", {"compile": {}}, 2, [8, 8, 8], torch.device("cpu"), "/c")
    assert spec == {"checkpoint": "c.pt", "weights": "ema", "recipe": {"compile": {}}, "num_samples": 2,
                    "size": [8, 8, 8], "device": "cpu", "cache_root": "/c", "time_eager": False}


def test_the_sidecar_times_the_eager_form_s_first_call_on_a_copy_in_its_own_session():
    """What the next job pays eagerly, measured in the sidecar's fresh process: the eager form only (no cuDNN
    autotuning left on after it), the network as loaded."""
    from med_ddpm.cli import CONFIG_DIR
    from optim import RecipeStack

    recipes = OmegaConf.merge(*(OmegaConf.load(CONFIG_DIR / "recipe" / f"{n}.yaml") for n in (
        "cudnn_benchmark", "channels_last_3d", "compile")))
    net = EpsNet()
    seconds = compile_sidecar.eager_first_s(RecipeStack.from_config(recipes), net, 1, [8, 8, 8], torch.device("cpu"))
    assert seconds > 0 and EpsNet.benchmark_seen == [False] and not torch.backends.cudnn.benchmark
    assert not net.conv.weight.is_contiguous(memory_format=torch.channels_last_3d)  # the loaded network untouched


class EpsNet(torch.nn.Module):
    """An ε-network of 1 image and 2 mask channels, noting cuDNN's autotuning flag at each call."""

    in_channels, out_channels, benchmark_seen = 3, 1, []

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        EpsNet.benchmark_seen.append(torch.backends.cudnn.benchmark)
        return self.conv(x)
