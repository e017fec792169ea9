"""ClipGradByZScore: ZClip (Kumar et al., 2025, "ZClip: Adaptive Spike Mitigation for LLM
Pre-Training"); the `zclip` package 1.0.0's `ZClip.step` is the specification."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._arguments import _policy
from torchclip.adaptive._state import (
    _COEFFICIENT_EPS,
    _check_bool,
    _check_choice,
    _check_count,
    _check_fraction,
    _check_positive,
    _check_state,
    _clip_coefficient,
    _divide,
    _scale,
    _StatefulClip,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _zclip_rule(settings: ClipGradByZScore, norm, mean, var, where):
    """ZClip's step after warm-up under a clip's settings: (coefficient, new mean, new var) from the global
    norm and the statistics, all Python floats, or all 0-d tensors with torch.where as `where`. The
    reference's order of operations, term by term."""
    std = var**0.5
    if settings.mode == "percentile":
        threshold = mean + settings.z_thresh * std
        spike = norm > threshold
    else:
        z = _divide(norm - mean, std + settings.eps)
        spike = z > settings.z_thresh
        if settings.clip_option == "adaptive_scaling":
            threshold = (mean + _divide(settings.z_thresh * std, z / settings.z_thresh)) * settings.clip_factor
        else:
            threshold = mean
    observed = where(spike, threshold, norm)
    # min(observed, max_grad_norm) with the reference's NaN rule: a NaN observed value stays NaN.
    cap = settings.max_grad_norm
    target = observed if cap is None else where(cap < observed, cap, observed)
    coefficient = where(norm > target, target / (norm + _COEFFICIENT_EPS), 1.0)
    new_mean = settings.alpha * mean + (1 - settings.alpha) * observed
    new_var = settings.alpha * var + (1 - settings.alpha) * (observed - new_mean) ** 2
    if settings.skip_update_on_spike:
        new_mean, new_var = where(spike, mean, new_mean), where(spike, var, new_var)
    return coefficient, new_mean, new_var


def _choose(condition: bool, a, b):
    """torch.where for Python values."""
    return a if condition else b


def _zclip_step(settings: ClipGradByZScore, norm: Tensor, mean: Tensor, var: Tensor) -> tuple[Tensor, ...]:
    """_zclip_rule on 0-d float64 tensors: on a device as tensor ops there; in host memory on Python floats,
    as zclip's (the read waits for nothing), where a dozen 0-d tensor ops would cost more than the norms."""
    if norm.device.type != "cpu":
        return _zclip_rule(settings, norm, mean, var, torch.where)
    step = _zclip_rule(settings, norm.item(), mean.item(), var.item(), _choose)
    return tuple(torch.tensor(x, dtype=torch.float64) for x in step)


