"""The drop-ins against torch.nn.utils (torch 2.13): results, dtypes, warnings, errors, patching."""

import inspect
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from testing import (
    CLIP_RTOL,
    DTYPES,
    FAST_NORM_TYPES,
    LAYOUTS,
    NORM_RTOL,
    NORM_TYPES,
    SHAPES,
    assert_close_rel,
    assert_norm_close,
    clone_params,
    cuda_only,
    device_params,
    device_tensor,
    grads_of,
    make_params,
    make_tensor,
    no_host_sync,
    reference_norm,
)

import torchclip

DROP_INS = ["clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_"]


def assert_grads_close(ours, theirs, rtol, atol=0.0):
    for p, q in zip(ours, theirs):
        if q.grad is None:
            assert p.grad is None
            continue
        assert p.grad.dtype == q.grad.dtype and p.grad.shape == q.grad.shape
        torch.testing.assert_close(p.grad.double(), q.grad.double(), rtol=rtol, atol=atol, equal_nan=True)


def mixed_specs(dtype, layout="contiguous"):
    return [(s, dtype, layout if len(s) > 0 and 0 not in s else "contiguous") for s in SHAPES]


# ---- signatures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DROP_INS)
def test_signature_matches_torch(name):
    def shape(function):  # names, kinds and defaults (annotations are strings on our side)
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    ours, theirs = shape(getattr(torchclip, name)), shape(getattr(torch.nn.utils, name))
    assert ours[: len(theirs)] == theirs
    # torchclip's additions (process_group) are keyword-only with a default: every torch call still fits
    assert all(kind == inspect.Parameter.KEYWORD_ONLY and default is None for _, kind, default in ours[len(theirs) :])


# ---- clip_grad_norm_ ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_grad_norm_matches_torch(device, dtype, norm_type, max_norm):
    # Positive orders only take tensors with elements when they have no identity (inf, negative p).
    specs = [s for s in mixed_specs(dtype) if norm_type > 0 and norm_type != math.inf or math.prod(s[0]) > 0]
    ours = make_params(specs, scale=0.1, device=device)
    theirs = clone_params(ours)
    before = [g.double() for g in grads_of(theirs)]
    reference = reference_norm(grads_of(theirs), norm_type)
    total = torchclip.clip_grad_norm_(ours, max_norm, norm_type)
    expected_total = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert total.dtype == expected_total.dtype and total.shape == expected_total.shape
    assert total.device == expected_total.device
    assert_norm_close(total, reference, f"{dtype} p={norm_type}")
    if math.isfinite(expected_total.item()) or not math.isfinite(reference):
        assert_grads_close(ours, theirs, CLIP_RTOL[dtype], atol=1e-7)
    else:
        # torch's norm overflowed its dtype and torch zeroed every gradient; torchclip clips by the
        # true norm, so the float64 formula is the oracle.
        coefficient = min(max_norm / (reference + 1e-6), 1.0)
        for g, b in zip(grads_of(ours), before):
            torch.testing.assert_close(g.double(), b * coefficient, rtol=CLIP_RTOL[dtype], atol=1e-7)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_clip_grad_norm_layouts(cpu_capability, layout, dtype):
    ours = make_params(mixed_specs(dtype, layout), scale=0.1)
    theirs = clone_params(ours)
    total = torchclip.clip_grad_norm_(ours, 0.3)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.3)
    torch.testing.assert_close(total, expected, rtol=NORM_RTOL[dtype] * 10, atol=0)
    assert_grads_close(ours, theirs, CLIP_RTOL[dtype], atol=1e-7)


