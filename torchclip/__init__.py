"""torchclip: fast, accurate gradient clipping for PyTorch.

Drop-ins for torch.nn.utils (same signatures, defaults, results and errors), running on fused
multi-tensor kernels. `torchclip.patch()` installs them into torch.nn.utils for code that cannot
change its imports.
"""

from torchclip._ops import cpu_capabilities, get_cpu_capability, set_cpu_capability
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