class ClipGradByZScore(_StatefulClip):
    r"""ZClip: clip the global gradient norm where it is an outlier against an EMA of past norms.

    For the first `warmup_steps` calls the global L2 norm g_t is only recorded (and the gradients
    clipped to `max_grad_norm`, as torch's clip_grad_norm_ does); then mean and variance start as
    those norms' mean and population variance. After warm-up, with std = sqrt(var):

    * mode="zscore": z = (g_t - mean) / (std + eps). A spike is z > z_thresh; its threshold is
      (mean + z_thresh * std / (z / z_thresh)) * clip_factor with clip_option="adaptive_scaling", or
      mean with clip_option="mean".
    * mode="percentile": a spike is g_t > mean + z_thresh * std, which is then the threshold.

    The target norm is the threshold on a spike, else g_t, and at most `max_grad_norm` (None: no cap);
    the gradients are scaled by target / (g_t + 1e-6) where g_t exceeds it. Then, unless
    skip_update_on_spike and a spike, with x the threshold on a spike, else g_t:
    mean <- alpha * mean + (1 - alpha) * x, var <- alpha * var + (1 - alpha) * (x - mean)^2 (the
    updated mean, as the reference does).

    `last_global_norm` (float64, before clipping), `last_norms` (per tensor) and `last_clip_coef` are
    the last call's, and `mean`, `var` the statistics, all tensors on the gradients' device. A call
    with no gradient to clip changes nothing (the reference records a norm of 0 there).

    `nonfinite`, for a NaN or inf global norm: "propagate" (the default) is zclip's rule and reads nothing
    back from a GPU, but one such norm makes mean and var NaN for the rest of the run: no later spike is
    found again, and with max_grad_norm=None nothing is clipped again. "skip" leaves the call out (nothing
    scaled, mean, var and the step count kept, `found_nonfinite` set, an optimizer hook skips the step);
    "raise" raises a RuntimeError before any change. Both read one flag a call on the host (on a GPU, a
    sync); choose "skip" after `scaler.unscale_()`, where NaN steps are routine.

    Args:
        alpha: the EMA coefficient of mean and variance, in (0, 1).
        z_thresh: the z-score above which a norm is a spike (> 0).
        max_grad_norm: a cap on the target norm, also the warm-up's clip; None: no cap. The default, 1.0
            (zclip's), clips every step of a model whose usual norm is above it, hiding the adaptive rule.
        eps: added to std in the z-score (>= 0).
        warmup_steps: calls that only record the norm (>= 1).
        mode: "zscore" or "percentile".
        clip_option: "adaptive_scaling" or "mean" (mode="zscore").
        clip_factor: scales the adaptive threshold (> 0).
        skip_update_on_spike: leave mean and variance as they were on a spike.
        nonfinite: "propagate", "skip" or "raise", as above.
        exact: exact norms (the true norm rounded once; see `torchclip.ClipGradByNorm`); None: the
            process-wide setting.
        process_group: hand-sharded gradients: every rank takes the same global norm.

    Raises:
        ValueError: a number out of its range; an unknown mode, clip_option or `nonfinite`.
        TypeError: an argument of the wrong type.

    Example:
        >>> optimizer = torchclip.optim.AdamW(model.parameters(), lr=1e-3, grad_clip=torchclip.ClipGradByZScore())
    """

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        max_grad_norm: float | None = 1.0,
        eps: float = 1e-6,
        warmup_steps: int = 25,
        mode: str = "zscore",
        clip_option: str = "adaptive_scaling",
        clip_factor: float = 1.0,
        skip_update_on_spike: bool = False,
        *,
        nonfinite: str = "propagate",
        process_group: ProcessGroup | None = None,
        exact: bool | None = None,
    ):
        self.alpha = _check_fraction("alpha", alpha, low_open=True, high_open=True)
        self.z_thresh = _check_positive("z_thresh", z_thresh)
        self.max_grad_norm = None if max_grad_norm is None else _check_positive("max_grad_norm", max_grad_norm)
        self.eps = _check_positive("eps", eps, allow_zero=True)
        self.warmup_steps = _check_count("warmup_steps", warmup_steps)
        self.mode = _check_choice("mode", mode, ("zscore", "percentile"))
        self.clip_option = _check_choice("clip_option", clip_option, ("adaptive_scaling", "mean"))
        self.clip_factor = _check_positive("clip_factor", clip_factor)
        self.skip_update_on_spike = _check_bool("skip_update_on_spike", skip_update_on_spike)
        self.nonfinite = _policy(nonfinite)
        self.exact = _ops.check_exact(exact)
        self.process_group = process_group
        self.steps = 0  # calls that clipped gradients, counted on the host
        self.warmup_norms = torch.zeros(self.warmup_steps, dtype=torch.float64)
        self.mean = torch.zeros((), dtype=torch.float64)
        self.var = torch.zeros((), dtype=torch.float64)
        self.last_global_norm: Tensor | None = None
        self.last_norms: Tensor | None = None
        self.last_clip_coef: Tensor | None = None

    def _clip_parameters(self, params) -> bool:
        """CPU parameters: their norms from one C++ walk that writes nothing (max_norm = inf, and "skip"
        for a NaN or inf norm); the rule on the host; the gradients scaled only where it clips."""
        if self.process_group is not None or self.mean.device.type != "cpu":
            return False
        found = self._walk_cpu(params, math.inf, 0.0, "skip", self.exact)
        if found is None:
            return False
        coefficient = self._observe(*found)
        if coefficient is not None and coefficient.item() != 1.0:  # (in host memory: the read waits for nothing)
            _scale([p.grad for p in params if p.grad is not None and self.selects(p)], coefficient)
        return True

    def clip_gradients_(self, grads, params) -> None:
        if not grads and self.process_group is None:
            return
        grads, norms, norm = self._global_norm_of(grads, params)
        coefficient = self._observe(norms, norm)
        if coefficient is not None:
            _scale(grads, coefficient)

    def _observe(self, norms: Tensor | None, norm: Tensor) -> Tensor | None:
        """One call's rule on its norms (per tensor, or None for hand shards, and global): records them,
        moves the statistics on, and returns the clip coefficient; None for a call that nonfinite refuses."""
        device = norm.device
        if not self._admits(norm):  # nothing moves, nothing is scaled
            self.last_norms, self.last_global_norm = norms, norm
            self.last_clip_coef = torch.ones((), dtype=torch.float64, device=device)
            return None
        self.warmup_norms = self._on(self.warmup_norms, device)
        self.mean, self.var = self._on(self.mean, device), self._on(self.var, device)
        if self.steps < self.warmup_steps:
            self.warmup_norms[self.steps] = norm
            if self.steps + 1 == self.warmup_steps:  # the EMA starts from the warm-up's statistics
                self.mean = self.warmup_norms.mean()
                self.var = ((self.warmup_norms - self.mean) ** 2).mean()
            if self.max_grad_norm is None:
                coefficient = torch.ones((), dtype=torch.float64, device=device)
            else:
                coefficient = _clip_coefficient(self.max_grad_norm, norm)
        else:
            coefficient, self.mean, self.var = _zclip_step(self, norm, self.mean, self.var)
        self.steps += 1
        self.last_norms, self.last_global_norm, self.last_clip_coef = norms, norm, coefficient
        return coefficient

    def state_dict(self) -> dict[str, Tensor]:
        """The statistics and the step count, as tensors (torch.load(..., weights_only=True) reads it)."""
        return {
            "steps": torch.tensor(self.steps, dtype=torch.int64),
            "warmup_norms": self.warmup_norms.clone(),
            "mean": self.mean.clone(),
            "var": self.var.clone(),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        _check_state(
            type(self).__name__, state, {"steps": (), "warmup_norms": (self.warmup_steps,), "mean": (), "var": ()}
        )
        device = self.mean.device
        self.steps = int(state["steps"])
        self.warmup_norms = state["warmup_norms"].to(device, torch.float64, copy=True)
        self.mean = state["mean"].to(device, torch.float64, copy=True)
        self.var = state["var"].to(device, torch.float64, copy=True)

    def __repr__(self):
        return (
            f"{type(self).__name__}(alpha={self.alpha}, z_thresh={self.z_thresh}, "
            f"max_grad_norm={self.max_grad_norm}, warmup_steps={self.warmup_steps}, mode={self.mode!r}, "
            f"clip_option={self.clip_option!r})"
        )
