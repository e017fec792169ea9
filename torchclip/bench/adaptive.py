"""torchclip-bench --adaptive: the adaptive clips against their reference packages.

Per clip and workload, four candidates run interleaved (balanced orders, medians, as the clip rows):
the reference package's own call (zclip 1.0.0's ZClip.step, autoclip 0.2.1's global QuantileClip.step,
timm's adaptive_clip_grad), torchclip's clip, ClipGradByGlobalNorm (what a fixed threshold costs), and
the memory bound: one read of the gradients (torch's sum over one buffer), or for ClipGradByUnitwiseNorm
one read of the weights and of the gradients, which AGC must read; for float16 and bfloat16 the sum is
float32's over as many bytes (timing.byte_stream_buffer), the time to stream them. A reference that is
not installed is left out (its column is empty). The parameters are views of one weight buffer (random,
so that AGC clips some units), the gradients views of another.

Every call gets a new step's gradients, untimed: the first ones times a factor drawn around 1 (standard
deviation 5%), so that the norm moves from call to call as in training and each clip makes its own
decisions. Without that, the candidates shared one set of gradients that every clip shrank in turn, and
the global Quantile, whose threshold is a quantile of norms that only ever fell, wrote on five calls in
twenty-four where ClipGradByGlobalNorm wrote on one. ClipGradByGlobalNorm's clip_norm, 1.1, is about the
98th percentile of those norms: a fixed threshold that, like the adaptive ones, clips a few calls; ZClip
takes it as its max_grad_norm (its default, 1.0, would cap half the calls).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import math
from dataclasses import dataclass

import torch

import torchclip
from torchclip.bench.timing import byte_stream_buffer, each_job, format_columns, interleave, no_sync

CLIPS = ["ClipGradByZScore", "ClipGradByQuantile (global)", "ClipGradByUnitwiseNorm"]
DEFAULT_WORKLOADS = ["gpt2_124m", "resnet50"]
NORM_SPREAD = 0.05  # the relative standard deviation of the gradients' norm from call to call
FIXED_CLIP_NORM = 1.1  # ClipGradByGlobalNorm's and ZClip's cap: about the 98th percentile of those norms


@dataclass
class AdaptiveRow:
    clip: str
    workload: str
    dtype: str
    threads: int
    tensors: int
    elements: int
    reference_ms: float  # NaN: the reference package is not installed
    torchclip_ms: float
    global_norm_ms: float
    bound_ms: float
    speedup: float
    global_norm_ratio: float
    bound_ratio: float
    spread: float
    device: str = "cpu"


def timm_agc():
    """timm's adaptive_clip_grad, or None where timm is not installed."""
    try:
        return importlib.import_module("timm.utils.agc").adaptive_clip_grad
    except (ImportError, OSError, RuntimeError):  # timm itself, or torchvision, which timm imports
        return _agc_from_timms_file()


