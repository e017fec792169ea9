"""Instructions per call of one benchmark row, which no neighbour disturbs: the measure for rows bound by host work.

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*qsort*' \\
        python bench/instructions.py --workload 10000x100 --op ClipGradByValue [--dtype float32] [--exact] [--calls 5]

(`bench/compare_builds.py --instructions` runs it for every row, under each build.) The row's torchclip call is
made `--calls` times, each from inside libc's qsort sorting two bytes with a Python comparator, so that
callgrind, told to count only inside qsort, counts the calls and nothing else (not the import, not the set-up,
not `prepare`); the count over --calls is the row's instructions per call (qsort's own, a few hundred, included).
valgrind runs no AVX-512 code: run it with ATEN_CPU_CAPABILITY=avx2 and TORCHCLIP_CPU_CAPABILITY=AVX2, as
compare_builds does, and compare like with like.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys

# callgrind's closing summary: "==PID== Collected : 37058323"
_COLLECTED = re.compile(r"^==\d+== Collected : (\d+)$", re.MULTILINE)


def collected(valgrind_stderr: str) -> int:
    """The instructions callgrind counted, from its output (the last summary where there are several)."""
    counts = _COLLECTED.findall(valgrind_stderr)
    if not counts:
        raise ValueError("no callgrind summary ('Collected : N') in valgrind's output")
    return int(counts[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--op", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--exact", action="store_true", help="the row's call with exact norms")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)

    import torch

    from torchclip.bench.timing import Grads
    from torchclip.bench.workloads import resolve

    try:
        from torchclip.bench.clip_rows import candidates_for
    except ImportError:  # (a build from before the rows moved to clip_rows.py, as a baseline can be)
        from torchclip.bench.__main__ import candidates_for

    torch.set_num_threads(args.threads)
    _, shapes = resolve(args.workload)
    candidates = candidates_for(args.op, Grads(shapes, getattr(torch, args.dtype)), False)
    call = candidates.torchclip
    if args.exact:
        from torchclip.bench.__main__ import with_exact_norms

        call = with_exact_norms(call)
    prepare = candidates.prepare or (lambda: None)
    for _ in range(3):  # warm: first calls build caches (plans, the overlap check's last verdict)
        prepare()
        call()

    def compare(first, second):
        call()
        return 0

    comparator = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(compare)
    two_bytes = (ctypes.c_char * 2)()
    libc = ctypes.CDLL(None)
    for _ in range(args.calls):
        prepare()
        libc.qsort(two_bytes, 2, 1, comparator)  # one comparison: the call, counted
    return 0


if __name__ == "__main__":
    sys.exit(main())
