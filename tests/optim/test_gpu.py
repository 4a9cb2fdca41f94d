"""GPU-only checks (``pytest -m gpu`` on the device machine): every recipe and the standard
combinations run a 128³ whole-head training step and two sampling steps, and the tiny model's step
matches the strict-FP32 baseline on CUDA; the Triton GroupNorm kernel matches the torch reference
across shapes, layouts and dtypes; the compiled kernel forms keep their layouts.

Cost: ``pytest -m gpu`` is sized for one device call (eager 128³ steps take seconds, each compile of the
tiny model tens of seconds). Every 128³ step under ``compile`` (about 90 s of compilation each on the H200),
the compiled combinations of the tiny model and the two-compile dense-gradient check are marked ``gpu_long``
instead: ``pytest -m gpu_long`` runs them in a second call.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import RECIPE_DIR, float32_buffers, stack_of, tiny_batch, tiny_unet, train_step

from med_ddpm.model import UNet3D
from optim import RecipeStack

WHOLE_HEAD = dict(in_channels=3, out_channels=1, model_channels=64, channel_mult=(1, 1, 2, 3, 4),
                  num_res_blocks=1, attention_ds=(8,), num_heads=1, dropout=0.0)
COMBOS = [["tf32", "channels_last_3d"], ["amp_bf16", "channels_last_3d"], ["amp_bf16", "compile"],
          ["amp_bf16", "compile_cudagraphs"], ["amp_bf16", "fused_groupnorm", "sdpa_attention"]]
SETS = [[p.stem] for p in sorted(RECIPE_DIR.glob("*.yaml"))] + COMBOS


def _compiles(names: list[str]) -> bool:
    return stack_of(names).slow_first_call


def _sets(slow_when) -> list:
    return [pytest.param(s, id="+".join(s), marks=[pytest.mark.gpu_long] if slow_when(s) else [pytest.mark.gpu]) for s in SETS]


@pytest.fixture(autouse=True)
def _cuda(request) -> None:
    """The default run deselects the gpu and gpu_long tests; one selected on a machine without CUDA fails rather
    than skips (a ``pytest -m gpu`` that skipped everything would read as green)."""
    gpu = any(request.node.get_closest_marker(mark) for mark in ("gpu", "gpu_long"))
    if gpu and not torch.cuda.is_available():
        pytest.fail("gpu-marked test run without CUDA")


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what pytest -m gpu does without CUDA")
def test_pytest_m_gpu_without_cuda_fails_instead_of_skipping(tmp_path) -> None:
    import subprocess
    import sys

    test = f"{__file__}::test_compile_keeps_ndhwc_convolutions_only_with_layout_optimisation_off"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", test],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 1 and "gpu-marked test run without CUDA" in done.stdout, done.stdout[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("1 error in")  # the summary line: no skip


@pytest.fixture(scope="module")
def whole_head() -> UNet3D:
    """One whole-head network (built once on the CPU; each test steps its own CUDA copy)."""
    torch.manual_seed(0)
    return UNet3D(**WHOLE_HEAD)


@pytest.fixture(scope="module")
def tiny_baseline():
    """The strict-FP32 tiny step on CUDA, shared by every stack's comparison."""
    x, t, target = tiny_batch(size=16, device="cuda")
    return (x, t, target), train_step(RecipeStack([]), tiny_unet().cuda(), x, t, target)


@pytest.mark.parametrize("names", _sets(_compiles))
def test_whole_head_train_step_and_two_sampling_steps(names: list[str], whole_head: UNet3D) -> None:
    stack = stack_of(names)
    stack.require("cuda")
    model = copy.deepcopy(whole_head).cuda()
    x = torch.randn(1, 3, 128, 128, 128, device="cuda")
    with stack.session():
        model = stack.prepare_model(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-5, **stack.optimizer_options())
        scaler = stack.grad_scaler("cuda")
        with stack.forward_context():
            loss = F.l1_loss(model(stack.prepare_input(x), torch.tensor([10], device="cuda")).float(),
                             torch.zeros(1, 1, 128, 128, 128, device="cuda"))
        assert stack.finite_or_skip(loss, opt)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        model.eval()
        x_t = torch.randn(1, 1, 128, 128, 128, device="cuda")
        with torch.no_grad():
            for step in range(2):
                with stack.forward_context():
                    eps = model(stack.prepare_input(torch.cat([x_t, x[:, 1:]], 1)),
                                torch.tensor([249 - step], device="cuda")).float()
                x_t = x_t - 0.01 * eps
        assert torch.isfinite(x_t).all()
        stack.describe()


