"""The Paddle-style classes against Paddle's documented formulas, computed independently in float64."""

import math

import pytest
import torch
from testing import CLIP_RTOL, DTYPES, make_params, no_host_sync

import torchclip
from torchclip import (
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByValue,
    GradientClipByGlobalNorm,
    GradientClipByNorm,
    GradientClipByValue,
)

SHAPES = [(7,), (3, 5), (64, 64), (1000,), (), (2, 3, 4)]


def params_of(dtype, scale=0.3, seed=0, none_every=0):
    return make_params([(s, dtype) for s in SHAPES], seed=seed, scale=scale, none_every=none_every)


def f64_grads(params):
    return [None if p.grad is None else p.grad.double().clone() for p in params]


def paddle_global_norm_reference(grads64, clip_norm):
    global_norm = math.sqrt(sum(float((g * g).sum()) for g in grads64 if g is not None))
    return [None if g is None else g * (clip_norm / max(global_norm, clip_norm)) for g in grads64], global_norm


def paddle_norm_reference(grads64, clip_norm):
    out = []
    for g in grads64:
        if g is None:
            out.append(None)
            continue
        norm = float(torch.linalg.vector_norm(g))
        out.append(g if norm <= clip_norm else g * (clip_norm / norm))
    return out


def assert_matches(params, expected, rtol):
    for p, e in zip(params, expected):
        if e is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad.double(), e, rtol=rtol, atol=1e-7)


# ---- formulas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clip_norm", [0.05, 1.0, 100.0])
def test_global_norm_formula(cpu_capability, dtype, clip_norm):
    params = params_of(dtype, none_every=4)
    expected, global_norm = paddle_global_norm_reference(f64_grads(params), clip_norm)
    clip = ClipGradByGlobalNorm(clip_norm)
    assert clip(params) is None
    assert_matches(params, expected, CLIP_RTOL[dtype])
    assert clip.last_global_norm.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert clip.last_global_norm.item() == pytest.approx(global_norm, rel=1e-6)


