"""optim.precompile on the CPU: a forward compiled ahead of time is saved, loaded back without tracing and matches
eager; inputs its guards refuse, an unreadable file, a forward that is not a module's method and a failing
``aot_compile`` all end on the lazy ``torch.compile`` path with the right output."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optim.compile import compile_model
from optim.precompile import Precompiled, precompiled_forward


class Block(nn.Module):
    """Convolution, GroupNorm and SiLU: the U-Net's unit, small enough to compile in seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch.compiler.reset()


def compiled_block(path, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(compiled block, its eager twin with the same weights)."""
    torch.manual_seed(seed)
    eager = Block()
    twin = Block()
    twin.load_state_dict(eager.state_dict())
    return compile_model(twin, aot_file=path), eager


def test_a_saved_forward_is_loaded_back_and_matches_eager(tmp_path):
    path = tmp_path / "block.aot"
    x = torch.randn(1, 2, 6, 6, 6)
    first, eager = compiled_block(path)
    torch.testing.assert_close(first(x), eager(x), rtol=1e-5, atol=1e-6)
    assert (precompiled_forward(first).status, path.exists()) == ("saved", True)
    again, eager = compiled_block(path, seed=1)  # other weights: the network is an input of the saved function
    torch.testing.assert_close(again(x), eager(x), rtol=1e-5, atol=1e-6)
    forward = precompiled_forward(again)
    assert (forward.status, forward.lazy_calls) == ("loaded", 0)


def test_an_ema_copy_shares_the_file_and_takes_the_lazy_path_under_no_grad(tmp_path):
    """Training's EMA is a deepcopy of the compiled network: its previews run under ``no_grad``, which the saved
    guards (grad mode on, as training traced it) refuse, so they compile lazily; the training file is left as is."""
    path, x = tmp_path / "block.aot", torch.randn(1, 2, 6, 6, 6)
    model, eager = compiled_block(path)
    model(x)
    saved = path.read_bytes()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(ema(x), eager(x), rtol=1e-5, atol=1e-6)
    forward = precompiled_forward(ema)
    assert forward is not precompiled_forward(model) and (forward.status, forward.lazy_calls) == ("loaded", 1)
    assert path.read_bytes() == saved


def test_inputs_the_guards_refuse_take_the_lazy_path(tmp_path):
    model, eager = compiled_block(tmp_path / "block.aot")
    model(torch.randn(1, 2, 6, 6, 6))
    x = torch.randn(2, 2, 4, 4, 4)  # another shape
    torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
    assert precompiled_forward(model).lazy_calls == 1


def test_an_unreadable_file_is_compiled_again(tmp_path, caplog):
    path = tmp_path / "block.aot"
    path.write_bytes(b"not a compiled function")
    model, eager = compiled_block(path)
    x = torch.randn(1, 2, 6, 6, 6)
    with caplog.at_level(logging.WARNING, logger="optim.precompile"):
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
    assert precompiled_forward(model).status == "saved" and f"{path}: could not load" in caplog.text
    assert path.read_bytes() != b"not a compiled function"


def test_a_failing_aot_compile_leaves_the_lazy_compile(tmp_path, caplog, monkeypatch):
    def refuse(self, args, kwargs):
        raise RuntimeError("Graph breaks are not supported with aot compile.\nmore")

    monkeypatch.setattr(Precompiled, "_build", refuse)
    path = tmp_path / "block.aot"
    model, eager = compiled_block(path)
    x = torch.randn(1, 2, 6, 6, 6)
    with caplog.at_level(logging.WARNING, logger="optim.precompile"):
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
    forward = precompiled_forward(model)
    assert (forward.status, forward.lazy_calls, path.exists()) == ("lazy", 1, False)
    assert (f"{path}: no ahead-of-time compiled forward (RuntimeError: Graph breaks are not supported with aot "
            "compile.); compiling it lazily") in caplog.text


def test_a_forward_that_is_not_a_module_method_compiles_lazily(tmp_path, caplog):
    block = Block()
    forward = Precompiled(lambda x: block(x) * 2, {"backend": "inductor"}, tmp_path / "f.aot")
    x = torch.randn(1, 2, 4, 4, 4)
    with caplog.at_level(logging.WARNING, logger="optim.precompile"):
        torch.testing.assert_close(forward(x), block(x) * 2, rtol=1e-5, atol=1e-6)
    assert forward.status == "lazy" and "function is not a module's bound forward" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graphed_forward_is_saved_and_loaded_on_the_gpu(tmp_path):
    """``compile_cudagraphs`` with ``aot``: CUDA-graph trees over the saved function, loaded back, match eager."""
    path, x = tmp_path / "block.aot", torch.randn(1, 2, 8, 8, 8, device="cuda")
    for status in ("saved", "loaded"):
        torch.manual_seed(0)
        eager = Block().cuda()
        model = compile_model(Block().cuda().requires_grad_(False), mode="reduce-overhead", aot_file=path)
        model.load_state_dict(eager.state_dict())
        with torch.no_grad():
            outs = [model(x) for _ in range(3)]  # warm-up, recording, replay
            torch.testing.assert_close(outs[-1], eager(x), rtol=1e-4, atol=1e-5)
        forward = precompiled_forward(model)
        assert (forward.status, forward.lazy_calls) == (status, 0)
