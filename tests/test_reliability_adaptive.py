"""Issue 34, items 8 and 9: the adaptive clips through a NaN or inf step, and their per-parameter state
when a call names new objects every step.

Item 8: under nonfinite="skip" a call with a NaN or inf norm changes nothing (gradients, statistics, step
counts) and asks an optimizer hook to skip the step, so the run continues as if the call had not been
made; "raise" raises before any change. "propagate", the default, stays the reference packages' rule
(tests/test_adaptive_zscore.py, tests/test_adaptive_quantile.py). Item 9: ClipGradByQuantile and ClipGradByNormEMA called with objects that are
new at every call (pairs built from p.detach(), functional training) clip as when called with the
parameters, by position, and warn once; rows of dead objects are reused, so the state does not grow."""

import copy
import math
import pickle
import warnings

import pytest
import torch

import torchclip
from torchclip import ClipGradByNormEMA, ClipGradByQuantile, ClipGradByUnitwiseNorm, ClipGradByZScore, SkipStepOnSpike

SHAPES = [(4, 3), (3,), (2, 5)]

# Set so that a few calls move the statistics and clip: short warm-ups and windows.
STATEFUL = {
    "zscore": lambda **kw: ClipGradByZScore(warmup_steps=3, max_grad_norm=None, **kw),
    "quantile": lambda **kw: ClipGradByQuantile(0.5, 4, **kw),
    "quantile-global": lambda **kw: ClipGradByQuantile(0.5, 4, global_threshold=True, **kw),
    "norm-ema": lambda **kw: ClipGradByNormEMA(warmup_steps=3, **kw),
    "skip-on-spike": lambda **kw: SkipStepOnSpike(ClipGradByNormEMA(warmup_steps=3), window=6, sigma_factor=2.0, **kw),
}
EVERY = {**STATEFUL, "unitwise": lambda **kw: ClipGradByUnitwiseNorm(0.05, **kw)}
PER_PARAMETER = {name: STATEFUL[name] for name in ("quantile", "norm-ema")}

FORMS = {
    "parameters": lambda params: params,
    "pairs": lambda params: [(p, p.grad) for p in params],
}


def make_params(seed=0, shapes=SHAPES):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]


def gradients(step, shapes=SHAPES):
    """Step `step`'s gradients: a drifting scale, and a 100x spike every 9th step."""
    generator = torch.Generator().manual_seed(1000 + step)
    scale = (1.0 + 0.3 * math.sin(step / 3)) * (100.0 if step % 9 == 8 else 1.0)
    return [torch.randn(s, generator=generator) * scale for s in shapes]


def poisoned(step, bad):
    grads = gradients(step)
    grads[1][0] = bad
    return grads


