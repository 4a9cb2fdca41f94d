"""Optimisation recipes: named, composable, measurable speed-ups for train, sample and bench.

``RecipeStack([])`` is the strict-FP32 baseline; each recipe is one small class per file with a
functional twin and a :class:`Capabilities` record the stack reads (see ``optim/CARDS.md``).
``optim`` depends on torch only (never on med_ddpm). Triton is imported lazily, by the fused
GroupNorm on CUDA.
"""

from optim.amp import Amp, autocast_for, finite_or_skip
from optim.attention import AttentionCore
from optim.base import Capabilities, DeviceInfo, Recipe, RecipeConflictError, UnsupportedRecipeError
from optim.channels_last import ChannelsLast3d, is_channels_last_3d, to_channels_last_3d
from optim.checkpointing import Checkpointing, apply_checkpointing
from optim.compile import Compile, compile_model
from optim.cudnn_benchmark import CudnnBenchmark, cudnn_benchmark_enabled
from optim.dense_conv_grads import DenseConvGrads, use_dense_conv_grads
from optim.flags import effective_flags
from optim.fused_adam import DeviceFiniteGuard, FusedAdam, fused_adam_options, skip_update_if_non_finite
from optim.fused_groupnorm import FusedGroupNorm, FusedGroupNormAct, fuse_groupnorm
from optim.narrow_conv import NarrowConvGemm, gemm_narrow_convs
from optim.sdpa_attention import SdpaAttention, SdpaAttentionCore, use_sdpa_attention
from optim.stack import RecipeStack
from optim.tf32 import Tf32, tf32_enabled
from optim.torch_defaults import TorchDefaults, torch_defaults_enabled
from optim.upsample import GatherUpsample, use_gather_upsample

__all__ = [
    "Amp", "AttentionCore", "Capabilities", "ChannelsLast3d", "Checkpointing", "Compile", "CudnnBenchmark",
    "DenseConvGrads", "DeviceFiniteGuard", "DeviceInfo", "FusedAdam", "FusedGroupNorm", "FusedGroupNormAct",
    "GatherUpsample", "NarrowConvGemm", "Recipe", "RecipeConflictError", "RecipeStack", "SdpaAttention",
    "SdpaAttentionCore", "Tf32", "TorchDefaults", "UnsupportedRecipeError", "apply_checkpointing",
    "autocast_for", "compile_model", "cudnn_benchmark_enabled", "effective_flags", "finite_or_skip",
    "fuse_groupnorm", "fused_adam_options", "gemm_narrow_convs", "is_channels_last_3d",
    "skip_update_if_non_finite", "tf32_enabled", "to_channels_last_3d", "torch_defaults_enabled",
    "use_dense_conv_grads", "use_gather_upsample", "use_sdpa_attention",
]
