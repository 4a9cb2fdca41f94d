"""bench.counters / bench.core.ncu / bench.counter_claims on CPU: ncu's CSV pages, kernel categories, the
aggregation, the unavailable-counters rows and the claim table. A fake ``ncu`` script stands in for
Nsight Compute: it prints the committed fixture pages, or ncu's errors."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from bench import counter_claims, counters
from bench.core import ncu
from bench.core.records import append_row, code_label, read_rows
from bench.core.runner import job_spec
from bench.core.worker import base_row
from med_ddpm.config_checks import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
FIXTURES = Path(__file__).parent / "fixtures" / "ncu"
RAW, DETAILS = (FIXTURES / "raw.csv").read_text(), (FIXTURES / "details.csv").read_text()
DURATIONS = [400_000, 100_000, 200_000, 300_000, 50_000, 25_000, 20_000, 10_000, 15_000]  # ns, in fixture order
CATEGORIES = ["conv fprop", "layout conversion", "conv dgrad", "conv wgrad", "normalisation", "elementwise",
              "optimizer", "attention", "GEMM"]
FAKE_NCU = f"""#!{sys.executable}
import os, sys
args = sys.argv[1:]
mode = os.environ.get("FAKE_NCU_MODE", "ok")
if "--version" in args:
    print("NVIDIA (R) Nsight Compute Command Line Profiler")
    print("Version 2025.3.1.0 (fake)")
elif "--import" in args:
    page = args[args.index("--page") + 1]
    text = open(os.path.join({str(FIXTURES)!r}, page + ".csv")).read()
    print(text if mode == "ok" else "".join(text.splitlines(True)[:3]) if mode == "no_kernels" else "")
elif mode == "gvisor":
    print("==PROF== Connected to process 17")
    print("==ERROR== Failed to initialize the profiler.")
    sys.exit(1)
elif mode == "no_report":
    print("==WARNING== No kernels were profiled.")
elif mode == "bad_metric":
    print("==ERROR== Failed to find metric smsp__no_such_metric.sum")
    sys.exit(1)
else:  # ok, no_kernels
    open(args[args.index("--export") + 1], "w").write("report")
    print('==PROF== Profiling "k" - 0: 0%....50%....100% - 9 passes')
    print('==PROF== Profiling "k" - 1: 0%....50%....100% - 11 passes')
"""


@functools.cache
def _composed(overrides: tuple[str, ...]) -> dict:
    """One composition per setting and worker: a dozen tests read the default's, and a composition takes 0.1 s."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="counters", overrides=["experiment=bench_smoke", "output_dir=/tmp/x", *overrides])
    return job_spec(cfg, "tiny")


def job(*overrides: str) -> dict:
    """The counters job of ``overrides``, a copy each test may change."""
    return copy.deepcopy(_composed(overrides))


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch) -> str:
    path = tmp_path / "bin" / "ncu"
    path.parent.mkdir()
    path.write_text(FAKE_NCU)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_NCU_MODE", "ok")
    return str(path)


# ---------------------------------------------------------------------------- parser
def test_raw_page_skips_units_row_and_reads_separators_and_na():
    launches, units = ncu.parse_raw(RAW)
    assert len(launches) == len(DURATIONS)
    assert units["gpc__cycles_elapsed.max"] == "cycle" and units["gpu__time_duration.sum"] == "nsecond"
    assert [x["gpu__time_duration.sum"] for x in launches] == DURATIONS
    assert launches[0]["gpc__cycles_elapsed.max"] == 7_200_000  # printed "7,200,000"
    assert launches[7]["dram__throughput.avg.pct_of_peak_sustained_elapsed"] is None  # "n/a"
    assert launches[3]["Kernel Name"].startswith("sm90_xmma_wgrad_indexed_implicit_gemm")


