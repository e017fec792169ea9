"""Every parallel layout of docs/sharded.md on 4 gloo processes: FSDP2 x TP (parameters on the 2-D mesh and on the
data-parallel sub-mesh), pipeline stages over FSDP2, pipeline stages holding experts, experts on a second mesh,
tensor parallelism with plain tensors beside the DTensors, and Partial gradients. Each against one process
clipping the whole model: the same norm on every rank, the same clipped gradients, exact norms bit for bit, and
the collectives counted (torch's CommDebugMode) within the route's budget: one per set of ranks the norm spans.
"""

import math

import pytest
import torch
import torch.distributed as dist
from ranks import rendezvous, spawn
from test_distributed import plain_parameters

import torchclip
import torchclip.optim

if dist.is_available():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

SHAPES = [(64, 32), (32,), (128, 8), (8,), (1000,), (4, 6, 3), (16, 16), (12,)]
NORM_TYPES = [2.0, 1.0, math.inf, 3.0]


def full_gradients():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=generator) for s in SHAPES]


def local_piece(full, mesh, placements):
    """This rank's piece of `full` under `placements` (Shard cuts as torch.chunk does, mesh dimension by mesh
    dimension; Replicate and Partial keep it whole), cut here without a collective: gloo moves no CUDA tensor
    for DTensor's scatter and broadcast (on an H200 the CUDA layouts' processes died of SIGSEGV in them)."""
    piece = full
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            chunks = torch.chunk(piece, mesh.size(dim), dim=placement.dim)
            rank = mesh.get_local_rank(dim)
            piece = chunks[rank] if rank < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece.clone()


def on_mesh(full, mesh, placements):
    """A parameter (zeros) and its gradient (full's pieces) as DTensors; a Partial placement's gradient holds
    unequal parts whose reduction is the full value (weights 1/4 and 3/4 for a sum, 1/2 and 3/2 for avg)."""
    local = local_piece(full, mesh, placements)
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            first = mesh.get_local_rank(dim) == 0
            local *= (0.25 if first else 0.75) if placement.reduce_op == "sum" else (0.5 if first else 1.5)
    plain_placements = [Replicate() if p.is_partial() else p for p in placements]
    shape = {"run_check": False, "shape": full.shape, "stride": full.stride()}
    param = torch.nn.Parameter(DTensor.from_local(torch.zeros_like(local), mesh, plain_placements, **shape))
    param.grad = DTensor.from_local(local, mesh, placements, **shape)
    return param


def plain(full):
    param = torch.nn.Parameter(torch.zeros_like(full))
    param.grad = full.clone()
    return param


# ---- the layouts: (rank) -> (this rank's parameters, which of the full gradients they are, the pipeline mesh or
# None, the collectives a clip_grad_norm_ of order 2 may issue) ---------------------------------------------


def fsdp2_tp_with_a_sub_mesh(rank):
    """FSDP2 x TP on a 2 x 2 mesh, part of the model outside the TP plan: those parameters are on the dp
    sub-mesh, replicated over tp (pytorch #180346: torch's stack of the norms refuses the mixed meshes)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = full_gradients()
    rules = [[Shard(0), Shard(1)], [Shard(0), Shard(0)], [Shard(0), Replicate()]]
    params = []
    for i, g in enumerate(full):
        if i % 2 == 0 and g.dim() > 1:
            params.append(on_mesh(g, mesh, rules[i % 3]))
        else:
            params.append(on_mesh(g, mesh["dp"], [Shard(0)]))
    return params, list(range(len(full))), None, 2


def fsdp2_tp_on_one_mesh(rank):
    """FSDP2 x TP, every parameter on the 2-D mesh (norms and biases as SequenceParallel: replicated over tp)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = full_gradients()
    params = [on_mesh(g, mesh, [Shard(0), Shard(1) if g.dim() > 1 else Replicate()]) for i, g in enumerate(full)]
    return params, list(range(len(full))), None, 1


