"""The adaptive clips against their reference packages, step for step on runs with loss spikes:
ClipGradByZScore against zclip 1.0.0's ZClip, ClipGradByQuantile against autoclip 0.2.1's QuantileClip.

The references compute norms in the gradients' dtype and their statistics in Python floats; torchclip
accumulates in float64 on the device, so gradients agree to float32 rounding, not bit for bit."""

import copy
import io
import math
import pathlib
import subprocess
import sys

import pytest
import torch

import torchclip
from torchclip.adaptive import ClipGradByQuantile, ClipGradByUnitwiseNorm, ClipGradByZScore

zclip = pytest.importorskip("zclip")
autoclip_torch = pytest.importorskip("autoclip.torch")

SPIKES = {7: 40.0, 31: 25.0, 32: 60.0, 45: 0.02, 50: 300.0}


def model_pair(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    return model, copy.deepcopy(model)


def gradient_run(model, steps, seed=1, spikes=SPIKES):
    """Per step, fresh gradients for every parameter: a slowly drifting scale, with spikes."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [p.shape for p in model.parameters()]
    for step in range(steps):
        scale = (1.0 + 0.3 * math.sin(step / 5)) * spikes.get(step, 1.0)
        yield [torch.randn(s, generator=generator) * scale for s in shapes]


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def assert_same_grads(reference, ours, step):
    for (name, a), b in zip(reference.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=2e-6, atol=1e-9, msg=lambda m, name=name: f"step {step}, {name}: {m}")


ZSCORE_SETTINGS = [
    {},
    {"mode": "percentile"},
    {"clip_option": "mean"},
    {"clip_factor": 0.7, "z_thresh": 2.0},
    {"skip_update_on_spike": True},
    {"max_grad_norm": None},
    {"max_grad_norm": 3.0, "warmup_steps": 5, "alpha": 0.9},
    {"mode": "percentile", "max_grad_norm": None, "skip_update_on_spike": True, "warmup_steps": 3},
]


@pytest.mark.parametrize("settings", ZSCORE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or
                         "defaults")
def test_zscore_matches_zclip_step_for_step(settings):
    reference_model, model = model_pair()
    reference = zclip.ZClip(**settings)
    clip = ClipGradByZScore(**settings)
    clipped_steps = 0
    for step, grads in enumerate(gradient_run(model, 60)):
        set_grads(reference_model, grads)
        set_grads(model, grads)
        norm = reference.step(reference_model)
        clip(model.parameters())
        assert clip.last_global_norm.item() == pytest.approx(norm, rel=1e-6)
        assert_same_grads(reference_model, model, step)
        clipped_steps += bool(clip.last_clip_coef < 1)
        if reference.initialized:
            assert clip.mean.item() == pytest.approx(reference.mean, rel=1e-6)
            assert clip.var.item() == pytest.approx(reference.var, rel=1e-5)
    assert clipped_steps > 0  # the run did exercise clipping


@pytest.mark.parametrize("global_threshold", [False, True])
@pytest.mark.parametrize("quantile,history_length", [(0.9, 1000), (0.5, 4), (0.0, 3), (1.0, 6)])
def test_quantile_matches_autoclip_step_for_step(global_threshold, quantile, history_length):
    reference_model, model = model_pair()
    reference = autoclip_torch.QuantileClip(reference_model.parameters(), quantile=quantile,
                                            history_length=history_length, global_threshold=global_threshold)
    clip = ClipGradByQuantile(quantile, history_length, global_threshold)
    for step, grads in enumerate(gradient_run(model, 40)):
        set_grads(reference_model, grads)
        set_grads(model, grads)
        reference.step()
        clip(model.parameters())
        assert_same_grads(reference_model, model, step)


def test_global_quantile_follows_autoclip_through_a_nan_gradient():
    """A NaN norm in the history makes autoclip's torch.quantile NaN until it leaves the window; the
    global rule on the host keeps NaNs beside its sorted window to do the same."""
    reference_model, model = model_pair()
    reference = autoclip_torch.QuantileClip(reference_model.parameters(), quantile=0.5, history_length=3,
                                            global_threshold=True)
    clip = ClipGradByQuantile(0.5, 3, global_threshold=True)
    saw_nan = saw_finite_after = False
    for step, grads in enumerate(gradient_run(model, 12)):
        if step == 4:
            grads[0][0, 0] = math.nan
        set_grads(reference_model, grads)
        set_grads(model, grads)
        reference.step()
        clip(model.parameters())
        for a, b in zip(reference_model.parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=2e-6, atol=1e-9, equal_nan=True)
        nan_now = bool(next(model.parameters()).grad.isnan().any())
        saw_nan |= nan_now
        saw_finite_after |= saw_nan and not nan_now
    assert saw_nan and saw_finite_after  # the NaN came, and left with the window


def test_quantile_parameter_first_met_later_starts_unclipped():
    """A parameter without a gradient on the first calls gets its own history when it first has one
    (the reference's per-parameter state), and its first clipped call clips nothing."""
    reference_model, model = model_pair()
    reference = autoclip_torch.QuantileClip(reference_model.parameters(), quantile=0.5, history_length=5)
    clip = ClipGradByQuantile(0.5, 5)
    for step, grads in enumerate(gradient_run(model, 12)):
        if step < 4:
            grads = [None if i == 0 else g for i, g in enumerate(grads)]
        for m in (reference_model, model):
            for p, g in zip(m.parameters(), grads):
                p.grad = None if g is None else g.clone()
        reference.step()
        clip(model.parameters())
        for a, b in zip(reference_model.parameters(), model.parameters()):
            if a.grad is not None:
                torch.testing.assert_close(b.grad, a.grad, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("make_clip", [
    lambda: ClipGradByQuantile(0.5, 4, global_threshold=True),
    lambda: ClipGradByZScore(warmup_steps=4, z_thresh=1.5),
], ids=["quantile-global", "zscore"])
def test_the_walk_agrees_with_the_pairs_form(make_clip):
    """CPU parameters take the C++ walk (the quantile: its host window's value as clip_grad_norm_'s
    max_norm; ZScore: the norms, then the host rule); Paddle's pairs take the Python walk and the
    same rules. need_clip marks leave a parameter out of both."""
    _, model = model_pair()
    _, twin = model_pair()
    torchclip.set_need_clip([next(model.parameters()), next(twin.parameters())], False)
    walked, paired = make_clip(), make_clip()
    clipped_steps = 0
    for step, grads in enumerate(gradient_run(model, 40)):
        if step == 20:
            grads[1][0] = math.inf  # an inf norm: recorded, and counted as non-finite
        set_grads(model, grads)
        set_grads(twin, grads)
        walked(model.parameters())
        paired([(p, p.grad) for p in twin.parameters()])
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=1e-9, equal_nan=True)
        assert torch.equal(next(model.parameters()).grad, grads[0])  # need_clip=False: never scaled
        clipped_steps += step < 20 and not torch.equal(list(model.parameters())[1].grad, grads[1])
        assert torch.equal(walked.last_norms, paired.last_norms)
        assert torch.equal(walked.nonfinite_steps, paired.nonfinite_steps)
    for name, value in paired.state_dict().items():
        torch.testing.assert_close(walked.state_dict()[name], value, rtol=0, atol=0, equal_nan=True)
    assert clipped_steps > 0 and walked.nonfinite_steps.item() == 1


@pytest.mark.parametrize("make_clip", [
    lambda: ClipGradByZScore(warmup_steps=4, skip_update_on_spike=True),
    lambda: ClipGradByQuantile(0.8, 5),
    lambda: ClipGradByQuantile(0.8, 5, global_threshold=True),
    lambda: torchclip.ClipGradByNormEMA(warmup_steps=6),
    lambda: torchclip.SkipStepOnSpike(torchclip.ClipGradByGlobalNorm(3.0), window=6),
], ids=["zscore", "quantile", "quantile-global", "norm-ema", "skip-on-spike"])
def test_restored_mid_run_continues_bit_for_bit(make_clip):
    _, model = model_pair()
    straight, restored = make_clip(), make_clip()
    run = list(gradient_run(model, 30))
    for grads in run[:12]:
        set_grads(model, grads)
        straight(model.parameters())
    buffer = io.BytesIO()
    torch.save(straight.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    _, twin = model_pair()
    for grads in run[12:]:
        set_grads(model, grads)
        set_grads(twin, grads)
        straight(model.parameters())
        restored(twin.parameters())
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a.grad, b.grad)
        if isinstance(straight, torchclip.SkipStepOnSpike):
            assert torch.equal(straight.skip, restored.skip)


def test_state_dict_holds_tensors_only():
    for clip in (ClipGradByZScore(), ClipGradByQuantile(), ClipGradByQuantile(global_threshold=True),
                 torchclip.ClipGradByNormEMA()):
        assert all(isinstance(v, torch.Tensor) for v in clip.state_dict().values())


@pytest.mark.parametrize("make_clip,match", [
    (lambda: ClipGradByZScore(alpha=1.0), r"alpha must be in \(0, 1\), got 1.0"),
    (lambda: ClipGradByZScore(alpha=0), r"alpha must be in \(0, 1\), got 0"),
    (lambda: ClipGradByZScore(z_thresh=-1), "z_thresh must be a finite number > 0, got -1"),
    (lambda: ClipGradByZScore(max_grad_norm=0.0), "max_grad_norm must be a finite number > 0, got 0.0"),
    (lambda: ClipGradByZScore(eps=-1e-6), "eps must be a finite number >= 0, got -1e-06"),
    (lambda: ClipGradByZScore(warmup_steps=0), "warmup_steps must be >= 1, got 0"),
    (lambda: ClipGradByZScore(mode="zscores"), "mode must be 'zscore' or 'percentile', got 'zscores'"),
    (lambda: ClipGradByZScore(clip_option="max"), "clip_option must be 'adaptive_scaling' or 'mean', got 'max'"),
    (lambda: ClipGradByZScore(clip_factor=0), "clip_factor must be a finite number > 0, got 0"),
    (lambda: ClipGradByQuantile(quantile=1.5), r"quantile must be in \[0, 1\], got 1.5"),
    (lambda: ClipGradByQuantile(history_length=0), "history_length must be >= 1, got 0"),
    (lambda: torchclip.ClipGradByNormEMA(beta=1.0), r"beta must be in \[0, 1\), got 1.0"),
    (lambda: torchclip.ClipGradByNormEMA(lambda_rel=0), "lambda_rel must be a finite number > 0, got 0"),
    (lambda: torchclip.ClipGradByNormEMA(lambda_abs=math.inf), "lambda_abs must be a finite number > 0, got inf"),
    (lambda: torchclip.ClipGradByNormEMA(warmup_steps=-1), "warmup_steps must be >= 0, got -1"),
])
def test_bad_arguments_name_the_argument(make_clip, match):
    with pytest.raises(ValueError, match=match):
        make_clip()


@pytest.mark.parametrize("make_clip,match", [
    (lambda: ClipGradByZScore(warmup_steps="5"), "warmup_steps must be an int, got '5'"),
    (lambda: ClipGradByQuantile(history_length=2.0), "history_length must be an int, got 2.0"),
    (lambda: ClipGradByQuantile(global_threshold=1), "global_threshold must be a bool, got 1"),
    (lambda: ClipGradByZScore(skip_update_on_spike="yes"), "skip_update_on_spike must be a bool, got 'yes'"),
])
def test_bad_argument_types_name_the_argument(make_clip, match):
    with pytest.raises(TypeError, match=match):
        make_clip()


def test_load_state_dict_refuses_a_mismatched_state_before_changing_anything():
    clip = ClipGradByZScore(warmup_steps=4)
    with pytest.raises(ValueError, match=r"warmup_norms must be a tensor of shape \(4,\), got \(25,\)"):
        clip.load_state_dict(ClipGradByZScore().state_dict())
    assert clip.steps == 0
    with pytest.raises(ValueError, match="expected the keys"):
        ClipGradByQuantile().load_state_dict(clip.state_dict())
    with pytest.raises(ValueError, match="a global clip has one history"):
        ClipGradByQuantile(history_length=1000, global_threshold=True).load_state_dict(
            {"history": torch.zeros(3, 1000, dtype=torch.float64), "counts": torch.zeros(3, dtype=torch.int64)})


@pytest.mark.parametrize("make_clip", [lambda: ClipGradByZScore(warmup_steps=3), lambda: ClipGradByQuantile(0.5, 8),
                                       lambda: torchclip.ClipGradByNormEMA(warmup_steps=3),
                                       lambda: ClipGradByUnitwiseNorm(0.05)],
                         ids=["zscore", "quantile", "norm-ema", "unitwise"])
def test_as_optimizer_hook_equals_calling_the_clip(make_clip):
    """grad_clip= on a torchclip.optim optimizer, need_clip honoured: the same steps as clip-then-step."""
    hooked_model, model = model_pair()
    for m in (hooked_model, model):
        torchclip.set_need_clip(m[0].bias, False)
    hooked = torchclip.optim.SGD(hooked_model.parameters(), lr=0.1, grad_clip=make_clip())
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = make_clip()
    for grads in gradient_run(model, 12):
        set_grads(hooked_model, grads)
        set_grads(model, grads)
        hooked.step()
        clip(model.parameters())
        plain.step()
        for a, b in zip(hooked_model.parameters(), model.parameters()):
            assert torch.equal(a, b)
    assert torch.equal(hooked_model[0].bias.grad, grads[1])  # never clipped: need_clip False


def test_public_names():
    assert torchclip.ClipGradByZScore is ClipGradByZScore
    assert torchclip.ClipGradByQuantile is ClipGradByQuantile
    assert torchclip.ClipGradByUnitwiseNorm is ClipGradByUnitwiseNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zscore_on_16_bit_gradients_against_float64(dtype):
    """The statistics are float64 whatever the gradients' dtype: the norms match a float64 reference."""
    _, model = model_pair()
    model.to(dtype)
    clip = ClipGradByZScore(warmup_steps=2)
    for grads in gradient_run(model, 6):
        set_grads(model, [g.to(dtype) for g in grads])
        expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double())
                                                         for p in model.parameters()]))
        clip(model.parameters())
        assert clip.last_global_norm.dtype == torch.float64
        assert clip.last_global_norm.item() == pytest.approx(expected.item(), rel=1e-12)