def test_raw_page_scales_time_and_prefixed_count_units():
    text = ('"ID","Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum"\n'
            '"","","usecond","Kinst"\n"0","k","1.5","2,000"\n')
    (launch,), _ = ncu.parse_raw(text)
    assert launch["gpu__time_duration.sum"] == pytest.approx(1500.0)
    assert launch["smsp__inst_executed.sum"] == pytest.approx(2e6)


def test_output_without_a_table_names_ncus_error():
    with pytest.raises(ValueError, match="Failed to find metric"):
        ncu.parse_raw("==PROF== Connected\n==ERROR== Failed to find metric x.sum\n")


def test_details_page_rule_results():
    rules = ncu.parse_rules(DETAILS)
    assert [(r["rule"], r["speedup_type"], r["speedup_pct"]) for r in rules] == [
        ("SOLBottleneck", "", None), ("CPIStall", "global", 25.0), ("CPIStall", "global", 50.0),
        ("MemoryCacheAccessPattern", "local", 40.0), ("AchievedOccupancy", "global", 10.0)]


def test_unavailable_reasons_and_passes():
    assert ncu.unavailable_reason("==ERROR== Failed to initialize the profiler.") == "Failed to initialize the profiler."
    assert "ERR_NVGPUCTRPERM" in ncu.unavailable_reason("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission")
    assert ncu.unavailable_reason("==ERROR== Failed to find metric x") is None
    assert ncu.replay_passes('==PROF== Profiling "k" - 3: 0%....100% - 9 passes\nother 4 passes') == [9]


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("h200_*_raw.csv")), ids=lambda p: p.name)
def test_captured_h200_pages_parse_and_categorise(path):
    """Pages trimmed from a device run (``counters.keep_report=true``): every launch has a duration and
    SM cycles, and every cuDNN/CUTLASS convolution kernel gets a direction."""
    launches, units = ncu.parse_raw(path.read_text())
    assert launches and units["gpu__time_duration.sum"] in ncu.TIME_NS  # the H200 run printed "ns"
    assert all(x["gpu__time_duration.sum"] > 0 and x["gpc__cycles_elapsed.max"] > 0 for x in launches)
    for x in launches:
        if re.search(r"xmma_(fprop|dgrad|wgrad)", x["Kernel Name"]):
            assert counters.category(x["Kernel Name"]).startswith("conv ") and "not named" not in counters.category(x["Kernel Name"])


# ---------------------------------------------------------------------------- categories and totals
def test_categories_of_real_kernel_names():
    launches, _ = ncu.parse_raw(RAW)
    assert [counters.category(x["Kernel Name"]) for x in launches] == CATEGORIES
    assert counters.category("void conv_depthwise3d_cuda_backward_weight_kernel<float>(...)") == "conv wgrad"
    assert counters.category("triton_poi_fused__to_copy_add_convolution_permute_silu_7") == "elementwise"
    assert counters.category("triton_red_fused_native_group_norm_backward_4") == "normalisation"
    assert counters.category("triton_tem_fused_convolution_0") == "conv (direction not named)"
    assert counters.category("void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>") == "layout conversion"


def values(cfg: dict) -> list[dict]:
    c = cfg["counters"]
    return [counters.launch_values(x, c["metrics"], c["stalls"]) for x in ncu.parse_raw(RAW)[0]]


def test_totals_sum_counts_and_weight_rates():
    launches = values(job()["config"])
    t = counters.totals(launches, steps=2)
    assert t["launches"] == pytest.approx(4.5)
    assert t["duration_ns"] == pytest.approx(sum(DURATIONS) / 2)
    assert t["sm_cycles"] == pytest.approx(16_596_000 / 2)
    assert t["inst_executed"] == pytest.approx(5_600_000 / 2)
    assert t["inst_tensor"] == pytest.approx(1_520_000 / 2)  # gmma only: no hmma in the fixture
    assert t["pipe_mix"]["tensor"] == pytest.approx(1_520_000 / 5_600_000)
    active = 2e6 / 0.5 + 5e5 / 0.25 + 1e6 / 0.4 + 1.5e6 / 0.2 + 2e5 / 0.3 + 1e5 / 0.2 + 1.5e5 / 0.3 + 6e4 / 0.3 + 9e4 / 0.6
    assert t["ipc"] == pytest.approx(5.6e6 / active)
    dram = [40, 80, 30, 20, 70, 90, 85, None, 10]  # the n/a launch carries no weight
    known = [(d, w) for d, w in zip(dram, DURATIONS) if d is not None]
    assert t["dram_pct"] == pytest.approx(sum(d * w for d, w in known) / sum(w for _, w in known))


