"""Issue 34, items 5 and 10: what a clip is called with, and every public function's bad arguments.

A clip called with anything but parameters or (param, grad) pairs raises a TypeError naming what it got
and what it takes; a bad argument raises an error naming the argument and the value. Either way nothing
changes: weights, gradients, need_clip marks, set_gradient_clip's clips, a clip's state.
"""

import inspect
import math
import re

import pytest
import torch

import torchclip
from torchclip import marks as clip_module
from torchclip import optim, tf_names

CLIPS = {
    "ClipGradByGlobalNorm": lambda: torchclip.ClipGradByGlobalNorm(0.1),
    "ClipGradByNorm": lambda: torchclip.ClipGradByNorm(0.1),
    "ClipGradByValue": lambda: torchclip.ClipGradByValue(0.01),
    "GradientClipByGlobalNorm": lambda: torchclip.GradientClipByGlobalNorm(0.1, need_clip=lambda p: True),
    "GradientClipByNorm": lambda: torchclip.GradientClipByNorm(0.1),
    "GradientClipByValue": lambda: torchclip.GradientClipByValue(0.01),
    "ClipGradByZScore": lambda: torchclip.ClipGradByZScore(warmup_steps=1, max_grad_norm=0.1),
    "ClipGradByQuantile": lambda: torchclip.ClipGradByQuantile(global_threshold=True),
    "ClipGradByNormEMA": lambda: torchclip.ClipGradByNormEMA(warmup_steps=1, lambda_abs=0.1),
    "SkipStepOnSpike": lambda: torchclip.SkipStepOnSpike(torchclip.ClipGradByNorm(0.1), window=2),
    "ClipGradByUnitwiseNorm": lambda: torchclip.ClipGradByUnitwiseNorm(),
}


def model_with_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()
    return model


def snapshot(model):
    """Everything a bad call must leave as it was."""
    return [
        (p.detach().clone(), p.grad.clone(), getattr(p, "need_clip", None), getattr(p, "gradient_clip_attr", None))
        for p in model.parameters()
    ], clip_module._default_clip


def assert_unchanged(model, before):
    params, default_clip = before
    for p, (weight, grad, need_clip, clip) in zip(model.parameters(), params):
        assert torch.equal(p.detach(), weight), "a weight was written"
        assert torch.equal(p.grad, grad), "a gradient was written"
        assert getattr(p, "need_clip", None) is need_clip and getattr(p, "gradient_clip_attr", None) is clip
    assert clip_module._default_clip is default_clip


def state_of(clip):
    return {k: v.clone() for k, v in clip.state_dict().items()} if hasattr(clip, "state_dict") else {}


# ---- item 5: what a clip is called with ------------------------------------------------------------

# (description, what the clip is called with, a regex of the TypeError: what it got)
MISUSES = [
    (
        "named_parameters()",
        lambda m: m.named_parameters(),
        r"item 0 is \('0\.weight', Parameter\), a \(name, parameter\) pair as model\.named_parameters\(\) yields",
    ),
    ("list(named_parameters())", lambda m: list(m.named_parameters()), r"item 0 is \('0\.weight', Parameter\)"),
    ("dict(named_parameters())", lambda m: dict(m.named_parameters()), r"got a mapping \(dict of 4 entries"),
    ("state_dict()", lambda m: m.state_dict(), r"got a mapping \(OrderedDict of 4 entries"),
    ("named_parameters().items() of a dict", lambda m: dict(m.named_parameters()).items(), r"item 0 is \('0\.weight'"),
    ("(p, p) pairs", lambda m: [(p, p) for p in m.parameters()], r"item 0's grad is the parameter itself"),
    (
        "(p, p.detach()) pairs",
        lambda m: [(p, p.detach()) for p in m.parameters()],
        r"item 0's grad lies in the parameter's own memory",
    ),
    (
        "(p, a view of p) pairs",
        lambda m: [(p, p.data[:1]) for p in m.parameters()],
        r"item 0's grad lies in the parameter's own memory",
    ),
    ("two parameters side by side", lambda m: [tuple(m[0].parameters())], r"item 0's grad is an nn\.Parameter"),
    ("a str", lambda m: "0.weight", r"got str '0\.weight'"),
    ("None", lambda m: None, r"got None"),
    ("an int", lambda m: 3, r"got int 3"),
    ("triples", lambda m: [(p, p.grad, 1.0) for p in m.parameters()], r"item 0 is a tuple of 3 items"),
    (
        "parameters then a pair",
        lambda m: [m[0].weight, (m[0].bias, m[0].bias.grad)],
        r"item 1 is tuple \(Parameter, Tensor\), not a tensor",
    ),
    (
        "a pair then a parameter",
        lambda m: [(m[0].bias, m[0].bias.grad), m[0].weight],
        r"item 0 is a \(param, grad\) pair but item 1 is Parameter of shape \(4, 3\)",
    ),
    (
        "a pair whose grad is a str",
        lambda m: [(p, "grad") for p in m.parameters()],
        r"item 0's grad must be a Tensor or None, got str 'grad'",
    ),
    (
        "a pair whose param is a float",
        lambda m: [(1.0, p.grad) for p in m.parameters()],
        r"item 0's param must be a Tensor, got float 1\.0",
    ),
    ("a list holding a str", lambda m: [*m.parameters(), "bias"], r"item 4 is str 'bias', not a tensor"),
]


