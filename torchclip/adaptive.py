"""Adaptive clipping: clips whose threshold follows the run, on torchclip's kernels.

* ClipGradByZScore: ZClip (Kumar et al., 2025, "ZClip: Adaptive Spike Mitigation for LLM
  Pre-Training"); the `zclip` package 1.0.0's `ZClip.step` is the specification.
* ClipGradByQuantile: AutoClip (Seetharaman et al., 2020, "AutoClip: Adaptive Gradient Clipping for
  Source Separation Networks"); the `autoclip` package 0.2.1's `QuantileClip` is the specification.
* ClipGradByNormEMA: AdaGC (Wang et al., 2025, "AdaGC: Improving Training Stability for Large Language
  Model Pretraining", arXiv:2502.11034), per-tensor clipping against an EMA of each tensor's own
  clipped norms; the paper's algorithm is the specification (no package ships it).
* SkipStepOnSpike: OLMo-core's spike skip (`olmo_core.optim.SkipStepOptimizer.get_step_factor`,
  ai2-olmo-core 3.0.0, its gradient-norm half): an optimizer hook skips the step whose global norm is
  more than sigma_factor standard deviations above the mean of a rolling window; a clip inside it
  clips the steps that go ahead.
* ClipGradByUnitwiseNorm: adaptive gradient clipping, AGC (Brock et al., 2021, "High-Performance
  Large-Scale Image Recognition Without Normalization"); timm's `adaptive_clip_grad` is the
  specification. It keeps no state.

All are ClipGradBase clips: `clip(parameters)`, `clip(pairs)`, `grad_clip=` on a torchclip.optim
optimizer or a param group, and need_clip all work as for ClipGradByGlobalNorm. Their statistics are
float64 tensors on the gradients' device, updated by tensor operations there: on a GPU a step never
reads a norm back to the host (the reference packages call .item() every step); on the CPU, where a
read waits for nothing, ZScore and the global Quantile run their rules on Python floats. Only the
number of calls so far, which the host knows, steers control flow (warm-up, the history ring's fill).
`state_dict()` holds tensors only, and a clip restored from it continues bit for bit, as does a copy
(copy.deepcopy, pickle, torch.save: see _ParamRows for per-parameter state). DTensor gradients are
clipped by their global norms (torchclip.distributed's one all_gather), so every rank keeps the same
statistics.

A NaN or inf norm: each clip takes `nonfinite`, as the norm-based Paddle classes do. "propagate" (the
default) is the reference packages' rule: the norm enters the statistics and scales the gradients, so
ZScore's mean and variance stay NaN for the rest of the run and a Quantile history gives NaN thresholds
until the norm leaves its window. "skip" leaves such a call out: no gradient is scaled, no statistic
moves, `found_nonfinite` is set and an optimizer hook skips the step; "raise" raises before any change.
Both read one flag per call on the host (on a GPU, a sync): the host counts the calls that enter the
statistics. Where clipping follows `scaler.unscale_()` (torch.amp), NaN and inf steps are routine: use
"skip" there.

Per-parameter state (ClipGradByQuantile's per-parameter histories, ClipGradByNormEMA's thresholds) is kept
per parameter object: pass the parameters themselves. Where a call names new objects every time (pairs
built from p.detach(), functional training), see _ParamRows: rows go by position, and the clip warns.
"""

from __future__ import annotations

import bisect
import copy
import math
import warnings

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from torchclip import _ops, _shards
from torchclip.clip import ClipGradBase, _policy, _tensor_norms, add_to_count

__all__ = ["ClipGradByNormEMA", "ClipGradByQuantile", "ClipGradByUnitwiseNorm", "ClipGradByZScore", "SkipStepOnSpike"]

# The epsilon both references add to the norm in the clip coefficient (torch's clip_grad_norm_'s).
_COEFFICIENT_EPS = 1e-6


def _targets_and_norms(grads: list[Tensor]) -> tuple[list[Tensor], Tensor]:
    """(the tensors to scale, each gradient's L2 norm in float64). DTensor gradients (FSDP2, tensor
    parallelism) are scaled in their local shards, and their norms are the global ones, the same on
    every rank (one all_gather of the local norms), so every rank takes the same decisions."""
    shards = _shards.dtensor_shards(grads)
    if shards is None:
        return grads, _tensor_norms(grads)
    return shards.local, _shards.global_tensor_norms(shards)


def _scale(grads: list[Tensor], scale: Tensor) -> None:
    """grads[i] *= scale (0-d) or scale[i] (1-d), rounded as torch's mul_; a scale of exactly 1 writes
    nothing on the CPU kernels, and a CPU scale of 1 (read without waiting) skips the call."""
    if not grads or (scale.dim() == 0 and scale.device.type == "cpu" and scale.item() == 1.0):
        return
    if _ops.kernels_serve(grads):
        _ops.multi_tensor_scale_(grads, scale)
        return
    for i, g in enumerate(grads):
        g.mul_((scale if scale.dim() == 0 else scale[i]).to(g.device))