def _agc_from_timms_file():
    """timm's agc.py from its installed files: it needs torch alone, where `import timm` needs torchvision,
    which may not import beside this torch."""
    try:
        path = importlib.metadata.distribution("timm").locate_file("timm/utils/agc.py")
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.spec_from_file_location("timm_agc", str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.adaptive_clip_grad


def reference_for(clip_name, params):
    """The reference package's call on `params`, or None where the package is not installed."""
    if clip_name == "ClipGradByZScore":
        if importlib.util.find_spec("zclip") is None:
            return None
        import zclip

        holder = torch.nn.Module()
        holder.params = torch.nn.ParameterList(params)
        reference = zclip.ZClip(warmup_steps=2, max_grad_norm=FIXED_CLIP_NORM)
        return lambda: reference.step(holder)
    if clip_name == "ClipGradByQuantile (global)":
        if importlib.util.find_spec("autoclip") is None:
            return None
        from autoclip.torch import QuantileClip

        return QuantileClip(params, global_threshold=True).step
    agc = timm_agc()
    return None if agc is None else (lambda: agc(params, 0.01, 1e-3))


def torchclip_clip(clip_name):
    if clip_name == "ClipGradByZScore":
        return torchclip.ClipGradByZScore(warmup_steps=2, max_grad_norm=FIXED_CLIP_NORM)
    if clip_name == "ClipGradByQuantile (global)":
        return torchclip.ClipGradByQuantile(global_threshold=True)
    return torchclip.ClipGradByUnitwiseNorm(0.01, 1e-3)


def candidates(clip_name, grads, weights):
    """torchclip's clip, ClipGradByGlobalNorm, the bound, and the reference (None if not installed)."""
    params = grads.params
    clip, global_norm = torchclip_clip(clip_name), torchclip.ClipGradByGlobalNorm(FIXED_CLIP_NORM)
    bound_buffers = [grads.bound_buffer]
    if clip_name == "ClipGradByUnitwiseNorm":  # AGC reads the weights too
        bound_buffers.insert(0, byte_stream_buffer(weights))

    def bound():
        for buffer in bound_buffers:
            buffer.sum()

    return [lambda: clip(params), lambda: global_norm(params), bound], reference_for(clip_name, params)


def new_steps(grads):
    """A function that gives grads a new step's gradients: the present ones times 1 + NORM_SPREAD * N(0, 1)."""
    first_gradients = grads.flat.clone()
    generator = torch.Generator().manual_seed(2)

    def new_step():
        factor = 1.0 + NORM_SPREAD * torch.randn((), generator=generator).item()
        torch.mul(first_gradients, factor, out=grads.flat)

    return new_step


def run(clip_names, workload_names, dtypes, thread_counts, rounds, warmup, progress, device="cpu"):
    sync = torch.cuda.synchronize if device == "cuda" else no_sync
    rows = []
    for clip_name, label, dtype_name, threads, grads in each_job(
        clip_names, workload_names, dtypes, thread_counts, progress, device
    ):
        weights = torch.randn(grads.flat.numel(), generator=torch.Generator().manual_seed(1)).to(
            device, grads.flat.dtype
        )
        weights.mul_(0.02)
        for p, w in zip(grads.params, torch.split(weights, [p.numel() for p in grads.params])):
            p.data = w.view(p.shape)
        fns, reference = candidates(clip_name, grads, weights)
        timings = interleave(fns if reference is None else [*fns, reference], rounds, warmup, new_steps(grads), sync)
        (t_ours, _), (t_global, _), (t_bound, _) = timings[:3]
        t_reference = timings[3][0] if reference is not None else math.nan
        rows.append(
            AdaptiveRow(
                clip_name,
                label,
                dtype_name,
                threads,
                len(grads.params),
                grads.flat.numel(),
                t_reference,
                t_ours,
                t_global,
                t_bound,
                t_reference / t_ours,
                t_ours / t_global,
                t_ours / t_bound,
                max(spread for _, spread in timings),
                device,
            )
        )
    return rows


def format_table(rows) -> str:
    header = [
        "clip",
        "workload",
        "dtype",
        "thr",
        "reference ms",
        "torchclip ms",
        "GlobalNorm ms",
        "bound ms",
        "speed-up",
        "x GlobalNorm",
        "x bound",
        "spread",
    ]
    return format_columns(
        header,
        [
            [
                r.clip,
                r.workload,
                r.dtype,
                str(r.threads),
                "" if math.isnan(r.reference_ms) else f"{r.reference_ms:.3f}",
                f"{r.torchclip_ms:.3f}",
                f"{r.global_norm_ms:.3f}",
                f"{r.bound_ms:.3f}",
                "" if math.isnan(r.speedup) else f"{r.speedup:.1f}x",
                f"{r.global_norm_ratio:.2f}",
                f"{r.bound_ratio:.2f}",
                f"{100 * r.spread:.0f}%",
            ]
            for r in rows
        ],
        left=4,
    )
