"""The one place where a call's gradients choose their route, and what each route does with them.

The eager fast path (csrc/walk) serves plain CPU and CUDA parameters before any Python runs. Every
other call (each drop-in's general path, the clip classes, the adaptive clips, the statistics, the
TensorFlow names, the optimizer hooks when the walk declines) builds one Gradients from the tensors it
reads or writes and follows its `route`, tried in this order:

    SHARDED         process_group= was given (pipeline stages, a hand-sharded optimizer), or DTensor
                    gradients (FSDP2, HSDP, tensor parallelism, experts, on any meshes, plain tensors
                    beside them): the local shards on the kernels, the collectives of torchclip/_sharded.py
    KERNELS         plain strided tensors on one device whose kernels were built, autograd not
                    tracking them: torchclip's ops (the walk's own rule, csrc/walk/param_walk.h)
    SPARSE          a sparse COO tensor among them (torch.nn.utils cannot clip those)
    TORCH           anything else (other devices, subclasses, differentiable norms, placements the
                    sharded route does not take): torch's own ops

Each entry point's rule over the route is a few lines beside it; the operations every rule shares
(per-tensor norms, the sharded total, scaling, clamping) are the methods below.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
from torch import Tensor

from torchclip import _ops, _sparse


class Route(enum.Enum):
    SHARDED = "sharded"
    KERNELS = "kernels"
    SPARSE = "sparse"
    TORCH = "torch"


class Gradients:
    """A call's gradients (`tensors`), the route they take, and their layout on the sharded route
    (`shards`, a torchclip._sharded.Layout).

    `params[i]` is `tensors[i]`'s parameter; only hand shards read it (which ones are replicated).
    `devices`: the device types whose kernels the call may use (the unit-wise clip's are CPU-only).
    """

    __slots__ = ("route", "shards", "tensors")

    def __init__(
        self,
        tensors: Sequence[Tensor],
        params: Sequence[Tensor] | None = None,
        *,
        process_group=None,
        devices: Sequence[str] = _ops.KERNEL_DEVICES,
    ):
        self.tensors = tensors
        self.shards = None
        if process_group is not None:
            self.route = Route.SHARDED
            self.shards = _sharded_layout(tensors, params, process_group)
            if self.shards is None:
                raise ValueError(
                    "process_group: sharded clipping takes plain strided CPU or CUDA tensors on one device, or "
                    f"DTensors with Shard, Replicate or Partial placements whose local shards are such; got "
                    f"{kinds_of(tensors)}"
                )
        elif _ops.kernels_serve(tensors, devices) and not _tracked(tensors):
            self.route = Route.KERNELS
        elif not _tracked(tensors) and (shards := _sharded_layout(tensors, params, None)) is not None:
            self.route = Route.SHARDED
            self.shards = shards
        elif any(_sparse.is_sparse(t) for t in tensors):
            self.route = Route.SPARSE
        else:
            self.route = Route.TORCH

    @property
    def local(self) -> list[Tensor]:
        """What this rank writes: its local shards on a sharded route, else the tensors themselves."""
        return self.tensors if self.shards is None else self.shards.local

    def tensor_norms(self, ord: float = 2.0, exact: bool | None = None) -> Tensor:
        """Each tensor's `ord`-norm in float64: one fused pass on KERNELS; the global norm of each sharded
        tensor on SHARDED (the same on every rank; a hand-sharded list's are refused); else one norm per
        tensor on the first tensor's device, differentiable (complex128 for complex data; sparse COO by
        its values). exact: exact norms (None: the process-wide setting; see refuse_exact)."""
        return self._norms(ord, exact, with_total=False)[0]

    def norms(self, ord: float = 2.0, exact: bool | None = None) -> tuple[Tensor, Tensor]:
        """(tensor_norms, the total norm in float64): the `ord`-norm of the per-tensor norms, or with
        exact norms (orders 1 and 2) the exact total rounded once, which per-tensor norms, each rounded,
        cannot give."""
        return self._norms(ord, exact, with_total=True)

    def _norms(self, ord: float, exact: bool | None, with_total: bool) -> tuple[Tensor, Tensor | None]:
        self.refuse_exact(exact)
        if self.route is Route.SHARDED:
            if not self.shards.aligned:
                raise ValueError("process_group: hand-sharded gradients have a global norm, not per-tensor norms")
            total, norms = self.shards.norms(ord, per_tensor=True, exact=_ops.exact_norms(exact))
            return norms, total
        exactly = _ops.exact_norms(exact) and ord in (1.0, 2.0)
        if self.route is Route.KERNELS or (exactly and self.route is Route.SPARSE and _sparse.on_cpu(self.tensors)):
            tensors = self.tensors if self.route is Route.KERNELS else _sparse.dense_terms(self.tensors)
            total, norms = _ops.multi_tensor_norm(tensors, ord, False, exact, torch.float64)
            if exactly:
                return norms, total
        else:
            device = self.tensors[0].device
            norms = torch.stack([_tensor_norm64(t, ord).to(device) for t in self.tensors])
        return norms, (torch.linalg.vector_norm(norms, ord) if with_total else None)

    def refuse_exact(self, exact: bool | None) -> None:
        """exact=True where the norm would not be exact (torch's own ops: tensors autograd
        tracks, subclasses, CUDA DTensors; CUDA sparse tensors): a ValueError,
        before anything is read or written."""
        if exact is True and (
            self.route is Route.TORCH or (self.route is Route.SPARSE and not _sparse.on_cpu(self.tensors))
        ):
            raise ValueError(
                "exact=True: exact norms are taken of plain CPU and CUDA tensors that autograd does not track, "
                f"CPU sparse tensors and sharded gradients; got {kinds_of(self.tensors)}"
            )

    def sharded_total_norm(self, ord: float, error_if_nonfinite: bool, exact: bool | None = None) -> Tensor:
        """The global norm of sharded gradients (float64, on their device, the same on every rank)."""
        total, _ = self.shards.norms(ord, exact=_ops.exact_norms(exact))
        raise_if_nonfinite(total, ord, error_if_nonfinite)
        return total

    def scale_(self, scale: Tensor) -> None:
        """Each written tensor times `scale` (0-d) or `scale[i]` (1-d), in place, rounded as torch's
        mul_ by a tensor; a scale of exactly 1 writes nothing on the CPU kernels."""
        targets = self.local
        if not targets:
            return
        if self.shards is not None:
            self.shards.scale_(scale)
            return
        if self.route is Route.KERNELS:
            _ops.multi_tensor_scale_(targets, scale)
            return
        for i, t in enumerate(targets):  # (scaling a sparse tensor's stored values scales its sums)
            t.mul_((scale if scale.dim() == 0 else scale[i]).to(t.device))

    def clamp_(self, lo: float, hi: float) -> None:
        """Each tensor clamped to [lo, hi] in place, in one pass on KERNELS (a sparse COO tensor after
        summing its duplicates)."""
        if self.route is Route.KERNELS:
            if self.tensors:
                _ops.multi_tensor_clamp_(self.tensors, lo, hi)
            return
        for t in self.tensors:
            (_sparse.clamp_ if _sparse.is_sparse(t) else Tensor.clamp_)(t, lo, hi)


def kinds_of(tensors: Sequence[Tensor]) -> list[str]:
    """What a refusal names: each distinct tensor type and device ("Tensor on cuda:0")."""
    return sorted({f"{type(t).__name__} on {t.device}" for t in tensors})


def _tracked(tensors: Sequence[Tensor]) -> bool:
    """Whether autograd would track a norm of these tensors (the kernels' results are not
    differentiable): grad mode is on and one of them requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _sharded_layout(tensors: Sequence[Tensor], params: Sequence[Tensor] | None, process_group):
    """The sharded route's layout, or None. torchclip._sharded imports torch.distributed, which is heavy and
    optional: it is imported where a process group is given or a tensor is a DTensor, never at import."""
    if process_group is None and not any(type(t).__name__ == "DTensor" for t in tensors):
        return None
    from torchclip import _sharded

    if not _sharded.distributed_ready():
        return None
    return _sharded.layout_of(list(tensors), None if params is None else list(params), process_group)


def raise_if_nonfinite(total: Tensor, norm_type: float, error_if_nonfinite: bool) -> None:
    """torch.nn.utils' error for error_if_nonfinite (a host read of the norm, as torch's)."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )


def _tensor_norm64(t: Tensor, ord: float) -> Tensor:
    if _sparse.is_sparse(t):
        return _sparse.norm64(t, ord)
    return torch.linalg.vector_norm(t, ord, dtype=torch.complex128 if t.is_complex() else torch.float64)
