"""torchclip-bench: time torchclip against torch.nn.utils and against the memory bound.

Method (the numbers are only worth what the method is):
* Each workload's gradients are views into one flat buffer, as DDP's gradient buckets and FSDP's flat
  parameters lay them out. The bound is a single pass of the fastest torch op over that same buffer
  (sum for a norm, sum + mul_ for norm + scale, clamp_ for value clipping): the same bytes, the same
  pages. (Separately allocated buffers of equal size differ from each other by up to 30% here, by
  physical placement alone, which would swamp the comparison.) --grads separate gives each gradient
  its own allocation instead, as autograd leaves them without DDP: torch and torchclip still clip the
  same tensors, but the bound then reads other pages, and with many small tensors there is more
  metadata to reach (each its own storage and version counter).
* For float16 and bfloat16 rows the bound is the same op in float32 over a float32 buffer of the same
  number of bytes (half the elements; timing.byte_stream_buffer): the time to stream those bytes, since
  torch's own 16-bit ops run slower than the memory on a CPU. That buffer is its own allocation, so
  these rows' ratios carry the placement noise above.
* torch (foreach and not), torchclip and the bound run interleaved in one process, after warm-up, in
  orders where each runs right after each other one equally often (balanced_orders: what ran just
  before a call changes its time); the table shows medians and the spread (interquartile range /
  median).
* --device cuda times the same rows on the GPU: each call is bracketed by torch.cuda.synchronize(), so
  a row is the time until the device has finished, and the bound is the device's own memory speed
  (the same single ops on the same buffers in device memory).
* The gradients' values are Gaussian (total norm ~1), except the "-backward" workloads' (workloads.BACKWARD):
  one backward of a --training model on its batch, whose heavier tails some kernels feel (the exact norm's
  checked blocks; docs/exact-norms-record.md, "Real gradients rise more").
* --params generator hands every candidate a fresh generator over the parameters (gradients for
  get_total_norm), as training loops pass model.parameters(), instead of the list (the default).
* "clip" rows scale every gradient on every call: each call's max_norm is 0.9 x the gradients' norm
  at that moment (measured untimed), so every candidate always writes, in every dtype, and the
  values never drift towards denormals (ClipTarget).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

import torchclip
from torchclip.bench import adaptive, per_sample, report, step, training, workloads
from torchclip.bench.clip_rows import NORM_OPS, OPS, candidates_for
from torchclip.bench.intervals import ratio_interval
from torchclip.bench.timing import Grads, balanced_orders, format_columns, interleave, no_sync, timed  # noqa: F401

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_WORKLOADS = ["gpt2_124m", "resnet50", "2000x64x64", "10000x100"]
QUICK_WORKLOADS = ["mobilenet_v3_small", "2000x64x64", "10000x100"]


@dataclass
class Row:
    op: str
    workload: str
    dtype: str
    threads: int
    tensors: int
    elements: int
    torch_ms: float
    torch_no_foreach_ms: float
    torchclip_ms: float
    bound_ms: float
    speedup: float
    bound_ratio: float
    gbps: float
    spread: float
    device: str = "cpu"
    exact_ms: float | None = None  # torchclip with exact norms (--exact), on the rows that take a norm
    # exact / torchclip: the median of the twin rounds' paired ratios (timing.interleave) and its 95% bootstrap
    # interval (intervals.py)
    exact_ratio: tuple[float, float, float] | None = None
    # --busy, rows on more than one thread: torchclip's call on one thread, timed in twin rounds with it, and
    # torchclip / that (over 1: slower on more threads than on one), the paired calls' median and its 95% interval
    one_thread_ms: float | None = None
    one_thread_ratio: tuple[float, float, float] | None = None


def run(
    workload_names,
    dtype_names,
    thread_counts,
    ops,
    rounds,
    warmup,
    progress,
    device="cpu",
    separate=False,
    as_generators=False,
    exact=False,
    against_one_thread=False,
):
    rows = []
    sync = torch.cuda.synchronize if device == "cuda" else no_sync
    jobs = [(w, d, t) for w in workload_names for d in dtype_names for t in thread_counts]
    total_steps, done = len(jobs) * len(ops), 0
    for workload, dtype_name, threads in jobs:
        label, shape_list = workloads.resolve(workload)
        g = Grads(shape_list, DTYPES[dtype_name], device=device, separate=separate, values=workloads.values(workload))
        torch.set_num_threads(threads)
        for op in ops:
            progress(done, total_steps, f"{label} {dtype_name} threads={threads}: {op}")
            done += 1
            c = candidates_for(op, g, as_generators)
            timed_fns = [c.torch, c.torch_no_foreach, c.torchclip, c.bound]
            with_exact = exact and op in NORM_OPS
            if with_exact:
                timed_fns.append(with_exact_norms(c.torchclip))
            with_one_thread = against_one_thread and threads > 1
            if with_one_thread:
                timed_fns.append(on_one_thread(c.torchclip))
            one_thread = len(timed_fns) - 1
            twins = ([(4, 2)] if with_exact else []) + ([(2, one_thread)] if with_one_thread else [])
            paired = []
            timings = interleave(timed_fns, rounds, warmup, c.prepare, sync, twins=twins, twins_out=paired)
            t_torch, t_no_foreach, t_clip, t_bound = (median for median, _ in timings[:4])
            bytes_moved = g.flat.numel() * g.flat.element_size() * c.passes
            rows.append(
                Row(
                    op,
                    label,
                    dtype_name,
                    threads,
                    len(shape_list),
                    g.flat.numel(),
                    t_torch,
                    t_no_foreach,
                    t_clip,
                    t_bound,
                    t_torch / t_clip,
                    t_clip / t_bound,
                    bytes_moved / t_clip / 1e6,
                    max(s for _, s in timings),
                    device,
                    timings[4][0] if with_exact else None,
                    ratio_interval(*paired[0]) if with_exact else None,
                    timings[one_thread][0] if with_one_thread else None,
                    ratio_interval(*paired[-1]) if with_one_thread else None,
                )
            )
            g.reset()
        del g
    progress(total_steps, total_steps, None)
    return rows


def _ratio_text(ratio) -> str:
    median, low, high = ratio
    return f"{median:.2f} ({low:.2f}-{high:.2f})"


def _paired_columns(ms, ratio) -> list[str]:
    """A paired call's columns: its ms and its ratio with interval, or dashes on a row without it."""
    return [f"{ms:.3f}", _ratio_text(ratio)] if ms is not None else ["-", "-"]


