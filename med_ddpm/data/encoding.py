"""How a case becomes tensors: the variants' label sets and condition channels, label maps, and Med-DDPM's
intensity scaling. Pure tensor functions, shared by the NIfTI datasets (:mod:`med_ddpm.data.datasets`) and the
synthetic phantoms (:mod:`med_ddpm.data.phantoms`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from med_ddpm.config_checks import check_one_of


@dataclass(frozen=True)
class Variant:
    """What a Med-DDPM variant's tensors look like.

    Attributes:
        name: ``whole_head`` or ``brats``.
        image_channels: target channels (modalities).
        labels: label values a preprocessed mask may hold; 0 is background and gets no channel.
        signed_cond: condition channels in {-1, 1} (whole-head original) instead of {0, 1} (BraTS original).
    """

    name: str
    image_channels: int
    labels: tuple[int, ...]
    signed_cond: bool

    @property
    def cond_channels(self) -> int:
        return len(self.labels) - 1


VARIANTS = {
    "whole_head": Variant("whole_head", 1, (0, 1, 2), signed_cond=True),
    "brats": Variant("brats", 4, (0, 1, 2, 3, 4), signed_cond=False),
}
# a network's output channels name its data variant (checkpoints record no data config)
VARIANT_BY_IMAGE_CHANNELS = {v.image_channels: name for name, v in VARIANTS.items()}


def get_variant(name: str) -> Variant:
    check_one_of("data.variant", name, tuple(VARIANTS))
    return VARIANTS[name]


def plain_tensor(x: Any) -> torch.Tensor:
    """A plain ``torch.Tensor`` (MONAI's MetaTensor metadata dropped: items must collate and pickle cheaply).

    ``as_subclass`` is what ``MetaTensor.as_tensor`` calls; it is used here so that checking for a MetaTensor
    does not import MONAI.
    """
    return x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def labels_to_cond(labels: torch.Tensor, variant: Variant) -> torch.Tensor:
    """One-hot a (1, D, H, W) label map into the variant's condition channels.

    Channel k-1 holds label k; background has no channel. Whole-head channels are mapped by x*2-1 to
    {-1, 1} as in the original ``dataset.py`` (``full_channel_mask=True``); BraTS channels stay in {0, 1}.
    """
    from monai.transforms import AsDiscrete

    onehot = AsDiscrete(to_onehot=len(variant.labels))(plain_tensor(labels).reshape(1, *labels.shape[-3:]))
    cond = plain_tensor(onehot)[1:].float()
    return (cond * 2 - 1 if variant.signed_cond else cond).contiguous()


def remap_brats_raw_labels(seg: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
    """Raw BraTS labels {0, 1, 2, 4} -> Med-DDPM's {0..4} (BRATS.md, ``preprocess_brats_data.py``).

    Enhancing tumour 4 becomes 3, and background voxels inside the head (``t1 > -1`` after scaling to
    [-1, 1]) become the healthy-brain label 4.
    """
    out = seg.clone()
    out[seg == 4] = 3
    out[(seg == 0) & (t1 > -1)] = 4
    return out


def medddpm_slice_minmax(image: torch.Tensor) -> torch.Tensor:
    """Med-DDPM's intensity scaling: every slice along the third NIfTI axis min-maxed to [-1, 1] on its own.

    The original runs sklearn ``MinMaxScaler().fit_transform`` on the NIfTI array reshaped to (i*j, k), so
    each k-slice is one feature scaled to [0, 1] (a constant slice becomes 0), then applies x*2-1. The third
    NIfTI axis is the model's D axis (dim 1 of a (C, D, H, W) tensor). Computed in float64 like sklearn.
    """
    x = torch.as_tensor(image).double()
    lo = x.amin(dim=(2, 3), keepdim=True)
    span = x.amax(dim=(2, 3), keepdim=True) - lo
    span = torch.where(span == 0, torch.ones_like(span), span)  # sklearn's _handle_zeros_in_scale
    return ((x - lo) / span * 2 - 1).float()
