"""Compare two builds of torchclip on the benchmark, or exact norms against today's, with intervals that can see 5%.

    python bench/compare_builds.py --baseline /path/to/main-checkout [--candidate .] [--pairs 12] [--bar 1.05] \\
        [torchclip-bench options, e.g. --workload 10000x100 --rounds 5]
    python bench/compare_builds.py --exact [--candidate .] [--pairs 12] [--bar 1.05] [torchclip-bench options]
    python bench/compare_builds.py [--baseline TREE] [--candidate .] --step sgd-fused --workload 24x1M [--bar 1.05]

Each build is a source tree with its extension built in place (`setup.py build_ext --inplace`). Two builds cannot
share one process (both register torch.ops.torchclip), and one process freezes one memory placement (which pages
the gradients got, which cache sets they map to): rows moved 10-60% between runs of one build. So every run is a
fresh process, and the builds alternate (A B, B A, A B, ...), so that a machine slowing down or warming up weighs
on both alike. A pair gives each row one ratio, candidate / baseline (each the median of that run's interleaved
rounds); the table gives the median ratio over the pairs and its 95% bootstrap interval
(torchclip/bench/intervals.py).
A row meets --bar when the interval's upper end is under it. With --exact there is no baseline: every run is
`torchclip-bench --exact` of the candidate, and its ratio is that run's own exact / today: the median of its calls
paired in twin rounds (an exact call with today's at the same place after the same calls; timing.interleave), not
the ratio of its medians, which compares calls after different ones; the runs are the pairs. With --step
(torchclip-bench --step: what clipping adds to an optimizer step), each run's own figure is the reads the folded
clip adds (its rows' "torchclip added"), so the table gives each build's median and interval of those, a row meeting
--bar when the candidate's upper end is under it, and, with a baseline, the candidate / baseline ratio of the
clipped step's time.

--instructions adds each row's instructions per call under callgrind (bench/instructions.py; one run per row and
build, AVX2 kernels), which no neighbour disturbs: the measure that settles rows bound by host work.

The interval says what the runs can resolve: twelve pairs whose ratios spread by +-10% give an interval about
+-4% wide around their median. torch's own time per run (min-max) shows how much the machine drifted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(path: str, name: str):
    """A module by its path: importing the torchclip package would load a build's extension in this process."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_intervals = _load(os.path.join(HERE, "..", "torchclip", "bench", "intervals.py"), "intervals")
ratio_interval, median_interval = _intervals.ratio_interval, _intervals.median_interval
collected = _load(os.path.join(HERE, "instructions.py"), "instructions").collected


def run_bench(tree: str, bench_args: list[str], out: str) -> list[dict]:
    # cwd first on sys.path: `-m torchclip.bench` imports the tree's package, not an installed one.
    command = [sys.executable, "-m", "torchclip.bench", "--json", out, *bench_args]
    subprocess.run(command, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        written = json.load(f)
    return written["step_rows"] if "step_rows" in written else written["rows"]


def key(row: dict) -> tuple:
    return row["workload"], row["optimizer"] if "optimizer" in row else row["op"], row["dtype"], row["threads"]


def collect(args, bench_args, trees) -> tuple[dict, dict, dict, dict]:
    """Per row: the baseline's and the candidate's time of each pair, torch's of every run (--step: each build's
    rows of every run, and the step's own time) and, with --exact, each run's own exact / today (its twin rounds'
    paired ratios' median: torchclip/bench/timing.py's interleave)."""
    base: dict[tuple, list] = {}
    cand: dict[tuple, list] = {}
    torch_ms: dict[tuple, list[float]] = {}
    exact_ratios: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            if args.exact:
                runs = [("candidate", [*bench_args, "--exact"])]
            elif "baseline" not in trees:
                runs = [("candidate", bench_args)]
            else:
                order = ("baseline", "candidate") if pair % 2 == 0 else ("candidate", "baseline")
                runs = [(build, bench_args) for build in order]
            for build, build_args in runs:
                rows = run_bench(trees[build], build_args, os.path.join(scratch, f"{build}-{pair}.json"))
                for row in rows:
                    if args.step:
                        torch_ms.setdefault(key(row), []).append(row["step_ms"])
                        (base if build == "baseline" else cand).setdefault(key(row), []).append(row)
                        continue
                    torch_ms.setdefault(key(row), []).append(row["torch_ms"])
                    if args.exact:
                        if row.get("exact_ms") is not None:
                            base.setdefault(key(row), []).append(row["torchclip_ms"])
                            cand.setdefault(key(row), []).append(row["exact_ms"])
                            exact_ratios.setdefault(key(row), []).append(row["exact_ratio"][0])
                    else:
                        (base if build == "baseline" else cand).setdefault(key(row), []).append(row["torchclip_ms"])
            print(f"pair {pair + 1}/{args.pairs} done", file=sys.stderr, flush=True)
    return base, cand, torch_ms, exact_ratios


def instructions_per_call(tree: str, row_key: tuple, exact: bool, calls: int) -> float:
    """bench/instructions.py's count for one row under one build, in valgrind (AVX2 code: valgrind runs no
    AVX-512)."""
    workload, op, dtype, threads = row_key
    command = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        "--toggle-collect=*qsort*",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        os.path.join(HERE, "instructions.py"),
        "--workload",
        workload,
        "--op",
        op,
        "--dtype",
        dtype,
        "--threads",
        str(threads),
        "--calls",
        str(calls),
    ] + (["--exact"] if exact else [])
    env = dict(os.environ, PYTHONPATH=tree, ATEN_CPU_CAPABILITY="avx2", TORCHCLIP_CPU_CAPABILITY="AVX2")
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return collected(result.stderr) / calls


