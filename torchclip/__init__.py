"""torchclip: fast, accurate gradient clipping for PyTorch.

Drop-ins for torch.nn.utils (same signatures, defaults, results and errors) and Paddle-style clip
classes usable as optimizer hooks (torchclip.optim), all on the same fused multi-tensor kernels.
`torchclip.patch()` installs the drop-ins into torch.nn.utils for code that cannot change its imports.
"""

from torchclip import optim
from torchclip._ops import cpu_capabilities, get_cpu_capability, set_cpu_capability
from torchclip.clip import (
    ClipGradBase,
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByValue,
    GradientClipByGlobalNorm,
    GradientClipByNorm,
    GradientClipByValue,
    exclude_from_clipping,
    set_gradient_clip,
    set_need_clip,
)
from torchclip.clip_grad import (
    clip_grad_norm,
    clip_grad_norm_,
    clip_grad_value_,
    clip_grads_with_norm_,
    get_total_norm,
    patch,
)

__version__ = "0.1.0"

__all__ = [
    "ClipGradBase",
    "ClipGradByGlobalNorm",
    "ClipGradByNorm",
    "ClipGradByValue",
    "GradientClipByGlobalNorm",
    "GradientClipByNorm",
    "GradientClipByValue",
    "exclude_from_clipping",
    "optim",
    "set_gradient_clip",
    "set_need_clip",
    "clip_grad_norm",
    "clip_grad_norm_",
    "clip_grad_value_",
    "clip_grads_with_norm_",
    "cpu_capabilities",
    "get_cpu_capability",
    "get_total_norm",
    "patch",
    "set_cpu_capability",
]
