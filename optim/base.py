"""The recipe protocol: one optimisation, its hooks into the loop, and its honesty contract.

A recipe is a small object with the hooks a train/sample/bench loop actually has
(composer's ``Algorithm`` cut down to our loop, torchbench's forward-only AMP context):

* ``session()``         process-global switches; restores *exactly* what it changed, because
                          Hydra multirun runs every job in one process;
* ``prepare_model(m)``  once, before the optimiser/EMA are built (memory format, surgery, compile);
* ``prepare_input(x)``  per batch (memory format of 5-D inputs);
* ``forward_context()`` around forward + loss only (autocast), never backward/optimiser;
* ``grad_scaler(dev)``  fp16 only;
* ``optimizer_options()`` keyword arguments for the loop's ``torch.optim.Adam`` (fused kernel);
* ``inductor_options()`` inductor config the recipe needs from the stack's ``compile`` (a kernel form
                          that pays off only under one inductor setting asks for it here);
* ``loss_guard()``      the loop's non-finite-loss guard, when the recipe brings its own (fused Adam's
                          device-side skip); the stack's default reads the loss on the host;
* ``supported(device)`` ``(ok, reason)`` so a stack refuses an impossible recipe up front;
* ``supports_training(grad_accum)`` the same for the training loop's micro-batches per step;
* ``describe()``        JSON-able record of what was applied, logged with every result.

``exact`` means bit-identical numerics to the strict-FP32 baseline; otherwise ``tolerance``
(``{"rtol", "atol"}``) is what the contract test enforces, read as
``max|a - b| <= atol + rtol * max|b|`` (relative to the tensor's scale, because elementwise
relative error is meaningless for values near zero in reduced precision).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from optim.flags import set_flags


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


class UnsupportedRecipeError(RuntimeError):
    """A recipe cannot run on the requested device; the message carries the recipe's reason."""


class RecipeConflictError(ValueError):
    """Two recipes cannot be combined (or a recipe's options are invalid)."""


class Recipe:
    """Base class: every hook is a no-op, so a recipe overrides only what it changes.

    Class attributes:
        name: config/registry name (``configs/recipe/<name>.yaml``).
        exact: True when numerics are bit-identical to the strict-FP32 baseline.
        tolerance: ``{"rtol", "atol"}`` enforced by the contract test when not exact.
        stage: ordering key used by :class:`optim.RecipeStack` (lower runs ``prepare_model`` first).
        conflicts: names of recipes this one cannot be combined with.
        slow_first_call: the first forward pays seconds of work (compilation); test suites
            use it to mark the recipe's CPU contract test ``slow``.
    """

    name: ClassVar[str] = "recipe"
    exact: ClassVar[bool] = True
    tolerance: ClassVar[dict[str, float]] = {"rtol": 0.0, "atol": 0.0}
    stage: ClassVar[int] = 0
    conflicts: ClassVar[tuple[str, ...]] = ()
    slow_first_call: ClassVar[bool] = False

    def flags(self) -> dict[str, Any]:
        """Process-global backend flags (names from :data:`optim.flags.FLAGS`) the session sets."""
        return {}

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Process-global switches for a run: sets :meth:`flags`, restores them exactly on exit."""
        with set_flags(self.flags()):
            yield

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Transform the model once, before optimiser/EMA creation; default: unchanged."""
        return model

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """Transform one input batch; default: unchanged."""
        return x

    def forward_context(self) -> contextlib.AbstractContextManager[None]:
        """Context around forward + loss only; default: none."""
        return contextlib.nullcontext()

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler | None:
        """A loss scaler when the recipe needs one (fp16 autocast); default: None."""
        return None

    def optimizer_options(self) -> dict[str, Any]:
        """Keyword arguments the loop passes to ``torch.optim.Adam``; default: none."""
        return {}

    def inductor_options(self) -> dict[str, Any]:
        """Inductor config for the stack's ``compile`` (its own ``inductor`` option wins); default: none."""
        return {}

    def loss_guard(self) -> Any | None:
        """A guard ``(loss, optimizer) -> run backward and step?`` with a ``skipped`` count; default: none."""
        return None

    def supported(self, device: DeviceInfo | torch.device | str | None) -> tuple[bool, str]:
        """Whether the recipe can run on ``device``; ``(False, reason)`` otherwise."""
        return True, ""

    def supports_training(self, grad_accum: int) -> tuple[bool, str]:
        """Whether the training loop can run the recipe with ``grad_accum`` micro-batches per optimiser step."""
        return True, ""

    def options(self) -> dict[str, Any]:
        """The recipe's constructor options (JSON-able), for ``describe()``."""
        return {}

    def describe(self) -> dict[str, Any]:
        """JSON-able record of this recipe: name, exactness, options, and what it applied."""
        return {"name": self.name, "exact": self.exact, "tolerance": dict(self.tolerance),
                **self.options()}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"


def cuda_capability_at_least(device: DeviceInfo, major: int, what: str) -> tuple[bool, str]:
    """Shared ``supported()`` rule for features gated on a CUDA compute capability.

    Off CUDA the feature is supported as a no-op (see each card); on CUDA it needs
    ``capability >= (major, 0)``.
    """
    if device.type != "cuda" or device.capability is None:
        return True, ""
    if device.capability[0] >= major:
        return True, ""
    cc = ".".join(map(str, device.capability))
    return False, (f"{what} needs CUDA compute capability >= {major}.0 (Ampere or newer); "
                   f"{device.name or 'this GPU'} has {cc}")