def pipeline_over_fsdp2(rank):
    """Two pipeline stages, each FSDP2 over its 2 ranks: clip_grad_norm_(stage's parameters, process_group=the
    pipeline group) gives the whole model's norm."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_local_rank("pp")
    full = full_gradients()
    mine = [i for i in range(len(full)) if i % 2 == stage]
    params = [on_mesh(full[i], mesh["dp"], [Shard(0)]) for i in mine]
    return params, mine, mesh["pp"], 2


def pipeline_with_experts(rank):
    """Pipeline stages holding experts: dense weights FSDP2 over the stage's ranks, experts (the tensors with a
    leading expert dimension) on a second mesh of the same ranks."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    experts_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    stage = mesh.get_local_rank("pp")
    full = full_gradients()
    mine = [i for i in range(len(full)) if i % 2 == stage]
    params = []
    for i in mine:
        expert = full[i].dim() == 3 or full[i].shape == (16, 16)
        params.append(on_mesh(full[i], experts_mesh["ep"] if expert else mesh["dp"], [Shard(0)]))
    return params, mine, mesh["pp"], 2


def experts_on_a_second_mesh(rank):
    """Dense weights FSDP2 over all ranks, experts on a 2-D (dp, ep) mesh of all ranks."""
    dense_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    experts_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    full = full_gradients()
    params = []
    for g in full:
        if g.dim() == 3 or g.shape == (16, 16):
            params.append(on_mesh(g, experts_mesh, [Replicate(), Shard(0)]))
        else:
            params.append(on_mesh(g, dense_mesh, [Shard(0)]))
    return params, list(range(len(full))), None, 1


def tp_with_plain_tensors(rank):
    """Tensor parallelism over 4 ranks with some parameters left as plain tensors, the same on every rank
    (torchtune #2420: torch's foreach norm refuses the mix)."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    full = full_gradients()
    params = [on_mesh(g, mesh, [Shard(0)]) if g.dim() > 1 else plain(g) for g in full]
    return params, list(range(len(full))), None, 1


def partial_gradients(rank):
    """Gradients with pending reductions (Partial sum and avg over tp): their norm is the reduced value's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = full_gradients()
    placements = [[Shard(0), Partial("sum")], [Shard(0), Replicate()], [Replicate(), Partial("avg")]]
    params = [on_mesh(g, mesh, placements[i % 3]) for i, g in enumerate(full)]
    # One all_reduce per (group, op) for the Partial copies, then the norm's one collective.
    return params, list(range(len(full))), None, 3


LAYOUTS = {
    f.__name__: f
    for f in [
        fsdp2_tp_with_a_sub_mesh,
        fsdp2_tp_on_one_mesh,
        pipeline_over_fsdp2,
        pipeline_with_experts,
        experts_on_a_second_mesh,
        tp_with_plain_tensors,
        partial_gradients,
    ]
}


def pp_group(pp_mesh):
    return None if pp_mesh is None else pp_mesh.get_group()


def as_full(grad):
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def same_on_every_rank(value: torch.Tensor):
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value)
    assert all(torch.equal(g, value) for g in gathered), gathered


