"""ClipGradBase: what every clip shares (the call forms, choosing the gradients, the statistics a
nonfinite policy keeps) and the protocol a clip follows, a user's own included."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._arguments import _CALL_FORMS, _checked_pairs, _checked_parameters, _items_of

__all__ = ["ClipGradBase"]


def add_to_count(count: Tensor | None, found: Tensor) -> Tensor:
    """count + found, as a 0-d int64 tensor on found's device. While a CUDA graph is being captured the
    sum goes into `count` in place: a new tensor would be rewritten by every replay with the captured
    call's sum, so replays would not count. Elsewhere a new tensor, so a count read earlier stays as read."""
    if count is None:
        return found.to(torch.int64)
    if found.is_cuda and count.device == found.device and torch.cuda.is_current_stream_capturing():
        return count.add_(found)
    return count.to(found.device) + found  # (int64 + bool is int64: one kernel, where a cast first made two)


def _warn_if_given_gradients(items: Sequence, who: str) -> None:
    """Warns where a clip was handed gradients instead of parameters (clip([p.grad for p in ...]), an easy
    slip since get_total_norm takes gradients): a clip reads each parameter's .grad, so it clipped nothing.
    They look like gradients when none has a .grad and none requires grad or is an nn.Parameter (a frozen
    model's parameters are Parameters). The first item decides at once on the usual call."""
    first = items[0] if items else None
    if not _looks_like_a_gradient(first) or not all(_looks_like_a_gradient(t) for t in items):
        return
    warnings.warn(
        f"{who} was given {len(items)} tensor(s) with no .grad that do not require grad: they look like "
        "gradients, but a clip reads each parameter's .grad, so nothing was clipped. Pass the parameters, "
        "e.g. model.parameters()",
        stacklevel=3,
    )


def _looks_like_a_gradient(t) -> bool:
    # (requires_grad first: .grad is then read only on leaves, which never warn about it)
    return isinstance(t, Tensor) and not t.requires_grad and not isinstance(t, torch.nn.Parameter) and t.grad is None


