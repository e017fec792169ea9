"""Clipping gradients that are sharded across the ranks of torch.distributed process groups.

With FSDP2, HSDP, tensor parallelism, experts, pipeline stages or a ZeRO-style optimizer each rank holds
part of the gradients. torchclip's clips and drop-ins take them as they are: each rank takes the norms of
its pieces with the fused kernels, the ranks combine them in as few collectives as the layout allows, and
every rank clips by the same coefficient, exactly as if the gradients were not sharded
(torchclip/_sharded.py says how each layout is counted and reduced).

This module holds what a user of those layouts calls beyond the drop-ins: `set_replicated` for parameters
every rank holds whole under hand sharding, and `global_norms` for logging.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from torchclip import _ops, _sharded

_REPLICATED = _sharded.REPLICATED_MARK
is_replicated = _sharded.is_replicated  # (the route reads the mark where it builds a layout)


def set_replicated(params: torch.nn.Module | Tensor | Iterable[Tensor], replicated: bool = True) -> int:
    """Mark parameters as replicated on every rank, for hand-sharded clipping (`process_group=`).

    Biases and norms under tensor parallelism, shared embeddings: every rank holds them whole, so only
    the group's first rank counts them in the global norm; every rank clips its own copy.

    Args:
        params: a Module (its parameters), an iterable of parameters, or one.
        replicated: True to mark, False to unmark.

    Returns:
        How many parameters were marked.

    Example:
        >>> torchclip.distributed.set_replicated([layer.bias for layer in model.layers])
    """
    if isinstance(params, torch.nn.Module):
        params = list(params.parameters())
    elif isinstance(params, Tensor):
        params = [params]
    else:
        params = list(params)
    for p in params:
        setattr(p, _REPLICATED, bool(replicated))
    return len(params)


def global_norms(
    parameters: Tensor | Iterable[Tensor],
    norm_type: float = 2.0,
    *,
    process_group: dist.ProcessGroup | None = None,
    exact: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """(total norm, per-gradient norms) of sharded gradients, for logging.

    Float64 on the gradients' device, the same on every rank, from one all_gather of one value per
    gradient for each set of ranks their meshes span (one all_reduce of one exact sum per gradient with
    exact norms).

    Args:
        parameters: parameters whose gradients are DTensors (plain tensors beside them are replicated
            over their ranks), or, with process_group and plain gradients, this rank's pieces of the same
            gradients as every other rank's, in the same order (an empty piece where a rank holds none);
            parameters without a gradient are skipped.
        norm_type: the norm's order p.
        process_group: for plain gradients, the group the pieces are spread over; for DTensor gradients,
            the group across which the model is split into disjoint parts (pipeline stages): the total is
            the whole model's, each gradient's norm its own stage's.
        exact: exact norms (p = 1, 2): the true norms rounded once, one process's bits on any number of
            ranks; None: torchclip.set_exact_norm's setting.

    Returns:
        (the total norm, each gradient's norm).

    Raises:
        ValueError: gradients the sharded route does not take: without process_group, anything but DTensors
            with Shard, Replicate or Partial placements.

    Example:
        >>> total, per_tensor = torchclip.distributed.global_norms(model.parameters())
    """
    _ops.check_exact(exact, norm_type)
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    layout = _sharded.layout_of(grads, params, process_group, aligned_pieces=True)
    if layout is None:
        raise ValueError(
            "parameters: global_norms takes DTensor gradients with Shard, Replicate or Partial placements, or "
            "with a process_group, plain strided CPU or CUDA tensors on one device"
        )
    with torch.no_grad():
        return layout.norms(float(norm_type), per_tensor=True, exact=_ops.exact_norms(exact))