def test_mixed_dtypes_in_one_call(cpu_capability):
    specs = [((50,), torch.float16), ((30, 3), torch.bfloat16), ((200,), torch.float32), ((9,), torch.float64)]
    ours = make_params(specs, scale=0.2)
    theirs = clone_params(ours)
    reference = reference_norm(grads_of(theirs), 2.0)
    total = torchclip.clip_grad_norm_(ours, 0.25)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.25)
    assert total.dtype == expected.dtype == torch.float64
    assert_close_rel(total.item(), reference, NORM_RTOL[torch.float32], "mixed")
    # torch rounds each per-tensor norm to its tensor's dtype first (fp16: 1e-3 off), so the float64
    # formula is the oracle for the gradients; torch's are within that rounding.
    coefficient = min(0.25 / (reference + 1e-6), 1.0)
    originals = make_params(specs, scale=0.2)
    for p, q, original in zip(ours, theirs, originals):
        expected = original.grad.double() * coefficient
        torch.testing.assert_close(p.grad.double(), expected, rtol=CLIP_RTOL[p.grad.dtype] / 4, atol=1e-7)
        torch.testing.assert_close(q.grad.double(), expected, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype_pair", [(torch.float16, torch.bfloat16), (torch.float16, torch.float32)])
def test_result_dtype_is_torchs_promotion(dtype_pair):
    params = make_params([((4,), dtype_pair[0]), ((4,), dtype_pair[1])])
    expected = torch.nn.utils.get_total_norm(grads_of(params))
    assert torchclip.get_total_norm(grads_of(params)).dtype == expected.dtype
    assert torchclip.clip_grad_norm_(params, 1e9).dtype == expected.dtype


def test_none_grads_are_skipped():
    ours = make_params([((5,), torch.float32)] * 6, none_every=2)
    theirs = clone_params(ours)
    torch.testing.assert_close(torchclip.clip_grad_norm_(ours, 0.1), torch.nn.utils.clip_grad_norm_(theirs, 0.1))
    assert_grads_close(ours, theirs, 2e-6)


def test_all_grads_none_gives_zero_norm():
    params = make_params([((5,), torch.float16)] * 3, none_every=1)
    total = torchclip.clip_grad_norm_(params, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert total.dtype == expected.dtype and total.item() == expected.item() == 0.0


def test_single_tensor_and_generator_inputs():
    ours = make_params([((40,), torch.float32)])
    theirs = clone_params(ours)
    torch.testing.assert_close(torchclip.clip_grad_norm_(ours[0], 0.1), torch.nn.utils.clip_grad_norm_(theirs[0], 0.1))
    assert_grads_close(ours, theirs, 2e-6)
    ours2 = make_params([((40,), torch.float32)] * 3)
    theirs2 = clone_params(ours2)
    torch.testing.assert_close(
        torchclip.clip_grad_norm_((p for p in ours2), 0.1), torch.nn.utils.clip_grad_norm_((p for p in theirs2), 0.1)
    )
    assert_grads_close(ours2, theirs2, 2e-6)


def test_empty_generator_warns_like_torch():
    with pytest.warns(UserWarning, match="empty generator") as ours:
        total = torchclip.clip_grad_norm_((p for p in []), 1.0)
    with pytest.warns(UserWarning, match="empty generator") as theirs:
        expected = torch.nn.utils.clip_grad_norm_((p for p in []), 1.0)
    assert str(ours[0].message) == str(theirs[0].message)
    assert ours[0].filename == theirs[0].filename == __file__  # attributed to the caller's line
    assert total.item() == expected.item() == 0.0 and total.dtype == expected.dtype


def test_empty_list_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torchclip.clip_grad_norm_([], 1.0).item() == 0.0


def test_deprecated_clip_grad_norm_warns_and_clips():
    ours = make_params([((40,), torch.float32)])
    theirs = clone_params(ours)
    with pytest.warns(FutureWarning, match="deprecated"):
        total = torchclip.clip_grad_norm(ours, 0.1)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(theirs, 0.1))
    assert_grads_close(ours, theirs, 2e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_error_if_nonfinite_raises_before_any_change(cpu_capability, bad):
    params = make_params([((10,), torch.float32), ((300,), torch.float32)])
    params[1].grad[7] = bad
    before = [p.grad.clone() for p in params]
    theirs = clone_params(params)
    with pytest.raises(RuntimeError) as ours_error:
        torchclip.clip_grad_norm_(params, 0.1, error_if_nonfinite=True)
    with pytest.raises(RuntimeError) as torch_error:
        torch.nn.utils.clip_grad_norm_(theirs, 0.1, error_if_nonfinite=True)
    assert str(ours_error.value).splitlines()[0] == str(torch_error.value).splitlines()[0]
    for p, b in zip(params, before):
        assert torch.equal(p.grad.nan_to_num(), b.nan_to_num())
    with pytest.raises(RuntimeError, match="non-finite"):
        torchclip.get_total_norm(grads_of(params), error_if_nonfinite=True)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_gradients_propagate_like_torch(bad):
    ours = make_params([((10,), torch.float32), ((300,), torch.float32)])
    ours[0].grad[3] = bad
    theirs = clone_params(ours)
    total = torchclip.clip_grad_norm_(ours, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.1)
    torch.testing.assert_close(total, expected, equal_nan=True)
    assert_grads_close(ours, theirs, 2e-6)


@pytest.mark.parametrize("norm_type", [math.inf, -math.inf, -1.0])
def test_empty_tensor_with_an_order_without_identity_raises(norm_type):
    tensors = [torch.ones(3), torch.empty(0)]
    with pytest.raises(RuntimeError, match="norm on an empty tensor because the operation does not have an identity"):
        torch.nn.utils.get_total_norm(tensors, norm_type)
    with pytest.raises(RuntimeError, match="norm on an empty tensor because the operation does not have an identity"):
        torchclip.get_total_norm(tensors, norm_type)


def test_norm_type_given_as_string_inf():
    grads = grads_of(make_params([((10,), torch.float32)]))
    torch.testing.assert_close(torchclip.get_total_norm(grads, "inf"), torch.nn.utils.get_total_norm(grads, "inf"))


@pytest.mark.parametrize("foreach", [None, True, False])
def test_foreach_argument_is_accepted_on_cpu(foreach):
    ours = make_params([((10,), torch.float32)] * 3)
    theirs = clone_params(ours)
    torch.testing.assert_close(
        torchclip.clip_grad_norm_(ours, 0.1, foreach=foreach),
        torch.nn.utils.clip_grad_norm_(theirs, 0.1, foreach=foreach),
    )
    torchclip.clip_grad_value_(ours, 0.01, foreach=foreach)
    torch.nn.utils.clip_grad_value_(theirs, 0.01, foreach=foreach)
    assert_grads_close(ours, theirs, 2e-6)


def test_meta_tensors_take_torchs_path():
    params = [torch.nn.Parameter(torch.empty(3, 4, device="meta")) for _ in range(2)]
    for p in params:
        p.grad = torch.empty(3, 4, device="meta")
    total = torchclip.clip_grad_norm_(params, 1.0)
    assert total.device.type == "meta" and total.shape == ()


def test_many_tiny_tensors(cpu_capability):
    ours = make_params([((100,), torch.float32)] * 10000, scale=0.01)
    theirs = clone_params(ours)
    reference = reference_norm(grads_of(theirs), 2.0)
    total = torchclip.clip_grad_norm_(ours, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert_norm_close(total, reference, "10,000 tensors")
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    assert_grads_close(ours, theirs, CLIP_RTOL[torch.float32])


def test_same_parameter_twice_behaves_as_torch():
    p = make_params([((10,), torch.float32)])[0]
    q = clone_params([p])[0]
    torch.testing.assert_close(torchclip.clip_grad_norm_([p, p], 0.1), torch.nn.utils.clip_grad_norm_([q, q], 0.1))
    torch.testing.assert_close(p.grad, q.grad)


def test_expanded_gradient_is_refused_before_any_change():
    params = make_params([((10,), torch.float32), ((4, 3), torch.float32)], scale=10.0)
    params[1].grad = torch.ones(1, 3).expand(4, 3)
    before = params[0].grad.clone()
    with pytest.raises(RuntimeError, match=r"tensors\[1\].*share memory"):
        torchclip.clip_grad_norm_(params, 0.1)
    with pytest.raises(RuntimeError, match=r"tensors\[1\].*share memory"):
        torchclip.clip_grad_value_(params, 0.1)
    assert torch.equal(params[0].grad, before)


def test_invalid_max_norm_raises_type_error_like_torch():
    params = make_params([((10,), torch.float32)])
    with pytest.raises((TypeError, ValueError)):
        torch.nn.utils.clip_grad_norm_(clone_params(params), "abc")
    with pytest.raises((TypeError, ValueError)):
        torchclip.clip_grad_norm_(params, "abc")


# ---- get_total_norm / clip_grads_with_norm_ -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_get_total_norm_matches_reference_and_torch(device, dtype, norm_type):
    grads = [device_tensor(s, dtype, i, device, 0.1) for i, s in enumerate(SHAPES) if math.prod(s) > 0]
    total = torchclip.get_total_norm(grads, norm_type)
    expected = torch.nn.utils.get_total_norm(grads, norm_type)
    assert total.dtype == expected.dtype and total.shape == expected.shape
    assert_norm_close(total, reference_norm(grads, norm_type), f"{dtype} p={norm_type}")


def test_get_total_norm_empty_and_single_tensor():
    assert torchclip.get_total_norm([]).item() == 0.0 and torchclip.get_total_norm([]).dtype == torch.float32
    t = make_tensor((33,), torch.float32, 0)
    torch.testing.assert_close(torchclip.get_total_norm(t), torch.nn.utils.get_total_norm(t))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_get_total_norm_of_tracked_tensors_is_not_differentiable_as_torchs(norm_type):
    # torch computes get_total_norm under no_grad; tensors that autograd tracks (which the fast path
    # leaves to the ops) give the same value, detached, not an error.
    leaves = [make_tensor((n,), torch.float32, i).requires_grad_() for i, n in enumerate([5, 40, 300])]
    tracked = [t * 2 for t in leaves]
    ours = torchclip.get_total_norm(tracked, norm_type)
    theirs = torch.nn.utils.get_total_norm(tracked, norm_type)
    assert not ours.requires_grad and not theirs.requires_grad
    assert_norm_close(ours, reference_norm(tracked, norm_type), f"p={norm_type}")


@pytest.mark.parametrize("total_dtype", [torch.float32, torch.float16, torch.float64])
def test_clip_grads_with_norm_uses_the_given_norm(cpu_capability, total_dtype):
    ours = make_params(mixed_specs(torch.float32), scale=0.1)
    theirs = clone_params(ours)
    total = torch.tensor(7.5, dtype=total_dtype)
    torchclip.clip_grads_with_norm_(ours, 1.0, total)
    torch.nn.utils.clip_grads_with_norm_(theirs, 1.0, total)
    assert_grads_close(ours, theirs, 0.0)  # same coefficient, same float32 multiply: bit-identical


def test_clip_grads_with_norm_skips_coefficient_one():
    ours = make_params([((64,), torch.float32)])
    before = ours[0].grad.clone()
    torchclip.clip_grads_with_norm_(ours, 10.0, torch.tensor(1.0))
    assert torch.equal(ours[0].grad, before)


@cuda_only
def test_cuda_drop_ins_never_wait_for_the_device_and_capture():
    params = device_params(torch.float32, "cuda", seed=57, scale=3.0)
    with no_host_sync("cuda"):
        torchclip.clip_grad_norm_(params, 1.0)
        torchclip.clip_grad_value_(params, 0.5)
        torchclip.get_total_norm([p.grad for p in params])
        torchclip.ClipGradByGlobalNorm(1.0)(params)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up off the capture, as torch's graph docs ask
        torchclip.clip_grad_norm_(params, 1.0)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        total = torchclip.clip_grad_norm_(params, 1.0)
    for p in params:
        p.grad.mul_(10.0)
    graph.replay()
    torch.cuda.synchronize()
    assert abs(total.item() - 10.0) < 1e-3  # the replayed norm of the rescaled (norm 1) gradients


# ---- clip_grad_value_ -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("clip_value", [0.0, 0.05, 1e-3, 2.0, math.inf, -0.5])
def test_clip_grad_value_is_bit_identical_to_torch(device, dtype, layout, clip_value):
    ours = make_params(mixed_specs(dtype, layout), device=device)
    ours[3].grad[2] = math.nan
    theirs = clone_params(ours)
    torchclip.clip_grad_value_(ours, clip_value)
    torch.nn.utils.clip_grad_value_(theirs, clip_value)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad.nan_to_num(7.0), q.grad.nan_to_num(7.0)), (dtype, layout, clip_value)
        assert torch.equal(p.grad.isnan(), q.grad.isnan())


def test_clip_grad_value_nan_bound_makes_everything_nan_like_torch():
    ours = make_params([((20,), torch.float32)])
    theirs = clone_params(ours)
    torchclip.clip_grad_value_(ours, math.nan)
    torch.nn.utils.clip_grad_value_(theirs, math.nan)
    assert ours[0].grad.isnan().all() and theirs[0].grad.isnan().all()


def test_clip_grad_value_with_no_gradients_does_nothing():
    params = make_params([((5,), torch.float32)] * 2, none_every=1)
    assert torchclip.clip_grad_value_(params, 1.0) is None  # torch raises an internal error here
    assert torchclip.clip_grad_value_([], 1.0) is None


# ---- hypothesis: random lists against torch and the fp64 reference --------------------------------

shape_strategy = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
spec_strategy = st.tuples(shape_strategy, st.sampled_from(DTYPES), st.sampled_from(["contiguous", "transposed"]))


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(spec_strategy, min_size=1, max_size=12),
    norm_type=st.sampled_from(FAST_NORM_TYPES + [0.0, 3.0]),
    max_norm=st.floats(1e-3, 10.0),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_clip_grad_norm(specs, norm_type, max_norm, scale, seed):
    specs = [(s, d, lay if len(s) > 1 else "contiguous") for s, d, lay in specs]
    if norm_type == math.inf:
        specs = [s for s in specs if math.prod(s[0]) > 0] or [((1,), torch.float32)]
    ours = make_params(specs, seed=seed, scale=scale)
    theirs = clone_params(ours)
    reference = reference_norm(grads_of(theirs), norm_type)
    inputs = grads_of(theirs)
    total = torchclip.clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert total.dtype == expected.dtype
    if math.isfinite(expected.item()):
        assert_norm_close(total, reference, "total norm", inputs)
        rtol = max(CLIP_RTOL[p.grad.dtype] for p in ours if p.grad is not None)
        assert_grads_close(ours, theirs, rtol, atol=max(1e-6 * scale, 1.2e-7))  # 2 float16 subnormal ulps


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(spec_strategy, min_size=1, max_size=12), clip_value=st.floats(0, 3.0), seed=st.integers(0, 2**16))
def test_hypothesis_clip_grad_value(specs, clip_value, seed):
    ours = make_params(specs, seed=seed)
    theirs = clone_params(ours)
    torchclip.clip_grad_value_(ours, clip_value)
    torch.nn.utils.clip_grad_value_(theirs, clip_value)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad)


