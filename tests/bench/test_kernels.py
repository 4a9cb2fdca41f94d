"""The kernel categoriser on real kernel names, and the markdown/PNG writers."""

import pytest

from bench import kernels

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
    # cuDNN's fused attention is named like a convolution (fprop): measured on the H200, round 5
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
        return {"recipes": recipes, "recipe_options": [], "config": {"bench": {"batch_size": batch}}}

    assert profile_label(job(1, [])) == "fp32"
    one, four = profile_label(job(1, ["amp_bf16"])), profile_label(job(4, ["amp_bf16"]))
    assert (one, four) == ("amp_bf16", "amp_bf16 (batch 4)")
    assert slug({"scenario": "denoise_step", "label": four}) == "denoise_step_amp_bf16_batch_4"
