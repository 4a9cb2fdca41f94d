"""bench.floor: the meta-device counts match a real forward, floors are the documented arithmetic, the command
measures the rates (on a CUDA GPU only) then puts a profile against them, counting the network, batch and network
calls that bench.profile recorded (model= only for an older profile), and inputs that do not belong together
(a bad file, another network, CPU rates, a floor above the measurement) are one line naming the option."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from bench import floor, profile
from bench.core.runner import job_spec
from bench.floor import floors_ms, main, measure_peaks, measured_ms, table, workload
from med_ddpm.cli import CONFIG_DIR
from med_ddpm.model import build_model

TINY = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "tiny.yaml"))
PEAKS = {"bf16_tflops": 500.0, "copy_tb_s": 4.0, "env": {"device": "cuda", "gpu": "NVIDIA Test GPU"}}
COMMITTED = CONFIG_DIR.parent / "bench" / "results" / "h200" / "tuning" / "profile_train_gather_0effe44"


def test_conv_flops_match_torchs_flop_counter_on_a_real_forward() -> None:
    model = build_model(TINY)
    x = torch.randn(1, TINY["in_channels"], *TINY["image_size"])
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(x, torch.zeros(1, dtype=torch.long))
    conv = counter.get_flop_counts()["Global"][torch.ops.aten.convolution]
    counts = workload(TINY)
    assert counts["conv_flops"] == conv
    assert workload(TINY, batch_size=2) == {k: 2 * v for k, v in counts.items()}
    # every GroupNorm32 input in bf16: at 32^3 the two full-resolution 32-channel norms alone are 2 x 2 MiB
    assert counts["gn_bytes"] > 2 * 2 * 32 * 32**3


def profile_record(scenario: str = "denoise_step", model: dict | None = TINY) -> dict:
    """A GPU profile of the tiny model; ``model=None``: one written before profiles recorded their network."""
    record = {"label": "amp_bf16", "scenario": scenario, "batch_size": 1, "activity": "GPU kernels", "total_ms": 20.0,
              "categories_ms": {"convolution": 12.0, "elementwise / activation": 5.0, "normalisation": 0.5}}
    return record if model is None else {**record, "model": model, "model_calls": 1}


def test_floors_are_flops_over_rate_and_passes_over_bandwidth() -> None:
    counts = {"conv_flops": 5e12, "gn_bytes": 2e9}
    assert floors_ms(counts, "denoise_step", PEAKS) == pytest.approx({"convolution": 10.0, "groupnorm": 1.5})
    assert floors_ms(counts, "train_step", PEAKS) == pytest.approx({"convolution": 30.0, "groupnorm": 4.0})
    with pytest.raises(ValueError, match="full_sample"):
        floors_ms(counts, "full_sample", PEAKS)
    text = table(profile_record(), measured_ms(profile_record()), floors_ms(counts, "denoise_step", PEAKS), PEAKS)
    assert "Rates measured on the NVIDIA Test GPU: bf16 matmul 500 TFLOP/s, copy 4.00 TB/s" in text
    assert "| convolution | 12.00 | 10.00 | 2.00 |" in text
    assert "| GroupNorm and elementwise | 5.50 | 1.50 | 4.00 |" in text
    assert "| everything else (not modelled) | 2.50 | 0.00 | 2.50 |" in text


def test_measured_peaks_are_positive_rates() -> None:
    peaks = measure_peaks(torch.device("cpu"), n=64, nbytes=1 << 20)
    assert peaks["bf16_tflops"] > 0 and peaks["copy_tb_s"] > 0 and "torch" in json.dumps(peaks["env"])


def floor_cfg(tmp_path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("floor", overrides=[f"output_dir={tmp_path}", *overrides])


def refused(capsys, cfg) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(cfg)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_measure_needs_a_cuda_gpu_and_the_table_names_it(tmp_path, monkeypatch, capsys) -> None:
    """Without CUDA measure=true is refused before measuring; with it (faked: measure_peaks stands in for speed)
    it measures the CUDA device, and a profile read against that peaks.json names its GPU."""
    measured = []
    monkeypatch.setattr(floor, "measure_peaks", lambda device: measured.append(device) or PEAKS)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = refused(capsys, floor_cfg(tmp_path / "cpu", "measure=true"))
    assert line == ("error: measure=true: needs a CUDA GPU, and this machine has none; use the peaks.json measured "
                    "on the GPU that ran the profile (peaks=PEAKS.json)")
    assert not measured and not (tmp_path / "cpu" / "peaks.json").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    main(floor_cfg(tmp_path / "peaks", "measure=true"))
    assert measured == [torch.device("cuda")]
    assert json.loads((tmp_path / "peaks" / "peaks.json").read_text()) == PEAKS
    (tmp_path / "profile.json").write_text(json.dumps(profile_record()))
    main(floor_cfg(tmp_path / "floor", f"profile={tmp_path / 'profile.json'}", f"peaks={tmp_path / 'peaks' / 'peaks.json'}"))
    text = (tmp_path / "floor" / "floor.md").read_text()
    assert text.startswith("## Floor of `amp_bf16` (denoise_step, batch 1)\n\nRates measured on the NVIDIA Test GPU: ")
    assert text in capsys.readouterr().out


def test_the_floor_counts_the_network_batch_and_calls_that_bench_profile_recorded(tmp_path, capsys) -> None:
    """bench.profile's record of a tiny train step (batch 2, 2 micro-batches) names its network; bench.floor, given no
    model=, counts that network at 4 volumes, and refuses a model= that is another network, naming both."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["model=tiny", "bench=train_step", "train.batch_size=2", "train.grad_accum=2",
                                        "profile.steps=1"])
    events = [("sm90_xmma_fprop_implicit_gemm_bf16", 20e3), ("group_norm_kernel", 1e3),
              ("vectorized_elementwise_kernel", 3e3), ("Memcpy DtoD", 1e3)]  # µs in the one step
    record = profile.summarise(events, job_spec(cfg, "tiny"), torch.device("cuda"))
    assert (record["model"], record["batch_size"], record["model_calls"]) == (TINY, 2, 2)
    (tmp_path / "profile.json").write_text(json.dumps(record))
    (tmp_path / "peaks.json").write_text(json.dumps(PEAKS))
    inputs = [f"profile={tmp_path / 'profile.json'}", f"peaks={tmp_path / 'peaks.json'}"]
    main(floor_cfg(tmp_path / "floor", *inputs))
    text = (tmp_path / "floor" / "floor.md").read_text()
    expected = floors_ms(workload(TINY, 4), "train_step", PEAKS)
    assert "(train_step, batch 2, 2 micro-batches)" in text
    assert f"| convolution | 20.00 | {expected['convolution']:.2f} |" in text
    assert f"| GroupNorm and elementwise | 4.00 | {expected['groupnorm']:.2f} |" in text
    main(floor_cfg(tmp_path / "same", *inputs, "model=tiny"))
    assert (tmp_path / "same" / "floor.md").read_text() == text
    line = refused(capsys, floor_cfg(tmp_path / "other", *inputs, "model=medddpm_whole_head"))
    assert re.search(r"^error: model=medddpm_whole_head: not the network profile=.*profile\.json timed \(model=tiny: "
                     r".*image_size \[128, 128, 128\] here, \[32, 32, 32\] there.*\); leave model= out", line), line
    assert not (tmp_path / "other" / "floor.md").exists()


