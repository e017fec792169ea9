"""Paddle-style gradient clipping classes on torchclip's kernels.

Paddle's documentation is the specification (paddle.nn.ClipGradByValue / ClipGradByNorm /
ClipGradByGlobalNorm, the fluid-era GradientClipBy* names with a `need_clip` predicate, ParamAttr's
need_clip, set_gradient_clip). Where Paddle and torch differ, each API keeps its own:

* ClipGradByGlobalNorm scales by clip_norm / max(global_norm, clip_norm): no epsilon, unlike
  torch.nn.utils.clip_grad_norm_'s max_norm / (total_norm + 1e-6).
* A gradient is "clipped" by ClipGradByNorm only when its norm is strictly above clip_norm.
* The global norm is accumulated in float64 for every dtype (Paddle sums float16/bfloat16 squares in
  half precision) and kept, for logging, in float32, or float64 when a gradient is float64 (Paddle's
  rule); the scale is applied in each gradient's own dtype.

Both call forms work. `clip(params_grads)` takes (param, grad) pairs, as Paddle's optimizers pass
them, and returns the pairs whose grad is not None (dropped, as in Paddle); `clip(parameters)` clips
each `.grad` (parameters: an iterable of tensors, one tensor, or an nn.Module for its parameters).
Anything else is a TypeError saying what was given, before any gradient changes: a mapping
(dict(model.named_parameters()), a state_dict), a str, model.named_parameters()'s (name, param) pairs,
and a pair whose grad is a weight (the parameter itself, its memory, or another nn.Parameter), which
would otherwise be clipped in the weight's place. Either way the gradients are clipped in place (Paddle
returns new tensors holding the same values): the fused kernels write where the data is.
`clip.last_global_norm` (ClipGradByGlobalNorm) holds the last call's norm as a tensor on the gradients'
device: logging it needs no host sync.

need_clip: a parameter whose `need_clip` attribute is False (set it with `set_need_clip`) is neither
clipped nor counted in the global norm, as Paddle's ParamAttr(need_clip=False). The legacy classes'
`need_clip` predicate excludes too: a parameter is clipped only when its attribute (default True) and
the predicate (default: all) both allow it, so either one can exclude it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._arguments import _number, _policy, _positive_finite
from torchclip._gradients import Gradients, Route
from torchclip._messages import shown
from torchclip.clip_base import ClipGradBase
from torchclip.marks import exclude_from_clipping, gradient_clip_of, set_gradient_clip, set_need_clip

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "ClipGradBase",  # (torchclip/clip_base.py)
    "ClipGradByGlobalNorm",
    "ClipGradByNorm",
    "ClipGradByValue",
    "GradientClipByGlobalNorm",
    "GradientClipByNorm",
    "GradientClipByValue",
    "exclude_from_clipping",  # the marks and set_gradient_clip: torchclip/marks.py
    "gradient_clip_of",
    "set_gradient_clip",
    "set_need_clip",
]


class ClipGradByValue(ClipGradBase):
    """Clamp every gradient element to [min, max] (Paddle's `paddle.nn.ClipGradByValue`).

    Called with parameters (`clip(model.parameters())`, clipped in place) or with Paddle's
    `(param, grad)` pairs (clipped in place and returned, pairs whose grad is None dropped), or given as
    `grad_clip=` to a `torchclip.optim` optimizer. NaN stays NaN. Unlike Paddle's, the gradients are
    clipped in place (Paddle returns new tensors holding the same values).

    Args:
        max: the upper bound.
        min: the lower bound; None means -max (then max must be > 0).

    Raises:
        ValueError: min > max, max <= 0 without min, or a NaN bound.
        TypeError: a bound that is not a number.

    Example:
        >>> clip = torchclip.ClipGradByValue(max=1.0)
        >>> clip(model.parameters())
    """

    def __init__(self, max: float, min: float | None = None):
        upper = _number("max", max)
        if min is None:
            if not upper > 0:
                raise ValueError(f"ClipGradByValue: max must be > 0 when min is None, got max={shown(max)}")
            lower = -upper
        else:
            lower = _number("min", min)
            if lower > upper:
                raise ValueError(f"ClipGradByValue: min must be <= max, got min={shown(min)}, max={shown(max)}")
        if math.isnan(lower) or math.isnan(upper):
            raise ValueError(f"ClipGradByValue: bounds must not be NaN, got min={shown(lower)}, max={shown(upper)}")
        self.min, self.max = lower, upper

    def _clip_parameters(self, params):
        return _ops.clamp_grads_of_plain(params, self.min, self.max, honor_need_clip=True)

    def clip_gradients_(self, grads, params):
        Gradients(grads).clamp_(self.min, self.max)

    def __repr__(self):
        return f"{type(self).__name__}(min={self.min}, max={self.max})"


class ClipGradByNorm(ClipGradBase):
    """Clip each gradient by its own L2 norm (Paddle's `paddle.nn.ClipGradByNorm`).

    A gradient whose norm is <= clip_norm is unchanged; otherwise it is multiplied by clip_norm / norm.
    `last_norms` holds the last call's per-gradient norms (float64, before clipping), `last_clip_coef`
    the factors they were scaled by and `last_clipped_norms` the norms after clipping, on the gradients'
    device. The call forms are `ClipGradByValue`'s.

    Args:
        clip_norm: the largest norm a gradient keeps, a finite number > 0.
        nonfinite: what a NaN or inf norm does: "propagate" (scale by it, as Paddle), "raise" (a
            RuntimeError, no gradient changed) or "skip" (no gradient changed; an optimizer hook skips
            the step).
        exact: the norms exact (the true norm rounded once: the same bits for any thread count, list
            order or sharding); None: `torchclip.set_exact_norm`'s setting; True raises for gradients
            off the CPU.

    Raises:
        ValueError: clip_norm <= 0, NaN or inf; an unknown `nonfinite`.

    Example:
        >>> clip = torchclip.ClipGradByNorm(clip_norm=1.0)
        >>> clip(model.parameters())
        >>> clip.last_norms  # each gradient's norm before clipping
    """

    def __init__(self, clip_norm: float, *, nonfinite: str = "propagate", exact: bool | None = None):
        self.clip_norm = _positive_finite("clip_norm", clip_norm)
        self.nonfinite = _policy(nonfinite)
        self.exact = _ops.check_exact(exact)
        self.last_norms: Tensor | None = None

    def _clip_parameters(self, params):
        norms = _ops.clip_by_tensor_norm_of_plain(
            params, self.clip_norm, honor_need_clip=True, nonfinite=self.nonfinite, exact=self.exact
        )
        if norms is not None:
            self.last_norms = norms
            self._record(norms)
        return norms is not None

    def clip_gradients_(self, grads, params):
        if not grads:
            return
        gradients = Gradients(grads)
        if gradients.route is Route.KERNELS:
            self.last_norms = _ops.clip_by_tensor_norm_(grads, self.clip_norm, self.nonfinite, self.exact)
            self._record(self.last_norms)
            return
        norms = gradients.tensor_norms(exact=self.exact)
        finite = torch.isfinite(norms).all()
        if self.nonfinite == "raise" and not finite:  # raising needs the answer on the host
            raise RuntimeError(
                "ClipGradByNorm: a gradient's norm is non-finite (NaN or inf), so it cannot be "
                "clipped; no gradient was changed"
            )
        keep = ~finite if self.nonfinite == "skip" else torch.zeros((), dtype=torch.bool, device=norms.device)
        # As the kernel: unchanged only when norm <= clip_norm, so a NaN norm propagates.
        gradients.scale_(torch.where((norms <= self.clip_norm) | keep, torch.ones_like(norms), self.clip_norm / norms))
        self.last_norms = norms
        self._record(norms)

    @property
    def last_clip_coef(self) -> Tensor | None:
        """The last call's factor per gradient (float64): 1 where the norm is <= clip_norm (and for every
        gradient of a call that "skip" left unchanged), else clip_norm / norm. Computed on first read
        from last_norms, on their device: the clipping call itself pays nothing for it."""
        norms = self.last_norms
        if norms is None:
            return None
        unchanged = norms <= self.clip_norm
        if self.nonfinite == "skip":
            unchanged = unchanged | self.found_nonfinite.to(norms.device)
        return torch.where(unchanged, torch.ones_like(norms), self.clip_norm / norms)

    @property
    def last_clipped_norms(self) -> Tensor | None:
        """Each gradient's norm after the last call (float64), for logging beside last_norms: last_norms
        times last_clip_coef on their device, so no gradient is read again and no host sync is made."""
        coefficient = self.last_clip_coef
        return None if coefficient is None else self.last_norms * coefficient

    def __repr__(self):
        return f"{type(self).__name__}(clip_norm={self.clip_norm})"


def _walk_by_global_norm(
    params, max_norm: float, nonfinite: str, exact: bool | None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Paddle's global-norm rule (torch's with eps = 0: min(max_norm / global_norm, 1), the norm kept in at
    least float32) over the marked gradients of plain CPU or CUDA parameters, in one C++ walk: (the global
    norm, each gradient's norm, the coefficient), or None where the walk declines."""
    return _ops.clip_grad_norm_of_plain(
        params,
        max_norm,
        2.0,
        False,
        eps=0.0,
        norm_at_least_float32=True,
        honor_need_clip=True,
        nonfinite=nonfinite,
        keep_stats=True,
        exact=exact,
    )


def _clip_by_global_norm(
    gradients: Gradients, clip_norm: float, nonfinite: str, exact: bool | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Paddle's global-norm rule on gradients the kernels do not serve, in tensor ops: (the global norm,
    float32 or float64 for float64 gradients; each gradient's norm; the coefficient), the gradients scaled."""
    grads = gradients.tensors
    wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    norms, global_norm = gradients.norms(2.0, exact)
    global_norm = global_norm.to(wide)
    finite = torch.isfinite(global_norm)
    if nonfinite == "raise" and not finite:  # raising needs the answer on the host
        raise _nonfinite_global_norm()
    scale = clip_norm / torch.clamp(global_norm, min=clip_norm)
    if nonfinite == "skip":
        scale = torch.where(finite, scale, torch.ones_like(scale))
    gradients.scale_(scale)
    return global_norm, norms, scale.to(torch.float64)


def _fused_step_scale(
    norm: Tensor, finite: Tensor, found: Tensor, clip_norm: float, nonfinite: str, scaler_found: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """(grad_scale, found_inf) a fused step takes from the global norm (unscaled) and whether it is finite,
    and whether this clip refuses the step (`found`): grad_scale is 1 / Paddle's coefficient
    clip_norm / max(norm, clip_norm), inf or NaN for a non-finite norm, which the kernel's division turns
    into what scaling by 0 or NaN gives (nonfinite="propagate"); "skip" scales by 1 and adds its refusal
    to GradScaler's found_inf."""
    grad_scale = torch.clamp(norm / clip_norm, min=1.0)
    if nonfinite != "skip":
        return grad_scale, scaler_found
    grad_scale = torch.where(finite, grad_scale, torch.ones_like(grad_scale))
    skip = found.to(torch.float32)
    return grad_scale, skip if scaler_found is None else torch.maximum(scaler_found, skip.to(scaler_found.device))


def _fused_step_scale_on_host(norm: float, dtype: torch.dtype, clip_norm: float, nonfinite: str):
    """_fused_step_scale's numbers for a CPU norm (float32 or float64) and no GradScaler, in Python floats: (the
    kernel's grad_scale, the coefficient 1 / grad_scale, found), the same bits as its tensor ops (each result rounded
    once to the norm's dtype: a float64 quotient of two float32 values rounds to float32's correctly rounded one).
    The tensor ops are a dozen dispatches, each of which after the norm's memory pass ran with its code out of cache:
    about 0.15 ms of a folded step over 24 x 1M. None where clip_norm rounds to 0 (the tensor ops' division then)."""
    divisor = _rounded(clip_norm, dtype)
    if divisor == 0.0:
        return None
    scale = _rounded(norm / divisor, dtype)
    scale = max(scale, 1.0)  # (torch.clamp's min; a NaN stays: max keeps its first argument when none is greater)
    found = not math.isfinite(norm)
    if found and nonfinite == "skip":
        scale = 1.0
    return _rounded(scale, torch.float32), _rounded(1.0 / scale, dtype), found


def _rounded(value: float, dtype: torch.dtype) -> float:
    """value rounded to float32 as a C cast rounds it (to nearest, inf beyond its range), or as it is."""
    if dtype != torch.float32:
        return value
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # (Pythons whose pack refuses what rounds to inf)
        return math.copysign(math.inf, value)


def _nonfinite_global_norm() -> RuntimeError:
    return RuntimeError(
        "ClipGradByGlobalNorm: the global norm is non-finite (NaN or inf), so it cannot be clipped; no "
        "gradient was changed"
    )


class ClipGradByGlobalNorm(ClipGradBase):
    """Scale every gradient by clip_norm / max(global_norm, clip_norm) (paddle.nn.ClipGradByGlobalNorm).

    global_norm is the L2 norm of all clipped gradients together. On an optimizer, one clip object
    computes one global norm over every parameter it serves; clips given by set_gradient_clip that share
    a group_name compute one global norm together and must share clip_norm (Paddle's rule).

    For logging without a host sync, on the gradients' device: `last_global_norm` (the norm before
    clipping, float32, float64 for float64 gradients: Paddle's dtype for it), `last_clipped_norm` (the
    norm after clipping, the same dtype), `last_norms` (each gradient's norm, float64; None for sharded
    gradients, whose per-tensor norms would cost another collective) and `last_clip_coef` (the factor
    every gradient was scaled by, 0-d float64, the precision the kernels scale in: 1 when nothing was
    clipped).

    Args:
        clip_norm: the largest global norm allowed, a finite number > 0.
        group_name: clips given by `set_gradient_clip` with one group name share one global norm.
        auto_skip_clip: Paddle's flag to leave the gradients untouched where global_norm <= clip_norm;
            the scale is exactly 1 there (and the CPU kernel skips the write), so no result changes.
        nonfinite: what a NaN or inf norm does: "propagate", "raise" or "skip" (see `ClipGradByNorm`).
        process_group: torchclip only: the gradients are this rank's shard of the group's; every rank
            clips by the same global norm (see `torchclip.distributed`).
        exact: the norms exact (the true norm rounded once: the same bits for any thread count, list
            order or sharding); None: `torchclip.set_exact_norm`'s setting; True raises for gradients
            off the CPU.

    Raises:
        ValueError: clip_norm <= 0, NaN or inf; an unknown `nonfinite`.
        TypeError: a `group_name` that is not a str, an `auto_skip_clip` that is not a bool.

    Example:
        >>> optimizer = torchclip.optim.SGD(
        ...     model.parameters(), lr=0.1, grad_clip=torchclip.ClipGradByGlobalNorm(clip_norm=1.0)
        ... )
    """

    def __init__(
        self,
        clip_norm: float,
        group_name: str = "default_group",
        auto_skip_clip: bool = False,
        *,
        nonfinite: str = "propagate",
        process_group: ProcessGroup | None = None,
        exact: bool | None = None,
    ):
        self.clip_norm = _positive_finite("clip_norm", clip_norm)
        self.nonfinite = _policy(nonfinite)
        self.process_group = process_group
        self.exact = _ops.check_exact(exact)
        if not isinstance(group_name, str):
            raise TypeError(f"group_name must be a str, got {shown(group_name)}")
        if not isinstance(auto_skip_clip, bool):
            raise TypeError(f"auto_skip_clip must be a bool, got {shown(auto_skip_clip)}")
        self.group_name = group_name
        self.auto_skip_clip = auto_skip_clip
        self.last_global_norm: Tensor | None = None
        self.last_norms: Tensor | None = None
        self.last_clip_coef: Tensor | None = None

    def _keep(self, global_norm: Tensor, norms: Tensor | None, coefficient: Tensor) -> None:
        self.last_global_norm, self.last_norms, self.last_clip_coef = global_norm, norms, coefficient

    @property
    def last_clipped_norm(self) -> Tensor | None:
        """The global norm after the last call, in last_global_norm's dtype, for logging beside it: the
        norm times the coefficient on their device, so no gradient is read again and no host sync is
        made. After a folded fused step, whose gradients stay unclipped, it is the norm of what the
        step applied."""
        if self.last_global_norm is None:
            return None
        norm = self.last_global_norm
        return (norm * self.last_clip_coef.to(norm.device)).to(norm.dtype)

    def _clip_parameters(self, params):
        if self.process_group is not None:
            return False  # sharded clipping needs the (param, grad) pairs: the Python walk
        found = _walk_by_global_norm(params, self.clip_norm, self.nonfinite, self.exact)
        if found is not None:
            self._keep(*found)
            self._record(found[0])
        return found is not None

    def clip_gradients_(self, grads, params):
        gradients = Gradients(grads, params, process_group=self.process_group)
        gradients.refuse_exact(self.exact)
        if gradients.shards is not None:
            return self._clip_sharded(gradients)
        if not grads:
            return
        if gradients.route is Route.KERNELS:
            self._keep(
                *_ops.clip_grad_norm_(
                    grads,
                    self.clip_norm,
                    2.0,
                    False,
                    eps=0.0,
                    norm_at_least_float32=True,
                    nonfinite=self.nonfinite,
                    exact=self.exact,
                )
            )
        else:
            self._keep(*_clip_by_global_norm(gradients, self.clip_norm, self.nonfinite, self.exact))
        self._record(self.last_global_norm)

    def _clip_sharded(self, gradients: Gradients) -> None:
        global_norm = gradients.sharded_total_norm(2.0, self.nonfinite == "raise", self.exact)
        self._record(global_norm)
        skip = self.nonfinite == "skip" and not torch.isfinite(global_norm)
        coefficient = torch.ones_like(global_norm) if skip else torch.clamp(self.clip_norm / global_norm, max=1.0)
        self._keep(global_norm.to(torch.float32), None, coefficient.to(torch.float64))
        if not skip:
            gradients.scale_(coefficient)

    def fold_into_fused_step(
        self, params, scaler_scale: Tensor | None, scaler_found: Tensor | None, taken=None
    ) -> tuple[Tensor, Tensor | None] | None:
        """This clip handed to a fused optimizer step (torchclip.optim): the global norm of `params`'
        selected gradients, taken and written nowhere, turned into the (grad_scale, found_inf) the step's
        kernel divides each gradient by and skips on; None where the C++ walk declines (clip in place).
        scaler_scale / scaler_found: GradScaler's, while the gradients are still scaled. taken: a
        BackwardNorms whose measurements stand in for the walk's norms where it has them. Nothing is read
        back to the host, except a CPU norm (already there: no sync) and to raise under nonfinite="raise"; the
        last_* statistics are kept."""
        if self.process_group is not None:
            return None  # sharded clipping needs the (param, grad) pairs: the Python walk, in place
        raises_here = self.nonfinite == "raise" and scaler_found is None
        # GradScaler.unscale_ before its step (found_inf without grad_scale) rewrote every gradient with a
        # kernel that bumps no version counter: what backward measured is stale.
        unscaled = scaler_found is not None and scaler_scale is None
        walked = None if taken is None else taken.take(params, _ops.exact_norms(self.exact), stale=unscaled)
        if walked is not None and raises_here and not bool(torch.isfinite(walked[0])):
            raise _nonfinite_global_norm()
        if walked is None:
            # max_norm = inf scales by exactly 1, which the kernels skip; a non-finite norm must not scale by NaN.
            walked = _walk_by_global_norm(params, math.inf, "raise" if raises_here else "skip", self.exact)
        if walked is None:
            return None
        norm, norms = walked[:2]
        if scaler_scale is None and scaler_found is None and norm.is_cpu:
            on_host = _fused_step_scale_on_host(norm.item(), norm.dtype, self.clip_norm, self.nonfinite)
            if on_host is not None:
                grad_scale, coefficient, found = on_host
                self._record_found_on_host(found)
                self._keep(norm, norms, torch.scalar_tensor(coefficient, dtype=torch.float64))
                found_inf = torch.scalar_tensor(float(found)) if self.nonfinite == "skip" else None
                return torch.scalar_tensor(grad_scale, dtype=torch.float32), found_inf
        if scaler_scale is not None:
            norm = norm / scaler_scale.to(norm.device)
            norms = norms / scaler_scale.to(norms.device)
        finite = torch.isfinite(norm)
        nonfinite = ~finite
        found = nonfinite
        if scaler_found is not None:
            # What the clip acts on (raise, skip): a step the scaler skips is the scaler's, not the clip's. What
            # it records is the norm as it was, as without a scaler: found_nonfinite agrees with last_global_norm.
            found = nonfinite & (scaler_found.to(norm.device) == 0)
        if self.nonfinite == "raise" and not raises_here and bool(found):
            raise _nonfinite_global_norm()
        self._record_found(nonfinite, refused=found)
        grad_scale, found_inf = _fused_step_scale(norm, finite, found, self.clip_norm, self.nonfinite, scaler_found)
        self._keep(norm, norms, (1.0 / grad_scale).to(torch.float64))
        if scaler_scale is not None:
            grad_scale = grad_scale * scaler_scale.to(grad_scale.device)
        return grad_scale.to(torch.float32), found_inf

    def __repr__(self):
        return f"{type(self).__name__}(clip_norm={self.clip_norm}, group_name={self.group_name!r})"


# ---- the fluid-era names, with a need_clip predicate ------------------------------------------------


def _predicate(need_clip):
    if need_clip is not None and not callable(need_clip):
        raise TypeError(
            f"need_clip must be a function taking a parameter and returning True (clip it) or False, got {shown(need_clip)}"
        )
    return need_clip


class GradientClipByValue(ClipGradByValue):
    """`fluid.clip.GradientClipByValue`: ClipGradByValue plus a need_clip predicate.

    Args:
        max: the upper bound.
        min: the lower bound; None means -max.
        need_clip: a function of a parameter, True to clip its gradient; None clips every one. A
            parameter is clipped only when its `need_clip` mark (default True) and this both allow it.
    """

    def __init__(self, max: float, min: float | None = None, need_clip: Callable[[Tensor], bool] | None = None):
        super().__init__(max, min)
        self._need_clip_predicate = _predicate(need_clip)


class GradientClipByNorm(ClipGradByNorm):
    """`fluid.clip.GradientClipByNorm`: ClipGradByNorm plus a need_clip predicate.

    Args:
        clip_norm: the largest norm a gradient keeps.
        need_clip: a function of a parameter, True to clip its gradient; None clips every one.
        exact: exact norms (see `ClipGradByNorm`).
    """

    def __init__(
        self, clip_norm: float, need_clip: Callable[[Tensor], bool] | None = None, *, exact: bool | None = None
    ):
        super().__init__(clip_norm, exact=exact)
        self._need_clip_predicate = _predicate(need_clip)


class GradientClipByGlobalNorm(ClipGradByGlobalNorm):
    """`fluid.clip.GradientClipByGlobalNorm`: ClipGradByGlobalNorm plus a need_clip predicate.

    Args:
        clip_norm: the largest global norm allowed.
        group_name: clips given by `set_gradient_clip` with one group name share one global norm.
        need_clip: a function of a parameter, True to clip (and count) its gradient; None: every one.
        exact: exact norms (see `ClipGradByGlobalNorm`).
    """

    def __init__(
        self,
        clip_norm: float,
        group_name: str = "default_group",
        need_clip: Callable[[Tensor], bool] | None = None,
        *,
        exact: bool | None = None,
    ):
        super().__init__(clip_norm, group_name, exact=exact)
        self._need_clip_predicate = _predicate(need_clip)
