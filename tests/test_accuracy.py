"""Accuracy against float64 and closed-form oracles: the cases where torch's own result is wrong."""

import math

import pytest
import torch
from testing import NORM_RTOL, assert_close_rel, assert_norm_close, make_params, reference_norm

import torchclip
from torchclip import _ops


def constant_params(value, count, dtype, parts=1, device="cpu"):
    params = []
    for _ in range(parts):
        p = torch.nn.Parameter(torch.zeros(count, dtype=dtype, device=device))
        p.grad = torch.full((count,), value, dtype=dtype, device=device)
        params.append(p)
    return params


def test_fp32_gradients_of_1e20_have_their_true_norm(device):
    params = constant_params(1e20, 10, torch.float32, parts=100, device=device)  # true norm 1e20 * sqrt(1000)
    assert torch.nn.utils.get_total_norm([p.grad for p in params]).isinf()  # torch overflows...
    total = torchclip.clip_grad_norm_(params, 1.0)  # ...torchclip does not
    assert_close_rel(total.item(), 1e20 * math.sqrt(1000), 1e-6, "norm")
    for p in params:  # and the clip is right: every element becomes 1 / sqrt(1000)
        torch.testing.assert_close(p.grad, torch.full_like(p.grad, 1 / math.sqrt(1000)), rtol=1e-6, atol=0)


def test_fp32_gradients_of_1e_30_do_not_underflow(device):
    grads = [torch.full((1000,), 1e-30, device=device)]
    assert torch.nn.utils.get_total_norm(grads).item() == 0.0  # torch underflows
    assert_close_rel(torchclip.get_total_norm(grads).item(), 1e-30 * math.sqrt(1000), 1e-6, "tiny")


def test_fp32_subnormal_gradients(device):
    grads = [torch.full((64,), 1e-40, device=device)]  # below float32's smallest normal number
    expected = torch.tensor(1e-40, dtype=torch.float32).double().item() * 8
    assert_close_rel(torchclip.get_total_norm(grads).item(), expected, 1e-6, "subnormal")


def test_fp16_gradients_with_a_norm_above_65504_are_clipped_not_zeroed(device):
    ours = constant_params(1000.0, 100, torch.float16, parts=2, device=device)  # true norm 1000 * sqrt(200)
    ours += constant_params(60000.0, 4, torch.float16, device=device)  # ... and 120000: total 120830 > 65504
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, theirs):
        q.grad = p.grad.clone()
    torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert all((q.grad == 0).all() for q in theirs)  # torch's norm is inf: every gradient zeroed
    total = torchclip.clip_grad_norm_(ours, 1.0)
    assert total.dtype == torch.float16 and total.isinf()  # torch's dtype, where 120830 is inf
    true_norm = math.sqrt(200 * 1000.0**2 + 4 * 60000.0**2)
    for p, value in zip(ours, [1000.0, 1000.0, 60000.0]):
        torch.testing.assert_close(
            p.grad.double(),
            torch.full_like(p.grad, value / true_norm, dtype=torch.float64),
            rtol=NORM_RTOL[torch.float16],
            atol=0,
        )


@pytest.mark.parametrize("value", [1e200, 1e-200, 1e-310])
def test_fp64_squares_outside_float64_range(device, value):
    grads = [torch.full((n,), value, dtype=torch.float64, device=device) for n in (100, 3)]
    expected = value * math.sqrt(103)
    assert_close_rel(torchclip.get_total_norm(grads).item(), expected, 1e-14, f"{value}")


def test_fp64_huge_and_tiny_in_one_tensor(device):
    t = torch.tensor([1e300, 3e-300, 1e300, -1e300], dtype=torch.float64, device=device)
    assert_close_rel(torchclip.get_total_norm([t]).item(), 1e300 * math.sqrt(3), 1e-15, "mixed")


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_50_million_fp32_elements(norm_type):
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(40_000_000, generator=generator), torch.rand(10_000_000, generator=generator) + 1.0]
    reference = reference_norm(tensors, norm_type)
    total = torchclip.get_total_norm(tensors, norm_type)
    assert_norm_close(total, reference, f"50M p={norm_type}")  # within 1e-6, torch's float32 sum is not


def test_bf16_and_fp16_values_are_widened_exactly(device):
    # Every finite bf16 value (a 65536-entry table), and every fp16 value: norms equal float64's.
    for dtype, bits in [
        (torch.bfloat16, torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)),
        (torch.float16, torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)),
    ]:
        values = bits.view(dtype)
        values = values[values.isfinite()].to(device)
        _, per_tensor = _ops.multi_tensor_norm([values], 1.0)  # float64: no rounding to hide behind
        assert_close_rel(per_tensor.item(), values.double().abs().sum().item(), 1e-13, f"{dtype} p=1")
        _, per_tensor = _ops.multi_tensor_norm([values], math.inf)
        assert per_tensor.item() == values.double().abs().max().item()


def test_accuracy_over_many_random_lists(device):
    for seed in range(20):
        params = make_params(
            [((1 + 37 * k,), torch.float32) for k in range(30)], seed=seed, scale=10.0 ** (seed % 7 - 3), device=device
        )
        grads = [p.grad for p in params]
        assert_norm_close(torchclip.get_total_norm(grads), reference_norm(grads, 2.0), f"seed {seed}")


@pytest.mark.parametrize("value", [0.7, 1 / 3, 3.3e-5])
def test_constant_values_round_the_same_way_every_time(device, value):
    # Adversarial for float32 block sums: every square rounds in the same direction.
    t = torch.full((10_000_000,), value, device=device)
    exact = t[0].double().item() * math.sqrt(t.numel())
    _, per_tensor = _ops.multi_tensor_norm([t])
    assert_close_rel(per_tensor.item(), exact, 1e-6, f"constant {value}")
