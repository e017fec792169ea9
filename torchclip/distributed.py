"""Clipping gradients that are sharded across the ranks of a torch.distributed process group.

With ZeRO-style or tensor-parallel sharding each rank holds part of the gradients. The global norm
needs every rank's part, so each rank computes its local total with the fused kernel, one all_gather
of one float64 scalar per rank collects them, and every rank combines them the same way: every rank
clips with the same coefficient, exactly as if the gradients were not sharded.

Parameters that every rank holds whole (replicated: biases and norms under tensor parallelism,
shared embeddings) would be counted once per rank; mark them with `set_replicated(params)` and only
the group's first rank counts them (every rank still clips its copy).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from torchclip import _ops

_REPLICATED = "torchclip_replicated"


def set_replicated(params, replicated: bool = True) -> int:
    """Mark parameters (a module's, an iterable's, or one) as replicated on every rank."""
    if isinstance(params, torch.nn.Module):
        params = list(params.parameters())
    elif isinstance(params, Tensor):
        params = [params]
    else:
        params = list(params)
    for p in params:
        setattr(p, _REPLICATED, bool(replicated))
    return len(params)


def _local_total64(grads: list[Tensor], norm_type: float) -> Tensor:
    """This rank's total norm (float64, CPU) of its gradients; the combining rule's identity when it
    has none (0 for every order but -inf, whose identity is +inf)."""
    if not grads:
        return torch.tensor(math.inf if norm_type == -math.inf else 0.0, dtype=torch.float64)
    if norm_type == 0.0:  # torch's p = 0 total counts the tensors with a non-zero element: a sum
        _, per_tensor = _ops.multi_tensor_norm(grads, 1.0)
        return (per_tensor != 0).sum().to(torch.float64)
    _, per_tensor = _ops.multi_tensor_norm(grads, norm_type)
    total, _ = _ops.multi_tensor_norm([per_tensor], norm_type)  # the kernel's overflow-safe combine
    return total


def _combine(totals: Tensor, norm_type: float) -> Tensor:
    if norm_type == 0.0:
        return totals.sum()
    total, _ = _ops.multi_tensor_norm([totals], norm_type)
    return total


def is_replicated(param) -> bool:
    return bool(getattr(param, _REPLICATED, False))


def sharded_total_norm(grads: list[Tensor], replicated: list[bool], norm_type: float, process_group) -> Tensor:
    """The global norm (float64, CPU, the same on every rank) of gradients sharded over the group;
    replicated[i] says grads[i] is whole on every rank (counted by the group's first rank only)."""
    first = dist.get_rank(process_group) == 0
    counted = [g for g, whole in zip(grads, replicated) if first or not whole]
    local = _local_total64(counted, norm_type)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(gathered, local, group=process_group)
    return _combine(torch.stack(gathered), norm_type)


# ---- DTensor gradients (FSDP2 fully_shard, torch.distributed.tensor) ----------------------------------


def dtensor_shards(grads: list[Tensor]):
    """(local tensors, replicated flags, process group) when every gradient is a DTensor on one 1-D
    mesh with Shard or Replicate placements; None otherwise (torch's own DTensor path serves those).

    Working on the local shards costs one Python step per gradient and one collective in all, where
    torch's DTensor path dispatches every per-parameter op through DTensor's sharding propagation."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    if not grads or not all(type(g) is DTensor for g in grads):
        return None
    mesh = grads[0].device_mesh
    if mesh.ndim != 1 or any(g.device_mesh != mesh for g in grads):
        return None
    locals_, replicated = [], []
    for g in grads:
        placement = g.placements[0]
        if not (placement.is_shard() or placement.is_replicate()):
            return None  # Partial: pending reductions, not gradients yet
        locals_.append(g._local_tensor)
        replicated.append(placement.is_replicate())
    return locals_, replicated, mesh.get_group()
