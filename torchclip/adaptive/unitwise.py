"""ClipGradByUnitwiseNorm: adaptive gradient clipping, AGC (Brock et al., 2021, "High-Performance
Large-Scale Image Recognition Without Normalization"); timm's `adaptive_clip_grad` is the
specification. It keeps no state."""

from __future__ import annotations

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._arguments import _policy
from torchclip._gradients import Gradients, Route, kinds_of
from torchclip._messages import shown
from torchclip.adaptive._state import _check_positive, _NonfiniteGate, _targets_and_norms
from torchclip.clip_base import ClipGradBase


class ClipGradByUnitwiseNorm(_NonfiniteGate, ClipGradBase):
    r"""AGC: clip each output unit's gradient against the norm of its weights.

    For every parameter W with gradient G and each unit u (a row of the first dimension: an output
    unit of a Linear or ConvNd weight; the whole tensor for a bias or a gain), with max_u =
    max(||W_u||, eps) * clip_factor: G_u is unchanged where ||G_u|| < max_u, else scaled by
    max_u / max(||G_u||, 1e-6). Norms are of order `norm_type` (> 0; inf allowed), accumulated in float64.

    On the CPU one fused op reads every weight and gradient once (all units of all parameters in one
    norm pass) and writes only the units it clips; timm's `adaptive_clip_grad` runs about nine ops per
    parameter with two full-size temporaries. Elsewhere (CUDA, DTensors, subclasses) the same rule runs
    as per-parameter torch ops, out of place where DTensor needs it (an in-place clamp of a partial
    reduction has no sharding strategy).

    `nonfinite`, for a NaN or inf gradient: "propagate" (the default) is timm's rule and costs nothing:
    the unit's gradient turns NaN, and as AGC keeps no state nothing else is spoiled (`found_nonfinite`
    is not set: no whole-gradient norm is taken). "skip" and "raise" take each gradient's L2 norm first,
    one more read of the gradients (and on a GPU one flag read on the host): where one is NaN or inf,
    "skip" changes no gradient, sets `found_nonfinite` and an optimizer hook skips the step; "raise"
    raises a RuntimeError before any change.

    Args:
        clip_factor: a unit's gradient norm is clipped to clip_factor times its weights' norm (> 0).
        eps: the smallest weight norm a unit is given (>= 0), so zero-initialised units still learn.
        norm_type: the norm's order p (> 0, inf allowed).
        nonfinite: "propagate", "skip" or "raise", as above.
        exact: each unit's norm (orders 1 and 2) the true norm rounded once; None: the process-wide
            setting (`torchclip.set_exact_norm`). True needs plain CPU tensors.

    Raises:
        ValueError: a number out of its range; an unknown `nonfinite`; exact=True for gradients that are
            not plain CPU tensors (raised when clipping, before any change).
        TypeError: an argument of the wrong type.

    Example:
        >>> clip = torchclip.ClipGradByUnitwiseNorm(clip_factor=0.01)
        >>> torchclip.set_need_clip(model.fc, False)  # NFNets leave the classifier out
        >>> optimizer = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=clip)
    """

    def __init__(
        self,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        norm_type: float = 2.0,
        *,
        nonfinite: str = "propagate",
        exact: bool | None = None,
    ):
        self.clip_factor = _check_positive("clip_factor", clip_factor)
        self.eps = _check_positive("eps", eps, allow_zero=True)
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
            raise TypeError(f"norm_type must be a number, got {shown(norm_type)}")
        if not float(norm_type) > 0:
            raise ValueError(f"norm_type must be > 0 (inf allowed), got {shown(norm_type)}")
        self.norm_type = float(norm_type)
        self.nonfinite = _policy(nonfinite)
        self.exact = _ops.check_exact(exact, norm_type)

    def clip_gradients_(self, grads, params) -> None:  # (no C++ walk: the fused op runs on the lists)
        if not grads:
            return
        params = [p.detach() for p in params]
        on_kernels = all(Gradients(tensors, devices=("cpu",)).route is Route.KERNELS for tensors in (grads, params))
        if self.exact and self.norm_type in (1.0, 2.0) and not on_kernels:
            raise ValueError(
                "ClipGradByUnitwiseNorm: exact=True: unit norms are taken exactly of plain CPU tensors only so "
                f"far; got {kinds_of(grads)}"
            )
        if self.nonfinite != "propagate" and not self._admits(_targets_and_norms(grads, self.exact)[1]):
            return
        if on_kernels:
            _ops.unitwise_clip_(grads, params, self.clip_factor, self.eps, self.norm_type, self.exact)
            return
        for p, g in zip(params, grads):
            if g.shape != p.shape:
                raise ValueError(
                    f"ClipGradByUnitwiseNorm: a gradient of shape {tuple(g.shape)} belongs to a "
                    f"parameter of shape {tuple(p.shape)}"
                )
        for p, g in zip(params, grads):
            max_norm = _unit_norms(p, self.norm_type).clamp(min=self.eps) * self.clip_factor
            grad_norm = _unit_norms(g, self.norm_type)
            factor = torch.where(grad_norm < max_norm, torch.ones_like(grad_norm), max_norm / grad_norm.clamp(min=1e-6))
            g.mul_(factor.to(g.device, torch.float64 if g.dtype == torch.float64 else torch.float32))

    def __repr__(self):
        return f"{type(self).__name__}(clip_factor={self.clip_factor}, eps={self.eps}, norm_type={self.norm_type})"


def _unit_norms(t: Tensor, norm_type: float) -> Tensor:
    """Per-unit norms in float64, shaped to broadcast against t (timm's unitwise_norm, keepdim)."""
    if t.dim() <= 1:
        return torch.linalg.vector_norm(t, norm_type, dtype=torch.float64)
    return torch.linalg.vector_norm(t, norm_type, dim=tuple(range(1, t.dim())), keepdim=True, dtype=torch.float64)
