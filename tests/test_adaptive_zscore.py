"""ClipGradByZScore against zclip 1.0.0's ZClip, step for step on runs with loss spikes.

The references compute norms in the gradients' dtype and their statistics in Python floats; torchclip
accumulates in float64 on the device, so gradients agree to float32 rounding, not bit for bit."""

import math

import pytest
import torch
from testing import assert_same_grads, gradient_run, model_pair, set_grads

from torchclip.adaptive import ClipGradByZScore
from torchclip.adaptive.zscore import _zclip_rule

zclip = pytest.importorskip("zclip")


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


@pytest.mark.parametrize(
    "settings", ZSCORE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults"
)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zscore_on_16_bit_gradients_against_float64(dtype):
    """The statistics are float64 whatever the gradients' dtype: the norms match a float64 reference."""
    _, model = model_pair()
    model.to(dtype)
    clip = ClipGradByZScore(warmup_steps=2)
    for grads in gradient_run(model, 6):
        set_grads(model, [g.to(dtype) for g in grads])
        expected = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in model.parameters()])
        )
        clip(model.parameters())
        assert clip.last_global_norm.dtype == torch.float64
        assert clip.last_global_norm.item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize(
    "settings", ZSCORE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "defaults"
)
def test_zscore_rule_on_tensors_equals_the_rule_on_floats(settings):
    """The device path (0-d tensors, torch.where) and the host path (Python floats) of the same rule give
    the same numbers, spikes, NaN and infinities included: equal up to float64 rounding, as torch's kernels
    and Python's libm each round an operation within an ulp, not always to the same bits (`** 0.5`, FMA), and
    the variance's subtraction can cancel (an absolute term at the inputs' scale, ~30)."""
    clip = ClipGradByZScore(**settings)
    generator = torch.Generator().manual_seed(0)
    cases = [
        (float(n), float(m), float(v))
        for n, m, v in torch.rand(40, 3, generator=generator, dtype=torch.float64)
        * torch.tensor([30.0, 3.0, 2.0], dtype=torch.float64)
    ]
    cases += [(math.nan, 1.0, 0.5), (math.inf, 1.0, 0.5), (2.0, 1.0, 0.0), (0.0, 0.0, 0.0)]
    for norm, mean, var in cases:
        on_floats = _zclip_rule(clip, norm, mean, var, lambda c, a, b: a if c else b)
        as_tensors = [torch.tensor(x, dtype=torch.float64) for x in (norm, mean, var)]
        on_tensors = _zclip_rule(clip, *as_tensors, torch.where)
        for f, t in zip(on_floats, on_tensors):
            t = t.item()
            assert (math.isnan(f) and math.isnan(t)) or f == t or math.isclose(f, t, rel_tol=1e-13, abs_tol=3e-14), (
                norm,
                mean,
                var,
                on_floats,
                on_tensors,
            )