@pytest.mark.parametrize("misuse", MISUSES, ids=[m[0] for m in MISUSES])
@pytest.mark.parametrize("name", CLIPS)
def test_a_clip_called_with_anything_else_raises_and_writes_nothing(name, misuse):
    _, given, message = misuse
    model = model_with_grads()
    clip = CLIPS[name]()
    clip(list(model.parameters()))  # a first call: the stateful clips have state to keep
    before, state = snapshot(model), state_of(clip)
    with pytest.raises(TypeError, match=message) as raised:
        clip(given(model))
    assert str(raised.value).startswith(name)
    assert re.search(r"it takes|must be a Tensor", str(raised.value))  # and what it accepts
    assert_unchanged(model, before)
    for key, value in state_of(clip).items():
        torch.testing.assert_close(value, state[key], equal_nan=True, rtol=0, atol=0)


def test_a_non_tensor_item_is_also_the_attribute_error_it_was():
    # NotATensorError: code that caught the AttributeError of `"x".grad` keeps working.
    with pytest.raises(AttributeError, match="item 0 is str"):
        torchclip.ClipGradByNorm(1.0)(["x"])


# The forms a clip takes, each against clip(list(model.parameters())) on a twin model.
FORMS = {
    "a Module": lambda m: m,
    "model.parameters()": lambda m: m.parameters(),
    "a tuple": lambda m: tuple(m.parameters()),
    "a generator": lambda m: (p for p in m.parameters()),
    "the values of dict(named_parameters())": lambda m: dict(m.named_parameters()).values(),
    "(param, grad) pairs": lambda m: [(p, p.grad) for p in m.parameters()],
    "(param, grad) lists": lambda m: [[p, p.grad] for p in m.parameters()],
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", CLIPS)
def test_every_call_form_clips_as_the_parameter_list(name, form):
    model, twin = model_with_grads(), model_with_grads()
    weights = [p.detach().clone() for p in model.parameters()]
    CLIPS[name]()(FORMS[form](model))
    CLIPS[name]()(list(twin.parameters()))
    for p, q, weight in zip(model.parameters(), twin.parameters(), weights):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
        assert torch.equal(p.detach(), weight)


def test_one_tensor_is_one_parameter():
    model, twin = model_with_grads(), model_with_grads()
    torchclip.ClipGradByNorm(0.1)(model[0].weight)
    torchclip.ClipGradByNorm(0.1)([twin[0].weight])
    assert torch.equal(model[0].weight.grad, twin[0].weight.grad)
    assert torch.equal(model[0].bias.grad, twin[0].bias.grad)  # untouched in both


def test_pairs_of_parameters_without_gradients_stay_pairs():
    model = model_with_grads()
    pairs = [(p, None) for p in model.parameters()]
    assert torchclip.ClipGradByGlobalNorm(0.1)(pairs) == []


# ---- item 10: every public function's bad arguments -----------------------------------------------


def _optimizer_rows():
    rows = []
    for name in ["SGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop"]:
        make = getattr(optim, name)
        rows += [
            (
                f"optim.{name}",
                f"optim.{name} clipnorm='big'",
                lambda m, make=make: make(m.parameters(), clipnorm="big"),
                TypeError,
                r"clipnorm must be a number, got 'big'",
            ),
            (
                f"optim.{name}",
                f"optim.{name} global_clipnorm=True",
                lambda m, make=make: make(m.parameters(), global_clipnorm=True),
                TypeError,
                r"global_clipnorm must be a number, got True",
            ),
            (
                f"optim.{name}",
                f"optim.{name} clipvalue=-1",
                lambda m, make=make: make(m.parameters(), clipvalue=-1),
                ValueError,
                r"clipvalue .* got -1",
            ),
        ]
    return rows


def _grads(m):
    return [p.grad for p in m.parameters()]


T = torch.tensor([3.0, -4.0])

# (public name, description, call(model), exception, regex naming the argument and the bad value)
ROWS = [
    # torch.nn.utils drop-ins: torch's exception classes (test_bad_input compares them with torch's)
    (
        "clip_grad_norm_",
        "norm_type 'fro'",
        lambda m: torchclip.clip_grad_norm_(m.parameters(), 1.0, "fro"),
        ValueError,
        r"norm_type must be a number, got 'fro'",
    ),
    (
        "clip_grad_norm_",
        "norm_type None",
        lambda m: torchclip.clip_grad_norm_(m.parameters(), 1.0, None),
        TypeError,
        r"norm_type must be a number, got None",
    ),
    (
        "clip_grad_norm_",
        "max_norm 'x'",
        lambda m: torchclip.clip_grad_norm_(m.parameters(), "x"),
        ValueError,
        r"max_norm must be a number, got 'x'",
    ),
    (
        "clip_grad_norm_",
        "max_norm a 2-element tensor",
        lambda m: torchclip.clip_grad_norm_(m.parameters(), T),
        ValueError,
        r"max_norm must be a number, got Tensor of shape \(2,\) and dtype torch\.float32$",
    ),
    (
        "clip_grad_norm",
        "max_norm None",
        lambda m: torchclip.clip_grad_norm(m.parameters(), None),
        TypeError,
        r"max_norm must be a number, got None",
    ),
    (
        "clip_grad_value_",
        "clip_value 'big'",
        lambda m: torchclip.clip_grad_value_(m.parameters(), "big"),
        ValueError,
        r"clip_value must be a number, got 'big'",
    ),
    (
        "clip_grad_value_",
        "clip_value 1j",
        lambda m: torchclip.clip_grad_value_(m.parameters(), 1j),
        TypeError,
        r"clip_value must be a number, got 1j",
    ),
    (
        "get_total_norm",
        "norm_type 'fro'",
        lambda m: torchclip.get_total_norm(_grads(m), "fro"),
        ValueError,
        r"norm_type must be a number, got 'fro'",
    ),
    (
        "clip_grads_with_norm_",
        "max_norm 'x'",
        lambda m: torchclip.clip_grads_with_norm_(m.parameters(), "x", torch.tensor(1.0)),
        ValueError,
        r"max_norm must be a number, got 'x'",
    ),
    (
        "clip_grads_with_norm_",
        "total_norm 'x'",
        lambda m: torchclip.clip_grads_with_norm_(m.parameters(), 1.0, "x"),
        TypeError,
        r"total_norm must be a 0-d tensor .*, got 'x'",
    ),
    (
        "clip_grads_with_norm_",
        "total_norm a float",
        lambda m: torchclip.clip_grads_with_norm_(m.parameters(), 1.0, 2.0),
        TypeError,
        r"total_norm must be a 0-d tensor .*, got 2\.0",
    ),
    (
        "clip_grads_with_norm_",
        "total_norm a 1-d tensor",
        lambda m: torchclip.clip_grads_with_norm_(m.parameters(), 1.0, torch.tensor([100.0, 1.0, 1.0, 1.0])),
        RuntimeError,
        r"total_norm must be a 0-d tensor .*, got a tensor of shape \(4,\)",
    ),
    # Lightning's grad_norm: Lightning's classes and words
    (
        "grad_norm",
        "norm_type 'fro'",
        lambda m: torchclip.grad_norm(m, "fro"),
        ValueError,
        r"`norm_type` must be a positive number or 'inf' \(infinity norm\)\. Got 'fro'",
    ),
    (
        "grad_norm",
        "norm_type None",
        lambda m: torchclip.grad_norm(m, None),
        TypeError,
        r"`norm_type` must be a positive number or 'inf' .* Got None",
    ),
    (
        "grad_norm",
        "norm_type NaN",
        lambda m: torchclip.grad_norm(m, math.nan),
        ValueError,
        r"`norm_type` must be a positive number or 'inf' .* Got nan",
    ),
    ("grad_norm", "norm_type -1", lambda m: torchclip.grad_norm(m, -1), ValueError, r"`norm_type` .* Got -1\.0"),
    (
        "grad_norm",
        "module a list",
        lambda m: torchclip.grad_norm(list(m.parameters()), 2),
        TypeError,
        r"module must be a torch\.nn\.Module, got list",
    ),
    (
        "grad_norm",
        "group_separator 3",
        lambda m: torchclip.grad_norm(m, 2, 3),
        TypeError,
        r"group_separator must be a str, got 3",
    ),
    # the Paddle-style classes
    (
        "ClipGradByValue",
        "max 'big'",
        lambda m: torchclip.ClipGradByValue("big"),
        TypeError,
        r"max must be a number, got 'big'",
    ),
    (
        "ClipGradByValue",
        "max None",
        lambda m: torchclip.ClipGradByValue(None),
        TypeError,
        r"max must be a number, got None",
    ),
    (
        "ClipGradByValue",
        "max True",
        lambda m: torchclip.ClipGradByValue(True),
        TypeError,
        r"max must be a number, got True",
    ),
    (
        "ClipGradByValue",
        "min 'x'",
        lambda m: torchclip.ClipGradByValue(1.0, "x"),
        TypeError,
        r"min must be a number, got 'x'",
    ),
    (
        "ClipGradByValue",
        "max a 2-element tensor",
        lambda m: torchclip.ClipGradByValue(T),
        TypeError,
        r"max must be a number, got Tensor of shape \(2,\) and dtype torch\.float32$",
    ),
    (
        "ClipGradByValue",
        "max NaN",
        lambda m: torchclip.ClipGradByValue(math.nan, 0.0),
        ValueError,
        r"bounds must not be NaN, got min=0\.0, max=nan",
    ),
    (
        "ClipGradByValue",
        "min > max",
        lambda m: torchclip.ClipGradByValue(1.0, 2.0),
        ValueError,
        r"min must be <= max, got min=2\.0, max=1\.0",
    ),
    (
        "ClipGradByNorm",
        "clip_norm True",
        lambda m: torchclip.ClipGradByNorm(True),
        TypeError,
        r"clip_norm must be a number, got True",
    ),
    (
        "ClipGradByNorm",
        "clip_norm 0",
        lambda m: torchclip.ClipGradByNorm(0),
        ValueError,
        r"clip_norm must be .*> 0, got 0",
    ),
    (
        "ClipGradByNorm",
        "nonfinite 'ignore'",
        lambda m: torchclip.ClipGradByNorm(1.0, nonfinite="ignore"),
        ValueError,
        r"nonfinite must be one of \('propagate', 'raise', 'skip'\), got 'ignore'",
    ),
    (
        "ClipGradByGlobalNorm",
        "clip_norm 'x'",
        lambda m: torchclip.ClipGradByGlobalNorm("x"),
        TypeError,
        r"clip_norm must be a number, got 'x'",
    ),
    (
        "ClipGradByGlobalNorm",
        "clip_norm inf",
        lambda m: torchclip.ClipGradByGlobalNorm(math.inf),
        ValueError,
        r"clip_norm must be a finite number > 0, got inf",
    ),
    (
        "ClipGradByGlobalNorm",
        "group_name 3",
        lambda m: torchclip.ClipGradByGlobalNorm(1.0, 3),
        TypeError,
        r"group_name must be a str, got 3",
    ),
    (
        "ClipGradByGlobalNorm",
        "auto_skip_clip 'yes'",
        lambda m: torchclip.ClipGradByGlobalNorm(1.0, "g", "yes"),
        TypeError,
        r"auto_skip_clip must be a bool, got 'yes'",
    ),
    (
        "ClipGradByGlobalNorm",
        "nonfinite None",
        lambda m: torchclip.ClipGradByGlobalNorm(1.0, nonfinite=None),
        ValueError,
        r"nonfinite must be one of .*, got None",
    ),
    (
        "GradientClipByValue",
        "max 'big'",
        lambda m: torchclip.GradientClipByValue("big"),
        TypeError,
        r"max must be a number, got 'big'",
    ),
    (
        "GradientClipByValue",
        "need_clip 3",
        lambda m: torchclip.GradientClipByValue(1.0, need_clip=3),
        TypeError,
        r"need_clip must be a function .*, got 3",
    ),
    (
        "GradientClipByNorm",
        "clip_norm False",
        lambda m: torchclip.GradientClipByNorm(False),
        TypeError,
        r"clip_norm must be a number, got False",
    ),
    (
        "GradientClipByGlobalNorm",
        "need_clip 'all'",
        lambda m: torchclip.GradientClipByGlobalNorm(1.0, need_clip="all"),
        TypeError,
        r"need_clip must be a function .*, got 'all'",
    ),
    # the adaptive clips
    (
        "ClipGradByZScore",
        "alpha 1",
        lambda m: torchclip.ClipGradByZScore(alpha=1),
        ValueError,
        r"alpha must be in \(0, 1\), got 1",
    ),
    (
        "ClipGradByZScore",
        "alpha 'x'",
        lambda m: torchclip.ClipGradByZScore(alpha="x"),
        TypeError,
        r"alpha must be a number, got 'x'",
    ),
    (
        "ClipGradByZScore",
        "z_thresh -1",
        lambda m: torchclip.ClipGradByZScore(z_thresh=-1),
        ValueError,
        r"z_thresh .* got -1",
    ),
    (
        "ClipGradByZScore",
        "max_grad_norm True",
        lambda m: torchclip.ClipGradByZScore(max_grad_norm=True),
        TypeError,
        r"max_grad_norm must be a number, got True",
    ),
    ("ClipGradByZScore", "eps NaN", lambda m: torchclip.ClipGradByZScore(eps=math.nan), ValueError, r"eps .* got nan"),
    (
        "ClipGradByZScore",
        "warmup_steps 2.0",
        lambda m: torchclip.ClipGradByZScore(warmup_steps=2.0),
        TypeError,
        r"warmup_steps must be an int, got 2\.0",
    ),
    (
        "ClipGradByZScore",
        "mode 'median'",
        lambda m: torchclip.ClipGradByZScore(mode="median"),
        ValueError,
        r"mode .* got 'median'",
    ),
    (
        "ClipGradByZScore",
        "clip_option 'max'",
        lambda m: torchclip.ClipGradByZScore(clip_option="max"),
        ValueError,
        r"clip_option .* got 'max'",
    ),
    (
        "ClipGradByZScore",
        "clip_factor 0",
        lambda m: torchclip.ClipGradByZScore(clip_factor=0),
        ValueError,
        r"clip_factor .* got 0",
    ),
    (
        "ClipGradByZScore",
        "skip_update_on_spike 1",
        lambda m: torchclip.ClipGradByZScore(skip_update_on_spike=1),
        TypeError,
        r"skip_update_on_spike must be a bool, got 1",
    ),
    (
        "ClipGradByQuantile",
        "quantile 1.5",
        lambda m: torchclip.ClipGradByQuantile(1.5),
        ValueError,
        r"quantile must be in \[0, 1\], got 1\.5",
    ),
    (
        "ClipGradByQuantile",
        "quantile '0.9'",
        lambda m: torchclip.ClipGradByQuantile("0.9"),
        TypeError,
        r"quantile .* got '0\.9'",
    ),
    (
        "ClipGradByQuantile",
        "history_length 0",
        lambda m: torchclip.ClipGradByQuantile(history_length=0),
        ValueError,
        r"history_length must be >= 1, got 0",
    ),
    (
        "ClipGradByQuantile",
        "global_threshold 'yes'",
        lambda m: torchclip.ClipGradByQuantile(global_threshold="yes"),
        TypeError,
        r"global_threshold must be a bool, got 'yes'",
    ),
    (
        "ClipGradByNormEMA",
        "lambda_rel NaN",
        lambda m: torchclip.ClipGradByNormEMA(lambda_rel=math.nan),
        ValueError,
        r"lambda_rel .* got nan",
    ),
    (
        "ClipGradByNormEMA",
        "beta 1",
        lambda m: torchclip.ClipGradByNormEMA(beta=1),
        ValueError,
        r"beta must be in \[0, 1\), got 1",
    ),
    (
        "ClipGradByNormEMA",
        "warmup_steps -1",
        lambda m: torchclip.ClipGradByNormEMA(warmup_steps=-1),
        ValueError,
        r"warmup_steps must be >= 0, got -1",
    ),
    (
        "ClipGradByNormEMA",
        "lambda_abs 'x'",
        lambda m: torchclip.ClipGradByNormEMA(lambda_abs="x"),
        TypeError,
        r"lambda_abs must be a number, got 'x'",
    ),
    (
        "SkipStepOnSpike",
        "window 0",
        lambda m: torchclip.SkipStepOnSpike(window=0),
        ValueError,
        r"window must be >= 1, got 0",
    ),
    (
        "SkipStepOnSpike",
        "sigma_factor 'x'",
        lambda m: torchclip.SkipStepOnSpike(sigma_factor="x"),
        TypeError,
        r"sigma_factor must be a number, got 'x'",
    ),
    ("SkipStepOnSpike", "clip 1.0", lambda m: torchclip.SkipStepOnSpike(1.0), TypeError, r"clip must be .*, got 1\.0"),
    (
        "ClipGradByUnitwiseNorm",
        "norm_type 'fro'",
        lambda m: torchclip.ClipGradByUnitwiseNorm(norm_type="fro"),
        TypeError,
        r"norm_type must be a number, got 'fro'",
    ),
    (
        "ClipGradByUnitwiseNorm",
        "norm_type NaN",
        lambda m: torchclip.ClipGradByUnitwiseNorm(norm_type=math.nan),
        ValueError,
        r"norm_type must be > 0 .*, got nan",
    ),
    (
        "ClipGradByUnitwiseNorm",
        "clip_factor -1",
        lambda m: torchclip.ClipGradByUnitwiseNorm(clip_factor=-1),
        ValueError,
        r"clip_factor .* got -1",
    ),
    (
        "ClipGradByUnitwiseNorm",
        "eps -1",
        lambda m: torchclip.ClipGradByUnitwiseNorm(eps=-1),
        ValueError,
        r"eps .* got -1",
    ),
    # marks and defaults
    (
        "set_need_clip",
        "need_clip 'no'",
        lambda m: torchclip.set_need_clip(m, "no"),
        TypeError,
        r"need_clip must be a bool, got 'no'",
    ),
    (
        "set_need_clip",
        "target a str",
        lambda m: torchclip.set_need_clip("0.weight", False),
        TypeError,
        r"set_need_clip: target got str '0\.weight'; it takes parameters",
    ),
    (
        "set_need_clip",
        "target dict(named_parameters())",
        lambda m: torchclip.set_need_clip(dict(m.named_parameters()), False),
        TypeError,
        r"set_need_clip: target got a mapping \(dict of 4 entries",
    ),
    (
        "set_need_clip",
        "target named_parameters()",
        lambda m: torchclip.set_need_clip(m.named_parameters(), False),
        TypeError,
        r"item 0 is tuple \(str, Parameter\), not a tensor",
    ),
    (
        "exclude_from_clipping",
        "module a list",
        lambda m: torchclip.exclude_from_clipping(list(m.parameters())),
        TypeError,
        r"module must be a torch\.nn\.Module, got list",
    ),
    (
        "exclude_from_clipping",
        "biases 'no'",
        lambda m: torchclip.exclude_from_clipping(m, biases="no"),
        TypeError,
        r"biases must be a bool, got 'no'",
    ),
    (
        "exclude_from_clipping",
        "norm_layers None",
        lambda m: torchclip.exclude_from_clipping(m, norm_layers=None),
        TypeError,
        r"norm_layers must be a bool, got None",
    ),
    (
        "set_gradient_clip",
        "clip 1.0",
        lambda m: torchclip.set_gradient_clip(1.0),
        TypeError,
        r"clip must be .*, got 1\.0",
    ),
    (
        "set_gradient_clip",
        "param_list a str",
        lambda m: torchclip.set_gradient_clip(torchclip.ClipGradByNorm(1.0), "0.weight", m),
        TypeError,
        r"param_list got str '0\.weight'; it takes a list of parameters or a list of parameter names",
    ),
    (
        "set_gradient_clip",
        "param_list names and parameters",
        lambda m: torchclip.set_gradient_clip(torchclip.ClipGradByNorm(1.0), ["0.weight", m[0].bias], m),
        TypeError,
        r"param_list item 1 is Parameter of shape \(4,\)",
    ),
    (
        "set_gradient_clip",
        "param_list a state_dict",
        lambda m: torchclip.set_gradient_clip(torchclip.ClipGradByNorm(1.0), m.state_dict(), m),
        TypeError,
        r"param_list got a mapping \(OrderedDict",
    ),
    (
        "set_gradient_clip",
        "program 3",
        lambda m: torchclip.set_gradient_clip(torchclip.ClipGradByNorm(1.0), ["w"], 3),
        TypeError,
        r"program must be the torch\.nn\.Module .*, got int",
    ),
    (
        "set_gradient_clip",
        "an unknown name",
        lambda m: torchclip.set_gradient_clip(torchclip.ClipGradByNorm(1.0), ["0.weight", "head"], m),
        ValueError,
        r"no parameter named \['head'\]",
    ),
    (
        "set_cpu_capability",
        "capability 'SSE'",
        lambda m: torchclip.set_cpu_capability("SSE"),
        ValueError,
        r"capability must be one of .*, got 'SSE'",
    ),
    (
        "set_exact_norm",
        "enabled 1",
        lambda m: torchclip.set_exact_norm(1),
        TypeError,
        r"enabled must be a bool, got 1",
    ),
    # TensorFlow's names
    (
        "clip_by_value",
        "t a list",
        lambda m: tf_names.clip_by_value([1.0], 0.0, 1.0),
        TypeError,
        r"t must be a torch\.Tensor, got list",
    ),
    (
        "clip_by_value",
        "clip_value_min 'a'",
        lambda m: tf_names.clip_by_value(T, "a", 1.0),
        TypeError,
        r"clip_value_min must be a number or a tensor, got 'a'",
    ),
    (
        "clip_by_value",
        "clip_value_max None",
        lambda m: tf_names.clip_by_value(T, 0.0, None),
        TypeError,
        r"clip_value_max must be a number or a tensor, got None",
    ),
    (
        "clip_by_value",
        "min > max",
        lambda m: tf_names.clip_by_value(T, 2.0, 1.0),
        ValueError,
        r"clip_value_min must be <= clip_value_max, got clip_value_min=2\.0, clip_value_max=1\.0",
    ),
    (
        "clip_by_norm",
        "clip_norm 'x'",
        lambda m: tf_names.clip_by_norm(T, "x"),
        TypeError,
        r"clip_norm must be .*, got 'x'",
    ),
    (
        "clip_by_norm",
        "clip_norm 0",
        lambda m: tf_names.clip_by_norm(T, 0),
        ValueError,
        r"clip_norm must be .*> 0, got 0",
    ),
    (
        "clip_by_norm",
        "clip_norm a 1-d tensor",
        lambda m: tf_names.clip_by_norm(T, T),
        ValueError,
        r"clip_norm must be a number or a 0-d tensor, got a tensor of shape \(2,\)",
    ),
    (
        "clip_by_norm",
        "axes 'x'",
        lambda m: tf_names.clip_by_norm(T, 1.0, axes="x"),
        TypeError,
        r"axes must be .*, got 'x'",
    ),
    ("clip_by_norm", "axes 3", lambda m: tf_names.clip_by_norm(T, 1.0, axes=3), ValueError, r"axes: 3 is out of range"),
    (
        "clip_by_global_norm",
        "t_list a tensor",
        lambda m: tf_names.clip_by_global_norm(T, 1.0),
        TypeError,
        r"t_list must be a sequence .*, got Tensor",
    ),
    (
        "clip_by_global_norm",
        "clip_norm NaN",
        lambda m: tf_names.clip_by_global_norm([T], math.nan),
        ValueError,
        r"clip_norm must be a finite number > 0, got nan",
    ),
    (
        "clip_by_global_norm",
        "use_norm 'x'",
        lambda m: tf_names.clip_by_global_norm([T], 1.0, use_norm="x"),
        TypeError,
        r"use_norm must be a number or a 0-d tensor, got 'x'",
    ),
    (
        "clip_by_global_norm",
        "use_norm a 1-d tensor",
        lambda m: tf_names.clip_by_global_norm([T], 1.0, use_norm=T),
        ValueError,
        r"use_norm must be a number or a 0-d tensor, got a tensor of shape \(2,\)",
    ),
    (
        "global_norm",
        "t_list a str",
        lambda m: tf_names.global_norm("abc"),
        TypeError,
        r"t_list must be a sequence .*, got str",
    ),
    (
        "global_norm",
        "t_list holding a str",
        lambda m: tf_names.global_norm([T, "abc"]),
        TypeError,
        r"t_list\[1\] must be a torch\.Tensor or None, got str",
    ),
    # torchclip.optim
    (
        "optim.attach",
        "optimizer 3",
        lambda m: optim.attach(3),
        TypeError,
        r"optimizer must be a torch\.optim\.Optimizer, got int",
    ),
    (
        "optim.attach",
        "grad_clip 1.0",
        lambda m: optim.attach(torch.optim.SGD(m.parameters(), lr=0.1), 1.0),
        TypeError,
        r"grad_clip must be a torchclip clip .*, got 1\.0",
    ),
    (
        "optim.with_grad_clip",
        "optimizer_class 3",
        lambda m: optim.with_grad_clip(3),
        TypeError,
        r"optimizer_class must be a torch\.optim\.Optimizer subclass, got 3",
    ),
    (
        "optim.SGD",
        "grad_clip 1.0",
        lambda m: optim.SGD(m.parameters(), lr=0.1, grad_clip=1.0),
        TypeError,
        r"grad_clip must be a torchclip clip .*, got 1\.0",
    ),
    (
        "optim.SGD",
        "a group's grad_clip 2",
        lambda m: optim.SGD([{"params": list(m.parameters()), "grad_clip": 2}], lr=0.1),
        TypeError,
        r"param_group\['grad_clip'\] must be a torchclip clip .*, got 2",
    ),
    (
        "optim.SGD",
        "clipnorm and clipvalue",
        lambda m: optim.SGD(m.parameters(), lr=0.1, clipnorm=1.0, clipvalue=1.0),
        ValueError,
        r"Only one of clipnorm, clipvalue and global_clipnorm .* clipnorm=1\.0, clipvalue=1\.0",
    ),
    *_optimizer_rows(),
]


@pytest.mark.filterwarnings("ignore:`torchclip.clip_grad_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}: {r[1]}" for r in ROWS])
def test_a_bad_argument_names_itself_and_changes_nothing(row):
    _, _, call, error, message = row
    model = model_with_grads()
    before = snapshot(model)
    with pytest.raises(error, match=message):
        call(model)
    assert_unchanged(model, before)


