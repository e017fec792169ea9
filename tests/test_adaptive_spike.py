"""SkipStepOnSpike: OLMo-core's rule, ai2-olmo-core 3.0.0's SkipStepOptimizer, transcribed."""

import pytest
import torch
from testing import gradient_run, model_pair, set_grads

import torchclip


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
    optimizer = torchclip.optim.SGD(
        model.parameters(), lr=0.1, grad_clip=torchclip.SkipStepOnSpike(inner, window=8, sigma_factor=3.0)
    )
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
        model.parameters(),
        lr=0.05,
        fused=fused,
        grad_clip=torchclip.SkipStepOnSpike(torchclip.ClipGradByGlobalNorm(5.0), window=6, sigma_factor=2.0),
    )
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
