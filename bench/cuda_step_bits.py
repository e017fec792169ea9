"""How far torchclip's read-only CUDA steps (adam_step_, sgd_step_) are from torch's fused CUDA steps on the same
inputs, option by option: the elements whose bits differ and the largest difference in units of the storage
type's rounding. The tests hold the steps to a tolerance; this says where the bits part and by how much, which
is what tells a contraction torch's build made on one path from a slip in the kernels. Run on a machine with a
GPU: python bench/cuda_step_bits.py [--size 1000000]."""

from __future__ import annotations

import argparse
import itertools

import torch

from torchclip import _ops

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def draw(n, dtype, generator, scale=1.0, positive=False):
    values = torch.rand(n, generator=generator) if positive else torch.randn(n, generator=generator)
    return (values * scale).to(dtype).cuda()


def apart(ours, theirs):
    """(elements whose bits differ, the largest difference over the storage type's spacing at theirs)."""
    differ = int((ours != theirs).sum())
    spacing = torch.finfo(theirs.dtype).eps * theirs.double().abs().clamp_min(torch.finfo(theirs.dtype).tiny)
    units = float(((ours.double() - theirs.double()).abs() / spacing).max()) if differ else 0.0
    return differ, units


def adam_rows(n, generator):
    for dtype, (amsgrad, maximize, weight_decay, decoupled, scale) in itertools.product(
        DTYPES, itertools.product([False, True], [False, True], [0.0, 0.1], [False, True], [None, 1.7])
    ):
        params, grads, exp_avgs = (draw(n, dtype, generator, s) for s in (1.0, 3.0, 0.1))
        exp_avg_sqs = draw(n, dtype, generator, 1e-2, positive=True)
        maxima = exp_avg_sqs + draw(n, dtype, generator, 1e-2, positive=True) if amsgrad else None
        ours = [[params], [grads], [exp_avgs], [exp_avg_sqs], [maxima] if amsgrad else [], [torch.tensor(3.0).cuda()]]
        theirs = [[t.clone() for t in tensors] for tensors in ours]
        grad_scale = None if scale is None else torch.tensor(scale).cuda()
        options = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "weight_decay": weight_decay, "eps": 1e-8}
        options.update(amsgrad=amsgrad, maximize=maximize)
        _ops.adam_step_(*ours, decoupled_weight_decay=decoupled, grad_scale=grad_scale, **options)
        torch._foreach_add_(theirs[5], 1)
        (torch._fused_adamw_ if decoupled else torch._fused_adam_)(*theirs, grad_scale=grad_scale, **options)
        name = f"amsgrad={amsgrad} maximize={maximize} wd={weight_decay} decoupled={decoupled} scale={scale}"
        yield "adam", dtype, name, [apart(ours[i][0], theirs[i][0]) for i in (0, 2, 3)]


def sgd_rows(n, generator):
    for dtype, (momentum, nesterov, weight_decay, maximize, scale) in itertools.product(
        DTYPES, itertools.product([0.0, 0.9], [False, True], [0.0, 0.1], [False, True], [None, 1.7])
    ):
        if nesterov and not momentum:
            continue
        lists = [[draw(n, dtype, generator, s)] for s in (1.0, 3.0, 0.1)]
        if not momentum:
            lists[2] = []
        ours, theirs = ([[t.clone() for t in tensors] for tensors in lists] for _ in range(2))
        options = {"lr": 1e-2, "weight_decay": weight_decay, "momentum": momentum, "dampening": 0.0}
        options.update(nesterov=nesterov, maximize=maximize, is_first_step=False)
        options["grad_scale"] = None if scale is None else torch.tensor(scale).cuda()
        _ops.sgd_step_(*ours, **options)
        torch._fused_sgd_(*theirs, **options)
        name = f"momentum={momentum} nesterov={nesterov} wd={weight_decay} maximize={maximize} scale={scale}"
        yield "sgd", dtype, name, [apart(ours[i][0], theirs[i][0]) for i in ((0, 2) if momentum else (0,))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000, help="elements per tensor")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; {args.size} elements a tensor")
    print("each list: elements whose bits differ from torch's / largest difference in roundings of the storage type")
    for optimizer, dtype, name, lists in itertools.chain(
        adam_rows(args.size, generator), sgd_rows(args.size, generator)
    ):
        cells = "  ".join(f"{differ:>8} /{units:6.2f}" for differ, units in lists)
        print(f"{optimizer:<5} {str(dtype).removeprefix('torch.'):<9} {name:<62} {cells}")


if __name__ == "__main__":
    main()