def with_exact_norms(call):
    """`call` with torchclip's exact norms on (torchclip.set_exact_norm), as it was after."""

    def exact_call():
        previous = torchclip.set_exact_norm(True)
        try:
            return call()
        finally:
            torchclip.set_exact_norm(previous)

    return exact_call


def on_one_thread(call):
    """`call` on one thread (torch.set_num_threads(1)), the thread count as it was after: beside a busy neighbour,
    what the same call costs without a second thread, timed in twin rounds with the call on more."""

    def one_thread_call():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return call()
        finally:
            torch.set_num_threads(threads)

    return one_thread_call


def format_table(rows) -> str:
    exact = any(r.exact_ms is not None for r in rows)
    one_thread = any(r.one_thread_ms is not None for r in rows)
    header = [
        "workload",
        "dtype",
        "thr",
        "op",
        "torch ms",
        "no-foreach ms",
        "torchclip ms",
        "bound ms",
        "speed-up",
        "x bound",
        "GB/s",
        "spread",
    ]
    header += ["exact ms", "exact x (95%)"] if exact else []
    header += ["1 thr ms", "x 1 thr (95%)"] if one_thread else []
    return format_columns(
        header,
        [
            [
                r.workload,
                r.dtype,
                str(r.threads),
                r.op,
                f"{r.torch_ms:.3f}",
                f"{r.torch_no_foreach_ms:.3f}",
                f"{r.torchclip_ms:.3f}",
                f"{r.bound_ms:.3f}",
                f"{r.speedup:.1f}x",
                f"{r.bound_ratio:.2f}",
                f"{r.gbps:.1f}",
                f"{100 * r.spread:.0f}%",
            ]
            + (_paired_columns(r.exact_ms, r.exact_ratio) if exact else [])
            + (_paired_columns(r.one_thread_ms, r.one_thread_ratio) if one_thread else [])
            for r in rows
        ],
        left=4,
    )


