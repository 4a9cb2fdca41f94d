"""The Med-DDPM 3-D U-Net (guided-diffusion lineage), with the original's module names.

A faithful re-implementation of ``diffusion_model/unet.py`` of Med-DDPM (Dorjsembe et al.,
2024) so that original checkpoints load with ``strict=True`` once the ``denoise_fn.`` prefix
is stripped. The network predicts ε from ``cat([x_t, cond], dim=1)`` and the timestep; it
never sees the noise schedule.

Example:
    >>> net = UNet3D(in_channels=3, out_channels=1, model_channels=32,
    ...              channel_mult=(1, 1, 1, 1, 2), attention_ds=(8,))
    >>> eps = net(torch.randn(2, 3, 32, 32, 32), torch.tensor([0, 137]))

Differences from the original, all numerically neutral: attention is not wrapped in the
original's always-on gradient checkpoint (that drops autocast; checkpointing is the opt-in
``checkpointing`` recipe), and the attention product is an :class:`optim.attention.AttentionCore`
submodule so recipes can swap its kernel.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from optim.attention import AttentionCore

NORM_GROUPS = 32
TIME_EMBED_MAX_PERIOD = 1000  # Med-DDPM uses 1000, not guided-diffusion's 10000
INPUT_CONV = "input_blocks.0.0"  # the convolution that reads x_t (and the mask channels)


class GroupNorm32(nn.GroupNorm):
    """GroupNorm(32) evaluated in float32 and cast back, as the original ``GroupNorm32``.

    The statistics of a 32-channel group over a 128³ volume lose precision in half
    precision, so the original always normalises in fp32 whatever the input dtype.
    """

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__(NORM_GROUPS, channels, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: int = TIME_EMBED_MAX_PERIOD) -> torch.Tensor:
    """Sinusoidal embedding [cos(t·f), sin(t·f)], f_i = exp(−ln(max_period)·i/half) (cos first).

    Computed in float32 like the original (Vaswani et al. 2017, eq. in §3.5, with the
    Med-DDPM max period of 1000).
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepBlock(nn.Module):
    """A block whose forward also takes the timestep embedding."""

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class TimestepEmbedSequential(nn.Sequential):
    """Sequential that passes the timestep embedding to the children that take it."""

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        for layer in self:
            x = layer(x, emb) if isinstance(layer, TimestepBlock) else layer(x)
        return x