def test_readme_example_runs(tmp_path):
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## Adaptive clipping"):]
    code = section[section.index("```python") + len("```python"):section.index("```\n", section.index("```python") + 9)]
    script = tmp_path / "readme_adaptive.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert torch.load(tmp_path / "clip.pt", weights_only=True)["history"].shape == (2, 1000)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("make_clip", [
    lambda: ClipGradByZScore(warmup_steps=3),
    lambda: ClipGradByQuantile(0.9, 4),
    lambda: ClipGradByQuantile(0.9, 4, global_threshold=True),
    lambda: torchclip.ClipGradByNormEMA(warmup_steps=3),
    lambda: ClipGradByUnitwiseNorm(0.05),
    lambda: torchclip.SkipStepOnSpike(torchclip.ClipGradByNormEMA(warmup_steps=2), window=4),
], ids=["zscore", "quantile", "quantile-global", "norm-ema", "unitwise", "skip-on-spike"])
def test_cuda_steps_never_wait_for_the_device(make_clip):
    """No host read of a norm during a step: every call, the first one included, under sync debug mode."""
    _, model = model_pair()
    model.cuda()
    clip = make_clip()
    runs = list(gradient_run(model, 10))
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for grads in runs:
            for p, g in zip(model.parameters(), grads):
                p.grad.copy_(g, non_blocking=True) if p.grad is not None else setattr(p, "grad", g.cuda(non_blocking=True))
            clip(model.parameters())
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    _, reference = model_pair()
    cpu_clip = make_clip()
    for grads in runs:
        set_grads(reference, grads)
        cpu_clip(reference.parameters())
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-5, atol=1e-8)