@pytest.mark.parametrize("names", _sets(lambda s: len(s) > 1 and _compiles(s)))
def test_tiny_step_matches_baseline_on_gpu(names: list[str], tiny_baseline) -> None:
    stack = stack_of(names)
    (x, t, target), base = tiny_baseline
    res = train_step(stack, tiny_unet().cuda(), x, t, target)
    tol = max((r.capabilities.tolerance for r in stack.recipes), key=lambda d: d["rtol"], default={"rtol": 0, "atol": 0})
    err = (res.output - base.output).abs().max().item()
    assert err <= tol["atol"] + tol["rtol"] * base.output.abs().max().item() or stack.exact and err == 0


# Med-DDPM's GroupNorm32 shapes: 3-D NCDHW/NDHWC, the attention's (B, C, T), and odd sizes with 3 channels a group
SHAPES = [(1, 64, 32, 32, 32), (1, 64, 4096), (3, 96, 5, 6, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["ncdhw", "ndhwc"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
def test_triton_groupnorm_matches_reference(shape, dtype, channels_last, silu) -> None:
    from optim.triton_groupnorm import group_norm_act_triton

    if channels_last and len(shape) != 5:
        pytest.skip("channels_last_3d is a 5-D layout")
    x = (torch.randn(shape, device="cuda") * 3 + 2).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    w, b = torch.randn(shape[1], device="cuda"), torch.randn(shape[1], device="cuda")
    ref = F.group_norm(x.float(), 32, w, b, 1e-5)
    ref = F.silu(ref) if silu else ref
    out = group_norm_act_triton(x, 32, w, b, 1e-5, silu, dtype)
    assert out.dtype == dtype and out.stride() == x.stride()
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=tol, atol=tol * 4)


@pytest.mark.gpu
def test_triton_groupnorm_merges_more_partials_than_its_padded_minimum() -> None:
    """Few groups: each is split over more programs than ``MIN_PARTS``, so ``_normalize`` merges ``split`` partials."""
    from optim.triton_groupnorm import MIN_PARTS, _split, group_norm_act_triton

    x = torch.randn(1, 8, 64, 64, 64, device="cuda") * 3 + 2
    assert _split(4, 2 * 64**3, x.device)[0] > MIN_PARTS
    w, b = torch.randn(8, device="cuda"), torch.randn(8, device="cuda")
    out = group_norm_act_triton(x, 4, w, b, 1e-5, True, torch.float32)
    torch.testing.assert_close(out, F.silu(F.group_norm(x, 4, w, b, 1e-5)), rtol=1e-5, atol=4e-5)


@pytest.mark.gpu
def test_triton_groupnorm_compiles_one_kernel_per_layout_whatever_the_layer_shape() -> None:
    """A cold Triton cache pays one compile per kernel variant: the whole-head network's levels (each its own split
    and channels per group) and the attention's (B, C, T) share one of each kernel."""
    from optim import triton_groupnorm as tg

    for kernel in (tg._partial_stats, tg._normalize):
        kernel.device_caches.clear()
    for c, size in ((64, (32, 32, 32)), (128, (16, 16, 16)), (256, (8, 8, 8)), (512, (4, 4, 4)), (64, (4096,))):
        x = torch.randn(1, c, *size, device="cuda", dtype=torch.float16)
        w, b = torch.randn(c, device="cuda"), torch.randn(c, device="cuda")
        tg.group_norm_act_triton(x, 32, w, b, 1e-5, True, torch.float16)
    device = torch.cuda.current_device()
    assert [len(k.device_caches[device][0]) for k in (tg._partial_stats, tg._normalize)] == [1, 1]


@pytest.mark.gpu
def test_fused_groupnorm_triton_backward_matches_torch() -> None:
    from optim.fused_groupnorm import FusedGroupNormAct

    norm = torch.nn.GroupNorm(32, 64).cuda()
    x = torch.randn(1, 64, 16, 16, 16, device="cuda", requires_grad=True)
    outs = []
    for impl in ("triton", "torch"):
        fused = FusedGroupNormAct.from_groupnorm(norm, "silu", impl)
        y = fused(x)
        grads = torch.autograd.grad(y.square().sum(), [x, norm.weight, norm.bias])
        outs.append((y, *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _conv_output_strides(layout_optimization) -> list[tuple[int, ...]]:
    """Strides of every convolution output in inductor's generated code for a bf16 NDHWC block."""
    import re

    from torch._inductor.utils import run_and_get_code

    from optim.compile import compile_model
    from optim.fused_groupnorm import fuse_groupnorm

    torch._dynamo.reset()
    block = torch.nn.Sequential(torch.nn.Conv3d(32, 64, 3, padding=1), torch.nn.GroupNorm(32, 64), torch.nn.SiLU(),
                                torch.nn.Conv3d(64, 64, 3, padding=1)).cuda()
    block = block.to(memory_format=torch.channels_last_3d)
    fuse_groupnorm(block, impl="torch")
    compile_model(block, layout_optimization=layout_optimization)
    x = torch.randn(1, 32, 16, 16, 16, device="cuda").contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        _, code = run_and_get_code(block, x)
    found = re.findall(r"assert_size_stride\(buf\d+, \([\d, ]+\), \(([\d, ]+)\), 'torch\.ops\.aten\.convolution", code[0])
    return [tuple(int(s) for s in strides.split(",") if s.strip()) for strides in found]


@pytest.mark.gpu
def test_compile_keeps_ndhwc_convolutions_only_with_layout_optimisation_off() -> None:
    """The cause of cuDNN's layout conversions under compile: with inductor's (2-D only) layout
    optimisation on, 3-D convs run NCDHW; ``auto`` (off for NDHWC weights) keeps them NDHWC."""
    ndhwc = (64 * 16**3, 1, 64 * 16**2, 64 * 16, 64)
    kept = _conv_output_strides("auto")
    assert len(kept) == 2 and all(s == ndhwc for s in kept), kept
    assert any(s != ndhwc for s in _conv_output_strides(True)), "inductor now keeps 3-D NDHWC: auto can go"


@pytest.mark.gpu
def test_sdpa_core_runs_med_ddpm_attention_on_the_flash_kernel() -> None:
    """Med-DDPM's q, k, v are transposed views of the qkv conv output; restricted to flash, SDPA
    raises on them unless the core hands it unit-stride channels (else: float32 math fallback)."""
    from optim.sdpa_attention import SdpaAttentionCore

    b, c, t = 1, 192, 4096  # the whole-head model's attention level: 16³ tokens, 192 channels
    qkv = torch.randn(b, 3 * c, t, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.reshape(b, 1, 3 * c, t).transpose(-1, -2).split(c, dim=-1)
    out = SdpaAttentionCore(backends=("flash",))(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def _kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
def test_narrow_conv_gemm_compiled_matches_cudnn_without_layout_conversions() -> None:
    """Med-DDPM's 64 -> 1 output conv in bf16 NDHWC, compiled as the network runs it: the GEMM form agrees with
    cuDNN's conv (forward and weight gradient) and launches no NCDHW<->NDHWC conversion."""
    from optim.narrow_conv import gemm_conv_forward

    cl = torch.channels_last_3d
    conv = torch.nn.Conv3d(64, 1, 3, padding=1).cuda().to(memory_format=cl)
    x = torch.randn(1, 64, 64, 64, 64, device="cuda").contiguous(memory_format=cl)
    gemm = torch.compile(lambda x: gemm_conv_forward(x, conv), options={"layout_optimization": False})
    outs = []
    with torch.autocast("cuda", torch.bfloat16):
        for fn in (conv, gemm):
            y = fn(x)
            (grad,) = torch.autograd.grad(y.float().square().mean(), conv.weight)
            outs.append((y.float(), grad))
        names = _kernel_names(lambda: gemm(x))
    (y_ref, g_ref), (y, g) = outs
    assert y.is_contiguous(memory_format=cl)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=2e-2 * y_ref.abs().max().item())
    torch.testing.assert_close(g, g_ref, rtol=0, atol=2e-2 * g_ref.abs().max().item())
    assert not [n for n in names if "nchwToNhwc" in n or "nhwcToNchw" in n], names


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True], ids=["ncdhw", "ndhwc"])
def test_gather_upsample_backward_matches_cuda_kernel(channels_last: bool) -> None:
    """The closed-form gather against PyTorch's atomic CUDA backward, at a decoder shape, both layouts."""
    from optim.upsample import trilinear_x2_gather, trilinear_x2_reference

    x = torch.randn(1, 64, 32, 32, 32, device="cuda")
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)
    g = torch.randn(1, 64, 64, 64, 64, device="cuda")
    grads = [torch.autograd.grad(f(x.requires_grad_()), x, g)[0] for f in (trilinear_x2_gather, trilinear_x2_reference)]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-5)


def _copies_under_conv_backward(fn) -> int:
    """``aten::copy_`` calls made inside ``convolution_backward`` (cuDNN making a gradient dense)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    backward = [e for e in events if "convolution_backward" in e.name]
    return sum(1 for e in events if e.name == "aten::copy_"
               and any(b.time_range.start <= e.time_range.start and e.time_range.end <= b.time_range.end
                       for b in backward))


@pytest.mark.gpu_long
def test_dense_conv_grads_moves_the_gradient_copies_out_of_compiled_convolution_backward() -> None:
    """The compiled channels-last bf16 train step of the tiny U-Net at 32³: the recipe moves most of the copies
    cuDNN's convolution backward makes out of the call (to a quarter or fewer), and the gradients are
    unchanged. In the CPU trace of this step 4 of the 5 left copy inputs, not gradients: the attention's output
    projection gets a (B, C, T) view of SDPA's token-major output (the CPU test names those operands)."""
    x, t, _ = tiny_batch(size=32, batch=1, device="cuda")
    copies, grads = [], []
    for extra in ([], ["dense_conv_grads"]):
        stack = stack_of(["amp_bf16", "channels_last_3d", "fused_groupnorm", "gather_upsample", "compile", *extra])
        with stack.session():
            model = stack.prepare_model(tiny_unet().cuda())
            xin = stack.prepare_input(x)

            def step(model=model, xin=xin, stack=stack):
                model.zero_grad(set_to_none=True)
                with stack.forward_context():
                    loss = model(xin, t).float().square().mean()
                loss.backward()

            step()  # compile
            copies.append(_copies_under_conv_backward(step))
            grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert copies[0] > 0 and copies[1] <= copies[0] // 4, copies
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=2e-2 * grads[0].abs().max().item())


