"""Every row of the bad-input table (docs/bad-input.md): the error (type and words) and gradients unchanged."""

import math
import threading

import pytest
import torch
from testing import make_params

import torchclip
from torchclip.clip_grad import NotATensorError


def fresh():
    return make_params([((5,), torch.float32), ((3, 4), torch.float32), ((7,), torch.float32)], scale=3.0)


def snapshot(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def assert_unchanged(params, before):
    for p, b in zip(params, before):
        assert (p.grad is None and b is None) or torch.equal(p.grad.nan_to_num(), b.nan_to_num())


def wrong_shape(params):
    params[1].grad = torch.zeros(4, 3)  # torch refuses `p.grad = ...` of another shape; .data does not
    return params


def int_grad(params):
    params[2].grad = torch.ones(7, dtype=torch.int64)
    return params


ROWS = [
    # (description, setup(params) -> params, call(params), error, message)
    (
        "norm_type not a number",
        None,
        lambda ps: torchclip.clip_grad_norm_(ps, 1.0, norm_type="two"),
        ValueError,
        "norm_type must be a number, got 'two'",
    ),
    (
        "max_norm not a number",
        None,
        lambda ps: torchclip.clip_grad_norm_(ps, None),
        TypeError,
        "max_norm must be a number, got None",
    ),
    (
        "clip_value not a number",
        None,
        lambda ps: torchclip.clip_grad_value_(ps, "big"),
        ValueError,
        "clip_value must be a number, got 'big'",
    ),
    (
        "an item that is not a tensor",
        lambda ps: ps + [3],
        lambda ps: torchclip.clip_grad_norm_(ps, 1.0),
        NotATensorError,
        r"parameters\[3\] must be a Tensor, got int 3",
    ),
    (
        "(name, parameter) pairs, as model.named_parameters() yields",
        None,
        lambda ps: torchclip.clip_grad_norm_([(f"{i}.weight", p) for i, p in enumerate(ps)], 1.0),
        NotATensorError,
        (
            r"parameters\[0\] is \('0\.weight', Parameter\), a \(name, parameter\) pair as "
            r"model\.named_parameters\(\) yields, not a Tensor; pass model\.parameters\(\)$"
        ),
    ),
    (
        "exact=True with an order it cannot make exact",
        None,
        lambda ps: torchclip.clip_grad_norm_(ps, 1.0, norm_type=3, exact=True),
        ValueError,
        r"exact=True: norm_type=3 has no exact norm; exact norms are of order 1 and 2",
    ),
    (
        "a non-tensor in get_total_norm",
        None,
        lambda ps: torchclip.get_total_norm([p.grad for p in ps] + ["x"]),
        NotATensorError,
        r"tensors\[3\] must be a Tensor, got str",
    ),
    (
        "a gradient of another shape",
        wrong_shape,
        lambda ps: torchclip.clip_grad_norm_(ps, 1.0),
        ValueError,
        r"parameters\[1\] has shape \(3, 4\) but its gradient has shape \(4, 3\)",
    ),
    (
        "an integer gradient, norm",
        int_grad,
        lambda ps: torchclip.clip_grad_norm_(ps, 1.0),
        RuntimeError,
        r"tensors\[2\] has dtype Long; a norm needs a floating point or complex dtype",
    ),
    (
        "a bool gradient, value clip",
        lambda ps: [*ps[:2], _bool_param()],
        lambda ps: torchclip.clip_grad_value_(ps, 1.0),
        RuntimeError,
        r"tensors\[2\] has dtype bool; clamping needs a numeric dtype",
    ),
    (
        "a complex gradient, value clip",
        lambda ps: [*ps[:2], _complex_param()],
        lambda ps: torchclip.clip_grad_value_(ps, 1.0),
        NotImplementedError,
        "clamping is not defined for complex numbers",
    ),
    (
        "an expanded (overlapping) gradient",
        lambda ps: [*ps[:2], _expanded_param()],
        lambda ps: torchclip.clip_grad_norm_(ps, 0.1),
        RuntimeError,
        "share memory",
    ),
    (
        "non-finite norm with error_if_nonfinite",
        lambda ps: _with_nan(ps),
        lambda ps: torchclip.clip_grad_norm_(ps, 0.1, error_if_nonfinite=True),
        RuntimeError,
        "non-finite",
    ),
    (
        "ClipGradByGlobalNorm clip_norm <= 0",
        None,
        lambda ps: torchclip.ClipGradByGlobalNorm(-1.0)(ps),
        ValueError,
        "clip_norm must be a finite number > 0, got -1.0",
    ),
    (
        "ClipGradByNorm clip_norm NaN",
        None,
        lambda ps: torchclip.ClipGradByNorm(math.nan)(ps),
        ValueError,
        "clip_norm must be a finite number > 0, got nan",
    ),
    (
        "ClipGradByValue min > max",
        None,
        lambda ps: torchclip.ClipGradByValue(1.0, 2.0)(ps),
        ValueError,
        "min must be <= max, got min=2.0, max=1.0",
    ),
    (
        "ClipGradByValue max <= 0 without min",
        None,
        lambda ps: torchclip.ClipGradByValue(-1.0)(ps),
        ValueError,
        "max must be > 0 when min is None",
    ),
    (
        "need_clip not callable",
        None,
        lambda ps: torchclip.GradientClipByNorm(1.0, need_clip=1)(ps),
        TypeError,
        "need_clip must be a function",
    ),
]


def _bool_param():
    p = torch.nn.Parameter(torch.zeros(7))
    p.grad = torch.zeros(7)
    p.grad.data = torch.ones(7, dtype=torch.bool)
    return p


def _complex_param():
    p = torch.nn.Parameter(torch.zeros(7, dtype=torch.complex64))
    p.grad = torch.ones(7, dtype=torch.complex64)
    return p


def _expanded_param():
    p = torch.nn.Parameter(torch.zeros(4, 3))
    p.grad = torch.ones(1, 3).expand(4, 3)
    return p


def _with_nan(params):
    params[0].grad[1] = math.nan
    return params


def _apply(setup, params):
    if setup is None:
        return params
    if setup in (wrong_shape, int_grad):  # these replace .data, which torch's setter allows
        if setup is wrong_shape:
            params[1].grad.data = torch.zeros(4, 3)
        else:
            params[2].grad.data = torch.ones(7, dtype=torch.int64)
        return params
    return setup(params)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_row(row):
    _, setup, call, error, message = row
    params = _apply(setup, fresh())
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    before = snapshot(tensors)
    with pytest.raises(error, match=message):
        call(params)
    assert_unchanged(tensors, before)


def _int_grads(params, dtype):
    params[2].grad.data = torch.ones(7, dtype=dtype)
    return params


# Bad input that torch.nn.utils refuses too: (description, setup(params) -> params, call(clip_grad, params)), where
# clip_grad is torch.nn.utils or torchclip. Which class torch raises depends on its release (2.15 made an integer
# or bool norm a NotImplementedError), so the oracle is the torch installed beside the suite.
REFUSED_BY_TORCH_TOO = [
    ("an integer gradient, norm", lambda ps: _int_grads(ps, torch.int64), lambda m, ps: m.clip_grad_norm_(ps, 1.0)),
    ("a bool gradient, norm", lambda ps: _int_grads(ps, torch.bool), lambda m, ps: m.clip_grad_norm_(ps, 1.0)),
    (
        "an integer tensor, get_total_norm",
        lambda ps: _int_grads(ps, torch.int32),
        lambda m, ps: m.get_total_norm([p.grad for p in ps]),
    ),
    (
        "an integer gradient, inf norm",
        lambda ps: _int_grads(ps, torch.int64),
        lambda m, ps: m.clip_grad_norm_(ps, 1.0, norm_type=math.inf),
    ),
    (
        "a complex gradient, value clip",
        lambda ps: [*ps[:2], _complex_param()],
        lambda m, ps: m.clip_grad_value_(ps, 1.0),
    ),
    (
        "non-finite norm with error_if_nonfinite",
        _with_nan,
        lambda m, ps: m.clip_grad_norm_(ps, 0.1, error_if_nonfinite=True),
    ),
    (
        "an empty gradient, inf norm",
        lambda ps: [*ps, _empty_param()],
        lambda m, ps: m.clip_grad_norm_(ps, 1.0, norm_type=math.inf),
    ),
    ("an item that is not a tensor", lambda ps: [*ps, 3], lambda m, ps: m.clip_grad_norm_(ps, 1.0)),
]


def _empty_param():
    p = torch.nn.Parameter(torch.zeros(0))
    p.grad = torch.zeros(0)
    return p


@pytest.mark.parametrize("row", REFUSED_BY_TORCH_TOO, ids=[r[0] for r in REFUSED_BY_TORCH_TOO])
def test_drop_ins_raise_what_the_installed_torch_raises(row):
    _, setup, call = row
    with pytest.raises(Exception) as theirs:  # the class torch raises is what this test reads
        call(torch.nn.utils, setup(fresh()))
    params = setup(fresh())
    tensors = [p for p in params if isinstance(p, torch.Tensor)]
    before = snapshot(tensors)
    with pytest.raises(type(theirs.value)):
        call(torchclip, params)
    assert_unchanged(tensors, before)


def test_not_a_tensor_error_is_also_what_torch_raises():
    with pytest.raises(AttributeError):
        torchclip.clip_grad_norm_([3], 1.0)
    with pytest.raises(TypeError):
        torchclip.clip_grad_norm_([3], 1.0)


@pytest.mark.parametrize(
    "max_norm, check",
    [
        (-1.0, lambda before, after, scale: torch.allclose(after, -before * scale)),  # torch flips (pytorch#31367)
        (math.nan, lambda before, after, scale: after.isnan().all()),
        (math.inf, lambda before, after, scale: torch.equal(after, before)),
    ],
)
def test_values_torch_accepts_keep_torchs_meaning(max_norm, check):
    ours, theirs = fresh(), fresh()
    torchclip.clip_grad_norm_(ours, max_norm)
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True, rtol=1e-5, atol=0)
    before = fresh()[0].grad
    total = torchclip.get_total_norm([p.grad for p in fresh()]).item()
    assert check(before, ours[0].grad, abs(max_norm) / (total + 1e-6) if math.isfinite(max_norm) else 1.0)


