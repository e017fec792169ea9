"""The CUDA kernels (csrc/cuda/), called through torch.ops.torchclip.* on CUDA tensors.

Oracles: the float64 reference (testing.reference_norm), torch.nn.utils on the same device, and the
CPU ops, whose results the CUDA ops must reproduce (same rounding rules; norms to float64 rounding).
Skipped where there is no GPU, and where torchclip was built without its CUDA kernels (asked of the
dispatcher, not guessed from an exception).
"""

import math

import pytest
import torch
from testing import (
    CLIP_RTOL,
    DTYPES,
    NORM_RTOL,
    NORM_TYPES,
    assert_close_rel,
    assert_norm_close,
    clip_by_hand,
    clone_params,
    make_params,
    make_tensor,
    reference_norm,
)

import torchclip

OPS = ["multi_tensor_norm", "multi_tensor_scale_", "multi_tensor_clamp_", "clip_grad_norm_", "clip_by_tensor_norm_"]


def _cuda_kernels_registered():
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"torchclip::{op}", "CUDA") for op in OPS)


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not _cuda_kernels_registered(),
        reason="torchclip was built without its CUDA kernels (TORCHCLIP_CUDA)",
    ),
]

ops = torch.ops.torchclip
CUDA = "cuda"
# Around kernel boundaries: one chunk is 65536 elements, so these make one- and many-chunk tensors.
SIZES = [0, 1, 7, 16, 33, 1000, 65535, 65536, 65537, 300001]
LAYOUTS = ["contiguous", "transposed", "strided", "offset"]


def cuda_tensor(shape, dtype, seed, scale=1.0, layout="contiguous"):
    """testing.make_tensor's tensor and memory layout, on the GPU."""
    if layout == "offset":  # a view 3 elements into its storage: not 16-byte aligned, the kernels' slow path
        base = make_tensor((math.prod(shape) + 3,), dtype, seed, scale).to(CUDA)
        return base[3:].view(shape)
    return same_layout_copy([make_tensor(shape, dtype, seed, scale, layout)], CUDA)[0]


def cuda_list(dtype, seed=0, scale=1.0, sizes=SIZES, layout="contiguous"):
    return [cuda_tensor((n,), dtype, seed + i, scale, layout) for i, n in enumerate(sizes)]


def same_layout_copy(tensors, device):
    """Copies with the same strides (so the same path: kernel or ATen) on `device`."""
    out = []
    for t in tensors:
        c = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
        c.copy_(t)
        out.append(c)
    return out


