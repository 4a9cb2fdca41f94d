"""The kernel categoriser on real kernel names, and the markdown/PNG writers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.core import kernels

# Real names from torch.profiler traces of this network (H100/H200, torch 2.x, cuDNN 9).
FIXTURE = {
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1": "convolution",
    "sm80_xmma_fprop_implicit_gemm_indexed_f32f32_f32f32_f32_nhwckrsc_nchw_tilesize64x64x8_stage3": "convolution",
    "sm80_xmma_dgrad_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nchw_tilesize128x128x16_stage4": "convolution",
    "cudnn::cnn::wgrad_alg0_engine<float, 128, 6, 7, 3, 3, 5, false, 512>": "convolution",
    "void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>": "convolution",
    "void cudnn::ops::nchwToNhwcKernel<float, float, float, true, false, (cudnnKernelDataType_t)2>": "layout conversion",
    "void cudnn::ops::nhwcToNchwKernel<__nv_bfloat16, __nv_bfloat16, float, false, true>": "layout conversion",
    "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float, float>(long, float, float const*, float*, float*)": "normalisation",
    "void at::native::(anonymous namespace)::ComputeFusedParamsCUDAKernel<float>(long, long, long, float const*)": "normalisation",
    "triton_red_fused_native_group_norm_silu_0": "normalisation",
    "ampere_sgemm_128x64_tn": "GEMM and attention",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "GEMM and attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>>": "GEMM and attention",
    # cuDNN's fused attention is named like a convolution (fprop), as the H200 runs it
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x192_4x1x1_cga1x1x1_kernel0_0": "GEMM and attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x192_4x1x1_kernel0_0": "GEMM and attention",
    "void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, Epilogue>(float*, float const*, int)": "GEMM and attention",
    "void at::native::(anonymous namespace)::upsample_trilinear3d_out_frame<float, float>(int, float, float, float)": "up/down-sampling",
    "void at::native::upsample_trilinear3d_backward_out_frame<c10::BFloat16, float>(unsigned long, int, int)": "up/down-sampling",
    "Memcpy HtoD (Pageable -> Device)": "memory copies",
    "Memset (Device)": "memory copies",
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>>": "memory copies",
    "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}, at::detail::Array<char*, 2>>": "elementwise / activation",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::FusedAdamMathFunctor<float, 4>>": "elementwise / activation",
    "triton_poi_fused_add_convolution_0": "elementwise / activation",  # a conv bias add fused by inductor
    "aten::mkldnn_convolution": "convolution",
    "aten::native_group_norm": "normalisation",
    "aten::upsample_trilinear3d": "up/down-sampling",
    "aten::silu": "elementwise / activation",
    "some_unknown_kernel_xyz": "other",
}


@pytest.mark.parametrize("name,category", FIXTURE.items())
def test_categorise(name, category):
    assert kernels.categorise(name) == category


def test_tensor_core_heuristic():
    assert kernels.is_tensor_core(next(n for n in FIXTURE if n.startswith("sm90_xmma_fprop")))
    assert kernels.is_tensor_core(next(n for n in FIXTURE if "tf32f32_tf32f32" in n))
    assert not kernels.is_tensor_core(next(n for n in FIXTURE if "f32f32_f32f32" in n))  # FFMA build
    assert not kernels.is_tensor_core("ampere_sgemm_128x64_tn")
    assert not kernels.is_tensor_core("void at::native::vectorized_elementwise_kernel<4, c10::BFloat16>")
    assert kernels.tensor_core_share({"sm90_xmma_gemm_bf16bf16_x": 3.0, "ampere_sgemm_128x64_tn": 1.0}) == 0.75


def test_markdown_and_png(tmp_path):
    times, counts = kernels.aggregate([(n, 10.0) for n in FIXTURE] + [("Memset (Device)", 5.0)])
    record = {"label": "amp_bf16", "scenario": "train_step", "activity": "GPU kernels", "steps": 2,
              "categories_ms": {k: v / 1e3 / 2 for k, v in kernels.breakdown(times).items()},
              "total_ms": sum(times.values()) / 1e3 / 2, "tensor_core_share": kernels.tensor_core_share(times),
              "top": kernels.top_kernels(times, counts, 20)}
    assert counts["Memset (Device)"] == 2 and len(record["top"]) == 20
    assert record["top"][0]["name"] == "Memset (Device)"
    text = kernels.markdown([record, {**record, "label": "fp32"}])
    assert "| normalisation |" in text and "Top kernels: fp32" in text
    kernels.stacked_bar_png([record], tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 1000


@pytest.mark.parametrize("name, category", [
    ("triton_poi_fused__to_copy__unsafe_index_add_arange_clamp_convolution_mul_silu_sub_view_114", "up/down-sampling"),
    ("triton_red_fused__to_copy_add_convolution_native_group_norm_silu_unsqueeze_14", "normalisation"),
    ("triton_poi_fused_add_convolution_mul_3", "elementwise / activation"),
    ("nvjet_sm90_tst_448x64_64x2_2x1_v_bz_coopB_NNN", "GEMM and attention"),
])
def test_inductor_kernels_are_named_by_what_they_run(name, category):
    """Inductor names fused kernels after the ops they absorbed: a conv bias add is not a convolution."""
    assert kernels.categorise(name) == category
    assert kernels.is_tensor_core(name) == name.startswith("nvjet")


def test_top_kernels_name_the_operator_that_launched_them():
    """A fp32 SIMT GEMM under autocast is only actionable if the table says which op ran it."""
    from types import SimpleNamespace

    import torch

    from bench.profile import _launchers

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    sgemm = "cutlass_80_simt_sgemm_256x128_8x4_nn_align1"
    op = lambda name, shapes, *launched: SimpleNamespace(  # noqa: E731
        device_type=cpu, name=name, input_shapes=shapes, kernels=[SimpleNamespace(name=k) for k in launched])
    events = [op("aten::mm", [[1, 256], [256, 768]], sgemm), op("aten::mm", [[1, 256], [256, 768]], sgemm),
              op("aten::addmm", [[4096, 256]], sgemm), op("aten::add", [], "vectorized_elementwise"),
              SimpleNamespace(device_type=gpu, name=sgemm, input_shapes=[], kernels=[])]
    launchers = _launchers(SimpleNamespace(events=lambda: events))
    assert launchers == {sgemm: "aten::mm [[1, 256], [256, 768]]", "vectorized_elementwise": "aten::add"}
    times, counts = kernels.aggregate([(sgemm, 50.0), ("triton_poi_fused_add_0", 10.0)])
    top = [{**k, "launched_by": launchers.get(k["name"], "")} for k in kernels.top_kernels(times, counts)]
    record = {"label": "bf16", "scenario": "denoise_step", "activity": "GPU kernels", "steps": 1,
              "categories_ms": kernels.breakdown(times), "total_ms": 0.06, "tensor_core_share": 0.0, "top": top}
    text = kernels.markdown([record])
    assert "launched by |" in text and "aten::mm [[1, 256], [256, 768]] |" in text


def test_profiles_of_one_stack_at_two_batch_sizes_get_two_labels_and_files():
    from bench.profile import profile_label, slug

    def job(batch: int, recipes: list[str]) -> dict:
        return {"recipes": recipes, "recipe_options": [], "config": {"bench": {"batch_size": batch, "scenario": "denoise_step"}}}

    assert profile_label(job(1, [])) == "fp32"
    one, four = profile_label(job(1, ["amp_bf16"])), profile_label(job(4, ["amp_bf16"]))
    assert (one, four) == ("amp_bf16", "amp_bf16 (batch 4)")
    assert slug({"scenario": "denoise_step", "label": four}) == "denoise_step_amp_bf16_batch_4"


def test_a_label_too_long_for_a_file_name_keeps_its_head_and_a_hash(tmp_path):
    """A long stack label with options can pass the 255 bytes a file name may hold."""
    from bench.profile import SLUG_MAX, slug, write_outputs

    stack = "+".join(["amp_bf16", "channels_last_3d", "fused_groupnorm", "sdpa_attention", "gather_upsample"] * 4)
    one, two = (slug({"scenario": "train_step", "label": f"{stack} [guard={g}]"}) for g in ("host", "device"))
    assert len(one) == len(two) == SLUG_MAX and one != two and one[:100] == two[:100]
    written = write_outputs(tmp_path, {"scenario": "train_step", "label": f"{stack} [guard=host]"})
    assert (tmp_path / f"{one}.json").exists() and written.exists()


def test_timeline_merges_streams_and_splits_idle_into_launch_gaps_and_host_waits():
    """Two steps; overlapping kernels (two streams) count once; 2 µs gaps are launch latency, 40 µs a host wait."""
    step = [(0.0, 100.0), (50.0, 120.0), (122.0, 200.0), (240.0, 300.0)]  # busy 200 + 60, gaps 2 and 40
    second = [(s + 301.0, e + 301.0) for s, e in step]  # 1 µs after the first step's last kernel
    t = kernels.timeline(step + second, steps=2)
    assert t["span_ms"] == pytest.approx(601e-3 / 2)
    assert t["busy_ms"] == pytest.approx(2 * 258e-3 / 2)
    assert t["idle_ms"] == pytest.approx(t["span_ms"] - t["busy_ms"]) == pytest.approx((2 + 40 + 1 + 2 + 40) / 2e3)
    assert t["launch_gaps"] == 1.5 and t["launch_gap_ms"] == pytest.approx(5e-3 / 2)
    assert t["host_waits"] == 1 and t["host_wait_ms"] == pytest.approx(40e-3) and t["longest_gap_us"] == 40
    assert t["kernels"] == 4
    with pytest.raises(ValueError, match="at least one kernel"):
        kernels.timeline([], steps=1)


def test_markdown_has_the_timeline_table_only_for_profiles_with_a_timeline():
    times, _ = kernels.aggregate([("triton_poi_fused_add_0", 10.0)])
    record = {"label": "graphed", "scenario": "train_step", "activity": "GPU kernels", "steps": 1, "top": [],
              "categories_ms": kernels.breakdown(times), "total_ms": 0.01, "tensor_core_share": 0.0}
    assert "GPU timeline" not in kernels.markdown([record])
    timed = {**record, "timeline": kernels.timeline([(0.0, 10.0), (12.0, 20.0), (80.0, 90.0)], steps=1)}
    text = kernels.markdown([record, timed])
    assert "| graphed | 0.090 | 0.028 | 0.062 | 0.002 ms in 1 | 0.060 ms in 1 | 60 | 3 |" in text


def test_cpu_profile_end_to_end_has_categories_and_no_gpu_timeline(tmp_path):
    """``python -m bench.profile`` on the tiny smoke model: the record, profile.md and the bar chart are written;
    a CPU profile has operator self times, so no GPU timeline, and counts every operator call (a convolution runs
    in each of the 2 steps); the record carries its run, commit and environment, and profile.md says so."""
    cmd = [sys.executable, "-m", "bench.profile", "experiment=bench_smoke", "bench=train_step",
           f"profile.out={tmp_path}", "profile.steps=2", "profile.warmup=1"]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record_path,) = tmp_path.glob("train_step_*.json")
    record = json.loads(record_path.read_text())
    assert record["timeline"] is None and record["categories_ms"]["convolution"] > 0
    assert all(k["calls"] >= 2 for k in record["top"] if k["category"] == "convolution")
    assert record["run_id"] and record["git_sha"] and record["env"]["device"] == "cpu"
    text = (tmp_path / "profile.md").read_text()
    assert "GPU timeline" not in text and (tmp_path / "profile_breakdown.png").exists()
    assert f"Provenance: All profiles come from one run ({record['run_id']})." in text


def test_profile_ncu_reads_ncu_through_bench_ncu(tmp_path, monkeypatch):
    """bench.profile's ncu table: bench.core.ncu runs ncu and reads its raw page (units applied, n/a blank)."""
    from bench import profile
    from bench.core import ncu

    page = ('==PROF== Disconnected\n"ID","Kernel Name","gpu__time_duration.sum","smsp__inst_executed.sum"\n'
            '"","","usecond","Kinst"\n"0","triton_poi_fused_0","1.5","2,000"\n"1","k2","n/a","3"\n')
    commands = []
    monkeypatch.setattr(ncu, "run", lambda cmd, timeout_s, log_path: commands.append(cmd) or ncu.Run(page, 0, 1.0))
    cfg = {"profile": {"ncu_metrics": ["gpu__time_duration.sum"], "ncu_kernels": 1, "ncu_launches": 2,
                       "ncu_timeout_s": 5}, "bench": {}}
    record = {"label": "fp32", "scenario": "denoise_step", "top": [{"name": "triton_poi_fused_0"}]}
    record["ncu"] = profile.run_ncu(cfg, record, tmp_path)
    assert commands[0][commands[0].index("--kernel-name") + 1] == "regex:triton_poi_fused_0"
    assert [r["gpu__time_duration.sum"] for r in record["ncu"]] == [1500.0, None]
    assert "| `triton_poi_fused_0` | 1500 | 2e+06 |" in profile.ncu_markdown(record)
    monkeypatch.setattr(ncu, "run", lambda cmd, timeout_s, log_path: ncu.Run("", None, 5.0))
    with pytest.raises(TimeoutError, match="profile.ncu_timeout_s=5"):
        profile.run_ncu(cfg, record, tmp_path)
