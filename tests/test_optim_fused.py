"""Clipping folded into torch's fused optimizer steps (fused=True): the clip's coefficient goes to the
fused kernel as grad_scale, and nonfinite="skip" as found_inf. Oracle: the same clip applied in place,
by hand, in float64 (Paddle's formula, clip_norm / max(global_norm, clip_norm)), then the same fused
step; with GradScaler, the scaled gradients unscaled as GradScaler.unscale_ does first."""

import math

import pytest
import torch
from testing import (
    assert_close_rel,
    clip_by_hand,
    clone_params,
    cuda_only,
    device_params,
    fused_like_torch,
    no_host_sync,
    requires_cuda,
    torch_fused_sgd_steps_16_bit_vectors,
)

import torchclip
import torchclip.clip as clip_module
import torchclip.optim as clip_optim
from torchclip import ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue

# What a folded step may differ by from clip-then-step: the kernel divides each gradient by the float32
# 1/coefficient where clip-then-step multiplies by the coefficient; one float32 rounding of the
# gradient, which Adam's update carries into the parameters at most as such (measured: <= 2e-7 relative
# after 5 float32 steps). Reduced-precision parameters round each gradient once more in their dtype.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2},
    torch.float16: {"rtol": 2e-3, "atol": 1e-3},
}

FUSED = {
    "Adam": {"lr": 1e-2},
    "AdamW": {"lr": 1e-2, "weight_decay": 0.1},
    "SGD": {"lr": 1e-2, "momentum": 0.9},
    "Adagrad": {"lr": 1e-2},
}

# The optimizers torchclip.optim folds the clip into a read-only step for (adam_step_, sgd_step_, adagrad_step_).
READ_ONLY_STEP = {optimizer_class.__name__ for optimizer_class in torchclip._read_only_step.STEPS}


@pytest.fixture(autouse=True)
def _no_global_default_clip():
    yield
    clip_module._default_clip = None


def parameters(dtype=torch.float32, seed=0, shapes=((64, 32), (32,), (7, 5, 3), (1,)), device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device, dtype)) for shape in shapes]


def gradient_steps(params, steps, seed=1, spread=10.0):
    """Fixed gradients for `steps` steps, large enough that clipping to 1 scales every step."""
    generator = torch.Generator().manual_seed(seed)
    return [[(torch.randn(p.shape, generator=generator) * spread).to(p.dtype) for p in params] for _ in range(steps)]


class NoInPlaceClip(Exception):
    pass


def refuse_in_place_clip(monkeypatch):
    """Folding must compute the norm alone: the in-place clip of ClipGradByGlobalNorm must not run."""

    def refuse(*args, **kwargs):
        raise NoInPlaceClip

    monkeypatch.setattr(ClipGradByGlobalNorm, "_clip_parameters", refuse)
    monkeypatch.setattr(ClipGradByGlobalNorm, "clip_gradients_", refuse)


@pytest.fixture
def forbid_in_place_clip(monkeypatch):
    refuse_in_place_clip(monkeypatch)


# The optimizers whose CUDA step is torchclip's read-only one (adagrad_step_ has no CUDA kernel).
READ_ONLY_STEP_ON_CUDA = READ_ONLY_STEP & {"Adam", "AdamW", "SGD"}


def torch_fuses_on_cuda(optimizer_class) -> bool:
    """Whether torch's fused step of optimizer_class runs on CUDA (torch 2.11's Adagrad refuses at its first step)."""
    p = torch.nn.Parameter(torch.zeros(1, device="cuda"))
    p.grad = torch.zeros_like(p)
    try:
        optimizer_class([p], fused=True).step()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("on", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def test_folded_step_is_clip_then_step(name, dtype, on, monkeypatch):
    steps, clip_norm = 5, 1.0
    ours, theirs = parameters(dtype, device=on), parameters(dtype, device=on)
    if on == "cuda" and name == "Adagrad" and not torch_fuses_on_cuda(torch.optim.Adagrad):
        optimizer = torchclip.optim.Adagrad(ours, fused=True, grad_clip=ClipGradByGlobalNorm(clip_norm), **FUSED[name])
        for p in ours:
            p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError, match="fused=True"):  # as torch's: no fused CUDA Adagrad in torch 2.11
            optimizer.step()
        return
    optimizer = getattr(torchclip.optim, name)(
        ours, fused=True, grad_clip=ClipGradByGlobalNorm(clip_norm), **FUSED[name]
    )
    sgd_skips_vectors = (
        on == "cpu" and name == "SGD" and dtype != torch.float32 and not torch_fused_sgd_steps_16_bit_vectors()
    )
    reference = getattr(torch.optim, name)(theirs, fused=not sgd_skips_vectors, **FUSED[name])
    # A fused step torch does not mark as reading grad_scale (_step_supports_amp_scaling: Adagrad on torch 2.11)
    # is not folded into: the clip runs in place, and must give the same steps.
    if clip_optim._steps_fused(optimizer):
        refuse_in_place_clip(monkeypatch)
    read_only = clip_optim._steps_fused(optimizer) and name in (
        READ_ONLY_STEP if on == "cpu" else READ_ONLY_STEP_ON_CUDA
    )
    for grads in gradient_steps(ours, steps):
        grads = [g.to(on) for g in grads]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        norm = clip_by_hand([q.grad for q in theirs], clip_norm)
        reference.step()
        clip = optimizer.grad_clip
        torch.testing.assert_close(clip.last_global_norm.double(), norm, rtol=1e-5, atol=0)
        norms = torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
        torch.testing.assert_close(clip.last_norms, norms, rtol=1e-6, atol=0)
        torch.testing.assert_close(clip.last_clip_coef, clip_norm / torch.clamp(norm, min=clip_norm), rtol=1e-5, atol=0)
        for p, q, g in zip(ours, theirs, grads):
            if read_only:  # as backward left them
                assert torch.equal(p.grad, g)
            else:  # torch's kernels write back the clipped values, as clip-then-step leaves them
                torch.testing.assert_close(p.grad, q.grad, **TOLERANCE[dtype])
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
def test_folded_scale_on_host_has_the_tensor_ops_bits(dtype, nonfinite):
    # A CPU norm's folded scale is taken in Python floats (no dispatches after the norm's memory pass): the same bits
    # as the tensor ops it stands for, at the clamp's edge, for clip norms float32 cannot hold, and for NaN and inf.
    generator = torch.Generator().manual_seed(0)
    clip_norms = [1.0, 0.1, 1 / 3, 0.7, 2.5e-3, 1e30, 1e300, 3e-39] + (
        10.0 ** (torch.rand(40, generator=generator, dtype=torch.float64) * 12 - 6)
    ).tolist()
    checked = 0
    for clip_norm in clip_norms:
        divisor = torch.tensor(clip_norm, dtype=torch.float64).to(dtype).item()
        near = [divisor * (1 + k * 2.0**-23) for k in range(-3, 4)]
        spread = (10.0 ** (torch.rand(30, generator=generator, dtype=torch.float64) * 16 - 8) * clip_norm).tolist()
        for value in near + spread + [0.0, math.inf, math.nan]:
            norm = torch.tensor(value, dtype=torch.float64).to(dtype)
            finite = torch.isfinite(norm)
            on_host = clip_module._fused_step_scale_on_host(norm.item(), dtype, clip_norm, nonfinite)
            if on_host is None:
                assert divisor == 0.0
                continue
            grad_scale, found_inf = clip_module._fused_step_scale(norm, finite, ~finite, clip_norm, nonfinite, None)
            host_scale, host_coefficient, host_found = on_host
            same = torch.tensor([host_scale, host_coefficient], dtype=torch.float64)
            want = torch.stack([grad_scale.to(torch.float32).double(), (1.0 / grad_scale).to(torch.float64)])
            assert torch.equal(same.isnan(), want.isnan()), (clip_norm, value)
            assert torch.equal(same.nan_to_num(), want.nan_to_num()), (clip_norm, value)
            assert host_found == (not bool(finite))
            assert (found_inf is None) == (nonfinite != "skip")
            checked += 1
    assert checked > 1000


@pytest.mark.parametrize("nonfinite", ["skip", "propagate"])
def test_folded_statistics_are_the_in_place_clips(nonfinite):
    """A folded CPU step makes its statistics on the host (torchclip.clip._fused_step_scale_on_host): the
    documented dtypes and shapes, and the values of the clip run in place, over steps with and without a NaN
    gradient."""
    ours, theirs = parameters(), parameters()
    folded = ClipGradByGlobalNorm(1.0, nonfinite=nonfinite)
    in_place = ClipGradByGlobalNorm(1.0, nonfinite=nonfinite)
    optimizer = torchclip.optim.SGD(ours, lr=1e-3, momentum=0.9, fused=True, grad_clip=folded)
    for index, grads in enumerate(gradient_steps(ours, 4)):
        if index in (1, 2):
            grads[0].view(-1)[index] = float("nan")
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        for p, g in zip(ours, grads):  # folded: the read-only step leaves the gradients as they were
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)
        in_place(theirs)
        # The documented types (the tensor route's: _record_found, add_to_count), which the in-place clip's
        # CPU route makes on the host too.
        for clip in (folded, in_place):
            assert clip.found_nonfinite.dtype == torch.bool and clip.found_nonfinite.shape == ()
            assert clip.nonfinite_steps.dtype == torch.int64 and clip.nonfinite_steps.shape == ()
            assert clip.last_clip_coef.dtype == torch.float64 and clip.last_clip_coef.shape == ()
            assert clip.last_global_norm.dtype == torch.float32 and clip.last_norms.dtype == torch.float64
        for name in ("found_nonfinite", "nonfinite_steps", "last_global_norm", "last_norms", "last_clip_coef"):
            got, expected = getattr(folded, name), getattr(in_place, name)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=0, equal_nan=True, msg=name)
        assert bool(folded.found_nonfinite) == (index in (1, 2))
    assert int(folded.nonfinite_steps) == 2


def test_unclipped_step_is_exactly_the_plain_step():
    ours, theirs = parameters(), parameters()
    optimizer = torchclip.optim.AdamW(ours, lr=1e-2, fused=True, grad_clip=ClipGradByGlobalNorm(1e6))
    reference = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    for grads in gradient_steps(ours, 3):
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
    for p, q in zip(ours, theirs):
        if fused_like_torch(torchclip.get_cpu_capability()):
            assert torch.equal(p, q)  # grad_scale is exactly 1: dividing by it changes no bit
        else:  # (DEFAULT fuses no multiply-add where torch's kernel does: a rounding apart per step)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_no_fold_without_fused_kernel_or_with_per_tensor_clip():
    """Non-fused optimizers, clips other than the global norm, and excluded parameters clip in place."""
    cases = [
        (torchclip.optim.AdamW, {"foreach": True}, ClipGradByGlobalNorm(1.0)),
        (torchclip.optim.AdamW, {"fused": True}, ClipGradByNorm(1.0)),
        (torchclip.optim.AdamW, {"fused": True}, ClipGradByValue(0.5)),
    ]
    for cls, kwargs, clip in cases:
        params = parameters()
        optimizer = cls(params, lr=1e-2, grad_clip=clip, **kwargs)
        assert optimizer.grad_clip_attachment.plan_for(optimizer).folded is None
    params = parameters()
    torchclip.set_need_clip(params[1], False)
    optimizer = torchclip.optim.AdamW(params, lr=1e-2, fused=True, grad_clip=ClipGradByGlobalNorm(1.0))
    assert optimizer.grad_clip_attachment.plan_for(optimizer).folded is None
    torchclip.set_need_clip(params[1], True)  # a new mark: the plan is rebuilt, and now folds
    assert optimizer.grad_clip_attachment.plan_for(optimizer).folded is optimizer.grad_clip


def test_excluded_parameter_keeps_its_gradient_on_a_fused_optimizer():
    params, theirs = parameters(), parameters()
    torchclip.set_need_clip(params[1], False)
    optimizer = torchclip.optim.Adam(params, lr=1e-2, fused=True, grad_clip=ClipGradByGlobalNorm(1.0))
    reference = torch.optim.Adam(theirs, lr=1e-2, fused=True)
    grads = gradient_steps(params, 1)[0]
    for p, q, g in zip(params, theirs, grads):
        p.grad, q.grad = g.clone(), g.clone()
    optimizer.step()
    clip_by_hand([q.grad for i, q in enumerate(theirs) if i != 1], 1.0)
    reference.step()
    assert torch.equal(params[1].grad, grads[1])
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p, q, **TOLERANCE[torch.float32])


def test_plan_is_cached_and_rebuilt_when_its_sources_change(monkeypatch):
    built = []
    original = clip_optim._Plan.__init__

    def counting(self, optimizer, default):
        built.append(1)
        original(self, optimizer, default)

    monkeypatch.setattr(clip_optim._Plan, "__init__", counting)
    params = parameters()
    optimizer = torchclip.optim.SGD(params[:3], lr=1e-2, fused=True, grad_clip=ClipGradByGlobalNorm(1.0))

    def step():
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()

    for _ in range(3):
        step()
    assert len(built) == 1
    params[0].grad = None  # which gradients are None needs no new plan: the walk skips them
    optimizer.step()
    assert len(built) == 1
    optimizer.add_param_group({"params": [params[3]]})
    step()
    assert len(built) == 2
    torchclip.set_need_clip(params[2], False)
    step()
    assert len(built) == 3
    torchclip.set_gradient_clip(ClipGradByValue(1.0), param_list=[params[3]])
    step()
    assert len(built) == 4
    torchclip.exclude_from_clipping(torch.nn.Linear(2, 2))
    step()
    assert len(built) == 5


def test_skip_becomes_found_inf(forbid_in_place_clip):
    params = parameters()
    optimizer = torchclip.optim.AdamW(
        params, lr=1e-2, fused=True, grad_clip=ClipGradByGlobalNorm(1.0, nonfinite="skip")
    )
    grads = gradient_steps(params, 2)
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    optimizer.step()
    before = [p.detach().clone() for p in params]
    bad = [g.clone() for g in grads[1]]
    bad[2][0, 0, 0] = float("inf")
    for p, g in zip(params, bad):
        p.grad = g.clone()
    optimizer.step()
    for p, b, g in zip(params, before, bad):
        assert torch.equal(p, b)  # the fused kernel skipped the update
        assert torch.equal(p.grad, g)  # and left the gradients alone
    assert all(optimizer.state[p]["step"].item() == 1 for p in params)  # torch rolled the step count back
    assert optimizer.grad_clip_attachment.skipped_steps == 1
    assert bool(optimizer.grad_clip.found_nonfinite)
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")


def test_raise_leaves_gradients_and_parameters_alone():
    params = parameters()
    optimizer = torchclip.optim.Adam(
        params, lr=1e-2, fused=True, grad_clip=ClipGradByGlobalNorm(1.0, nonfinite="raise")
    )
    grads = gradient_steps(params, 1)[0]
    grads[0][3, 3] = float("nan")
    for p, g in zip(params, grads):
        p.grad = g.clone()
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="non-finite"):
        optimizer.step()
    for p, b, g in zip(params, before, grads):
        assert torch.equal(p, b)
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, equal_nan=True)


def test_propagate_inf_norm_as_clip_then_step():
    ours, theirs = parameters(), parameters()
    optimizer = torchclip.optim.SGD(ours, lr=1e-2, fused=True, grad_clip=ClipGradByGlobalNorm(1.0))
    reference = torch.optim.SGD(theirs, lr=1e-2, fused=True)
    grads = gradient_steps(ours, 1)[0]
    grads[1][0] = float("inf")
    for p, q, g in zip(ours, theirs, grads):
        p.grad, q.grad = g.clone(), g.clone()
    optimizer.step()
    for q in theirs:  # the coefficient 1 / inf = 0: finite gradients become 0, inf ones NaN
        q.grad.mul_(0.0)
    reference.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, equal_nan=True)


# ---- GradScaler --------------------------------------------------------------------------------------


def scaled_run(dtype, clip, steps, with_inf_at=None, name="AdamW"):
    """torchclip: GradScaler.step on a fused optimizer with grad_clip=. Returns the parameters."""
    params = parameters(dtype)
    optimizer = getattr(torchclip.optim, name)(params, fused=True, grad_clip=clip, **FUSED[name])
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    scaler.scale(torch.ones(()))  # (creates the scale, as the first scaler.scale(loss) would)
    scales = []
    for step, grads in enumerate(gradient_steps(params, steps)):
        scale = scaler.get_scale()
        scales.append(scale)
        for p, g in zip(params, grads):
            p.grad = (g.double() * scale).to(dtype)
            if step == with_inf_at and p.dim() == 2:
                p.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
    return params, scales


def by_hand_run(dtype, clip_in_place, steps, scales, with_inf_at=None, name="AdamW"):
    """The oracle: scaled gradients unscaled as GradScaler.unscale_ does, the clip, the plain fused step;
    a step with a non-finite gradient is skipped (the scaler's decision)."""
    params = parameters(dtype)
    optimizer = getattr(torch.optim, name)(params, fused=True, **FUSED[name])
    for step, (grads, scale) in enumerate(zip(gradient_steps(params, steps), scales)):
        inverse = torch.tensor(scale, dtype=torch.float64).reciprocal().float()
        for p, g in zip(params, grads):
            p.grad = (g.double() * scale).to(dtype)
        if step == with_inf_at:
            continue
        torch._foreach_mul_([p.grad for p in params], inverse)
        clip_in_place([p.grad for p in params])
        optimizer.step()
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_scaler_folded_clip_sees_unscaled_norm(dtype, forbid_in_place_clip):
    steps = 5
    clip = ClipGradByGlobalNorm(1.0)
    ours, scales = scaled_run(dtype, clip, steps, with_inf_at=2)
    assert scales[3] == scales[2] / 2  # the scaler saw the overflow and backed off
    theirs = by_hand_run(dtype, lambda grads: clip_by_hand(grads, 1.0), steps, scales, with_inf_at=2)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **TOLERANCE[dtype])
    # The norm the clip reports is the unscaled one.
    last = [(g.double()) for g in gradient_steps(parameters(dtype), steps)[-1]]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in last]))
    torch.testing.assert_close(clip.last_global_norm.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("nonfinite", ["propagate", "skip", "raise"])
def test_a_step_grad_scaler_skipped_reports_the_nonfinite_norm_as_a_step_without_it(nonfinite, forbid_in_place_clip):
    """found_nonfinite agrees with last_global_norm on a step GradScaler skips (an inf gradient), as it does
    without a scaler; the step is the scaler's to skip, so the clip's policy neither raises nor counts it."""
    results = {}
    for with_scaler in (True, False):
        clip = ClipGradByGlobalNorm(1.0, nonfinite=nonfinite)
        params = parameters(torch.float32)
        optimizer = torchclip.optim.AdamW(params, fused=True, grad_clip=clip, **FUSED["AdamW"])
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if with_scaler else None
        if with_scaler:
            scaler.scale(torch.ones(()))  # (creates the scale, as the first scaler.scale(loss) would)
        for p in params:
            p.grad = torch.ones_like(p) * (1024.0 if with_scaler else 1.0)
            p.grad.view(-1)[0] = math.inf
        try:
            scaler.step(optimizer) if with_scaler else optimizer.step()
        except RuntimeError:
            assert not with_scaler and nonfinite == "raise"
            continue
        results[with_scaler] = clip
        assert math.isinf(clip.last_global_norm.item()) and bool(clip.found_nonfinite)
        assert int(clip.nonfinite_steps) == 1
        skipped_by_the_clip = nonfinite == "skip" and not with_scaler
        assert optimizer.grad_clip_attachment.skipped_steps == int(skipped_by_the_clip)
    assert True in results  # under the scaler, "raise" leaves the overflow to the scaler


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_scaler_unfolded_clip_sees_unscaled_gradients(dtype):
    """A clip that cannot be folded (per element, per tensor) is applied to unscaled gradients."""
    steps = 4
    ours, scales = scaled_run(dtype, ClipGradByValue(0.5), steps, with_inf_at=1)

    def clamp(grads):
        for g in grads:
            g.clamp_(-0.5, 0.5)

    theirs = by_hand_run(dtype, clamp, steps, scales, with_inf_at=1)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, **TOLERANCE[dtype])


@cuda_only
@pytest.mark.parametrize("name", ["Adam", "AdamW"])
@pytest.mark.parametrize("nonfinite", ["propagate", "skip"])
def test_cuda_clip_folded_into_a_fused_step_captures_and_replays(name, nonfinite):
    # The clip's norm, its coefficient as the fused kernel's grad_scale and "skip" as its found_inf, and
    # the step, all in one captured graph; each replay gets its step's gradients copied into the captured
    # ones. Oracle: Paddle's clip in float64, in place, then torch's own fused step, eagerly.
    options = {"lr": 1e-2, "fused": True, "capturable": True, **({"weight_decay": 0.1} if name == "AdamW" else {})}
    ours = device_params(torch.float32, "cuda", seed=71, scale=3.0)
    theirs = clone_params(ours)
    clip = torchclip.ClipGradByGlobalNorm(1.0, nonfinite=nonfinite)
    optimizer = getattr(torchclip.optim, name)(ours, grad_clip=clip, **options)
    reference = getattr(torch.optim, name)(theirs, **options)
    generator = torch.Generator(device="cuda").manual_seed(73)
    steps = [[torch.randn(p.shape, device="cuda", generator=generator) * 3.0 for p in ours] for _ in range(7)]
    nonfinite_steps = {4, 6} if nonfinite == "skip" else set()  # ("propagate" would make every parameter NaN)
    for index in nonfinite_steps:
        steps[index][1][0] = math.nan

    def load(params, grads):
        for p, g in zip(params, grads):
            p.grad.copy_(g)

    def reference_step(grads):
        for q, g in zip(theirs, grads):
            q.grad = g.clone()
        norm = clip_by_hand([q.grad for q in theirs], 1.0).item()
        if math.isfinite(norm):  # (a non-finite norm: no step, the skipped step's gradients are dropped)
            reference.step()
        return norm

    warm_up = 3  # eager steps off the capture, as torch's graph docs ask; they must not sync either
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with no_host_sync("cuda"), torch.cuda.stream(side):
        for grads in steps[:warm_up]:
            load(ours, grads)
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    for grads in steps[:warm_up]:
        reference_step(grads)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        optimizer.step()
    for index, grads in enumerate(steps[warm_up:], warm_up):
        load(ours, grads)
        graph.replay()
        norm = reference_step(grads)
        torch.cuda.synchronize()
        if math.isfinite(norm):  # the clip's statistics are the graph's outputs: each replay refreshes them
            assert_close_rel(clip.last_global_norm.item(), norm, 1e-6)
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {index}")
    # counters accumulate across replays (in place: a captured new tensor would hold one replay's count)
    assert int(clip.nonfinite_steps) == len(nonfinite_steps)
    assert optimizer.grad_clip_attachment.skipped_steps == len(nonfinite_steps)
