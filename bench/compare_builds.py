"""Compare two builds of torchclip on the benchmark, on this machine, in one run.

    python bench/compare_builds.py --baseline /path/to/main-checkout [--candidate .] [--pairs 3] \
        [torchclip-bench options, e.g. --workload 10000x100 --workload gpt2_124m]

Each build is a source tree with its extension built in place (`setup.py build_ext --inplace`). Two
builds cannot share one process (both register torch.ops.torchclip), so the benchmark runs in a fresh
process per build, the builds alternating (A B, B A, A B, ...) so that a machine slowing down or
warming up weighs on both alike. Every run times torchclip against torch itself, interleaved, as
torchclip-bench always does; the table gives, per row, each build's median torchclip time over the
runs, and the median over the pairs of candidate / baseline. torch's own time per run shows how much
the machine drifted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_bench(tree: str, bench_args: list[str], out: str) -> list[dict]:
    # cwd first on sys.path: `-m torchclip.bench` imports the tree's package, not an installed one.
    command = [sys.executable, "-m", "torchclip.bench", "--json", out, *bench_args]
    subprocess.run(command, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["rows"]


def key(row: dict) -> tuple:
    return row["workload"], row["op"], row["dtype"], row["threads"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="source tree of the baseline build")
    parser.add_argument("--candidate", default=".", help="source tree of the candidate build (default: .)")
    parser.add_argument("--pairs", type=int, default=3, help="baseline/candidate run pairs (default 3)")
    args, bench_args = parser.parse_known_args(argv)
    trees = {"baseline": os.path.abspath(args.baseline), "candidate": os.path.abspath(args.candidate)}
    times: dict[str, dict[tuple, list[float]]] = {"baseline": {}, "candidate": {}}
    torch_times: dict[tuple, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(args.pairs):
            order = ("baseline", "candidate") if pair % 2 == 0 else ("candidate", "baseline")
            for build in order:
                rows = run_bench(trees[build], bench_args, os.path.join(scratch, f"{build}-{pair}.json"))
                for row in rows:
                    times[build].setdefault(key(row), []).append(row["torchclip_ms"])
                    torch_times.setdefault(key(row), []).append(row["torch_ms"])
                print(f"pair {pair + 1}/{args.pairs}: {build} done", file=sys.stderr, flush=True)
    print(f"baseline {trees['baseline']}\ncandidate {trees['candidate']}\n{args.pairs} pairs, medians\n")
    print(
        "| workload | op | dtype | threads | baseline ms | candidate ms | candidate / baseline | torch ms (min-max) |"
    )
    print("|---|---|---|---|---:|---:|---:|---|")
    for row_key in times["baseline"]:
        base, cand = times["baseline"][row_key], times["candidate"].get(row_key)
        if not cand:
            continue
        ratio = statistics.median(c / b for b, c in zip(base, cand))
        torch_ms = torch_times[row_key]
        print(
            f"| {' | '.join(str(k) for k in row_key)} | {statistics.median(base):.3f} | "
            f"{statistics.median(cand):.3f} | {ratio:.3f} | {min(torch_ms):.1f}-{max(torch_ms):.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
