"""torchclip-bench --step OPTIMIZER: what clipping adds to a training step.

Four candidates run interleaved on the same parameters, gradients and optimizer state (balanced
orders, medians, as the clip rows): the optimizer step alone; torch's clip_grad_norm_ then the step;
torchclip's grad_clip= step (ClipGradByGlobalNorm, folded into the fused kernel where torch's optimizer
is fused); and torchclip.get_total_norm, one read of the gradients, the floor of any norm clip. The
"added" columns give (clip + step - step) / get_total_norm: what the clip costs, in reads of the
gradients. Every call clips (max_norm is 0.9 x the gradients' norm, set untimed before each call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import torchclip
from torchclip.bench.timing import each_job, format_columns, interleave, no_sync

# name -> (torch.optim class, keyword arguments); lr is small so that the parameters barely move.
OPTIMIZERS = {
    "adamw-fused": (torch.optim.AdamW, {"lr": 1e-4, "fused": True}),
    "adam-fused": (torch.optim.Adam, {"lr": 1e-4, "fused": True}),
    "sgd-fused": (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9, "fused": True}),
    "adagrad-fused": (torch.optim.Adagrad, {"lr": 1e-4, "fused": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-4, "foreach": True}),
    "sgd": (torch.optim.SGD, {"lr": 1e-4, "momentum": 0.9, "foreach": True}),
}
DEFAULT_WORKLOADS = ["gpt2_124m", "resnet50", "24x1M", "10000x100"]


@dataclass
class StepRow:
    optimizer: str
    workload: str
    dtype: str
    threads: int
    tensors: int
    elements: int
    step_ms: float
    torch_clip_step_ms: float
    torchclip_step_ms: float
    total_norm_ms: float
    torch_added_reads: float
    torchclip_added_reads: float
    spread: float
    device: str = "cpu"


def candidates(name, grads):
    """The four timed calls and their untimed preparation, over `grads` (bench's Grads)."""
    cls, kwargs = OPTIMIZERS[name]
    params = grads.params
    for p in params:
        p.detach().zero_()
    clip = torchclip.ClipGradByGlobalNorm(1.0)
    # One optimizer (torchclip.optim's, as users build it), so every candidate updates the same state; the
    # hook is switched on for torchclip's candidate alone, and off it steps as torch's class does.
    optimizer = torchclip.optim.with_grad_clip(cls)(params, grad_clip=clip, **kwargs)
    attachment = optimizer.grad_clip_attachment
    attachment.enabled = False

    def prepare():  # clip.clip_norm is torch's max_norm too: both candidates clip by the same number
        attachment.enabled = False
        clip.clip_norm = 0.9 * float(torchclip.get_total_norm(grads.grads).double())

    def step_alone():
        optimizer.step()

    def torch_clip_step():
        torch.nn.utils.clip_grad_norm_(params, clip.clip_norm)
        optimizer.step()

    def torchclip_step():
        attachment.enabled = True
        optimizer.step()

    def total_norm():
        torchclip.get_total_norm(grads.grads)

    return [step_alone, torch_clip_step, torchclip_step, total_norm], prepare


def run(optimizer_names, workload_names, dtypes, thread_counts, rounds, warmup, progress, device="cpu"):
    """One StepRow per optimizer x workload x dtype x thread count; `dtypes` maps names to torch dtypes."""
    sync = torch.cuda.synchronize if device == "cuda" else no_sync
    rows = []
    for name, label, dtype_name, threads, grads in each_job(
        optimizer_names, workload_names, dtypes, thread_counts, progress, device
    ):
        fns, prepare = candidates(name, grads)
        timings = interleave(fns, rounds, warmup, prepare, sync)
        (t_step, _), (t_torch, _), (t_ours, _), (t_norm, _) = timings
        rows.append(
            StepRow(
                name,
                label,
                dtype_name,
                threads,
                len(grads.params),
                grads.flat.numel(),
                t_step,
                t_torch,
                t_ours,
                t_norm,
                (t_torch - t_step) / t_norm,
                (t_ours - t_step) / t_norm,
                max(spread for _, spread in timings),
                device,
            )
        )
        del grads
    return rows


def format_table(rows) -> str:
    header = [
        "optimizer",
        "workload",
        "dtype",
        "thr",
        "step ms",
        "torch clip+step ms",
        "torchclip step ms",
        "get_total_norm ms",
        "torch added (reads)",
        "torchclip added (reads)",
        "spread",
    ]
    return format_columns(
        header,
        [
            [
                r.optimizer,
                r.workload,
                r.dtype,
                str(r.threads),
                f"{r.step_ms:.3f}",
                f"{r.torch_clip_step_ms:.3f}",
                f"{r.torchclip_step_ms:.3f}",
                f"{r.total_norm_ms:.3f}",
                f"{r.torch_added_reads:.2f}",
                f"{r.torchclip_added_reads:.2f}",
                f"{100 * r.spread:.0f}%",
            ]
            for r in rows
        ],
        left=4,
    )