@pytest.mark.parametrize("auto_skip_clip", [False, True])
def test_global_norm_below_clip_norm_leaves_gradients_untouched(auto_skip_clip):
    params = params_of(torch.float32, scale=1e-3)
    before = [p.grad.clone() for p in params]
    ClipGradByGlobalNorm(10.0, auto_skip_clip=auto_skip_clip)(params)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_global_norm_mixed_dtypes_accumulates_wide_and_scales_in_each_dtype():
    specs = [((300,), torch.float16), ((40, 3), torch.bfloat16), ((100,), torch.float32)]
    params = make_params(specs, scale=50.0)  # fp16 squares: 50^2 * 300 ~ 7.5e5, beyond float16
    expected, global_norm = paddle_global_norm_reference(f64_grads(params), 1.0)
    clip = ClipGradByGlobalNorm(1.0)
    clip(params)
    assert clip.last_global_norm.dtype == torch.float32
    assert clip.last_global_norm.item() == pytest.approx(global_norm, rel=1e-6)
    for p, e in zip(params, expected):
        assert p.grad.dtype in (torch.float16, torch.bfloat16, torch.float32)
        torch.testing.assert_close(p.grad.double(), e, rtol=CLIP_RTOL[p.grad.dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_norm_formula(cpu_capability, dtype):
    params = params_of(dtype, none_every=3)
    grads64 = f64_grads(params)
    norms = sorted(float(torch.linalg.vector_norm(g)) for g in grads64 if g is not None)
    clip_norm = norms[len(norms) // 2]  # some tensors above, some at or below
    clip = ClipGradByNorm(clip_norm)
    clip(params)
    assert_matches(params, paddle_norm_reference(grads64, clip_norm), CLIP_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bounds", [(0.1, None), (0.5, -0.2), (0.0, -1.0)])
def test_value_formula(cpu_capability, dtype, bounds):
    params = params_of(dtype)
    maximum, minimum = bounds
    lo = -maximum if minimum is None else minimum
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    expected = [p.grad.to(opmath).clamp(lo, maximum).to(dtype).double() for p in params]
    ClipGradByValue(maximum, minimum)(params)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad.double(), e, rtol=0, atol=0)


# ---- call forms and need_clip -------------------------------------------------------------------


@pytest.mark.parametrize("clip", [ClipGradByGlobalNorm(0.1), ClipGradByNorm(0.1), ClipGradByValue(0.01)])
def test_pairs_form_returns_pairs_without_none_grads(clip):
    params = params_of(torch.float32, none_every=2)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        t.grad = None if p.grad is None else p.grad.clone()
    pairs = clip([(p, p.grad) for p in params])
    assert [p for p, _ in pairs] == [p for p in params if p.grad is not None]
    assert all(g is p.grad for p, g in pairs)  # clipped in place: the same tensors
    clip(twins)  # the parameter form gives the same values
    for (p, g), t in zip(pairs, [t for t in twins if t.grad is not None]):
        assert torch.equal(g, t.grad)


@pytest.mark.parametrize(
    "make_clip", [lambda: ClipGradByGlobalNorm(0.01), lambda: ClipGradByNorm(0.01), lambda: ClipGradByValue(0.001)]
)
def test_need_clip_false_is_neither_clipped_nor_counted(make_clip):
    params = params_of(torch.float32)
    torchclip.set_need_clip(params[1], False)
    torchclip.set_need_clip(params[3:5], False)
    excluded_before = {i: params[i].grad.clone() for i in (1, 3, 4)}
    included = [p for i, p in enumerate(params) if i not in excluded_before]
    expected_global, _ = paddle_global_norm_reference(f64_grads(included), 0.01)
    clip = make_clip()
    clip(params)
    for i, before in excluded_before.items():
        assert torch.equal(params[i].grad, before)
    if isinstance(clip, ClipGradByGlobalNorm):  # the global norm counts only the included ones
        assert_matches(included, expected_global, CLIP_RTOL[torch.float32])


def test_legacy_need_clip_predicate_and_attribute_both_exclude():
    params = params_of(torch.float32)
    torchclip.set_need_clip(params[0], False)
    clip = GradientClipByGlobalNorm(0.01, need_clip=lambda p: p.dim() != 2)
    before = [p.grad.clone() for p in params]
    clip(params)
    for p, b in zip(params, before):
        untouched = p is params[0] or p.dim() == 2
        assert torch.equal(p.grad, b) == untouched


def test_legacy_classes_match_the_new_ones():
    for legacy, modern in [
        (GradientClipByValue(0.1, -0.05), ClipGradByValue(0.1, -0.05)),
        (GradientClipByNorm(0.2), ClipGradByNorm(0.2)),
        (GradientClipByGlobalNorm(0.2, "g"), ClipGradByGlobalNorm(0.2, "g")),
    ]:
        a, b = params_of(torch.float32), params_of(torch.float32)
        legacy(a)
        modern(b)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a, b))


def test_exclude_from_clipping_marks_biases_and_norm_layers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    assert torchclip.exclude_from_clipping(model) == 3  # linear bias, layernorm weight and bias
    assert [getattr(p, "need_clip", True) for p in model.parameters()] == [True, False, False, False, True]


# ---- bad arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, error, message",
    [
        (lambda: ClipGradByGlobalNorm(0.0), ValueError, "clip_norm must be a finite number > 0, got 0.0"),
        (lambda: ClipGradByGlobalNorm(-1.0), ValueError, "clip_norm must be a finite number > 0, got -1.0"),
        (lambda: ClipGradByGlobalNorm(math.inf), ValueError, "clip_norm must be a finite number > 0, got inf"),
        (lambda: ClipGradByGlobalNorm(math.nan), ValueError, "clip_norm must be a finite number > 0, got nan"),
        (lambda: ClipGradByGlobalNorm("x"), TypeError, "clip_norm must be a number, got 'x'"),
        (lambda: ClipGradByGlobalNorm(1.0, group_name=3), TypeError, "group_name must be a str, got 3"),
        (lambda: ClipGradByGlobalNorm(1.0, auto_skip_clip=1), TypeError, "auto_skip_clip must be a bool, got 1"),
        (lambda: ClipGradByNorm(0), ValueError, "clip_norm must be a finite number > 0, got 0"),
        (lambda: ClipGradByValue(0.0), ValueError, "max must be > 0 when min is None, got max=0.0"),
        (lambda: ClipGradByValue(-1.0), ValueError, "max must be > 0 when min is None, got max=-1.0"),
        (lambda: ClipGradByValue(1.0, 2.0), ValueError, "min must be <= max, got min=2.0, max=1.0"),
        (lambda: ClipGradByValue(math.nan, 0.0), ValueError, "bounds must not be NaN"),
        (lambda: GradientClipByNorm(1.0, need_clip=True), TypeError, "need_clip must be a function"),
        (lambda: GradientClipByGlobalNorm(1.0, need_clip="all"), TypeError, "need_clip must be a function"),
        (lambda: GradientClipByValue(1.0, need_clip=3), TypeError, "need_clip must be a function"),
        (lambda: torchclip.set_need_clip([torch.zeros(1), "w"], False), TypeError, "item 1 is str"),
        (lambda: torchclip.set_need_clip(torch.nn.Linear(2, 2), 0), TypeError, "need_clip must be a bool, got 0"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(factory, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        factory()


class SubclassedGrad(torch.Tensor):
    """A tensor subclass: the classes must take their general (torch-op) path for it."""


@pytest.mark.parametrize(
    "make_clip",
    [lambda: ClipGradByGlobalNorm(0.05), lambda: ClipGradByNorm(0.05), lambda: ClipGradByValue(0.01, -0.02)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_general_path_agrees_with_the_kernels(make_clip, dtype):
    plain = params_of(dtype)
    other = params_of(dtype)
    for p in other:
        p.grad = p.grad.as_subclass(SubclassedGrad)
    make_clip()(plain)
    make_clip()(other)
    for p, q in zip(plain, other):
        assert type(q.grad) is SubclassedGrad
        torch.testing.assert_close(
            q.grad.as_subclass(torch.Tensor).double(), p.grad.double(), rtol=CLIP_RTOL[dtype], atol=1e-6
        )


# ---- what the clips keep for logging ---------------------------------------------------------------


def as_subclass_grads(params):
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.as_subclass(SubclassedGrad)


# Each route of a class: the C++ walk (a parameter list), the dispatcher's op (Paddle's pairs), and the
# general path of torch ops (a gradient subclass the kernels do not serve).
ROUTES = {
    "walk": lambda clip, params: clip(params),
    "op": lambda clip, params: clip([(p, p.grad) for p in params]),
    "general": lambda clip, params: (as_subclass_grads(params), clip(params)),
}


def plain(t):
    return t.as_subclass(torch.Tensor)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("clip_norm", [0.05, 100.0])
def test_global_norm_keeps_each_norm_and_the_coefficient(route, clip_norm):
    params = params_of(torch.float32, none_every=4)
    grads64 = [g for g in f64_grads(params) if g is not None]
    _, global_norm = paddle_global_norm_reference(grads64, clip_norm)
    clip = ClipGradByGlobalNorm(clip_norm)
    ROUTES[route](clip, params)
    norms, coefficient = plain(clip.last_norms), plain(clip.last_clip_coef)
    assert norms.dtype == coefficient.dtype == torch.float64 and coefficient.shape == ()
    expected = torch.stack([torch.linalg.vector_norm(g) for g in grads64])
    torch.testing.assert_close(norms, expected, rtol=1e-6, atol=0)
    assert coefficient.item() == pytest.approx(clip_norm / max(global_norm, clip_norm), rel=1e-6)


@pytest.mark.parametrize("route", ["walk", "op"])
def test_global_norm_skipped_for_a_nonfinite_norm_keeps_a_coefficient_of_one(route):
    params = params_of(torch.float32)
    params[2].grad[0, 0] = math.inf
    clip = ClipGradByGlobalNorm(0.05, nonfinite="skip")
    ROUTES[route](clip, params)
    assert clip.last_clip_coef.item() == 1.0 and math.isinf(clip.last_norms[2].item())
    assert bool(clip.found_nonfinite)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
def test_per_tensor_norm_keeps_each_coefficient(route, nonfinite):
    params = params_of(torch.float32)
    grads64 = f64_grads(params)
    norms = [float(torch.linalg.vector_norm(g)) for g in grads64]
    clip_norm = sorted(norms)[len(norms) // 2]
    if nonfinite == "skip":
        params[1].grad[0, 0] = math.nan
    clip = ClipGradByNorm(clip_norm, nonfinite=nonfinite)
    ROUTES[route](clip, params)
    coefficients = plain(clip.last_clip_coef)
    assert coefficients.dtype == torch.float64 and coefficients.shape == (len(params),)
    if nonfinite == "skip":  # the NaN gradient made the call leave every gradient as it was
        assert torch.equal(coefficients, torch.ones_like(coefficients))
        return
    expected = torch.tensor([1.0 if n <= clip_norm else clip_norm / n for n in norms], dtype=torch.float64)
    torch.testing.assert_close(coefficients, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("clip_norm", [0.05, 100.0])
def test_the_norms_after_clipping_are_the_clipped_gradients_norms(route, clip_norm):
    """last_clipped_norm(s): the norms of the gradients as the clip left them, from the kept statistics."""
    params = params_of(torch.float32)
    for clip in (ClipGradByGlobalNorm(clip_norm), ClipGradByNorm(clip_norm)):
        for p, g in zip(params, f64_grads(params_of(torch.float32))):
            p.grad = g.float()
        ROUTES[route](clip, params)
        after = torch.stack([torch.linalg.vector_norm(plain(p.grad).double()) for p in params])
        if isinstance(clip, ClipGradByGlobalNorm):
            clipped = plain(clip.last_clipped_norm)
            assert clipped.dtype == plain(clip.last_global_norm).dtype == torch.float32 and clipped.shape == ()
            torch.testing.assert_close(clipped.double(), torch.linalg.vector_norm(after), rtol=1e-6, atol=0)
        else:
            torch.testing.assert_close(plain(clip.last_clipped_norms), after, rtol=1e-6, atol=0)


def test_the_norms_after_clipping_are_read_without_a_host_sync(device):
    params = []
    for q in params_of(torch.float32):
        params.append(torch.nn.Parameter(q.detach().to(device)))
        params[-1].grad = q.grad.to(device)
    global_clip, per_tensor_clip = ClipGradByGlobalNorm(0.05), ClipGradByNorm(0.05)
    global_clip(params)
    per_tensor_clip(params)
    with no_host_sync(device):
        after, each_after = global_clip.last_clipped_norm, per_tensor_clip.last_clipped_norms
    assert after.device.type == each_after.device.type == device
    torch.testing.assert_close(after.cpu().double(), torch.tensor(0.05, dtype=torch.float64), rtol=1e-6, atol=0)


def test_norms_after_clipping_are_none_before_the_first_call():
    assert ClipGradByGlobalNorm(1.0).last_clipped_norm is None
    assert ClipGradByNorm(1.0).last_clipped_norms is None


# Lists this long are walked by every intra-op thread (csrc/walk/param_walk.cpp); the need_clip marks
# are read first, on the calling thread.
LONG = 5000


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "make_clip",
    [lambda: ClipGradByGlobalNorm(0.05), lambda: ClipGradByNorm(0.01), lambda: ClipGradByValue(0.01, -0.02)],
)
def test_need_clip_on_a_long_list_matches_the_python_path(make_clip, threads):
    torch.set_num_threads(threads)  # (conftest restores it)
    params = make_params([((3 + i % 5,), torch.float32) for i in range(LONG)], seed=21, none_every=11)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for i, (p, t) in enumerate(zip(params, twins)):
        t.grad = None if p.grad is None else p.grad.clone()
        if i % 7 == 3:
            torchclip.set_need_clip([p, t], False)
    make_clip()(params)  # the C++ walk
    make_clip()([(t, t.grad) for t in twins])  # the pairs form: the Python walk
    for p, t in zip(params, twins):
        assert (p.grad is None) == (t.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, t.grad, rtol=CLIP_RTOL[torch.float32], atol=1e-7)


def test_a_need_clip_property_that_drops_gradients_is_read_before_the_walk(monkeypatch):
    # need_clip looked up on a parameter may run Python code (here a property on the class) that
    # changes gradients. Every mark is read before the walk borrows any gradient, so a gradient
    # dropped that way is simply not there, and the others are clipped.
    params = make_params([((4,), torch.float32) for _ in range(LONG)], seed=22, scale=10.0)
    dropped = set(range(0, LONG, 9))

    def need_clip(self):
        if self.index in dropped:
            self.grad = None
        return True

    for i, p in enumerate(params):
        p.index = i
    monkeypatch.setattr(torch.nn.Parameter, "need_clip", property(need_clip), raising=False)
    ClipGradByValue(0.5)(params)
    for i, p in enumerate(params):
        assert (p.grad is None) == (i in dropped)
        if p.grad is not None:
            assert p.grad.abs().max() <= 0.5


# ---- the protocol a user's clip follows (ClipGradBase's docstring, docs/optimizer.md) ---------------------


class ClipGradBySign(torchclip.ClipGradBase):
    """The documented example: signSGD's update, each element to -1, 0 or 1."""

    def __init__(self):
        self.calls = []

    def clip_gradients_(self, grads, params):
        self.calls.append(([tuple(g.shape) for g in grads], [tuple(p.shape) for p in params]))
        for g in grads:
            g.sign_()


def test_a_users_clip_gets_the_selected_gradients_beside_their_parameters_in_both_call_forms():
    for form in ("parameters", "pairs"):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        torchclip.set_need_clip(model[1].bias, False)
        excluded = model[1].bias.grad.clone()
        clip = ClipGradBySign()
        if form == "parameters":
            assert clip(model) is None
        else:
            pairs = [(p, p.grad) for p in model.parameters()]
            assert clip(pairs) == pairs
        assert clip.calls == [([(4, 3), (4,), (2, 4)], [(4, 3), (4,), (2, 4)])]
        for p in list(model.parameters())[:3]:
            assert torch.equal(p.grad, p.grad.sign())
        assert torch.equal(model[1].bias.grad, excluded)


@pytest.mark.parametrize("fused", [False, True])
def test_a_users_clip_serves_as_an_optimizers_grad_clip(fused):
    model = torch.nn.Linear(5, 3)
    reference = torch.nn.Linear(5, 3)
    reference.load_state_dict(model.state_dict())
    opt = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=ClipGradBySign(), fused=fused)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, fused=fused)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.sign()
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_a_users_clip_that_refuses_the_step_is_skipped_by_the_optimizer():
    class RefuseEveryStep(ClipGradBySign):
        def step_refused(self):
            return torch.tensor(True)

    model = torch.nn.Linear(5, 3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=RefuseEveryStep())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.grad_clip_attachment.skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_clip_without_clip_gradients_says_what_to_define():
    class Incomplete(torchclip.ClipGradBase):
        pass

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(NotImplementedError, match=r"Incomplete must define clip_gradients_\(grads, params\)"):
        Incomplete()([p])
