"""The global norm taken while backward runs: torchclip.optim's folded clip without its read after backward.

A folded clip (one ClipGradByGlobalNorm over a fused optimizer, torchclip.optim) reads every gradient once
after backward, for the norm, before the fused step. With `norm_in_backward=True` the attachment measures
each gradient as soon as it is final instead, from a post-accumulate-grad hook on its parameter (while the
gradient is still in cache; on CUDA, in batches queued behind backward's kernels); the step then combines
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

Under torch.distributed: FSDP2 runs the hooks on its sharded parameters after its reduce-scatter, the
post-divide and the accumulation, so a DTensor gradient is final there; the step combines the shards'
measurements in one collective (torchclip.distributed's, the exact sums' with exact norms), and the clip
folds into the fused step. DDP's reduction rewrites a plain gradient after its hook (with
gradient_as_bucket_view, without a version bump), so there the hooks stand aside; `reduced_by(ddp_model)`
measures the reduced buckets in DDP's comm hook instead, tied to the gradients DDP writes at the end of
backward. Without it every plain gradient under torch.distributed is measured at the step.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from torchclip import _C, _ops


@dataclass
class _Measured:
    grad: weakref.ref  # the gradient measured, not kept alive
    version: object  # _version_of(grad) when measured
    exact: bool
    value: Tensor  # exact: the gradient's ExactSum row (int64, 138); else its float64 norm (0-d)


class _Pending(NamedTuple):
    """A CUDA gradient waiting for its batch's measurement."""

    param: Tensor
    grad: Tensor
    piece: Tensor  # what is measured: the gradient, or a DTensor's local shard
    version: object  # _version_of(grad) at its hook
    stream: object  # the stream its hook ran on, which wrote it (None off CUDA)


