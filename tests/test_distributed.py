"""Sharded gradients on torch.distributed (gloo, 2 and 4 processes): the same global norm and the
same clipped gradients on every rank as single-process clipping of the full gradient list."""

import math

import pytest
import torch
import torch.distributed as dist
from ranks import rendezvous, spawn
from testing import CLIP_RTOL, NORM_RTOL

import torchclip
import torchclip.distributed
from torchclip.distributed import set_replicated

if dist.is_available():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

SHAPES = [(64, 32), (32,), (128, 7), (5,), (1000,), (3, 3, 3)]
REPLICATED = [(16,), (4, 4)]  # present whole on every rank (biases, norms under tensor parallelism)


def full_gradients():
    generator = torch.Generator().manual_seed(0)
    sharded = [torch.randn(s, generator=generator) for s in SHAPES]
    replicated = [torch.randn(s, generator=generator) for s in REPLICATED]
    return sharded, replicated


def rank_parameters(rank, world):
    """Round-robin whole tensors, plus a ZeRO-style flat slice of the largest one on every rank."""
    sharded, replicated = full_gradients()
    params, pieces = [], []
    for i, g in enumerate(sharded):
        if g.numel() == 1000:  # split evenly across ranks (ZeRO-style flat shards)
            piece = g.chunk(world)[rank]
            pieces.append(("slice", i, rank))
        elif i % world == rank:
            piece = g
            pieces.append(("whole", i, None))
        else:
            continue
        p = torch.nn.Parameter(torch.zeros_like(piece))
        p.grad = piece.clone()
        params.append(p)
    for j, g in enumerate(replicated):
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        set_replicated(p)
        params.append(p)
        pieces.append(("replicated", j, None))
    return params, pieces


def expected_piece(reference, piece, world):
    """What rank_parameters' piece of the full list `reference` (parameters) holds after clipping."""
    kind, index, shard = piece
    if kind == "whole":
        return reference[index].grad
    if kind == "slice":
        return reference[index].grad.chunk(world)[shard]
    return reference[len(SHAPES) + index].grad


def worker(rank, world, init_method, norm_type, max_norm):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        params, pieces = rank_parameters(rank, world)
        sharded, replicated = full_gradients()
        reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in sharded + replicated]
        for p, g in zip(reference, sharded + replicated):
            p.grad = g.clone()
        # get_total_norm over the sharded tensors only (no replicated ones to count once)
        sharded_only = [p.grad for p, (kind, _, _) in zip(params, pieces) if kind != "replicated"]
        norm_only = torchclip.get_total_norm(sharded_only, norm_type, process_group=dist.group.WORLD)
        expected_norm_only = torchclip.get_total_norm(sharded, norm_type)
        torch.testing.assert_close(norm_only, expected_norm_only, rtol=1e-6, atol=0)
        expected_total = torchclip.clip_grad_norm_(reference, max_norm, norm_type)
        total = torchclip.clip_grad_norm_(params, max_norm, norm_type, process_group=dist.group.WORLD)
        torch.testing.assert_close(total, expected_total, rtol=1e-6, atol=0)
        for p, piece in zip(params, pieces):
            torch.testing.assert_close(p.grad, expected_piece(reference, piece, world), rtol=1e-6, atol=1e-9)
        # The Paddle class with a process group: Paddle's formula over the same global norm.
        params, _ = rank_parameters(rank, world)
        clip = torchclip.ClipGradByGlobalNorm(0.5, process_group=dist.group.WORLD)
        clip(params)
        expected_global = torchclip.get_total_norm(sharded + replicated)
        torch.testing.assert_close(clip.last_global_norm, expected_global, rtol=1e-6, atol=0)
        scale = min(0.5 / expected_global.item(), 1.0)
        assert clip.last_norms is None and clip.last_clip_coef.dtype == torch.float64
        assert clip.last_clip_coef.item() == pytest.approx(scale, rel=1e-6)
        fresh, _ = rank_parameters(rank, world)
        for p, q in zip(params, fresh):
            torch.testing.assert_close(p.grad, q.grad * scale, rtol=1e-6, atol=1e-9)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
