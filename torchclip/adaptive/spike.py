"""SkipStepOnSpike: OLMo-core's spike skip (`olmo_core.optim.SkipStepOptimizer.get_step_factor`,
ai2-olmo-core 3.0.0, its gradient-norm half): an optimizer hook skips the step whose global norm is
more than sigma_factor standard deviations above the mean of a rolling window; a clip inside it
clips the steps that go ahead."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._arguments import _policy
from torchclip._messages import shown
from torchclip.adaptive._state import _check_count, _check_positive, _check_state, _StatefulClip
from torchclip.clip_base import ClipGradBase, add_to_count

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


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

    Args:
        clip: a clip that runs on the steps that go ahead (every call), or None.
        window: how many past global norms are compared (>= 1).
        sigma_factor: how many standard deviations above the mean make a spike (> 0).
        nonfinite: "propagate", "skip" or "raise", as above.
        exact: exact norms (the true norm rounded once; see `torchclip.ClipGradByNorm`); None: the
            process-wide setting.
        process_group: hand-sharded gradients: every rank takes the same global norm.

    Raises:
        TypeError: `clip` is not a clip; an argument of the wrong type.
        ValueError: a number out of its range; an unknown `nonfinite`.

    Example:
        >>> skip = torchclip.SkipStepOnSpike(torchclip.ClipGradByGlobalNorm(1.0))
        >>> optimizer = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=skip)
    """

    def __init__(
        self,
        clip: ClipGradBase | None = None,
        window: int = 128,
        sigma_factor: float = 6.0,
        *,
        nonfinite: str = "propagate",
        process_group: ProcessGroup | None = None,
        exact: bool | None = None,
    ):
        if clip is not None and not isinstance(clip, ClipGradBase):
            raise TypeError(f"clip must be a torchclip clip (e.g. ClipGradByGlobalNorm) or None, got {shown(clip)}")
        self.clip = clip
        self.window = _check_count("window", window)
        self.sigma_factor = _check_positive("sigma_factor", sigma_factor)
        self.nonfinite = _policy(nonfinite)
        self.exact = _ops.check_exact(exact)
        self.process_group = process_group
        self.history = torch.full((self.window,), math.nan, dtype=torch.float64)
        self.count = 0  # norms seen, on the host
        self.skip: Tensor | None = None
        self.skips: Tensor | None = None
        self.last_global_norm: Tensor | None = None

    def clip_gradients_(self, grads, params) -> None:
        if not grads and self.process_group is None:
            self.skip = None
            return
        norm = self._global_norm_of(grads, params)[2]
        admitted = self._admits(norm)
        # A norm that nonfinite keeps out of the window is skipped, as a NaN or inf norm in it would be.
        skip = self._decide(norm) if admitted else torch.ones((), dtype=torch.bool, device=norm.device)
        self.skip, self.last_global_norm = skip, norm
        self.skips = add_to_count(self.skips, skip)
        if admitted and self.clip is not None:
            selected = [(p, g) for p, g in zip(params, grads) if self.clip.selects(p)]
            self.clip.clip_gradients_([g for _, g in selected], [p for p, _ in selected])

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

    def step_refused(self) -> Tensor | None:
        return self.skip

    def state_dict(self) -> dict[str, Tensor]:
        """The window of norms and the count, as tensors (the inner clip's state is its own)."""
        return {"history": self.history.clone(), "count": torch.tensor(self.count, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        _check_state(type(self).__name__, state, {"history": (self.window,), "count": ()})
        self.history = state["history"].to(self.history.device, torch.float64, copy=True)
        self.count = int(state["count"])

    def __repr__(self):
        return f"{type(self).__name__}(clip={self.clip!r}, window={self.window}, sigma_factor={self.sigma_factor})"