def test_category_stalls_are_instruction_weighted_and_ranked():
    cfg = job()["config"]
    summary = counters.summarise(values(cfg), [], steps=1, top_stalls=3)
    assert list(summary["categories"]) == list(counters.CATEGORIES)
    assert summary["categories"]["conv wgrad"]["top_stalls"] == [["barrier", 6.0], ["long_scoreboard", 2.0], ["wait", 1.0]]
    fprop_dgrad = counters.totals([x for x in values(cfg) if x["category"] in ("conv fprop", "conv dgrad")], 1, 1)
    assert fprop_dgrad["top_stalls"] == [["long_scoreboard", pytest.approx((4 * 2e6 + 3 * 1e6) / 3e6)]]
    elementwise = summary["categories"]["elementwise"]["top_stalls"]
    assert [r for r, _ in elementwise] == ["long_scoreboard", "wait"]  # its barrier stall is 0: not listed
    assert summary["categories"]["conv (direction not named)"]["launches"] == 0
    assert summary["categories"]["conv (direction not named)"]["sm_cycles"] is None


def test_rule_savings_rank_by_estimated_time_saved():
    launches = values(job()["config"])
    saved = counters.rule_savings(ncu.parse_rules(DETAILS), launches, steps=1)
    assert [(r["rule"], r["speedup_type"]) for r in saved] == [
        ("CPIStall", "global"), ("MemoryCacheAccessPattern", "local"), ("AchievedOccupancy", "global")]
    cpi = saved[0]
    assert cpi["saved_ms"] == pytest.approx((0.25 * 400_000 + 0.5 * 300_000) / 1e6)
    assert cpi["share"] == pytest.approx(250_000 / sum(DURATIONS))
    assert (cpi["launches"], cpi["top_category"]) == (2, "conv wgrad")


def test_kernel_table_lists_each_kernel_longest_first():
    lines = counters.kernel_table(values(job()["config"])).splitlines()
    assert lines[0].startswith("kernel,category,launches,duration_ns,sm_cycles")
    assert len(lines) == 1 + len(DURATIONS)
    assert ",conv fprop,1,400000," in lines[1] and ",conv wgrad,1,300000," in lines[2]


# ---------------------------------------------------------------------------- whole job with a fake ncu
def test_collect_reads_the_report_and_writes_the_kernel_table(fake_ncu, tmp_path):
    j = job("counters.rules=true")
    out = tmp_path / "out"
    out.mkdir()
    fields = counters.collect(j, out, fake_ncu, timeout_s=60)
    assert (fields["status"], fields["message"]) == ("ok", "")
    assert fields["replay_passes"] == 10  # median of 9 and 11
    cmd = fields["ncu_command"]
    assert cmd[cmd.index("--nvtx-include") + 1] == "counters" and "--clock-control" in cmd
    assert cmd[cmd.index("--replay-mode") + 1] == fields["replay"] == "kernel"
    assert cmd.count("--section") == len(j["config"]["counters"]["sections"])
    metrics = cmd[cmd.index("--metrics") + 1].split(",")
    assert "gpc__cycles_elapsed.max" in metrics and counters.STALL_METRIC.format("gmma") in metrics
    assert cmd[-3:] == ["bench.counters", counters.STEP_FLAG, str(out / f"{counters.file_slug(j)}.job.json")]
    assert fields["counters"]["overall"]["sm_cycles"] == pytest.approx(16_596_000)
    assert fields["counters"]["rules"][0]["rule"] == "CPIStall"
    assert (out / fields["kernels_csv"]).exists()
    assert not list(out.glob("*.ncu-rep")) and not list(out.glob("*_raw.csv"))  # counters.keep_report=false