def test_negative_clip_value_sets_every_gradient_to_it_as_torch_does():
    ours, theirs = fresh(), fresh()
    torchclip.clip_grad_value_(ours, -0.5)
    torch.nn.utils.clip_grad_value_(theirs, -0.5)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad) and (p.grad == -0.5).all()


# ---- threads and memory ----------------------------------------------------------------------------


def test_concurrent_calls_from_python_threads_match_serial_calls():
    def parameter_sets():
        return [make_params([((1000,), torch.float32)] * 50, seed=100 * k, scale=0.1) for k in range(4)]

    def work(params, results, k):
        for _ in range(20):  # later calls find the gradients (almost) clipped already
            results[k] = torchclip.clip_grad_norm_(params, 0.5).item()

    serial_sets, serial_results = parameter_sets(), [None] * 4
    for k, params in enumerate(serial_sets):
        work(params, serial_results, k)
    threaded_sets, threaded_results = parameter_sets(), [None] * 4
    threads = [
        threading.Thread(target=work, args=(params, threaded_results, k)) for k, params in enumerate(threaded_sets)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert threaded_results == serial_results
    for serial, threaded in zip(serial_sets, threaded_sets):
        for p, q in zip(serial, threaded):
            assert torch.equal(p.grad, q.grad)


def test_set_num_threads_one_gives_the_same_bits():
    params = make_params([((300_000,), torch.float32)] * 4, scale=0.1)
    torch.set_num_threads(1)
    one = torchclip.get_total_norm([p.grad for p in params]).item()
    torch.set_num_threads(2)
    assert torchclip.get_total_norm([p.grad for p in params]).item() == one


def test_clipping_allocates_no_memory_proportional_to_the_gradients():
    import resource

    params = make_params([((4_000_000,), torch.float32)] * 25, scale=0.1)  # 400 MB of gradients
    torchclip.clip_grad_norm_(params, 0.5)  # warm up: code pages, thread pool
    torchclip.clip_grad_value_(params, 0.01)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for _ in range(3):
        torchclip.clip_grad_norm_(params, 0.4)
        torchclip.clip_grad_value_(params, 0.005)
        torchclip.ClipGradByGlobalNorm(0.3)(params)
        torchclip.ClipGradByNorm(0.01)(params)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 8 * 1024, f"peak memory grew by {grown_kib} KiB while clipping 400 MB of gradients"


def _model():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


# Calls given a tensor (or a pair holding one) where a number, a clip or a flag goes: (description, call). Each
# raises, and its message names what it got by type, shape and dtype, never by the tensor's printed contents.
_MATRIX = torch.randn(64, 64)
GIVEN_A_TENSOR = [
    ("clip_grad_norm_ max_norm", lambda ps: torchclip.clip_grad_norm_(ps, _MATRIX)),
    ("clip_grad_norm_ norm_type", lambda ps: torchclip.clip_grad_norm_(ps, 1.0, norm_type=_MATRIX)),
    ("clip_grad_value_ clip_value", lambda ps: torchclip.clip_grad_value_(ps, _MATRIX)),
    ("get_total_norm norm_type", lambda ps: torchclip.get_total_norm([p.grad for p in ps], _MATRIX)),
    ("get_total_norm a pair", lambda ps: torchclip.get_total_norm([("w", _MATRIX)])),
    ("clip_grad_norm_ a list", lambda ps: torchclip.clip_grad_norm_([[_MATRIX]], 1.0)),
    ("clip_grads_with_norm_ total_norm", lambda ps: torchclip.clip_grads_with_norm_(ps, 1.0, _MATRIX)),
    ("named_parameters()", lambda ps: torchclip.clip_grad_norm_(_model().named_parameters(), 1.0)),
    ("ClipGradByGlobalNorm clip_norm", lambda ps: torchclip.ClipGradByGlobalNorm(_MATRIX)),
    ("ClipGradByNorm clip_norm, 0-d", lambda ps: torchclip.ClipGradByNorm(torch.tensor(-1.0))),
    ("ClipGradByValue max", lambda ps: torchclip.ClipGradByValue(_MATRIX)),
    ("ClipGradByValue min > max, 0-d", lambda ps: torchclip.ClipGradByValue(torch.tensor(1.0), torch.tensor(2.0))),
    ("ClipGradByGlobalNorm nonfinite", lambda ps: torchclip.ClipGradByGlobalNorm(1.0, nonfinite=_MATRIX)),
    ("ClipGradByGlobalNorm group_name", lambda ps: torchclip.ClipGradByGlobalNorm(1.0, group_name=_MATRIX)),
    ("a clip given a pair of tensors", lambda ps: torchclip.ClipGradByGlobalNorm(1.0)([(ps[0], ps[0].grad), _MATRIX])),
    ("a clip given a non-tensor pair", lambda ps: torchclip.ClipGradByNorm(1.0)([(_MATRIX, "grad")])),
    ("ClipGradByZScore alpha", lambda ps: torchclip.ClipGradByZScore(alpha=_MATRIX)),
    ("ClipGradByQuantile quantile", lambda ps: torchclip.ClipGradByQuantile(quantile=_MATRIX)),
    ("ClipGradByNormEMA beta", lambda ps: torchclip.ClipGradByNormEMA(beta=_MATRIX)),
    ("ClipGradByUnitwiseNorm norm_type", lambda ps: torchclip.ClipGradByUnitwiseNorm(norm_type=_MATRIX)),
    ("SkipStepOnSpike clip", lambda ps: torchclip.SkipStepOnSpike(clip=_MATRIX)),
    ("set_gradient_clip clip", lambda ps: torchclip.set_gradient_clip(_MATRIX)),
    ("an optimizer's grad_clip", lambda ps: torchclip.optim.SGD(ps, lr=0.1, grad_clip=_MATRIX)),
    ("clip_by_value bound", lambda ps: torchclip.clip_by_value(ps[0].grad, _MATRIX, 1.0)),
    ("clip_by_norm clip_norm", lambda ps: torchclip.clip_by_norm(ps[0].grad, _MATRIX)),
]


@pytest.mark.parametrize("row", GIVEN_A_TENSOR, ids=[r[0] for r in GIVEN_A_TENSOR])
def test_no_error_message_prints_a_tensors_contents(row):
    _, call = row
    params = fresh()
    before = snapshot(params)
    with pytest.raises(Exception) as raised:
        call(params)
    message = str(raised.value)
    assert "tensor(" not in message and "\n" not in message, message
    assert "Tensor" in message or "tensor" in message, message  # it still says what it got
    assert_unchanged(params, before)


def test_a_number_given_as_a_0d_tensor_is_named_by_its_value():
    with pytest.raises(ValueError, match=r"got Tensor of shape \(\) and dtype torch\.float32 holding -1\.0$"):
        torchclip.ClipGradByNorm(torch.tensor(-1.0))


@pytest.mark.parametrize("norm_type", [3, 0.5, "3"])
@pytest.mark.parametrize(
    "call",
    [
        lambda ps, p: torchclip.get_total_norm([q.grad for q in ps], p, exact=True),
        lambda ps, p: torchclip.clip_grad_norm_(ps, 0.1, p, exact=True),
        lambda ps, p: torchclip.grad_norm(torch.nn.ParameterList(ps), p, exact=True),
        lambda ps, p: torchclip.ClipGradByUnitwiseNorm(norm_type=float(p) if isinstance(p, str) else p, exact=True),
    ],
    ids=["get_total_norm", "clip_grad_norm_", "grad_norm", "ClipGradByUnitwiseNorm"],
)
def test_exact_true_refuses_an_order_it_cannot_make_exact(call, norm_type):
    params = fresh()
    before = snapshot(params)
    with pytest.raises(
        ValueError, match=r"exact=True: norm_type=\S+ has no exact norm; exact norms are of order 1 and 2"
    ):
        call(params, norm_type)
    assert_unchanged(params, before)


@pytest.mark.parametrize("norm_type", [1, 2.0, "inf", math.inf, -math.inf, 0])
def test_exact_true_takes_the_exact_orders(norm_type):
    params = fresh()
    expected = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    torch.testing.assert_close(torchclip.get_total_norm([p.grad for p in params], norm_type, exact=True), expected)


def test_the_process_setting_leaves_other_orders_as_they_are():
    params = fresh()
    expected = torch.nn.utils.get_total_norm([p.grad for p in params], 3)
    before = torchclip.set_exact_norm(True)
    try:
        torch.testing.assert_close(torchclip.get_total_norm([p.grad for p in params], 3), expected)
    finally:
        torchclip.set_exact_norm(before)


# ---- a clip handed the gradients instead of the parameters ------------------------------------------

CLIPS = [
    lambda: torchclip.ClipGradByGlobalNorm(1.0),
    lambda: torchclip.ClipGradByNorm(1.0),
    lambda: torchclip.ClipGradByValue(1.0),
    lambda: torchclip.GradientClipByGlobalNorm(1.0, need_clip=lambda p: True),  # (a predicate: the Python walk)
    lambda: torchclip.ClipGradByZScore(),
    lambda: torchclip.ClipGradByQuantile(),
    lambda: torchclip.ClipGradByUnitwiseNorm(),
]


@pytest.mark.parametrize("make_clip", CLIPS)
def test_a_clip_given_gradients_warns_with_the_fix_and_changes_nothing(make_clip):
    params = fresh()
    grads = [p.grad for p in params]
    before = [g.clone() for g in grads]
    with pytest.warns(UserWarning, match=r"look like gradients.*Pass the parameters, e\.g\. model\.parameters\(\)"):
        make_clip()(grads)
    assert all(torch.equal(g, b) for g, b in zip(grads, before))


@pytest.mark.parametrize("make_clip", CLIPS)
def test_a_clip_given_parameters_does_not_warn(make_clip, recwarn):
    with_grads = fresh()
    frozen = [torch.nn.Parameter(torch.ones(3), requires_grad=False) for _ in range(2)]  # a frozen model's
    no_grad_yet = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]  # before the first backward
    for params in (with_grads, frozen, no_grad_yet, [], torch.nn.Linear(2, 2)):
        make_clip()(params)
    make_clip()([(p, p.grad) for p in with_grads])
    assert not [w for w in recwarn if "look like gradients" in str(w.message)]


def test_the_drop_ins_keep_torchs_silence_for_gradients(recwarn):
    """torch's clip_grad_norm_ given gradients (no .grad of their own) returns a zero norm, silently."""
    grads = [p.grad for p in fresh()]
    ours, theirs = torchclip.clip_grad_norm_(grads, 1.0), torch.nn.utils.clip_grad_norm_(grads, 1.0)
    assert torch.equal(ours, theirs) and ours.item() == 0.0
    assert not [w for w in recwarn if "look like gradients" in str(w.message)]
