"""Clipping ZeRO-style sharded gradients with one collective.

    torchrun --nproc_per_node 2 examples/distributed_sharded_clip.py
    python examples/distributed_sharded_clip.py          # spawns 2 gloo processes itself

Each rank owns a slice of every gradient (as a ZeRO optimizer shards its state). torch.nn.utils would
clip each rank by its local norm, so every rank would clip differently; with process_group every rank
gets the global norm (one all_gather of one scalar) and clips by the same coefficient.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torchclip


def full_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model(torch.randn(16, 32)).pow(2).sum().backward()
    return [p.grad.detach().flatten() for p in model.parameters()]


def main():
    rank, world = dist.get_rank(), dist.get_world_size()
    full = full_gradients()
    shards = []
    for g in full:
        piece = g.chunk(world)[rank] if rank < len(g.chunk(world)) else g[:0]
        p = torch.nn.Parameter(torch.zeros_like(piece))
        p.grad = piece.clone()
        shards.append(p)
    local_norm = torch.nn.utils.get_total_norm([p.grad for p in shards])
    global_norm = torchclip.clip_grad_norm_(shards, max_norm=1.0, process_group=dist.group.WORLD)
    expected = torch.nn.utils.get_total_norm(full)
    assert torch.allclose(global_norm, expected, rtol=1e-6), (global_norm, expected)
    clipped = torch.nn.utils.get_total_norm([p.grad for p in shards]) ** 2
    dist.all_reduce(clipped)
    assert abs(clipped.sqrt().item() - 1.0) < 1e-5, clipped.sqrt()
    print(f"rank {rank}: local norm {local_norm.item():.4f}, global norm {global_norm.item():.4f}, clipped to 1.0")


def spawned(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    main()
    dist.destroy_process_group()
    # Done: leave without interpreter teardown, where gloo's threads now and then abort a spawned
    # process ("terminate called without an active exception") after all its work is done.
    os._exit(0)


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            main()
        finally:
            dist.destroy_process_group()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(spawned, args=(2, port), nprocs=2, join=True)
