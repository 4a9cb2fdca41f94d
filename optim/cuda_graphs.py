"""CUDA graphs for the denoiser step in sampling: capture once per input signature, then replay.

At batch 1 a 128³ U-Net step launches hundreds of kernels; replaying a captured graph removes
the per-kernel CPU launch cost. The wrapper keeps static input buffers, copies each call's
inputs in, replays, and returns a *clone* of the static output (the next replay overwrites it).
A new shape/dtype/autocast state triggers a new capture. Under autograd (training) it runs
eagerly: graphing a training step needs ``torch.cuda.make_graphed_callables`` with fixed sample
inputs and autocast caching off, which the loop does not provide; use ``compile`` with
``mode=reduce-overhead`` (inductor's cudagraph trees) to graph training instead.

Example:
    >>> model = graph_denoiser(model.cuda().eval())
    >>> with torch.no_grad():
    ...     eps = model(x_t, t)      # first call per shape captures, later calls replay
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from optim.base import DeviceInfo, Recipe
from optim.forward_override import override_forward, overrides


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    output: torch.Tensor


def _signature(args: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    device_type = args[0].device.type
    autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    return tuple((a.shape, a.dtype, a.device, a.stride()) for a in args) + autocast


class GraphedForward:
    """Callable that replays a CUDA graph of ``forward`` for positional CUDA tensor inputs."""

    def __init__(self, forward: Callable[..., torch.Tensor], warmup: int = 3) -> None:
        self.forward, self.warmup = forward, warmup
        self.graphs: dict[tuple[Any, ...], _Captured] = {}
        self.replays = 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        eager = (torch.is_grad_enabled() or kwargs or not args
                 or not all(isinstance(a, torch.Tensor) and a.is_cuda for a in args))
        if eager:
            return self.forward(*args, **kwargs)
        key = _signature(args)
        captured = self.graphs.get(key) or self._capture(key, args)
        for buffer, arg in zip(captured.inputs, args):
            buffer.copy_(arg)
        captured.graph.replay()
        self.replays += 1
        return captured.output.clone()

    def _capture(self, key: tuple[Any, ...], args: tuple[torch.Tensor, ...]) -> _Captured:
        inputs = [a.clone() for a in args]
        device_type = args[0].device.type
        # Autocast's weight-cast cache would hand the graph tensors freed when the outer
        # autocast exits; casting inside the graph keeps every buffer in the graph's pool.
        no_cache = torch.autocast(device_type, enabled=torch.is_autocast_enabled(device_type),
                                  dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), no_cache:  # warm-up: lazy inits, compile, cuDNN autotune
            for _ in range(self.warmup):
                self.forward(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), no_cache:
            output = self.forward(*inputs)
        self.graphs[key] = _Captured(graph, inputs, output)
        return self.graphs[key]


def _graphed(forward: Callable[..., torch.Tensor], warmup: int) -> GraphedForward:
    return GraphedForward(forward, warmup)


def graph_denoiser(model: nn.Module, warmup: int = 3) -> nn.Module:
    """Functional twin: replay CUDA graphs for ``model``'s grad-free calls (in place, same keys)."""
    override_forward(model, functools.partial(_graphed, warmup=warmup))
    return model


class CudaGraphs(Recipe):
    """Capture/replay the denoiser forward for sampling (CUDA only; eager under autograd).

    Bit-exact: replay runs the very kernels that eager mode would. Runs after ``compile`` in
    ``prepare_model`` (so it captures compiled kernels); conflicts with ``compile`` in
    ``reduce-overhead`` mode, which already captures graphs of its own.
    """

    name = "cuda_graphs"
    exact = True
    stage = 60

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self._model: nn.Module | None = None

    def prepare_model(self, model: nn.Module) -> nn.Module:
        self._model = graph_denoiser(model, self.warmup)
        return self._model

    def supported(self, device: DeviceInfo | torch.device | str | None) -> tuple[bool, str]:
        info = DeviceInfo.of(device)
        if info.type != "cuda":
            return False, f"CUDA graphs need a CUDA device, got {info.type!r}"
        return True, ""

    def options(self) -> dict[str, Any]:
        return {"warmup": self.warmup}

    def describe(self) -> dict[str, Any]:
        graphed = [o.fn for o in overrides(self._model)] if self._model is not None else []
        graphed = [g for g in graphed if isinstance(g, GraphedForward)]
        return {**super().describe(),
                "captured_signatures": sum(len(g.graphs) for g in graphed),
                "replays": sum(g.replays for g in graphed)}