def make_progress(enabled):
    """A one-line progress bar on stderr when it is a terminal; silent otherwise (CI logs, pipes)."""

    def progress(done, total, message):
        if not enabled:
            return
        width = 24
        filled = width * done // max(total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {message or 'done'}"
        sys.stderr.write("\r\033[K" + line[: shutil.get_terminal_size().columns - 1])
        if message is None:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return progress


def _positive_integers(parser, flag: str, text: str) -> list[int]:
    """A comma list of positive integers, or the parser's error naming the flag and what it got."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        parser.error(f"{flag} {text!r}: expected a comma list of positive integers")
    return values


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="torchclip-bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workload",
        action="append",
        help=f"a name ({', '.join(workloads.names())}) or a JSON file of shapes; repeatable",
    )
    parser.add_argument(
        "--model",
        action="append",
        metavar="MODULE:CALLABLE",
        help="a workload from a model's parameter shapes, built on the meta device "
        "(e.g. torchvision.models:resnet50); repeatable",
    )
    parser.add_argument("--dtype", action="append", help=f"one of {', '.join(DTYPES)}; repeatable (default float32)")
    parser.add_argument(
        "--threads", default=str(torch.get_num_threads()), help="comma list of thread counts (default: all cores)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per candidate (default 15; 5 with --quick); with --exact or --busy's one-thread call, "
        "rounded up to whole designs of twin rounds (20 rounds for five calls), whose calls pair after the same calls",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the gradients live (default cpu); cuda times the CUDA kernels",
    )
    parser.add_argument(
        "--grads",
        choices=["views", "separate"],
        default="views",
        help="gradients as views of one flat buffer (default: DDP buckets, FSDP flat parameters) "
        "or each its own allocation (autograd without DDP)",
    )
    parser.add_argument(
        "--params",
        choices=["list", "generator"],
        default="list",
        help="what each call receives: a list of the parameters (default) or a fresh generator "
        "over them, as training loops pass model.parameters()",
    )
    parser.add_argument(
        "--step",
        action="append",
        metavar="OPTIMIZER",
        help=f"instead of the clip rows, what clipping adds to an optimizer step: one of "
        f"{', '.join(step.OPTIMIZERS)}; repeatable (default workloads: "
        f"{', '.join(step.DEFAULT_WORKLOADS)})",
    )
    parser.add_argument(
        "--training",
        action="append",
        metavar="MODEL",
        help=f"what clipping adds to whole training steps (forward, backward, clip, step) of a model: one of "
        f"{', '.join(training.MODELS)}; repeatable, and with --step on one page (needs transformers)",
    )
    parser.add_argument(
        "--ranks",
        default="1",
        help="--training: comma list of DistributedDataParallel rank counts (gloo processes on this machine; "
        "default 1, no DDP)",
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="instead of the clip rows, the adaptive clips against their reference packages (zclip, "
        f"autoclip, timm) and ClipGradByGlobalNorm (default workloads: "
        f"{', '.join(adaptive.DEFAULT_WORKLOADS)})",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="also time torchclip with exact norms (torchclip.set_exact_norm) on the rows that take a norm: "
        "columns exact ms and exact x (exact / torchclip: the median of the twin rounds' paired ratios and its 95%% "
        "interval; across processes: bench/compare_builds.py --exact)",
    )
    parser.add_argument(
        "--per-sample",
        action="store_true",
        help="instead of the clip rows, DP-SGD's per-sample clipping (torchclip.per_sample) against Opacus's "
        f"DPOptimizer, in reads of the per-sample gradients (workloads: {', '.join(per_sample.WORKLOADS)}; "
        "default dtypes float32 and bfloat16)",
    )
    parser.add_argument(
        "--batch",
        default=",".join(map(str, per_sample.DEFAULT_BATCHES)),
        help="--per-sample: comma list of batch sizes (default %(default)s)",
    )
    parser.add_argument(
        "--op",
        action="append",
        metavar="OP",
        help=f"time only this row's op (repeatable; default all: {', '.join(OPS)})",
    )
    parser.add_argument(
        "--busy",
        action="store_true",
        help="a busy neighbour: another process spins on one core for the whole run, as a data loader's worker "
        "does beside training; rows on more than one thread also time torchclip's call on one thread in the same "
        "rounds: columns 1 thr ms and x 1 thr (torchclip / that, paired rounds' median and 95%% interval; over 1: "
        "slower on more threads than on one)",
    )
    parser.add_argument("--quick", action="store_true", help="small workloads, few rounds: seconds, for CI")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--plot", metavar="PATH", help="also draw speed-up and fraction of the bound (PNG)")
    parser.add_argument("--markdown", metavar="PATH", help="also write a results page (Markdown, with the plot)")
    args = parser.parse_args(argv)
    for flag, names, known in (
        ("--step", args.step, step.OPTIMIZERS),
        ("--training", args.training, training.MODELS),
        ("--op", args.op, OPS),
        ("--dtype", args.dtype, DTYPES),
    ):
        for name in names or []:
            if name not in known:
                parser.error(f"{flag} {name!r}: unknown; choose from {', '.join(known)}")
    if args.training and importlib.util.find_spec("transformers") is None:
        parser.error("--training needs transformers (its models): pip install -r requirements-integration.txt")
    args.rank_counts = _positive_integers(parser, "--ranks", args.ranks)
    args.thread_counts = _positive_integers(parser, "--threads", args.threads)
    args.batches = _positive_integers(parser, "--batch", args.batch)
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before the run, not after it
        parser.error("--plot needs matplotlib: pip install torchclip[bench]")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.device == "cuda" and "cuda" not in torchclip._ops.KERNEL_DEVICES:
        parser.error("--device cuda: torchclip was built without its CUDA kernels (TORCHCLIP_CUDA=1)")
    if args.training and args.device == "cuda" and args.rank_counts != [1]:
        parser.error(f"--ranks {args.ranks} with --device cuda: the training rows run DDP on the CPU only")
    args.workload = (args.workload or []) + [f"model:{m}" for m in args.model or []]
    if args.per_sample:
        for w in args.workload:
            if w not in per_sample.WORKLOADS:
                parser.error(f"--per-sample --workload {w!r}: unknown; choose from {', '.join(per_sample.WORKLOADS)}")
        if args.device != "cpu":
            parser.error("--per-sample times the CPU kernels (--device cpu)")
        return args
    for w in args.workload:
        try:
            workloads.resolve(w)
        except ValueError as error:
            parser.error(str(error))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.busy:
        # The neighbour: a process that only spins, for as long as the benchmark runs.
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            return _main(args, argv)
        finally:
            neighbour.kill()
            neighbour.wait()
    return _main(args, argv)


def _main(args, argv) -> int:
    args.argv = argv if argv is not None else sys.argv[1:]  # the command a results page names
    rounds = args.rounds or (5 if args.quick else 15)
    if args.step or args.training:
        return main_step(args, rounds)
    if args.adaptive:
        return main_adaptive(args, rounds)
    if args.per_sample:
        return main_per_sample(args, rounds)
    names = args.workload or (QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS)
    rows = run(
        names,
        args.dtype or ["float32"],
        args.thread_counts,
        [op for op in OPS if op in (args.op or OPS)],
        rounds,
        warmup=1 if args.quick else 2,
        progress=make_progress(sys.stderr.isatty()),
        device=args.device,
        separate=args.grads == "separate",
        as_generators=args.params == "generator",
        exact=args.exact,
        against_one_thread=args.busy,
    )
    where = (
        f"GPU: {torch.cuda.get_device_name()}"
        if args.device == "cuda"
        else f"CPU kernels: {torchclip.get_cpu_capability()}"
    )
    header = (
        f"torchclip {torchclip.__version__} ({where}), "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; medians of {rounds} interleaved rounds; "
        f"gradients: {'separate allocations' if args.grads == 'separate' else 'views of one buffer'}; "
        f"parameters passed as a {args.params}" + ("; a busy neighbour spinning on one core" if args.busy else "")
    )
    table = format_table(rows)
    print(header)
    print(table)
    if args.plot:
        report.plot(rows, args.plot, header)
    if args.markdown:
        command = "torchclip-bench " + " ".join(args.argv)
        with open(args.markdown, "w") as f:
            f.write(report.markdown_page(rows, table, header, command, args.plot))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "cpu_capability": torchclip.get_cpu_capability(),
                    "device": args.device,
                    "grads": args.grads,
                    "params": args.params,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=1,
            )
    return 0


def main_step(args, rounds) -> int:
    """--step: what clipping adds to optimizer steps (torchclip/bench/step.py); --training: to whole
    training steps (torchclip/bench/training.py)."""
    header = (
        f"torchclip {torchclip.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, device "
        f"{args.device}; medians of {rounds} interleaved rounds"
    )
    print(header)
    rows, table = [], None
    if args.step:
        names = args.workload or (QUICK_WORKLOADS if args.quick else step.DEFAULT_WORKLOADS)
        rows = step.run(
            args.step,
            names,
            {d: DTYPES[d] for d in args.dtype or ["float32"]},
            args.thread_counts,
            rounds,
            warmup=1 if args.quick else 2,
            progress=make_progress(sys.stderr.isatty()),
            device=args.device,
        )
        table = step.format_table(rows)
        print(table)
    training_rows, training_table = [], None
    if args.training:
        training_rows = [
            row
            for ranks in args.rank_counts
            for row in training.run(
                args.training, rounds, warmup=1 if args.quick else 2, ranks=ranks, device=args.device
            )
        ]
        training_table = training.format_table(training_rows)
        print(training_table)
    if args.markdown:
        command = "torchclip-bench " + " ".join(args.argv)
        with open(args.markdown, "w") as f:
            f.write(report.step_markdown_page(table, training_table, header, command))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "device": args.device,
                    "step_rows": [asdict(r) for r in rows],
                    "training_rows": [asdict(r) for r in training_rows],
                },
                f,
                indent=1,
            )
    return 0


def main_adaptive(args, rounds) -> int:
    """--adaptive: the adaptive clips against their references (torchclip/bench/adaptive.py)."""
    names = args.workload or (QUICK_WORKLOADS if args.quick else adaptive.DEFAULT_WORKLOADS)
    rows = adaptive.run(
        adaptive.CLIPS,
        names,
        {d: DTYPES[d] for d in args.dtype or ["float32"]},
        args.thread_counts,
        rounds,
        warmup=1 if args.quick else 2,
        progress=make_progress(sys.stderr.isatty()),
        device=args.device,
    )
    print(
        f"torchclip {torchclip.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs, device {args.device}; "
        f"medians of {rounds} interleaved rounds; x GlobalNorm = torchclip / ClipGradByGlobalNorm, x bound = "
        f"torchclip / one read of the gradients (and of the weights, for ClipGradByUnitwiseNorm)"
    )
    print(adaptive.format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "device": args.device, "adaptive_rows": [asdict(r) for r in rows]},
                f,
                indent=1,
            )
    return 0


def main_per_sample(args, rounds) -> int:
    """--per-sample: torchclip.per_sample against Opacus's DPOptimizer (torchclip/bench/per_sample.py)."""
    names = args.workload or (["resnet20"] if args.quick else list(per_sample.WORKLOADS))
    batches = args.batches if not args.quick else args.batches[:1]
    rows = per_sample.run(
        names,
        args.dtype or ["float32", "bfloat16"],
        batches,
        args.thread_counts,
        rounds,
        warmup=1 if args.quick else 2,
        progress=make_progress(sys.stderr.isatty()),
    )
    header = (
        f"torchclip {torchclip.__version__} (CPU kernels: {torchclip.get_cpu_capability()}), torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs; medians of {rounds} interleaved rounds, in reads of the per-sample gradients (one "
        f"read: torch's sum over their bytes); torchclip = per-sample norms + clip_and_accumulate_, + noise = with "
        f"noise and the division by the batch size; Opacus = DPOptimizer.clip_and_accumulate (+ add_noise + "
        f"scale_grad); x faster = Opacus + noise / torchclip + noise"
    )
    print(header)
    table = per_sample.format_table(rows)
    print(table)
    if args.markdown:
        command = "torchclip-bench " + " ".join(args.argv)
        with open(args.markdown, "w") as f:
            f.write(
                f"# Per-sample clipping (DP-SGD) against Opacus\n\n{header}\n\n```\n{command}\n```\n\n```\n{table}\n```\n"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "per_sample_rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
