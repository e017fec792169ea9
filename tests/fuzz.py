"""Property-based fuzzing of the kernels and the drop-ins against float64 and torch oracles.

Short campaign: tests/test_fuzz.py runs it in CI. Long campaign:
    .venv/bin/python tests/fuzz.py --cases 100000
prints the number of cases tried and exits non-zero on the first failure (with hypothesis' shrunk
example). Inputs: 1-6 tensors of float16/bfloat16/float32/float64, 0-3 dimensions, contiguous,
transposed, strided or offset views, values mixing normal draws with NaN, +-inf, +-0, subnormals and
each dtype's extremes. A second campaign (`--shared-cases`) draws lists whose gradients share memory:
the same tensor repeated, overlapping views, adjacent views of one buffer, separate tensors, some made
in inference mode, on 2 threads and up to ~200k elements so the kernels split the work.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from testing import DTYPES, NORM_RTOL, params_with, reference_norm

import torchclip

SPECIALS = ["nan", "inf", "-inf", "zero", "-zero", "subnormal", "max", "-max", "tiny"]


def special_value(kind: str, dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return {
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
        "zero": 0.0,
        "-zero": -0.0,
        "subnormal": info.smallest_normal / 4,
        "max": info.max,
        "-max": -info.max,
        "tiny": info.tiny,
    }[kind]


@st.composite
def tensors(draw, allow_specials=True):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=3)))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided", "offset"]))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e20]))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    base_shape = shape if layout != "strided" or not shape else (*shape[:-1], 2 * shape[-1])
    extra = 3 if layout == "offset" else 0
    values = torch.randn(math.prod(base_shape) + extra, generator=generator, dtype=torch.float64) * scale
    if allow_specials and values.numel():
        for _ in range(draw(st.integers(0, 3))):
            values[draw(st.integers(0, values.numel() - 1))] = special_value(draw(st.sampled_from(SPECIALS)), dtype)
    storage = values.to(dtype)
    if layout == "offset":
        t = storage[extra:].view(shape)
    elif layout == "strided" and shape:
        t = storage.view(base_shape)[..., ::2]
    elif layout == "transposed" and len(shape) >= 2:
        t = storage.view(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    else:
        t = storage.view(shape)
    assert t.shape == shape and t.numel() == n
    return t


def robust_reference_norm(grads, norm_type) -> float:
    """torch's definition of the total norm in float64, scaled by the largest magnitude (p > 0) or the
    smallest (p < 0) so that norms near float64's limits, where torch's own float64 norm overflows,
    are exact too. For finite p != 0 the total is (sum over every element of |x|^p)^(1/p)."""
    if norm_type in (0.0, math.inf, -math.inf):
        return reference_norm([g.double() for g in grads], norm_type)
    values = torch.cat([g.double().flatten() for g in grads]).abs()
    if values.numel() == 0 or values.isnan().any():
        return math.nan if values.numel() else 0.0
    scale = values.max().item() if norm_type > 0 else values.min().item()
    if scale == 0.0 or math.isinf(scale):
        return scale
    return scale * ((values / scale) ** norm_type).sum().item() ** (1.0 / norm_type)


def check_norm(grads, norm_type):
    if (norm_type in (math.inf, -math.inf) or norm_type < 0) and any(g.numel() == 0 for g in grads):
        return
    total = torchclip.get_total_norm(grads, norm_type)
    reference = robust_reference_norm(grads, norm_type)
    expected = torch.tensor(reference, dtype=torch.float64).to(total.dtype).item()
    got = total.item()
    if math.isnan(expected):
        assert math.isnan(got), (got, expected)
    elif math.isinf(expected) or expected == 0.0:
        assert got == expected, (got, expected)
    else:
        rtol = max(NORM_RTOL[total.dtype], 1e-6 if any(g.dtype != torch.float64 for g in grads) else 0.0)
        # General orders raise |x| to the power p in float64: extreme values lose a few more digits.
        if norm_type not in (1.0, 2.0, math.inf, -math.inf, 0.0):
            rtol = max(rtol, 1e-9)
        assert abs(got - expected) <= rtol * abs(expected), (got, expected, norm_type, total.dtype)


def check_value_clip(grads, clip_value):
    ours = [g.clone() for g in grads]
    theirs = [g.clone() for g in grads]
    try:
        torch.nn.utils.clip_grad_value_(params_with(theirs), clip_value)
    except RuntimeError as error:  # torch refuses float16 bounds beyond 65504; torchclip clamps
        assert "without overflow" in str(error)
        return
    torchclip.clip_grad_value_(params_with(ours), clip_value)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.nan_to_num(1.0, 2.0, -2.0), b.nan_to_num(1.0, 2.0, -2.0)) and torch.equal(
            a.isnan(), b.isnan()
        )


def check_norm_clip(grads, max_norm):
    reference = robust_reference_norm(grads, 2.0)
    before = [g.double() for g in grads]
    params = params_with([g.clone() for g in grads])
    torchclip.clip_grad_norm_(params, max_norm)
    if not math.isfinite(reference):
        return  # propagate: NaN/inf coefficients, as torch
    coefficient = min(max_norm / (reference + 1e-6), 1.0)
    for p, b in zip(params, before):
        expected = (b * coefficient).to(p.grad.dtype).double()
        torch.testing.assert_close(
            p.grad.double(),
            expected,
            rtol=4e-3 if p.grad.dtype.itemsize == 2 else 2e-6,
            atol=torch.finfo(p.grad.dtype).smallest_normal * 4,
            equal_nan=True,
        )


def run_case(grads, op, norm_type, bound, capability):
    torchclip.set_cpu_capability(capability)
    if op == "norm":
        check_norm(grads, norm_type)
    elif op == "value":
        check_value_clip(grads, bound)
    else:
        check_norm_clip(grads, bound)


CASE = {
    "grads": st.lists(tensors(), min_size=1, max_size=6),
    "op": st.sampled_from(["norm", "value", "clip"]),
    "norm_type": st.sampled_from([1.0, 2.0, math.inf, 0.0, 3.0, 0.5, -math.inf, -1.5]),
    "bound": st.sampled_from([0.0, 1e-3, 0.5, 1.0, 1e6]),
    "capability": st.sampled_from(torchclip.cpu_capabilities()),
}


def campaign(cases: int, derandomize: bool = False) -> int:
    count = 0

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(**CASE)
    def property_holds(grads, op, norm_type, bound, capability):
        nonlocal count
        count += 1
        run_case(grads, op, norm_type, bound, capability)

    before = torchclip.get_cpu_capability()
    try:
        property_holds()
    finally:
        torchclip.set_cpu_capability(before)
    return count


@st.composite
def shared_lists(draw):
    """(buffer, [(kind, start, length) or ("repeat", index)], dtype, in inference mode)."""
    dtype = draw(st.sampled_from(DTYPES))
    size = draw(st.sampled_from([64, 1000, 70_000, 200_000]))
    items = []
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["view", "view", "repeat", "separate"] if items else ["view", "separate"]))
        if kind == "repeat":
            items.append(("repeat", draw(st.integers(0, len(items) - 1))))
        else:
            start = draw(st.integers(0, size - 1))
            items.append((kind, start, draw(st.integers(1, size - start))))
    return dtype, size, items, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


def build_shared(dtype, size, items, seed):
    generator = torch.Generator().manual_seed(seed)
    buffer = (torch.randn(size, generator=generator, dtype=torch.float64) * 0.1).to(dtype)
    grads = []
    for item in items:
        if item[0] == "repeat":
            grads.append(grads[item[1]])
        else:
            _, start, length = item
            view = buffer[start : start + length]
            grads.append(view if item[0] == "view" else view.clone())
    params, made = [], {}
    for g in grads:  # one parameter per distinct gradient object: a repeat lists the same parameter again
        if id(g) not in made:
            made[id(g)] = params_with([g])[0]
        params.append(made[id(g)])
    return params


def run_shared_case(dtype, size, items, inference, seed, op, capability):
    """torchclip on one copy of the list, torch.nn.utils on another, built alike: each listed gradient clipped
    in list order (shared elements scaled once per listing)."""
    torchclip.set_cpu_capability(capability)
    mode = torch.inference_mode() if inference else torch.no_grad()
    with mode:
        ours, theirs = build_shared(dtype, size, items, seed), build_shared(dtype, size, items, seed)
        if op == "value":
            torchclip.clip_grad_value_(ours, 0.05)
            torch.nn.utils.clip_grad_value_(theirs, 0.05)
            for p, q in zip(ours, theirs):
                assert torch.equal(p.grad, q.grad)
            return
        total = torchclip.clip_grad_norm_(ours, 0.5)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    # torch sums 16/32-bit squares in their own dtype; the coefficient's error is applied once per listing.
    rtol = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(total, expected, rtol=rtol, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=torch.finfo(dtype).tiny)


def shared_campaign(cases: int, derandomize: bool = False) -> int:
    count = 0

    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=derandomize,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        case=shared_lists(),
        op=st.sampled_from(["norm", "value"]),
        capability=st.sampled_from(torchclip.cpu_capabilities()),
    )
    def property_holds(case, op, capability):
        nonlocal count
        count += 1
        run_shared_case(*case, op, capability)

    before, threads = torchclip.get_cpu_capability(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        property_holds()
    finally:
        torchclip.set_cpu_capability(before)
        torch.set_num_threads(threads)
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--shared-cases", type=int, default=2_000, help="lists whose gradients share memory")
    args = parser.parse_args(argv)
    count = campaign(args.cases)
    shared = shared_campaign(args.shared_cases)
    print(f"fuzz: {count} cases tried, and {shared} lists sharing memory, no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
