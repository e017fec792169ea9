"""Clipping FSDP2 (fully_shard) gradients: nothing to change but the import.

    torchrun --nproc_per_node 2 examples/fsdp2_clip.py
    python examples/fsdp2_clip.py                        # spawns 2 gloo processes itself

After backward, fully_shard leaves each parameter's gradient as a DTensor sharded over the ranks.
torchclip.clip_grad_norm_ clips the local shards with the fused kernels and one all_gather of one
scalar per rank, and returns a plain tensor whose .item() is the global norm on every rank. The
Paddle-style optimizer hook (ClipGradByGlobalNorm as grad_clip=) takes the same path.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import torchclip
import torchclip.optim


def build_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main():
    rank = dist.get_rank()
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooked = build_model()  # the same model, clipped by an optimizer hook instead
    clip = torchclip.ClipGradByGlobalNorm(0.5)
    hooked_optimizer = torchclip.optim.SGD(hooked.parameters(), lr=0.1, grad_clip=clip)
    generator = torch.Generator().manual_seed(rank)  # each rank its own batches
    for step in range(3):
        x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
        for m in (model, hooked):
            torch.nn.functional.mse_loss(m(x), y).backward()
        # torch's own answer, from the full (unsharded) gradients, before anything is clipped
        expected = torch.linalg.vector_norm(torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()]))
        norm = torchclip.clip_grad_norm_(model.parameters(), max_norm=0.5)
        assert torch.allclose(norm, expected, rtol=1e-5), (norm, expected)
        optimizer.step()
        optimizer.zero_grad()
        hooked_optimizer.step()  # clips (Paddle's formula, the same global norm), then steps
        hooked_optimizer.zero_grad()
        assert torch.allclose(clip.last_global_norm, expected, rtol=1e-5), (clip.last_global_norm, expected)
        if rank == 0:
            what = "clipped to 0.5" if norm.item() > 0.5 else "under 0.5, so nothing was clipped"
            print(f"step {step}: global gradient norm {norm.item():.4f} (the same on every rank): {what}")


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