# (p = 0 counts tensors, and a ZeRO slice is one more tensor: sharding changes that count by design.)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_sharded_clipping_equals_single_process_clipping(world, norm_type, tmp_path):
    spawn(worker, world, rendezvous(tmp_path), norm_type, 0.5)


# Norm orders whose sharded total must equal the unsharded one exactly as torch defines it. With
# DTensors every rank holds a piece of the same gradients, so p = 0 (torch counts whole tensors) and
# negative orders are exact too.
DTENSOR_NORM_TYPES = [2.0, 1.0, math.inf, 3.0, 0.0, -1.0, -math.inf]


def dtensor_parameters(full, mesh, placements, weights=None):
    params = []
    for i, (g, placement) in enumerate(zip(full, placements)):
        w = torch.zeros_like(g) if weights is None else weights[i].clone()
        p = torch.nn.Parameter(distribute_tensor(w, mesh, placement))
        p.grad = distribute_tensor(g.clone(), mesh, placement)
        params.append(p)
    return params


def plain_parameters(full, weights=None):
    params = [
        torch.nn.Parameter(torch.zeros_like(g) if weights is None else w.clone()) for g, w in zip(full, weights or full)
    ]
    for p, g in zip(params, full):
        p.grad = g.clone()
    return params


def check_dtensor_clipping(full, make_params):
    """clip_grad_norm_, ClipGradByGlobalNorm and global_norms on DTensor gradients against the same
    calls on the full gradients in one process, for every norm order."""
    for norm_type in DTENSOR_NORM_TYPES:
        params, reference = make_params(), plain_parameters(full)
        expected_total = torchclip.clip_grad_norm_(reference, 0.5, norm_type)
        total = torchclip.clip_grad_norm_(params, 0.5, norm_type)  # no process_group needed
        assert type(total) is torch.Tensor  # a plain tensor: .item() is the global value on every rank
        torch.testing.assert_close(total, expected_total, rtol=1e-6, atol=0, msg=f"norm_type {norm_type}")
        for p, q in zip(params, reference):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9)
        total, per_tensor = torchclip.distributed.global_norms(make_params(), norm_type)
        expected = torch.stack([torch.linalg.vector_norm(g.double(), norm_type) for g in full])
        torch.testing.assert_close(per_tensor, expected, rtol=1e-7, atol=0)
        torch.testing.assert_close(total, expected_total.double(), rtol=1e-6, atol=0)
    params, reference = make_params(), plain_parameters(full)
    clip = torchclip.ClipGradByGlobalNorm(0.5)
    clip(params)
    torchclip.ClipGradByGlobalNorm(0.5)(reference)
    torch.testing.assert_close(clip.last_global_norm, torchclip.get_total_norm(full), rtol=1e-6, atol=0)
    assert clip.last_clip_coef.item() == pytest.approx(min(0.5 / clip.last_global_norm.item(), 1.0), rel=1e-6)
    for p, q in zip(params, reference):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9)
    for norm_type in (1.0, 2.0):  # exact norms: one process's bits, whatever the mesh and placements
        total, per_tensor = torchclip._ops.multi_tensor_norm(full, norm_type, exact=True, dtype=torch.float64)
        got_total, got_per_tensor = torchclip.distributed.global_norms(make_params(), norm_type, exact=True)
        assert torch.equal(got_per_tensor, per_tensor) and torch.equal(got_total, total), norm_type
        params, reference = make_params(), plain_parameters(full)
        expected = torchclip.clip_grad_norm_(reference, 0.5, norm_type, exact=True)
        assert torch.equal(torchclip.clip_grad_norm_(params, 0.5, norm_type, exact=True), expected), norm_type
        for p, q in zip(params, reference):
            assert torch.equal(p.grad.full_tensor(), q.grad), norm_type