# ---- ClipGradByUnitwiseNorm (AGC): timm's adaptive_clip_grad in tests/test_integration_timm.py; here
# against the formula in float64, on every path -----------------------------------------------------------


def agc_reference(param, grad, clip_factor, eps, norm_type):
    """timm's rule in float64: per unit (row of dim 0; whole tensor for 0-d/1-d)."""
    p, g = param.detach().double(), grad.double()
    dims = tuple(range(1, p.dim()))
    unit = (lambda t: torch.linalg.vector_norm(t, norm_type)) if p.dim() <= 1 else \
        (lambda t: torch.linalg.vector_norm(t, norm_type, dim=dims, keepdim=True))
    max_norm = unit(p).clamp(min=eps) * clip_factor
    grad_norm = unit(g)
    return torch.where(grad_norm < max_norm, g, g * (max_norm / grad_norm.clamp(min=1e-6)))


def agc_model(dtype=torch.float32, memory_format=torch.contiguous_format):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4),
                                torch.nn.LayerNorm(4)).to(dtype).to(memory_format=memory_format)
    for i, p in enumerate(model.parameters()):
        p.grad = (torch.randn(p.shape) * 0.05 * (i + 1)).to(dtype).to(memory_format=memory_format) \
            if p.dim() == 4 else (torch.randn(p.shape) * 0.05 * (i + 1)).to(dtype)
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_unitwise_norm_against_the_formula_in_float64(norm_type, memory_format, dtype):
    model = agc_model(dtype, memory_format)
    expected = [agc_reference(p, p.grad, 0.01, 1e-3, norm_type) for p in model.parameters()]
    before = [p.grad.clone() for p in model.parameters()]
    torchclip.ClipGradByUnitwiseNorm(0.01, 1e-3, norm_type)(model.parameters())
    changed = 0
    for p, e, b in zip(model.parameters(), expected, before):
        rtol = {torch.float32: 2e-7, torch.float64: 1e-14, torch.bfloat16: 8e-3}[dtype]
        torch.testing.assert_close(p.grad.double(), e, rtol=rtol, atol=0)
        changed += not torch.equal(p.grad, b)
    assert changed >= 3


