"""Clipping gradients that are sharded across the ranks of a torch.distributed process group.

With ZeRO-style, FSDP2 or tensor-parallel sharding each rank holds part of the gradients. The global
norm needs every rank's part, so each rank computes its local norms with the fused kernel, one
all_gather of float64 values collects them, and every rank combines the same numbers the same way:
every rank clips with the same coefficient, exactly as if the gradients were not sharded.

Each piece a rank holds is either counted by it or not, so that every element of the full gradients
is counted exactly once:

* hand-sharded gradients (`process_group=`): every piece is counted, except pieces of parameters
  marked replicated (`set_replicated`: biases and norms under tensor parallelism, shared
  embeddings), which only the group's first rank counts;
* DTensor gradients (FSDP2's fully_shard, HSDP, FSDP + tensor parallelism): a rank counts its local
  shard when its coordinate is 0 along every mesh dimension whose placement is Replicate.

Norms of any order combine by the same rule the kernels use within a rank: the p-norm of the
pieces' p-norms (a sum of counts for p = 0), so one combine works for every norm type. Exact norms
(p = 1 and 2, `exact=` or torchclip.set_exact_norm) exchange exact sums instead: each rank's sum of
|x| or x^2 as int64 digits, added by one all_reduce, which integer addition makes exact in any order,
then rounded once: any number of ranks and any sharding give one process's bits.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from torchclip import _ops

_REPLICATED = "torchclip_replicated"


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


def is_replicated(param) -> bool:
    return bool(getattr(param, _REPLICATED, False))


@dataclass
class Shards:
    """This rank's pieces of sharded gradients, and how to combine them with the other ranks'."""

    local: list[Tensor]  # this rank's pieces (plain tensors: the kernels' input)
    counted: list[bool]  # whether this rank counts local[i] (one copy of every element is counted)
    groups: list  # process groups whose all_gathers, in turn, reach every rank holding a piece
    # Whether every rank holds a piece of the same gradients in the same order (DTensors do, a
    # hand-sharded optimizer need not): only then are per-tensor norms defined across ranks.
    aligned: bool


def hand_shards(grads: list[Tensor], replicated: list[bool], process_group, aligned: bool = False) -> Shards:
    """Shards of a hand-sharded (ZeRO-style) optimizer: `grads` is this rank's share of the group's."""
    first = dist.get_rank(process_group) == 0
    return Shards(grads, [first or not whole for whole in replicated], [process_group], aligned)


def _identity(norm_type: float) -> float:
    """A piece that adds nothing: 0 for positive orders (and p = 0's count); +inf for negative orders,
    where |x|^p of inf is 0, and for -inf, a minimum."""
    return math.inf if norm_type < 0 else 0.0


def _local_norms(shards: Shards, norm_type: float) -> Tensor:
    """Each local piece's norm (float64, CPU), or the identity where this rank does not count it."""
    values = torch.full((len(shards.local),), _identity(norm_type), dtype=torch.float64)
    # An empty piece (a rank past the end of a small Shard(0) tensor) adds nothing: the identity.
    counted = [i for i, c in enumerate(shards.counted) if c and shards.local[i].numel() > 0]
    if counted:
        # p = 0: torch's per-tensor 0-norm counts non-zero elements, and counts add across pieces.
        _, norms = _ops.multi_tensor_norm([shards.local[i] for i in counted], norm_type)
        values[counted] = norms
    return values


def _combine_rows(rows: Tensor, norm_type: float) -> Tensor:
    """Column-wise: the norm of each column's pieces (rows are ranks), by the kernels' combine."""
    if norm_type == 0.0:
        return rows.sum(dim=0)
    _, combined = _ops.multi_tensor_norm(list(rows.t().contiguous()), norm_type)
    return combined


def _total_of_tensor_norms(norms: Tensor, norm_type: float) -> Tensor:
    """torch's total from per-tensor norms: their p-norm; for p = 0, the tensors with a non-zero norm."""
    if norm_type == 0.0:
        return (norms != 0).sum().to(torch.float64)
    total, _ = _ops.multi_tensor_norm([norms], norm_type)
    return total.to(torch.float64)


def _all_combine(values: Tensor, norm_type: float, groups) -> Tensor:
    """values (float64 vector, the same length on every rank) combined element-wise over the ranks of
    each group in turn; the result is bit-identical on every rank (same inputs, same order)."""
    for group in groups:
        gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, values, group=group)
        values = _combine_rows(torch.stack(gathered), norm_type)
    return values


def _exact_sums(shards: Shards, norm_type: float, per_tensor: bool) -> Tensor:
    """This rank's exact sums (int64 rows, _ops.exact_sums): one per gradient, or one for all; zero
    rows where this rank does not count its piece."""
    counted = [i for i, c in enumerate(shards.counted) if c and shards.local[i].numel() > 0]
    if counted and not per_tensor:
        return _ops.exact_sums([shards.local[i] for i in counted], norm_type, False)
    rows = torch.zeros((len(shards.local) if per_tensor else 1, _ops.EXACT_SUM_COLUMNS), dtype=torch.int64)
    if counted:
        rows[counted] = _ops.exact_sums([shards.local[i] for i in counted], norm_type, True)
    return rows


def _all_add(rows: Tensor, groups) -> Tensor:
    """rows summed element-wise over the ranks of each group in turn: integers, so exact in any order."""
    for group in groups:
        dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    return rows