def dtensor_worker(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sharded, replicated = full_gradients()
        full = sharded + replicated
        placements = [[Shard(0)]] * len(sharded) + [[Replicate()]] * len(replicated)
        check_dtensor_clipping(full, lambda: dtensor_parameters(full, mesh, placements))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_dtensor_gradients_are_clipped_on_their_local_shards(world, tmp_path):
    spawn(dtensor_worker, world, rendezvous(tmp_path))


def two_dim_mesh_worker(rank, world, init_method):
    """FSDP + tensor parallelism and HSDP layouts on a 2 x 2 mesh, and gradients on two meshes."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        sharded, replicated = full_gradients()
        full = sharded + replicated
        layouts = [
            [Shard(0), Shard(1)],  # FSDP over dp, column-parallel over tp
            [Shard(0), Replicate()],  # FSDP over dp, replicated over tp (a norm's weight)
            [Replicate(), Shard(0)],  # HSDP: replicated across dp groups, sharded within
            [Replicate(), Replicate()],
        ]
        placements = [
            layouts[i % len(layouts)] if g.dim() > 1 or i % len(layouts) != 0 else [Shard(0), Replicate()]
            for i, g in enumerate(full)
        ]
        check_dtensor_clipping(full, lambda: dtensor_parameters(full, mesh, placements))
        # Two meshes over the same ranks: a 1-D one and the 2-D one.
        flat = init_device_mesh("cpu", (world,))

        def on_two_meshes():
            params = dtensor_parameters(full[:3], flat, [[Shard(0)]] * 3)
            return params + dtensor_parameters(full[3:], mesh, placements[3:])

        check_dtensor_clipping(full, on_two_meshes)
        # Tensor parallelism alone, on the tp sub-mesh of each dp replica, each replica with its own
        # gradients: every replica gets the norm of its own DTensors (a collective over its tp group).
        own = [g * (1 + mesh.get_local_rank("dp")) for g in full]
        tp_placements = [[Shard(0)] if i % 2 else [Replicate()] for i in range(len(own))]
        check_dtensor_clipping(own, lambda: dtensor_parameters(own, mesh["tp"], tp_placements))
    finally:
        dist.destroy_process_group()


def test_dtensors_on_two_dimensional_and_several_meshes(tmp_path):
    spawn(two_dim_mesh_worker, 4, rendezvous(tmp_path))


def fsdp2_worker(rank, world, init_method, mesh_shape):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")  # FSDP; HSDP
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        generator = torch.Generator().manual_seed(rank)  # each rank its own batch
        model(torch.randn(4, 8, generator=generator)).pow(2).sum().backward()
        full = [p.grad.full_tensor() for p in model.parameters()]
        reference = plain_parameters(full)
        expected = torch.nn.utils.clip_grad_norm_(reference, 0.1)
        total = torchclip.clip_grad_norm_(model.parameters(), 0.1)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
        for p, q in zip(model.parameters(), reference):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-8)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, mesh_shape", [(2, (2,)), (4, (2, 2))], ids=["fsdp", "hsdp"])
def test_fsdp2_fully_shard_gradients(world, mesh_shape, tmp_path):
    spawn(fsdp2_worker, world, rendezvous(tmp_path), mesh_shape)


def per_tensor_worker(rank, world, init_method):
    """Hand-sharded pieces of the same gradients on every rank: per-tensor norms in the same collective."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        sharded, _ = full_gradients()
        params = []
        for g in sharded:
            pieces = g.flatten().chunk(world)
            piece = pieces[rank] if rank < len(pieces) else g.flatten()[:0]  # (5,) has 2 pieces of 3 and 2
            p = torch.nn.Parameter(torch.zeros_like(piece))
            p.grad = piece.clone()
            params.append(p)
        total, per_tensor = torchclip.distributed.global_norms(params, 2.0, process_group=dist.group.WORLD)
        expected = torch.stack([torch.linalg.vector_norm(g.double()) for g in sharded])
        torch.testing.assert_close(per_tensor, expected, rtol=1e-7, atol=0)
        torch.testing.assert_close(total, torch.linalg.vector_norm(expected), rtol=1e-7, atol=0)
    finally:
        dist.destroy_process_group()


def test_per_tensor_norms_of_hand_sharded_gradients(tmp_path):
    spawn(per_tensor_worker, 2, rendezvous(tmp_path))


def ddp_worker(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        generator = torch.Generator().manual_seed(rank)  # each rank its own batch
        model(torch.randn(4, 8, generator=generator)).pow(2).sum().backward()
        # What DDP does after backward: average the gradients over the ranks. (DDP's own reducer is
        # left out: torn down with gloo in a test process it aborts now and then at exit.)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        twins = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for t, p in zip(twins, model.parameters()):
            t.grad = p.grad.clone()
        # The gradients are replicated: plain clipping, no process_group, agrees with torch on every rank
        total = torchclip.clip_grad_norm_(model.parameters(), 0.1)
        expected = torch.nn.utils.clip_grad_norm_(twins, 0.1)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
        gathered = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(gathered, total)
        assert all(torch.equal(g, total) for g in gathered)  # the same on every rank
        for t, p in zip(twins, model.parameters()):
            torch.testing.assert_close(p.grad, t.grad, rtol=1e-5, atol=1e-8)
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_need_no_process_group(tmp_path):
    spawn(ddp_worker, 2, rendezvous(tmp_path))


# ---- adaptive clips on DTensor gradients: the global (per-tensor) norms, the same decisions everywhere ----


ADAPTIVE_CLIPS = {
    "zscore": lambda: torchclip.ClipGradByZScore(warmup_steps=3, max_grad_norm=None),
    "quantile": lambda: torchclip.ClipGradByQuantile(0.5, 4),
    "quantile-global": lambda: torchclip.ClipGradByQuantile(0.5, 4, global_threshold=True),
    "norm-ema": lambda: torchclip.ClipGradByNormEMA(warmup_steps=3),
    "skip-on-spike": lambda: torchclip.SkipStepOnSpike(torchclip.ClipGradByGlobalNorm(20.0), window=4),
}


def adaptive_worker(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sharded, replicated = full_gradients()
        placements = [[Shard(0)]] * len(sharded) + [[Replicate()]] * len(replicated)
        for name, make_clip in ADAPTIVE_CLIPS.items():
            clip, reference_clip = make_clip(), make_clip()
            for step, scale in enumerate([1.0, 1.2, 0.9, 1.1, 30.0, 1.0, 0.8]):  # a spike at step 4
                full = [g * scale * (1 + 0.1 * i * step) for i, g in enumerate(sharded + replicated)]
                params, reference = dtensor_parameters(full, mesh, placements), plain_parameters(full)
                clip(params)
                reference_clip(reference)
                for p, q in zip(params, reference):
                    torch.testing.assert_close(
                        p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9, msg=f"{name}, step {step}"
                    )
                if name == "skip-on-spike":
                    assert bool(clip.skip) == bool(reference_clip.skip), step
    finally:
        dist.destroy_process_group()


def test_adaptive_clips_on_dtensor_gradients(tmp_path):
    spawn(adaptive_worker, 2, rendezvous(tmp_path))


HAND_SHARDED_CLIPS = {
    "zscore": lambda group: torchclip.ClipGradByZScore(warmup_steps=3, max_grad_norm=None, process_group=group),
    "quantile-global": lambda group: torchclip.ClipGradByQuantile(0.5, 4, global_threshold=True, process_group=group),
    "skip-on-spike": lambda group: torchclip.SkipStepOnSpike(window=4, process_group=group),
}


def hand_sharded_adaptive_worker(rank, world, init_method):
    """ZeRO-style shards (whole tensors round-robin, a flat slice, replicated ones): the global-norm
    adaptive clips with process_group= take the decisions single-process clipping of the full list takes."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        sharded, replicated = full_gradients()
        for name, make_clip in HAND_SHARDED_CLIPS.items():
            clip, reference_clip = make_clip(dist.group.WORLD), make_clip(None)
            for step, scale in enumerate([1.0, 1.2, 0.9, 1.1, 30.0, 1.0, 0.8]):
                params, pieces = rank_parameters(rank, world)
                for p in params:
                    p.grad.mul_(scale)
                reference = plain_parameters([g * scale for g in sharded + replicated])
                clip(params)
                reference_clip(reference)
                last = (lambda c: c.last_norms) if name == "quantile-global" else (lambda c: c.last_global_norm)
                # each norm is within NORM_RTOL of the true one; the ranks and one process sum in other blocks
                torch.testing.assert_close(last(clip), last(reference_clip), rtol=2 * NORM_RTOL[torch.float32], atol=0)
                for p, piece in zip(params, pieces):
                    torch.testing.assert_close(
                        p.grad,
                        expected_piece(reference, piece, world),
                        rtol=CLIP_RTOL[torch.float32],
                        atol=1e-9,
                        msg=f"{name}, step {step}",
                    )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_adaptive_clips_on_hand_sharded_gradients(world, tmp_path):
    spawn(hand_sharded_adaptive_worker, world, rendezvous(tmp_path))


def agc_dtensor_worker(rank, world, init_method):
    """ClipGradByUnitwiseNorm on DTensor weights and gradients (rows whole on a rank with Shard(0), split
    with Shard(1)): torch's DTensor ops reduce each unit across ranks, as single-process AGC does."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        generator = torch.Generator().manual_seed(0)
        shapes = [(8, 6), (6,), (4, 3, 3, 3), (10, 4)]
        placements = [[Shard(0)], [Replicate()], [Shard(0)], [Shard(1)]]
        weights = [torch.randn(s, generator=generator) * 0.02 for s in shapes]
        grads = [torch.randn(s, generator=generator) * 0.01 for s in shapes]
        params = dtensor_parameters(grads, mesh, placements, weights)
        reference = plain_parameters(grads, weights)
        torchclip.ClipGradByUnitwiseNorm(0.01)(params)
        torchclip.ClipGradByUnitwiseNorm(0.01)(reference)
        assert any(not torch.equal(q.grad, g) for q, g in zip(reference, grads))  # some units clipped
        for p, q in zip(params, reference):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-9)
    finally:
        dist.destroy_process_group()


def test_unitwise_norm_on_dtensor_gradients(tmp_path):
    spawn(agc_dtensor_worker, 2, rendezvous(tmp_path))


# ---- exact norms: exact sums exchanged, one process's bits on any number of ranks ------------------


def exact_full_gradients():
    """float32 and bfloat16 gradients whose magnitudes span 1e-30 to 1e30: float64 partial sums combined
    over ranks would round differently from one process's."""
    generator = torch.Generator().manual_seed(7)
    shapes = [(24, 9), (1001,), (8, 8), (37,), (12, 5)]
    full = []
    for i, shape in enumerate(shapes):
        magnitudes = torch.exp2(torch.rand(shape, generator=generator, dtype=torch.float64) * 200 - 100)
        signs = torch.randint(0, 2, shape, generator=generator) * 2 - 1
        full.append((signs * magnitudes).to(torch.bfloat16 if i == 3 else torch.float32))
    return full


def uneven_cuts(n, world, rank):
    """Rank `rank`'s [begin, end) of n elements cut at uneven points (some ranks may hold none)."""
    cuts = [0] + sorted({(n * k * k) // (world * world) for k in range(1, world)}) + [n]
    cuts += [n] * (world + 1 - len(cuts))
    return cuts[rank], cuts[rank + 1]


def exact_worker(rank, world, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        full = exact_full_gradients()
        mesh = init_device_mesh("cpu", (world,))
        for norm_type in (2.0, 1.0):
            total, per_tensor = torchclip._ops.multi_tensor_norm(full, norm_type, exact=True, dtype=torch.float64)
            # Hand shards: every gradient flattened and cut unevenly, ZeRO-style, plus a replicated one.
            pieces = []
            for g in full:
                begin, end = uneven_cuts(g.numel(), world, rank)
                p = torch.nn.Parameter(torch.zeros(end - begin, dtype=g.dtype))
                p.grad = g.reshape(-1)[begin:end].clone()
                pieces.append(p)
            replicated = torch.nn.Parameter(torch.zeros(3))
            replicated.grad = torch.tensor([1e-3, 2.5, -7.0])
            set_replicated(replicated)
            with_replicated = torchclip._ops.multi_tensor_norm(
                [*full, replicated.grad], norm_type, exact=True, dtype=torch.float64
            )[0]
            got = torchclip.get_total_norm(
                [p.grad for p in pieces], norm_type, process_group=dist.group.WORLD, exact=True
            )
            assert torch.equal(got, total.to(got.dtype)), (norm_type, got.item(), total.item())
            reference = plain_parameters([*full, replicated.grad])
            expected = torchclip.clip_grad_norm_(reference, 0.5, norm_type, exact=True)
            got = torchclip.clip_grad_norm_(
                [*pieces, replicated], 0.5, norm_type, process_group=dist.group.WORLD, exact=True
            )
            assert got.double().item() == with_replicated.to(got.dtype).double().item() == expected.double().item()
            for p, g, q in zip(pieces, full, reference):
                begin, end = uneven_cuts(g.numel(), world, rank)
                assert torch.equal(p.grad, q.grad.reshape(-1)[begin:end]), norm_type
            # DTensor gradients, Shard(0) and Shard(1): the same bits, per tensor and in total.
            for dim in (0, 1):
                placements = [[Shard(dim if g.dim() > 1 else 0)] for g in full]
                params = dtensor_parameters(full, mesh, placements)
                got_total, got_per_tensor = torchclip.distributed.global_norms(params, norm_type, exact=True)
                assert torch.equal(got_per_tensor, per_tensor) and got_total.item() == total.item(), (dim, norm_type)
                reference = plain_parameters(full)
                expected = torchclip.clip_grad_norm_(reference, 0.5, norm_type, exact=True)
                got = torchclip.clip_grad_norm_(params, 0.5, norm_type, exact=True)
                assert torch.equal(got, expected), (dim, norm_type)
                for p, q in zip(params, reference):
                    assert torch.equal(p.grad.full_tensor(), q.grad), (dim, norm_type)
        # A complex piece on the first rank only: every rank still takes the same collective.
        z = torch.complex(torch.randn(50, generator=torch.Generator().manual_seed(1)), torch.ones(50))
        mine = [z] if rank == 0 else []
        got = torchclip.get_total_norm([*mine, full[0]], 1.0, process_group=dist.group.WORLD, exact=True)
        ones = [full[0]] * world  # every rank's full[0], as one process sees them
        assert got.item() == torchclip.get_total_norm([z, *ones], 1.0, exact=True).item()
        params = dtensor_parameters(full, mesh, [[Shard(1 if g.dim() > 1 else 0)] for g in full])
        clip = torchclip.ClipGradByGlobalNorm(0.5, exact=True)
        clip(params)
        reference_clip = torchclip.ClipGradByGlobalNorm(0.5, exact=True)
        reference_clip(plain_parameters(full))
        assert torch.equal(clip.last_global_norm, reference_clip.last_global_norm)
        assert torch.equal(clip.last_clip_coef, reference_clip.last_clip_coef)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_exact_norms_give_one_process_bits_on_any_number_of_ranks(world, tmp_path):
    spawn(exact_worker, world, rendezvous(tmp_path))


# ---- the norm while backward runs, on DistributedDataParallel's reduced buckets ----------------------------


class _DDPNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
        )
        self.unused = torch.nn.Linear(3, 3)  # never gets a gradient

    def forward(self, x):
        return self.layers(x)


def ddp_backward_norm_worker(rank, world, init_method, bucket_view):
    """Gradient accumulation over 3 micro-batches (the first two under DDP's no_sync), several buckets, an
    unused parameter: the norm measured on the reduced buckets is the post-backward one, bit for bit
    (exact), and so are the parameters after 3 steps. (No destroy_process_group: DDP's reducers are alive,
    and _run_and_exit leaves without teardown.)"""
    from contextlib import nullcontext

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    results = []
    for norm_in_backward in (True, False):
        model = _DDPNet()
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=0.0005, gradient_as_bucket_view=bucket_view, find_unused_parameters=True
        )
        clip = torchclip.ClipGradByGlobalNorm(0.1, exact=True)
        optimizer = torchclip.optim.AdamW(
            model.parameters(), lr=1e-2, fused=True, grad_clip=clip, norm_in_backward=norm_in_backward
        )
        backward_norms = optimizer.grad_clip_attachment.backward_norms
        if norm_in_backward:
            backward_norms.reduced_by(ddp)
        generator = torch.Generator().manual_seed(rank)  # each rank its own batches
        norms = []
        for _ in range(3):
            optimizer.zero_grad()
            for k in range(3):
                with ddp.no_sync() if k < 2 else nullcontext():
                    ddp(torch.randn(4, 8, generator=generator)).pow(2).sum().backward()
            expected = torchclip.get_total_norm([p.grad.double() for p in model.parameters() if p.grad is not None])
            optimizer.step()
            norms.append(clip.last_global_norm.clone())
            if norm_in_backward:
                with_grads = sum(p.grad is not None for p in model.parameters())
                assert (backward_norms.taken_in_backward, backward_norms.taken_after_backward) == (with_grads, 0)
                torch.testing.assert_close(norms[-1].double(), expected, rtol=1e-6, atol=0)
        results.append((norms, [p.detach().clone() for p in model.parameters()]))
    (ours, ours_params), (theirs, their_params) = results
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (ours, theirs)
    assert all(torch.equal(p, q) for p, q in zip(ours_params, their_params))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bucket_view", [False, True], ids=["grads_copied", "gradient_as_bucket_view"])
def test_ddp_norm_in_backward_is_the_post_backward_norm(world, bucket_view, tmp_path):
    spawn(ddp_backward_norm_worker, world, rendezvous(tmp_path), bucket_view)


def fsdp2_backward_norm_worker(rank, world, init_method, mesh_shape):
    """FSDP2 runs the hooks on its sharded parameters after the reduce-scatter, the post-divide and the
    accumulation: the measured shards combine in one collective into the post-backward norm, bit for bit
    (exact), with gradient accumulation under set_requires_gradient_sync(False) for 2 of 3 micro-batches,
    and the folded step gives clip-then-step's parameters. Batched: the shards measured as CUDA's are, in
    batches and at the end of backward (from inside FSDP2's own end-of-backward callback)."""
    from torchclip import backward_norm

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")  # FSDP; HSDP
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for exact in (True, False):
        check_fsdp2_norm_in_backward(rank, mesh, exact)
    measured_in_batches = backward_norm._measured_in_batches
    backward_norm._measured_in_batches = lambda grad: True
    try:
        check_fsdp2_norm_in_backward(rank, mesh, exact=False)
    finally:  # (the process runs the next test: tests/ranks.py)
        backward_norm._measured_in_batches = measured_in_batches


def check_fsdp2_norm_in_backward(rank, mesh, exact):
    from torch.distributed.fsdp import fully_shard

    results = []
    for norm_in_backward in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        clip = torchclip.ClipGradByGlobalNorm(0.1, exact=exact)
        optimizer = torchclip.optim.AdamW(
            model.parameters(), lr=1e-2, fused=True, grad_clip=clip, norm_in_backward=norm_in_backward
        )
        backward_norms = optimizer.grad_clip_attachment.backward_norms
        generator = torch.Generator().manual_seed(rank)
        norms = []
        for _ in range(3):
            optimizer.zero_grad()
            for k in range(3):
                model.set_requires_gradient_sync(k == 2)
                model(torch.randn(4, 8, generator=generator)).pow(2).sum().backward()
            full = [p.grad.full_tensor().double() for p in model.parameters()]
            expected = torchclip.get_total_norm(full, exact=True).float()
            optimizer.step()
            norms.append(clip.last_global_norm.clone())
            if exact:
                assert torch.equal(norms[-1], expected), (norms[-1], expected)
            else:
                torch.testing.assert_close(norms[-1], expected, rtol=1e-6, atol=0)
            if norm_in_backward:
                assert (backward_norms.taken_in_backward, backward_norms.taken_after_backward) == (4, 0)
        results.append((norms, [p.full_tensor() for p in model.parameters()]))
    (ours, ours_params), (theirs, their_params) = results
    if exact:
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    for p, q in zip(ours_params, their_params):  # the fold divides where the clip in place multiplies
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world, mesh_shape", [(2, (2,)), (4, (2, 2))], ids=["fsdp", "hsdp"])
def test_fsdp2_norm_in_backward_is_the_post_backward_norm(world, mesh_shape, tmp_path):
    spawn(fsdp2_backward_norm_worker, world, rendezvous(tmp_path), mesh_shape)
