"""ClipGradByQuantile: AutoClip (Seetharaman et al., 2020, "AutoClip: Adaptive Gradient Clipping for
Source Separation Networks"); the `autoclip` package 0.2.1's `QuantileClip` is the specification."""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._arguments import _policy
from torchclip.adaptive._state import (
    _COEFFICIENT_EPS,
    _check_bool,
    _check_count,
    _check_fraction,
    _check_state,
    _clip_coefficient,
    _clip_coefficient_on_host,
    _ParamRows,
    _scale,
    _StatefulClip,
    _targets_and_norms,
    _to_device,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


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


class _NormHistory:
    """The rings of past norms behind ClipGradByQuantile's thresholds, and their quantiles.

    A base of the clip rather than an object it holds, so that `history`, `counts` and `_window` stay the
    clip's own attributes, as its pickles since torchclip 0.1.0 hold them. `history` holds one float64
    ring of `history_length` norms per row (one in global mode; one per parameter, see _ParamRows, otherwise),
    NaN where nothing was recorded yet; `counts[row]`, on the host, how many norms the row has seen. A ring
    fills in order and a quantile does not depend on order, so a row's first min(count, history_length) slots
    are its norms. The global row also has a sorted copy on the host, `_window`, built on first use, from
    which the CPU rule takes its quantile without a tensor op.
    """

    quantile: float
    history_length: int
    global_threshold: bool
    history: Tensor
    counts: list[int]
    _window: _SortedWindow | None

    def _restart_history(self, history: Tensor, counts: list[int]) -> None:
        self.history, self.counts, self._window = history, counts, None

    def _empty_rings(self, rows: int, device=None) -> Tensor:
        return torch.full((rows, self.history_length), math.nan, dtype=torch.float64, device=device)

    def _history_state(self) -> dict[str, Tensor]:
        return {"history": self.history.clone(), "counts": torch.tensor(self.counts, dtype=torch.int64)}

    def _load_history(self, state: dict[str, Tensor]) -> int:
        """Restores the rings from a _history_state, checked before anything changes; returns its row count."""
        history = state.get("history") if isinstance(state, dict) else None
        rows = history.shape[0] if isinstance(history, Tensor) and history.dim() == 2 else -1
        _check_state(type(self).__name__, state, {"history": (rows, self.history_length), "counts": (rows,)})
        if self.global_threshold and rows != 1:
            raise ValueError(f"{type(self).__name__}.load_state_dict: a global clip has one history, got {rows}")
        counts = [int(c) for c in state["counts"].tolist()]
        self._restart_history(state["history"].to(self.history.device, torch.float64, copy=True), counts)
        return rows

    def _fit_rows(self, count: int, reclaimed: list[int], device) -> None:
        if count > self.history.shape[0]:
            grow = self._empty_rings(count - self.history.shape[0], device)
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
        """The quantile of the first `filled` slots of each of `rows`: torch.quantile, the reference's, so a
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

    def _host_threshold(self) -> float | None:
        """The global row's quantile from the host window; None before any norm was recorded (the first
        call clips nothing)."""
        return self._host_window().quantile(self.quantile) if self.counts[0] > 0 else None

    def _record_on_host(self, value: float) -> None:
        """Records the global norm in the global row (in host memory) and its sorted window."""
        count = self.counts[0]
        slot = count % self.history_length
        self._host_window().replace(self.history[0, slot].item() if count >= self.history_length else None, value)
        self.history[0, slot] = value
        self.counts[0] += 1

    def _host_window(self) -> _SortedWindow:
        if self._window is None:
            self._window = _SortedWindow(self.history[0, : min(self.counts[0], self.history_length)].tolist())
        return self._window


class ClipGradByQuantile(_NormHistory, _StatefulClip):
    r"""AutoClip: clip to a quantile of the norms seen so far.

    Each call clips by torch.nn.utils.clip_grad_norm_'s rule, max_norm / (norm + 1e-6) where that is
    below 1, with max_norm the `quantile` (linear interpolation, torch.quantile's) of the last
    `history_length` norms before clipping, then records the new norm. The first call, with no
    history, clips nothing.

    global_threshold=False (the default, as the reference): every gradient has its own history and is
    clipped by its own norm; a parameter's first call with a gradient clips nothing. True: one history
    of the global L2 norm of all the gradients, which are scaled together.

    `history` holds the histories, fixed-size float64 rings on the gradients' device, and `counts` how
    many norms each has seen; `last_norms` the last call's norms (per tensor, or the global one).

    Per-parameter histories are kept per parameter object (see _ParamRows): name the parameters
    themselves, `clip(model.parameters())` or `[(p, p.grad) for p in model.parameters()]`. Objects that
    are new at every call (pairs built from p.detach(), functional training) cannot be told apart
    across calls: their histories go by position in the list while its length and shapes match the last
    call's, and start anew where they differ; the clip warns once. A dead parameter's history is reused.

    `nonfinite`, for a NaN or inf norm (the global one, or any gradient's): "propagate" (the default) is
    autoclip's rule and reads nothing back from a GPU, but the norm enters its history: the gradients that
    history clips turn NaN for the next `history_length` calls. "skip" leaves the call out (nothing scaled
    or recorded, `found_nonfinite` set, an optimizer hook skips the step); "raise" raises a RuntimeError
    before any change. Both read one flag a call on the host (on a GPU, a sync); choose "skip" after
    `scaler.unscale_()`, where NaN steps are routine.

    Args:
        quantile: which quantile of the history is the threshold, in [0, 1].
        history_length: how many past norms each history keeps (>= 1).
        global_threshold: one history of the global norm (True) or one per parameter (False).
        nonfinite: "propagate", "skip" or "raise", as above.
        exact: exact norms (the true norm rounded once; see `torchclip.ClipGradByNorm`); None: the
            process-wide setting.
        process_group: hand-sharded gradients (needs global_threshold=True): every rank takes the
            same global norm (see `torchclip.distributed`).

    Raises:
        ValueError: a number out of its range; process_group without global_threshold.
        TypeError: an argument of the wrong type.

    Example:
        >>> clip = torchclip.ClipGradByQuantile(quantile=0.9, history_length=1000)
        >>> clip(model.parameters())
    """

    def __init__(
        self,
        quantile: float = 0.9,
        history_length: int = 1000,
        global_threshold: bool = False,
        *,
        nonfinite: str = "propagate",
        process_group: ProcessGroup | None = None,
        exact: bool | None = None,
    ):
        self.quantile = _check_fraction("quantile", quantile, low_open=False, high_open=False)
        self.history_length = _check_count("history_length", history_length)
        self.global_threshold = _check_bool("global_threshold", global_threshold)
        self.nonfinite = _policy(nonfinite)
        self.exact = _ops.check_exact(exact)
        if process_group is not None and not global_threshold:
            raise ValueError(
                "ClipGradByQuantile: process_group needs global_threshold=True (a per-parameter history "
                "needs each parameter's whole gradient, which hand shards split across ranks)"
            )
        self.process_group = process_group
        rows = 1 if global_threshold else 0  # per-parameter rows come with their parameters
        self._restart_history(self._empty_rings(rows), [0] * rows)
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
        found = self._walk_cpu(
            params, math.inf if threshold is None else threshold, _COEFFICIENT_EPS, walk_nonfinite, self.exact
        )
        if found is None:
            return False
        self._observe_global_on_host(found[1])
        return True

    def clip_gradients_(self, grads, params) -> None:
        if not grads and self.process_group is None:
            return
        if self.global_threshold:
            grads, _, norm = self._global_norm_of(grads, params)
            if norm.device.type == "cpu":
                return self._clip_global_on_host(grads, norm)
            observed = norm.reshape(1)
        else:
            grads, observed = _targets_and_norms(grads, self.exact)
        self.last_norms = observed[0] if self.global_threshold else observed
        if not self._admits(self.last_norms):
            return
        device = observed.device
        self.history = self._on(self.history, device)
        rows = [0] if self.global_threshold else self._rows_of(params, device)
        thresholds = self._thresholds(rows, device)
        scale = _clip_coefficient(thresholds, observed)
        self._record_norms(rows, observed, device)
        _scale(grads, scale[0] if self.global_threshold else scale)

    def _clip_global_on_host(self, grads: list[Tensor], norm: Tensor) -> None:
        """The global rule where the norm is in host memory, on floats: torch.quantile and the 0-d ops around
        it, run with their code out of cache after a step's memory pass, cost more than the norms."""
        self.history = self._on(self.history, norm.device)
        threshold = self._host_threshold()
        coefficient = 1.0 if threshold is None else _clip_coefficient_on_host(threshold, norm.item())
        if self._observe_global_on_host(norm) and coefficient != 1.0:
            _scale(grads, torch.tensor(coefficient, dtype=torch.float64))

    def _observe_global_on_host(self, norm: Tensor) -> bool:
        """Records the global norm (0-d, in host memory) where nonfinite admits it, and says whether it did."""
        self.last_norms = norm
        if not self._admits(norm):
            return False
        self._record_on_host(norm.item())
        return True

    def state_dict(self) -> dict[str, Tensor]:
        """The histories (a row per parameter, see _ParamRows) and their counts, as tensors."""
        return self._history_state()

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self._rows = _ParamRows(self._load_history(state))

    def __repr__(self):
        return (
            f"{type(self).__name__}(quantile={self.quantile}, history_length={self.history_length}, "
            f"global_threshold={self.global_threshold})"
        )
