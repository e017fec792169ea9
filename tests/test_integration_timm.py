"""torchclip inside timm's training loop (`pytest -m integration`).

timm needs torchvision, and PyPI's only torchvision for torch 2.13 (0.28.0) is a CUDA build that does not
import on the CPU torch; so this module runs where ./dev test-torch installs requirements-timm.txt beside the
torchvision made for that torch (2.11, in CI), and is skipped where timm is absent.

timm's train.py clips through its loss scaler, timm.utils.NativeScaler, which unscales and then calls
timm.utils.dispatch_clip_grad (timm/utils/clip_grad.py): mode "norm" and "value" call
torch.nn.utils.clip_grad_norm_ / clip_grad_value_ by attribute at call time, so patch() reaches them;
mode "agc" is timm's own adaptive_clip_grad, which patch() leaves alone.
"""

import pytest
import torch

timm = pytest.importorskip("timm")

import torchclip

STEPS = 3

pytestmark = pytest.mark.integration


def timm_run(mode, clip_grad):
    """A few steps of timm's own loop: NativeScaler(loss, optimizer, clip_grad=..., clip_mode=...)."""
    from timm.utils import NativeScaler

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = NativeScaler(device="cpu")
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        images = torch.randn(4, 3, 32, 32, generator=generator)
        targets = torch.randint(0, 5, (4,), generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images), targets) * 100  # large gradients: clipping bites
        scaler(loss, optimizer, clip_grad=clip_grad, clip_mode=mode, parameters=model.parameters())
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode, clip_grad", [("norm", 0.5), ("value", 0.01)])
def test_timm_native_scaler_clips_with_torchclip_under_patch(mode, clip_grad, kernel_spy):
    expected = timm_run(mode, clip_grad)
    unclipped = timm_run(mode, None)
    assert kernel_spy.clips == 0
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-4) for a, b in zip(expected, unclipped))
    with torchclip.patch():
        actual = timm_run(mode, clip_grad)
    assert kernel_spy.clips == STEPS, kernel_spy.calls
    for a, e in zip(actual, expected):
        if mode == "value":
            assert torch.equal(a, e)  # the same clamp
        else:  # torchclip's coefficient comes from a float64 norm, torch's from a float32 one
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-7)


def test_timm_agc_is_not_torchclips(kernel_spy):
    with torchclip.patch():
        timm_run("agc", 0.01)
    assert kernel_spy.clips == 0  # adaptive_clip_grad is timm's own


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_by_unitwise_norm_is_timms_agc(memory_format, norm_type):
    """ClipGradByUnitwiseNorm against timm's own adaptive_clip_grad on a timm model's gradients
    (channels_last: the conv weights take the per-tensor path, not the fused kernel)."""
    from timm.utils import adaptive_clip_grad

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=5).to(memory_format=memory_format)
    images = torch.randn(4, 3, 32, 32).to(memory_format=memory_format)
    (torch.nn.functional.cross_entropy(model(images), torch.arange(4)) * 100).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    adaptive_clip_grad(model.parameters(), clip_factor=0.01, eps=1e-3, norm_type=norm_type)
    expected = [p.grad.clone() for p in model.parameters()]
    assert sum(not torch.equal(e, g) for e, g in zip(expected, grads)) > 10  # AGC bit on many tensors
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    torchclip.ClipGradByUnitwiseNorm(clip_factor=0.01, eps=1e-3, norm_type=norm_type)(model.parameters())
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=2e-6, atol=1e-12)