class ClipGradBase:
    """What every clip shares: the two call forms, choosing the gradients to clip, and what an optimizer
    hook asks of a clip.

    Writing a clip: subclass ClipGradBase and define `clip_gradients_(grads, params)`, which clips the
    given gradients in place (each beside its parameter, for clips that read the weights or keep state
    per parameter). It is called with the gradients this clip selects (`selects`: need_clip marks, the
    legacy need_clip predicate; gradients that are None dropped), under torch.no_grad(), from either
    call form, so the clip works as `clip(model.parameters())`, as `clip(pairs)` and as `grad_clip=` on
    torchclip.optim's optimizers. Two more hooks have defaults:

    * `step_refused()`: whether the last call asks an optimizer hook to skip the step (a 0-d bool tensor,
      never read by the hook on a fused step, or None). By default, a NaN/inf norm under nonfinite="skip",
      as `_record(norms)` noted it.
    * `_clip_parameters(params)`: a shortcut for plain parameters, one C++ call that selects and clips
      (the built-in clips' fast path); returning False (the default) takes `clip_gradients_`.

    Example:

        class ClipGradBySign(torchclip.ClipGradBase):   # signSGD's update: each element to -1, 0 or 1
            def clip_gradients_(self, grads, params):
                for g in grads:
                    g.sign_()

    Norm-based clips take `nonfinite`, what a NaN or inf norm does: "propagate" (scale by it, as torch
    and Paddle do: the gradients become NaN or zero), "raise" (a RuntimeError, gradients unchanged) or
    "skip" (gradients unchanged; an optimizer hook then skips the step). `found_nonfinite` (a 0-d bool
    tensor) says whether the last call met one and `nonfinite_steps` (0-d int64) counts the calls that
    did, both on the gradients' device, for logging without a host sync.
    """

    _need_clip_predicate: Callable[[Tensor], bool] | None = None
    nonfinite: str = "propagate"
    exact: bool | None = None  # exact norms (the norm-based clips' argument); None: the process-wide setting
    found_nonfinite: Tensor | None = None
    nonfinite_steps: Tensor | None = None
    _refused: Tensor | None = None  # step_refused()'s flag, as _record_found keeps it

    def _record(self, norms: Tensor) -> None:
        """Update found_nonfinite / nonfinite_steps from the last call's norm(s)."""
        if norms.dim() == 0 and norms.is_cpu:
            return self._record_found_on_host(not math.isfinite(norms.item()))
        finite = torch.isfinite(norms)
        self._record_found((finite if norms.dim() == 0 else finite.all()).logical_not_())

    def _record_found(self, found: Tensor, refused: Tensor | None = None) -> None:
        """found: the last call met a NaN/inf norm; refused: of those, what the clip's own policy acts on
        (a folded step under GradScaler leaves the scaler's overflow to the scaler), by default found."""
        self.found_nonfinite = found
        self._refused = found if refused is None else refused
        self.nonfinite_steps = add_to_count(self.nonfinite_steps, found)

    def _record_found_on_host(self, found: bool) -> None:
        """_record_found for a flag the host already has (a CPU clip): two new CPU tensors, no ops,
        which after a step's memory pass run with their code out of cache. torch.scalar_tensor, not
        torch.tensor: right after the norm's memory pass the folded step's three scalars and these two took
        0.076 ms less (a slow-memory hour, 24 x 1M, 30 blocks of 20 shuffled rounds), 0.03 of a read."""
        steps = self.nonfinite_steps
        if steps is not None and not steps.is_cpu:
            return self._record_found(torch.scalar_tensor(found, dtype=torch.bool, device=steps.device))
        self.found_nonfinite = self._refused = torch.scalar_tensor(found, dtype=torch.bool)
        self.nonfinite_steps = torch.scalar_tensor((0 if steps is None else steps.item()) + found, dtype=torch.int64)

    def step_refused(self) -> Tensor | None:
        """Whether the last call asks an optimizer hook to skip the step (a 0-d bool tensor), or None:
        a NaN/inf norm under nonfinite="skip" (not one GradScaler skips the step for itself)."""
        if self.nonfinite != "skip":
            return None
        return self.found_nonfinite if self._refused is None else self._refused

    def selects(self, param) -> bool:
        """Whether this clip clips `param`'s gradient: its need_clip mark (default True) and the legacy
        need_clip predicate (default: all) both allow it."""
        if getattr(param, "need_clip", True) is False:  # the same test as the C++ walk's
            return False
        return self._need_clip_predicate is None or bool(self._need_clip_predicate(param))

    def __call__(self, params_grads):
        """clip(pairs) -> clipped pairs (grad None dropped); clip(parameters or a Module) -> None.

        The one route of every clip: the C++ walk over the parameters and their need_clip marks (a
        need_clip predicate is Python, so it takes the Python walk), else the general path under one
        no_grad()."""
        who = type(self).__name__
        items = _items_of(params_grads, who, _CALL_FORMS)
        pairs_form = bool(items) and isinstance(items[0], (tuple, list))
        if pairs_form:
            pairs = [(p, g) for p, g in _checked_pairs(items, who) if g is not None]
        else:
            # The C++ walk takes only tensors (it declines anything else), so the items are checked after it.
            if self._need_clip_predicate is None and not _ops.dynamo_is_tracing() and self._clip_parameters(items):
                _warn_if_given_gradients(items, who)
                return None
            pairs = [(p, p.grad) for p in _checked_parameters(items, who, _CALL_FORMS) if p.grad is not None]
            if not pairs:
                _warn_if_given_gradients(items, who)
        selected = [(p, g) for p, g in pairs if self.selects(p)]
        with torch.no_grad():
            self.clip_gradients_([g for _, g in selected], [p for p, _ in selected])
        return pairs if pairs_form else None

    def clip_gradients_(self, grads: list[Tensor], params: list[Tensor]) -> None:
        """Clip `grads` in place; `params[i]` is the parameter of `grads[i]`. What a clip defines."""
        raise NotImplementedError(f"{type(self).__name__} must define clip_gradients_(grads, params): see ClipGradBase")

    def _clip_parameters(self, params: list) -> bool:
        """Select and clip the gradients of plain CPU or CUDA parameters in one C++ call; False (the
        default) when some parameter needs the general path, clip_gradients_."""
        return False