def _public_functions():
    """Every public function or class that takes arguments: torchclip's, torchclip.optim's, tf_names'."""
    names = []
    for prefix, module in (("", torchclip), ("optim.", optim), ("", tf_names)):
        for name in module.__all__:
            member = getattr(module, name)
            if inspect.ismodule(member) or (inspect.isclass(member) and issubclass(member, Exception)):
                continue
            if name == "patch" or not inspect.signature(member).parameters:
                continue  # nothing to get wrong
            names.append(prefix + name)
    return sorted(set(names))


def test_every_public_function_has_rows():
    covered = {r[0] for r in ROWS}
    missing = [name for name in _public_functions() if name not in covered]
    assert not missing, f"no bad-argument row for {missing}"


# Rows torch.nn.utils (or Lightning) refuses too: the same exception class, with the argument named.
TORCH_TOO = [
    lambda u, m: u.clip_grad_norm_(m.parameters(), 1.0, "fro"),
    lambda u, m: u.clip_grad_norm_(m.parameters(), None),
    lambda u, m: u.clip_grad_value_(m.parameters(), 1j),
    lambda u, m: u.get_total_norm(_grads(m), None),
    lambda u, m: u.clip_grads_with_norm_(m.parameters(), 1.0, "x"),
    lambda u, m: u.clip_grads_with_norm_(m.parameters(), 1.0, 2.0),
    lambda u, m: u.clip_grads_with_norm_(m.parameters(), 1.0, torch.tensor([100.0, 1.0, 1.0, 1.0])),
]


