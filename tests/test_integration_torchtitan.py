"""torchtitan's own clip_grad_norm_ (torchtitan 0.3.0, `torchtitan.distributed.utils`), called as its trainer calls
it (`pp_mesh=`, `ep_enabled=`), under `torchclip.patch()` on 4 gloo processes: the same result as without the patch
where torchtitan works, the right one where it fails today (parameters on mixed meshes), in no more collectives
(each get_total_norm torchtitan makes is one).

torchtitan installs without its dependencies (requirements-torchtitan.txt: ./dev setup takes it with --no-deps,
as its datasets, wandb and tensorboard are not needed for the clip)."""

import pytest
import torch
import torch.distributed as dist
from ranks import rendezvous, spawn
from test_distributed import plain_parameters
from test_parallel_layouts import (
    as_full,
    experts_on_a_second_mesh,
    fsdp2_tp_with_a_sub_mesh,
    full_gradients,
    pipeline_over_fsdp2,
    pipeline_with_experts,
)

import torchclip

titan = pytest.importorskip("torchtitan.distributed.utils")
pytestmark = pytest.mark.integration

if dist.is_available():
    from torch.distributed.tensor.debug import CommDebugMode

# (layout, torchtitan's ep_enabled, whether torchtitan clips it right without torchclip)
CASES = {
    "pipeline_over_fsdp2": (pipeline_over_fsdp2, False, True),
    "pipeline_with_experts": (pipeline_with_experts, True, True),
    "experts_on_a_second_mesh": (experts_on_a_second_mesh, True, True),
    "fsdp2_tp_with_a_sub_mesh": (fsdp2_tp_with_a_sub_mesh, False, False),
}


def titan_clip(make, rank, ep_enabled):
    """torchtitan's clip of this rank's parameters: (the norm, the parameters, which gradients, collectives)."""
    params, mine, pp_mesh, _ = make(rank)
    with CommDebugMode() as comm:
        norm = titan.clip_grad_norm_(params, 0.5, 2.0, pp_mesh=pp_mesh, ep_enabled=ep_enabled)
    return norm, params, mine, comm.get_total_counts()


def titan_worker(rank, world, init_method, name):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        make, ep_enabled, works_without = CASES[name]
        reference = plain_parameters(full_gradients())
        expected = torchclip.clip_grad_norm_(reference, 0.5, 2.0)
        if works_without:
            theirs, params, mine, their_collectives = titan_clip(make, rank, ep_enabled)
            torch.testing.assert_close(theirs, expected, rtol=1e-5, atol=0)
        else:
            with pytest.raises(Exception, match="mesh"):  # pytorch #180346
                titan_clip(make, rank, ep_enabled)
        with torchclip.patch():
            ours, params, mine, our_collectives = titan_clip(make, rank, ep_enabled)
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
        for p, i in zip(params, mine):
            torch.testing.assert_close(as_full(p.grad), reference[i].grad, rtol=1e-6, atol=1e-9)
        if works_without:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
            assert our_collectives <= their_collectives, (our_collectives, their_collectives)
        if rank == 0:
            print(
                f"{name}: torchtitan's clip {their_collectives if works_without else 'fails'}, patched {our_collectives}"
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(CASES))
def test_torchtitans_clip_under_patch(name, tmp_path):
    spawn(titan_worker, 4, rendezvous(tmp_path), name)
