"""TensorFlow's clipping functions and Keras 3's optimizer arguments against TensorFlow's documented
formulas, evaluated here in float64 (TensorFlow itself is a multi-GB install, so it is not the oracle):

    clip_by_value(t, lo, hi)          = min(max(t, lo), hi)
    clip_by_norm(t, c, axes)          = t * c / max(l2norm(t, axes, keepdims), c)      (0 stays 0)
    global_norm(ts)                   = sqrt(sum l2norm(t)^2), None ignored
    clip_by_global_norm(ts, c, n)     = [t * c * min(1/n, 1/c) + (n - n)], n       (NaN for inf/NaN n)
    Keras clipnorm / clipvalue / global_clipnorm = clip_by_norm / clip_by_value(-v, v) / clip_by_global_norm
"""

import math

import pytest
import torch

import torchclip

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
RTOL = {
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
    torch.float32: 2e-7,
    torch.float64: 1e-14,
    torch.complex64: 2e-7,
    torch.complex128: 1e-14,
}


def fixed_tensors(dtype):
    generator = torch.Generator().manual_seed(3)
    shapes = [(4, 5), (7,), (2, 3, 4), ()]
    return [
        (torch.randn(s, generator=generator, dtype=torch.float64) * (i + 1)).to(dtype) for i, s in enumerate(shapes)
    ]


def formula_clip_by_norm(t, c, axes=None):
    t64 = t.to(torch.complex128 if t.is_complex() else torch.float64)
    dims = None if axes is None else ((axes,) if isinstance(axes, int) else tuple(axes))
    norm = torch.linalg.vector_norm(t64, 2.0, dim=dims, keepdim=dims is not None)
    return t64 * c / torch.clamp(norm, min=c)


