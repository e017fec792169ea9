"""The benchmark's outputs beyond the terminal table: a plot and a results page (Markdown)."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform


def machine_description() -> str:
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # Linux names the CPU model here
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def row_label(row, vary_dtype: bool, vary_threads: bool) -> str:
    label = f"{row.workload} · {row.op}"
    if vary_dtype:
        label += f" · {row.dtype}"
    if vary_threads:
        label += f" · {row.threads} thr"
    return label


def label_log_axis(axis, values) -> None:
    """Labels a log x axis at 1, 2 and 5 x 10^k (at 10^k alone past three decades), as plain numbers,
    and leaves the minor ticks unlabelled: matplotlib labels them on short ranges, over each other."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low, high = min(*values, 1.0), max(*values, 1.0)  # the axis always shows 1, where the line is
    per_decade = (1.0,) if math.log10(high / low) > 3 else (1.0, 2.0, 5.0)
    axis.xaxis.set_major_locator(LogLocator(base=10, subs=per_decade))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    axis.xaxis.set_minor_formatter(NullFormatter())


def plot(rows, path: str, title: str) -> None:
    """Two panels sharing one row per measurement: speed-up over torch (log scale) and time over the
    bound (1 = as fast as one pass of torch's fastest op over one buffer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vary_dtype = len({r.dtype for r in rows}) > 1
    vary_threads = len({r.threads for r in rows}) > 1
    labels = [row_label(r, vary_dtype, vary_threads) for r in rows]
    workloads = list(dict.fromkeys(r.workload for r in rows))
    colours = {w: plt.cm.tab10(i % 10) for i, w in enumerate(workloads)}
    y = list(range(len(rows)))[::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.32 * len(rows)), sharey=True)
    left.barh(y, [r.speedup for r in rows], color=[colours[r.workload] for r in rows])
    left.set_xscale("log")
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xlabel("speed-up over torch.nn.utils (log scale; > 1 is faster)")
    left.set_yticks(y, labels, fontsize=8)
    for yi, r in zip(y, rows):
        left.text(r.speedup, yi, f" {r.speedup:.1f}x", va="center", fontsize=7)
    right.barh(y, [r.bound_ratio for r in rows], color=[colours[r.workload] for r in rows])
    right.set_xscale("log")  # ratios near 1 (big tensors) and near 10 (tiny ones) both stay readable
    right.axvline(1.0, color="black", linewidth=0.8)
    right.set_xlabel("torchclip time / bound time (log scale; 1 = one pass over one buffer)")
    for yi, r in zip(y, rows):
        right.text(r.bound_ratio, yi, f" {r.bound_ratio:.2f}", va="center", fontsize=7)
    label_log_axis(left, [r.speedup for r in rows])
    label_log_axis(right, [r.bound_ratio for r in rows])
    for axis in (left, right):
        axis.margins(x=0.15)  # room for the value labels
        axis.grid(axis="x", alpha=0.3)
        axis.set_axisbelow(True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))  # keep the title clear of the bars
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown_page(rows, table: str, header: str, command: str, plot_path: str | None) -> str:
    today = datetime.date.today().isoformat()
    lines = [
        "# torchclip benchmark results",
        "",
        f"Regenerate with `{command}` (from the repository root). Generated {today}.",
        "",
        f"- machine: {machine_description()}",
        f"- {header}",
        "",
        "Columns: torch ms is torch.nn.utils with its defaults (foreach on CPU), no-foreach ms the same with",
        "foreach=False; bound ms is torch's fastest single op over the same bytes in one buffer (sum for a",
        "norm, sum + mul_ for norm + scale, clamp_ for value); for float16 and bfloat16 rows it is the float32",
        "op over a float32 buffer of the same number of bytes (half the elements), the time to stream those",
        "bytes, since torch's 16-bit ops are slower than the memory; x bound = torchclip ms / bound ms; spread",
        "is the largest interquartile range / median of the four. The method is in torchclip/bench/__main__.py.",
        "What clipping adds to a fused optimizer step is on RESULTS-step.md (`torchclip-bench --step`).",
        "",
    ]
    if any(getattr(r, "exact_ms", None) is not None for r in rows):
        lines[-1:-1] = [
            "exact ms is torchclip's call with exact norms (`exact=True`), timed in the same rounds; exact x =",
            "exact / torchclip, the median of the ratios of calls paired in twin rounds (each after the same calls)",
            "and its 95% bootstrap interval (one process; bench/compare_builds.py --exact gives the interval over",
            "fresh processes).",
        ]
    if any(getattr(r, "one_thread_ms", None) is not None for r in rows):
        lines[-1:-1] = [
            "1 thr ms is torchclip's call on one thread, timed in the same rounds beside the busy neighbour (--busy);",
            "x 1 thr = torchclip / 1 thr, the median of the ratios of calls paired in twin rounds and its 95%",
            "bootstrap interval (over 1: slower on more threads than on one).",
        ]
    if plot_path:
        lines += [f"![speed-up and fraction of the bound]({os.path.basename(plot_path)})", ""]
    lines += ["```", table, "```", ""]
    return "\n".join(lines)


def step_markdown_page(table: str | None, training_table: str | None, header: str, command: str) -> str:
    """The page of torchclip-bench --step / --training: what clipping adds to an optimizer step, and to a
    whole training step."""
    lines = [
        "# What clipping adds to an optimizer step",
        "",
        f"Regenerate with `{command}` (from the repository root). Generated {datetime.date.today().isoformat()}.",
        "",
        f"- machine: {machine_description()}",
        f"- {header}",
        "",
    ]
    if table is not None:
        lines += [
            "## The step",
            "",
            "Columns: step ms is the optimizer step alone; torch clip+step ms is torch.nn.utils.clip_grad_norm_",
            "then the step; torchclip step ms is the step of torchclip.optim's grad_clip=ClipGradByGlobalNorm",
            "(folded into the fused kernel where the optimizer is fused); get_total_norm ms is one read of the",
            "gradients, the floor of any norm clip. added (reads) = (clip + step - step) / get_total_norm. Every",
            "call clips (max_norm is 0.9 x the gradients' norm). The method is in torchclip/bench/step.py.",
            "",
            "```",
            table,
            "```",
            "",
        ]
    if training_table is not None:
        lines += [
            "## The training step",
            "",
            "Forward, backward, clip and a fused AdamW step of a model, four ways: no clip; torch's",
            "clip_grad_norm_ then the step; torchclip's folded grad_clip=ClipGradByGlobalNorm; the same with",
            "norm_in_backward=True. ms: median whole steps; added: against no clip; after bwd (reads): the time",
            "from the end of backward to the end of the step, less no clip's, in get_total_norm times (norm ms,",
            "one read of the gradients). Every call clips. The method is in torchclip/bench/training.py.",
        ]
        if "device cuda" in header:
            lines += [
                "On CUDA: GPT-2 124M on 8 x 512 tokens, ResNet-50 on 32 images of 224 x 224, float32, timed by",
                "CUDA events (the GPU's timeline).",
            ]
        lines += [
            "",
            "```",
            training_table,
            "```",
            "",
        ]
    return "\n".join(lines)