@pytest.mark.parametrize("call", TORCH_TOO)
def test_drop_ins_keep_torchs_exception_class(call):
    with pytest.raises(Exception) as theirs:
        call(torch.nn.utils, model_with_grads())
    model = model_with_grads()
    before = snapshot(model)
    with pytest.raises(type(theirs.value)) as ours:
        call(torchclip, model)
    assert re.search(r"(norm_type|max_norm|clip_value|total_norm) must be", str(ours.value))
    assert_unchanged(model, before)


@pytest.mark.parametrize("norm_type", ["fro", None, "two"])
def test_grad_norm_keeps_lightnings_exception_class(norm_type):
    lightning_grads = pytest.importorskip("pytorch_lightning.utilities.grads")
    with pytest.raises(Exception) as theirs:
        lightning_grads.grad_norm(model_with_grads(), norm_type)
    with pytest.raises(type(theirs.value), match=r"`norm_type` must be a positive number"):
        torchclip.grad_norm(model_with_grads(), norm_type)


def test_set_gradient_clip_takes_one_parameter_or_a_module():
    model = model_with_grads()
    clip = torchclip.ClipGradByNorm(1.0)
    torchclip.set_gradient_clip(clip, model[0].weight)  # one tensor: that parameter (it iterated its rows)
    assert clip_module.gradient_clip_of(model[0].weight) is clip
    assert getattr(model[0].bias, "gradient_clip_attr", None) is None
    torchclip.set_gradient_clip(clip, model[1])
    assert all(clip_module.gradient_clip_of(p) is clip for p in model[1].parameters())
