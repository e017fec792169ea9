"""The torchclip ops themselves: opcheck, fakes, every compiled CPU path, rounding, determinism."""

import math
import re

import pytest
import torch
from testing import DTYPES, NORM_TYPES, assert_norm_close, make_tensor, reference_norm

import torchclip
from torchclip import _C, _ops

SIZES = [0, 1, 15, 16, 17, 31, 64, 1000, 65536 + 3, 300001]


def tensor_list(dtype, seed=0, scale=1.0):
    return [make_tensor((n,), dtype, seed + i, scale) for i, n in enumerate(SIZES)]


# ---- opcheck: schema, fake, autograd registration, and the dispatcher agree --------------------


def adam_step_arguments():
    """adam_step_'s keyword arguments in the op tests (a fresh grad_scale each time)."""
    return {
        "lr": 1e-2,
        "beta1": 0.9,
        "beta2": 0.999,
        "weight_decay": 0.1,
        "eps": 1e-8,
        "amsgrad": False,
        "maximize": False,
        "decoupled_weight_decay": True,
        "grad_scale": torch.tensor(2.0),
    }


OPCHECK_CASES = {
    "multi_tensor_norm": lambda: ((tensor_list(torch.float32)[1:5], 2.0, False),),
    "multi_tensor_scale_": lambda: (
        (tensor_list(torch.float16)[:5], torch.tensor(0.5)),
        (tensor_list(torch.float32)[:3], torch.tensor([0.5, 1.0, 2.0])),
    ),
    "multi_tensor_clamp_": lambda: ((tensor_list(torch.bfloat16)[:5], -0.5, 0.5),),
    "clip_grad_norm_": lambda: (
        (tensor_list(torch.float32)[1:6], 0.1, 2.0, False),
        (tensor_list(torch.float16)[1:6], 0.1, 2.0, False, 0.0, True),
    ),
    "clip_by_tensor_norm_": lambda: (
        (tensor_list(torch.float64)[1:6], 1.0),
        (tensor_list(torch.float32)[1:6], 1.0, "skip"),
    ),
    "unitwise_clip_": lambda: (
        (
            [make_tensor((5, 7), torch.float32, 1), make_tensor((3,), torch.bfloat16, 2)],
            [make_tensor((5, 7), torch.float32, 3, 1e-3), make_tensor((3,), torch.float32, 4)],
            0.01,
            1e-3,
            2.0,
        ),
        (
            [make_tensor((4, 2, 3), torch.float64, 5).transpose(1, 2)],
            [make_tensor((4, 3, 2), torch.float64, 6)],
            0.5,
            0.0,
            float("inf"),
        ),
    ),
    # (a dict last: the keyword arguments)
    "adam_step_": lambda: (
        (
            [make_tensor((5, 7), torch.float32, 1), make_tensor((3,), torch.float32, 2)],
            [make_tensor((5, 7), torch.float32, 3), make_tensor((3,), torch.float32, 4)],
            [torch.zeros(5, 7), torch.zeros(3)],
            [torch.zeros(5, 7), torch.zeros(3)],
            [],
            [torch.tensor(0.0), torch.tensor(4.0)],
            adam_step_arguments(),
        ),
    ),
}


def test_every_op_has_an_opcheck_case():
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchclip::")}
    assert registered == set(OPCHECK_CASES), registered


@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck(name):
    op = getattr(torch.ops.torchclip, name).default
    for args in OPCHECK_CASES[name]():
        kwargs = args[-1] if isinstance(args[-1], dict) else {}
        torch.library.opcheck(op, args[:-1] if kwargs else args, kwargs)


def test_fake_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tensors = [torch.empty(3, dtype=torch.float16), torch.empty(4, 4, dtype=torch.bfloat16)]
        total, per_tensor = torch.ops.torchclip.multi_tensor_norm(tensors, 2.0, False)
        assert total.shape == () and total.dtype == torch.float32
        assert per_tensor.shape == (2,) and per_tensor.dtype == torch.float64
        total, per_tensor, coefficient = torch.ops.torchclip.clip_grad_norm_(tensors, 1.0, 2.0, False)
        assert total.dtype == torch.float32
        assert per_tensor.shape == (2,) and per_tensor.dtype == torch.float64
        assert coefficient.shape == () and coefficient.dtype == torch.float64