def test_fields_collect_only_the_metrics_named(fake_ncu, tmp_path):
    fields = counters.collect(job("counters.fields=[duration_ns,sm_cycles]", "counters.stalls=[]"), tmp_path, fake_ncu,
                              timeout_s=60)
    cmd = fields["ncu_command"]
    assert cmd[cmd.index("--metrics") + 1].split(",") == ["gpu__time_duration.sum", "gpc__cycles_elapsed.max"]
    overall = fields["counters"]["overall"]
    assert overall["sm_cycles"] == pytest.approx(16_596_000) and overall["inst_executed"] is None


def test_application_replay_runs_the_program_once_per_pass(fake_ncu, tmp_path):
    fields = counters.collect(job("counters.replay=application"), tmp_path, fake_ncu, timeout_s=60)
    cmd = fields["ncu_command"]
    assert fields["status"] == "ok" and fields["replay"] == "application"
    assert cmd[cmd.index("--replay-mode") + 1] == "application" and cmd.count("--replay-mode") == 1


def test_keep_report_keeps_the_pages_read(fake_ncu, tmp_path):
    j = job("counters.keep_report=true", "counters.rules=true")
    counters.collect(j, tmp_path, fake_ncu, timeout_s=60)
    name = counters.file_slug(j)
    assert (tmp_path / f"{name}.ncu-rep").exists()
    assert ncu.parse_raw((tmp_path / f"{name}_raw.csv").read_text())[0] == ncu.parse_raw(RAW)[0]
    assert ncu.parse_rules((tmp_path / f"{name}_details.csv").read_text()) == ncu.parse_rules(DETAILS)


