"""The recipe protocol: one optimisation, what it declares as data, and the few hooks a loop calls.

A recipe is a small object named by its config (``configs/recipe/<name>.yaml``). What the stack needs
to validate, order and combine recipes is data, a frozen :class:`Capabilities`; what changes the
computation is a hook (composer's ``Algorithm`` cut down to our loop):

* ``session()``         process-global state beyond :attr:`Capabilities.flags`, restored exactly on exit
                          (Hydra multirun runs every job in one process);
* ``prepare_model(m)``  once, before the optimiser/EMA are built (memory format, surgery, compile);
* ``prepare_input(x)``  per batch (memory format of 5-D inputs);
* ``forward_context()`` around forward + loss only (autocast), never backward/optimiser;
* ``optimizer_options()`` keyword arguments for the loop's ``torch.optim.Adam``;
* ``loss_guard()``      the loop's non-finite-loss guard, when the recipe brings its own.

``exact`` means bit-identical numerics to the strict-FP32 baseline; otherwise ``tolerance``
(``{"rtol", "atol"}``) is what the contract test enforces, read as
``max|a - b| <= atol + rtol * max|b|`` (relative to the tensor's scale, because elementwise
relative error is meaningless for values near zero in reduced precision).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

EXACT = {"rtol": 0.0, "atol": 0.0}


@dataclass(frozen=True)
class DeviceInfo:
    """What ``supported()`` needs to know about a device; constructible by hand for tests.

    Attributes:
        type: ``"cpu"`` or ``"cuda"`` (any ``torch.device`` type).
        capability: CUDA compute capability ``(major, minor)``; ``None`` off CUDA.
        name: human-readable device name, for messages only.
    """

    type: str
    capability: tuple[int, int] | None = None
    name: str = ""

    @classmethod
    def of(cls, device: DeviceInfo | torch.device | str | None) -> DeviceInfo:
        """Normalise a device spec; queries the driver only for real CUDA devices."""
        if isinstance(device, DeviceInfo):
            return device
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return cls("cuda", tuple(torch.cuda.get_device_capability(index)),
                       torch.cuda.get_device_name(index))
        return cls(device.type)


@dataclass(frozen=True)
class Capabilities:
    """What a recipe declares; :class:`optim.RecipeStack` reads it, no recipe is special-cased.

    Attributes:
        exact: bit-identical to the strict-FP32 baseline.
        tolerance: ``{"rtol", "atol"}`` the contract test enforces when not exact.
        stage: ordering key (lower runs ``prepare_model`` first).
        kind: at most one recipe of a kind per stack (``"amp"``, ``"compile"``); empty: the recipe's name.
        flags: process-global backend flags (names from :data:`optim.flags.FLAGS`) the session sets.
        inductor: inductor config the session sets for any compile in the stack (a compile recipe's
            own ``inductor`` option wins over it).
        devices: device types it runs on; ``None``: any.
        acts_on: device types on which it changes the computation; elsewhere it runs but is inert (``tf32``
            sets CUDA flags no CPU kernel reads), so a timed row of it there measures the baseline again.
            ``None``: every device it runs on.
        min_cuda_capability: CUDA compute capability major it needs on CUDA; 0: any.
        modules: importable packages it needs.
        requirement: what needs the device, for refusals (``"bfloat16 autocast"``).
        fix: what to do instead, appended to a refusal after ``"; "``.
        captures_graphs: replays CUDA graphs that reuse memory between replays, so gradients cannot be
            accumulated over micro-batches.
        scales_loss: needs a loss scaler (fp16 autocast).
        slow_first_call: the first call pays seconds of work (compilation); its CPU contract test is slow.
        pays_eagerly: speeds a network call up without a compiler, from the first call on, so the stack's eager form
            (:meth:`optim.RecipeStack.eager`, a job too small to compile) keeps it. False for a compiler, for a
            change whose gain comes only through one (a layout or a kernel form inductor fuses, slower eagerly) and
            for one that pays only over many calls (cuDNN's autotuning spends seconds on the first).
    """

    exact: bool = True
    tolerance: Mapping[str, float] = field(default_factory=lambda: dict(EXACT))
    stage: int = 0
    kind: str = ""
    flags: Mapping[str, Any] = field(default_factory=dict)
    inductor: Mapping[str, Any] = field(default_factory=dict)
    devices: tuple[str, ...] | None = None
    acts_on: tuple[str, ...] | None = None
    min_cuda_capability: int = 0
    modules: tuple[str, ...] = ()
    requirement: str = ""
    fix: str = ""
    captures_graphs: bool = False
    scales_loss: bool = False
    slow_first_call: bool = False
    pays_eagerly: bool = True

    def inert_on(self, device: DeviceInfo) -> bool:
        """True where the recipe runs but changes nothing (see ``acts_on``)."""
        return self.acts_on is not None and device.type not in self.acts_on

    def refusal(self, device: DeviceInfo) -> str:
        """Why the recipe cannot run on ``device`` (``"<reason>; <fix>"``), or ``""`` when it can."""
        what = self.requirement or "it"
        reason = ""
        if self.devices is not None and device.type not in self.devices:
            reason = f"{what} runs on {' or '.join(self.devices)} only, not {device.type}"
        elif device.type == "cuda" and device.capability and device.capability[0] < self.min_cuda_capability:
            cc = ".".join(map(str, device.capability))
            reason = (f"{what}: needs CUDA compute capability >= {self.min_cuda_capability}.0; "
                      f"{device.name or 'this GPU'} has {cc}")
        elif missing := [m for m in self.modules if importlib.util.find_spec(m) is None]:
            reason = f"{what}: needs the {', '.join(missing)} package, not installed here"
        return f"{reason}; {self.fix}" if reason and self.fix else reason


class UnsupportedRecipeError(RuntimeError):
    """A recipe cannot run on the requested device; the message carries the recipe's reason."""


class RecipeConflictError(ValueError):
    """Two recipes cannot be combined (or a recipe's options are invalid)."""


class Recipe:
    """Base class: every hook is a no-op, so a recipe overrides only what it changes.

    Attributes:
        name: the config name (``configs/recipe/<name>.yaml``); ``RecipeStack.from_config`` sets it
            from the config key, so errors name what the user typed.
        capabilities: the declared data; a recipe whose data depends on its options sets it in ``__init__``.
    """

    name: str = "recipe"
    capabilities: Capabilities = Capabilities()

    def supported(self, device: DeviceInfo | torch.device | str | None) -> tuple[bool, str]:
        """``(True, "")``, or ``(False, "<reason>; <fix>")`` from :meth:`Capabilities.refusal`."""
        reason = self.capabilities.refusal(DeviceInfo.of(device))
        return not reason, reason

    def session(self) -> contextlib.AbstractContextManager[None]:
        """Process-global state beyond the declared flags, restored on exit; default: none."""
        return contextlib.nullcontext()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Transform the model once, before optimiser/EMA creation; default: unchanged."""
        return model

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """Transform one input batch; default: unchanged."""
        return x

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        """Context around forward + loss only; default: none."""
        return contextlib.nullcontext()

    def optimizer_options(self) -> dict[str, Any]:
        """Keyword arguments the loop passes to ``torch.optim.Adam``; default: none."""
        return {}

    def loss_guard(self) -> Any | None:
        """A guard ``(loss, optimizer) -> run backward and step?`` with a ``skipped`` count; default: none."""
        return None

    def options(self) -> dict[str, Any]:
        """The recipe's constructor options (JSON-able), for ``describe()``."""
        return {}

    def describe(self) -> dict[str, Any]:
        """JSON-able record of this recipe: name, declared data, options, and what it applied."""
        caps = asdict(self.capabilities)
        return {"name": self.name, "exact": caps.pop("exact"), "tolerance": caps.pop("tolerance"),
                "capabilities": caps, **self.options()}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{self.name}({opts})"