def test_unitwise_norm_op_serves_the_kernels_and_honours_need_clip():
    model = agc_model()
    torchclip.set_need_clip(model[2].weight, False)
    kept = model[2].weight.grad.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torchclip.ClipGradByUnitwiseNorm()(model.parameters())
    assert [e.name for e in prof.events()].count("torchclip::unitwise_clip_") == 1
    assert torch.equal(model[2].weight.grad, kept)


def test_unitwise_norm_op_errors_name_the_argument():
    g, p = torch.randn(3, 4), torch.randn(4, 3)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has shape \[3, 4\] but params\[0\] has shape \[4, 3\]"):
        torch.ops.torchclip.unitwise_clip_([g], [p], 0.01, 1e-3, 2.0)
    with pytest.raises(RuntimeError, match="got 1 gradients and 2 parameters"):
        torch.ops.torchclip.unitwise_clip_([g], [p, p], 0.01, 1e-3, 2.0)
    with pytest.raises(RuntimeError, match="norm_type must be > 0"):
        torch.ops.torchclip.unitwise_clip_([g], [g.clone()], 0.01, 1e-3, 0.0)
    with pytest.raises(RuntimeError, match=r"grads\[0\] and params\[0\] must be floating point, got Float and Long"):
        torch.ops.torchclip.unitwise_clip_([g], [p.t().to(torch.int64)], 0.01, 1e-3, 2.0)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has elements that share memory"):
        torch.ops.torchclip.unitwise_clip_([torch.ones(3, 1).expand(3, 4)], [g], 0.01, 1e-3, 2.0)
    with pytest.raises(ValueError, match="clip_factor must be a finite number > 0, got 0"):
        ClipGradByUnitwiseNorm(clip_factor=0)
    with pytest.raises(ValueError, match=r"norm_type must be > 0 \(inf allowed\), got -2"):
        ClipGradByUnitwiseNorm(norm_type=-2)