def _reduced_after_backward() -> bool:
    """Whether gradients may still change after their hook: under torch.distributed, DDP reduces them after
    backward, and with gradient_as_bucket_view its collective writes the bucket the gradient views without
    bumping its version. There every gradient is measured at the step, as without the hooks."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _is_dtensor(grad) -> bool:
    return grad is not None and hasattr(grad, "_local_tensor") and hasattr(grad, "placements")


def _version_of(grad: Tensor):
    """The version counters that an in-place write to the gradient bumps (a DTensor's and its shard's)."""
    return (grad._version, grad._local_tensor._version) if _is_dtensor(grad) else grad._version


def _plain_version(grad: Tensor):
    return grad._version


def _measurable(grad: Tensor | None, exact: bool) -> bool:
    """Whether the kernels measure this gradient on their own: a plain strided tensor of a kernel dtype
    (exact sums: on the CPU)."""
    if grad is None or not _ops.kernels_serve([grad]):
        return False
    return not exact or grad.device.type == "cpu"


def _measure(grads: list[Tensor], exact: bool) -> list[Tensor]:
    """Each gradient's measurement, in one call: its exact sum's row, or its float64 norm."""
    if exact:
        return list(_C.exact_sums(grads, 2.0, True).unbind())
    return list(_ops.multi_tensor_norm(grads, 2.0, False, False, torch.float64)[1].unbind())


# FSDP2 before torch 2.13 copies an offloaded gradient into pinned memory without waiting for the copy
# before it runs this hook (2.13 copies synchronously where a parameter has such hooks).
_OFFLOAD_COPY_MAY_BE_IN_FLIGHT = torch.__version__ < (2, 13)


def _offload_in_flight(grad: Tensor, piece: Tensor) -> bool:
    return (
        _OFFLOAD_COPY_MAY_BE_IN_FLIGHT
        and piece.device.type == "cpu"
        and _is_dtensor(grad)
        and torch.cuda.is_initialized()
        and piece.is_pinned()
    )


def _measured_in_batches(grad: Tensor) -> bool:
    """CUDA gradients wait for a batch; a CPU gradient is measured in its hook, while it is in cache."""
    return grad.device.type == "cuda"


# CUDA gradients are measured a batch of this many bytes at a time, on backward's stream: a launch per
# gradient cost the host ~60-100 us each (ResNet-50's step, 161 parameters, 45% longer on an H200; batched
# 4-18%), and a stream of their own cost more host time than it saved (docs/optimizer.md).
CUDA_BATCH_BYTES = 32 << 20


class BackwardNorms:
    """The measurements of one attachment's parameters (torchclip.optim.attach(..., norm_in_backward=True)).

    Attributes:
        taken_in_backward: gradients the last step took from backward's measurements.
        taken_after_backward: gradients the last step had to read itself (not final when measured, or
            not measurable by the hook).
    """

    def __init__(self, optimizer, exact: bool):
        # Keyed by id(parameter): a Tensor key hashes through Python (torch's Tensor.__hash__), which the
        # step's lookup of every parameter paid; each record's weak reference to its gradient settles identity.
        self._measured: dict[int, _Measured] = {}
        self._reduced: dict[Tensor, tuple[bool, Tensor]] = {}  # DDP's reduced gradients, measured this backward
        self._settling = False  # a check of the reduced gradients is queued at the end of this backward
        self._paused = False
        self._pending: list[_Pending] = []
        self._pending_bytes = 0
        self._measuring_streams: set = set()  # the streams measurements ran on since the last step
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
        grad = param.grad
        # FSDP2 runs this hook on its sharded parameters after the reduce-scatter, the post-divide and the
        # accumulation (a DTensor gradient is final); a plain gradient under torch.distributed is not.
        if self._paused or (not _is_dtensor(grad) and _reduced_after_backward()):
            return
        piece = grad._local_tensor if _is_dtensor(grad) else grad
        if not _measurable(piece, self._exact) or _offload_in_flight(grad, piece):
            self._measured.pop(id(param), None)  # (the step measures it)
            return
        if _measured_in_batches(piece):
            self._measure_later(param, grad, piece)
            return
        (value,) = _measure([piece], self._exact)
        self._measured[id(param)] = _Measured(weakref.ref(grad), _version_of(grad), self._exact, value)

    def _measure_later(self, param: Tensor, grad: Tensor, piece: Tensor) -> None:
        """A CUDA gradient joins the batch measured when it holds CUDA_BATCH_BYTES, or when backward ends
        (a backward that raised leaves its batch to the step), on the stream its hook ran on: the stream
        that wrote it (autograd's, or FSDP2's post-reduce stream)."""
        stream = torch.cuda.current_stream(piece.device) if piece.device.type == "cuda" else None
        queued = bool(self._pending) or self._measure_at_the_end_of_backward()
        self._pending.append(_Pending(param, grad, piece, _version_of(grad), stream))
        self._pending_bytes += piece.numel() * piece.element_size()
        if not queued or self._pending_bytes >= CUDA_BATCH_BYTES:
            self._measure_pending()

    def _measure_at_the_end_of_backward(self) -> bool:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._measure_pending)
        except RuntimeError:  # the hook was called outside backward
            return False
        return True

    def _measure_pending(self) -> None:
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        if self._handles is None:  # removed during this backward
            return
        batches: dict[tuple, list] = {}
        for item in pending:
            batches.setdefault((item.piece.device, item.stream), []).append(item)
        for (_, stream), items in batches.items():
            with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
                values = _measure([item.piece for item in items], False)
            if stream is not None:
                self._measuring_streams.add(stream)
            for item, value in zip(items, values):
                self._measured[id(item.param)] = _Measured(weakref.ref(item.grad), item.version, False, value)

    def _wait_for_the_measurements(self, values: list[Tensor]) -> None:
        """The step's stream waits for the streams the measurements ran on (FSDP2's post-reduce stream waits
        for nothing of ours), and their results stay allocated until it has read them."""
        streams, self._measuring_streams = self._measuring_streams, set()
        for stream in streams:
            current = torch.cuda.current_stream(stream.device)
            if stream != current:
                current.wait_stream(stream)
                for value in values:
                    if value.device == stream.device:
                        value.record_stream(current)

    def reduced_by(self, ddp_model, hook=None, state=None) -> None:
        """Measure the gradients of `ddp_model` (a DistributedDataParallel) as they come out of its reduction,
        bucket by bucket, instead of at the step: registers the model's comm hook (DDP takes one), a wrapper
        around `hook` (called as hook(state, bucket); default: DDP's averaging all-reduce over its process
        group). DDP's no_sync() skips the reduction, and so the measurements, of the micro-batches under it.

        Raises:
            TypeError: ddp_model is not a DistributedDataParallel.
        """
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"ddp_model must be a DistributedDataParallel, got {type(ddp_model).__name__}")
        if hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            hook, state = allreduce_hook, ddp_model.process_group

        def measured_hook(_, bucket):
            base = bucket.buffer().storage_offset()
            pieces = [
                (p, g.storage_offset() - base, g.numel()) for p, g in zip(bucket.parameters(), bucket.gradients())
            ]
            exact = self._exact
            self._settle_at_the_end_of_backward()

            def measure(future):
                reduced = future.value()
                reduced = reduced[0] if isinstance(reduced, list) else reduced
                flat = reduced.reshape(-1)
                if not self._paused and self._handles is not None:
                    served = [(p, flat.narrow(0, offset, numel)) for p, offset, numel in pieces]
                    served = [(p, piece) for p, piece in served if _measurable(piece, exact)]
                    if served:
                        for (p, _), value in zip(served, _measure([piece for _, piece in served], exact)):
                            self._reduced[p] = (exact, value)
                return reduced

            return hook(state, bucket).then(measure)

        ddp_model.register_comm_hook(None, measured_hook)

    def _settle_at_the_end_of_backward(self) -> None:
        """DDP writes the reduced gradients into `.grad` in its own end-of-backward callback, queued after the
        comm hooks ran; this callback queues the check after it, so the measurements are tied to the gradient
        tensors and versions the step will see."""
        if self._settling:
            return
        self._settling = True
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._settle))

    def _settle(self) -> None:
        self._settling = False
        reduced, self._reduced = self._reduced, {}
        if self._handles is None:  # removed
            return
        for p, (exact, value) in reduced.items():
            grad = p.grad
            if grad is not None:
                self._measured[id(p)] = _Measured(weakref.ref(grad), grad._version, exact, value)

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
        if self._pending:  # (a backward that raised never ran its end-of-backward callback)
            self._measure_pending()
        measured, self._measured = ({} if stale else self._measured), {}
        self._exact = exact
        grads = [(p, g) for p in params if (g := p.grad) is not None]
        # The walk reads every gradient where one is beyond the measurements.
        self.taken_in_backward, self.taken_after_backward = 0, len(grads)
        if not grads:
            return None
        device = grads[0][1].device
        if any(g.device != device for _, g in grads):
            return None
        # (plain gradients take the short way: on a GPU this loop's host time is a sizeable part of a read)
        shards, version_of = None, _plain_version
        if not all(type(g) is Tensor for _, g in grads):
            dtensors, version_of = [_is_dtensor(g) for _, g in grads], _version_of
            if any(dtensors):
                from torchclip import _sharded

                shards = _sharded.layout_of([g for _, g in grads]) if _sharded.distributed_ready() else None
                if shards is None or shards.partial:  # (a Partial gradient's norm needs its reduction first)
                    return None
        values, missed = [], []
        for i, (p, g) in enumerate(grads):
            record = measured.get(id(p))
            if record is None or record.grad() is not g or record.version != version_of(g) or record.exact != exact:
                piece = shards.local[i] if shards is not None else g
                if not _measurable(piece, exact):
                    return None
                missed.append((len(values), piece))
                values.append(None)
            else:
                values.append(record.value)
        if missed:
            for (i, _), value in zip(missed, _measure([piece for _, piece in missed], exact)):
                values[i] = value
        self.taken_in_backward, self.taken_after_backward = len(grads) - len(missed), len(missed)
        if self._measuring_streams:
            self._wait_for_the_measurements(values)
        dtype = torch.promote_types(_ops.total_norm_dtype([g for _, g in grads]), torch.float32)
        if shards is not None:
            return self._combine_shards(shards, values, exact, dtype, device)
        if exact:
            rows = torch.stack(values)
            # Integer sums: every gradient's row and their total, rounded once each.
            rounded = _C.norms_of_exact_sums(torch.cat([rows, rows.sum(0, keepdim=True)]), 2.0)
            norms, total = rounded[:-1], rounded[-1]
        else:
            norms = torch.stack(values)
            total = _ops.multi_tensor_norm([norms], 2.0, False, False, torch.float64)[0]  # the norm of the norms
        return total.to(dtype), norms

    @staticmethod
    def _combine_shards(shards, values, exact: bool, dtype, device) -> tuple[Tensor, Tensor]:
        """The global norms from this rank's measurements of its DTensor shards: the collectives the sharded
        route takes after backward (torchclip/_sharded.py), on the pieces this rank counts (others zero)."""
        local = torch.stack(values)
        local[[not counted for counted in shards.counted]] = 0
        total, norms = shards.norms(2.0, per_tensor=True, exact=exact, local=local)
        return total.to(device=device, dtype=dtype), norms

    def discard(self) -> None:
        """Forget the measurements (a step that does not fold the clip)."""
        self._measured, self._pending, self._pending_bytes = {}, [], 0
        self._measuring_streams = set()

    def remove(self) -> None:
        """Remove the hooks (a comm hook reduced_by registered stays with DDP, which cannot drop one: it
        goes on reducing as the hook it wraps, and measures nothing)."""
        for handle in self._handles or []:
            handle.remove()
        self._handles = None
        self.discard()
