"""The host cost of clip_grad_norm_ on many DTensor gradients, per parallel layout, torchclip against torch.

    .venv/bin/python bench/dtensor_startup.py [--params 1000,5000,20000] [--torch-params 2000] [--calls 11]

Two gloo processes on this machine, 8x8 weights sharded on dim 0. Layouts: `fsdp` (a 1-D mesh of both
ranks), `fsdp_tp` (a 2-D (dp, tp) = (1, 2) mesh, FSDP's Shard(0) on dp and tensor parallelism's Shard(1) on
tp) and `pipeline` (two stages of one rank each, `process_group=` the pipeline group). Prints, per layout and
count, the first call and the median of the later ones, for torchclip, for the bound it is held to (the same
clip of the local shards as plain tensors, plus the collectives the layout needs: one all_gather of one
scalar per set of ranks), and for torch (--torch-params only: torch's first call grows superlinearly; torch has
no pipeline clip). The issue's goals: a first call under 0.2 s at 20,000 parameters, later calls within
1.5x of the bound.
"""

import argparse
import functools
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timings(clip, calls):
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        clip()
        out.append(time.perf_counter() - start)
    return out[0], statistics.median(out[1:])


def layout(name, count):
    """(this rank's parameters, process_group, the groups the bound's scalar all_gathers run over)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if name == "fsdp":
        mesh, placements, group, groups = init_device_mesh("cpu", (2,)), [Shard(0)], None, [dist.group.WORLD]
    elif name == "fsdp_tp":
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        placements, group, groups = [Shard(0), Shard(1)], None, [dist.group.WORLD]
    else:
        world = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
        mesh, placements, group = world["dp"], [Shard(0)], world.get_group("pp")
        groups = [mesh.get_group(), group]
    params = []
    for _ in range(count):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 8), mesh, placements))
        p.grad = distribute_tensor(torch.randn(8, 8), mesh, placements)
        params.append(p)
    return params, group, groups


def bound(params, groups):
    """The clip of the local shards as plain tensors, and one all_gather of one scalar per group."""
    import torchclip

    local = [torch.nn.Parameter(p.to_local()) for p in params]
    for q, p in zip(local, params):
        q.grad = p.grad.to_local()

    def clip():
        norm = torchclip.get_total_norm([q.grad for q in local]).double().reshape(1)
        for group in groups:
            gathered = [torch.empty_like(norm) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, norm, group=group)
        torchclip.clip_grads_with_norm_(local, 1.0, norm[0])

    return clip


def worker(rank, world, port, counts, torch_count, calls):
    import torchclip

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rows = []
    for name in ("fsdp", "fsdp_tp", "pipeline"):
        for count in counts:
            params, group, groups = layout(name, count)
            ours = timings(functools.partial(torchclip.clip_grad_norm_, params, 1.0, process_group=group), calls)
            held = timings(bound(params, groups), calls)
            rows.append((name, count, ours, held))
        if name != "pipeline":
            params, _, _ = layout(name, torch_count)
            theirs = timings(functools.partial(torch.nn.utils.clip_grad_norm_, params, 1.0), calls)
            rows.append((name, torch_count, None, theirs))
    if rank == 0:
        print(
            "| layout | DTensor parameters | torchclip first call (s) | later calls (ms) | bound (ms) | x bound | torch first (s) / later (ms) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, count, ours, other in rows:
            if ours is None:
                print(f"| {name} | {count} | | | | | {other[0]:.3f} / {other[1] * 1e3:.1f} |")
            else:
                print(
                    f"| {name} | {count} | {ours[0]:.3f} | {ours[1] * 1e3:.1f} | {other[1] * 1e3:.1f} | "
                    f"{ours[1] / other[1]:.2f} | |"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", default="1000,5000,20000", help="comma list of DTensor parameter counts")
    parser.add_argument("--torch-params", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=11, help="calls per row: the first, and the median of the rest")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    counts = [int(c) for c in args.params.split(",")]
    mp.spawn(worker, args=(2, port, counts, args.torch_params, args.calls), nprocs=2, join=True)