# ---- patch ----------------------------------------------------------------------------------------


def test_patch_context_manager_installs_and_restores():
    originals = {name: getattr(torch.nn.utils, name) for name in DROP_INS}
    with torchclip.patch():
        for name in DROP_INS:
            assert getattr(torch.nn.utils, name) is getattr(torchclip, name)
        assert torch.nn.utils.clip_grad.clip_grad_norm_ is torchclip.clip_grad_norm_
        params = make_params([((10,), torch.float32)])
        torch.nn.utils.clip_grad_norm_(params, 0.1)
        assert abs(params[0].grad.norm().item() - 0.1) < 1e-5
    for name in DROP_INS:
        assert getattr(torch.nn.utils, name) is originals[name]


def test_patched_functions_say_they_are_torchclips():
    """The documented check (README): the patched names' module, and their help's first line."""
    with torchclip.patch():
        for name in DROP_INS:
            function = getattr(torch.nn.utils, name)
            assert function.__module__ == "torchclip.clip_grad"
            assert function.__doc__.startswith(f"torchclip's {name}: "), function.__doc__[:80]
    assert torch.nn.utils.clip_grad_norm_.__module__.startswith("torch.")


def test_patch_undo():
    original = torch.nn.utils.clip_grad_value_
    handle = torchclip.patch()
    assert torch.nn.utils.clip_grad_value_ is torchclip.clip_grad_value_
    handle.undo()
    assert torch.nn.utils.clip_grad_value_ is original
