"""ClipGradByNormEMA: AdaGC (Wang et al., 2025, "AdaGC: Improving Training Stability for Large Language
Model Pretraining", arXiv:2502.11034), per-tensor clipping against an EMA of each tensor's own
clipped norms; the paper's algorithm is the specification (no package ships it)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._arguments import _policy
from torchclip.adaptive._state import (
    _check_count,
    _check_fraction,
    _check_positive,
    _check_state,
    _ParamRows,
    _scale,
    _StatefulClip,
    _targets_and_norms,
    _to_device,
)


def _adagc_rule(settings: ClipGradByNormEMA, norms: Tensor, gammas: Tensor, warming_up: bool) -> tuple[Tensor, Tensor]:
    """AdaGC's step under a clip's settings: (each gradient's clip coefficient, its new threshold) from the
    gradients' norms and their thresholds, float64 tensors on one device."""
    if warming_up:
        global_norm = torch.linalg.vector_norm(norms, 2.0)
        coefficient = torch.clamp(settings.lambda_abs / global_norm, max=1.0)
        clipped = coefficient * norms
        new_gammas = torch.minimum(gammas, clipped)
        # An inf global norm scales every gradient by 0: no threshold learns from that.
        remembered = torch.isfinite(clipped) & torch.isfinite(global_norm)
    else:
        coefficient = torch.where(norms > 0, torch.clamp(settings.lambda_rel * gammas / norms, max=1.0), 1.0)
        clipped = coefficient * norms
        new_gammas = torch.where(torch.isinf(gammas), norms, settings.beta * gammas + (1 - settings.beta) * clipped)
        remembered = torch.isfinite(clipped)
    # A NaN or inf norm is scaled as torch scales it (the gradient turns NaN) but not remembered.
    return coefficient, torch.where(remembered, new_gammas, gammas)


class ClipGradByNormEMA(_StatefulClip):
    r"""AdaGC: clip each gradient against an EMA of its own clipped norms (Wang et al., 2025).

    With g_i a tensor's gradient and gamma_i its threshold state (+inf at first):

    * warm-up (the first `warmup_steps` calls): global clipping, h = min(lambda_abs / ||g||, 1) with
      ||g|| the global L2 norm, g_i <- h * g_i, and gamma_i <- min(gamma_i, ||h * g_i||).
    * after: h_i = min(lambda_rel * gamma_i / ||g_i||, 1), g_i <- h_i * g_i, and
      gamma_i <- beta * gamma_i + (1 - beta) * ||h_i * g_i||.

    Where the paper is silent: a tensor first met after warm-up is not clipped and starts its EMA at
    its own norm (gamma would otherwise stay +inf), and a zero gradient is left alone (h = 1, where
    the formula gives 0/0); a NaN or inf norm leaves its threshold as it was, and in warm-up, where an
    inf norm makes h = 0, every threshold (min(gamma_i, 0) would hold them all at 0 for good).
    `last_norms` (before clipping) and `last_clip_coef` (h, one per tensor after warm-up) are the last
    call's, `gammas` the thresholds, all on the gradients' device.

    Thresholds are kept per parameter object (see _ParamRows): name the parameters themselves,
    `clip(model.parameters())` or `[(p, p.grad) for p in model.parameters()]`. Objects that are new at
    every call (pairs built from p.detach(), functional training) cannot be told apart across calls:
    their thresholds go by position in the list while its length and shapes match the last call's, and
    start anew where they differ; the clip warns once. A dead parameter's threshold is reused.

    `nonfinite`, for a NaN or inf norm of any gradient: "propagate" (the default, as for every adaptive
    clip, and reading nothing back from a GPU) scales by it as torch does (the gradients turn NaN), the
    step count moves on and the thresholds keep as above. "skip" leaves the call out: no gradient is
    scaled, no threshold or step count moves, `found_nonfinite` is set and an optimizer hook skips the
    step. "raise" raises a RuntimeError before any change. "skip" and "raise" read one flag per call on
    the host (on a GPU, a sync).

    Args:
        lambda_rel: after warm-up, each gradient is clipped to lambda_rel times its threshold (> 0).
        beta: the thresholds' EMA coefficient, in [0, 1).
        warmup_steps: calls of global clipping first (>= 0).
        lambda_abs: the global norm bound during warm-up (> 0).
        nonfinite: "propagate", "skip" or "raise", as above.
        exact: exact norms (the true norm rounded once; see `torchclip.ClipGradByNorm`); None: the
            process-wide setting.

    Raises:
        ValueError: a number out of its range; an unknown `nonfinite`.
        TypeError: an argument of the wrong type.

    Example:
        >>> clip = torchclip.ClipGradByNormEMA(warmup_steps=100)
        >>> optimizer = torchclip.optim.AdamW(model.parameters(), lr=1e-3, grad_clip=clip)
    """

    def __init__(
        self,
        lambda_rel: float = 1.05,
        beta: float = 0.98,
        warmup_steps: int = 100,
        lambda_abs: float = 1.0,
        *,
        nonfinite: str = "propagate",
        exact: bool | None = None,
    ):
        self.lambda_rel = _check_positive("lambda_rel", lambda_rel)
        self.beta = _check_fraction("beta", beta, low_open=False, high_open=True)
        self.warmup_steps = _check_count("warmup_steps", warmup_steps, minimum=0)
        self.lambda_abs = _check_positive("lambda_abs", lambda_abs)
        self.nonfinite = _policy(nonfinite)
        self.exact = _ops.check_exact(exact)
        self.steps = 0
        self.gammas = torch.empty(0, dtype=torch.float64)  # one per parameter, see _ParamRows
        self._rows = _ParamRows()
        self.last_norms: Tensor | None = None
        self.last_clip_coef: Tensor | None = None

    def clip_gradients_(self, grads, params) -> None:
        if not grads:
            return
        grads, norms = _targets_and_norms(grads, self.exact)
        device = norms.device
        self.last_norms = norms
        if not self._admits(norms):
            self.last_clip_coef = torch.ones_like(norms)
            return
        self.gammas = self._on(self.gammas, device)
        index = _to_device(self._rows_of(params, device), device)
        warming_up = self.steps < self.warmup_steps
        coefficient, gammas = _adagc_rule(self, norms, self.gammas.index_select(0, index), warming_up)
        self.gammas.index_copy_(0, index, gammas)
        self.steps += 1
        self.last_clip_coef = coefficient
        _scale(grads, coefficient)

    def _fit_rows(self, count: int, reclaimed: list[int], device) -> None:
        if count > self.gammas.shape[0]:
            grow = torch.full((count - self.gammas.shape[0],), math.inf, dtype=torch.float64, device=device)
            self.gammas = torch.cat([self.gammas, grow])
        if reclaimed:
            self.gammas.index_fill_(0, _to_device(reclaimed, device), math.inf)

    def state_dict(self) -> dict[str, Tensor]:
        """The step count and the thresholds (one per parameter, see _ParamRows), as tensors."""
        return {"steps": torch.tensor(self.steps, dtype=torch.int64), "gammas": self.gammas.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        gammas = state.get("gammas") if isinstance(state, dict) else None
        rows = gammas.shape[0] if isinstance(gammas, Tensor) and gammas.dim() == 1 else -1
        _check_state(type(self).__name__, state, {"steps": (), "gammas": (rows,)})
        self.steps = int(state["steps"])
        self.gammas = state["gammas"].to(self.gammas.device, torch.float64, copy=True)
        self._rows = _ParamRows(rows)

    def __repr__(self):
        return (
            f"{type(self).__name__}(lambda_rel={self.lambda_rel}, beta={self.beta}, "
            f"warmup_steps={self.warmup_steps}, lambda_abs={self.lambda_abs})"
        )
