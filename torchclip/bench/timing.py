"""The benchmark's measuring tools: the gradients, the interleaved timer, the table."""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch

from torchclip.bench import workloads


def byte_stream_buffer(flat: torch.Tensor) -> torch.Tensor:
    """The buffer the bound's torch op runs over: `flat` itself in float32 and float64; for float16
    and bfloat16 a new float32 buffer of the same number of bytes (half the elements, an odd one
    dropped), because torch's 16-bit ops are slower than the memory on a CPU and the bound is the
    time to stream the bytes. It holds `flat`'s first values, so none is denormal (slow on some CPUs)."""
    if flat.dtype not in (torch.float16, torch.bfloat16):
        return flat
    return flat[: flat.numel() * flat.element_size() // 4].float()


class Grads:
    """Parameters whose gradients are views into one flat buffer or, with separate=True, copies of
    those views, each its own allocation (the flat buffer stays, for the bound). Their values are Gaussian, or
    `values` (tensors of shape_list's shapes: workloads.values) rounded to dtype."""

    def __init__(self, shape_list, dtype, seed=0, device="cpu", separate=False, values=None):
        sizes = [math.prod(s) for s in shape_list]
        self.initial = None
        if values is None:
            generator = torch.Generator().manual_seed(seed)
            self.flat = torch.randn(sum(sizes), generator=generator, dtype=torch.float32).to(device, dtype)
            self.flat.mul_(1.0 / math.sqrt(max(1, self.flat.numel())))  # total norm ~1
        else:
            self.flat = torch.cat([v.reshape(-1) for v in values]).to(device, dtype)
            self.initial = self.flat.clone()
        self.views = [view.view(shape) for view, shape in zip(torch.split(self.flat, sizes), shape_list)]
        self.separate = separate
        self.params = []
        for view, shape in zip(self.views, shape_list):
            # On the CPU never touched, so it has no pages; on a GPU it is memory, never read.
            p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
            p.grad = view.clone() if separate else view
            self.params.append(p)
        self.grads = [p.grad for p in self.params]

    @functools.cached_property
    def bound_buffer(self) -> torch.Tensor:
        """byte_stream_buffer(self.flat), made once: every row of the workload streams the same pages."""
        return byte_stream_buffer(self.flat)

    def reset(self):
        if self.initial is None:
            torch.manual_seed(0)
            self.flat.normal_().mul_(1.0 / math.sqrt(max(1, self.flat.numel())))
        else:
            self.flat.copy_(self.initial)
        if self.separate:
            torch._foreach_copy_(self.grads, self.views)


def each_job(names, workload_names, dtypes, thread_counts, progress, device="cpu"):
    """The jobs of a mode that times one thing per name (an optimizer, a clip): yields (name, workload
    label, dtype name, thread count, Grads) for every combination, `dtypes` mapping names to torch
    dtypes, with the thread count set and progress reported."""
    jobs = [(n, w, d, t) for n in names for w in workload_names for d in dtypes for t in thread_counts]
    for done, (name, workload, dtype_name, threads) in enumerate(jobs):
        label, shape_list = workloads.resolve(workload)
        progress(done, len(jobs), f"{name} {label} {dtype_name} threads={threads}")
        torch.set_num_threads(threads)
        values = workloads.values(workload)
        yield name, label, dtype_name, threads, Grads(shape_list, dtypes[dtype_name], device=device, values=values)
    progress(len(jobs), len(jobs), None)


def no_sync() -> None:
    """The CPU's synchronisation: nothing to wait for (timed()'s default)."""


def timed(fn, prepare=None, sync=no_sync) -> float:
    """Milliseconds of fn(); prepare() runs first, untimed; sync() (a device synchronisation) before
    the clock starts and before it stops."""
    if prepare is not None:
        prepare()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def balanced_orders(n):
    """Orders of n candidates in which every candidate runs right after every other one equally often
    (a Williams design: n rows for even n, 2n for odd). What ran just before a call leaves the caches
    and the allocator in its own state, and a call pays for it: a rotation (round r starts with
    candidate r mod n) keeps each candidate's predecessor fixed, so one candidate would always follow
    the bound's single pass and another always torch's foreach=False loop over 10,000 tensors."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(c + shift) % n for c in first] for shift in range(n)]
    return rows if n % 2 == 0 else rows + [row[::-1] for row in rows]


def twin_rounds(orders, twins):
    """The rounds of one design with twins: each of `orders` followed, for each pair (a, b) of `twins` in turn, by its
    twin, the same order with a and b swapped. In a round and its twin, a's call and b's stand at the same place after
    the same calls (a and b swapped among them), so their times differ by a and b alone, not by what ran before."""
    rounds = []
    for order in orders:
        rounds.append(order)
        for a, b in twins:
            rounds.append([b if c == a else a if c == b else c for c in order])
    return rounds


def interleave(candidates, rounds, warmup, prepare=None, sync=no_sync, twins=(), twins_out=None):
    """Medians and spreads (IQR / median) of each candidate, run in balanced_orders(), one order per
    round in turn; prepare() runs untimed before each call.

    twins: pairs (a, b) of candidates whose times are compared call by call (twin_rounds: each round followed by
    its twin for each pair); `rounds` is then rounded up to whole designs, and twins_out receives, per pair, the
    two lists of paired times (a's, b's): a's call in a round with b's at its place in the twin, and b's with a's.
    A call that opens a round is not paired: it follows the round before, which differs between the two. What ran
    before a call changes its time, and calls paired within one round, or medians, compare calls after different
    ones (docs/exact-norms-record.md, "Twin rounds")."""
    for _ in range(warmup):
        for fn in candidates:
            timed(fn, prepare, sync)
    schedule = twin_rounds(balanced_orders(len(candidates)), twins)
    if twins:
        rounds = -(-rounds // len(schedule)) * len(schedule)
    samples = [[] for _ in candidates]
    at = [{} for _ in range(rounds)]  # per round, each candidate's time
    for r in range(rounds):
        for i in schedule[r % len(schedule)]:
            at[r][i] = timed(candidates[i], prepare, sync)
            samples[i].append(at[r][i])
    if twins_out is not None:
        group = 1 + len(twins)  # (twin_rounds: an order, then its twins)
        for j, (a, b) in enumerate(twins):
            firsts, seconds = [], []
            for original in range(0, rounds, group):
                order, twin = schedule[original % len(schedule)], at[original + 1 + j]
                if order.index(a) != 0:  # (a opens neither the original nor, as b, the twin)
                    firsts.append(at[original][a])
                    seconds.append(twin[b])
                if order.index(b) != 0:
                    firsts.append(twin[a])
                    seconds.append(at[original][b])
            twins_out.append((firsts, seconds))
    out = []
    for s in samples:
        s = sorted(s)
        median = statistics.median(s)
        q1, q3 = s[len(s) // 4], s[(3 * len(s)) // 4]
        out.append((median, (q3 - q1) / median if median > 0 else 0.0))
    return out


def format_columns(header: list[str], lines: list[list[str]], left: int) -> str:
    """A plain-text table: the first `left` columns left-aligned, the rest (numbers) right-aligned."""
    lines = [header, *lines]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        out.append(
            "  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        )
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
