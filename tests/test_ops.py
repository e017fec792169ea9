"""The torchclip ops as the dispatcher sees them: opcheck on every device, fakes, the compiled libraries,
refusals, lazily negated and conjugated views. Their arithmetic is tests/test_kernels.py's."""

import math
import re

import pytest
import torch
from testing import make_tensor, op_runs_on
from torch.utils._pytree import tree_map

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


def sgd_step_arguments():
    return {
        "lr": 1e-2,
        "weight_decay": 0.1,
        "momentum": 0.9,
        "dampening": 0.0,
        "nesterov": True,
        "maximize": False,
        "is_first_step": False,
        "grad_scale": torch.tensor(2.0),
    }


def adagrad_step_arguments():
    return {
        "lr": 1e-2,
        "lr_decay": 0.01,
        "weight_decay": 0.1,
        "eps": 1e-10,
        "maximize": False,
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
    "sgd_step_": lambda: (
        (
            [make_tensor((5, 7), torch.float32, 1), make_tensor((3,), torch.bfloat16, 2)],
            [make_tensor((5, 7), torch.float32, 3), make_tensor((3,), torch.bfloat16, 4)],
            [torch.zeros(5, 7), torch.zeros(3, dtype=torch.bfloat16)],
            sgd_step_arguments(),
        ),
    ),
    "adagrad_step_": lambda: (
        (
            [make_tensor((5, 7), torch.float64, 1), make_tensor((3,), torch.float32, 2)],
            [make_tensor((5, 7), torch.float64, 3), make_tensor((3,), torch.float32, 4)],
            [torch.zeros(5, 7, dtype=torch.float64), torch.zeros(3)],
            [torch.tensor(0.0), torch.tensor(4.0)],
            adagrad_step_arguments(),
        ),
    ),
    "per_sample_norms": lambda: (
        ([make_tensor((4, 3, 5), torch.float32, 1), make_tensor((4, 7), torch.bfloat16, 2)], [1, 1], 2.0),
        (
            [
                make_tensor((3, 2), torch.float64, 1),
                make_tensor((1, 2), torch.float64, 2),
                make_tensor((4,), torch.float16, 3),
            ],
            [2, 1],
            1.0,
        ),
    ),
    "per_sample_accumulate_": lambda: (
        (
            [make_tensor((4, 3, 5), torch.float32, 1), make_tensor((4, 7), torch.bfloat16, 2)],
            [1, 1],
            torch.rand(1, 4, dtype=torch.float64),
            [torch.zeros(3, 5), torch.zeros(7)],
            [torch.zeros(3, 5), torch.zeros(7)],
            {"accumulate": True, "noise_std": 0.5, "seed": 3, "divisor": 4.0},
        ),
        (
            [make_tensor((2, 6), torch.float64, 1), make_tensor((1, 6), torch.float64, 2)],
            [2],
            torch.rand(1, 3, dtype=torch.float64),
            [torch.zeros(6, dtype=torch.float64)],
            [],
            {"accumulate": False},
        ),
    ),
}


def test_every_op_has_an_opcheck_case():
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchclip::")}
    assert registered == set(OPCHECK_CASES), registered


@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck(device, name):
    if not op_runs_on(name, device):
        pytest.skip(f"{name} runs on the CPU only")
    op = getattr(torch.ops.torchclip, name).default
    for args in OPCHECK_CASES[name]():
        args = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, args)
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


def test_capabilities_weakest_first_whatever_the_build_order(monkeypatch):
    # TORCHCLIP_CPU_ISAS=AVX512,AVX2 builds them in that order; the default is still the strongest torch allows
    monkeypatch.setattr(_C, "cpu_capabilities_built", lambda: ["DEFAULT", "AVX512", "AVX2"])
    monkeypatch.setattr(_C, "cpu_runs", lambda name: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("TORCHCLIP_CPU_CAPABILITY", raising=False)
    assert torchclip.cpu_capabilities() == ["DEFAULT", "AVX2", "AVX512"]
    assert _ops._default_cpu_capability() == "AVX512"


def test_set_cpu_capability_rejects_unknown_names():
    with pytest.raises(ValueError, match="capability must be one of"):
        torchclip.set_cpu_capability("SSE9")


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


def _sgd_lists(kind):
    params, grads = _listed(kind, (5, 7)), _listed(kind, (5, 7), seed=3)
    buffers = [torch.zeros(5, 7, dtype=torch.float32 if kind == "neg" else torch.complex64), torch.zeros(5)]
    return (params, grads, buffers), sgd_step_arguments()


def _adagrad_lists(kind):
    params, grads = _listed(kind, (5, 7)), _listed(kind, (5, 7), seed=3)
    sums = [torch.zeros(5, 7, dtype=torch.float32 if kind == "neg" else torch.complex64), torch.zeros(5)]
    return (params, grads, sums, [torch.tensor(0.0), torch.tensor(4.0)]), adagrad_step_arguments()


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
    "sgd_step_": _sgd_lists,
    "adagrad_step_": _adagrad_lists,
    "per_sample_norms": lambda kind: (
        ([_viewed(kind, (4, 3), 1), make_tensor((4, 5), torch.float32, 2)], [1, 1], 2.0),
        {},
    ),
    "per_sample_accumulate_": lambda kind: (
        (
            [_viewed(kind, (4, 3), 1), make_tensor((4, 5), torch.float32, 2)],
            [1, 1],
            torch.rand(2, 4, dtype=torch.float64),
            [torch.zeros(3), torch.zeros(5)],
            [],
        ),
        {"accumulate": False},
    ),
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
    if name.endswith("_step_") and not result:  # declined, for the caller to take torch's step: nothing written
        _assert_same(_materialised(args), before)
        return
    _assert_same(result, expected)
    _assert_same(_materialised(args), copies)
