"""Negative controls for the quality gate: deliberately wrong denoisers it must catch.

A gate is only as good as its detection threshold, so the quality ladder runs these next to the
real recipe stacks and publishes which fail. They are :class:`optim.Recipe` objects (so a job
composes and labels them like a stack) but they live here and in ``configs/control/``, never in
``configs/recipe/``: nothing shipped can select them. Each wraps the network in ``prepare_model``:

* :class:`EpsScale`: ε·(1 + δ), a systematic scale error (``eps_scale(1.05)``);
* :class:`EpsNoise`: ε + N(0, σ²) on every call, random error with no bias (``eps_noise(0.05)``);
* :class:`SkipGroupNorm`: one GroupNorm replaced by the identity, a broken kernel
  (``skip_groupnorm(0)``).

Removing the x̂₀ clipping is a sampler option, not a network change: ``+sampler.clip_denoised=false``.

Example:
    python -m bench.sweep experiment=bench_smoke bench.quality=true +control=eps_scale recipe.eps_scale.factor=1.02
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn

from optim.base import Capabilities, Recipe


class _OutputMap(nn.Module):
    """``model`` followed by ``fn`` on its output (same call signature as the model)."""

    def __init__(self, model: nn.Module, fn):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.fn(self.model(*args, **kwargs))


class _Control(Recipe):
    """A test-only recipe: never exact, labelled with its parameters (the dataclass fields)."""

    capabilities = Capabilities(exact=False, tolerance={"rtol": float("inf"), "atol": float("inf")})

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @property
    def label(self) -> str:
        return f"{self.name}({', '.join(str(v) for v in self.options().values())})"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "label": self.label, "negative_control": True}


@dataclass
class EpsScale(_Control):
    """ε·``factor``: over- (factor > 1) or under-predicting the noise by a fixed fraction."""

    name: ClassVar[str] = "eps_scale"
    factor: float = 1.05

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return _OutputMap(model, lambda eps: eps * self.factor)


@dataclass
class EpsNoise(_Control):
    """ε + σ·z, z ~ N(0, I) drawn fresh on every call from a generator seeded once."""

    name: ClassVar[str] = "eps_noise"
    sigma: float = 0.05
    seed: int = 0
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    def _noise(self, eps: torch.Tensor) -> torch.Tensor:
        if self._generator is None or self._generator.device != eps.device:
            self._generator = torch.Generator(eps.device).manual_seed(self.seed)
        z = torch.randn(eps.shape, generator=self._generator, device=eps.device, dtype=torch.float32)
        return eps + self.sigma * z.to(eps.dtype)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return _OutputMap(model, self._noise)


@dataclass
class SkipGroupNorm(_Control):
    """The ``index``-th GroupNorm of the network (in ``named_modules`` order) replaced by the identity."""

    name: ClassVar[str] = "skip_groupnorm"
    index: int = 0

    def prepare_model(self, model: nn.Module) -> nn.Module:
        norms = [name for name, m in model.named_modules() if isinstance(m, nn.GroupNorm)]
        if not 0 <= self.index < len(norms):
            raise ValueError(f"skip_groupnorm: index {self.index} out of range; the model has {len(norms)} GroupNorms")
        parent, _, attr = norms[self.index].rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, nn.Identity())
        return model