def give(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def same(a, b) -> bool:
    """Bit for bit, NaN where NaN."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


def state_of(clip) -> dict:
    state = {k: v.clone() for k, v in clip.state_dict().items()} if hasattr(clip, "state_dict") else {}
    if isinstance(clip, SkipStepOnSpike):
        state.update({f"clip.{k}": v.clone() for k, v in clip.clip.state_dict().items()})
    return state


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert same(value, b[key]), key


# ---- item 8: a NaN or inf step -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("bad_step", [1, 5], ids=["in-warmup", "after-warmup"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", STATEFUL)
def test_skip_leaves_a_nonfinite_step_out_as_if_it_had_not_been_made(name, form, bad_step, bad):
    """The clip under "skip" meets a NaN or inf step that a twin never sees: that call changes no gradient
    and no statistic and refuses the step; every other call is the twin's, bit for bit."""
    skipping, twin = STATEFUL[name](nonfinite="skip"), STATEFUL[name]()
    params, twin_params = make_params(), make_params()
    clipped = 0
    for step in range(20):
        if step == bad_step:
            grads = poisoned(step, bad)
            give(params, grads)
            before = state_of(skipping)
            skipping(FORMS[form](params))
            assert all(same(p.grad, g) for p, g in zip(params, grads)), "a gradient was scaled"
            assert_same_state(state_of(skipping), before)
            assert bool(skipping.found_nonfinite) and bool(skipping.step_refused())
            continue
        grads = gradients(step)
        give(params, grads)
        give(twin_params, grads)
        skipping(FORMS[form](params))
        twin(FORMS[form](twin_params))
        for p, q in zip(params, twin_params):
            assert torch.equal(p.grad, q.grad), f"step {step}"
        assert not bool(skipping.found_nonfinite)
        if isinstance(twin, SkipStepOnSpike):
            assert torch.equal(skipping.skip, twin.skip), f"step {step}"
        clipped += any(not torch.equal(p.grad, g) for p, g in zip(twin_params, grads))
    assert_same_state(state_of(skipping), state_of(twin))
    assert int(skipping.nonfinite_steps) == 1 and clipped > 0


@pytest.mark.parametrize("form", FORMS)
def test_zscore_after_a_nan_step_still_clips_a_spike(form):
    """The issue's run: warm-up, a NaN step, then a 100x spike with max_grad_norm=None. zclip's rule
    ("propagate") keeps mean and var NaN and lets the spike through; "skip" clips it."""
    clip = ClipGradByZScore(warmup_steps=3, max_grad_norm=None, nonfinite="skip")
    reference = ClipGradByZScore(warmup_steps=3, max_grad_norm=None)
    params, twin = make_params(), make_params()
    for step in range(9):  # the spike last
        grads = poisoned(step, math.nan) if step == 5 else gradients(step)
        give(params, grads)
        give(twin, grads)
        clip(FORMS[form](params))
        reference(FORMS[form](twin))
    assert math.isfinite(clip.mean.item()) and math.isfinite(clip.var.item())
    assert clip.last_clip_coef.item() < 0.1
    assert math.isnan(reference.mean.item()) and reference.last_clip_coef.item() == 1.0


@pytest.mark.parametrize("global_threshold", [False, True], ids=["per-parameter", "global"])
@pytest.mark.parametrize("form", FORMS)
def test_quantile_after_a_nan_step_gives_no_nan_gradient(form, global_threshold):
    """autoclip's rule ("propagate") gives NaN gradients for the next history_length steps; "skip" none."""
    clip = ClipGradByQuantile(0.5, 4, global_threshold=global_threshold, nonfinite="skip")
    params = make_params()
    for step in range(12):
        give(params, poisoned(step, math.nan) if step == 3 else gradients(step))
        clip(FORMS[form](params))
        if step != 3:
            assert all(bool(torch.isfinite(p.grad).all()) for p in params), f"step {step}"
    assert not bool(torch.isnan(clip.history).any())
    assert clip.counts == [11] * len(clip.counts)  # the NaN step recorded nothing


@pytest.mark.parametrize("name", EVERY)
def test_raise_changes_nothing_and_names_the_norm(name):
    clip = EVERY[name](nonfinite="raise")
    params = make_params()
    for step in range(4):
        give(params, gradients(step))
        clip(params)
    before = state_of(clip)
    grads = poisoned(4, math.inf)
    give(params, grads)
    with pytest.raises(
        RuntimeError,
        match=r"norm.* is inf, so it cannot be clipped \(nonfinite='raise'\); no "
        r"gradient or statistic was changed",
    ):
        clip(params)
    assert all(same(p.grad, g) for p, g in zip(params, grads))
    assert_same_state(state_of(clip), before)
    give(params, gradients(5))
    clip(params)  # and it goes on


@pytest.mark.parametrize("name", EVERY)
def test_skip_under_an_optimizer_hook_skips_the_step(name):
    params = make_params()
    optimizer = torchclip.optim.SGD(params, lr=0.1, grad_clip=EVERY[name](nonfinite="skip"))
    for step in range(4):
        give(params, gradients(step))
        optimizer.step()
    weights = [p.detach().clone() for p in params]
    give(params, poisoned(4, math.nan))
    optimizer.step()
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert optimizer.grad_clip_attachment.skipped_steps == 1
    give(params, gradients(5))
    optimizer.step()
    assert not any(torch.equal(p, w) for p, w in zip(params, weights))


def test_unitwise_skip_leaves_a_nonfinite_call_alone():
    """AGC keeps no state: "propagate" (timm's rule) takes no whole-gradient norm, so found_nonfinite
    stays unset; "skip" takes them, and a NaN one leaves every gradient as it was."""
    params = make_params()
    grads = poisoned(0, math.nan)
    give(params, grads)
    skipping = ClipGradByUnitwiseNorm(0.05, nonfinite="skip")
    skipping(params)
    assert all(same(p.grad, g) for p, g in zip(params, grads))
    assert bool(skipping.found_nonfinite) and int(skipping.nonfinite_steps) == 1
    propagating = ClipGradByUnitwiseNorm(0.05)
    propagating(params)
    assert propagating.found_nonfinite is None and torch.isnan(params[1].grad).all()


@pytest.mark.parametrize("name", EVERY)
def test_nonfinite_is_one_of_the_policies(name):
    assert EVERY[name]().nonfinite == "propagate"  # the reference packages' rule (tests/test_adaptive_*.py)
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('propagate', 'raise', 'skip'\), got 'ignore'"):
        EVERY[name](nonfinite="ignore")


def test_norm_ema_an_inf_norm_in_warmup_leaves_every_threshold():
    """In warm-up an inf norm makes the global coefficient 0; min(gamma, 0) held every other tensor's
    threshold at 0 for good, and after warm-up their gradients were scaled to 0 at every step."""
    clip = ClipGradByNormEMA(warmup_steps=3)
    params = make_params()
    give(params, gradients(0))
    clip(params)
    gammas = clip.gammas.clone()
    give(params, poisoned(1, math.inf))
    clip(params)  # "propagate": the gradients are scaled by 0 (the inf one turns NaN)
    assert torch.equal(clip.gammas, gammas)
    for step in range(2, 6):
        give(params, gradients(step))
        clip(params)
    assert all(bool((p.grad != 0).any()) for p in params)


# ---- item 9: objects that are new at every call ---------------------------------------------------------


def detached_pairs(params):
    return [(p.detach(), p.grad) for p in params]


def functional(params):
    """New leaf tensors every call, holding the parameters' values and gradients (torch.func style)."""
    fresh = [p.detach().clone().requires_grad_() for p in params]
    for t, p in zip(fresh, params):
        t.grad = p.grad
    return fresh


NEW_OBJECTS = {"detached pairs": detached_pairs, "functional": functional}


def rows(clip) -> int:
    return clip.history.shape[0] if isinstance(clip, ClipGradByQuantile) else clip.gammas.shape[0]


@pytest.mark.parametrize("make", NEW_OBJECTS)
@pytest.mark.parametrize("name", PER_PARAMETER)
def test_new_objects_every_call_clip_as_the_parameters_do(name, make):
    clip, reference = PER_PARAMETER[name](), PER_PARAMETER[name]()
    params, twin = make_params(), make_params()
    clipped = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(20):
            grads = gradients(step)
            give(params, grads)
            give(twin, grads)
            clip(NEW_OBJECTS[make](params))
            reference(twin)
            for p, q in zip(params, twin):
                assert torch.equal(p.grad, q.grad), f"step {step}"
            clipped += step >= 3 and any(not torch.equal(q.grad, g) for q, g in zip(twin, grads))
    assert rows(clip) == len(SHAPES)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "is a new object and none of the last call's is alive" in messages[0]
    assert clipped > 0


@pytest.mark.parametrize("name", PER_PARAMETER)
def test_rows_of_dead_objects_are_reused_and_start_anew(name):
    """A new model every call, its shapes not the last one's (so not matched by position): the state keeps
    one row per live parameter, and a parameter's first call is its first (Quantile: nothing clipped)."""
    clip = PER_PARAMETER[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(12):
            shapes = SHAPES if step % 2 else SHAPES[::-1]
            params = make_params(step, shapes)
            grads = gradients(step, shapes)
            give(params, grads)
            clip(params)
            assert rows(clip) == len(shapes), f"step {step}"
            if isinstance(clip, ClipGradByQuantile):
                assert all(torch.equal(p.grad, g) for p, g in zip(params, grads)), f"step {step}"


@pytest.mark.parametrize("name", PER_PARAMETER)
def test_a_list_of_another_length_starts_anew(name):
    """New objects every call whose list changed length: no position to go by, so fresh rows (Quantile:
    nothing clipped), in the dead objects' place."""
    clip = PER_PARAMETER[name]()
    params = make_params()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(6):
            give(params, gradients(step))
            clip(detached_pairs(params))
        grads = gradients(6)
        give(params, grads)
        clip(detached_pairs(params[:2]))
    assert rows(clip) == len(SHAPES)
    if isinstance(clip, ClipGradByQuantile):
        assert clip.counts == [1, 1, 6]
        assert all(torch.equal(p.grad, g) for p, g in zip(params[:2], grads))


@pytest.mark.parametrize("name", PER_PARAMETER)
def test_two_live_models_keep_their_own_rows_without_a_warning(name):
    """Parameters that stay alive are never matched by position, even where shapes match. (No warm-up for
    NormEMA: its step count is the clip's, which serves both models.)"""
    make = {"quantile": STATEFUL["quantile"], "norm-ema": lambda: ClipGradByNormEMA(warmup_steps=0)}[name]
    clip = make()
    models = [make_params(0), make_params(1)]
    own = [make(), make()]
    twins = [make_params(0), make_params(1)]
    clipped = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(16):
            for params, reference, twin in zip(models, own, twins):
                grads = gradients(step + 100 * (params is models[1]))
                give(params, grads)
                give(twin, grads)
                clip(params)
                reference(twin)
                assert all(torch.equal(p.grad, q.grad) for p, q in zip(params, twin)), f"step {step}"
                clipped += any(not torch.equal(q.grad, g) for q, g in zip(twin, grads))
    assert rows(clip) == 2 * len(SHAPES) and clipped > 0


@pytest.mark.parametrize("copier", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", PER_PARAMETER)
def test_a_copy_of_a_clip_matching_by_position_continues_bit_for_bit(name, copier):
    clip = PER_PARAMETER[name]()
    params = make_params()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(6):
            give(params, gradients(step))
            clip(detached_pairs(params))
        copied = copy.deepcopy(clip) if copier == "deepcopy" else pickle.loads(pickle.dumps(clip))
        for step in range(6, 14):
            grads = gradients(step)
            give(params, grads)
            clip(detached_pairs(params))
            expected = [p.grad.clone() for p in params]
            give(params, grads)
            copied(detached_pairs(params))
            assert all(torch.equal(p.grad, e) for p, e in zip(params, expected)), f"step {step}"
    assert_same_state(state_of(copied), state_of(clip))
