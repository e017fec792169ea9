"""Where the host time of a CUDA clip over many small tensors goes (issue 19's "say where the
remaining time goes"): each op through the drop-in (the walk, then the CUDA implementation called
directly), the op through torch.ops on a ready list (no walk; the list converted and dispatched), the
per-call launch count, the launches' share of the host time and the kernels' time on the device, from
torch.profiler. Run on a machine with a GPU: python bench/cuda_host_cost.py [--workload 10000x100 ...]."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import torchclip
from torchclip.bench import workloads
from torchclip.bench.timing import Grads


def host_and_total_ms(fn, calls=200):
    """(host ms per call: calls enqueued back to back, one sync at the end; ms per call synchronised)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        host.append((enqueued - start) * 1e3 / calls)
        start = time.perf_counter()
        for _ in range(calls // 4):
            fn()
            torch.cuda.synchronize()
        total.append((time.perf_counter() - start) * 1e3 / (calls // 4))
    return statistics.median(host), statistics.median(total)


def launches(fn):
    """(kernel launches per call, ms of cudaLaunchKernel per call, ms of kernel time on the device per
    call) from torch.profiler."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    count, ms = 0, 0.0
    for event in prof.key_averages():
        if event.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            count += event.count
            ms += event.cpu_time_total / 1e3
    device_ms = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    return count, ms, device_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", action="append", help="repeatable; default 10000x100")
    parser.add_argument("--dtype", action="append", help="repeatable; default float32")
    parser.add_argument("--case", action="append", help="repeatable: only these cases (names as printed)")
    parser.add_argument(
        "--breakdown", action="store_true", help="also torch.profiler's table and cProfile's of two cases' host time"
    )
    args = parser.parse_args()
    for workload in args.workload or ["10000x100"]:
        for dtype in args.dtype or ["float32"]:
            report(workload, getattr(torch, dtype), args.case, args.breakdown)


def breakdown(fn, calls=5):
    """torch.profiler's events of `calls` calls after two warm-up calls under the profiler (its first
    events carry its own start-up), by self CPU time."""
    schedule = torch.profiler.schedule(wait=0, warmup=2, active=calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:
        for _ in range(2 + calls):
            fn()
            torch.cuda.synchronize()
            prof.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)


def python_profile(fn, calls=200):
    """cProfile's functions of `calls` calls by their own time: the Python side of a call (a C++ op is
    one entry, its time included)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return text.getvalue()


def report(workload, dtype, only=None, with_breakdown=False):
    label, shapes = workloads.resolve(workload)
    g = Grads(shapes, dtype, device="cuda")
    ops = torch.ops.torchclip
    cases = {
        "clip_grad_norm_ (drop-in)": lambda: torchclip.clip_grad_norm_(g.params, 1e9),
        "clip_grad_norm_ (op on a list)": lambda: ops.clip_grad_norm_(
            g.grads, 1e9, 2.0, False, 1e-6, False, "propagate"
        ),
        "get_total_norm (drop-in)": lambda: torchclip.get_total_norm(g.grads),
        "get_total_norm (drop-in, exact)": lambda: torchclip.get_total_norm(g.grads, exact=True),
        "multi_tensor_norm (op on a list)": lambda: ops.multi_tensor_norm(g.grads, 2.0, False),
        "clip_grad_value_ (drop-in)": lambda: torchclip.clip_grad_value_(g.params, 1e9),
        "multi_tensor_clamp_ (op on a list)": lambda: ops.multi_tensor_clamp_(g.grads, -1e9, 1e9),
        "ClipGradByNorm": lambda: torchclip.ClipGradByNorm(1e9)(g.params),
        "ClipGradByGlobalNorm": lambda: torchclip.ClipGradByGlobalNorm(1e9)(g.params),
        "ClipGradByValue": lambda: torchclip.ClipGradByValue(1e9)(g.params),
        "torch._foreach_norm (reference)": lambda: torch._foreach_norm(g.grads),
        "sum over one buffer (the bound)": lambda: g.flat.sum(),
    }
    cases = {name: fn for name, fn in cases.items() if only is None or name in only}
    print(f"{label}, {dtype}: {len(shapes)} tensors on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':38} {'host ms':>8} {'synced ms':>10} {'launches':>9} {'launch ms':>10} {'kernel ms':>10}")
    with torch.no_grad():
        for name, fn in cases.items():
            host, total = host_and_total_ms(fn)
            count, launch_ms, device_ms = launches(fn)
            print(f"{name:38} {host:8.3f} {total:10.3f} {count:9d} {launch_ms:10.3f} {device_ms:10.3f}")
        if with_breakdown:
            for name in {"clip_grad_norm_ (drop-in)", "ClipGradByNorm"} & cases.keys():
                print(f"{label} {name}:\n{breakdown(cases[name])}\n{python_profile(cases[name])}")


if __name__ == "__main__":
    main()