def assert_close_to(result, expected, dtype):
    assert result.dtype == dtype
    torch.testing.assert_close(result.to(expected.dtype), expected, rtol=RTOL[dtype], atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_by_value(dtype):
    for t in fixed_tensors(dtype):
        before = t.clone()
        result = torchclip.clip_by_value(t, -0.5, 1.25)
        assert torch.equal(t, before)  # out of place
        assert_close_to(result, torch.clamp(t.double(), -0.5, 1.25), dtype)
    t = torch.tensor([-2.0, math.nan, 0.3, 5.0], dtype=dtype)
    low = torch.tensor([-1.0, 0.0, 0.5, 0.0])
    result = torchclip.clip_by_value(t, low, 1.0)  # a tensor bound, broadcast, taken in t's dtype
    assert result.dtype == dtype and torch.isnan(result[1])
    assert result[[0, 2, 3]].tolist() == [-1.0, 0.5, 1.0]


@pytest.mark.parametrize("dtype", DTYPES + [torch.complex64, torch.complex128])
@pytest.mark.parametrize("axes", [None, 0, -1, [0, 1]])
def test_clip_by_norm(dtype, axes):
    for t in fixed_tensors(dtype):
        if axes is not None and t.dim() < 2:
            continue
        for c in (0.5, 3.0, 1e3):
            before = t.clone()
            result = torchclip.clip_by_norm(t, c, axes)
            assert torch.equal(t, before)
            assert_close_to(result, formula_clip_by_norm(t, c, axes), dtype)


def test_clip_by_norm_zero_stays_zero_and_large_values_do_not_overflow():
    assert torch.equal(torchclip.clip_by_norm(torch.zeros(5), 1.0), torch.zeros(5))
    assert torch.equal(torchclip.clip_by_norm(torch.zeros(2, 3), 1.0, axes=1), torch.zeros(2, 3))
    # float32 squares of 1e20 overflow in float32 (TensorFlow gives 0 there); float64 accumulation does not
    big = torch.full((4,), 1e20)
    torch.testing.assert_close(torchclip.clip_by_norm(big, 2.0), torch.full((4,), 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_global_norm(dtype):
    tensors = fixed_tensors(dtype)
    expected = math.sqrt(sum(torch.linalg.vector_norm(t.double()).item() ** 2 for t in tensors))
    result = torchclip.global_norm([tensors[0], None, *tensors[1:]])
    assert result.dtype == dtype and result.dim() == 0
    assert result.double().item() == pytest.approx(expected, rel=RTOL[dtype])
    assert torchclip.global_norm([None]).item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip_norm", [0.5, 1e4])
def test_clip_by_global_norm(dtype, clip_norm):
    tensors = fixed_tensors(dtype)
    listed = [tensors[0], None, *tensors[1:]]
    before = [t.clone() for t in tensors]
    clipped, norm = torchclip.clip_by_global_norm(listed, clip_norm)
    n = math.sqrt(sum(torch.linalg.vector_norm(t.double()).item() ** 2 for t in tensors))
    scale = clip_norm * min(1.0 / n, 1.0 / clip_norm)
    assert clipped[1] is None and len(clipped) == len(listed)
    for result, t in zip([clipped[0], *clipped[2:]], tensors):
        assert_close_to(result, t.double() * scale, dtype)
    assert norm.dtype == dtype and norm.double().item() == pytest.approx(n, rel=RTOL[dtype])
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_clip_by_global_norm_nonfinite_norm_gives_nan_everywhere_and_use_norm():
    clipped, norm = torchclip.clip_by_global_norm([torch.tensor([1.0, math.inf]), torch.ones(3)], 1.0)
    assert math.isinf(norm.item()) and all(torch.isnan(c).all() for c in clipped)
    clipped, _ = torchclip.clip_by_global_norm([torch.tensor([1.0, math.nan])], 1.0)
    assert torch.isnan(clipped[0]).all()
    t = torch.tensor([3.0, 4.0])
    clipped, norm = torchclip.clip_by_global_norm([t], 1.0, use_norm=10.0)  # the norm is not computed
    assert torch.allclose(clipped[0], t / 10.0) and norm.item() == 10.0
    clipped, norm = torchclip.clip_by_global_norm([t], 1.0, use_norm=torch.tensor(0.0))  # norm 0: scale 1
    assert torch.equal(clipped[0], t) and norm.item() == 0.0


def test_gradients_flow_as_through_the_formula():
    """Differentiable, as TensorFlow's: gradients equal those of the formula written in torch ops."""
    generator = torch.Generator().manual_seed(0)
    for fn, formula in [
        (lambda x: torchclip.clip_by_norm(x, 1.0), lambda x: formula_clip_by_norm(x, 1.0)),
        (lambda x: torchclip.clip_by_norm(x, 0.7, axes=1), lambda x: formula_clip_by_norm(x, 0.7, 1)),
        (
            lambda x: torchclip.clip_by_global_norm([x, x * 2], 1.0)[0][1],
            lambda x: x * 2 * (1.0 / torch.clamp(torch.sqrt((x * x).sum() * 5), min=1.0)),
        ),
        (lambda x: torchclip.clip_by_value(x, -0.3, 0.3), lambda x: torch.clamp(x, -0.3, 0.3)),
    ]:
        x = torch.randn(3, 4, generator=generator, dtype=torch.float64, requires_grad=True)
        weights = torch.randn(3, 4, generator=generator, dtype=torch.float64)
        (ours,) = torch.autograd.grad((fn(x) * weights).sum(), x)
        (theirs,) = torch.autograd.grad((formula(x) * weights).sum(), x)
        torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (
            lambda: torchclip.clip_by_norm(torch.ones(3), -1.0),
            ValueError,
            "clip_norm must be a finite number > 0, got -1.0",
        ),
        (
            lambda: torchclip.clip_by_norm(torch.ones(3), math.inf),
            ValueError,
            "clip_norm must be a finite number > 0, got inf",
        ),
        (
            lambda: torchclip.clip_by_norm(torch.ones(2, 3), 1.0, axes=2),
            ValueError,
            r"axes: 2 is out of range .* \(axes=2\)",
        ),
        (lambda: torchclip.clip_by_norm(torch.ones(2, 3), 1.0, axes=[0, -3]), ValueError, r"axes: -3 is out of range"),
        (lambda: torchclip.clip_by_norm([1.0], 1.0), TypeError, "t must be a torch.Tensor, got list"),
        (lambda: torchclip.clip_by_norm(torch.ones(3, dtype=torch.int64), 1.0), TypeError, "dtype torch.int64"),
        (lambda: torchclip.clip_by_global_norm(torch.ones(3), 1.0), TypeError, "t_list must be a sequence"),
        (
            lambda: torchclip.clip_by_global_norm([torch.ones(3), 2.0], 1.0),
            TypeError,
            r"t_list\[1\] must be a torch.Tensor or None, got float",
        ),
        (
            lambda: torchclip.clip_by_global_norm([torch.ones(3)], 0.0),
            ValueError,
            "clip_norm must be a finite number > 0, got 0.0",
        ),
        (lambda: torchclip.global_norm([torch.ones(3), "x"]), TypeError, r"t_list\[1\]"),
        (
            lambda: torchclip.clip_by_value(torch.ones(3), 2.0, 1.0),
            ValueError,
            "clip_value_min must be <= clip_value_max, got clip_value_min=2.0, clip_value_max=1.0",
        ),
        (lambda: torchclip.clip_by_value(torch.ones(3, dtype=torch.complex64), 0.0, 1.0), TypeError, "complex64"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---- Keras 3's optimizer arguments ---------------------------------------------------------------------


def keras_run(clip_kwargs, keras_rule, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    twin = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
    twin.load_state_dict(model.state_dict())
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.1, **clip_kwargs)
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=generator) * 3 for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        optimizer.step()
        for p, g in zip(twin.parameters(), keras_rule([g.double() for g in grads])):
            p.grad = g.float()
        plain.step()
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_keras_clipnorm_clips_each_gradient_by_its_own_norm():
    keras_run({"clipnorm": 1.5}, lambda gs: [g * 1.5 / max(torch.linalg.vector_norm(g).item(), 1.5) for g in gs])


def test_keras_clipvalue_clamps_each_element():
    keras_run({"clipvalue": 0.7}, lambda gs: [torch.clamp(g, -0.7, 0.7) for g in gs])


def test_keras_global_clipnorm_clips_all_gradients_together():
    def rule(gs):
        n = math.sqrt(sum(torch.linalg.vector_norm(g).item() ** 2 for g in gs))
        return [g * 2.0 * min(1.0 / n, 1.0 / 2.0) for g in gs]

    keras_run({"global_clipnorm": 2.0}, rule)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"clipnorm": 1.0, "global_clipnorm": 1.0},
            "Only one of clipnorm, clipvalue and global_clipnorm can be set .*clipnorm=1.0, global_clipnorm=1.0",
        ),
        ({"clipnorm": 1.0, "clipvalue": 0.5}, "clipnorm=1.0, clipvalue=0.5"),
        ({"clipnorm": 1.0, "grad_clip": torchclip.ClipGradByValue(1.0)}, "grad_clip and clipnorm both set"),
        ({"global_clipnorm": -1.0}, "global_clipnorm must be a finite number > 0, got -1.0"),
    ],
)
def test_keras_arguments_refuse_conflicts_and_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        torchclip.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1, **kwargs)
