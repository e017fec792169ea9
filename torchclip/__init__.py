"""torchclip: fast, accurate gradient clipping for PyTorch.

Drop-ins for torch.nn.utils (same signatures, defaults, results and errors) and Paddle-style clip
classes usable as optimizer hooks (torchclip.optim), all on the same fused multi-tensor kernels.
`torchclip.patch()` installs the drop-ins into torch.nn.utils for code that cannot change its imports.
"""

from torchclip import optim
from torchclip._ops import cpu_capabilities, get_cpu_capability, get_exact_norm, set_cpu_capability, set_exact_norm
from torchclip.adaptive import (
    ClipGradByNormEMA,
    ClipGradByQuantile,
    ClipGradByUnitwiseNorm,
    ClipGradByZScore,
    SkipStepOnSpike,
)
from torchclip.clip import (
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByValue,
    GradientClipByGlobalNorm,
    GradientClipByNorm,
    GradientClipByValue,
)
from torchclip.clip_base import ClipGradBase
from torchclip.clip_grad import (
    NotATensorError,
    clip_grad_norm,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
)
from torchclip.marks import exclude_from_clipping, set_gradient_clip, set_need_clip
from torchclip.patching import patch
from torchclip.stats import grad_norm
from torchclip.tf_names import clip_by_global_norm, clip_by_norm, clip_by_value, global_norm

__version__ = "0.1.0"

# What the API reference's table documents (docs/reference.md), no more (tests/test_public_api.py).
__all__ = [
    "ClipGradBase",
    "ClipGradByGlobalNorm",
    "ClipGradByNorm",
    "ClipGradByNormEMA",
    "ClipGradByQuantile",
    "ClipGradByUnitwiseNorm",
    "ClipGradByValue",
    "ClipGradByZScore",
    "GradientClipByGlobalNorm",
    "GradientClipByNorm",
    "GradientClipByValue",
    "NotATensorError",
    "SkipStepOnSpike",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "cpu_capabilities",
    "exclude_from_clipping",
    "get_cpu_capability",
    "get_exact_norm",
    "get_total_norm",
    "global_norm",
    "grad_norm",
    "optim",
    "patch",
    "set_cpu_capability",
    "set_exact_norm",
    "set_gradient_clip",
    "set_need_clip",
]