class ResBlock(TimestepBlock):
    """h = Conv(SiLU(GN(x))) + Lin(SiLU(emb)); h = Conv(Drop(SiLU(GN(h)))); out = skip(x) + h."""

    checkpoint_group: ClassVar[str] = "resblocks"

    def __init__(self, channels: int, emb_channels: int, dropout: float, out_channels: int | None = None):
        super().__init__()
        out_channels = out_channels or channels
        self.in_layers = nn.Sequential(
            GroupNorm32(channels), nn.SiLU(), nn.Conv3d(channels, out_channels, 3, padding=1)
        )
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, out_channels))
        self.out_layers = nn.Sequential(
            GroupNorm32(out_channels),
            nn.SiLU(),
            nn.Dropout(p=dropout),
            nn.Conv3d(out_channels, out_channels, 3, padding=1),
        )
        if out_channels == channels:
            self.skip_connection: nn.Module = nn.Identity()
        else:
            self.skip_connection = nn.Conv3d(channels, out_channels, 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        emb_out = self.emb_layers(emb).type(h.dtype)
        h = h + emb_out[(...,) + (None,) * (h.dim() - emb_out.dim())]
        return self.skip_connection(x) + self.out_layers(h)


class AttentionBlock(nn.Module):
    """Spatial self-attention over the D·H·W tokens, residual on the un-normalised input.

    qkv is a 1×1 Conv1d whose 3C output channels use the legacy per-head layout
    ``[q_h | k_h | v_h]`` (identical to ``[q | k | v]`` for the single head Med-DDPM uses).
    """

    checkpoint_group: ClassVar[str] = "attention"

    def __init__(self, channels: int, num_heads: int = 1):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"attention channels {channels} not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.norm = GroupNorm32(channels)
        self.qkv = nn.Conv1d(channels, channels * 3, 1)
        self.attention = AttentionCore()
        self.proj_out = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, *spatial = x.shape
        x_flat = x.reshape(b, c, -1)  # flattening order D, H, W
        qkv = self.qkv(self.norm(x_flat))  # (B, 3C, T)
        ch = c // self.num_heads
        q, k, v = qkv.reshape(b, self.num_heads, 3 * ch, -1).transpose(-1, -2).split(ch, dim=-1)
        a = self.attention(q, k, v)  # (B, heads, T, ch)
        h = self.proj_out(a.transpose(-1, -2).reshape(b, c, -1))
        return (x_flat + h).reshape(b, c, *spatial)


class Downsample(nn.Module):
    """Learned stride-2 3×3×3 convolution on all three axes (not average pooling)."""

    def __init__(self, channels: int):
        super().__init__()
        self.op = nn.Conv3d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class Upsample(nn.Module):
    """Trilinear ×2 (align_corners=False) then a 3×3×3 conv; guided-diffusion uses nearest.

    Checkpointed with ``checkpointing.level=all``: otherwise the conv keeps the interpolated
    tensor (8× the input) for its backward. ``interpolate`` is looked up on the instance, so the
    ``gather_upsample`` recipe can give it an atomic-free backward without touching the forward.
    """

    checkpoint_group: ClassVar[str] = "upsample"
    interpolation: ClassVar[str] = "trilinear_x2"  # the gather_upsample recipe swaps `interpolate`

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv3d(channels, channels, 3, padding=1)

    @staticmethod
    def interpolate(x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, size=[2 * s for s in x.shape[2:]], mode="trilinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.interpolate(x))


class UNet3D(nn.Module):
    """Med-DDPM's U-Net: ``forward(cat([x_t, cond], 1), t) -> ε``.

    Args:
        in_channels: image channels + mask channels (whole-head 1 + 2, BraTS 4 + 4).
        out_channels: predicted-ε channels (whole-head 1, BraTS 4).
        model_channels: base width (64 for the released models).
        channel_mult: width multiplier per resolution level.
        num_res_blocks: ResBlocks per level in the encoder (the decoder has one more).
        attention_ds: downsample rates that get attention after their ResBlocks; the
            middle block always has attention. Whole-head: (8,); BraTS effectively ().
        num_heads: attention heads (1 in Med-DDPM).
        dropout: dropout inside ResBlocks.
    """

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 1,
        model_channels: int = 64,
        channel_mult: Sequence[int] = (1, 1, 2, 3, 4),
        num_res_blocks: int = 1,
        attention_ds: Sequence[int] = (8,),
        num_heads: int = 1,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.config = dict(
            in_channels=int(in_channels),
            out_channels=int(out_channels),
            model_channels=int(model_channels),
            channel_mult=[int(m) for m in channel_mult],
            num_res_blocks=int(num_res_blocks),
            attention_ds=sorted(int(d) for d in attention_ds),
            num_heads=int(num_heads),
            dropout=float(dropout),
        )
        mc, emb_dim = model_channels, 4 * model_channels
        self.model_channels = mc
        self.time_embed = nn.Sequential(nn.Linear(mc, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))

        def res(ch_in: int, ch_out: int) -> ResBlock:
            return ResBlock(ch_in, emb_dim, dropout, ch_out)

        self.input_blocks = nn.ModuleList([TimestepEmbedSequential(nn.Conv3d(in_channels, mc, 3, padding=1))])
        skip_chans, ch, ds = [mc], mc, 1
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers: list[nn.Module] = [res(ch, mult * mc)]
                ch = mult * mc
                if ds in attention_ds:
                    layers.append(AttentionBlock(ch, num_heads))
                self.input_blocks.append(TimestepEmbedSequential(*layers))
                skip_chans.append(ch)
            if level != len(channel_mult) - 1:
                self.input_blocks.append(TimestepEmbedSequential(Downsample(ch)))
                skip_chans.append(ch)
                ds *= 2

        self.middle_block = TimestepEmbedSequential(res(ch, ch), AttentionBlock(ch, num_heads), res(ch, ch))

        self.output_blocks = nn.ModuleList()
        for level, mult in reversed(list(enumerate(channel_mult))):
            for i in range(num_res_blocks + 1):
                layers = [res(ch + skip_chans.pop(), mc * mult)]
                ch = mc * mult
                if ds in attention_ds:
                    layers.append(AttentionBlock(ch, num_heads))
                if level and i == num_res_blocks:
                    layers.append(Upsample(ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))

        self.out = nn.Sequential(GroupNorm32(ch), nn.SiLU(), nn.Conv3d(ch, out_channels, 3, padding=1))
        self.zero_init_residuals()

    def zero_init_residuals(self) -> None:
        """Zero the output conv, each ResBlock's last conv and each attention ``proj_out``, as the
        original does: every residual branch starts as the identity and a fresh net predicts ε = 0."""
        layers = [self.out[-1]]
        for m in self.modules():
            if isinstance(m, ResBlock):
                layers.append(m.out_layers[-1])
            elif isinstance(m, AttentionBlock):
                layers.append(m.proj_out)
        for layer in layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    @property
    def in_channels(self) -> int:
        return self.config["in_channels"]

    @property
    def out_channels(self) -> int:
        return self.config["out_channels"]

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Predict ε. ``x``: (B, C_in, D, H, W) = cat([x_t, cond]); ``t``: (B,) integer steps."""
        emb = self.time_embed(timestep_embedding(t, self.model_channels).type(x.dtype))
        skips = []
        h = x
        for block in self.input_blocks:
            h = block(h, emb)
            skips.append(h)
        h = self.middle_block(h, emb)
        for block in self.output_blocks:
            h = block(torch.cat([h, skips.pop()], dim=1), emb)
        return self.out(h)


MODEL_KEYS = (
    "in_channels",
    "out_channels",
    "model_channels",
    "channel_mult",
    "num_res_blocks",
    "attention_ds",
    "num_heads",
    "dropout",
)


def build_model(cfg: Mapping[str, Any]) -> UNet3D:
    """Build a :class:`UNet3D` from a ``model`` config node (extra keys such as image_size are ignored)."""
    return UNet3D(**{k: cfg[k] for k in MODEL_KEYS if k in cfg})