def test_a_committed_profile_without_its_network_still_works_with_model(tmp_path, capsys) -> None:
    """The H200 train-step profile at 0effe44 (written before profiles recorded their network): with model= the
    table is the committed floor.md's, the rates line now naming the GPU; without model= it is refused."""
    inputs = [f"profile={next(COMMITTED.glob('train_step_*.json'))}", f"peaks={COMMITTED / 'peaks.json'}"]
    main(floor_cfg(tmp_path / "floor", *inputs, "model=medddpm_whole_head"))
    lines = (tmp_path / "floor" / "floor.md").read_text().splitlines()
    committed = (COMMITTED / "floor.md").read_text().splitlines()
    assert lines[2].startswith("Rates measured on the NVIDIA H200: bf16 matmul 779 TFLOP/s")
    assert lines[:2] + lines[3:] == committed[:2] + committed[3:] and "| convolution | 35.03 | 21.16 | 13.87 |" in lines
    line = refused(capsys, floor_cfg(tmp_path / "bare", *inputs))
    assert re.search(r"^error: profile=.*train_step_.*\.json: does not record the network it timed .*; pass "
                     r"model=NAME", line), line


def test_a_bad_input_file_is_one_line_naming_its_option(tmp_path, capsys) -> None:
    files = {"profile.json": profile_record(), "sample.json": profile_record("full_sample"),
             "old.json": profile_record(model=None), "cpu_profile.json": {**profile_record(), "activity": "CPU operator self time"},
             "rows.json": {"ms_median": 1.0}, "peaks.json": PEAKS, "cpu_peaks.json": {**PEAKS, "env": {"gpu": None}},
             "slow_peaks.json": {**PEAKS, "bf16_tflops": 0.83}}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    (tmp_path / "broken.json").write_text("{")
    cases = {("rows.json", "peaks.json"): r"^error: profile=.*rows\.json: not a bench\.profile record",
             ("sample.json", "peaks.json"): r"^error: profile: a full_sample profile has no floor model; pass a "
                                            r"profile of denoise_step or train_step$",
             ("old.json", "peaks.json"): r"^error: profile=.*old\.json: does not record the network it timed",
             ("cpu_profile.json", "peaks.json"): r"^error: profile=.*cpu_profile\.json: times 'CPU operator self time', "
                                                 r"not GPU kernels; pass a profile that bench\.profile wrote on the GPU$",
             ("profile.json", "rows.json"): r"^error: peaks=.*rows\.json: no bf16_tflops and copy_tb_s; pass the",
             ("profile.json", "cpu_peaks.json"): r"^error: peaks=.*cpu_peaks\.json: not measured on a GPU \(env\.gpu is "
                                                 r"None\); pass the peaks\.json .* on the GPU that ran the profile$",
             ("profile.json", "slow_peaks.json"): r"^error: profile=.*profile\.json: the convolution floor \(23\.45 ms\) is "
                                                  r"above the 12\.00 ms measured, so the profile, the network and peaks= "
                                                  r"do not belong together; pass the peaks\.json measured on the GPU",
             ("profile.json", "broken.json"): r"^error: peaks=.*broken\.json: cannot read \(Expecting",
             ("profile.json", "none.json"): r"^error: peaks=.*none\.json: cannot read \(No such file or directory\)"}
    for (profile_file, peaks), pattern in cases.items():
        cfg = floor_cfg(tmp_path / "out", f"profile={tmp_path / profile_file}", f"peaks={tmp_path / peaks}")
        assert re.search(pattern, refused(capsys, cfg)), (profile_file, peaks)
    assert not (tmp_path / "out" / "floor.md").exists()
