"""The kernels' arithmetic on every device (csrc/cpu/*_kernel.cpp, csrc/cuda/*_kernel.cu), called through the
ops: norms against the float64 reference, scaling and clamping against torch to the bit, the clip ops against
torch.nn.utils, threads; on CUDA, the agreement with the CPU kernels, no host synchronisation, CUDA graphs.

`device` (conftest.py) runs a test once per compiled CPU kernel library and once on CUDA where there is a GPU
and torchclip's CUDA kernels; `pytest -m cuda` runs the CUDA cases alone.
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
    assert_same_values,
    cuda_only,
    device_list,
    device_tensor,
    has_identity,
    identical,
    make_tensor,
    no_host_sync,
    reference_norm,
    subnormal_spacing,
)

from torchclip import _ops

ops = torch.ops.torchclip
# Around the CPU kernels' vector tails (15, 16, 17, 31) and the CUDA kernels' chunks of 65536 elements.
SIZES = [0, 1, 15, 16, 17, 31, 64, 1000, 65535, 65536, 65537, 300001]


def tensor_list(dtype, device="cpu", seed=0, scale=1.0, layout="contiguous"):
    return device_list(dtype, device, seed, scale, SIZES, layout)


def with_elements(tensors, norm_type):
    """The tensors an order without an identity (inf, negative) can take: the non-empty ones."""
    return tensors if has_identity(norm_type) else [t for t in tensors if t.numel() > 0]


# ---- norms ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ord", NORM_TYPES)
def test_per_tensor_norms(device, dtype, ord):
    tensors = with_elements(tensor_list(dtype, device, scale=0.5), ord)
    total, per_tensor = _ops.multi_tensor_norm(tensors, ord)
    assert total.device.type == per_tensor.device.type == device
    assert total.dtype == dtype and per_tensor.dtype == torch.float64 and per_tensor.shape == (len(tensors),)
    # float64 accumulation is exact to ~1e-15; the CPU kernels sum p = 2 squares of 16/32-bit data in
    # float32 blocks (norm_kernel.cpp), guaranteed to 1e-6 and typically ~1e-8.
    rtol = 1e-6 if device == "cpu" and ord == 2.0 and dtype != torch.float64 else 1e-12
    for t, n in zip(tensors, per_tensor.tolist()):
        expected = torch.linalg.vector_norm(t.double(), ord).item()
        if math.isfinite(expected) and expected != 0:
            assert abs(n - expected) <= rtol * abs(expected) + 1e-300, (t.numel(), n, expected)
        else:
            assert n == expected or (math.isnan(n) and math.isnan(expected))
    assert_norm_close(total, reference_norm(tensors, ord), f"{dtype} ord={ord}")


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ord", NORM_TYPES)
def test_cuda_norms_agree_with_the_cpu_kernels(dtype, ord):
    tensors = with_elements(tensor_list(dtype, "cuda", seed=3), ord)
    total, per_tensor = _ops.multi_tensor_norm(tensors, ord)
    cpu_total, cpu_per_tensor = _ops.multi_tensor_norm([t.cpu() for t in tensors], ord)
    assert cpu_total.dtype == total.dtype
    rtol = NORM_RTOL[torch.float64] if dtype == torch.float64 else NORM_RTOL[torch.float32]
    torch.testing.assert_close(per_tensor.cpu(), cpu_per_tensor, rtol=rtol, atol=0, equal_nan=True)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided", "offset"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 3.0, 0.0])
def test_norms_of_every_layout(device, layout, norm_type):
    # "strided" is not dense (ATen's path); the others are walked as flat spans.
    tensors = [
        device_tensor(shape, dtype, i, device, 1.0, layout)
        for i, shape in enumerate([(3, 5), (64, 33), (300, 257)])
        for dtype in (torch.float32, torch.bfloat16)
    ]
    total, per_tensor = _ops.multi_tensor_norm(tensors, norm_type)
    assert_norm_close(total, reference_norm(tensors, norm_type), layout, tensors)
    expected = torch.stack([torch.linalg.vector_norm(t.double(), norm_type) for t in tensors])
    torch.testing.assert_close(per_tensor, expected, rtol=1e-6, atol=0)


def test_mixed_dtypes_in_one_call(device):
    specs = [(1000, torch.float16), (70000, torch.bfloat16), (5, torch.float32), (65537, torch.float64)]
    tensors = [device_tensor((n,), dtype, i, device) for i, (n, dtype) in enumerate(specs)]
    for norm_type in NORM_TYPES:
        total, _ = _ops.multi_tensor_norm(tensors, norm_type)
        assert total.dtype == torch.float64  # the promotion of the inputs, as torch's
        assert_norm_close(total, reference_norm(tensors, norm_type), f"p={norm_type}", tensors)
    assert _ops.multi_tensor_norm(tensors[:3], 2.0)[0].dtype == torch.float32


def test_complex_and_negated_views_take_atens_path(device):
    z = torch.randn(1000, dtype=torch.complex64, device=device)
    x = torch.randn(2000, device=device)
    neg = torch._neg_view(torch.randn(300, device=device))
    assert neg.is_neg()
    tensors = [z, x, neg]
    for norm_type in [2.0, 3.0, math.inf]:
        total, _ = _ops.multi_tensor_norm(tensors, norm_type)
        assert total.dtype == torch.float32
        assert_norm_close(total, reference_norm(tensors, norm_type), f"p={norm_type}", tensors)
    expected = [neg.resolve_neg().clamp(-0.5, 0.5), x.clamp(-0.5, 0.5)]
    _ops.multi_tensor_clamp_([neg, x], -0.5, 0.5)
    assert_same_values(neg.resolve_neg(), expected[0], "neg view")
    assert_same_values(x, expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_range_values_do_not_overflow(device, dtype):
    # Squares of 1e20 overflow float32 (torch returns inf and zeroes the gradients); accumulated in
    # float64 the norm is 1e20 * sqrt(1e6 + 1000).
    tensors = [torch.full((n,), 1e20, dtype=dtype, device=device) for n in (1000, 1_000_000)]
    total, per_tensor = _ops.multi_tensor_norm(tensors, 2.0)
    value = float(torch.tensor(1e20, dtype=dtype))
    assert_norm_close(total, value * math.sqrt(1_001_000), "total")  # (rounded to the total's dtype)
    assert_close_rel(per_tensor[1].item(), value * 1000.0, 1e-6, "per tensor")
    tiny = [torch.full((1000,), 1e-30, device=device)]
    assert_close_rel(_ops.multi_tensor_norm(tiny, 2.0)[0].item(), 1e-30 * math.sqrt(1000), 1e-6, "tiny")


def assert_close_or_ulp(actual, expected, what):
    """Within 1e-12, or one unit in the last place: a subnormal result (4.6e-314 for 1e-310 at
    p = -1.5) holds fewer bits than 1e-12 asks, and the expected value is itself rounded there."""
    if abs(actual - expected) > math.ulp(expected):
        assert_close_rel(actual, expected, 1e-12, what)


@pytest.mark.parametrize("value", [1e200, 1e-310, 1e-200])
@pytest.mark.parametrize("norm_type", [2.0, 3.0, -1.5])
def test_float64_powers_outside_float64_range_are_rescaled(device, value, norm_type):
    tensors = [torch.full((n,), value, dtype=torch.float64, device=device) for n in (10, 100000)]
    total, per_tensor = _ops.multi_tensor_norm(tensors, norm_type)
    for i, t in enumerate(tensors):
        assert_close_or_ulp(per_tensor[i].item(), value * t.numel() ** (1 / norm_type), f"tensors[{i}]")
    assert_close_or_ulp(total.item(), value * 100010 ** (1 / norm_type), "total")


def test_nan_and_inf(device):
    x = torch.randn(200000, device=device)
    x[123456] = math.nan
    y = torch.randn(10, device=device)
    y[3] = math.inf
    for norm_type in [1.0, 2.0, math.inf, -math.inf, 3.0, 0.0]:
        total, per_tensor = _ops.multi_tensor_norm([x, y], norm_type)
        expected = torch.stack([torch.linalg.vector_norm(t.double(), norm_type) for t in (x, y)])
        torch.testing.assert_close(per_tensor, expected, rtol=1e-6, atol=0, equal_nan=True)
        assert_norm_close(total, reference_norm([x, y], norm_type), f"p={norm_type}")
    with pytest.raises(RuntimeError, match="non-finite"):
        _ops.multi_tensor_norm([x, y], 2.0, True)


@cuda_only
@pytest.mark.parametrize("count", [90, 2000])
def test_cuda_norms_of_many_tensors_span_several_launches(count):
    # 90 tensors fit one small launch table (100); 2,000 take three large ones (864 each), so a block
    # finds its tensor by a search over hundreds of entries, and multi-chunk tensors meet one-chunk ones.
    generator = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 20000, (count - 8,), generator=generator).tolist()
    sizes += [0, 1, 65536 * 3, 65536 * 3 + 5, 65535, 65537, 131071, 65536 * 300 + 17]
    sizes = [sizes[i] for i in torch.randperm(len(sizes), generator=generator).tolist()]
    tensors = device_list(torch.float32, "cuda", seed=11, sizes=sizes)
    for norm_type in [2.0, 1.0, 0.5]:  # (orders with an identity: the list holds empty tensors)
        total, per_tensor = _ops.multi_tensor_norm(tensors, norm_type)
        assert_norm_close(total, reference_norm(tensors, norm_type), f"p={norm_type}", tensors)
        expected = torch.stack([torch.linalg.vector_norm(t.double(), norm_type) for t in tensors])
        torch.testing.assert_close(per_tensor, expected, rtol=1e-6, atol=0)
    expected = [t.clamp(-1e-3, 1e-3) for t in tensors]
    _ops.multi_tensor_clamp_(tensors, -1e-3, 1e-3)
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


def test_one_huge_tensor_and_many_tiny_ones_agree_with_the_reference(device):
    tensors = [make_tensor((3_000_000,), torch.float32, 0).to(device)]
    tensors += [make_tensor((7,), torch.float32, i).to(device) for i in range(3000)]
    total, _ = _ops.multi_tensor_norm(tensors, 2.0)
    assert_norm_close(total, reference_norm(tensors, 2.0), "huge + tiny")


# ---- scaling, clamping ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("coefficient", [0.5, 1 / 3, 0.999999, 1e-30, 0.0, -2.0, math.nan])
def test_scale_rounds_like_torch(device, dtype, coefficient):
    tensors = tensor_list(dtype, device)
    # x times the float32 coefficient in float32 (float64 for float64 data), rounded once: torch's mul by a
    # 0-d CPU tensor. (torch rounds a Python scalar, or a CUDA 0-d tensor, to a 16-bit dtype first.)
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    expected = [(t.to(opmath) * torch.tensor(coefficient).to(opmath).to(device)).to(dtype) for t in tensors]
    if device == "cpu":  # the same as torch's own op there
        torchs = [t.clone() for t in tensors]
        torch._foreach_mul_(torchs, torch.tensor(coefficient))
        assert all(torch.equal(a.nan_to_num(1.0), b.nan_to_num(1.0)) for a, b in zip(torchs, expected))
    _ops.multi_tensor_scale_(tensors, torch.tensor(coefficient))
    for t, e in zip(tensors, expected):
        assert torch.equal(t.nan_to_num(1.0), e.nan_to_num(1.0)) and torch.equal(t.isnan(), e.isnan())


@cuda_only
@pytest.mark.parametrize("layout", ["contiguous", "offset", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_scale_is_the_cpu_kernels_to_the_bit(dtype, layout):
    tensors = tensor_list(dtype, "cuda", seed=7, layout=layout)
    for scale in [
        torch.tensor(0.3),
        torch.tensor(0.3, device="cuda"),
        torch.tensor(1.0, device="cuda"),
        torch.tensor(1e-41, dtype=torch.float64, device="cuda"),
        torch.rand(len(tensors), dtype=torch.float64, device="cuda"),
    ]:
        on_gpu = [t.clone() for t in tensors]
        on_cpu = [t.cpu() for t in tensors]
        _ops.multi_tensor_scale_(on_gpu, scale)
        _ops.multi_tensor_scale_(on_cpu, scale.cpu())
        for g, c in zip(on_gpu, on_cpu):
            if layout == "strided":
                # ATen's mul_ by a tensor on the GPU, the CPU kernel on the copy (.cpu() makes it dense):
                # torch's type promotion may round a device scale to the data's dtype first.
                torch.testing.assert_close(g.cpu(), c, rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).tiny)
            else:
                assert_same_values(g, c, f"{dtype} by {scale}")


def test_scale_by_one_writes_nothing(cpu_capability):
    # A signalling-free NaN payload would be rewritten by a write; equality of raw bits proves none.
    t = torch.tensor([1.5, -0.0, math.inf, math.nan] * 20, dtype=torch.float32)
    bits = t.view(torch.int32).clone()
    _ops.multi_tensor_scale_([t], torch.tensor(1.0))
    assert torch.equal(t.view(torch.int32), bits)


def test_per_tensor_scales(device):
    tensors = tensor_list(torch.float32, device)[1:6]
    scales = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.25], dtype=torch.float64, device=device)
    expected = [t * s.float() for t, s in zip(tensors, scales)]
    _ops.multi_tensor_scale_(tensors, scales)
    for t, e in zip(tensors, expected):
        assert torch.equal(t, e)


def test_scale_rejects_a_scale_of_the_wrong_shape(device):
    tensors = tensor_list(torch.float32, device)[1:4]
    before = [t.clone() for t in tensors]
    with pytest.raises(
        RuntimeError, match=r"scale must be a 0-d tensor or a 1-d tensor with one entry per tensor \(3\)"
    ):
        _ops.multi_tensor_scale_(tensors, torch.ones(2, device=device))
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


CLAMP_BOUNDS = [
    (-0.5, 0.5),
    (0.0, 0.0),
    (-1e-3, 2.0),
    (0.3, -0.3),
    (-math.inf, 0.1),
    (-1e5, 1e5),
    (-0.1, math.nan),
    (-math.inf, math.inf),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bounds", CLAMP_BOUNDS)
@pytest.mark.parametrize("layout", ["contiguous", "offset"])
def test_clamp_is_bit_identical_to_torch(device, dtype, bounds, layout):
    tensors = tensor_list(dtype, device, scale=3.0, layout=layout)
    tensors[4][3] = math.nan
    tensors[5][0] = -math.inf
    tensors[9][::11] = math.inf
    tensors.append(device_tensor((40, 30), dtype, 99, device, layout="strided"))  # ATen's path
    try:
        expected = [t.clone().clamp_min_(bounds[0]).clamp_max_(bounds[1]) for t in tensors]
    except RuntimeError as error:  # torch refuses a float16 bound beyond 65504; the maths does not
        assert "without overflow" in str(error) and dtype == torch.float16
        expected = [t.float().clamp_min_(bounds[0]).clamp_max_(bounds[1]).to(dtype) for t in tensors]
    _ops.multi_tensor_clamp_(tensors, *bounds)
    for i, (t, e) in enumerate(zip(tensors, expected)):
        assert_same_values(t, e, f"tensors[{i}], {dtype}, {bounds}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_tails_stay_inside_their_spans(device, dtype):
    # Spans of every tail length packed back to back in one buffer, with a border on each side: the
    # kernels copy a tail in and out by masked vector loads and stores, which must touch its elements
    # only. Each write is checked against torch on a copy, and the border must keep its bits.
    lengths = list(range(1, 34))
    buffer = device_tensor((sum(lengths) + 2,), dtype, 11, device, scale=4.0)
    spans = list(torch.split(buffer[1:-1], lengths))
    border = buffer[[0, -1]].clone()
    expected = [s.clone().clamp_min_(-0.5).clamp_max_(0.5).mul_(0.25) for s in spans]
    _ops.multi_tensor_clamp_(spans, -0.5, 0.5)
    _ops.multi_tensor_scale_(spans, torch.tensor(0.25))
    assert all(torch.equal(s, e) for s, e in zip(spans, expected))
    assert torch.equal(buffer[[0, -1]], border)
    norms = _ops.multi_tensor_norm(spans, 2.0, False)[1]
    reference = torch.stack([torch.linalg.vector_norm(s.double()) for s in spans])
    torch.testing.assert_close(norms, reference, rtol=1e-6, atol=0)


# ---- the clip ops ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_grad_norm_op_matches_torch_nn_utils(device, dtype, norm_type):
    grads = with_elements(tensor_list(dtype, device, seed=13), norm_type)
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
    # The op also returns each tensor's norm and the coefficient, float64 on the device (for logging).
    assert norms.dtype == kept_coefficient.dtype == torch.float64 and norms.shape == (len(grads),)
    assert norms.device == kept_coefficient.device == total.device and kept_coefficient.shape == ()
    for i, g in enumerate(grads):
        assert_close_rel(norms[i].item(), torch.linalg.vector_norm(g.double(), norm_type).item(), 1e-6)
    # The coefficient from the float64 reference; the result rounded to the dtype (values below its
    # normal range keep fewer bits, hence the absolute tolerance).
    coefficient = min(max_norm / (reference + 1e-6), 1.0)
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


def test_clip_grad_norm_op_over_kernels_and_atens_path(device):
    specs = [(1000, torch.float16), (70000, torch.bfloat16), (5000, torch.float32), (65537, torch.float64)]
    grads = [device_tensor((n,), dtype, i, device) for i, (n, dtype) in enumerate(specs)]
    grads.append(device_tensor((100, 10), torch.float32, 9, device, layout="strided"))  # not dense: ATen's
    grads.append(torch.randn(50, dtype=torch.complex64, device=device))
    before = [g.clone() for g in grads]
    total, _, _ = ops.clip_grad_norm_(grads, 1.0, 2.0, False)
    reference = reference_norm(before, 2.0)
    assert total.dtype == torch.float64
    assert_close_rel(total.item(), reference, 1e-6)
    coefficient = 1.0 / (reference + 1e-6)
    for i, (g, b) in enumerate(zip(grads, before)):
        # (on the CPU a norm over 16/32-bit tensors is promised to 1e-6, and so is the coefficient it gives
        # float64 ones; CUDA accumulates every dtype in float64)
        coefficient_rtol = NORM_RTOL[torch.float32] if device == "cpu" else 0.0
        torch.testing.assert_close(
            g.to(torch.complex128),
            b.to(torch.complex128) * coefficient,
            rtol=max(CLIP_RTOL.get(b.dtype, CLIP_RTOL[torch.float32]), coefficient_rtol),
            atol=subnormal_spacing(b.dtype),
            msg=f"grads[{i}]",
        )


def test_clip_grad_norm_op_of_float32_1e20(device):
    grads = [torch.full((1000,), 1e20, device=device) for _ in range(10)]
    total, _, _ = ops.clip_grad_norm_(grads, 1.0, 2.0, False)
    assert total.dtype == torch.float32
    assert_close_rel(total.item(), 1e20 * 100.0, 1e-6)
    assert_close_rel(torch.linalg.vector_norm(torch.cat(grads).double()).item(), 1.0, 1e-5)


def test_clip_grad_norm_op_nonfinite_policies(device):
    def grads():
        g = [torch.randn(100000, device=device), torch.randn(10, device=device)]
        g[1][4] = math.inf
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


def test_clip_grad_norm_op_leaves_the_bits_when_no_clip_is_needed(device):
    grads = tensor_list(torch.bfloat16, device, seed=17, scale=1e-3)
    before = [g.clone() for g in grads]
    ops.clip_grad_norm_(grads, 1e6, 2.0, False)
    assert all(identical(a, b) for a, b in zip(grads, before))


def test_clip_by_tensor_norm(device):
    tensors = [make_tensor((n,), torch.float32, i).to(device) for i, n in enumerate([3, 100, 1000])]
    norms = [torch.linalg.vector_norm(t.double()).item() for t in tensors]
    max_norm = sorted(norms)[1]
    expected = [t.double() * (1.0 if n <= max_norm else max_norm / n) for t, n in zip(tensors, norms)]
    returned = _ops.clip_by_tensor_norm_(tensors, max_norm)
    assert returned.dtype == torch.float64 and returned.device.type == device
    assert returned.tolist() == pytest.approx(norms, rel=1e-6)
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t.double(), e, rtol=1e-6, atol=0)


def test_clip_by_tensor_norm_nonfinite_policies(device):
    tensors = tensor_list(torch.float32, device, seed=19, scale=0.01)
    tensors[2][0] = math.nan
    snapshot = [t.clone() for t in tensors]
    _ops.clip_by_tensor_norm_(tensors, 1e-3, "skip")  # skip leaves all
    assert all(identical(a, b) for a, b in zip(tensors, snapshot))
    with pytest.raises(RuntimeError, match=r"clip_by_tensor_norm_: a gradient's norm is non-finite"):
        _ops.clip_by_tensor_norm_(tensors, 1e-3, "raise")  # raise refuses before any write
    assert all(identical(a, b) for a, b in zip(tensors, snapshot))


@cuda_only
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_clip_by_tensor_norm_agrees_with_the_cpu_kernels(dtype):
    tensors = tensor_list(dtype, "cuda", seed=19, scale=0.01)
    tensors[6].mul_(100)  # some above max_norm, some below
    tensors[9].mul_(100)
    cpu = [t.cpu() for t in tensors]
    norms = _ops.clip_by_tensor_norm_(tensors, 1.0)
    cpu_norms = _ops.clip_by_tensor_norm_(cpu, 1.0)
    rtol = NORM_RTOL[torch.float64] if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(norms.cpu(), cpu_norms, rtol=rtol, atol=0)
    for i, (t, c) in enumerate(zip(tensors, cpu)):
        torch.testing.assert_close(t.cpu(), c, rtol=CLIP_RTOL[dtype], atol=0, msg=f"tensors[{i}]")


def test_errors_name_the_op_and_the_index_before_any_write(device):
    good = torch.randn(100, device=device)
    before = good.clone()
    if device == "cuda":
        with pytest.raises(RuntimeError, match=r"clip_grad_norm_: tensors\[1\] is on cpu"):
            ops.clip_grad_norm_([good, torch.randn(3)], 1e-3, 2.0, False)
    with pytest.raises(RuntimeError, match=r"multi_tensor_norm: tensors\[1\] has dtype Long"):
        ops.multi_tensor_norm([good, torch.ones(3, dtype=torch.long, device=device)], 2.0, False)
    with pytest.raises(RuntimeError, match=r"cannot compute the inf norm on an empty tensor .*tensors\[1\]"):
        ops.clip_grad_norm_([good, torch.empty(0, device=device)], 1e-3, math.inf, False)
    with pytest.raises(RuntimeError, match=r"multi_tensor_clamp_: tensors\[1\] has elements that share memory"):
        ops.multi_tensor_clamp_([good, torch.randn(1, device=device).expand(5)], -1e-3, 1e-3)
    with pytest.raises(RuntimeError, match=r"nonfinite must be"):
        ops.clip_grad_norm_([good], 1e-3, 2.0, False, nonfinite="ignore")
    assert identical(good, before)


# ---- threads, determinism ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_norms_are_bit_identical_across_thread_counts(cpu_capability, dtype):
    tensors = [make_tensor((n,), dtype, i) for i, n in enumerate([5, 70000, 3, 1 << 20, 999])]
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        total, per_tensor = _ops.multi_tensor_norm(tensors, 2.0)
        results.append((total.item(), per_tensor.tolist()))
    assert results[0] == results[1] == results[2]


def test_grouped_small_tensors_keep_their_own_norms(cpu_capability):
    # Small tensors are walked in runs of whole tensors, big ones in pieces; empty ones have no piece.
    # Each tensor's norm must be the one it has alone, to the bit, whatever the thread count and whatever
    # else the list holds (piece lengths follow a tensor's own size: a quarter of 1,000,003, 2^20 for 5M).
    sizes = [0, 100, 65536, 65537, 0, 3, 1] * 100 + [200_000, 0, 7, 1_000_003, 5_000_001]
    tensors = [make_tensor((n,), torch.float32, i) for i, n in enumerate(sizes)]
    orders = (2.0, 1.0, 3.0)  # (inf refuses the empty tensors: no identity)
    alone = {ord: [_ops.multi_tensor_norm([t], ord)[1].item() for t in tensors] for ord in orders}
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for ord in orders:
            _, per_tensor = _ops.multi_tensor_norm(tensors, ord)
            assert per_tensor.tolist() == alone[ord], (threads, ord)
        clamped = [t.clone() for t in tensors]
        _ops.multi_tensor_clamp_(clamped, -0.5, 0.5)
        assert all(torch.equal(c, t.clamp(-0.5, 0.5)) for c, t in zip(clamped, tensors))


def test_the_same_call_gives_the_same_bits(device):
    tensors = device_list(torch.float32, device, seed=41, sizes=[65536 * 400 + 5, 1000, 3000000])
    tensors += device_list(torch.bfloat16, device, seed=43, sizes=[65536 * 50 + 1] * 3)
    for norm_type in [2.0, 1.0, 3.0]:
        first = _ops.multi_tensor_norm(tensors, norm_type)
        for _ in range(5):
            again = _ops.multi_tensor_norm(tensors, norm_type)
            assert identical(first[0], again[0]) and identical(first[1], again[1]), norm_type
    clipped = [[t.clone() for t in tensors] for _ in range(2)]
    totals = [ops.clip_grad_norm_(c, 1.0, 2.0, False)[0] for c in clipped]
    assert identical(totals[0], totals[1])
    assert all(identical(a, b) for a, b in zip(*clipped))


# ---- CUDA: no host synchronisation, graphs ---------------------------------------------------------


@cuda_only
def test_cuda_ops_never_wait_for_the_device():
    nonempty = [n for n in SIZES if n > 0]  # (the inf norm below has no identity)
    grads = device_list(torch.float32, "cuda", seed=23, sizes=nonempty)
    grads += device_list(torch.bfloat16, "cuda", seed=29, sizes=nonempty)
    grads.append(torch.randn(64, 66, device="cuda")[:, ::2])  # ATen's path: must not sync either
    scale = torch.tensor(0.5, device="cuda")
    with no_host_sync("cuda"):
        ops.clip_grad_norm_(grads, 1.0, 2.0, False)
        ops.clip_grad_norm_(grads, 1.0, math.inf, False, nonfinite="skip")
        ops.clip_grad_norm_(grads, 1.0, 3.0, False)
        ops.multi_tensor_clamp_(grads, -0.01, 0.01)
        ops.multi_tensor_norm(grads, 2.0, False)
        ops.multi_tensor_scale_(grads, scale)
        ops.multi_tensor_scale_(grads, torch.tensor(0.5))  # a CPU scalar is read on the host, not the device
        ops.clip_by_tensor_norm_(grads, 0.1)


@cuda_only
def test_cuda_graph_capture_and_replay():
    grads = device_list(torch.float32, "cuda", seed=31, sizes=[1000, 65537, 300001])
    grads += device_list(torch.float16, "cuda", seed=37, sizes=[5, 70000])
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
        assert all(identical(a, b) for a, b in zip(total, eager_total)), round_
        assert all(identical(a, b) for a, b in zip(grads, eager)), round_