def layout_worker(rank, world, init_method, name):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        make = LAYOUTS[name]
        full = full_gradients()
        for norm_type in NORM_TYPES:
            params, mine, pp_mesh, budget = make(rank)
            group = pp_group(pp_mesh)
            reference = plain_parameters(full)
            expected = torchclip.clip_grad_norm_(reference, 0.5, norm_type)
            with CommDebugMode() as comm:
                total = torchclip.clip_grad_norm_(params, 0.5, norm_type, process_group=group)
            assert type(total) is torch.Tensor
            torch.testing.assert_close(total, expected, rtol=1e-6, atol=0, msg=f"{name}, norm_type {norm_type}")
            same_on_every_rank(total)
            if norm_type == 2.0:
                assert comm.get_total_counts() <= budget, (name, dict(comm.get_comm_counts()))
            for p, i in zip(params, mine):
                torch.testing.assert_close(as_full(p.grad), reference[i].grad, rtol=1e-6, atol=1e-9)
        # Exact norms: one process's bits.
        for norm_type in (1.0, 2.0):
            params, mine, pp_mesh, _ = make(rank)
            group = pp_group(pp_mesh)
            expected = torchclip.get_total_norm(full, norm_type, exact=True)
            got = torchclip.get_total_norm([p.grad for p in params], norm_type, exact=True, process_group=group)
            assert torch.equal(got, expected), (name, norm_type, got, expected)
            clip = torchclip.ClipGradByGlobalNorm(0.5, process_group=group, exact=True)
            clip(params)
            reference = plain_parameters(full)
            reference_clip = torchclip.ClipGradByGlobalNorm(0.5, exact=True)
            reference_clip(reference)
            assert torch.equal(clip.last_global_norm, reference_clip.last_global_norm), name
            for p, i in zip(params, mine):
                torch.testing.assert_close(as_full(p.grad), reference[i].grad, rtol=1e-6, atol=1e-9)
        # The clip as an optimizer's grad_clip= (it clips in place before the step: a sharded clip is not folded).
        params, mine, pp_mesh, _ = make(rank)
        clip = torchclip.ClipGradByGlobalNorm(0.5, process_group=pp_group(pp_mesh))
        torchclip.optim.SGD(params, lr=0.1, foreach=False, grad_clip=clip).step()
        reference = plain_parameters(full)
        torchclip.ClipGradByGlobalNorm(0.5)(reference)
        torch.optim.SGD(reference, lr=0.1).step()
        for p, i in zip(params, mine):
            torch.testing.assert_close(as_full(p.detach()), reference[i].detach(), rtol=1e-6, atol=1e-9)
        # Per-gradient norms for logging: each gradient's own, the total the whole model's.
        params, mine, pp_mesh, _ = make(rank)
        total, per_tensor = torchclip.distributed.global_norms(params, 2.0, process_group=pp_group(pp_mesh))
        expected = torch.stack([torch.linalg.vector_norm(full[i].double()) for i in mine])
        torch.testing.assert_close(per_tensor, expected, rtol=1e-7, atol=0)
        torch.testing.assert_close(total, torchclip.get_total_norm(full).double(), rtol=1e-6, atol=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_one_global_clip_over_the_layout(name, tmp_path):
    spawn(layout_worker, 4, rendezvous(tmp_path), name)


# ---- CUDA shards: 2 processes on one GPU over gloo, which moves CUDA tensors through the host ----------------


def cuda_layouts(mesh, full):
    """(name, this rank's parameters, process_group) on CUDA: FSDP2's Shard(0), plain tensors beside
    DTensors, Partial sums, and hand shards (whole tensors dealt round-robin) with process_group."""
    rank = dist.get_rank()
    yield "fsdp2", [on_mesh(g, mesh, [Shard(0)]) for g in full], None
    yield "plain beside DTensors", [on_mesh(g, mesh, [Shard(0)]) if g.dim() > 1 else plain(g) for g in full], None
    yield "partial", [on_mesh(g, mesh, [Partial("sum") if i % 2 else Shard(0)]) for i, g in enumerate(full)], None
    mine = [plain(g) if i % 2 == rank else plain(torch.zeros(0, device=g.device)) for i, g in enumerate(full)]
    yield "hand shards", mine, dist.group.WORLD


def full_on_cpu(grad, cpu_mesh):
    """A CUDA gradient's full value on the CPU: a DTensor's local piece gathered over gloo as a CPU DTensor."""
    if not isinstance(grad, DTensor):
        return grad.cpu()
    shape = {"run_check": False, "shape": grad.shape, "stride": grad.stride()}
    return DTensor.from_local(grad.to_local().cpu(), cpu_mesh, grad.placements, **shape).full_tensor()


def cuda_layout_worker(rank, world, init_method):
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
        cpu_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        full = full_gradients()
        on_gpu = [g.cuda() for g in full]
        for name, params, group in cuda_layouts(mesh, on_gpu):
            reference = plain_parameters(full)
            expected = torchclip.clip_grad_norm_(reference, 0.5)
            total = torchclip.clip_grad_norm_(params, 0.5, process_group=group)
            assert total.device.type == "cuda", name
            torch.testing.assert_close(total.cpu(), expected, rtol=1e-6, atol=0, msg=name)
            if group is None:
                for p, q in zip(params, reference):
                    torch.testing.assert_close(full_on_cpu(p.grad, cpu_mesh), q.grad, rtol=1e-6, atol=1e-9, msg=name)
        for name, params, group in cuda_layouts(mesh, on_gpu):
            got = torchclip.get_total_norm([p.grad for p in params], exact=True, process_group=group)
            assert torch.equal(got.cpu(), torchclip.get_total_norm(full, exact=True)), name
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_shards_take_the_cuda_kernels(tmp_path):
    spawn(cuda_layout_worker, 2, rendezvous(tmp_path))
