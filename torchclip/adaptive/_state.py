"""What the adaptive clips share: the stateful clips' base class, per-parameter rows, the nonfinite policy,
the norm and scale helpers and the argument checks.

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

import copy
import math
import warnings

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from torchclip import _ops
from torchclip._gradients import Gradients
from torchclip._messages import shown
from torchclip.clip_base import ClipGradBase

# The epsilon both references add to the norm in the clip coefficient (torch's clip_grad_norm_'s).
_COEFFICIENT_EPS = 1e-6


def _targets_and_norms(grads: list[Tensor], exact: bool | None = None) -> tuple[list[Tensor], Tensor]:
    """(the tensors to scale, each gradient's L2 norm in float64). DTensor gradients (FSDP2, tensor
    parallelism) are scaled in their local shards, and their norms are the global ones, the same on
    every rank (one all_gather of the local norms), so every rank takes the same decisions."""
    gradients = Gradients(grads)
    return gradients.local, gradients.tensor_norms(exact=exact)


def _scale(grads: list[Tensor], scale: Tensor) -> None:
    """grads[i] *= scale (0-d) or scale[i] (1-d), rounded as torch's mul_; a scale of exactly 1 writes
    nothing on the CPU kernels, and a CPU scale of 1 (read without waiting) skips the call."""
    if not grads or (scale.dim() == 0 and scale.device.type == "cpu" and scale.item() == 1.0):
        return
    Gradients(grads).scale_(scale)


def _clip_coefficient(max_norm: Tensor | float, norm: Tensor) -> Tensor:
    """torch.nn.utils.clip_grad_norm_'s coefficient: min(max_norm / (norm + 1e-6), 1)."""
    return torch.clamp(max_norm / (norm + _COEFFICIENT_EPS), max=1.0)


def _clip_coefficient_on_host(max_norm: float, norm: float) -> float:
    """_clip_coefficient on Python floats, with torch's rounding and NaN rule."""
    coefficient = _divide(max_norm, norm + _COEFFICIENT_EPS)
    return coefficient if not coefficient > 1.0 else 1.0  # torch.clamp's: NaN stays NaN


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
        raise TypeError(f"{name} must be a number, got {shown(value)}")
    number = float(value)
    above = number > 0.0 if low_open else number >= 0.0
    below = number < 1.0 if high_open else number <= 1.0
    if not (above and below):
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {shown(value)}")
    return number