# ---- the kernels: every compiled instruction set --------------------------------------------------


def test_build_info():
    assert _C.torch_version_built_against() == torch.__version__.split("+")[0]
    assert "DEFAULT" in _C.cpu_capabilities_built()
    assert isinstance(_C.cuda_built(), bool)
    assert torchclip.get_cpu_capability() in torchclip.cpu_capabilities()


def test_set_cpu_capability_rejects_unknown_names():
    with pytest.raises(ValueError, match="capability must be one of"):
        torchclip.set_cpu_capability("SSE9")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ord", NORM_TYPES)
def test_per_tensor_norms(cpu_capability, dtype, ord):
    tensors = tensor_list(dtype, scale=0.5)
    if ord <= 0 or math.isinf(ord):
        tensors = [t for t in tensors if t.numel() > 0]
    total, per_tensor = _ops.multi_tensor_norm(tensors, ord)
    # float64 accumulation is exact to ~1e-15; p = 2 on 16/32-bit data sums squares in float32 blocks
    # (norm_kernel.cpp), guaranteed to 1e-6 and typically ~1e-8.
    rtol = 1e-6 if ord == 2.0 and dtype != torch.float64 else 1e-12
    for t, n in zip(tensors, per_tensor.tolist()):
        expected = torch.linalg.vector_norm(t.double(), ord).item()
        if math.isfinite(expected) and expected != 0:
            assert abs(n - expected) <= rtol * abs(expected) + 1e-300, (t.numel(), n, expected)
        else:
            assert n == expected or (math.isnan(n) and math.isnan(expected))
    assert_norm_close(total, reference_norm(tensors, ord), f"{dtype} ord={ord}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("coefficient", [0.5, 1 / 3, 0.999999, 1e-30, 0.0, -2.0, math.nan])
def test_scale_rounds_like_torch(cpu_capability, dtype, coefficient):
    tensors = tensor_list(dtype)
    expected = [t.clone() for t in tensors]
    torch._foreach_mul_(expected, torch.tensor(coefficient))
    _ops.multi_tensor_scale_(tensors, torch.tensor(coefficient))
    for t, e in zip(tensors, expected):
        assert torch.equal(t.nan_to_num(1.0), e.nan_to_num(1.0)) and torch.equal(t.isnan(), e.isnan())


def test_scale_by_one_writes_nothing(cpu_capability):
    # A signalling-free NaN payload would be rewritten by a write; equality of raw bits proves none.
    t = torch.tensor([1.5, -0.0, math.inf, math.nan] * 20, dtype=torch.float32)
    bits = t.view(torch.int32).clone()
    _ops.multi_tensor_scale_([t], torch.tensor(1.0))
    assert torch.equal(t.view(torch.int32), bits)


def test_per_tensor_scales(cpu_capability):
    tensors = tensor_list(torch.float32)[1:6]
    scales = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.25], dtype=torch.float64)
    expected = [t * s.float() for t, s in zip(tensors, scales)]
    _ops.multi_tensor_scale_(tensors, scales)
    for t, e in zip(tensors, expected):
        assert torch.equal(t, e)