def _exact_norms(
    shards: Shards, norm_type: float, per_tensor: bool, local: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    rows = _all_add(_exact_sums(shards, norm_type, per_tensor) if local is None else local, shards.groups)
    total = _ops.norms_of_exact_sums(rows.sum(dim=0, keepdim=True), norm_type)[0]
    return total, (_ops.norms_of_exact_sums(rows, norm_type) if per_tensor else None)


def sharded_norms(
    shards: Shards, norm_type: float, per_tensor: bool = False, exact: bool = False, local: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """(global total norm, global per-tensor norms or None), float64 on the CPU, the same on every rank.

    Without per_tensor the collective carries one scalar per rank; with it (aligned shards only), one
    value per gradient, and the total is formed from the global per-tensor norms. p = 0 takes the
    per-tensor route whenever the shards are aligned: torch's p = 0 total counts whole tensors. With
    exact (p = 1, 2), exact sums are exchanged instead (kExactSumColumns int64s per row; see above).
    local: with per_tensor, this rank's values already taken (norm_in_backward's measurements): the exact
    sums' rows, or each piece's norm, zero where this rank does not count its piece."""
    if per_tensor and not shards.aligned:
        raise ValueError(
            "per_tensor: per-tensor norms need every rank to hold pieces of the same gradients "
            "in the same order (DTensor gradients do; hand-sharded lists need not)"
        )
    # Decided by the order alone, so every rank takes the same collective (a complex piece's 1-norm
    # enters its rank's exact sum as a float64 value).
    if exact and norm_type in (1.0, 2.0):
        return _exact_norms(shards, norm_type, per_tensor, local)
    local = _local_norms(shards, norm_type) if local is None else local
    if per_tensor or (norm_type == 0.0 and shards.aligned):
        norms = _all_combine(local, norm_type, shards.groups)
        return _total_of_tensor_norms(norms, norm_type), (norms if per_tensor else None)
    if norm_type == 0.0:
        # A piece counts as a tensor: sharding a tensor across ranks changes this count by design.
        local_total = (local != 0).sum().to(torch.float64)
    elif len(local):
        local_total = _total_of_tensor_norms(local, norm_type)
    else:
        local_total = torch.tensor(_identity(norm_type), dtype=torch.float64)
    return _all_combine(local_total.reshape(1), norm_type, shards.groups)[0], None


# ---- DTensor gradients (FSDP2 fully_shard, HSDP, FSDP + TP, torch.distributed.tensor) -----------


def _mesh_ranks(mesh) -> frozenset:
    return frozenset(mesh.mesh.flatten().tolist())


def _counted_here(dtensor) -> bool | None:
    """Whether this rank counts its local shard; None for a Partial placement (a pending reduction,
    not a gradient yet)."""
    mesh = dtensor.device_mesh
    counted = True
    for dim, placement in enumerate(dtensor.placements):
        if placement.is_replicate():
            counted = counted and mesh.get_local_rank(dim) == 0
        elif not placement.is_shard():
            return None
    return counted


def dtensor_shards(grads: list[Tensor]) -> Shards | None:
    """Shards for DTensor gradients with Shard and Replicate placements, on one mesh of any dimension
    or on several meshes that all span every rank; None otherwise (torch's own DTensor path serves
    those: Partial placements, meshes over different subsets of ranks).

    One Python step per gradient and one all_gather in all (one per mesh dimension for a single mesh
    over a subset of the ranks), where torch's DTensor path dispatches every per-parameter op through
    DTensor's sharding propagation."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    if not grads or not all(type(g) is DTensor for g in grads):
        return None
    # Models have a handful of (mesh, placements) layouts and up to tens of thousands of gradients:
    # decide once per layout (this halved the walk over 20,000 gradients).
    counted_by_layout: dict = {}
    counted = []
    for g in grads:
        layout = (g.device_mesh, g.placements)
        if layout not in counted_by_layout:
            counted_by_layout[layout] = _counted_here(g)
        counted.append(counted_by_layout[layout])
    if any(c is None for c in counted_by_layout.values()):
        return None
    meshes = {mesh for mesh, _ in counted_by_layout}
    if all(_mesh_ranks(m) == frozenset(range(dist.get_world_size())) for m in meshes):
        groups = [dist.group.WORLD]
    elif len(meshes) == 1:
        (mesh,) = meshes
        groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    else:
        return None
    return Shards([g._local_tensor for g in grads], counted, groups, aligned=True)


def global_norms(
    parameters: Tensor | Iterable[Tensor],
    norm_type: float = 2.0,
    *,
    process_group: dist.ProcessGroup | None = None,
    exact: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """(total norm, per-gradient norms) of sharded gradients, for logging.

    Float64 on the CPU, the same on every rank, from one all_gather of one value per gradient (one
    all_reduce of one exact sum per gradient with exact norms).

    Args:
        parameters: parameters whose gradients are DTensors, or, with process_group, this rank's pieces
            of the same gradients as every other rank's, in the same order (an empty piece where a rank
            holds none); parameters without a gradient are skipped.
        norm_type: the norm's order p.
        process_group: the group the pieces are spread over; None for DTensor gradients.
        exact: exact norms (p = 1, 2): the true norms rounded once, one process's bits on any number of
            ranks; None: torchclip.set_exact_norm's setting.

    Returns:
        (the total norm, each gradient's norm).

    Raises:
        ValueError: without process_group, gradients that are not DTensors with Shard or Replicate
            placements.

    Example:
        >>> total, per_tensor = torchclip.distributed.global_norms(model.parameters())
    """
    _ops.check_exact(exact)
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if process_group is not None:
        shards = hand_shards(grads, [is_replicated(p) for p in params], process_group, aligned=True)
    else:
        shards = dtensor_shards(grads)
        if shards is None:
            raise ValueError(
                "parameters: without a process_group, global_norms takes DTensor gradients with "
                "Shard or Replicate placements"
            )
    return sharded_norms(shards, float(norm_type), per_tensor=True, exact=_ops.exact_norms(exact))