def _check_positive(name: str, value, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {shown(value)}")
    number = float(value)
    if not (math.isfinite(number) and (number >= 0.0 if allow_zero else number > 0.0)):
        raise ValueError(f"{name} must be a finite number {'>=' if allow_zero else '>'} 0, got {shown(value)}")
    return number


def _check_count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {shown(value)}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {shown(value)}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {shown(value)}")
    return value


def _check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got {shown(value)}")
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
        if (
            self.claimed == self.count
            and self.last is not None
            and all(r is None for r in rows)
            and owned.isdisjoint(self.last)
        ):
            if not self.warned:
                self.warned = True
                warnings.warn(
                    f"{who}: every parameter this call names is a new object and none of the last "
                    f"call's is alive (e.g. pairs built from p.detach(), or functional training), so no "
                    f"parameter can be told across calls: per-parameter state goes by position in the "
                    f"list while the count and shapes match the last call's, and starts anew where they "
                    f"differ. Name the parameters themselves (model.parameters(), or [(p, p.grad) for p "
                    f"in model.parameters()]) to keep it per parameter",
                    stacklevel=6,
                )
            if len(params) == len(self.last) and all(
                tuple(p.shape) == self.shapes[r] for p, r in zip(params, self.last)
            ):
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


class _NonfiniteGate:
    """The nonfinite policy of a clip whose rule runs in Python (a mixin before ClipGradBase, whose
    `nonfinite` and `_record` it uses): the stateful clips and the stateless AGC alike."""

    def _admits(self, norms: Tensor) -> bool:
        """Records found_nonfinite / nonfinite_steps for this call's norms and says whether they may enter
        the statistics and clip: always under "propagate"; under "skip" not where one is NaN or inf (the
        call then changes nothing); under "raise" such a call raises, before anything changes."""
        refused = self.nonfinite != "propagate" and not bool(torch.isfinite(norms).all())  # a sync on a GPU
        if refused and self.nonfinite == "raise":
            bad = int(torch.nonzero(~torch.isfinite(norms.reshape(-1)))[0])
            what = "the global norm" if norms.dim() == 0 else f"the norm of gradient {bad} (of {norms.numel()})"
            raise RuntimeError(
                f"{type(self).__name__}: {what} is {norms.reshape(-1)[bad].item()}, so it cannot be "
                f"clipped (nonfinite='raise'); no gradient or statistic was changed"
            )
        self._record(norms)
        return not refused


class _StatefulClip(_NonfiniteGate, ClipGradBase):
    """What the stateful adaptive clips share: the Python walk (their rules need the gradient list; ZScore
    and the global Quantile take the C++ walk on CPU parameters), state tensors that follow the gradients
    to their device, the nonfinite policy (_NonfiniteGate) and per-parameter rows."""

    def _clip_parameters(self, params) -> bool:
        return False  # the Python walk: ClipGradBase.__call__ then calls clip_gradients_

    @staticmethod
    def _walk_cpu(
        params, max_norm: float, eps: float, nonfinite: str, exact: bool | None
    ) -> tuple[Tensor, Tensor] | None:
        """clip_grad_norm_'s C++ walk over CPU parameters, need_clip marks honoured: (each gradient's norm,
        the global norm in float64, as _global_norm_of computes it: the walk's total is in the gradients'
        dtype), or None where the gradients are elsewhere or the walk declines. Exact norms decline: their
        float64 total is not the norm of the per-tensor norms, and _global_norm_of's path gives it."""
        if _ops.exact_norms(exact):
            return None
        first = next((p.grad for p in params if isinstance(p, Tensor) and p.grad is not None), None)
        if first is None or first.device.type != "cpu":
            return None
        found = _ops.clip_grad_norm_of_plain(
            params,
            max_norm,
            2.0,
            False,
            eps=eps,
            honor_need_clip=True,
            nonfinite=nonfinite,
            keep_stats=True,
            exact=exact,
        )
        return None if found is None else (found[1], torch.linalg.vector_norm(found[1], 2.0))

    @staticmethod
    def _on(tensor: Tensor, device: torch.device) -> Tensor:
        # non_blocking: a host-to-device copy that does not wait for the device (the first call's state).
        return tensor if tensor.device == device else tensor.to(device, non_blocking=True)

    # Hand-sharded gradients (torchclip.distributed): the clips that need only the global norm take one.
    process_group = None

    def _global_norm_of(self, grads, params) -> tuple[list[Tensor], Tensor | None, Tensor]:
        """(the tensors to scale, each gradient's L2 norm or None, the global L2 norm), float64. Hand
        shards (process_group) give the global norm alone: a tensor's pieces may live on several ranks.
        With a process group every rank calls, gradients or not: the norm is a collective."""
        gradients = Gradients(grads, params, process_group=self.process_group)
        if gradients.shards is not None and not gradients.shards.aligned:
            return gradients.local, None, gradients.sharded_total_norm(2.0, False, self.exact)
        norms, total = gradients.norms(2.0, self.exact)
        return gradients.local, norms, total

    def _rows_of(self, params: list[Tensor], device: torch.device) -> list[int]:
        """Each parameter's row in per-parameter state (see _ParamRows), the state made to fit them."""
        rows, reclaimed = self._rows.rows_of(params, type(self).__name__)
        self._fit_rows(self._rows.count, reclaimed, device)  # the clip's own: grow to count rows, clear reclaimed
        return rows