def test_scale_rejects_a_scale_of_the_wrong_shape():
    tensors = tensor_list(torch.float32)[1:4]
    before = [t.clone() for t in tensors]
    with pytest.raises(
        RuntimeError, match=r"scale must be a 0-d tensor or a 1-d tensor with one entry per tensor \(3\)"
    ):
        _ops.multi_tensor_scale_(tensors, torch.ones(2))
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bounds", [(-0.5, 0.5), (0.0, 0.0), (-1e-3, 2.0), (0.3, -0.3), (-math.inf, 0.1), (-1e5, 1e5)])
def test_clamp_is_bit_identical_to_torch(cpu_capability, dtype, bounds):
    tensors = tensor_list(dtype)
    tensors[4][3] = math.nan
    tensors[5][0] = -math.inf
    try:
        expected = [t.clone().clamp_min_(bounds[0]).clamp_max_(bounds[1]) for t in tensors]
    except RuntimeError as error:  # torch refuses a float16 bound beyond 65504; the maths does not
        assert "without overflow" in str(error) and dtype == torch.float16
        expected = [t.float().clamp_min_(bounds[0]).clamp_max_(bounds[1]).to(dtype) for t in tensors]
    _ops.multi_tensor_clamp_(tensors, *bounds)
    for t, e in zip(tensors, expected):
        assert torch.equal(t.nan_to_num(7.0), e.nan_to_num(7.0)) and torch.equal(t.isnan(), e.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_tails_stay_inside_their_spans(cpu_capability, dtype):
    # Spans of every tail length packed back to back in one buffer, with a border on each side: the
    # kernels copy a tail in and out by masked vector loads and stores, which must touch its elements
    # only. Each write is checked against torch on a copy, and the border must keep its bits.
    lengths = list(range(1, 34))
    buffer = make_tensor((sum(lengths) + 2,), dtype, 11, scale=4.0)
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


def test_clamp_refuses_complex_before_any_change():
    tensors = [torch.randn(10), torch.randn(4, dtype=torch.complex64)]
    before = tensors[0].clone()
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype ComplexFloat; clamping is not defined"):
        _ops.multi_tensor_clamp_(tensors, -0.1, 0.1)
    assert torch.equal(tensors[0], before)


def test_complex_and_integer_tensors_take_atens_path():
    tensors = [torch.randn(17, dtype=torch.complex64), torch.randn(5)]
    total, _ = _ops.multi_tensor_norm(tensors, 2.0)
    expected = torch.nn.utils.get_total_norm(tensors)
    assert total.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="floating point or complex"):
        _ops.multi_tensor_norm([torch.arange(4)], 2.0)


def test_neg_bit_views(cpu_capability):
    base = torch.linspace(-1, 0.5, 50)
    negated = torch._neg_view(base)
    total, _ = _ops.multi_tensor_norm([negated], math.inf)
    assert total.item() == 1.0
    # In a mutable list too (the dispatcher's fallback refuses those; the ops fall through to ATen's path).
    expected = negated.resolve_neg().clamp(-0.5, 0.2)
    _ops.multi_tensor_clamp_([negated], -0.5, 0.2)
    assert torch.equal(negated.resolve_neg(), expected) and torch.equal(base, -expected)
    conjugated = torch.randn(20, dtype=torch.complex64).conj()
    expected = conjugated.resolve_conj() * 0.5
    _ops.multi_tensor_scale_([conjugated, negated], torch.tensor(0.5))
    assert torch.equal(conjugated.resolve_conj(), expected)


# ---- lazily negated and conjugated views: every op falls through to its kernel (ops.cpp) -------------


def _viewed(kind, shape, seed):
    """A lazily negated (float32) or conjugated (complex64) view, as kind is "neg" or "conj"."""
    if kind == "neg":
        return torch._neg_view(make_tensor(shape, torch.float32, seed))
    return torch.complex(make_tensor(shape, torch.float32, seed), make_tensor(shape, torch.float32, seed + 100)).conj()


def _materialised(value):
    """`value` with every tensor in it a plain copy holding what the view reads as."""
    if isinstance(value, torch.Tensor):
        return value.resolve_neg().resolve_conj().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialised(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialised(v) for k, v in value.items()}
    return value


def _assert_same(actual, expected):
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, equal_nan=True)
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for k in expected:
            _assert_same(actual[k], expected[k])
    else:
        assert actual == expected


def _listed(kind, shape=(17,), seed=1):
    """A list of a view and a plain float32 tensor."""
    return [_viewed(kind, shape, seed), make_tensor((5,), torch.float32, seed + 1)]


def _adam_lists(kind):
    dtype = torch.float32 if kind == "neg" else torch.complex64
    params, grads = _listed(kind, (5, 7)), _listed(kind, (5, 7), seed=3)
    zeros = [torch.zeros(5, 7, dtype=dtype), torch.zeros(5)]
    return (params, grads, zeros, [z.clone() for z in zeros], [], [torch.tensor(0.0), torch.tensor(4.0)]), (
        adam_step_arguments()
    )


