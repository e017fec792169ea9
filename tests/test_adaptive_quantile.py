"""ClipGradByQuantile against autoclip 0.2.1's QuantileClip, step for step on runs with loss spikes.

The references compute norms in the gradients' dtype and their statistics in Python floats; torchclip
accumulates in float64 on the device, so gradients agree to float32 rounding, not bit for bit."""

import math

import pytest
import torch
from testing import assert_same_grads, gradient_run, model_pair, set_grads

from torchclip.adaptive import ClipGradByQuantile

autoclip_torch = pytest.importorskip("autoclip.torch")


@pytest.mark.parametrize("global_threshold", [False, True])
@pytest.mark.parametrize("quantile,history_length", [(0.9, 1000), (0.5, 4), (0.0, 3), (1.0, 6)])
def test_quantile_matches_autoclip_step_for_step(global_threshold, quantile, history_length):
    reference_model, model = model_pair()
    reference = autoclip_torch.QuantileClip(
        reference_model.parameters(),
        quantile=quantile,
        history_length=history_length,
        global_threshold=global_threshold,
    )
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
    reference = autoclip_torch.QuantileClip(
        reference_model.parameters(), quantile=0.5, history_length=3, global_threshold=True
    )
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
