"""ClipGradByUnitwiseNorm (AGC): timm's adaptive_clip_grad in tests/test_integration_timm.py; here
against the formula in float64, on every path."""

import pytest
import torch

import torchclip
from torchclip.adaptive import ClipGradByUnitwiseNorm


def agc_reference(param, grad, clip_factor, eps, norm_type):
    """timm's rule in float64: per unit (row of dim 0; whole tensor for 0-d/1-d)."""
    p, g = param.detach().double(), grad.double()
    dims = tuple(range(1, p.dim()))
    unit = (
        (lambda t: torch.linalg.vector_norm(t, norm_type))
        if p.dim() <= 1
        else (lambda t: torch.linalg.vector_norm(t, norm_type, dim=dims, keepdim=True))
    )
    max_norm = unit(p).clamp(min=eps) * clip_factor
    grad_norm = unit(g)
    return torch.where(grad_norm < max_norm, g, g * (max_norm / grad_norm.clamp(min=1e-6)))


def agc_model(dtype=torch.float32, memory_format=torch.contiguous_format):
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4), torch.nn.LayerNorm(4)
        )
        .to(dtype)
        .to(memory_format=memory_format)
    )
    for i, p in enumerate(model.parameters()):
        p.grad = (
            (torch.randn(p.shape) * 0.05 * (i + 1)).to(dtype).to(memory_format=memory_format)
            if p.dim() == 4
            else (torch.randn(p.shape) * 0.05 * (i + 1)).to(dtype)
        )
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
