"""bench.experiments.floor: the meta-device counts match a real forward, floors are the documented arithmetic,
and a bad profile path is named."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from bench.experiments.floor import CONFIG_DIR, floors_ms, main, measure_peaks, table, workload
from med_ddpm.model import build_model

TINY = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "tiny.yaml"))


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


def test_floors_are_flops_over_rate_and_passes_over_bandwidth() -> None:
    counts, peaks = {"conv_flops": 5e12, "gn_bytes": 2e9}, {"bf16_tflops": 500.0, "copy_tb_s": 4.0}
    assert floors_ms(counts, "denoise_step", peaks) == pytest.approx({"convolution": 10.0, "groupnorm": 1.5})
    assert floors_ms(counts, "train_step", peaks) == pytest.approx({"convolution": 30.0, "groupnorm": 4.0})
    with pytest.raises(ValueError, match="full_sample"):
        floors_ms(counts, "full_sample", peaks)
    profile = {"label": "amp_bf16", "scenario": "denoise_step", "batch_size": 1, "total_ms": 20.0,
               "categories_ms": {"convolution": 12.0, "elementwise / activation": 5.0, "normalisation": 0.5}}
    text = table(profile, floors_ms(counts, "denoise_step", peaks), peaks)
    assert "| convolution | 12.00 | 10.00 | 2.00 |" in text
    assert "| GroupNorm and elementwise | 5.50 | 1.50 | 4.00 |" in text
    assert "| everything else (not modelled) | 2.50 | 0.00 | 2.50 |" in text


def test_measured_peaks_are_positive_rates() -> None:
    peaks = measure_peaks(torch.device("cpu"), n=64, nbytes=1 << 20)
    assert peaks["bf16_tflops"] > 0 and peaks["copy_tb_s"] > 0 and "torch" in json.dumps(peaks["env"])


def test_cli_names_a_missing_profile(tmp_path) -> None:
    (tmp_path / "peaks.json").write_text(json.dumps({"bf16_tflops": 790, "copy_tb_s": 4.0}))
    with pytest.raises(SystemExit, match="bench.experiments.floor: cannot read .*nothere.json"):
        main([f"profile={tmp_path / 'nothere.json'}", f"peaks={tmp_path / 'peaks.json'}"])
    with pytest.raises(SystemExit, match="measure=true"):
        main(["bogus"])
    with pytest.raises(SystemExit, match="measure=true"):  # a profile needs the rates to divide by
        main([f"profile={tmp_path / 'nothere.json'}"])
