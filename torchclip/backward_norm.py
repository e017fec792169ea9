"""The global norm taken while backward runs: torchclip.optim's folded clip without its read after backward.

A folded clip (one ClipGradByGlobalNorm over a fused optimizer, torchclip.optim) reads every gradient once
after backward, for the norm, before the fused step. With `norm_in_backward=True` the attachment measures
each gradient as soon as it is final instead, from a post-accumulate-grad hook on its parameter (while the
gradient is still in cache, and, on CUDA, queued behind backward's own kernels); the step then combines
those measurements and folds the coefficient into the kernel as before. What the hook keeps per parameter:
the gradient's exact sum of squares (an `ExactSum` row, the 138 int64s ranks exchange) under exact norms,
else its float64 norm, so the combination is the post-backward norm, the same bits with exact norms and
within the documented accuracy without.

Which gradient is final: the last one the hook saw before the step. Each measurement remembers the gradient
tensor and its version counter, and the step uses it only if the parameter still holds that tensor at that
version. A later micro-batch's accumulation (gradient accumulation), DDP's copy of the reduced gradient, an
unscale_, a clip in place or a new tensor assigned to `.grad` all change one or the other, and that
gradient is measured again at the step (counted in `taken_after_backward`): never a stale norm, at worst
today's read. Two kinds of write bump no version counter: GradScaler.unscale_ (its foreach kernel), which
the step recognises (GradScaler then hands it found_inf without grad_scale) and measures every gradient
again for, and writes through `.data`, which nothing can see: do not change `.grad.data` between backward
and the step. `no_sync()` skips the hooks for micro-batches whose gradients are not final yet.

Under torch.distributed the hooks measure nothing (DDP's reduction can rewrite a gradient after its hook
without a version bump): every gradient is measured at the step, as without norm_in_backward. Measuring
DDP's reduced buckets (a comm hook) and FSDP2's reduce-scatter output is the next step.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from torchclip import _C, _ops


@dataclass
class _Measured:
    grad: weakref.ref  # the gradient measured, not kept alive
    version: int
    exact: bool
    value: Tensor  # exact: the gradient's ExactSum row (int64, 138); else its float64 norm (0-d)


def _reduced_after_backward() -> bool:
    """Whether gradients may still change after their hook: under torch.distributed, DDP reduces them after
    backward, and with gradient_as_bucket_view its collective writes the bucket the gradient views without
    bumping its version. There every gradient is measured at the step, as without the hooks."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _measurable(grad: Tensor | None, exact: bool) -> bool:
    """Whether the kernels measure this gradient on their own: a plain strided tensor of a kernel dtype
    (exact sums: on the CPU)."""
    if grad is None or not _ops.kernels_serve([grad]):
        return False
    return not exact or grad.device.type == "cpu"


def _measure(grad: Tensor, exact: bool) -> Tensor:
    if exact:
        return _C.exact_sums([grad], 2.0, False)[0]
    return _ops.multi_tensor_norm([grad], 2.0, False, False, torch.float64)[0]


class BackwardNorms:
    """The measurements of one attachment's parameters (torchclip.optim.attach(..., norm_in_backward=True)).

    Attributes:
        taken_in_backward: gradients the last step took from backward's measurements.
        taken_after_backward: gradients the last step had to read itself (not final when measured, or
            not measurable by the hook).
    """

    def __init__(self, optimizer, exact: bool):
        self._measured: dict[Tensor, _Measured] = {}
        self._paused = False
        self._exact = exact  # the mode the last step asked for: the hooks measure in it
        self.taken_in_backward = 0
        self.taken_after_backward = 0
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_final_grad)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad
        ]

    def _on_final_grad(self, param: Tensor) -> None:
        if self._paused or _reduced_after_backward():
            return
        grad = param.grad
        if not _measurable(grad, self._exact):
            self._measured.pop(param, None)
            return
        value = _measure(grad, self._exact)
        self._measured[param] = _Measured(weakref.ref(grad), grad._version, self._exact, value)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the measurements in this block (the micro-batches before the last one of an accumulation,
        whose gradients are not final): as DDP's no_sync, only to save the work; the step measures any
        gradient whose final value the hooks missed."""
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    def take(self, params, exact: bool, stale: bool = False) -> tuple[Tensor, Tensor] | None:
        """(the global 2-norm of `params`' gradients, in at least float32 as the folded walk gives it; each
        gradient's norm, float64) from the measurements, measuring what they miss (all of them when
        `stale`); None where a gradient is not measurable (the walk decides then). Every measurement is used
        up: the next step starts anew."""
        measured, self._measured = ({} if stale else self._measured), {}
        self._exact = exact
        grads = [(p, p.grad) for p in params if p.grad is not None]
        # The walk reads every gradient where one is beyond the measurements.
        self.taken_in_backward, self.taken_after_backward = 0, len(grads)
        if not grads or len({g.device for _, g in grads}) != 1:
            return None
        values, after = [], 0
        for p, g in grads:
            record = measured.get(p)
            if record is None or record.grad() is not g or record.version != g._version or record.exact != exact:
                if not _measurable(g, exact):
                    return None
                record = _Measured(weakref.ref(g), g._version, exact, _measure(g, exact))
                after += 1
            values.append(record.value)
        self.taken_in_backward, self.taken_after_backward = len(grads) - after, after
        if exact:
            rows = torch.stack(values)
            # Integer sums: every gradient's row and their total, rounded once each.
            rounded = _C.norms_of_exact_sums(torch.cat([rows, rows.sum(0, keepdim=True)]), 2.0)
            norms, total = rounded[:-1], rounded[-1]
        else:
            norms = torch.stack(values)
            total = _ops.multi_tensor_norm(values, 2.0, False, False, torch.float64)[0]  # the norm of the norms
        dtype = torch.promote_types(_result_type([g for _, g in grads]), torch.float32)
        return total.to(dtype), norms

    def discard(self) -> None:
        """Forget the measurements (a step that does not fold the clip)."""
        self._measured = {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._measured = {}


def _result_type(tensors) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype
