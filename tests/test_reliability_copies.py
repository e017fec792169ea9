"""Issue 34, items 6 and 7: copies of clips and of clipped optimizers (deepcopy, pickle, torch.save)
continue as the originals would, bit for bit; the optimizer hook's plan follows every change to what
the optimizer steps."""

import copy
import io
import math
import pickle

import pytest
import torch
from testing import make_tensor

import torchclip
from torchclip import (
    ClipGradBase,
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByNormEMA,
    ClipGradByQuantile,
    ClipGradByUnitwiseNorm,
    ClipGradByValue,
    ClipGradByZScore,
    GradientClipByGlobalNorm,
    GradientClipByNorm,
    GradientClipByValue,
    SkipStepOnSpike,
)


def _not_a_vector(param):  # a need_clip predicate that pickles (a lambda would not)
    return param.dim() != 1


def _torch_round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIERS = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": _torch_round_trip,
}

# Every clip class torchclip exports, set so that a few calls move its statistics (short warm-ups and
# windows, thresholds the gradients below cross).
CLIPS = {
    "ClipGradByValue": lambda: ClipGradByValue(0.5),
    "ClipGradByNorm": lambda: ClipGradByNorm(1.0),
    "ClipGradByGlobalNorm": lambda: ClipGradByGlobalNorm(1.0),
    "GradientClipByValue": lambda: GradientClipByValue(0.5, need_clip=_not_a_vector),
    "GradientClipByNorm": lambda: GradientClipByNorm(1.0, need_clip=_not_a_vector),
    "GradientClipByGlobalNorm": lambda: GradientClipByGlobalNorm(1.0, need_clip=_not_a_vector),
    "ClipGradByZScore": lambda: ClipGradByZScore(z_thresh=1.0, max_grad_norm=None, warmup_steps=3),
    "ClipGradByQuantile": lambda: ClipGradByQuantile(0.5, history_length=4),
    "ClipGradByQuantile(global)": lambda: ClipGradByQuantile(0.5, history_length=4, global_threshold=True),
    "ClipGradByNormEMA": lambda: ClipGradByNormEMA(lambda_rel=0.5, warmup_steps=2),
    "ClipGradByUnitwiseNorm": lambda: ClipGradByUnitwiseNorm(0.05),
    "SkipStepOnSpike": lambda: SkipStepOnSpike(
        ClipGradByNormEMA(lambda_rel=0.5, warmup_steps=2), window=4, sigma_factor=0.5
    ),
}

SHAPES = [(4, 3), (3,), (2, 5)]
SCALES = [1.0, 3.0, 0.5, 20.0, 1.0, 0.2, 50.0, 2.0, 1.0, 7.0, 0.1, 30.0]  # spikes for the adaptive clips


def _params(seed=0):
    return [torch.nn.Parameter(make_tensor(shape, torch.float32, seed + i)) for i, shape in enumerate(SHAPES)]


def _gradient(step, i, shape=None):
    shape = SHAPES[i] if shape is None else shape
    return make_tensor(shape, torch.float32, 100 * step + i, scale=SCALES[step % len(SCALES)] * (i + 1))


def _clip_step(clip, params, step, without=()):
    """Gives params this step's gradients (none for the indices in `without`), clips them, returns them."""
    for i, p in enumerate(params):
        p.grad = None if i in without else _gradient(step, i)
    clip(params)
    return [None if p.grad is None else p.grad.clone() for p in params]


def _same(a, b) -> bool:
    """Bit for bit, NaN where NaN (the history rings start as NaN)."""
    if not isinstance(a, torch.Tensor):
        return a == b
    return (
        isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


def _assert_same_state(original, copied, where="clip"):
    """Every statistic a clip keeps, its inner clip's too (the parameter rows are compared by behaviour)."""
    assert type(copied) is type(original)
    for name, value in vars(original).items():
        if name in ("_rows", "_rows_taken"):
            continue
        other = vars(copied)[name]
        if isinstance(value, ClipGradBase):
            _assert_same_state(value, other, f"{where}.{name}")
        elif hasattr(value, "__dict__") and not callable(value):  # ClipGradByQuantile's sorted window
            assert vars(value) == vars(other), f"{where}.{name}"
        elif value is None or isinstance(value, (torch.Tensor, int, float, str, bool, list)):
            assert _same(value, other), f"{where}.{name}: {value!r} vs {other!r}"
        else:  # the need_clip predicate
            assert other is value, f"{where}.{name}"


def _assert_same_grads(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None and y is None) or torch.equal(x, y), f"{what}: gradient {i}"


def test_every_exported_clip_class_is_covered():
    exported = {
        name
        for name in torchclip.__all__
        if isinstance(getattr(torchclip, name), type)
        and issubclass(getattr(torchclip, name), ClipGradBase)
        and getattr(torchclip, name) is not ClipGradBase
    }  # (the base defines no clip)
    assert exported <= {name.split("(")[0] for name in CLIPS}


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("name", CLIPS)
def test_a_copied_clip_continues_bit_for_bit(name, copier):
    params = _params()
    clip = CLIPS[name]()
    for step in range(5):
        _clip_step(clip, params, step)
    copied = COPIERS[copier](clip)
    _assert_same_state(clip, copied)
    for step in range(5, 12):  # the copy keeps its rows by identity (deepcopy) or takes them again in order (pickle)
        expected = _clip_step(clip, params, step)
        _assert_same_grads(_clip_step(copied, params, step), expected, f"{name} step {step}")
    _assert_same_state(clip, copied)


@pytest.mark.parametrize("name", ["ClipGradByQuantile", "ClipGradByNormEMA", "SkipStepOnSpike"])
def test_a_deepcopy_with_the_parameters_moves_per_parameter_state_to_the_copies(name):
    params = _params()
    clip = CLIPS[name]()
    _clip_step(clip, params, 0, without={0})  # parameter 0 is met last: rows in another order than the list's
    for step in range(1, 5):
        _clip_step(clip, params, step)
    copied_params, copied = copy.deepcopy((params, clip))
    for step in range(5, 12):
        expected = _clip_step(clip, params, step)
        _assert_same_grads(_clip_step(copied, copied_params, step), expected, f"{name} step {step}")
    _assert_same_state(clip, copied)


def test_a_deepcopy_before_its_parameters_keeps_the_original_parameters_rows():
    params = _params()
    clip = CLIPS["ClipGradByQuantile"]()
    for step in range(5):
        _clip_step(clip, params, step)
    copied, _ = copy.deepcopy((clip, params))  # the parameters were not copied yet when the clip was
    _assert_same_grads(_clip_step(copied, params, 5), _clip_step(clip, params, 5), "step 5")


# ---- optimizers ------------------------------------------------------------------------------------


def _optimizer(how, params):
    clip = ClipGradByGlobalNorm(1.0)
    if how == "grad_clip=":
        return torchclip.optim.SGD(params, lr=0.5, momentum=0.9, grad_clip=clip)
    if how == "attach":
        optimizer = torch.optim.SGD(params, lr=0.5, momentum=0.9)
        torchclip.optim.attach(optimizer, clip)
        return optimizer
    if how == "param group":
        return torchclip.optim.SGD([{"grad_clip": clip, "params": params}], lr=0.5, momentum=0.9)
    # a with_grad_clip class that torchclip.optim does not name: pickle must still find it
    return torchclip.optim.with_grad_clip(torch.optim.ASGD)(params, lr=0.5, grad_clip=clip)


def _optimizer_step(optimizer, step):
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        p.grad = _gradient(step, i, p.shape) * 100
    optimizer.step()


@pytest.mark.parametrize("copier", COPIERS)
@pytest.mark.parametrize("how", ["grad_clip=", "attach", "param group", "with_grad_clip(ASGD)"])
def test_a_copied_optimizer_clips_the_copied_parameters(how, copier):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = _optimizer(how, list(model.parameters()))
    for step in range(2):
        _optimizer_step(optimizer, step)
    copied_model, copied = COPIERS[copier]((model, optimizer))
    before = [p.detach().clone() for p in model.parameters()]
    _optimizer_step(copied, 2)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the original's are untouched
    _optimizer_step(optimizer, 2)
    for p, q in zip(model.parameters(), copied_model.parameters()):
        assert torch.equal(p, q)
    clipped = torch.stack([torch.linalg.vector_norm(q.grad) for q in copied_model.parameters()])
    assert torch.linalg.vector_norm(clipped) <= 1.0 + 1e-6  # (the gradients were ~100 times larger)


@pytest.mark.parametrize("copier", COPIERS)
def test_a_copied_optimizer_continues_its_adaptive_clips_bit_for_bit(copier):
    params = _params()
    quantile = ClipGradByQuantile(0.5, history_length=4)
    spike = SkipStepOnSpike(ClipGradByNormEMA(lambda_rel=0.5, warmup_steps=2), window=4, sigma_factor=0.5)
    # the group's clip comes before its parameters in the group: a deepcopy meets it first
    optimizer = torchclip.optim.SGD(
        [{"grad_clip": quantile, "params": params[:2]}, {"params": params[2:]}], lr=0.1, momentum=0.9, grad_clip=spike
    )
    for step in range(6):
        _optimizer_step(optimizer, step)
    copied = COPIERS[copier](optimizer)
    for step in range(6, 12):
        _optimizer_step(optimizer, step)
        _optimizer_step(copied, step)
    copied_params = [p for group in copied.param_groups for p in group["params"]]
    for p, q in zip(params, copied_params):
        assert torch.equal(p, q)
    assert copied.grad_clip_attachment.skipped_steps == optimizer.grad_clip_attachment.skipped_steps > 0
    _assert_same_state(spike, copied.grad_clip)
    _assert_same_state(quantile, copied.param_groups[0]["grad_clip"])


@pytest.mark.parametrize("copier", COPIERS)
def test_a_copied_optimizer_keeps_its_clips_out_of_its_state_dict(copier):
    params = _params()
    clip = ClipGradByNorm(1.0)
    copied = COPIERS[copier](torchclip.optim.SGD([{"params": params, "grad_clip": clip}], lr=0.1))
    buffer = io.BytesIO()
    torch.save(copied.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert "grad_clip" not in state["param_groups"][0]
    copied.load_state_dict(state)
    assert isinstance(copied.param_groups[0]["grad_clip"], ClipGradByNorm)


@pytest.mark.parametrize("copier", COPIERS)
def test_a_copy_of_a_removed_hook_stays_removed(copier):
    params = _params()
    optimizer = torchclip.optim.SGD(params, lr=1.0, grad_clip=ClipGradByGlobalNorm(1.0, nonfinite="skip"))
    for p in params:
        p.grad = torch.full_like(p, math.nan)
    optimizer.step()
    optimizer.grad_clip_attachment.remove()
    copied = COPIERS[copier](optimizer)
    assert copied.grad_clip_attachment.skipped_steps == 1
    copied_params = copied.param_groups[0]["params"]
    for p in copied_params:
        p.grad = torch.full_like(p, 100.0)
    copied.step()  # unclipped, as the original now steps
    assert all(torch.equal(q, p - 100.0) for p, q in zip(params, copied_params))


# ---- the hook's plan -------------------------------------------------------------------------------


def _clipped_by(clip, params, step):
    """What `clip` makes of the step's gradients on copies of params."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return _clip_step(clip, copies, step)


@pytest.mark.parametrize(
    "change",
    [
        "replace the list",
        "replace one parameter",
        "swap a group",
        "set a group's clip",
        "set the default clip",
        "unfuse a group",
    ],
)
def test_the_plan_follows_what_the_optimizer_steps(change):
    old, new = _params(0)[:2], _params(10)[:2]
    fused = change == "unfuse a group"
    optimizer = torchclip.optim.SGD(old, lr=1.0, grad_clip=ClipGradByGlobalNorm(1.0), fused=fused)
    for i, p in enumerate(old):
        p.grad = _gradient(0, i)
    optimizer.step()  # the plan is built and cached
    group, stepped, clip = optimizer.param_groups[0], new, ClipGradByGlobalNorm(1.0)
    if change == "replace the list":
        group["params"] = list(new)
    elif change == "replace one parameter":
        group["params"][1] = new[1]
        stepped = [old[0], new[1]]
    elif change == "swap a group":
        optimizer.param_groups.pop()
        optimizer.add_param_group({"params": list(new)})
    elif change == "set a group's clip":
        clip = group["grad_clip"] = ClipGradByValue(0.01)
        stepped = old
    elif change == "set the default clip":
        clip = optimizer.grad_clip_attachment.clip = ClipGradByValue(0.01)
        stepped = old
    else:
        group["fused"] = False
        stepped = old
    before = [p.detach().clone() for p in stepped]
    expected = _clipped_by(clip, stepped, 3)
    for i, p in enumerate(stepped):
        p.grad = _gradient(3, i)
    optimizer.step()
    for p, b, g in zip(stepped, before, expected):
        assert torch.equal(p, b - g)


def test_the_plan_is_reused_while_nothing_changes():
    optimizer = torchclip.optim.SGD(_params(), lr=1.0, grad_clip=ClipGradByGlobalNorm(1.0))
    attachment = optimizer.grad_clip_attachment
    assert attachment.plan_for(optimizer) is attachment.plan_for(optimizer)


def test_a_group_clip_that_is_not_a_clip_is_named():
    optimizer = torchclip.optim.SGD(_params(), lr=1.0)
    optimizer.param_groups[0]["grad_clip"] = 0.5
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['grad_clip'\] must be a torchclip clip.*got 0.5"):
        optimizer.step()


def test_a_shallow_copy_of_an_optimizer_clips_with_the_same_clip():
    params = _params()
    optimizer = torchclip.optim.SGD(params, lr=1.0, grad_clip=ClipGradByGlobalNorm(1.0))
    copied = copy.copy(optimizer)
    assert copied.param_groups is optimizer.param_groups and copied.grad_clip is optimizer.grad_clip
    _optimizer_step(copied, 0)
    assert torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])) <= 1.0 + 1e-6
