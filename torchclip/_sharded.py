"""The sharded route: gradients spread over the ranks of torch.distributed process groups, in one room.

A `Layout`, built once per call from the gradients (and `process_group=` where given), says what this rank
holds of each gradient (`local`, plain tensors the kernels read and scale), whether this rank counts that
piece in a norm (`counted`: every element of the full gradients counted exactly once), and over which
process groups the local sums are reduced (`buckets`, then `across`). Every collective of the sharded route
is issued here, in an order that depends only on the gradient list, so every rank issues the same ones.

The layouts:

* DTensor gradients (FSDP2's fully_shard, HSDP, tensor parallelism, experts; `Shard`, FSDP2's strided shards,
  `Replicate` and `Partial` placements) on any number of meshes. A rank counts its local shard when its
  coordinate is 0 on every mesh dimension whose placement is `Replicate` (or `Partial`, once reduced: a
  `Partial` gradient means its reduced value, as torch means it, and its norm reads a reduced copy made by one
  all_reduce per mesh dimension and reduce op for all such gradients). Gradients are bucketed by the set of
  ranks their mesh spans; each bucket's sums are reduced over that set (its mesh's process group when the mesh
  spans every rank or has one dimension, else over each of its dimensions in turn). A mesh over fewer ranks
  than another one of the same call is a slice replicated over the rest (a parameter outside the tensor-
  parallel plan, on the data-parallel sub-mesh): its own reduction counts it once.
* Plain tensors among DTensors are replicated over the DTensors' ranks, as torch's `implicit_replication`
  treats them: counted by the first rank of the widest mesh, in its bucket.
* `process_group=` names the group across which the gradients given are disjoint parts of the whole (pipeline
  stages, a hand-sharded optimizer): after the buckets, the totals are combined over it. Plain tensors given
  with it are this rank's pieces (counted, except a parameter marked replicated, which the group's first
  rank counts) and their per-tensor norms are combined over it too (ZeRO-style slices of the same
  gradients); DTensors keep their per-tensor norms to their own meshes (a stage's parameters are its own).

Norms of any order combine by the rule the kernels use within a rank: the p-norm of the pieces' p-norms (a
sum of counts for p = 0), exchanged by all_gather, so every rank combines the same numbers in the same order
and returns the same bits. Exact norms (p = 1 and 2) exchange exact sums (int64 digits) by all_reduce, exact
in any order, rounded once. Collectives run on the gradients' device (NCCL on GPUs, gloo on the CPU) and the
norm stays there: no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from torchclip import _ops

REPLICATED_MARK = "torchclip_replicated"  # torchclip.distributed.set_replicated's attribute


@dataclass
class Bucket:
    """Gradients whose sums are reduced over the same ranks: `members` (indices into the layout's lists),
    reduced over `groups` in turn (empty: this rank alone)."""

    members: list[int]
    groups: list


@dataclass
class _PartialPiece:
    """A gradient with Partial placements: its local value is reduced over `dims` of `mesh` before its
    norm is read (the gradient itself is left as it is: scaling a partial sum scales the reduced one)."""

    index: int
    mesh: object
    reductions: list  # (mesh dimension, reduce op name)


@dataclass
class Layout:
    local: list[Tensor]  # this rank's piece of each gradient (plain tensors: the kernels' input)
    counted: list[bool]  # whether this rank counts local[i]: one copy of every element is counted
    buckets: list[Bucket]
    across: object = None  # process_group: disjoint parts, combined after the buckets
    # Whether each gradient is one tensor whose pieces lie in its bucket's ranks (DTensors; hand-sharded
    # lists when the caller says every rank passes pieces of the same gradients in the same order): only then
    # are per-tensor norms defined across ranks.
    aligned: bool = True
    partial: list[_PartialPiece] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        """Where the norms are taken and exchanged: the pieces' device; for a rank holding none, the one its
        groups' backend moves (NCCL: the current CUDA device)."""
        if self.local:
            return self.local[0].device
        groups = [g for b in self.buckets for g in b.groups] + ([self.across] if self.across is not None else [])
        if groups and dist.get_backend(groups[0]) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---- norms -----------------------------------------------------------------------------------

    def norms(
        self, norm_type: float, *, per_tensor: bool = False, exact: bool = False, local: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """(the global total norm, the global per-tensor norms or None), float64 on the gradients' device,
        the same on every rank. p = 0's total counts whole tensors (torch's rule), so it takes the
        per-tensor route when the layout is aligned. local: this rank's values already taken
        (norm_in_backward's measurements, per tensor): each piece's norm, or its exact sums' row; zero
        where this rank does not count its piece."""
        if per_tensor and not self.aligned:
            raise ValueError(
                "per_tensor: per-tensor norms need every rank to hold pieces of the same gradients "
                "in the same order (DTensor gradients do; hand-sharded lists need not)"
            )
        # Decided by the order alone, so every rank takes the same collectives.
        if exact and norm_type in (1.0, 2.0):
            return self._exact_norms(norm_type, per_tensor, local)
        if local is None:
            local = self._local_norms(norm_type)
        if per_tensor or (norm_type == 0.0 and self.aligned):
            if self._one_bucket:
                norms = _all_combine(local, norm_type, self.buckets[0].groups)
            else:
                norms = local.clone()
                for bucket in self.buckets:
                    norms[bucket.members] = _all_combine(local[bucket.members], norm_type, bucket.groups)
            total = _total_of_tensor_norms(norms, norm_type)
            norms = norms if per_tensor else None
        else:
            # One value per bucket (a piece counts as a tensor for p = 0: sharding changes that count by
            # design), each combined over its bucket's ranks (one collective for buckets over the same
            # groups), then over the buckets.
            totals = torch.stack([_total_of_tensor_norms(self._of(local, b), norm_type) for b in self.buckets])
            for groups, indices in _by_groups(self.buckets).items():
                totals[indices] = _all_combine(totals[indices], norm_type, list(groups))
            total = _combine_rows(totals.reshape(-1, 1), norm_type)[0]
            norms = None
        if self.across is not None:
            total = _all_combine(total.reshape(1), norm_type, [self.across])[0]
        return total, norms

    @property
    def _one_bucket(self) -> bool:
        """One bucket holding every gradient (most layouts): its members need no indexing."""
        return len(self.buckets) == 1 and len(self.buckets[0].members) == len(self.local)

    def _of(self, values: Tensor, bucket: Bucket) -> Tensor:
        return values if self._one_bucket else values[bucket.members]

    def _pieces(self) -> list[Tensor]:
        """What each gradient's norm reads: its local piece, or its reduced copy (Partial placements)."""
        if not self.partial:
            return self.local
        pieces = list(self.local)
        for piece, reduced in zip(self.partial, _reduce_partials(self.partial, self.local)):
            pieces[piece.index] = reduced
        return pieces

    def _local_norms(self, norm_type: float) -> Tensor:
        """Each piece's norm (float64), or the identity where this rank does not count it."""
        values = torch.full((len(self.local),), _identity(norm_type), dtype=torch.float64, device=self.device)
        pieces = self._pieces()
        # An empty piece (a rank past the end of a small Shard(0) tensor) adds nothing: the identity, which
        # its norm is for positive finite orders (the kernels refuse an empty tensor's inf norm, as torch).
        finite_positive = 0 < norm_type < math.inf
        if finite_positive and all(self.counted):
            if pieces:
                values = _ops.multi_tensor_norm(pieces, norm_type)[1].to(self.device)
            return values
        counted = [i for i, c in enumerate(self.counted) if c and (finite_positive or pieces[i].numel() > 0)]
        if counted:
            # p = 0: torch's per-tensor 0-norm counts non-zero elements, and counts add across pieces.
            _, norms = _ops.multi_tensor_norm([pieces[i] for i in counted], norm_type)
            values[counted] = norms.to(self.device)
        return values

    def _exact_norms(self, norm_type: float, per_tensor: bool, local: Tensor | None) -> tuple[Tensor, Tensor | None]:
        # Exchanged on the pieces' device (NCCL moves no CPU tensor), rounded on the CPU.
        rows = (self._exact_rows(norm_type) if local is None else local).to(self.device)
        if per_tensor:
            for bucket in self.buckets:
                rows[bucket.members] = _all_add(rows[bucket.members], bucket.groups)
            total_row = rows.sum(dim=0, keepdim=True)
        else:
            # One row per bucket (ranks may hold different numbers of pieces), one collective per groups.
            sums = torch.stack([self._of(rows, b).sum(dim=0) for b in self.buckets])
            for groups, indices in _by_groups(self.buckets).items():
                sums[indices] = _all_add(sums[indices], list(groups))
            total_row = sums.sum(dim=0, keepdim=True)
        if self.across is not None:
            total_row = _all_add(total_row, [self.across])
        total = _ops.norms_of_exact_sums(total_row.cpu(), norm_type)[0].to(self.device)
        return total, (_ops.norms_of_exact_sums(rows.cpu(), norm_type).to(self.device) if per_tensor else None)

    def _exact_rows(self, norm_type: float) -> Tensor:
        """This rank's exact sums (int64 rows on the CPU, one per gradient; _ops.exact_sums), zero where
        this rank does not count its piece. (CUDA pieces are summed from CPU copies: no CUDA exact-sums
        kernel yet.)"""
        pieces = self._pieces()
        if all(self.counted) and all(p.device.type == "cpu" for p in pieces) and pieces:
            return _ops.exact_sums(pieces, norm_type, True)
        rows = torch.zeros((len(pieces), _ops.EXACT_SUM_COLUMNS), dtype=torch.int64)
        counted = [i for i, c in enumerate(self.counted) if c and pieces[i].numel() > 0]
        if counted:
            rows[counted] = _ops.exact_sums([pieces[i].cpu() for i in counted], norm_type, True)
        return rows

    # ---- writing ---------------------------------------------------------------------------------

    def scale_(self, scale: Tensor) -> None:
        """Every local piece times `scale` (0-d), in place: one coefficient across every mesh."""
        if self.local:
            _ops.multi_tensor_scale_(self.local, scale.to(self.device))


# ---- building a layout ---------------------------------------------------------------------------


def distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_replicated(param) -> bool:
    """Whether torchclip.distributed.set_replicated marked this parameter."""
    return bool(getattr(param, REPLICATED_MARK, False))


def layout_of(
    grads: list[Tensor], params: list[Tensor] | None = None, process_group=None, aligned_pieces: bool = False
) -> Layout | None:
    """The layout of a call's gradients, or None where the sharded route does not serve them: no DTensor
    and no process_group; placements other than Shard, Replicate and Partial (sum, avg, max, min); a mesh
    without this rank; pieces the kernels do not serve (another device, a subclass, several devices).
    aligned_pieces: plain gradients with process_group are pieces of the same gradients on every rank, in the
    same order (global_norms' promise), so their per-tensor norms are defined."""
    dtensor_type = _dtensor_type()
    if dtensor_type is not None and any(type(g) is dtensor_type for g in grads):
        layout = _dtensor_layout(grads, dtensor_type, process_group)
    elif process_group is not None:
        replicated = [is_replicated(p) for p in (grads if params is None else params)]
        layout = hand_layout(grads, replicated, process_group, aligned_pieces)
    else:
        return None
    if layout is None or not _ops.kernels_serve(layout.local):
        return None
    return layout


def hand_layout(grads: list[Tensor], replicated: list[bool], process_group, aligned: bool) -> Layout:
    """A hand-sharded (ZeRO-style) optimizer's layout: `grads` are this rank's share of the group's."""
    first = dist.get_rank(process_group) == 0
    counted = [first or not whole for whole in replicated]
    return Layout(list(grads), counted, [Bucket(list(range(len(grads))), [process_group])], None, aligned)


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


# A Partial placement's reduce op, as an all_reduce op; avg is a sum divided by the group's size.
_PARTIAL_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}


def _placement_rule(mesh, placements):
    """(counted here, [(mesh dimension, reduce op) for Partial dimensions]) for one (mesh, placements), or
    None where the route does not serve it."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    counted, partial = True, []
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            continue
        if placement.is_partial():
            op = getattr(placement, "reduce_op", None)
            if op not in _PARTIAL_OPS:
                return None
            partial.append((dim, op))
        elif not placement.is_replicate():
            return None
        counted = counted and coordinate[dim] == 0  # Replicate, and Partial once reduced
    return counted, partial


# id(DTensorSpec) -> (the spec, its mesh, counted here, Partial dimensions, the mesh's ranks): FSDP2 keeps one spec
# per parameter across steps, so later calls find each gradient's rule by an integer key (DeviceMesh's and
# Placement's own hashes are Python, a microsecond a call: half the walk over 20,000 gradients). The spec is kept
# to check the id is still its own; the cache is emptied when it grows past _SPEC_RULES_LIMIT entries.
_SPEC_RULES: dict = {}
_SPEC_RULES_LIMIT = 1 << 16


# (id(mesh), placements) -> (mesh, counted here, Partial dimensions, ranks): a model has a handful.
_LAYOUT_RULES: dict = {}


def _spec_rule(spec):
    """(spec, mesh, counted here, Partial dimensions, ranks) for a DTensorSpec, or None where the route does
    not serve its placements."""
    entry = _SPEC_RULES.get(id(spec))
    if entry is not None and entry[0] is spec:
        return entry
    mesh = spec.mesh
    key = (id(mesh), spec.placements)
    rule = _LAYOUT_RULES.get(key)
    if rule is None or rule[0] is not mesh:
        found = _placement_rule(mesh, spec.placements)
        if found is None:
            return None
        if len(_LAYOUT_RULES) >= _SPEC_RULES_LIMIT:
            _LAYOUT_RULES.clear()
        rule = _LAYOUT_RULES[key] = (mesh, *found, frozenset(mesh.mesh.flatten().tolist()))
    if len(_SPEC_RULES) >= _SPEC_RULES_LIMIT:
        _SPEC_RULES.clear()
    entry = _SPEC_RULES[id(spec)] = (spec, *rule)
    return entry


def _dtensor_layout(grads: list[Tensor], dtensor_type, process_group) -> Layout | None:
    buckets: dict = {}  # the ranks a mesh spans -> (mesh, Bucket), in first-appearance order
    local, counted, partial, plain = [], [], [], []
    # (the loop runs once per gradient: its lookups are bound to locals, and a cached rule is read inline)
    rules_get, add_local, add_counted = _SPEC_RULES.get, local.append, counted.append
    last_ranks, add_member = None, None
    for i, g in enumerate(grads):
        if type(g) is not dtensor_type:
            add_local(g)
            add_counted(False)  # decided below, once the widest mesh is known
            plain.append(i)
            continue
        spec = g._spec
        rule = rules_get(id(spec))
        if rule is None or rule[0] is not spec:
            rule = _spec_rule(spec)
            if rule is None:
                return None
        _, mesh, counted_here, partial_dims, ranks = rule
        if ranks is not last_ranks:
            if ranks not in buckets:
                buckets[ranks] = (mesh, Bucket([], _groups_spanning(mesh, ranks)))
            add_member, last_ranks = buckets[ranks][1].members.append, ranks
        add_local(g._local_tensor)
        add_counted(counted_here)
        add_member(i)
        if partial_dims:
            partial.append(_PartialPiece(i, mesh, partial_dims))
    # Plain tensors: replicated over the DTensors' ranks, counted by the widest mesh's first rank.
    if plain:
        widest_ranks = max(buckets, key=len)  # (max keeps the first of equals: first appearance)
        widest_mesh, widest = buckets[widest_ranks]
        first = all(c == 0 for c in widest_mesh.get_coordinate())
        for i in plain:
            counted[i] = first
        widest.members.extend(plain)
    return Layout(local, counted, [b for _, b in buckets.values()], process_group, True, partial)


def _groups_spanning(mesh, ranks: frozenset) -> list:
    """Process groups whose reductions in turn reach every rank of the mesh: the world's group when it
    spans the world, its own for one dimension, else one per dimension."""
    if len(ranks) == dist.get_world_size():
        return [dist.group.WORLD]
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


# ---- the collectives -----------------------------------------------------------------------------


def _identity(norm_type: float) -> float:
    """A piece that adds nothing: 0 for positive orders (and p = 0's count); +inf for negative orders,
    where |x|^p of inf is 0, and for -inf, a minimum."""
    return math.inf if norm_type < 0 else 0.0


def _total_of_tensor_norms(norms: Tensor, norm_type: float) -> Tensor:
    """torch's total from per-tensor norms: their p-norm; for p = 0, the tensors with a non-zero norm."""
    if norm_type == 0.0:
        return (norms != 0).sum().to(torch.float64)
    if norms.numel() == 0:
        return torch.tensor(_identity(norm_type), dtype=torch.float64, device=norms.device)
    total, _ = _ops.multi_tensor_norm([norms], norm_type)
    return total.to(torch.float64)


def _combine_rows(rows: Tensor, norm_type: float) -> Tensor:
    """Column-wise: the norm of each column's pieces (rows are ranks), by the kernels' combine."""
    if norm_type == 0.0:
        return rows.sum(dim=0)
    _, combined = _ops.multi_tensor_norm(list(rows.t().contiguous()), norm_type)
    return combined.to(rows.device)


def _all_combine(values: Tensor, norm_type: float, groups) -> Tensor:
    """values (a float64 vector, the same length on every rank) combined element-wise over the ranks of
    each group in turn; the result is bit-identical on every rank (same inputs, same order)."""
    for group in groups:
        if values.numel() == 0:
            return values
        gathered = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, values.contiguous(), group=group)
        values = _combine_rows(torch.stack(gathered), norm_type)
    return values


def _all_add(rows: Tensor, groups) -> Tensor:
    """rows summed element-wise over the ranks of each group in turn: integers, so exact in any order."""
    rows = rows.contiguous()
    for group in groups:
        dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    return rows


def _by_groups(buckets: list[Bucket]) -> dict:
    """Bucket indices by their groups (a tuple), in first-appearance order."""
    found: dict = {}
    for i, bucket in enumerate(buckets):
        found.setdefault(tuple(bucket.groups), []).append(i)
    return found


def _reduce_partials(partials: list[_PartialPiece], local: list[Tensor]) -> list[Tensor]:
    """Reduced copies of Partial gradients' local values: one all_reduce per (mesh dimension's group, op,
    dtype) for all of them, in the order of the list (the same on every rank)."""
    copies = [local[p.index].detach().clone() for p in partials]
    steps: dict = {}
    for k, piece in enumerate(partials):
        for dim, op in piece.reductions:
            steps.setdefault((piece.mesh.get_group(dim), op, copies[k].dtype), []).append(k)
    for (group, op, _), members in steps.items():
        flat = torch.cat([copies[k].reshape(-1) for k in members])
        dist.all_reduce(flat, op=getattr(dist.ReduceOp, _PARTIAL_OPS[op]), group=group)
        if op == "avg":
            flat /= dist.get_world_size(group)
        offset = 0
        for k in members:
            n = copies[k].numel()
            copies[k].copy_(flat[offset : offset + n].view_as(copies[k]))
            offset += n
    return copies
