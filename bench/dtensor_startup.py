"""How long clip_grad_norm_ takes on many DTensor gradients (FSDP2-style), torchclip against torch.

    .venv/bin/python bench/dtensor_startup.py [--params 20000] [--torch-params 2000]

Two gloo processes on this machine, 8x8 weights sharded on dim 0. Prints the first call and the
median of the next five, for torchclip (all --params) and torch (--torch-params: torch's first call
grows superlinearly, so it gets fewer).
"""

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timings(clip, params, calls=6):
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        clip(params, 1.0)
        out.append(time.perf_counter() - start)
    return out[0], statistics.median(out[1:])


def make_params(mesh, count):
    from torch.distributed.tensor import Shard, distribute_tensor

    params = []
    for _ in range(count):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
        params.append(p)
    return params


def worker(rank, world, port, count, torch_count):
    from torch.distributed.device_mesh import init_device_mesh

    import torchclip

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    ours = timings(torchclip.clip_grad_norm_, make_params(mesh, count))
    theirs = timings(torch.nn.utils.clip_grad_norm_, make_params(mesh, torch_count))
    if rank == 0:
        print(f"torchclip, {count} DTensor params: first call {ours[0]:.3f} s, later calls {ours[1]:.3f} s")
        print(f"torch,     {torch_count} DTensor params: first call {theirs[0]:.3f} s, later calls {theirs[1]:.3f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=20000)
    parser.add_argument("--torch-params", type=int, default=2000)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args.params, args.torch_params), nprocs=2, join=True)