@pytest.mark.gpu
def test_groupnorm_closed_form_backward_compiles_without_a_float32_intermediate() -> None:
    """bf16 NDHWC GroupNorm + SiLU, 128 channels at 32³, compiled with realize_reads_threshold 6: the
    closed-form backward allocates no full-size float32 buffer (autograd's form did on the CPU), and its
    gradients match autograd's."""
    from torch._inductor.utils import run_and_get_code

    from optim.groupnorm_ndhwc import group_norm_act_channels_last, group_norm_act_ndhwc_closed_form

    cl = torch.channels_last_3d
    x = torch.randn(1, 128, 32, 32, 32, device="cuda").to(torch.bfloat16).contiguous(memory_format=cl)
    w, b = torch.randn(128, device="cuda"), torch.randn(128, device="cuda")
    dy = torch.randn_like(x)
    found, grads = {}, {}
    for name, form in (("autograd", group_norm_act_channels_last), ("closed_form", group_norm_act_ndhwc_closed_form)):
        def step(x, w, b, dy, form=form):
            return torch.autograd.grad(form(x, 32, w, b, 1e-5, True), (x, w, b), dy)

        torch.compiler.reset()
        compiled = torch.compile(step, options={"layout_optimization": False, "realize_reads_threshold": 6})
        grads[name], codes = run_and_get_code(compiled, *(t.requires_grad_() for t in (x, w, b)), dy)
        found[name] = float32_buffers(codes, "cuda", x.numel())
    torch.compiler.reset()
    assert not found["closed_form"], found
    for ref, new in zip(grads["autograd"], grads["closed_form"], strict=True):
        torch.testing.assert_close(new.float(), ref.float(), rtol=0, atol=1e-2 * ref.abs().max().item())