def _clip_coefficient(max_norm: Tensor | float, norm: Tensor) -> Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient: min(max_norm / (norm + 1e-6), 1)."""
    return torch.clamp(max_norm / (norm + _COEFFICIENT_EPS), max=1.0)


def _to_device(values: list, device: torch.device) -> Tensor:
    """Host-known indices or flags as a tensor on `device`, copied without waiting for the device."""
    return torch.tensor(values).to(device, non_blocking=True)


def _divide(a, b):
    """a / b with IEEE's rules for floats too (Python raises on a zero divisor; torch and zclip's numbers
    reach one only where the quotient goes unused, as a threshold on a step with no spike)."""
    try:
        return a / b
    except ZeroDivisionError:
        return math.nan if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1.0, b)


def _check_fraction(name: str, value, low_open: bool, high_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    number = float(value)
    above = number > 0.0 if low_open else number >= 0.0
    below = number < 1.0 if high_open else number <= 1.0
    if not (above and below):
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")
    return number


def _check_positive(name: str, value, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and (number >= 0.0 if allow_zero else number > 0.0)):
        raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")
    return number


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return value


def _check_state(name: str, state: dict, expected: dict[str, tuple]) -> None:
    """A state_dict's keys and tensor shapes against this clip's own (before anything is loaded)."""
    if not isinstance(state, dict) or set(state) != set(expected):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{name}.load_state_dict: expected the keys {sorted(expected)}, got {got}")
    for key, shape in expected.items():
        value = state[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != shape:
            what = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"{name}.load_state_dict: {key} must be a tensor of shape {shape}, got {what}")


class _ParamRows:
    """Which row of a clip's per-parameter state belongs to which parameter.

    A row is keyed by the object a call names for the parameter (the parameter-list form's items, the
    pairs' first items), held weakly: tensors compare elementwise, and a dead object's row is handed to
    the next new one, its state started anew, so the state does not grow with objects that come and go.
    Restored rows (load_state_dict, pickling: weak references do not pickle, and a parameter pickled
    alongside is a new object) are taken again in the order parameters are next met, so a clip restored
    before the same training loop lines up with its parameters.

    Where a call names only new objects and none of the last call's is alive (pairs built from p.detach(),
    functional training that makes new tensors each step: nothing identifies a parameter across calls),
    the rows go by position to the last call's while the count and shapes match, and start anew where
    they differ; the clip warns once, as it then relies on the order of the list.
    """

    def __init__(self, count: int = 0):
        self.owners = WeakIdKeyDictionary()  # object -> row
        self.count = count  # rows in the clip's state
        self.claimed = 0  # rows from here to count were restored and wait for owners, in first-met order
        self.shapes: list[tuple | None] = [None] * count  # each row's parameter shape, for matching by position
        self.last: list[int] | None = None  # the last call's rows, in its order
        self.warned = False

    def rows_of(self, params: list[Tensor], who: str) -> tuple[list[int], list[int]]:
        """(each parameter's row, the rows handed on from dead objects, whose state must start anew)."""
        rows = [self.owners.get(p) for p in params]
        reclaimed = []
        if None in rows:
            rows, reclaimed = self._claim(params, rows, who)
        self.last = rows
        return rows, reclaimed

    def _claim(self, params: list[Tensor], rows: list, who: str) -> tuple[list[int], list[int]]:
        owned = set(self.owners.values())
        if self.claimed == self.count and self.last is not None and all(r is None for r in rows) \
                and owned.isdisjoint(self.last):
            if not self.warned:
                self.warned = True
                warnings.warn(f"{who}: every parameter this call names is a new object and none of the last "
                              f"call's is alive (e.g. pairs built from p.detach(), or functional training), so no "
                              f"parameter can be told across calls: per-parameter state goes by position in the "
                              f"list while the count and shapes match the last call's, and starts anew where they "
                              f"differ. Name the parameters themselves (model.parameters(), or [(p, p.grad) for p "
                              f"in model.parameters()]) to keep it per parameter", stacklevel=6)
            if len(params) == len(self.last) and all(
                    tuple(p.shape) == self.shapes[r] for p, r in zip(params, self.last)):
                for p, r in zip(params, self.last):
                    self.owners[p] = r
                return list(self.last), []
        free = [r for r in range(self.claimed - 1, -1, -1) if r not in owned]  # dead objects' rows, lowest last
        reclaimed = []
        for i, p in enumerate(params):
            if rows[i] is None:  # (looked up again: an object listed twice takes its first listing's row)
                rows[i] = self.owners.get(p)
            if rows[i] is None:
                rows[i] = self._new_row(p, free, reclaimed)
        return rows, reclaimed

    def _new_row(self, param: Tensor, free: list[int], reclaimed: list[int]) -> int:
        """A row for a parameter met for the first time: the next restored row, else a dead object's, else a
        new one."""
        if self.claimed < self.count:
            row = self.claimed
            self.claimed += 1
        elif free:
            row = free.pop()
            reclaimed.append(row)
        else:
            row = self.count
            self.count, self.claimed = self.count + 1, self.count + 1
            self.shapes.append(None)
        self.owners[param], self.shapes[row] = row, tuple(param.shape)
        return row

    def __getstate__(self) -> dict:
        """The rows without their owners: a copy takes them again in the order parameters are next met."""
        return {"count": self.count, "shapes": self.shapes, "warned": self.warned}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["count"])
        self.shapes, self.warned = list(state["shapes"]), state["warned"]

    def __deepcopy__(self, memo: dict):
        """A deepcopy's rows go to the copies of the parameters this deepcopy copied before the clip (its memo:
        a model copied with its optimizer, or a torchclip.optim optimizer alone), else stay with the same
        parameters, as a clip copied alone is used on them."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy({k: v for k, v in vars(self).items() if k != "owners"}, memo))
        copied.owners = WeakIdKeyDictionary()
        for param, row in self.owners.items():
            copied.owners[memo.get(id(param), param)] = row
        return copied


class _StatefulClip(ClipGradBase):
    """What the adaptive clips share: the Python walk (their rules need the gradient list; ZScore and the
    global Quantile take the C++ walk on CPU parameters), state tensors that follow the gradients to
    their device, the nonfinite policy and per-parameter rows."""

    def _clip_parameters(self, params) -> bool:
        return False  # the Python walk: ClipGradBase.__call__ then calls _clip_pairs

    @staticmethod
    def _walk_cpu(params, max_norm: float, eps: float, nonfinite: str) -> tuple[Tensor, Tensor] | None:
        """clip_grad_norm_'s C++ walk over CPU parameters, need_clip marks honoured: (each gradient's norm,
        the global norm in float64, as _global_norm_of computes it: the walk's total is in the gradients'
        dtype), or None where the gradients are elsewhere or the walk declines."""
        first = next((p.grad for p in params if isinstance(p, Tensor) and p.grad is not None), None)
        if first is None or first.device.type != "cpu":
            return None
        found = _ops.clip_grad_norm_of_plain(params, max_norm, 2.0, False, eps=eps, honor_need_clip=True,
                                             nonfinite=nonfinite, keep_stats=True)
        return None if found is None else (found[1], torch.linalg.vector_norm(found[1], 2.0))

    @staticmethod
    def _on(tensor: Tensor, device: torch.device) -> Tensor:
        # non_blocking: a host-to-device copy that does not wait for the device (the first call's state).
        return tensor if tensor.device == device else tensor.to(device, non_blocking=True)

    # Hand-sharded gradients (torchclip.distributed): the clips that need only the global norm take one.
    process_group = None

    def _global_norm_of(self, pairs) -> tuple[list[Tensor], Tensor | None, Tensor]:
        """(the tensors to scale, each gradient's L2 norm or None, the global L2 norm), float64. Hand
        shards (process_group) give the global norm alone: a tensor's pieces may live on several ranks.
        With a process group every rank calls, gradients or not: the norm is a collective."""
        grads = [g for _, g in pairs]
        if self.process_group is not None:
            shards = _shards.hand_shards(grads, [p for p, _ in pairs], self.process_group)
            return shards.local, None, _shards.sharded_norm(shards, 2.0, False)
        targets, norms = _targets_and_norms(grads)
        return targets, norms, torch.linalg.vector_norm(norms, 2.0)

    def _admits(self, norms: Tensor) -> bool:
        """Records found_nonfinite / nonfinite_steps for this call's norms and says whether they may enter
        the statistics and clip: always under "propagate"; under "skip" not where one is NaN or inf (the
        call then changes nothing); under "raise" such a call raises, before anything changes."""
        refused = self.nonfinite != "propagate" and not bool(torch.isfinite(norms).all())  # a sync on a GPU
        if refused and self.nonfinite == "raise":
            bad = int(torch.nonzero(~torch.isfinite(norms.reshape(-1)))[0])
            what = "the global norm" if norms.dim() == 0 else f"the norm of gradient {bad} (of {norms.numel()})"
            raise RuntimeError(f"{type(self).__name__}: {what} is {norms.reshape(-1)[bad].item()}, so it cannot be "
                               f"clipped (nonfinite='raise'); no gradient or statistic was changed")
        self._record(norms)
        return not refused

    def _rows_of(self, params: list[Tensor], device: torch.device) -> list[int]:
        """Each parameter's row in per-parameter state (see _ParamRows), the state made to fit them."""
        rows, reclaimed = self._rows.rows_of(params, type(self).__name__)
        self._fit_rows(self._rows.count, reclaimed, device)  # the clip's own: grow to count rows, clear reclaimed
        return rows


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

    `nonfinite`, for a NaN or inf global norm: "propagate" (the default) is zclip's rule, so that the
    clip is the reference step for step (tests/test_adaptive.py) and reads nothing back from a GPU, but
    one such norm makes mean and var NaN for the rest of the run: no later spike is found again, and
    with max_grad_norm=None nothing is clipped again. "skip" leaves the call out: no gradient is scaled,
    mean, var and the step count stay as they were, `found_nonfinite` is set and an optimizer hook skips
    the step. "raise" raises a RuntimeError before any change. Choose "skip" where NaN steps are routine
    (clipping after `scaler.unscale_()`); it reads one flag per call on the host (on a GPU, a sync).
    """

    def __init__(self, alpha: float = 0.97, z_thresh: float = 2.5, max_grad_norm: float | None = 1.0,
                 eps: float = 1e-6, warmup_steps: int = 25, mode: str = "zscore",
                 clip_option: str = "adaptive_scaling", clip_factor: float = 1.0,
                 skip_update_on_spike: bool = False, *, nonfinite: str = "propagate", process_group=None):
        self.alpha = _check_fraction("alpha", alpha, low_open=True, high_open=True)
        self.z_thresh = _check_positive("z_thresh", z_thresh)
        self.max_grad_norm = None if max_grad_norm is None else _check_positive("max_grad_norm", max_grad_norm)
        self.eps = _check_positive("eps", eps, allow_zero=True)
        self.warmup_steps = _check_count("warmup_steps", warmup_steps)
        if mode not in ("zscore", "percentile"):
            raise ValueError(f"mode must be 'zscore' or 'percentile', got {mode!r}")
        if clip_option not in ("adaptive_scaling", "mean"):
            raise ValueError(f"clip_option must be 'adaptive_scaling' or 'mean', got {clip_option!r}")
        self.mode, self.clip_option = mode, clip_option
        self.clip_factor = _check_positive("clip_factor", clip_factor)
        if not isinstance(skip_update_on_spike, bool):
            raise TypeError(f"skip_update_on_spike must be a bool, got {skip_update_on_spike!r}")
        self.skip_update_on_spike = skip_update_on_spike
        self.nonfinite = _policy(nonfinite)
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
        found = self._walk_cpu(params, math.inf, 0.0, "skip")
        if found is None:
            return False
        coefficient = self._observe(*found)
        if coefficient is not None and coefficient.item() != 1.0:  # (in host memory: the read waits for nothing)
            _scale([p.grad for p in params if p.grad is not None and self._wants(p)], coefficient)
        return True

    def _clip_pairs(self, pairs) -> None:
        if not pairs and self.process_group is None:
            return
        grads, norms, norm = self._global_norm_of(pairs)
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
            if self.steps + 1 == self.warmup_steps:
                self.mean = self.warmup_norms.mean()
                self.var = ((self.warmup_norms - self.mean) ** 2).mean()
            if self.max_grad_norm is None:
                coefficient = torch.ones((), dtype=torch.float64, device=device)
            else:
                coefficient = _clip_coefficient(self.max_grad_norm, norm)
        else:
            coefficient = self._after_warmup(norm)
        self.steps += 1
        self.last_norms, self.last_global_norm, self.last_clip_coef = norms, norm, coefficient
        return coefficient

    def _clip(self, grads):  # ClipGradBase's route always comes through _clip_pairs
        raise AssertionError("ClipGradByZScore clips through _clip_pairs")

    def _after_warmup(self, norm: Tensor) -> Tensor:
        """The clip coefficient after warm-up, and the EMA update. In host memory the numbers are read
        (it waits for nothing) and the rule runs on Python floats, as zclip's: a dozen 0-d tensor ops
        cost ~0.1 ms, 7% of a ResNet-50 norm pass on 2 cores. On a device it runs as tensor ops there."""
        if norm.device.type != "cpu":
            coefficient, self.mean, self.var = self._zclip_rule(norm, self.mean, self.var, torch.where)
            return coefficient
        coefficient, mean, var = self._zclip_rule(norm.item(), self.mean.item(), self.var.item(),
                                                  lambda c, a, b: a if c else b)
        self.mean = torch.tensor(mean, dtype=torch.float64)
        self.var = torch.tensor(var, dtype=torch.float64)
        return torch.tensor(coefficient, dtype=torch.float64)

    def _zclip_rule(self, norm, mean, var, where):
        """(coefficient, new mean, new var) from the norm and the statistics: all Python floats, or all
        0-d tensors with torch.where as `where`. The reference's order of operations, term by term."""
        std = var ** 0.5
        if self.mode == "percentile":
            threshold = mean + self.z_thresh * std
            spike = norm > threshold
        else:
            z = _divide(norm - mean, std + self.eps)
            spike = z > self.z_thresh
            if self.clip_option == "adaptive_scaling":
                threshold = (mean + _divide(self.z_thresh * std, z / self.z_thresh)) * self.clip_factor
            else:
                threshold = mean
        observed = where(spike, threshold, norm)
        # min(observed, max_grad_norm) with the reference's NaN rule: a NaN observed value stays NaN.
        target = observed if self.max_grad_norm is None else where(self.max_grad_norm < observed,
                                                                   self.max_grad_norm, observed)
        coefficient = where(norm > target, target / (norm + _COEFFICIENT_EPS), 1.0)
        new_mean = self.alpha * mean + (1 - self.alpha) * observed
        new_var = self.alpha * var + (1 - self.alpha) * (observed - new_mean) ** 2
        if self.skip_update_on_spike:
            new_mean, new_var = where(spike, mean, new_mean), where(spike, var, new_var)
        return coefficient, new_mean, new_var

    def state_dict(self) -> dict[str, Tensor]:
        """The statistics and the step count, as tensors (torch.load(..., weights_only=True) reads it)."""
        return {"steps": torch.tensor(self.steps, dtype=torch.int64), "warmup_norms": self.warmup_norms.clone(),
                "mean": self.mean.clone(), "var": self.var.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        _check_state(type(self).__name__, state,
                     {"steps": (), "warmup_norms": (self.warmup_steps,), "mean": (), "var": ()})
        device = self.mean.device
        self.steps = int(state["steps"])
        self.warmup_norms = state["warmup_norms"].to(device, torch.float64, copy=True)
        self.mean = state["mean"].to(device, torch.float64, copy=True)
        self.var = state["var"].to(device, torch.float64, copy=True)

    def __repr__(self):
        return (f"{type(self).__name__}(alpha={self.alpha}, z_thresh={self.z_thresh}, "
                f"max_grad_norm={self.max_grad_norm}, warmup_steps={self.warmup_steps}, mode={self.mode!r}, "
                f"clip_option={self.clip_option!r})")


class _SortedWindow:
    """The values of a history ring in ascending order, updated in O(log n) comparisons a call (bisect),
    with its NaNs counted apart (they have no place in an order)."""

    def __init__(self, values: list[float]):
        self.nans = sum(1 for v in values if math.isnan(v))
        self.values = sorted(v for v in values if not math.isnan(v))

    def replace(self, evicted: float | None, added: float) -> None:
        if evicted is not None:
            if math.isnan(evicted):
                self.nans -= 1
            else:
                del self.values[bisect.bisect_left(self.values, evicted)]
        if math.isnan(added):
            self.nans += 1
        else:
            bisect.insort(self.values, added)

    def quantile(self, q: float) -> float:
        """torch.quantile's (linear interpolation, and torch.lerp's two formulas); NaN if a value is."""
        if self.nans:
            return math.nan
        rank = q * (len(self.values) - 1)
        below, above = self.values[math.floor(rank)], self.values[math.ceil(rank)]
        weight = rank - math.floor(rank)
        return below + weight * (above - below) if weight < 0.5 else above - (above - below) * (1 - weight)


class ClipGradByQuantile(_StatefulClip):
    r"""AutoClip: clip to a quantile of the norms seen so far.

    Each call clips by torch.nn.utils.clip_grad_norm_'s rule, max_norm / (norm + 1e-6) where that is
    below 1, with max_norm the `quantile` (linear interpolation, torch.quantile's) of the last
    `history_length` norms before clipping, then records the new norm. The first call, with no
    history, clips nothing.

    global_threshold=False (the default, as the reference): every gradient has its own history and is
    clipped by its own norm; a parameter's first call with a gradient clips nothing. True: one history
    of the global L2 norm of all the gradients, which are scaled together.

    The histories are fixed-size float64 rings on the gradients' device (quantiles do not depend on
    order). `last_norms` holds the last call's norms (per tensor, or the global one).

    Per-parameter histories are kept per parameter object (see _ParamRows): name the parameters
    themselves, `clip(model.parameters())` or `[(p, p.grad) for p in model.parameters()]`. Objects that
    are new at every call (pairs built from p.detach(), functional training) cannot be told apart
    across calls: their histories go by position in the list while its length and shapes match the last
    call's, and start anew where they differ; the clip warns once. A dead parameter's history is reused.

    `nonfinite`, for a NaN or inf norm (the global one, or any gradient's): "propagate" (the default) is
    autoclip's rule, so that the clip is the reference step for step (tests/test_adaptive.py) and reads
    nothing back from a GPU, but the norm enters its history, whose quantile is then NaN: the gradients
    that history clips turn NaN for the next `history_length` calls. "skip" leaves the call out: no
    gradient is scaled, no history records a norm, `found_nonfinite` is set and an optimizer hook skips
    the step. "raise" raises a RuntimeError before any change. Choose "skip" where NaN steps are routine
    (clipping after `scaler.unscale_()`); it reads one flag per call on the host (on a GPU, a sync).
    """

    def __init__(self, quantile: float = 0.9, history_length: int = 1000, global_threshold: bool = False, *,
                 nonfinite: str = "propagate", process_group=None):
        self.quantile = _check_fraction("quantile", quantile, low_open=False, high_open=False)
        self.history_length = _check_count("history_length", history_length)
        if not isinstance(global_threshold, bool):
            raise TypeError(f"global_threshold must be a bool, got {global_threshold!r}")
        self.global_threshold = global_threshold
        self.nonfinite = _policy(nonfinite)
        if process_group is not None and not global_threshold:
            raise ValueError("ClipGradByQuantile: process_group needs global_threshold=True (a per-parameter history "
                             "needs each parameter's whole gradient, which hand shards split across ranks)")
        self.process_group = process_group
        # One row per history (one in global mode; per parameter, see _ParamRows, otherwise), NaN where
        # nothing was recorded yet; counts[row] on the host: how many norms the row has seen.
        self.history = torch.full((1 if global_threshold else 0, history_length), math.nan, dtype=torch.float64)
        self.counts: list[int] = [0] * self.history.shape[0]
        self._window: _SortedWindow | None = None  # the global history, sorted, for the host rule
        self._rows = _ParamRows()
        self.last_norms: Tensor | None = None

    def _clip_parameters(self, params) -> bool:
        """The global rule on CPU gradients in one C++ walk: autoclip's step is clip_grad_norm_ with the
        quantile as max_norm, and the quantile depends only on the norms before this call, so the host
        window gives it first and the walk then norms and clips in one call."""
        if not self.global_threshold or self.process_group is not None or self.history.device.type != "cpu":
            return False
        threshold = self._host_threshold()
        # "skip": the walk writes nothing for a NaN or inf norm, which only "propagate" scales by, after a first call.
        walk_nonfinite = "propagate" if threshold is not None and self.nonfinite == "propagate" else "skip"
        found = self._walk_cpu(params, math.inf if threshold is None else threshold, _COEFFICIENT_EPS, walk_nonfinite)
        if found is None:
            return False
        self._observe_global_on_host(found[1])
        return True

    def _clip_pairs(self, pairs) -> None:
        if not pairs and self.process_group is None:
            return
        if self.global_threshold:
            grads, _, norm = self._global_norm_of(pairs)
            if norm.device.type == "cpu":
                return self._clip_global_on_host(grads, norm)
            observed = norm.reshape(1)
        else:
            grads, observed = _targets_and_norms([g for _, g in pairs])
        self.last_norms = observed[0] if self.global_threshold else observed
        if not self._admits(self.last_norms):
            return
        device = observed.device
        self.history = self._on(self.history, device)
        rows = [0] if self.global_threshold else self._rows_of([p for p, _ in pairs], device)
        thresholds = self._thresholds(rows, device)
        scale = _clip_coefficient(thresholds, observed)
        self._record_norms(rows, observed, device)
        _scale(grads, scale[0] if self.global_threshold else scale)

    def _clip(self, grads):  # ClipGradBase's route always comes through _clip_pairs
        raise AssertionError("ClipGradByQuantile clips through _clip_pairs")

    def _clip_global_on_host(self, grads: list[Tensor], norm: Tensor) -> None:
        """The global rule where the norm is in host memory: read without waiting, and the quantile taken
        from a sorted copy of the window kept beside the ring. After a step's memory pass, torch.quantile
        and the 0-d ops around it ran with their code out of cache: ~0.25 ms a call, 12% of a ResNet-50
        norm pass on 2 cores. The arithmetic is the tensor rule's, in float64."""
        self.history = self._on(self.history, norm.device)
        value, threshold = norm.item(), self._host_threshold()
        coefficient = 1.0
        if threshold is not None:
            coefficient = _divide(threshold, value + _COEFFICIENT_EPS)
            coefficient = coefficient if not coefficient > 1.0 else 1.0  # torch.clamp's: NaN stays NaN
        if self._observe_global_on_host(norm) and coefficient != 1.0:
            _scale(grads, torch.tensor(coefficient, dtype=torch.float64))

    def _observe_global_on_host(self, norm: Tensor) -> bool:
        """Adds the global norm (0-d, in host memory) to the history and the sorted window where nonfinite
        admits it, and says whether it did."""
        self.last_norms = norm
        if not self._admits(norm):
            return False
        value, count = norm.item(), self.counts[0]
        slot = count % self.history_length
        self._host_window().replace(self.history[0, slot].item() if count >= self.history_length else None, value)
        self.history[0, slot] = value
        self.counts[0] += 1
        return True

    def _host_threshold(self) -> float | None:
        """The global rule's max_norm from the host window; None before any norm was recorded (the first
        call clips nothing)."""
        return self._host_window().quantile(self.quantile) if self.counts[0] > 0 else None

    def _host_window(self) -> _SortedWindow:
        if self._window is None:
            self._window = _SortedWindow(self.history[0, :min(self.counts[0], self.history_length)].tolist())
        return self._window

    def _fit_rows(self, count: int, reclaimed: list[int], device) -> None:
        if count > self.history.shape[0]:
            grow = torch.full((count - self.history.shape[0], self.history_length), math.nan,
                              dtype=torch.float64, device=device)
            self.history = torch.cat([self.history, grow])
            self.counts += [0] * grow.shape[0]
        if reclaimed:
            self.history.index_fill_(0, _to_device(reclaimed, device), math.nan)
            for r in reclaimed:
                self.counts[r] = 0

    def _thresholds(self, rows: list[int], device) -> Tensor:
        """quantile of each row's recorded norms; inf for a row with none."""
        filled = [min(self.counts[r], self.history_length) for r in rows]
        if all(f == filled[0] for f in filled):  # the usual case: every row has seen as many norms
            return self._quantiles(rows, filled[0], device)
        thresholds = torch.empty(len(rows), dtype=torch.float64, device=device)
        for count in set(filled):
            at = [i for i, f in enumerate(filled) if f == count]
            thresholds.index_copy_(0, _to_device(at, device), self._quantiles([rows[i] for i in at], count, device))
        return thresholds

    def _quantiles(self, rows: list[int], filled: int, device) -> Tensor:
        """The quantile of the first `filled` slots of each of `rows`, the norms they recorded (a ring
        fills in order, and order does not matter to a quantile): torch.quantile, the reference's, so a
        recorded NaN norm gives NaN as there. (nanquantile over whole rows cost ~0.1 ms a call.)"""
        if filled == 0:
            return torch.full((len(rows),), math.inf, dtype=torch.float64, device=device)
        if self._every_row_in_order(rows):
            window = self.history[:, :filled]
        else:
            window = self.history.index_select(0, _to_device(rows, device))[:, :filled]
        return torch.quantile(window, self.quantile, dim=1)

    def _every_row_in_order(self, rows: list[int]) -> bool:
        """Whether `rows` are all of the history's, in order: then a slice of it, no index tensors."""
        return rows == list(range(self.history.shape[0]))

    def _record_norms(self, rows: list[int], norms: Tensor, device) -> None:
        slots = [self.counts[r] % self.history_length for r in rows]
        if self._every_row_in_order(rows) and all(s == slots[0] for s in slots):
            self.history[:, slots[0]] = norms  # (no index tensors to build and copy)
        else:
            self.history.index_put_((_to_device(rows, device), _to_device(slots, device)), norms)
        for r in rows:
            self.counts[r] += 1

    def state_dict(self) -> dict[str, Tensor]:
        """The histories (a row per parameter, see _ParamRows) and their counts, as tensors."""
        return {"history": self.history.clone(), "counts": torch.tensor(self.counts, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        history = state.get("history") if isinstance(state, dict) else None
        rows = history.shape[0] if isinstance(history, Tensor) and history.dim() == 2 else -1
        _check_state(type(self).__name__, state, {"history": (rows, self.history_length), "counts": (rows,)})
        if self.global_threshold and rows != 1:
            raise ValueError(f"{type(self).__name__}.load_state_dict: a global clip has one history, got {rows}")
        self.history = state["history"].to(self.history.device, torch.float64, copy=True)
        self.counts = [int(c) for c in state["counts"].tolist()]
        self._window = None
        self._rows = _ParamRows(rows)

    def __repr__(self):
        return (f"{type(self).__name__}(quantile={self.quantile}, history_length={self.history_length}, "
                f"global_threshold={self.global_threshold})")


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
    """

    def __init__(self, lambda_rel: float = 1.05, beta: float = 0.98, warmup_steps: int = 100,
                 lambda_abs: float = 1.0, *, nonfinite: str = "propagate"):
        self.lambda_rel = _check_positive("lambda_rel", lambda_rel)
        self.beta = _check_fraction("beta", beta, low_open=False, high_open=True)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int):
            raise TypeError(f"warmup_steps must be an int, got {warmup_steps!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps
        self.lambda_abs = _check_positive("lambda_abs", lambda_abs)
        self.nonfinite = _policy(nonfinite)
        self.steps = 0
        self.gammas = torch.empty(0, dtype=torch.float64)  # one per parameter, see _ParamRows
        self._rows = _ParamRows()
        self.last_norms: Tensor | None = None
        self.last_clip_coef: Tensor | None = None

    def _clip_pairs(self, pairs) -> None:
        if not pairs:
            return
        grads, norms = _targets_and_norms([g for _, g in pairs])
        device = norms.device
        self.last_norms = norms
        if not self._admits(norms):
            self.last_clip_coef = torch.ones_like(norms)
            return
        self.gammas = self._on(self.gammas, device)
        index = _to_device(self._rows_of([p for p, _ in pairs], device), device)
        gamma = self.gammas.index_select(0, index)
        if self.steps < self.warmup_steps:
            global_norm = torch.linalg.vector_norm(norms, 2.0)
            coefficient = torch.clamp(self.lambda_abs / global_norm, max=1.0)
            clipped = coefficient * norms
            new_gamma = torch.minimum(gamma, clipped)
            # An inf global norm scales every gradient by 0: no threshold learns from that.
            remembered = torch.isfinite(clipped) & torch.isfinite(global_norm)
        else:
            coefficient = torch.where(norms > 0, torch.clamp(self.lambda_rel * gamma / norms, max=1.0), 1.0)
            clipped = coefficient * norms
            new_gamma = torch.where(torch.isinf(gamma), norms, self.beta * gamma + (1 - self.beta) * clipped)
            remembered = torch.isfinite(clipped)
        # A NaN or inf norm is scaled as torch scales it (the gradient turns NaN) but not remembered.
        self.gammas.index_copy_(0, index, torch.where(remembered, new_gamma, gamma))
        self.steps += 1
        self.last_clip_coef = coefficient
        _scale(grads, coefficient)

    def _fit_rows(self, count: int, reclaimed: list[int], device) -> None:
        if count > self.gammas.shape[0]:
            grow = torch.full((count - self.gammas.shape[0],), math.inf, dtype=torch.float64, device=device)
            self.gammas = torch.cat([self.gammas, grow])
        if reclaimed:
            self.gammas.index_fill_(0, _to_device(reclaimed, device), math.inf)

    def _clip(self, grads):  # ClipGradBase's route always comes through _clip_pairs
        raise AssertionError("ClipGradByNormEMA clips through _clip_pairs")

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
        return (f"{type(self).__name__}(lambda_rel={self.lambda_rel}, beta={self.beta}, "
                f"warmup_steps={self.warmup_steps}, lambda_abs={self.lambda_abs})")


class SkipStepOnSpike(_StatefulClip):
    r"""Skip the optimizer step on a gradient-norm spike (OLMo-core's rule), optionally clipping too.

    The global L2 norm g_t of the gradients is compared with the norms of up to `window` earlier calls:
    once at least max(2, window // 2) norms have been seen (this one included), the step is skipped
    unless g_t - mean <= sigma_factor * std (std unbiased, as torch.std_mean): a spike, a NaN or inf
    norm, and (as in OLMo-core) a window of one norm, whose std is NaN, all skip. Every norm enters
    the window, skipped or not. Used as `grad_clip=` on a torchclip.optim optimizer (or
    torchclip.optim.attach), the hook skips the step (its `skipped_steps` counts them); called
    directly, it only decides: `skip` holds the last decision (a 0-d bool tensor on the gradients'
    device) and `skips` the count. `clip`, if given, then runs on the same gradients (every call, so a
    stateful clip sees every norm).

    `nonfinite`, for a NaN or inf norm, whose step is skipped in every mode: "propagate" (the default)
    is OLMo-core's rule, and reads nothing back from a GPU, but the norm enters the window, whose mean
    and std are then NaN: every step is skipped until it leaves, `window` calls later. "skip" keeps it
    out of the window and the count, and `clip` is not called (the gradients stay as they are, its
    statistics too); "raise" raises a RuntimeError before any change. "skip" and "raise" read one flag
    per call on the host (on a GPU, a sync, also on a fused optimizer).
    """

    def __init__(self, clip: ClipGradBase | None = None, window: int = 128, sigma_factor: float = 6.0, *,
                 nonfinite: str = "propagate", process_group=None):
        if clip is not None and not isinstance(clip, ClipGradBase):
            raise TypeError(f"clip must be a torchclip clip (e.g. ClipGradByGlobalNorm) or None, got {clip!r}")
        self.clip = clip
        self.window = _check_count("window", window)
        self.sigma_factor = _check_positive("sigma_factor", sigma_factor)
        self.nonfinite = _policy(nonfinite)
        self.process_group = process_group
        self.history = torch.full((self.window,), math.nan, dtype=torch.float64)
        self.count = 0  # norms seen, on the host
        self.skip: Tensor | None = None
        self.skips: Tensor | None = None
        self.last_global_norm: Tensor | None = None

    def _clip_pairs(self, pairs) -> None:
        if not pairs and self.process_group is None:
            self.skip = None
            return
        norm = self._global_norm_of(pairs)[2]
        admitted = self._admits(norm)
        # A norm that nonfinite keeps out of the window is skipped, as a NaN or inf norm in it would be.
        skip = self._decide(norm) if admitted else torch.ones((), dtype=torch.bool, device=norm.device)
        self.skip, self.last_global_norm = skip, norm
        self.skips = add_to_count(self.skips, skip)
        if admitted and self.clip is not None:
            self.clip._clip_pairs([(p, g) for p, g in pairs if self.clip._wants(p)])

    def _decide(self, norm: Tensor) -> Tensor:
        """Whether to skip (0-d bool) against the earlier norms; the norm then enters the window."""
        self.history = self._on(self.history, norm.device)
        earlier = min(self.count, self.window)
        if self.count + 1 < max(2, self.window // 2):
            skip = torch.zeros((), dtype=torch.bool, device=norm.device)
        elif earlier == 1:  # the std of one norm is NaN, and no comparison with NaN holds: skipped
            skip = torch.ones((), dtype=torch.bool, device=norm.device)
        else:
            std, mean = torch.std_mean(self.history[:earlier])
            skip = ~((norm - mean) <= self.sigma_factor * std)
        self.history[self.count % self.window] = norm
        self.count += 1
        return skip

    def _step_refused(self) -> Tensor | None:
        return self.skip

    def _clip(self, grads):  # ClipGradBase's route always comes through _clip_pairs
        raise AssertionError("SkipStepOnSpike decides through _clip_pairs")

    def state_dict(self) -> dict[str, Tensor]:
        """The window of norms and the count, as tensors (the inner clip's state is its own)."""
        return {"history": self.history.clone(), "count": torch.tensor(self.count, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        _check_state(type(self).__name__, state, {"history": (self.window,), "count": ()})
        self.history = state["history"].to(self.history.device, torch.float64, copy=True)
        self.count = int(state["count"])

    def __repr__(self):
        return f"{type(self).__name__}(clip={self.clip!r}, window={self.window}, sigma_factor={self.sigma_factor})"


class ClipGradByUnitwiseNorm(_StatefulClip):
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
    """

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3, norm_type: float = 2.0, *,
                 nonfinite: str = "propagate"):
        self.clip_factor = _check_positive("clip_factor", clip_factor)
        self.eps = _check_positive("eps", eps, allow_zero=True)
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
            raise TypeError(f"norm_type must be a number, got {norm_type!r}")
        if not float(norm_type) > 0:
            raise ValueError(f"norm_type must be > 0 (inf allowed), got {norm_type!r}")
        self.norm_type = float(norm_type)
        self.nonfinite = _policy(nonfinite)

    def _clip_pairs(self, pairs) -> None:
        if not pairs:
            return
        params, grads = [p.detach() for p, _ in pairs], [g for _, g in pairs]
        if self.nonfinite != "propagate" and not self._admits(_targets_and_norms(grads)[1]):
            return
        if _ops.kernels_serve(grads, devices=("cpu",)) and _ops.kernels_serve(params, devices=("cpu",)):
            _ops.unitwise_clip_(grads, params, self.clip_factor, self.eps, self.norm_type)
            return
        for p, g in zip(params, grads):
            if g.shape != p.shape:
                raise ValueError(f"ClipGradByUnitwiseNorm: a gradient of shape {tuple(g.shape)} belongs to a "
                                 f"parameter of shape {tuple(p.shape)}")
        for p, g in zip(params, grads):
            max_norm = _unit_norms(p, self.norm_type).clamp(min=self.eps) * self.clip_factor
            grad_norm = _unit_norms(g, self.norm_type)
            factor = torch.where(grad_norm < max_norm, torch.ones_like(grad_norm), max_norm / grad_norm.clamp(min=1e-6))
            g.mul_(factor.to(g.device, torch.float64 if g.dtype == torch.float64 else torch.float32))

    def _clip(self, grads):  # ClipGradBase's route always comes through _clip_pairs
        raise AssertionError("ClipGradByUnitwiseNorm clips through _clip_pairs")

    def __repr__(self):
        return f"{type(self).__name__}(clip_factor={self.clip_factor}, eps={self.eps}, norm_type={self.norm_type})"


def _unit_norms(t: Tensor, norm_type: float) -> Tensor:
    """Per-unit norms in float64, shaped to broadcast against t (timm's unitwise_norm, keepdim)."""
    if t.dim() <= 1:
        return torch.linalg.vector_norm(t, norm_type, dtype=torch.float64)
    return torch.linalg.vector_norm(t, norm_type, dim=tuple(range(1, t.dim())), keepdim=True, dtype=torch.float64)
