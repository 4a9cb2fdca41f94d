"""bench.floor: the meta-device counts match a real forward, floors are the documented arithmetic, the command
measures the rates then puts a profile against them, and a bad input file is one line naming its option."""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from bench import floor
from bench.floor import floors_ms, main, measure_peaks, table, workload
from med_ddpm.cli import CONFIG_DIR
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


def profile_record(scenario: str = "denoise_step") -> dict:
    return {"label": "amp_bf16", "scenario": scenario, "batch_size": 1, "total_ms": 20.0,
            "categories_ms": {"convolution": 12.0, "elementwise / activation": 5.0, "normalisation": 0.5}}


def test_floors_are_flops_over_rate_and_passes_over_bandwidth() -> None:
    counts, peaks = {"conv_flops": 5e12, "gn_bytes": 2e9}, {"bf16_tflops": 500.0, "copy_tb_s": 4.0}
    assert floors_ms(counts, "denoise_step", peaks) == pytest.approx({"convolution": 10.0, "groupnorm": 1.5})
    assert floors_ms(counts, "train_step", peaks) == pytest.approx({"convolution": 30.0, "groupnorm": 4.0})
    with pytest.raises(ValueError, match="full_sample"):
        floors_ms(counts, "full_sample", peaks)
    text = table(profile_record(), floors_ms(counts, "denoise_step", peaks), peaks)
    assert "| convolution | 12.00 | 10.00 | 2.00 |" in text
    assert "| GroupNorm and elementwise | 5.50 | 1.50 | 4.00 |" in text
    assert "| everything else (not modelled) | 2.50 | 0.00 | 2.50 |" in text


def test_measured_peaks_are_positive_rates() -> None:
    peaks = measure_peaks(torch.device("cpu"), n=64, nbytes=1 << 20)
    assert peaks["bf16_tflops"] > 0 and peaks["copy_tb_s"] > 0 and "torch" in json.dumps(peaks["env"])


def floor_cfg(tmp_path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("floor", overrides=["model=tiny", f"output_dir={tmp_path}", *overrides])


def test_measured_rates_then_a_profile_against_them(tmp_path, monkeypatch, capsys) -> None:
    """measure=true writes peaks.json (small sizes here: the real ones are for a GPU); a profile read against
    it gives floor.md, the floors of the tiny model's convolutions and GroupNorms at those rates."""
    monkeypatch.setattr(floor, "measure_peaks", functools.partial(measure_peaks, n=64, nbytes=1 << 20))
    main(floor_cfg(tmp_path / "peaks", "measure=true"))
    peaks = json.loads((tmp_path / "peaks" / "peaks.json").read_text())
    assert peaks["bf16_tflops"] > 0 and peaks["copy_tb_s"] > 0
    (tmp_path / "profile.json").write_text(json.dumps(profile_record()))
    main(floor_cfg(tmp_path / "floor", f"profile={tmp_path / 'profile.json'}", f"peaks={tmp_path / 'peaks' / 'peaks.json'}"))
    text = (tmp_path / "floor" / "floor.md").read_text()
    expected = floors_ms(workload(OmegaConf.to_container(floor_cfg(tmp_path).model)), "denoise_step", peaks)
    assert f"| convolution | 12.00 | {expected['convolution']:.2f} |" in text
    assert text.startswith("## Floor of `amp_bf16` (denoise_step, batch 1)") and text in capsys.readouterr().out


def refused(capsys, cfg) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(cfg)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_a_bad_input_file_is_one_line_naming_its_option(tmp_path, capsys) -> None:
    (tmp_path / "profile.json").write_text(json.dumps(profile_record()))
    (tmp_path / "sample.json").write_text(json.dumps(profile_record("full_sample")))
    (tmp_path / "rows.json").write_text(json.dumps({"ms_median": 1.0}))
    (tmp_path / "peaks.json").write_text(json.dumps({"bf16_tflops": 790, "copy_tb_s": 4.0}))
    (tmp_path / "broken.json").write_text("{")
    cases = {("rows.json", "peaks.json"): r"^error: profile=.*rows\.json: not a bench\.profile record",
             ("sample.json", "peaks.json"): r"^error: profile: a full_sample profile has no floor model; pass a "
                                            r"profile of denoise_step or train_step$",
             ("profile.json", "rows.json"): r"^error: peaks=.*rows\.json: no bf16_tflops and copy_tb_s; pass the",
             ("profile.json", "broken.json"): r"^error: peaks=.*broken\.json: cannot read \(Expecting",
             ("profile.json", "none.json"): r"^error: peaks=.*none\.json: cannot read \(No such file or directory\)"}
    for (profile, peaks), pattern in cases.items():
        cfg = floor_cfg(tmp_path / "out", f"profile={tmp_path / profile}", f"peaks={tmp_path / peaks}")
        assert re.search(pattern, refused(capsys, cfg)), (profile, peaks)
    assert not (tmp_path / "out" / "floor.md").exists()