@pytest.mark.gpu_long
def test_amp_fp32_island_survives_compile_cudagraphs() -> None:
    """``amp_bf16``'s fp32 island on the first convolution still changes the numerics when the model is compiled
    and graphed: compiled-with-island matches eager-with-island, and differs from compiled plain bf16."""
    from med_ddpm.model import INPUT_CONV
    from optim.amp import Amp
    from optim.compile import Compile

    x, t, _ = tiny_batch(size=16, device="cuda")

    @torch.no_grad()
    def forward(recipes) -> torch.Tensor:
        stack = RecipeStack(recipes)
        with stack.session():
            net = stack.prepare_model(tiny_unet().cuda().eval())
            with stack.forward_context():
                for _ in range(3):  # warm-up and graph capture, then the replayed call
                    out = net(stack.prepare_input(x), t).float().clone()
        return out

    island = [INPUT_CONV]
    eager = forward([Amp("bfloat16", fp32_modules=island)])
    graphed = forward([Amp("bfloat16", fp32_modules=island), Compile(mode="reduce-overhead")])
    plain = forward([Amp("bfloat16"), Compile(mode="reduce-overhead")])
    assert torch.allclose(graphed, eager, rtol=2e-2, atol=2e-2)
    assert not torch.equal(graphed, plain)
