"""Gradients' bridge to sharded gradients (torchclip.distributed), for the drop-ins and
the clip classes. torchclip.distributed imports torch.distributed, which is heavy and optional: it is
imported on first use, never at `import torchclip`."""

from __future__ import annotations

import torch
from torch import Tensor

from torchclip import _ops


def _distributed():
    from torchclip import distributed

    return distributed


def hand_shards(grads: list[Tensor], params: list[Tensor], process_group):
    """Shards of gradients the user sharded by hand over `process_group`: the parameters say which
    gradients are replicated (counted by one rank only)."""
    distributed = _distributed()
    return distributed.hand_shards(grads, [distributed.is_replicated(p) for p in params], process_group)


def dtensor_shards(grads: list[Tensor]):
    """Shards of DTensor gradients (FSDP2), or None: not DTensors, or no process group is initialised."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return _distributed().dtensor_shards(grads)


def raise_if_nonfinite(total: Tensor, norm_type: float, error_if_nonfinite: bool) -> None:
    """torch.nn.utils' error for error_if_nonfinite (a host read of the norm, as torch's)."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )


def sharded_norm(shards, norm_type: float, error_if_nonfinite: bool, exact: bool | None = None) -> Tensor:
    """The global norm (float64, CPU, the same on every rank) of sharded gradients."""
    if not _ops.kernels_serve(shards.local, devices=("cpu",)):
        raise ValueError("process_group: sharded clipping runs on plain strided CPU gradients (gloo) for now")
    total, _ = _distributed().sharded_norms(shards, norm_type, exact=_ops.exact_norms(exact))
    raise_if_nonfinite(total, norm_type, error_if_nonfinite)
    return total


def global_tensor_norms(shards, norm_type: float = 2.0, exact: bool | None = None) -> tuple[Tensor, Tensor]:
    """(the global total, each sharded gradient's global norm), float64 on the CPU, the same on every
    rank, of CPU shards."""
    return _distributed().sharded_norms(shards, norm_type, per_tensor=True, exact=_ops.exact_norms(exact))
