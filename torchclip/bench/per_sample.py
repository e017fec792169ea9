"""torchclip-bench --per-sample: DP-SGD's clipping (per-sample norms, then the clipped sum, with and without the
noise and the division by the expected batch size) against Opacus's own DPOptimizer.clip_and_accumulate (+
add_noise + scale_grad), in reads of the per-sample gradients.

A read is the time of torch's sum over a float32 buffer of the per-sample gradients' bytes (the memory bound
of one pass; timing.byte_stream_buffer). The per-sample gradients are allocated parameter by parameter, as
Opacus's GradSampleModule leaves them, in the row's dtype, beside float32 parameters. Each candidate's call
starts from no summed_grad (and Opacus's processed marks cleared), untimed; the candidates run interleaved
(timing.interleave)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchclip.bench.timing import byte_stream_buffer, format_columns, interleave
from torchclip.per_sample import clip_and_accumulate_


def _gpt2_width_256() -> list[list[int]]:
    """A GPT-2-style stack at width 256, three blocks and a 2,048 x 256 embedding: 37 tensors, 2.9M values."""
    width, hidden = 256, 1024
    block = [[width], [width], [width, 3 * width], [3 * width], [width, width], [width], [width], [width]]
    block += [[width, hidden], [hidden], [hidden, width], [width]]
    return [[2048, width]] + block * 3


def _resnet20() -> list[list[int]]:
    """A ResNet-20-style conv net (CIFAR; GroupNorm, as DP training uses): 3 stages of 3 blocks, 0.27M values."""
    shapes = [[16, 3, 3, 3], [16], [16]]
    channels_in = 16
    for channels in (16, 32, 64):
        for block in range(3):
            shapes += [
                [channels, channels_in, 3, 3],
                [channels],
                [channels],
                [channels, channels, 3, 3],
                [channels],
                [channels],
            ]
            if channels != channels_in:
                shapes += [[channels, channels_in, 1, 1]]
            channels_in = channels
    return shapes + [[10, 64], [10]]


WORKLOADS = {"gpt2_w256": _gpt2_width_256, "resnet20": _resnet20}
DEFAULT_BATCHES = (16, 64)
MAX_NORM, NOISE_MULTIPLIER = 1.0, 1.0


@dataclass
class PerSampleRow:
    workload: str
    dtype: str
    batch: int
    threads: int
    elements: int  # per-sample gradient values, all samples
    read_ms: float  # one read of the per-sample gradients (the bound of one pass)
    torchclip_reads: float
    torchclip_noise_reads: float
    opacus_reads: float | None  # None: Opacus is not installed
    opacus_noise_reads: float | None
    spread: float  # the largest IQR / median of the row's candidates


def _params(shapes, batch, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02)
        p.grad_sample = torch.randn((batch, *shape), generator=generator).to(dtype)
        params.append(p)
    return params


def _opacus_optimizer(params, batch):
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return None
    return DPOptimizer(
        torch.optim.SGD(params, lr=0.1),
        noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=MAX_NORM,
        expected_batch_size=batch,
    )


def run(workload_names, dtypes, batches, thread_counts, rounds, warmup, progress) -> list[PerSampleRow]:
    jobs = [(w, d, b, t) for w in workload_names for d in dtypes for b in batches for t in thread_counts]
    rows = []
    for done, (workload, dtype_name, batch, threads) in enumerate(jobs):
        progress(done, len(jobs), f"per-sample {workload} {dtype_name} B={batch} threads={threads}")
        torch.set_num_threads(threads)
        rows.append(_time_row(workload, dtype_name, batch, threads, rounds, warmup))
    progress(len(jobs), len(jobs), None)
    return rows


def _time_row(workload, dtype_name, batch, threads, rounds, warmup) -> PerSampleRow:
    params = _params(WORKLOADS[workload](), batch, getattr(torch, dtype_name))
    elements = sum(p.grad_sample.numel() for p in params)
    read_buffer = byte_stream_buffer(torch.cat([p.grad_sample.reshape(-1) for p in params]))
    optimizer = _opacus_optimizer(params, batch)

    def reset():
        for p in params:
            p.summed_grad = None
            p.grad = None
            p.grad_sample.__dict__.pop("_processed", None)

    candidates = [
        read_buffer.sum,
        lambda: clip_and_accumulate_(params, MAX_NORM),
        lambda: clip_and_accumulate_(params, MAX_NORM, noise_multiplier=NOISE_MULTIPLIER, expected_batch_size=batch),
    ]
    if optimizer is not None:

        def opacus_with_noise():
            optimizer.clip_and_accumulate()
            optimizer.add_noise()
            optimizer.scale_grad()

        candidates += [optimizer.clip_and_accumulate, opacus_with_noise]
    results = interleave(candidates, rounds, warmup, prepare=reset)
    read_ms = results[0][0]
    reads = [median / read_ms for median, _ in results[1:]] + [None, None]
    return PerSampleRow(
        workload,
        dtype_name,
        batch,
        threads,
        elements,
        read_ms,
        reads[0],
        reads[1],
        reads[2],
        reads[3],
        max(spread for _, spread in results),
    )


def _reads(value) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}"


def format_table(rows: list[PerSampleRow]) -> str:
    header = [
        "workload",
        "dtype",
        "B",
        "thr",
        "values",
        "read ms",
        "torchclip",
        "+ noise",
        "Opacus",
        "+ noise",
        "x faster",
        "spread",
    ]
    lines = []
    for r in rows:
        faster = "-" if r.opacus_noise_reads is None else f"{r.opacus_noise_reads / r.torchclip_noise_reads:.1f}"
        lines.append(
            [
                r.workload,
                r.dtype,
                str(r.batch),
                str(r.threads),
                f"{r.elements / 1e6:.1f}M",
                f"{r.read_ms:.2f}",
                _reads(r.torchclip_reads),
                _reads(r.torchclip_noise_reads),
                _reads(r.opacus_reads),
                _reads(r.opacus_noise_reads),
                faster,
                f"{r.spread:.0%}",
            ]
        )
    return format_columns(header, lines, left=2)