def print_instructions(args, trees, row_keys) -> None:
    """The instructions table: per row, each build's (or today's and exact's) instructions per call."""
    first, second = ("today", "exact") if args.exact else ("baseline", "candidate")
    print(
        f"\ninstructions per call (callgrind, AVX2 kernels, {args.calls} calls, the row's threads run one at a time):\n"
    )
    print(f"| workload | op | dtype | threads | {first} | {second} | {second} / {first} |")
    print("|---|---|---|---|---:|---:|---:|")
    for row_key in row_keys:
        if args.exact:
            a = instructions_per_call(trees["candidate"], row_key, False, args.calls)
            b = instructions_per_call(trees["candidate"], row_key, True, args.calls)
        else:
            a = instructions_per_call(trees["baseline"], row_key, False, args.calls)
            b = instructions_per_call(trees["candidate"], row_key, False, args.calls)
        print(f"| {' | '.join(str(k) for k in row_key)} | {a:,.0f} | {b:,.0f} | {b / a:.3f} |", flush=True)


def print_step_table(args, base, cand, torch_ms) -> None:
    """--step: per row, each build's median reads added by the folded clip and 95% interval over the runs."""
    with_baseline = bool(base)
    bar_column = "" if args.bar is None else " met |"
    columns = "baseline added reads | candidate added reads | candidate / baseline step ms | 95% interval | "
    print(
        f"| optimizer | workload | dtype | threads | {columns if with_baseline else 'added reads | 95% interval | '}"
        f"step alone ms |{bar_column}"
    )
    print(
        "|---|---|---|---|"
        + ("---|---|---:|---|" if with_baseline else "---:|---|")
        + "---|"
        + ("---|" if args.bar is not None else "")
    )

    def added(rows):
        return median_interval([row["torchclip_added_reads"] for row in rows])

    for row_key, rows in cand.items():
        workload, optimizer, dtype, threads = row_key
        median, low, high = added(rows)
        cells = [optimizer, workload, dtype, str(threads)]
        if with_baseline:
            if len(base.get(row_key, [])) != len(rows):
                continue
            b_median, b_low, b_high = added(base[row_key])
            ratio, r_low, r_high = ratio_interval(
                [row["torchclip_step_ms"] for row in rows], [row["torchclip_step_ms"] for row in base[row_key]]
            )
            cells += [
                f"{b_median:.3f} ({b_low:.3f}-{b_high:.3f})",
                f"{median:.3f} ({low:.3f}-{high:.3f})",
                f"{ratio:.3f}",
                f"{r_low:.3f}-{r_high:.3f}",
            ]
        else:
            cells += [f"{median:.3f}", f"{low:.3f}-{high:.3f}"]
        t = torch_ms[row_key]
        cells.append(f"{min(t):.2f}-{max(t):.2f}")
        met = "" if args.bar is None else (" yes |" if high < args.bar else " no |")
        print(f"| {' | '.join(cells)} |{met}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="source tree of the baseline build")
    parser.add_argument("--candidate", default=".", help="source tree of the candidate build (default: .)")
    parser.add_argument("--exact", action="store_true", help="exact norms against today's norms, in the candidate")
    parser.add_argument("--pairs", type=int, default=12, help="run pairs (default 12); --exact: runs")
    parser.add_argument("--bar", type=float, help="mark the rows whose interval's upper end is under this ratio")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count each row's instructions per call under callgrind (needs valgrind; about a minute a row "
        "and build: choose the rows with --workload and --op)",
    )
    parser.add_argument("--calls", type=int, default=5, help="--instructions: calls counted per row (default 5)")
    parser.add_argument(
        "--row-op",
        action="append",
        metavar="OP",
        help="report only this op's rows (repeatable); unlike the bench's --op, which a baseline from before it "
        "would refuse, every build still times every row",
    )
    args, bench_args = parser.parse_known_args(argv)
    args.step = "--step" in bench_args or any(arg.startswith("--step=") for arg in bench_args)
    if args.exact and (args.baseline is not None or args.step):
        parser.error("--exact compares exact norms with today's in one build: no --baseline, no --step")
    if not args.exact and args.baseline is None and not args.step:
        parser.error(
            "give --baseline TREE (two builds), --exact (exact norms against today's) or --step (reads a clip adds)"
        )
    if args.step and args.instructions:
        parser.error("--instructions counts the clip rows' calls, not --step's")
    if args.pairs < 2:
        parser.error("--pairs must be at least 2: an interval needs more than one ratio")
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind (Debian/Ubuntu: apt-get install valgrind)")
    trees = {"candidate": os.path.abspath(args.candidate)}
    if args.baseline is not None:
        trees["baseline"] = os.path.abspath(args.baseline)
    base, cand, torch_ms, exact_ratios = collect(args, bench_args, trees)
    if args.step:
        runs = f"{args.pairs} {'pairs' if args.baseline else 'runs'}"
        where = f"candidate {trees['candidate']}" + ("" if args.baseline is None else f"\nbaseline {trees['baseline']}")
        print(f"{where}\n{runs}; added reads: (clipped step - step alone) / get_total_norm, median and 95% bootstrap")
        print(f"interval over the runs{'' if args.bar is None else f'; met: the interval under {args.bar}'}\n")
        print_step_table(args, base, cand, torch_ms)
        return 0
    what = "exact / today" if args.exact else "candidate / baseline"
    where = f"candidate {trees['candidate']}" + ("" if args.exact else f"\nbaseline {trees['baseline']}")
    print(
        f"{where}\n{args.pairs} {'runs' if args.exact else 'pairs'}; ratio: median of the per-pair {what}, 95% interval"
    )
    print(f"(bootstrap over the pairs){'' if args.bar is None else f'; met: the interval under {args.bar}'}\n")
    bar_column = "" if args.bar is None else " met |"
    first, second = ("today ms", "exact ms") if args.exact else ("baseline ms", "candidate ms")
    print(f"| workload | op | dtype | threads | {first} | {second} | {what} | 95% interval | torch ms |{bar_column}")
    print("|---|---|---|---|---:|---:|---:|---|---|" + ("---|" if args.bar is not None else ""))
    row_keys = [k for k in base if k in cand and (args.row_op is None or k[1] in args.row_op)]
    for row_key in row_keys:
        b, c = base[row_key], cand[row_key]
        if len(c) != len(b):
            continue
        median, low, high = median_interval(exact_ratios[row_key]) if args.exact else ratio_interval(c, b)
        met = "" if args.bar is None else (" yes |" if high < args.bar else " no |")
        t = torch_ms[row_key]
        print(
            f"| {' | '.join(str(k) for k in row_key)} | {statistics.median(b):.3f} | {statistics.median(c):.3f} | "
            f"{median:.3f} | {low:.3f}-{high:.3f} | {min(t):.2f}-{max(t):.2f} |{met}"
        )
    if args.instructions:
        print_instructions(args, trees, row_keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