# Each op's arguments (args, kwargs) with a view of `kind` in every tensor list, against which
# test_views_fall_through runs the op and the op on materialised copies. One entry per op
# (tests/test_op_registry.py checks).
NEG_CONJ_CASES = {
    "multi_tensor_norm": lambda kind: ((_listed(kind), 2.0, False), {}),
    "multi_tensor_scale_": lambda kind: ((_listed(kind), torch.tensor(0.5)), {}),
    "multi_tensor_clamp_": lambda kind: ((_listed(kind), -0.5, 0.2), {}),
    "clip_grad_norm_": lambda kind: ((_listed(kind), 0.1, 2.0, False), {}),
    "clip_by_tensor_norm_": lambda kind: ((_listed(kind), 0.5), {}),
    "unitwise_clip_": lambda kind: ((_listed(kind, (5, 7)), _listed(kind, (5, 7), seed=3), 0.01, 1e-3, 2.0), {}),
    "adam_step_": _adam_lists,
}


@pytest.mark.parametrize("kind", ["neg", "conj"])
@pytest.mark.parametrize("name", sorted(NEG_CONJ_CASES))
def test_views_fall_through(cpu_capability, name, kind):
    # The dispatcher's own Negative/Conjugate fallbacks would copy the views, and refuse them in a
    # mutable list; the ops take them as they are and must read (and write) what the views hold.
    op = getattr(torch.ops.torchclip, name)
    args, kwargs = NEG_CONJ_CASES[name](kind)
    copies, copy_kwargs = _materialised(args), _materialised(kwargs)
    before = _materialised(args)
    try:
        expected = op(*copies, **copy_kwargs)
    except RuntimeError as error:  # refused (complex where the op takes real tensors): the same words
        with pytest.raises(type(error), match=re.escape(str(error).splitlines()[0])):
            op(*args, **kwargs)
        _assert_same(_materialised(args), before)
        return
    result = op(*args, **kwargs)
    if name == "adam_step_" and not result:  # declined, for the caller to take torch's step: nothing written
        _assert_same(_materialised(args), before)
        return
    _assert_same(result, expected)
    _assert_same(_materialised(args), copies)


def test_clip_by_tensor_norm(cpu_capability):
    tensors = [make_tensor((n,), torch.float32, i) for i, n in enumerate([3, 100, 1000])]
    norms = [torch.linalg.vector_norm(t.double()).item() for t in tensors]
    max_norm = sorted(norms)[1]
    expected = [t.double() * (1.0 if n <= max_norm else max_norm / n) for t, n in zip(tensors, norms)]
    returned = _ops.clip_by_tensor_norm_(tensors, max_norm)
    assert returned.tolist() == pytest.approx(norms, rel=1e-6)
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t.double(), e, rtol=1e-6, atol=0)


# ---- threads ------------------------------------------------------------------------------------


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
    # Each tensor's norm must be the one it has alone, to the bit, whatever the thread count.
    sizes = [0, 100, 65536, 65537, 0, 3, 1] * 100 + [200_000, 0, 7]
    tensors = [make_tensor((n,), torch.float32, i) for i, n in enumerate(sizes)]
    orders = (2.0, 1.0, 3.0)  # (inf refuses the empty tensors: no identity)
    alone = {ord: [_ops.multi_tensor_norm([t], ord)[1].item() for t in tensors] for ord in orders}
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for ord in orders:
                _, per_tensor = _ops.multi_tensor_norm(tensors, ord)
                assert per_tensor.tolist() == alone[ord], (threads, ord)
            clamped = [t.clone() for t in tensors]
            _ops.multi_tensor_clamp_(clamped, -0.5, 0.5)
            assert all(torch.equal(c, t.clamp(-0.5, 0.5)) for c, t in zip(clamped, tensors))
    finally:
        torch.set_num_threads(previous)


def test_one_huge_tensor_and_many_tiny_ones_agree_with_the_reference(cpu_capability):
    tensors = [make_tensor((3_000_000,), torch.float32, 0)] + [make_tensor((7,), torch.float32, i) for i in range(3000)]
    total, _ = _ops.multi_tensor_norm(tensors, 2.0)
    assert_norm_close(total, reference_norm(tensors, 2.0), "huge + tiny")
