"""Per-sample gradient clipping for differentially private training (DP-SGD).

DP-SGD clips every sample's gradient, not the batch's, then sums the batch and adds Gaussian noise. Here that
is two passes over the per-sample gradients, each reading them once in their own dtype: `per_sample_norms`,
then `clip_and_accumulate_` (the noise and the division by the expected batch size folded into the second).
`patch_opacus()` makes Opacus's optimizers use them (docs/per-sample.md).
"""

from torchclip.per_sample._clip import (
    CLIP_RULES,
    STYLES,
    add_noise_,
    clip_and_accumulate_,
    clip_factors,
    per_sample_norms,
)
from torchclip.per_sample._opacus import patch_opacus

__all__ = [
    "CLIP_RULES",
    "STYLES",
    "add_noise_",
    "clip_and_accumulate_",
    "clip_factors",
    "patch_opacus",
    "per_sample_norms",
]
