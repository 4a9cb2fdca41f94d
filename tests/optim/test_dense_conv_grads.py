"""dense_conv_grads: every convolution's backward gets its output gradient dense in the layout cuDNN asks for."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import stack_of, tiny_unet
from functorch.compile import aot_module_simplified, make_boxed_func
from torch import nn

from optim import DenseConvGrads, use_dense_conv_grads
from optim.dense_conv_grads import DenseGrad, conv_memory_format

CL = torch.channels_last_3d


def test_layout_rule_is_cudnns_input_or_weight_rule() -> None:
    x, w = torch.randn(1, 8, 4, 4, 4), torch.randn(8, 8, 3, 3, 3)
    assert conv_memory_format(x, w) == torch.contiguous_format
    assert conv_memory_format(x.contiguous(memory_format=CL), w) == CL
    assert conv_memory_format(x, w.contiguous(memory_format=CL)) == CL
    assert conv_memory_format(torch.randn(1, 8, 64), torch.randn(8, 8, 1)) == torch.contiguous_format  # attention's 1-D convs
    one = torch.randn(1, 1, 4, 4, 4)  # C = 1: both layouts at once, so nothing to choose
    assert conv_memory_format(one, torch.randn(8, 1, 3, 3, 3)) == torch.contiguous_format


def test_dense_grad_backward_returns_the_gradient_in_the_requested_layout() -> None:
    """The decoder's case: a channel slice of an NDHWC concatenation's gradient, strided, comes out dense
    and equal."""
    y = torch.randn(1, 4, 3, 3, 3).requires_grad_()
    strided = torch.randn(1, 8, 3, 3, 3).contiguous(memory_format=CL)[:, :4]
    (grad,) = torch.autograd.grad(DenseGrad.apply(y, CL), y, strided)
    assert not strided.is_contiguous(memory_format=CL)
    assert grad.is_contiguous(memory_format=CL) and torch.equal(grad, strided)
    out = DenseGrad.apply(y, CL)
    assert torch.equal(out, y) and out.grad_fn is not None


def _strided_conv_operands(extra: list[str]) -> tuple[list[tuple[str, int]], int]:
    """((operand, input rank) of every operand of convolution_backward that is not dense, total calls) in the
    AOT backward graph of the tiny U-Net under the GPU test's stack (bf16, channels-last, fused GroupNorm,
    gather upsampling) plus ``extra``, judged by cuDNN's rule (NDHWC when the input or the
    weight is); cuDNN copies each such operand inside the call."""
    graphs = []

    def backend(gm, example_inputs):
        def keep(g, _):
            graphs.append(g)
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                     bw_compiler=keep)

    names = ["amp_bf16", "channels_last_3d", "fused_groupnorm", "gather_upsample", *extra]
    stack = stack_of(names)
    with stack.session():
        model = stack.prepare_model(tiny_unet(channel_mult=(1, 1, 2), attention_ds=(4,)))
        x = stack.prepare_input(torch.randn(1, 3, 16, 16, 16))
        with stack.forward_context():
            loss = torch.compile(model, backend=backend)(x, torch.tensor([3])).float().square().mean()
        loss.backward()
        torch.compiler.reset()
    nodes = [n for g in graphs for n in g.graph.nodes if "convolution_backward" in str(n.target)]
    strided = []
    for n in nodes:
        grad, x, w = (n.args[i].meta["val"] for i in range(3))
        fmt = conv_memory_format(x, w)
        strided += [(name, x.dim()) for name, t in (("grad", grad), ("input", x), ("weight", w))
                    if not t.is_contiguous(memory_format=fmt)]
    return strided, len(nodes)


@pytest.mark.slow
def test_compiled_backward_graph_has_no_strided_convolution_gradient() -> None:
    """The traced training graph (AOT autograd, what inductor compiles): without the recipe some
    convolution_backward calls get strided gradients (cuDNN would copy them inside the call); with it none.
    What stays strided is the input of the attention's 1-D output projection, a (B, C, T) view of SDPA's
    token-major output: 4 of the 5 copies the GPU test still counts with the recipe (of 28 without, on the H200)."""
    before, total = _strided_conv_operands([])
    after, total_after = _strided_conv_operands(["dense_conv_grads"])
    assert total == total_after > 0
    assert sum(name == "grad" for name, _ in before) > 0
    assert after and set(after) == {("input", 3)}, (before, after, total)


def test_every_conv_is_hooked_once_and_a_deepcopy_keeps_the_hook() -> None:
    model = tiny_unet()
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv1d | nn.Conv3d)]
    assert use_dense_conv_grads(model) == convs and use_dense_conv_grads(model) == []
    recipe = DenseConvGrads()
    recipe.prepare_model(model := tiny_unet())
    assert recipe.describe()["hooked_convs"] == len(convs)
    ema = copy.deepcopy(model)
    y = torch.randn(1, 8, 8, 8, 8).contiguous(memory_format=CL)
    conv = next(m for m in ema.modules() if isinstance(m, nn.Conv3d) and m.in_channels == 32)
    out = conv(y[:, :0].new_zeros(1, 32, 4, 4, 4))
    assert out.grad_fn is not None and "DenseGrad" in type(out.grad_fn).__name__