@pytest.mark.parametrize("settings", ZSCORE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or
                         "defaults")
def test_zscore_rule_on_tensors_equals_the_rule_on_floats(settings):
    """The device path (0-d tensors, torch.where) and the host path (Python floats) of the same rule give
    the same numbers, spikes, NaN and infinities included: equal up to float64 rounding, as torch's kernels
    and Python's libm each round an operation within an ulp, not always to the same bits (`** 0.5`, FMA), and
    the variance's subtraction can cancel (an absolute term at the inputs' scale, ~30)."""
    clip = ClipGradByZScore(**settings)
    generator = torch.Generator().manual_seed(0)
    cases = [(float(n), float(m), float(v)) for n, m, v in torch.rand(40, 3, generator=generator, dtype=torch.float64)
             * torch.tensor([30.0, 3.0, 2.0], dtype=torch.float64)]
    cases += [(math.nan, 1.0, 0.5), (math.inf, 1.0, 0.5), (2.0, 1.0, 0.0), (0.0, 0.0, 0.0)]
    for norm, mean, var in cases:
        on_floats = clip._zclip_rule(norm, mean, var, lambda c, a, b: a if c else b)
        as_tensors = [torch.tensor(x, dtype=torch.float64) for x in (norm, mean, var)]
        on_tensors = clip._zclip_rule(*as_tensors, torch.where)
        for f, t in zip(on_floats, on_tensors):
            t = t.item()
            assert (math.isnan(f) and math.isnan(t)) or f == t or math.isclose(f, t, rel_tol=1e-13, abs_tol=3e-14), (
                norm, mean, var, on_floats, on_tensors)


# ---- ClipGradByNormEMA (AdaGC): no package ships it; the paper's algorithm, in float64 ---------------------


class AdaGCReference:
    """Wang et al. 2025 (arXiv:2502.11034), Algorithm 1, in float64, one tensor at a time; plus the
    clip's documented choices where the paper is silent (a tensor met after warm-up, a zero gradient)."""

    def __init__(self, lambda_rel, beta, warmup_steps, lambda_abs):
        self.lambda_rel, self.beta, self.warmup_steps, self.lambda_abs = lambda_rel, beta, warmup_steps, lambda_abs
        self.gamma, self.t = {}, 0

    def step(self, named_grads):
        norms = {k: torch.linalg.vector_norm(g.double()).item() for k, g in named_grads.items()}
        out = {}
        if self.t < self.warmup_steps:
            h = min(self.lambda_abs / math.sqrt(sum(n * n for n in norms.values())), 1.0)
            for k, g in named_grads.items():
                out[k] = g.double() * h
                self.gamma[k] = min(self.gamma.get(k, math.inf), h * norms[k])
        else:
            for k, g in named_grads.items():
                gamma = self.gamma.get(k, math.inf)
                h = 1.0 if norms[k] == 0 else min(self.lambda_rel * gamma / norms[k], 1.0)
                out[k] = g.double() * h
                self.gamma[k] = norms[k] if math.isinf(gamma) else self.beta * gamma + (1 - self.beta) * h * norms[k]
        self.t += 1
        return out


@pytest.mark.parametrize("settings", [{}, {"warmup_steps": 5}, {"warmup_steps": 0, "lambda_rel": 1.2, "beta": 0.5},
                                      {"warmup_steps": 8, "lambda_abs": 0.5, "beta": 0.9}],
                         ids=["defaults", "warmup5", "no-warmup", "warmup8"])
def test_norm_ema_follows_the_papers_algorithm(settings):
    _, model = model_pair()
    clip = torchclip.ClipGradByNormEMA(**settings)
    reference = AdaGCReference(**{"lambda_rel": 1.05, "beta": 0.98, "warmup_steps": 100, "lambda_abs": 1.0, **settings})
    clipped_after_warmup = 0
    for step, grads in enumerate(gradient_run(model, clip.warmup_steps + 30)):
        if step < 3:  # the last layer's bias has no gradient on the first steps: met later
            grads = grads[:-1] + [None]
        for p, g in zip(model.parameters(), grads):
            p.grad = None if g is None else g.clone()
        named = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        expected = reference.step(named)
        clip(model.parameters())
        for n, p in model.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(p.grad.double(), expected[n], rtol=2e-7, atol=0, msg=f"step {step} {n}")
        if step >= clip.warmup_steps:
            clipped_after_warmup += int((clip.last_clip_coef < 1).sum())
    assert clipped_after_warmup > 0


def test_norm_ema_zero_and_nonfinite_gradients():
    w = torch.nn.Parameter(torch.zeros(3))
    clip = torchclip.ClipGradByNormEMA(warmup_steps=1)
    w.grad = torch.ones(3)
    clip([w])
    w.grad = torch.zeros(3)
    clip([w])  # h = 1 where the formula gives 0 / 0
    assert torch.equal(w.grad, torch.zeros(3))
    gamma = clip.gammas.clone()
    w.grad = torch.tensor([1.0, math.inf, 0.0])
    clip([w])
    assert torch.isnan(w.grad).any()  # scaled by 0 as torch scales an inf norm: NaN, propagated
    assert torch.equal(clip.gammas, gamma)  # the inf norm left the threshold as it was


# ---- SkipStepOnSpike: OLMo-core's rule -------------------------------------------------------------------


class OLMoSkipRule:
    """ai2-olmo-core 3.0.0's SkipStepOptimizer bookkeeping and get_step_factor, gradient-norm half
    (olmo_core/optim/skip_step_optimizer.py): a list of at most window + 1 norms, the latest last."""

    def __init__(self, window, sigma_factor):
        self.window, self.sigma_factor, self.norms = window, sigma_factor, []

    def proceeds(self, norm):
        self.norms.append(torch.tensor(norm, dtype=torch.float64))
        while len(self.norms) > self.window + 1:
            self.norms.pop(0)
        if len(self.norms) < max(2, self.window // 2):
            return True
        if len(self.norms) == 2:  # torch warns that one value has no unbiased std; it is NaN
            return False
        std, mean = torch.std_mean(torch.stack(self.norms[:-1]))
        return bool((self.norms[-1] - mean) <= self.sigma_factor * std)


@pytest.mark.parametrize("window,sigma_factor", [(128, 6.0), (8, 3.0), (4, 2.0), (3, 1.0)])
def test_skip_on_spike_decides_as_olmo_core(window, sigma_factor):
    _, model = model_pair()
    skip = torchclip.SkipStepOnSpike(window=window, sigma_factor=sigma_factor)
    reference = OLMoSkipRule(window, sigma_factor)
    skipped = 0
    for step, grads in enumerate(gradient_run(model, 150, spikes={10: 30.0, 40: 0.01, 100: 50.0, 140: 80.0})):
        set_grads(model, grads)
        skip(model.parameters())
        expected = not reference.proceeds(skip.last_global_norm.item())
        assert bool(skip.skip) == expected, step
        skipped += expected
        assert torch.equal(model[0].weight.grad, grads[0])  # deciding changes no gradient
    assert int(skip.skips) == skipped
    assert 0 < skipped < 150


def test_skip_on_spike_skips_the_optimizer_step_and_clips_the_others():
    _, model = model_pair()
    _, twin = model_pair()
    inner = torchclip.ClipGradByGlobalNorm(2.0)
    optimizer = torchclip.optim.SGD(model.parameters(), lr=0.1,
                                    grad_clip=torchclip.SkipStepOnSpike(inner, window=8, sigma_factor=3.0))
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    reference = OLMoSkipRule(8, 3.0)
    reference_clip = torchclip.ClipGradByGlobalNorm(2.0)
    skipped = 0
    for grads in gradient_run(model, 60):
        set_grads(model, grads)
        set_grads(twin, grads)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])).item()
        optimizer.step()
        if reference.proceeds(norm):
            reference_clip(twin.parameters())
            plain.step()
        else:
            skipped += 1
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert optimizer.grad_clip_attachment.skipped_steps == skipped > 0


def test_skip_on_spike_arguments():
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        torchclip.SkipStepOnSpike(window=0)
    with pytest.raises(ValueError, match="sigma_factor must be a finite number > 0, got -1"):
        torchclip.SkipStepOnSpike(sigma_factor=-1)
    with pytest.raises(TypeError, match="clip must be a torchclip clip"):
        torchclip.SkipStepOnSpike(clip=torch.nn.utils.clip_grad_norm_)


@pytest.mark.parametrize("optimizer_class", [torchclip.optim.AdamW, torchclip.optim.SGD])
def test_skip_on_spike_on_a_fused_optimizer_skips_through_found_inf(optimizer_class, monkeypatch):
    """On a fused optimizer the refusal reaches the kernel as found_inf: the hook reads no flag (no
    Tensor.__bool__ during a step), and the steps taken and skipped are the unfused optimizer's."""
    _, fused_model = model_pair()
    _, plain_model = model_pair()
    make = lambda model, fused: optimizer_class(
        model.parameters(), lr=0.05, fused=fused,
        grad_clip=torchclip.SkipStepOnSpike(torchclip.ClipGradByGlobalNorm(5.0), window=6, sigma_factor=2.0))
    fused, plain = make(fused_model, True), make(plain_model, False)
    for grads in gradient_run(fused_model, 30, spikes={12: 40.0, 20: 60.0}):
        set_grads(fused_model, grads)
        set_grads(plain_model, grads)
        with monkeypatch.context() as patched:
            patched.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("a flag was read during a fused step"))
            fused.step()
        plain.step()
        for a, b in zip(fused_model.parameters(), plain_model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert fused.grad_clip_attachment.skipped_steps == plain.grad_clip_attachment.skipped_steps > 0
