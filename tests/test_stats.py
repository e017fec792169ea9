"""torchclip.grad_norm against Lightning's own lightning.pytorch.utilities.grad_norm."""

import pytest
import torch

import torchclip

lightning_grads = pytest.importorskip("pytorch_lightning.utilities.grads")


def model_with_grads(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3), torch.nn.LayerNorm(3))
    model.to(dtype)
    for i, p in enumerate(model.parameters()):
        p.grad = None if i == 2 else torch.randn_like(p) * (10.0 ** (i - 3))  # one without a gradient
    return model


@pytest.mark.parametrize("norm_type", [1, 2, 2.0, 3.5, "inf", float("inf")])
@pytest.mark.parametrize("separator", ["/", "."])
def test_same_keys_and_values_as_lightning(norm_type, separator):
    model = model_with_grads()
    expected = lightning_grads.grad_norm(model, norm_type, separator)
    got = torchclip.grad_norm(model, norm_type, separator)
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype
        torch.testing.assert_close(got[key], value.cpu(), rtol=2e-6, atol=0, msg=key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_against_lightning(dtype):
    model = model_with_grads(dtype)
    expected = lightning_grads.grad_norm(model, 2)
    got = torchclip.grad_norm(model, 2)
    assert list(got) == list(expected)
    tolerance = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}[dtype]
    for key, value in expected.items():
        assert got[key].dtype == value.dtype
        torch.testing.assert_close(got[key], value.cpu(), rtol=tolerance, atol=0, msg=key)


def test_no_gradients_gives_an_empty_dict():
    assert torchclip.grad_norm(torch.nn.Linear(2, 2), 2) == {} == lightning_grads.grad_norm(torch.nn.Linear(2, 2), 2)


@pytest.mark.parametrize("norm_type", [0, -1, "-inf"])
def test_bad_norm_type_raises_lightnings_error(norm_type):
    model = model_with_grads()
    with pytest.raises(ValueError) as ours:
        torchclip.grad_norm(model, norm_type)
    with pytest.raises(ValueError) as theirs:
        lightning_grads.grad_norm(model, norm_type)
    assert str(ours.value) == str(theirs.value)


def test_one_fused_norm_pass():
    """The norms come from torchclip's kernel (one multi_tensor_norm call), not a norm per parameter."""
    model = model_with_grads()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torchclip.grad_norm(model, 2)
    names = [e.name for e in prof.events()]
    assert names.count("torchclip::multi_tensor_norm") == 1
    assert "aten::linalg_vector_norm" in names  # the total, once
    assert names.count("aten::linalg_vector_norm") == 1
