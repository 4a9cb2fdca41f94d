"""timings.json: marks from process start, the first step apart from the steady state, the data-wait share."""

from __future__ import annotations

import json
import time

import pytest
import torch

from med_ddpm.run_clock import LoopTimer, RunClock, TimedIterator, compile_phases, process_start_time


def slow_batches(wait_s: float):
    while True:
        time.sleep(wait_s)
        yield {}


def test_the_loop_timer_splits_first_step_steady_state_and_data_wait(tmp_path):
    batches = TimedIterator(slow_batches(0.02))
    timer = LoopTimer(RunClock("train"), torch.device("cpu"), batches, volumes_per_step=2)
    first = [None]
    for step in range(1, 7):
        next(batches)
        time.sleep(0.06 if step == 1 else 0.02)  # the first step "compiles"
        first.append(timer.step_done(last=step == 6))
    assert first[1:] == [True] + [False] * 5
    timings = json.loads(timer.write(tmp_path, compile_cache="off").read_text())
    assert timings["steady_steps"] == 3 and timings["steps"] == 6 and timings["compile_cache"] == "off"
    assert timings["first_step_s"] >= 0.075 and timings["ms_per_step"] == pytest.approx(40, rel=0.5)
    assert timings["ms_per_volume"] == pytest.approx(timings["ms_per_step"] / 2, rel=1e-3)
    assert timings["data_wait_pct"] == pytest.approx(50, abs=20)
    assert timings["loop_start_s"] <= timings["first_step_done_s"] <= timings["total_s"]


def test_a_loop_too_short_for_a_steady_state_reports_none(tmp_path):
    timer = LoopTimer(RunClock("train"), torch.device("cpu"), TimedIterator(slow_batches(0)), volumes_per_step=1)
    for step in range(1, 4):
        timer.step_done(last=step == 3)
    assert "ms_per_volume" not in json.loads(timer.write(tmp_path).read_text())


def test_timings_keep_what_torch_compile_spent(tmp_path):
    """Dynamo's counters grow by what a compiled call cost; timings.json carries them, so a first step's time
    splits into compiling and the rest."""
    torch._dynamo.reset()  # clears Dynamo's counters too
    before = compile_phases().get("total_wall_time", 0.0)
    torch.compile(lambda x: torch.sin(x) * 2, backend="eager")(torch.ones(3))
    after = compile_phases()
    assert after["total_wall_time"] > before and after["total_wall_time"] >= after["entire_frame_compile"]
    assert set(after) <= {"total_wall_time", "entire_frame_compile", "entire_backward_compile", "backend_compile",
                          "inductor_compile", "async_compile.wait"}
    written = json.loads(RunClock("sample").write(tmp_path).read_text())["torch_compile_s"]
    assert written["total_wall_time"] >= after["total_wall_time"]


def test_the_process_started_before_now():
    assert 0 < time.time() - process_start_time() < 3600


def test_timings_keep_the_compile_time_a_reset_cleared(tmp_path):
    """The compile recipes end their session with ``torch.compiler.reset()`` before timings.json is written (the
    H200 rows read 0 s of compilation); a mark taken inside the session keeps the counters."""
    torch._dynamo.reset()
    clock = RunClock("sample")
    torch.compile(lambda x: torch.cos(x) + 1, backend="eager")(torch.ones(3))
    clock.mark("first_volume_done")
    torch.compiler.reset()
    assert compile_phases().get("total_wall_time", 0.0) == 0.0
    written = json.loads(clock.write(tmp_path).read_text())["torch_compile_s"]
    assert written["total_wall_time"] > 0 and written["entire_frame_compile"] > 0
