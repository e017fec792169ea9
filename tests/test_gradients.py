"""torchclip/_gradients.py: the one place a call's gradients choose their route, and the Python copy of
the kernels' eligibility rule (what dynamo traces) held equal to the C++ one."""

import math

import pytest
import torch
from testing import NORM_RTOL, make_tensor

import torchclip
from torchclip import _C, _ops
from torchclip._gradients import Gradients, Route


class _Subclass(torch.Tensor):
    pass


def _lists():
    """Lists whose eligibility both rules judge: every kind of tensor that is not a subclass or wrapper."""
    dense = make_tensor((4, 5), torch.float32, seed=0)
    return {
        "empty": [],
        "one float32": [dense],
        "mixed dtypes": [dense, make_tensor((3,), torch.float64, 1), make_tensor((2, 2), torch.bfloat16, 2)],
        "a transposed view": [dense.t()],
        "every other element": [dense[:, ::2]],
        "complex": [torch.randn(3, dtype=torch.complex64)],
        "integer": [torch.arange(5)],
        "zero elements": [torch.empty(0, 3)],
        "a negated view": [dense.neg().conj()],
        "sparse COO": [torch.eye(3).to_sparse()],
        "sparse CSR": [torch.eye(3).to_sparse_csr()],
        "sparse among dense": [dense, torch.eye(3).to_sparse()],
        "meta": [torch.empty(3, device="meta")],
        "CPU then meta": [dense, torch.empty(3, device="meta")],
        "meta then CPU": [torch.empty(3, device="meta"), dense],
        "mkldnn": [torch.randn(2, 3).to_mkldnn()] if torch.backends.mkldnn.is_available() else [],
    }


@pytest.mark.parametrize("name", list(_lists()))
@pytest.mark.parametrize("devices", [_ops.KERNEL_DEVICES, ("cpu",)])
def test_the_traced_rule_is_the_kernels_rule(name, devices):
    tensors = _lists()[name]
    assert _ops.kernels_serve_traced(tensors, devices) == _C.kernels_serve(tensors, "cuda" in devices)


def test_the_traced_rule_differs_only_where_dynamo_never_looks():
    # A subclass is refused by the C++ rule; dynamo traces through subclasses and hands the rule plain
    # tensors, so the Python rule never sees one.
    sub = torch.randn(3).as_subclass(_Subclass)
    assert not _C.kernels_serve([sub], False)
    assert _ops.kernels_serve_traced([sub], ("cpu",))


@pytest.mark.parametrize(
    ("name", "route"),
    [
        ("one float32", Route.KERNELS),
        ("mixed dtypes", Route.KERNELS),
        ("every other element", Route.KERNELS),
        ("sparse COO", Route.SPARSE),
        ("sparse among dense", Route.SPARSE),
        ("meta", Route.TORCH),
        ("CPU then meta", Route.TORCH),
        ("sparse CSR", Route.TORCH),
    ],
)
def test_each_kind_of_list_takes_its_route(name, route):
    assert Gradients(_lists()[name]).route is route


def test_a_subclass_takes_torchs_route():
    assert Gradients([torch.randn(3).as_subclass(_Subclass)]).route is Route.TORCH


def test_tensors_autograd_tracks_take_torchs_route_for_differentiable_norms():
    leaf = torch.randn(5, requires_grad=True)
    assert Gradients([leaf]).route is Route.TORCH
    norm = Gradients([leaf]).tensor_norms()[0]
    norm.backward()
    torch.testing.assert_close(leaf.grad, (leaf / leaf.norm()).detach(), rtol=1e-6, atol=0)
    with torch.no_grad():
        assert Gradients([leaf]).route is Route.KERNELS


def test_cpu_only_kernels_refuse_other_devices():
    meta = [torch.empty(3, device="meta")]
    assert Gradients(meta, devices=("cpu",)).route is Route.TORCH
    assert Gradients([torch.randn(3)], devices=("cpu",)).route is Route.KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("ord", [1.0, 2.0, math.inf, 3.0])
def test_every_route_gives_the_same_norms(dtype, ord, cpu_capability):
    # torch's per-tensor norms accumulate in float64; the kernels' do too, except p = 2 on 16/32-bit data,
    # whose squares are summed in float32 blocks (norm_kernel.cpp): 1e-6, the narrow norms' guarantee.
    rtol = NORM_RTOL[torch.float32] if ord == 2.0 and dtype != torch.float64 else NORM_RTOL[torch.float64]
    tensors = [make_tensor(shape, dtype, seed) for seed, shape in enumerate([(7, 5), (300,), (1,), (100003,)])]
    kernels = Gradients(tensors).tensor_norms(ord)
    tracked = [t.clone().requires_grad_() for t in tensors]
    general = Gradients(tracked).tensor_norms(ord).detach()
    assert Gradients(tracked).route is Route.TORCH
    torch.testing.assert_close(kernels, general, rtol=rtol, atol=0)
    sparse = [t.to_sparse() for t in tensors]
    torch.testing.assert_close(Gradients(sparse).tensor_norms(ord), general, rtol=NORM_RTOL[torch.float64], atol=0)


@pytest.mark.parametrize("route_of", ["kernels", "sparse", "torch"])
def test_scale_and_clamp_write_the_same_on_every_route(route_of, cpu_capability):
    base = [make_tensor((6, 4), torch.float32, 1, scale=3.0), make_tensor((9,), torch.float64, 2, scale=3.0)]
    tensors = {
        "kernels": [t.clone() for t in base],
        "sparse": [t.clone().to_sparse() for t in base],
        "torch": [t.clone().as_subclass(_Subclass) for t in base],
    }[route_of]
    gradients = Gradients(tensors)
    assert gradients.route.value == route_of
    gradients.scale_(torch.tensor([0.5, 2.0], dtype=torch.float64))
    gradients.clamp_(-1.0, 1.0)
    for t, b in zip(tensors, base):
        dense = (t.to_dense() if t.layout == torch.sparse_coo else t).as_subclass(torch.Tensor)
        torch.testing.assert_close(dense, b.clone().mul_(0.5 if b.dtype == torch.float32 else 2.0).clamp_(-1, 1))


def test_the_drop_ins_general_paths_follow_the_routes():
    # Sparse gradients: clipped (torch raises); a meta gradient: torch's own implementation.
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = (torch.ones(4) * 10).to_sparse()
    total = torchclip.clip_grad_norm_([p], 1.0)
    torch.testing.assert_close(total, torch.tensor(20.0))
    torch.testing.assert_close(p.grad.to_dense().norm(), torch.tensor(1.0), rtol=1e-5, atol=0)
    m = torch.nn.Parameter(torch.zeros(4, device="meta"))
    m.grad = torch.empty(4, device="meta")
    assert torchclip.clip_grad_norm_([m], 1.0).device.type == "meta"
