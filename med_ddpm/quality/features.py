"""Pluggable 3-D feature extractors for FID / KID on volumes.

FID and KID compare distributions of *features*, so their meaning depends entirely on the
extractor. No 3-D network can be downloaded here, so two kinds are offered:

* :class:`RandomConv3dFeatures` (the default): a small 3-D CNN with a fixed-seed random
  initialisation. Random conv features are a fixed, deterministic nonlinear map, so two runs
  with the same seed give comparable numbers, but the values mean nothing across seeds,
  widths or papers. Its name carries ``(relative metric only)`` for that reason.
* :class:`MedicalNetFeatures`: a MedicalNet (Chen et al. 2019, "Med3D") 3-D ResNet built with
  MONAI's :func:`monai.networks.nets.resnet` layout and loaded from a user-given weights file
  (e.g. ``resnet_10_23dataset.pth``), the closest thing to an Inception network for 3-D MRI.

Example:
    >>> feats = RandomConv3dFeatures(seed=0)(torch.randn(4, 1, 32, 32, 32))   # (4, 240)

Every extractor treats each image channel as its own 1-channel volume and concatenates the
per-channel features, so 4-modality BraTS volumes work with single-channel networks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from med_ddpm.config_checks import CheckpointError

MEDICALNET_DEPTHS = (10, 18, 34, 50, 101, 152, 200)


class FeatureExtractor(nn.Module):
    """Maps volumes (B, C, D, H, W) to feature vectors (B, C·F), one channel at a time.

    Subclasses implement :meth:`extract` on single-channel volumes. ``relative_only`` says
    whether the features are meaningless outside this project's own comparisons.
    """

    name: str = "features"
    relative_only: bool = True

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        """(N, 1, D, H, W) float32 -> (N, F)."""
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 5:
            raise ValueError(f"{self.name}: expected volumes (B, C, D, H, W), got shape {tuple(x.shape)}")
        b, c = x.shape[:2]
        feats = self.extract(x.reshape(b * c, 1, *x.shape[2:]).float())
        return feats.reshape(b, -1)

    def describe(self) -> dict:
        """JSON-able identity of the extractor, stored next to every FID/KID number."""
        return {"name": self.name, "relative_only": self.relative_only}


class RandomConv3dFeatures(FeatureExtractor):
    """Fixed-seed random 3-D CNN: ``levels`` stride-2 conv+LeakyReLU stages, pooled per stage.

    The feature vector is the spatial mean of every stage's activations (width·(2^levels − 1)
    values), so both fine texture and coarse shape contribute. No normalisation layers: a
    random BatchNorm has no meaningful statistics, and the map must not depend on the batch.
    Initialised inside :func:`torch.random.fork_rng`, so building it never moves the
    caller's global RNG and the same seed always gives the same weights.

    Args:
        width: channels of the first stage; each later stage doubles it.
        levels: number of stride-2 stages (a 16³ volume supports 4).
        seed: the initialisation seed; numbers are comparable only for the same seed.
    """

    relative_only = True

    def __init__(self, width: int = 16, levels: int = 4, seed: int = 0):
        super().__init__()
        self.width, self.levels, self.seed = width, levels, seed
        self.name = f"random_cnn3d(w={width},l={levels},seed={seed}) (relative metric only)"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            chans = [1] + [width * 2**i for i in range(levels)]
            self.stages = nn.ModuleList(
                nn.Sequential(nn.Conv3d(cin, cout, 3, stride=2, padding=1), nn.LeakyReLU(0.2))
                for cin, cout in zip(chans[:-1], chans[1:])
            )
        self.requires_grad_(False).eval()

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        pooled = []
        for stage in self.stages:
            x = stage(x)
            pooled.append(x.mean(dim=(2, 3, 4)))
        return torch.cat(pooled, dim=1)

    def describe(self) -> dict:
        return {**super().describe(), "width": self.width, "levels": self.levels, "seed": self.seed}


class MedicalNetFeatures(FeatureExtractor):
    """MedicalNet 3-D ResNet (MONAI layout), global-average-pooled layer-4 features.

    MedicalNet was trained on z-scored volumes, so each volume is z-scored first
    (``normalize="zscore"``); pass ``"none"`` if the data already matches its training.
    Shortcut type and downsample bias follow MONAI's
    :func:`~monai.networks.nets.resnet.get_medicalnet_pretrained_resnet_args` (depth-dependent).

    Args:
        weights_path: a MedicalNet ``.pth`` file: ``{"state_dict": ...}`` with ``module.``
            prefixes (as released) or a bare state dict.
        depth: ResNet depth, one of 10, 18, 34, 50, 101, 152, 200.
        normalize: ``"zscore"`` (per volume) or ``"none"``.
    """

    relative_only = False

    def __init__(self, weights_path: str | Path, depth: int = 10, normalize: str = "zscore"):
        super().__init__()
        from monai.networks.nets import resnet

        if depth not in MEDICALNET_DEPTHS:
            raise ValueError(f"MedicalNetFeatures: depth must be one of {MEDICALNET_DEPTHS}, got {depth}")
        if normalize not in ("zscore", "none"):
            raise ValueError(f"MedicalNetFeatures: normalize must be 'zscore' or 'none', got {normalize!r}")
        bias_downsample, shortcut_type = resnet.get_medicalnet_pretrained_resnet_args(depth)
        self.net = getattr(resnet, f"resnet{depth}")(
            spatial_dims=3, n_input_channels=1, feed_forward=False, conv1_t_size=7, conv1_t_stride=2,
            shortcut_type=shortcut_type, bias_downsample=bias_downsample,
        )
        self.net.load_state_dict(_medicalnet_state_dict(Path(weights_path), self.net))
        self.depth, self.normalize, self.weights_path = depth, normalize, str(weights_path)
        self.name = f"medicalnet_resnet{depth}"
        self.requires_grad_(False).eval()

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalize == "zscore":
            flat = x.flatten(1)
            mean, std = flat.mean(1), flat.std(1).clamp_min(1e-6)
            x = (x - mean.view(-1, 1, 1, 1, 1)) / std.view(-1, 1, 1, 1, 1)
        return self.net(x)

    def describe(self) -> dict:
        return {**super().describe(), "depth": self.depth, "weights_path": self.weights_path}


def _medicalnet_state_dict(path: Path, net: nn.Module) -> dict[str, torch.Tensor]:
    """Read a MedicalNet weights file and check its keys against ``net`` before loading."""
    if not path.is_file():
        raise CheckpointError(f"MedicalNet weights not found: {path}")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for corrupt / non-tensor pickles
        raise CheckpointError(f"{path}: cannot read MedicalNet weights ({err})") from err
    state = raw.get("state_dict", raw) if isinstance(raw, dict) else None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a state dict or {{'state_dict': ...}}, got {type(raw).__name__}")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    expected = set(net.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: keys do not match a MedicalNet resnet of this depth "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''})"
        )
    return state
