"""Opacus in one line: `torchclip.per_sample.patch_opacus()` makes Opacus's DPOptimizer (and every optimizer
that inherits its steps: DistributedDPOptimizer, DPPerLayerOptimizer and its distributed forms) clip,
accumulate and add noise with torchclip's kernels. What Opacus defines stays Opacus's: which parameters and
samples, the clip rule min(1, C / (n + 1e-6)), the per-layer bounds, the noise's standard deviation
(noise_multiplier * max_grad_norm) and generator, the scaling, the processed-gradient checks, the step hooks
and the privacy accounting. Secure mode (secure_mode=True) keeps Opacus's own noise; optimizers with their own
clip_and_accumulate (AdaClip, fast gradient clipping) keep theirs."""

from __future__ import annotations

from torchclip.patching import AttributePatch
from torchclip.per_sample._clip import add_noise_, clip_and_accumulate_


def _opacus_optimizers():
    try:
        from opacus.optimizers import optimizer as dp_optimizer
        from opacus.optimizers import perlayeroptimizer
    except ImportError as error:
        raise ImportError(f"patch_opacus() needs Opacus (pip install opacus): {error}") from error
    return dp_optimizer, perlayeroptimizer


class patch_opacus(AttributePatch):
    """Install torchclip's per-sample clipping into Opacus's optimizers until ``.undo()``, or for a block:

    Example:
        >>> torchclip.per_sample.patch_opacus()  # before or after make_private: the methods are the classes'
        >>> with torchclip.per_sample.patch_opacus():
        ...     optimizer.step()
    """

    def __init__(self) -> None:
        dp_optimizer, perlayeroptimizer = _opacus_optimizers()
        DPOptimizer = dp_optimizer.DPOptimizer
        DPPerLayerOptimizer = perlayeroptimizer.DPPerLayerOptimizer
        check, mark = dp_optimizer._check_processed_flag, dp_optimizer._mark_as_processed
        opacus_add_noise = DPOptimizer.add_noise

        def clip_by(self, max_norm, style: str) -> None:
            params = self.params
            for p in params:  # (before any write, where Opacus checks parameter by parameter)
                check(p.grad_sample)
            clip_and_accumulate_(params, max_norm, style=style)
            for p in params:
                mark(p.grad_sample)

        def clip_and_accumulate(self) -> None:
            clip_by(self, self.max_grad_norm, "flat")

        def clip_and_accumulate_per_layer(self) -> None:
            clip_by(self, self.max_grad_norms, "per_layer")

        def add_noise(self) -> None:
            if self.secure_mode:
                return opacus_add_noise(self)
            params = self.params
            for p in params:
                check(p.summed_grad)
            add_noise_(params, self.noise_multiplier * self.max_grad_norm, generator=self.generator)
            for p in params:
                mark(p.summed_grad)
            return None

        super().__init__(
            [
                (DPOptimizer, "clip_and_accumulate", clip_and_accumulate),
                (DPOptimizer, "add_noise", add_noise),
                (DPPerLayerOptimizer, "clip_and_accumulate", clip_and_accumulate_per_layer),
            ]
        )