def test_gvisor_profiler_failure_is_an_unsupported_row(fake_ncu, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_MODE", "gvisor")
    fields = counters.collect(job(), tmp_path, fake_ncu, timeout_s=60)
    assert fields["status"] == "unsupported"
    assert fields["message"] == "ncu cannot read counters on this machine: Failed to initialize the profiler."
    assert "counters" not in fields


def test_an_ncu_error_is_an_error_row_with_its_words(fake_ncu, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_MODE", "bad_metric")
    fields = counters.collect(job(), tmp_path, fake_ncu, timeout_s=60)
    assert fields["status"] == "error"
    assert fields["message"] == "ncu exited with code 1: Failed to find metric smsp__no_such_metric.sum"


def test_an_empty_range_is_an_error_row_that_says_so(fake_ncu, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NCU_MODE", "no_report")
    name = counters.file_slug(job())
    fields = counters.collect(job(), tmp_path, fake_ncu, timeout_s=60)
    assert fields["message"] == f"ncu wrote no report {name}.ncu-rep: No kernels were profiled."
    monkeypatch.setenv("FAKE_NCU_MODE", "no_kernels")
    fields = counters.collect(job(), tmp_path, fake_ncu, timeout_s=60)
    assert (fields["status"], fields["message"]) == (
        "error", f"no kernel launch inside NVTX range 'counters' was profiled (kernel_filter=None); see {name}.ncu.log")


def test_missing_ncu_and_cpu_device_are_unsupported_rows(fake_ncu, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ncu on PATH
    monkeypatch.setattr(ncu, "DEFAULT_NCU", str(tmp_path / "none" / "ncu"))
    row = counters.measure(job(), tmp_path, timeout_s=60)
    assert row["status"] == "unsupported" and row["counters"] is None
    assert row["message"].startswith("Nsight Compute not found: no ncu on PATH")
    assert row["kernel_release"] == os.uname().release and row["firecracker"] == ("-fc-" in os.uname().release)
    row = counters.measure(job(f"counters.ncu={fake_ncu}"), tmp_path, timeout_s=60)
    assert row["message"] == "hardware counters need a CUDA device; device=cpu resolved to cpu"
    append_row(tmp_path / counter_claims.ROWS_FILE, row)  # the row is a valid results row
    assert read_rows(tmp_path / counter_claims.ROWS_FILE)[0]["env"]["device"] == "cpu"


# ---------------------------------------------------------------------------- claim table
def ok_row(fake_ncu: str, out: Path, recipe: str) -> dict:
    j = job(f"recipe={recipe}")
    return {**base_row(j), "experiment": None, **counters.collect(j, out, fake_ncu, timeout_s=60)}


def test_claim_table_sets_stacks_against_strict_fp32(fake_ncu, tmp_path):
    base = ok_row(fake_ncu, tmp_path, "[]")
    tf32 = ok_row(fake_ncu, tmp_path, "[tf32]")
    overall = tf32["counters"]["overall"]
    overall.update(sm_cycles=overall["sm_cycles"] / 4, inst_executed=overall["inst_executed"] / 2,
                   tensor_pipe_pct=overall["tensor_pipe_pct"] * 3, ipc=overall["ipc"] * 1.07)
    zero = copy.deepcopy(base)
    zero["counters"]["overall"]["tensor_pipe_pct"] = 0.0
    c = counter_claims.compare(tf32, base)
    assert (c["sm_cycles"], c["inst"], c["tensor"]) == pytest.approx((4.0, 2.0, 3.0))
    assert c["ipc"] == pytest.approx(0.07)
    assert counter_claims.compare(tf32, zero)["tensor"] is None  # no MMA in the baseline: no ratio
    zero["counters"]["overall"]["tensor_pipe_pct"] = 0.0006  # the H200's strict-FP32 forward: rounding-level use
    assert counter_claims.compare(tf32, zero)["tensor"] is None
    for row in (base, tf32):
        append_row(tmp_path / counter_claims.ROWS_FILE, row)
    text = counter_claims.write(tmp_path).read_text()
    assert "| tf32 | 1x | 4x | 2x | 3x (" in text and "| +7.0% |" in text
    assert counter_claims.STUDY["label"] in text
    assert "#### tf32: train_step 8x8x8, batch 1" in text and "| conv wgrad | 1 | 0.300 |" in text
    fprop, wgrad = text.index("| conv fprop | 1 | 0.400 |"), text.index("| conv wgrad | 1 | 0.300 |")
    assert fprop < wgrad and "barrier 6.0, long_scoreboard 2.0, wait 1.0" in text[wgrad:]  # longest first, ranked
    assert (tmp_path / counter_claims.PLOT).stat().st_size > 0


def test_claim_table_without_baseline_says_so(fake_ncu, tmp_path, capsys):
    append_row(tmp_path / counter_claims.ROWS_FILE, ok_row(fake_ncu, tmp_path, "[tf32]"))
    assert "No strict-FP32 row for this workload" in counter_claims.write(tmp_path).read_text()
    assert counter_claims.main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'missing' / 'counters.jsonl'}: not found; write it with "
                                       f"python -m bench.counters counters.out={tmp_path / 'missing'}\n")


def test_a_page_of_several_calls_marks_the_factors_of_another_run(fake_ncu, tmp_path, capsys):
    """One page from several folders (one device call each): a stack from another folder or run than its strict-FP32
    row says so in its label and on the plot, and every row names its commit."""
    base, same, other = (ok_row(fake_ncu, tmp_path, r) for r in ("[]", "[tf32]", "[amp_bf16]"))
    base["run_id"] = same["run_id"] = "20261205T052152Z-75c57d"
    other["run_id"] = "20261205T051339Z-d2f5de"
    for folder, rows in (("first_call", (base, same)), ("second_call", (other,))):
        for row in rows:
            append_row(tmp_path / folder / counter_claims.ROWS_FILE, row)
    assert counter_claims.main([str(tmp_path), "first_call", "second_call"]) == 0
    text = (tmp_path / counter_claims.MARKDOWN).read_text()
    sha = code_label(read_rows(tmp_path / "first_call" / counter_claims.ROWS_FILE)[0])  # append_row stamps the commit
    assert "| tf32 | 1x | 1x | 1x |" in text and "| amp_bf16 (another call: second_call) | 1x |" in text
    assert text.count(f"| {sha} |") == 3 and "another call: first_call" not in text
    same["run_id"] = "20261205T000000Z-000000"
    assert counter_claims.other_run(same, base) == "another run: 20261205T000000Z-000000"  # one folder, two runs
    assert counter_claims.main([str(tmp_path), "third_call"]) == 2
    assert "third_call/counters.jsonl: not found" in capsys.readouterr().err


def test_a_stack_filtered_otherwise_than_its_baseline_is_marked(fake_ncu, tmp_path):
    """Factors over two kernel filters set different kernels against each other: the label and the plot say so."""
    base, stack = ok_row(fake_ncu, tmp_path, "[]"), ok_row(fake_ncu, tmp_path, "[tf32]")
    base["kernel_filter"], stack["kernel_filter"] = COMMITTED_FILTER, "library"
    for row in (base, stack):
        append_row(tmp_path / counter_claims.ROWS_FILE, row)
    text = counter_claims.write(tmp_path).read_text()
    assert f"| tf32 (kernel filter library, the baseline's {COMMITTED_FILTER}) | 1x |" in text
    stack["kernel_filter"] = COMMITTED_FILTER
    assert counter_claims.other_kernels(stack, base) is None


def test_profiled_step_job_round_trips(fake_ncu, tmp_path):
    j = job("bench=denoise_step", "counters.steps=2")
    counters.collect(j, tmp_path, fake_ncu, timeout_s=60)
    saved = json.loads((tmp_path / f"{counters.file_slug(j)}.job.json").read_text())
    assert saved["config"]["counters"]["steps"] == 2 and saved["config"]["bench"]["scenario"] == "denoise_step"


def test_bad_counter_options_end_with_one_line():
    c = job()["config"]["counters"]
    with pytest.raises(ConfigError, match=r"counters.metrics.cycles is not a field"):
        counters.check_options({**c, "metrics": {**c["metrics"], "cycles": "sm__cycles_elapsed.max"}})
    with pytest.raises(ConfigError, match=r"^counters.replay=range: must be one of kernel, application$"):
        counters.check_options({**c, "replay": "range"})
    with pytest.raises(ConfigError, match=r"^counters.fields: cycles is not a field of counters.metrics"):
        counters.check_options({**c, "fields": ["duration_ns", "cycles"]})
    with pytest.raises(ConfigError, match=r"counters.steps=0"):
        counters.check_options({**c, "steps": 0})
    counters.check_options(c)  # the shipped config is valid


COMMITTED_FILTER = "xmma|implicit|gemm|conv|cutlass|cudnn|nchw|nhwc|Nhwc|Nchw|sm90|dgrad|wgrad|transpose"


def test_library_filter_is_the_committed_filter_without_inductors_triton_kernels():
    """On every kernel name ncu reported on the H200 (strict FP32 to the compiled fast stack), ``library`` selects
    what the committed rows' filter selected, less inductor's Triton kernels that it also caught."""
    names = (FIXTURES / "kernel_names.txt").read_text().split("\n")
    library = re.compile(counters.kernel_regex(job("counters.kernel_filter=library")["config"]["counters"]))
    committed = re.compile(COMMITTED_FILTER)
    assert [n for n in names if library.search(n)] == [
        n for n in names if committed.search(n) and not n.startswith("triton_")]
    assert sum(1 for n in names if n.startswith("triton_") and committed.search(n)) >= 10
    assert sum(1 for n in names if library.search(n)) >= 40


def test_the_named_filter_reaches_ncu_and_the_row_keeps_its_name(fake_ncu, tmp_path):
    j = job("counters.kernel_filter=library")
    cmd = counters.collect(j, tmp_path, fake_ncu, timeout_s=60)["ncu_command"]
    assert cmd[cmd.index("--kernel-name") + 1] == "regex:" + j["config"]["counters"]["kernel_filters"]["library"]
    assert counters.measure(j, tmp_path, timeout_s=60)["kernel_filter"] == "library"  # the row: the name, not the regex
    c = job(f"counters.kernel_filter='{COMMITTED_FILTER}'")["config"]["counters"]
    assert counters.kernel_regex(c) == COMMITTED_FILTER and counters.kernel_regex({"kernel_filter": None}) is None
    with pytest.raises(ConfigError, match=r"^counters.kernel_filter=\(conv: not a regular expression .*library$"):
        counters.check_options({**c, "kernel_filter": "(conv"})


def doc_commands() -> list[list[str]]:
    """The ``python -m bench.counters`` commands of docs/counters.md, as argument lists."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / "counters.md").read_text(), re.S)
    return [shlex.split(line)[3:] for block in blocks for line in block.splitlines()
            if line.startswith("python -m bench.counters ")]


@pytest.mark.parametrize("args", doc_commands(), ids=" ".join)
def test_documented_commands_compose(args):
    overrides = OverridesParser.create().parse_overrides([a for a in args if a != "-m"])
    choices = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
               else [o.input_line] for o in overrides]
    for combo in itertools.product(*choices):
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name="counters", overrides=[*combo, "output_dir=/tmp/x"])
        counters.check_options(cfg.counters)
        assert cfg.bench.scenario in ("train_step", "denoise_step", "full_sample")


def test_profiled_step_wraps_only_the_measured_calls_in_the_range(tmp_path, monkeypatch):
    events: list[str] = []

    @contextlib.contextmanager
    def fake_step(cfg, device):
        yield (lambda: events.append("step")), None

    monkeypatch.setattr(counters, "prepared_step", fake_step)
    monkeypatch.setattr(counters.torch.cuda.nvtx, "range_start", lambda msg: events.append(f"start {msg}") or 7)
    monkeypatch.setattr(counters.torch.cuda.nvtx, "range_end", lambda rid: events.append(f"end {rid}"))
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job("counters.warmup=2", "counters.steps=3")))
    assert counters.profiled_step(path) == 0
    assert events == ["step", "step", "start counters", "step", "step", "step", "end 7"]


@pytest.mark.gpu
def test_train_step_counters_on_the_gpu_include_the_backward(tmp_path):
    """The real thing on a CUDA machine with ncu: the tiny smoke step's row is ok, and the NVTX start/end range
    caught the convolution backward, which autograd launches from its own thread."""
    if ncu.find_ncu() is None:
        pytest.skip("no ncu on this machine")
    subprocess.run([sys.executable, "-m", "bench.counters", "experiment=bench_smoke", "device=cuda",
                    f"counters.out={tmp_path}", f"hydra.run.dir={tmp_path / 'hydra'}"], check=True, cwd=REPO)
    (row,) = read_rows(tmp_path / counter_claims.ROWS_FILE)
    assert (row["status"], row["message"]) == ("ok", "")
    cats, overall = row["counters"]["categories"], row["counters"]["overall"]
    assert cats["conv fprop"]["launches"] > 0
    assert cats["conv dgrad"]["launches"] + cats["conv wgrad"]["launches"] > 0
    assert cats["optimizer"]["launches"] > 0
    assert overall["sm_cycles"] > 0 and overall["inst_executed"] > 0 and overall["ipc"] > 0