def bits(t):
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def identical(a, b):
    """Same dtype, shape and bits: for the determinism and graph-replay checks."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_values(a, b, what=""):
    """Same dtype and exactly the same values, any NaN equal to any NaN (implementations may differ in
    the NaN payload they write)."""
    assert a.dtype == b.dtype, what
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True, msg=what)


def ref_norm(tensors, norm_type):
    """testing.reference_norm, for complex tensors too (norms of the magnitudes, as torch)."""
    if not any(t.is_complex() for t in tensors):
        return reference_norm(tensors, norm_type)
    norms = [
        torch.linalg.vector_norm(t.detach().to(torch.complex128 if t.is_complex() else torch.float64), norm_type)
        for t in tensors
    ]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type).item()


def subnormal_spacing(dtype):
    """The absolute resolution of `dtype` near 0: a result that small is off by up to this much."""
    info = torch.finfo(dtype.to_real() if dtype.is_complex else dtype)
    return info.smallest_normal * info.eps


def needs_identity(p):
    return p in (math.inf, -math.inf) or p < 0


# ---- multi_tensor_norm ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_norm_against_float64_reference_and_cpu(dtype, norm_type):
    sizes = [n for n in SIZES if n > 0] if needs_identity(norm_type) else SIZES
    tensors = cuda_list(dtype, seed=3, sizes=sizes)
    total, per_tensor = ops.multi_tensor_norm(tensors, norm_type, False)
    assert total.device.type == CUDA and per_tensor.device.type == CUDA
    assert total.dtype == dtype and per_tensor.dtype == torch.float64 and per_tensor.shape == (len(tensors),)
    assert_norm_close(total, reference_norm(tensors, norm_type), f"{dtype} p={norm_type}", tensors)
    # float64 accumulation: exact to float64 rounding. (The CPU kernels sum 16/32-bit squares in float32
    # blocks, guaranteed to 1e-6; that is the bound between the two devices.)
    rtol = NORM_RTOL[torch.float64] if dtype == torch.float64 else NORM_RTOL[torch.float32]
    for i, t in enumerate(tensors):
        expected = torch.linalg.vector_norm(t.double(), norm_type).item()
        assert_close_rel(per_tensor[i].item(), expected, rtol, f"tensors[{i}] ({t.numel()} elements)")
    cpu_total, cpu_per_tensor = ops.multi_tensor_norm([t.cpu() for t in tensors], norm_type, False)
    assert cpu_total.dtype == total.dtype
    torch.testing.assert_close(per_tensor.cpu(), cpu_per_tensor, rtol=rtol, atol=0, equal_nan=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0, 0.0])
def test_norm_layouts_take_kernel_or_aten(layout, norm_type):
    # "strided" is not dense (ATen's path); the others are walked as flat spans.
    tensors = [
        cuda_tensor(shape, dtype, i, 1.0, layout)
        for i, shape in enumerate([(3, 5), (64, 33), (300, 257)])
        for dtype in (torch.float32, torch.bfloat16)
    ]
    total, per_tensor = ops.multi_tensor_norm(tensors, norm_type, False)
    assert_norm_close(total, reference_norm(tensors, norm_type), layout, tensors)
    expected = torch.stack([torch.linalg.vector_norm(t.double(), norm_type) for t in tensors])
    torch.testing.assert_close(per_tensor, expected, rtol=1e-6, atol=0)


def test_norm_mixed_dtypes_in_one_call():
    tensors = [
        make_tensor((n,), dtype, i).to(CUDA)
        for i, (n, dtype) in enumerate(
            [(1000, torch.float16), (70000, torch.bfloat16), (5, torch.float32), (65537, torch.float64)]
        )
    ]
    for norm_type in NORM_TYPES:
        total, _ = ops.multi_tensor_norm(tensors, norm_type, False)
        assert total.dtype == torch.float64  # the promotion of the inputs, as torch's
        assert_norm_close(total, reference_norm(tensors, norm_type), f"p={norm_type}", tensors)
    narrow = tensors[:3]
    assert ops.multi_tensor_norm(narrow, 2.0, False)[0].dtype == torch.float32


def test_norm_complex_and_negated_views_take_aten():
    z = torch.randn(1000, dtype=torch.complex64, device=CUDA)
    x = torch.randn(2000, device=CUDA)
    neg = torch._neg_view(torch.randn(300, device=CUDA))
    assert neg.is_neg()
    tensors = [z, x, neg]
    for norm_type in [2.0, 3.0, math.inf]:
        total, _ = ops.multi_tensor_norm(tensors, norm_type, False)
        assert total.dtype == torch.float32
        assert_norm_close(total, ref_norm(tensors, norm_type), f"p={norm_type}", tensors)
    expected = [neg.resolve_neg().clamp(-0.5, 0.5), x.clamp(-0.5, 0.5)]
    ops.multi_tensor_clamp_([neg, x], -0.5, 0.5)
    assert_same_values(neg.resolve_neg(), expected[0], "neg view")
    assert_same_values(x, expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_fp32_range_values_do_not_overflow(dtype):
    # Squares of 1e20 overflow float32 (torch returns inf and zeroes the gradients); accumulated in
    # float64 the norm is 1e20 * sqrt(1e6 + 1000).
    tensors = [
        torch.full((1000,), 1e20, dtype=dtype, device=CUDA),
        torch.full((1_000_000,), 1e20, dtype=dtype, device=CUDA),
    ]
    total, per_tensor = ops.multi_tensor_norm(tensors, 2.0, False)
    value = float(torch.tensor(1e20, dtype=dtype))
    assert_norm_close(total, value * math.sqrt(1_001_000), "total")  # (rounded to the total's dtype)
    assert_close_rel(per_tensor[1].item(), value * 1000.0, 1e-6, "per tensor")
    tiny = [torch.full((1000,), 1e-30, device=CUDA)]
    assert_close_rel(ops.multi_tensor_norm(tiny, 2.0, False)[0].item(), 1e-30 * math.sqrt(1000), 1e-6, "tiny")


@pytest.mark.parametrize("value", [1e200, 1e-310, 1e-200])
@pytest.mark.parametrize("norm_type", [2.0, 3.0, -1.5])
def test_norm_float64_extremes_are_rescaled(value, norm_type):
    # (|x|^p leaves float64's range; the finishing block sums again scaled, on the device)
    tensors = [torch.full((n,), value, dtype=torch.float64, device=CUDA) for n in (10, 100000)]
    total, per_tensor = ops.multi_tensor_norm(tensors, norm_type, False)
    for i, t in enumerate(tensors):
        assert_close_or_ulp(per_tensor[i].item(), value * t.numel() ** (1 / norm_type), f"tensors[{i}]")
    assert_close_or_ulp(total.item(), value * 100010 ** (1 / norm_type), "total")


def assert_close_or_ulp(actual, expected, what):
    """Within 1e-12, or one unit in the last place: a subnormal result (4.6e-314 for 1e-310 at
    p = -1.5) holds fewer bits than 1e-12 asks, and the expected value is itself rounded there."""
    if abs(actual - expected) > math.ulp(expected):
        assert_close_rel(actual, expected, 1e-12, what)


def test_norm_nan_and_inf():
    x = torch.randn(200000, device=CUDA)
    x[123456] = float("nan")
    y = torch.randn(10, device=CUDA)
    y[3] = float("inf")
    for norm_type in [1.0, 2.0, math.inf, -math.inf, 3.0, 0.0]:
        total, per_tensor = ops.multi_tensor_norm([x, y], norm_type, False)
        cpu_total, cpu_per_tensor = ops.multi_tensor_norm([x.cpu(), y.cpu()], norm_type, False)
        torch.testing.assert_close(per_tensor.cpu(), cpu_per_tensor, rtol=1e-6, atol=0, equal_nan=True)
        torch.testing.assert_close(total.cpu(), cpu_total, rtol=1e-6, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="non-finite"):
        ops.multi_tensor_norm([x, y], 2.0, True)


@pytest.mark.parametrize("count", [90, 2000])
def test_norm_many_tensors_span_several_launches(count):
    # 90 tensors fit one small launch table (100); 2,000 take three large ones (864 each), so a block
    # finds its tensor by a search over hundreds of entries, and multi-chunk tensors meet one-chunk ones.
    generator = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 20000, (count - 8,), generator=generator).tolist()
    sizes += [0, 1, 65536 * 3, 65536 * 3 + 5, 65535, 65537, 131071, 65536 * 300 + 17]
    sizes = [sizes[i] for i in torch.randperm(len(sizes), generator=generator).tolist()]
    tensors = cuda_list(torch.float32, seed=11, sizes=sizes)
    for norm_type in [2.0, 1.0, 0.5]:  # (orders with an identity: the list holds empty tensors)
        total, per_tensor = ops.multi_tensor_norm(tensors, norm_type, False)
        assert_norm_close(total, reference_norm(tensors, norm_type), f"p={norm_type}", tensors)
        expected = torch.stack([torch.linalg.vector_norm(t.double(), norm_type) for t in tensors])
        torch.testing.assert_close(per_tensor, expected, rtol=1e-6, atol=0)
    expected = [t.clamp(-1e-3, 1e-3) for t in tensors]
    ops.multi_tensor_clamp_(tensors, -1e-3, 1e-3)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


# ---- scaling, clamping ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "offset", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_matches_the_cpu_op_exactly(dtype, layout):
    tensors = cuda_list(dtype, seed=7, layout=layout)
    for scale in [
        torch.tensor(0.3),
        torch.tensor(0.3, device=CUDA),
        torch.tensor(1.0, device=CUDA),
        torch.tensor(1e-41, dtype=torch.float64, device=CUDA),
        torch.rand(len(tensors), dtype=torch.float64, device=CUDA),
    ]:
        on_gpu = [t.clone() for t in tensors]
        on_cpu = [t.cpu() for t in tensors]
        ops.multi_tensor_scale_(on_gpu, scale)
        ops.multi_tensor_scale_(on_cpu, scale.cpu())
        for g, c in zip(on_gpu, on_cpu):
            if layout == "strided":
                # ATen's mul_ by a tensor on the GPU, the CPU kernel on the copy (.cpu() makes it dense):
                # torch's type promotion may round a device scale to the data's dtype first.
                torch.testing.assert_close(g.cpu(), c, rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).tiny)
            else:
                assert_same_values(g, c, f"{dtype} by {scale}")


@pytest.mark.parametrize("layout", ["contiguous", "offset"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_clamp_matches_torch(dtype, layout):
    tensors = cuda_list(dtype, seed=9, scale=3.0, layout=layout)
    tensors[5][::7] = float("nan")
    tensors[6][::11] = float("inf")
    tensors.append(torch.randn(40, 30, dtype=dtype, device=CUDA)[:, ::3])  # ATen's path
    for lo, hi in [(-0.5, 0.5), (-math.inf, 1.0), (2.0, 1.0), (-0.1, math.nan), (-math.inf, math.inf)]:
        ours = [t.clone() for t in tensors]
        theirs = [t.clone() for t in tensors]
        ops.multi_tensor_clamp_(ours, lo, hi)
        for t in theirs:
            t.clamp_min_(lo).clamp_max_(hi)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_values(a, b, f"tensors[{i}], {dtype}, [{lo}, {hi}]")


# ---- clipping ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_grad_norm_matches_torch_nn_utils(dtype, norm_type):
    sizes = [n for n in SIZES if n > 0] if needs_identity(norm_type) else SIZES
    grads = cuda_list(dtype, seed=13, sizes=sizes)
    theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(theirs, grads):
        p.grad = g.clone()
    ours = [g.clone() for g in grads]
    max_norm = 0.25
    total, norms, kept_coefficient = ops.clip_grad_norm_(ours, max_norm, norm_type, False)
    expected_total = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert total.dtype == expected_total.dtype and total.device == expected_total.device
    reference = reference_norm(grads, norm_type)
    assert_norm_close(total, reference, f"{dtype} p={norm_type}", grads)
    # The coefficient from the float64 reference; the result rounded to the dtype (values below its
    # normal range keep fewer bits, hence the absolute tolerance).
    coefficient = min(max_norm / (reference + 1e-6), 1.0)
    # The op also returns each tensor's norm and the coefficient, float64 on the device (for logging).
    assert norms.dtype == kept_coefficient.dtype == torch.float64 and norms.shape == (len(grads),)
    assert norms.device == kept_coefficient.device == total.device and kept_coefficient.shape == ()
    for i, g in enumerate(grads):
        assert_close_rel(norms[i].item(), reference_norm([g], norm_type), 1e-6)
    assert_close_rel(kept_coefficient.item(), coefficient, 1e-6)
    tiny = torch.finfo(dtype).tiny
    # torch's own norm overflows a 16-bit dtype where the true one does not (then torch zeroes every
    # gradient): there the float64 reference is the only oracle.
    torch_is_right = math.isfinite(expected_total.item()) or not math.isfinite(reference)
    for i, (g, p) in enumerate(zip(ours, theirs)):
        expected = (grads[i].double() * coefficient).to(dtype)
        torch.testing.assert_close(g, expected, rtol=CLIP_RTOL[dtype], atol=tiny, msg=f"tensors[{i}] vs float64")
        if torch_is_right:
            torch.testing.assert_close(g, p.grad, rtol=CLIP_RTOL[dtype], atol=tiny, msg=f"tensors[{i}] vs torch")


def test_clip_grad_norm_mixed_list_and_aten_path():
    grads = [
        make_tensor((n,), dtype, i).to(CUDA)
        for i, (n, dtype) in enumerate(
            [(1000, torch.float16), (70000, torch.bfloat16), (5000, torch.float32), (65537, torch.float64)]
        )
    ]
    grads.append(torch.randn(100, 20, device=CUDA)[:, ::2])  # not dense: ATen's path
    grads.append(torch.randn(50, dtype=torch.complex64, device=CUDA))
    before = [g.clone() for g in grads]
    total, _, _ = ops.clip_grad_norm_(grads, 1.0, 2.0, False)
    reference = ref_norm(before, 2.0)
    assert total.dtype == torch.float64
    assert_close_rel(total.item(), reference, 1e-6)
    coefficient = 1.0 / (reference + 1e-6)
    for i, (g, b) in enumerate(zip(grads, before)):
        rtol = CLIP_RTOL.get(b.dtype, CLIP_RTOL[torch.float32])
        torch.testing.assert_close(
            g.to(torch.complex128),
            b.to(torch.complex128) * coefficient,
            rtol=rtol,
            atol=subnormal_spacing(b.dtype),
            msg=f"grads[{i}]",
        )


def test_clip_grad_norm_of_fp32_1e20():
    grads = [torch.full((1000,), 1e20, device=CUDA) for _ in range(10)]
    total, _, _ = ops.clip_grad_norm_(grads, 1.0, 2.0, False)
    assert total.dtype == torch.float32
    assert_close_rel(total.item(), 1e20 * 100.0, 1e-6)
    assert_close_rel(torch.linalg.vector_norm(torch.cat(grads).double()).item(), 1.0, 1e-5)


def test_clip_grad_norm_nonfinite_policies():
    def grads():
        g = [torch.randn(100000, device=CUDA), torch.randn(10, device=CUDA)]
        g[1][4] = float("inf")
        return g

    skipped = grads()
    before = [g.clone() for g in skipped]
    total, _, _ = ops.clip_grad_norm_(skipped, 1.0, 2.0, False, nonfinite="skip")
    assert math.isinf(total.item())
    assert all(identical(a, b) for a, b in zip(skipped, before))
    raised = grads()
    before = [g.clone() for g in raised]
    with pytest.raises(RuntimeError, match="non-finite"):
        ops.clip_grad_norm_(raised, 1.0, 2.0, False, nonfinite="raise")
    with pytest.raises(RuntimeError, match="non-finite"):
        ops.clip_grad_norm_(raised, 1.0, 2.0, True)
    assert all(identical(a, b) for a, b in zip(raised, before))
    propagated = grads()
    ops.clip_grad_norm_(propagated, 1.0, 2.0, False)
    assert (propagated[0] == 0).all()  # scaled by 1 / inf, torch's way


def test_clip_grad_norm_not_needed_leaves_bits():
    grads = cuda_list(torch.bfloat16, seed=17, scale=1e-3)
    before = [g.clone() for g in grads]
    ops.clip_grad_norm_(grads, 1e6, 2.0, False)
    assert all(identical(a, b) for a, b in zip(grads, before))


@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_by_tensor_norm(dtype):
    tensors = cuda_list(dtype, seed=19, scale=0.01)
    tensors[6].mul_(100)  # some above max_norm, some below
    tensors[9].mul_(100)
    before = [t.clone() for t in tensors]
    max_norm = 1.0
    norms = ops.clip_by_tensor_norm_(tensors, max_norm)
    assert norms.dtype == torch.float64 and norms.device.type == CUDA
    cpu = [b.cpu() for b in before]
    cpu_norms = ops.clip_by_tensor_norm_(cpu, max_norm)
    rtol = NORM_RTOL[torch.float64] if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(norms.cpu(), cpu_norms, rtol=rtol, atol=0)
    for i, (t, c) in enumerate(zip(tensors, cpu)):
        torch.testing.assert_close(t.cpu(), c, rtol=CLIP_RTOL[dtype], atol=0, msg=f"tensors[{i}]")
    # nonfinite: skip leaves all, raise refuses before any write
    tensors[2][0] = float("nan")
    snapshot = [t.clone() for t in tensors]
    ops.clip_by_tensor_norm_(tensors, 1e-3, "skip")
    assert all(identical(a, b) for a, b in zip(tensors, snapshot))
    with pytest.raises(RuntimeError, match=r"clip_by_tensor_norm_: a gradient's norm is non-finite"):
        ops.clip_by_tensor_norm_(tensors, 1e-3, "raise")
    assert all(identical(a, b) for a, b in zip(tensors, snapshot))


# ---- errors name the op and the index, before any write ------------------------------------------


def test_errors_before_any_write():
    good = torch.randn(100, device=CUDA)
    before = good.clone()
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_: tensors\[1\] is on cpu"):
        ops.clip_grad_norm_([good, torch.randn(3)], 1e-3, 2.0, False)
    with pytest.raises(RuntimeError, match=r"multi_tensor_norm: tensors\[1\] has dtype Long"):
        ops.multi_tensor_norm([good, torch.ones(3, dtype=torch.long, device=CUDA)], 2.0, False)
    with pytest.raises(RuntimeError, match=r"cannot compute the inf norm on an empty tensor .*tensors\[1\]"):
        ops.clip_grad_norm_([good, torch.empty(0, device=CUDA)], 1e-3, math.inf, False)
    with pytest.raises(RuntimeError, match=r"multi_tensor_clamp_: tensors\[1\] has elements that share memory"):
        ops.multi_tensor_clamp_([good, torch.randn(1, device=CUDA).expand(5)], -1e-3, 1e-3)
    with pytest.raises(RuntimeError, match=r"nonfinite must be"):
        ops.clip_grad_norm_([good], 1e-3, 2.0, False, nonfinite="ignore")
    assert identical(good, before)


# ---- no host synchronisation, CUDA graphs, determinism -------------------------------------------


def test_no_host_sync():
    nonempty = [n for n in SIZES if n > 0]  # (the inf norm below has no identity)
    grads = cuda_list(torch.float32, seed=23, sizes=nonempty) + cuda_list(torch.bfloat16, seed=29, sizes=nonempty)
    grads.append(torch.randn(64, 66, device=CUDA)[:, ::2])  # ATen's path: must not sync either
    scale = torch.tensor(0.5, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.clip_grad_norm_(grads, 1.0, 2.0, False)
        ops.clip_grad_norm_(grads, 1.0, math.inf, False, nonfinite="skip")
        ops.clip_grad_norm_(grads, 1.0, 3.0, False)
        ops.multi_tensor_clamp_(grads, -0.01, 0.01)
        ops.multi_tensor_norm(grads, 2.0, False)
        ops.multi_tensor_scale_(grads, scale)
        ops.multi_tensor_scale_(grads, torch.tensor(0.5))  # a CPU scalar is read on the host, not the device
        ops.clip_by_tensor_norm_(grads, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_capture_and_replay():
    grads = cuda_list(torch.float32, seed=31, sizes=[1000, 65537, 300001]) + cuda_list(
        torch.float16, seed=37, sizes=[5, 70000]
    )
    originals = [g.clone() for g in grads]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture, as torch's graph docs ask
        ops.clip_grad_norm_(grads, 0.5, 2.0, False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total = ops.clip_grad_norm_(grads, 0.5, 2.0, False)
    for round_ in range(3):
        fresh = [o * (round_ + 1) for o in originals]
        for g, f in zip(grads, fresh):
            g.copy_(f)
        graph.replay()
        eager = [f.clone() for f in fresh]
        eager_total = ops.clip_grad_norm_(eager, 0.5, 2.0, False)
        torch.cuda.synchronize()
        assert identical(total, eager_total), round_
        assert all(identical(a, b) for a, b in zip(grads, eager)), round_


def test_deterministic_bits():
    tensors = cuda_list(torch.float32, seed=41, sizes=[65536 * 400 + 5, 1000, 3000000]) + cuda_list(
        torch.bfloat16, seed=43, sizes=[65536 * 50 + 1] * 3
    )
    for norm_type in [2.0, 1.0, 3.0]:
        first = ops.multi_tensor_norm(tensors, norm_type, False)
        for _ in range(5):
            again = ops.multi_tensor_norm(tensors, norm_type, False)
            assert identical(first[0], again[0]) and identical(first[1], again[1]), norm_type
    clipped = [[t.clone() for t in tensors] for _ in range(2)]
    totals = [ops.clip_grad_norm_(c, 1.0, 2.0, False) for c in clipped]
    assert identical(totals[0], totals[1])
    assert all(identical(a, b) for a, b in zip(*clipped))


# ---- the dispatcher, autograd and fakes agree on CUDA --------------------------------------------

OPCHECK_CASES = {
    "multi_tensor_norm": lambda: ((cuda_list(torch.float32)[1:5], 2.0, False),),
    "multi_tensor_scale_": lambda: (
        (cuda_list(torch.float16)[:5], torch.tensor(0.5, device=CUDA)),
        (cuda_list(torch.float32)[:3], torch.tensor([0.5, 1.0, 2.0], device=CUDA)),
    ),
    "multi_tensor_clamp_": lambda: ((cuda_list(torch.bfloat16)[:5], -0.5, 0.5),),
    "clip_grad_norm_": lambda: (
        (cuda_list(torch.float32)[1:6], 0.1, 2.0, False),
        (cuda_list(torch.float16)[1:6], 0.1, 2.0, False, 0.0, True),
    ),
    "clip_by_tensor_norm_": lambda: ((cuda_list(torch.float64)[1:6], 1.0),),
}


@pytest.mark.parametrize("name", OPS)
def test_opcheck_on_cuda(name):
    op = getattr(ops, name).default
    for args in OPCHECK_CASES[name]():
        torch.library.opcheck(op, args)


# ---- the drop-ins and the Paddle classes on CUDA parameters ------------------------------------


def cuda_params(dtype, seed, scale=1.0):
    return clone_params(make_params([((n,), dtype) for n in (1000, 65537, 7, 300001)], seed, scale), device=CUDA)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_drop_ins_route_cuda_gradients_to_the_kernels(dtype, norm_type):
    ours = cuda_params(dtype, seed=51, scale=3.0)
    theirs = clone_params(ours)
    reference = reference_norm([p.grad for p in ours], norm_type)
    true_clip = [(p.grad.double() * min(1.0, 1.0 / (reference + 1e-6))).to(dtype) for p in ours]
    total = torchclip.clip_grad_norm_(ours, 1.0, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert total.device == expected.device and total.dtype == expected.dtype
    assert_norm_close(total, reference)
    # torch's total is in the gradients' dtype: a 16-bit L1 norm of 3e5 values overflows there and
    # torch zeroes every gradient. Ours is clipped by the float64 norm, so the oracle is the reference.
    oracles = [q.grad for q in theirs] if torch.isfinite(expected) else true_clip
    for p, oracle in zip(ours, oracles):
        torch.testing.assert_close(
            p.grad.double(), oracle.double(), rtol=CLIP_RTOL[dtype], atol=max(1e-6, subnormal_spacing(dtype))
        )
    ours = cuda_params(dtype, seed=53, scale=3.0)
    theirs = clone_params(ours)
    torchclip.clip_grad_value_(ours, 0.5)
    torch.nn.utils.clip_grad_value_(theirs, 0.5)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours, theirs))


def test_drop_in_get_total_norm_takes_the_kernels():
    # fp32 squares of 1e20 overflow in torch's float32 accumulation; the kernels accumulate in float64,
    # so a finite total shows the call reached them (and did not sync: the norm stays on the device).
    tensors = [torch.full((n,), 1e20, device=CUDA) for n in (1000, 70000, 3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        total = torchclip.get_total_norm(tensors)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert total.device.type == CUDA and total.dtype == torch.float32
    assert_close_rel(total.item(), float(torch.tensor(1e20)) * math.sqrt(71003), 1e-6)


def test_drop_in_clip_grad_norm_does_not_sync_and_captures():
    params = cuda_params(torch.float32, seed=57, scale=3.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torchclip.clip_grad_norm_(params, 1.0)
        torchclip.clip_grad_value_(params, 0.5)
        torchclip.ClipGradByGlobalNorm(1.0)(params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torchclip.clip_grad_norm_(params, 1.0)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        total = torchclip.clip_grad_norm_(params, 1.0)
    for p in params:
        p.grad.mul_(10.0)
    graph.replay()
    torch.cuda.synchronize()
    assert abs(total.item() - 10.0) < 1e-3  # the replayed norm of the rescaled (norm 1) gradients


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
def test_clip_folded_into_a_fused_step_captures_and_replays(name, nonfinite):
    # The clip's norm, its coefficient as the fused kernel's grad_scale and "skip" as its found_inf, and
    # the step, all in one captured graph; each replay gets its step's gradients copied into the captured
    # ones. Oracle: Paddle's clip in float64, in place, then torch's own fused step, eagerly.
    options = {"lr": 1e-2, "fused": True, "capturable": True, **({"weight_decay": 0.1} if name == "AdamW" else {})}
    ours = cuda_params(torch.float32, seed=71, scale=3.0)
    theirs = clone_params(ours)
    clip = torchclip.ClipGradByGlobalNorm(1.0, nonfinite=nonfinite)
    optimizer = getattr(torchclip.optim, name)(ours, grad_clip=clip, **options)
    reference = getattr(torch.optim, name)(theirs, **options)
    generator = torch.Generator(device=CUDA).manual_seed(73)
    steps = [[torch.randn(p.shape, device=CUDA, generator=generator) * 3.0 for p in ours] for _ in range(7)]
    nonfinite_steps = {4, 6} if nonfinite == "skip" else set()  # ("propagate" would make every parameter NaN)
    for index in nonfinite_steps:
        steps[index][1][0] = math.nan

    def load(params, grads):
        for p, g in zip(params, grads):
            p.grad.copy_(g)

    def reference_step(grads):
        for q, g in zip(theirs, grads):
            q.grad = g.clone()
        norm = clip_by_hand([q.grad for q in theirs], 1.0).item()
        if math.isfinite(norm):  # (a non-finite norm: no step, the skipped step's gradients are dropped)
            reference.step()
        return norm

    warm_up = 3  # eager steps off the capture, as torch's graph docs ask; they must not sync either
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            for grads in steps[:warm_up]:
                load(ours, grads)
                optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    for grads in steps[:warm_up]:
        reference_step(grads)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        optimizer.step()
    for index, grads in enumerate(steps[warm_up:], warm_up):
        load(ours, grads)
        graph.replay()
        norm = reference_step(grads)
        torch.cuda.synchronize()
        if math.isfinite(norm):  # the clip's statistics are the graph's outputs: each replay refreshes them
            assert_close_rel(clip.last_global_norm.item(), norm, 1e-6)
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {index}")
    # counters accumulate across replays (in place: a captured new tensor would hold one replay's count)
    assert int(clip.nonfinite_steps) == len(nonfinite_steps)
    assert optimizer.grad_clip_attachment.skipped_steps == len(nonfinite_steps)


def test_eager_walk_serves_cuda_parameters():
    # The C++ walk (csrc/walk) gathers CUDA gradients, splits them and calls the CUDA implementations
    # directly (cuda_split_ops.h); it bumps each version once, as the ops' Autograd kernels do.
    params = cuda_params(torch.float32, seed=61, scale=3.0)
    expected = [p.grad.clamp(-0.5, 0.5) for p in params]
    versions = [p.grad._version for p in params]
    assert torchclip._ops.clamp_grads_of_plain(params, -0.5, 0.5)
    assert [p.grad._version for p in params] == [v + 1 for v in versions]
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    reference = reference_norm([p.grad for p in params], 2.0)
    total = torchclip._ops.total_norm_of_plain([p.grad for p in params], 2.0, False)
    assert total.device.type == CUDA
    assert_norm_close(total, reference)
    total = torchclip._ops.clip_grad_norm_of_plain(params, 1.0, 2.0, False)
    assert_norm_close(total, reference)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params])).item()
    assert_close_rel(clipped, reference / (reference + 1e-6), 1e-6, "clipped norm")
    norms = torchclip._ops.clip_by_tensor_norm_of_plain(params, 0.1, False)
    assert norms.shape == (len(params),) and norms.dtype == torch.float64
    assert all(torch.linalg.vector_norm(p.grad.double()).item() <= 0.1 * (1 + 1e-6) for p in params)
    # Gradients on two devices, or under a dispatch mode, take the general path.
    on_cpu = torch.nn.Parameter(torch.randn(3))
    on_cpu.grad = torch.randn(3)
    assert torchclip._ops.clip_grad_norm_of_plain(params + [on_cpu], 1.0, 2.0, False) is None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():
        assert torchclip._ops.clip_grad_norm_of_plain(params, 1.0, 2.0, False) is None


def test_eager_walk_splits_cuda_gradients_the_kernels_do_not_take():
    # A strided view and a complex gradient go to ATen from the walk's split, beside the kernels' spans.
    def params():
        found = cuda_params(torch.float32, seed=63, scale=3.0)
        strided = torch.nn.Parameter(torch.zeros(500, device=CUDA))
        strided.grad = torch.randn(500, 3, device=CUDA)[:, 1]
        complex_weight = torch.nn.Parameter(torch.zeros(40, dtype=torch.complex64, device=CUDA))
        complex_weight.grad = torch.randn(40, dtype=torch.complex64, device=CUDA)
        return [strided] + found + [complex_weight]

    torch.manual_seed(0)
    ours = params()
    theirs = clone_params(ours)
    total = torchclip._ops.clip_grad_norm_of_plain(ours, 1.0, 2.0, False)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, 2.0)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    torch.manual_seed(0)
    ours = params()
    expected = [p.grad.clamp(-0.5, 0.5) if not p.grad.is_complex() else None for p in ours]
    assert torchclip._ops.clamp_grads_of_plain(ours[:-1], -0.5, 0.5)
    assert all(torch.equal(p.grad, e) for p, e in zip(ours[:-1], expected))


@pytest.mark.parametrize(
    "clip, op_name",
    [
        (lambda params: torchclip.clip_grad_norm_(params, 1.0), "torchclip::clip_grad_norm_"),
        (lambda params: torchclip.clip_grad_value_(params, 0.5), "torchclip::multi_tensor_clamp_"),
        (lambda params: torchclip.get_total_norm([p.grad for p in params]), "torchclip::multi_tensor_norm"),
        (lambda params: torchclip.ClipGradByNorm(0.1)(params), "torchclip::clip_by_tensor_norm_"),
    ],
)
def test_the_profiler_sees_the_cuda_fast_path(clip, op_name):
    params = cuda_params(torch.float32, seed=65, scale=3.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        clip(params)
    names = [event.name for event in profile.events()]
    assert names.count("torchclip::walk_parameters") == 1
    assert names.count(op_name) == 1
