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


def sharded_total_norm(params_and_grads: list[tuple[Tensor, Tensor]], norm_type: float, process_group) -> Tensor:
    """The global norm (float64, CPU, the same on every rank) of gradients sharded over the group."""
    first = dist.get_rank(process_group) == 0
    counted = [g for p, g in params_and_grads if first or not getattr(p, _REPLICATED, False)]
    local = _local_total64(counted, norm_type)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(gathered, local, group=process_group)
    return _combine(torch.stack(gathered), norm_type)
