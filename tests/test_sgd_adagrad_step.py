"""torchclip.sgd_step_ and torchclip.adagrad_step_ (torchclip.optim's SGD and Adagrad steps under a folded
clip): torch's fused CPU steps, arithmetic for arithmetic, except that the gradients are only read.

Oracle: torch's own fused kernels (torch._fused_sgd_, torch._fused_adagrad_) on copies of the same tensors;
for float16 and bfloat16, torch's float32 kernel on float32 copies, each stored value rounded once to the
storage type, which is torch 2.14's 16-bit arithmetic (float32 opmath) on every torch: torch before 2.14
skips whole 16-bit vectors in its fused SGD (pytorch#191763)."""

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from testing import assert_cuda_step_matches, cuda_only, fused_like_torch, torch_fused_sgd_steps_16_bit_vectors

import torchclip
from torchclip import ClipGradByGlobalNorm, _ops, _read_only_step

SIZES = (1, 15, 16, 17, 100, 1024, 70000)
WHOLE_VECTORS = (16, 1024)  # no tail: torch's vector loop only
SIXTEEN_BIT = (torch.float16, torch.bfloat16)

# A few roundings of the storage type at the inputs' magnitude (parameters ~1, gradients ~3, Adagrad's sums
# ~10): tails go through torch's scalar loop, which its compiler contracts differently from its vectors, and
# without FMA (DEFAULT) nothing is fused as in torch's AVX kernels, so a product's rounding (weight decay,
# g * g) carries into the sum: up to 3 float32 units at 16 measured.
TOLERANCE = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-6},
    torch.float64: {"rtol": 2e-15, "atol": 2e-15},
    torch.bfloat16: {"rtol": 8e-3, "atol": 1e-3},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
}


def draw(dtype, seed, scale=1.0, positive=False, sizes=SIZES):
    generator = torch.Generator().manual_seed(seed)
    return [((torch.rand if positive else torch.randn)(n, generator=generator) * scale).to(dtype) for n in sizes]


def copies(lists):
    return [[t.clone() for t in tensors] for tensors in lists]


def through_float32(kernel, lists, dtype, **kwargs):
    """torch's fused `kernel` on `lists`; 16-bit lists on float32 copies, rounded back once."""
    widened = [
        [t.float() for t in tensors] if dtype in SIXTEEN_BIT and tensors and tensors[0].dtype == dtype else tensors
        for tensors in lists
    ]
    kernel(*widened, **kwargs)
    for tensors, wide in zip(lists, widened):
        if wide is not tensors:
            for t, w in zip(tensors, wide):
                t.copy_(w)


def assert_matches(ours, theirs, which, dtype, cpu_capability):
    for position in which:
        for n, a, b in zip(SIZES, ours[position], theirs[position]):
            torch.testing.assert_close(a, b, **TOLERANCE[dtype])
            if fused_like_torch(cpu_capability) and n in WHOLE_VECTORS:
                assert torch.equal(a, b), (position, n)  # torch's vector arithmetic, bit for bit


# ---- sgd_step_ ---------------------------------------------------------------------------------------

SGD_OPTIONS = [
    options
    for options in itertools.product([0.0, 0.9], [0.0, 0.3], [False, True], [0.0, 0.1], [False, True], [None, 1.7])
    if options[0] or not (options[1] or options[2])  # dampening and nesterov only with momentum
]


def sgd_both(dtype, options, first_step, device="cpu"):
    """One step of sgd_step_ and of torch's fused kernel (on the CPU through float32 for 16-bit data, see above)
    on copies of the same lists on `device`, the gradients only read by ours: (ours, theirs)."""
    momentum, dampening, nesterov, weight_decay, maximize, scale = options
    lists = [[t.to(device) for t in draw(dtype, seed, magnitude)] for seed, magnitude in ((0, 1.0), (1, 3.0), (2, 0.1))]
    if not momentum:
        lists[2] = []
    ours, theirs = copies(lists), copies(lists)
    hyperparameters = {
        "lr": 1e-2,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "dampening": dampening,
        "nesterov": nesterov,
        "maximize": maximize,
        "is_first_step": first_step and momentum != 0,
        "grad_scale": None if scale is None else torch.tensor(scale, device=device),
    }
    assert _ops.sgd_step_(*ours, **hyperparameters)
    if device == "cpu":
        through_float32(torch._fused_sgd_, theirs, dtype, **hyperparameters)
    else:
        torch._fused_sgd_(*theirs, **hyperparameters)
    assert all(torch.equal(a, b) for a, b in zip(ours[1], lists[1]))  # the gradients: only read
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("first_step", [False, True])
def test_sgd_matches_torchs_fused_step_and_never_writes_gradients(dtype, first_step, cpu_capability):
    for options in SGD_OPTIONS:
        ours, theirs = sgd_both(dtype, options, first_step)
        assert_matches(ours, theirs, (0, 2), dtype, cpu_capability)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("first_step", [False, True])
def test_cuda_sgd_matches_torchs_fused_cuda_step_and_never_writes_gradients(dtype, first_step):
    """torch's fused CUDA SGD (float opmath for 16-bit storage too), within a rounding of the storage type."""
    for options in SGD_OPTIONS:
        ours, theirs = sgd_both(dtype, options, first_step, "cuda")
        assert_cuda_step_matches(ours, theirs, (0, 2), TOLERANCE[dtype], options)


@cuda_only
def test_cuda_sgd_found_inf_leaves_everything():
    lists = [[t.cuda() for t in draw(torch.float32, seed)] for seed in range(3)]
    before = copies(lists)
    hyperparameters = {"lr": 0.1, "weight_decay": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": True}
    found_inf = torch.tensor(1.0, device="cuda")
    assert _ops.sgd_step_(*lists, maximize=False, is_first_step=False, found_inf=found_inf, **hyperparameters)
    assert all(torch.equal(a, b) for x, y in zip(lists, before) for a, b in zip(x, y))


def test_sgd_found_inf_leaves_everything():
    lists = [draw(torch.float32, 0), draw(torch.float32, 1), draw(torch.float32, 2)]
    before = copies(lists)
    hyperparameters = {"lr": 0.1, "weight_decay": 0.1, "momentum": 0.9, "dampening": 0.0, "nesterov": True}
    assert _ops.sgd_step_(*lists, maximize=False, is_first_step=False, found_inf=torch.tensor(1.0), **hyperparameters)
    assert all(torch.equal(a, b) for x, y in zip(lists, before) for a, b in zip(x, y))


# Scales whose reciprocals round far from 1 / scale, powers of two, a subnormal, scales that send quotients out
# of float32's range both ways, and the ones no GradScaler passes but a division still defines.
DIVISION_SCALES = [
    1.7,
    3.0,
    0.1,
    1 / 3,
    float.fromhex("0x1.fffffep0"),
    float.fromhex("0x1.000002p0"),
    2.0**-130,
    2.0**100,
    1e-38,
    3e38,
    0.0,
    math.inf,
    math.nan,
]


@pytest.mark.parametrize("scale", DIVISION_SCALES)
def test_a_scaled_gradient_is_divided_bit_for_bit(scale, cpu_capability):
    """grad_scale divides the gradient as IEEE division does, torch's arithmetic, whatever the kernels do to save the
    divider (a multiply by the reciprocal is off in about a third of these): every quotient, over random bit
    patterns (subnormals, infinities, NaNs), every significand step of a binade's first 2^16 and signed zeros.
    SGD with lr 1 from zero parameters stores -(g / scale)."""
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31 - 1, (60000,), generator=generator, dtype=torch.int32)
    significands = torch.arange(0x3F800000, 0x3F800000 + 2**16, dtype=torch.int32)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 2.0**-149, 3.4028235e38])
    grad = torch.cat([patterns.view(torch.float32), significands.view(torch.float32), specials])
    param = torch.zeros_like(grad)
    grad_scale = torch.tensor(scale, dtype=torch.float32)
    hyperparameters = {"lr": 1.0, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0, "nesterov": False}
    assert _ops.sgd_step_(
        [param], [grad], [], maximize=False, is_first_step=False, grad_scale=grad_scale, **hyperparameters
    )
    expected = torch.zeros_like(grad) - grad / grad_scale  # (adding zero as the step's multiply-add does)
    assert torch.equal(param.isnan(), expected.isnan())
    same = param.view(torch.int32) == expected.view(torch.int32)
    assert bool((same | expected.isnan()).all()), grad[~(same | expected.isnan())][:5]


# ---- adagrad_step_ ------------------------------------------------------------------------------------

ADAGRAD_OPTIONS = list(itertools.product([0.0, 0.1], [0.0, 0.01], [False, True], [None, 1.7], [1e-10, 1e-3]))


def adagrad_lists(dtype, sizes=SIZES):
    steps = [torch.tensor(float(2 + i % 3)) for i in range(len(sizes))]
    return [draw(dtype, 0, sizes=sizes), draw(dtype, 1, 3.0, sizes=sizes), draw(dtype, 2, 0.1, True, sizes), steps]


def torch_fused_adagrad(lists, dtype, found_inf=None, **hyperparameters):
    torch._foreach_add_(lists[3], 1)  # as torch.optim.adagrad._fused_adagrad, before its kernel
    through_float32(torch._fused_adagrad_, lists, dtype, found_inf=found_inf, **hyperparameters)
    if found_inf is not None:
        torch._foreach_sub_(lists[3], [found_inf] * len(lists[3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_adagrad_matches_torchs_fused_step_and_never_writes_gradients(dtype, cpu_capability):
    for weight_decay, lr_decay, maximize, scale, eps in ADAGRAD_OPTIONS:
        lists = adagrad_lists(dtype)
        ours, theirs = copies(lists), copies(lists)
        hyperparameters = {
            "lr": 1e-2,
            "lr_decay": lr_decay,
            "weight_decay": weight_decay,
            "eps": eps,
            "maximize": maximize,
            "grad_scale": None if scale is None else torch.tensor(scale),
        }
        assert _ops.adagrad_step_(*ours, **hyperparameters)
        torch_fused_adagrad(theirs, dtype, **hyperparameters)
        assert all(torch.equal(a, b) for a, b in zip(ours[1], lists[1]))
        assert all(torch.equal(a, b) for a, b in zip(ours[3], theirs[3]))  # the step counts
        assert_matches(ours, theirs, (0, 2), dtype, cpu_capability)


def test_adagrad_found_inf_leaves_everything_and_zero_steps():
    hyperparameters = {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1, "eps": 1e-10, "maximize": False}
    ours = adagrad_lists(torch.float32)
    before = copies(ours)
    assert _ops.adagrad_step_(*ours, found_inf=torch.tensor(1.0), **hyperparameters)
    assert all(torch.equal(a, b) for x, y in zip(ours, before) for a, b in zip(x, y))
    theirs = copies(ours)
    assert _ops.adagrad_step_(*ours, found_inf=torch.tensor(0.0), **hyperparameters)
    torch_fused_adagrad(theirs, torch.float32, found_inf=torch.tensor(0.0), **hyperparameters)
    assert all(torch.equal(a, b) for a, b in zip(ours[3], theirs[3]))
    for x, y in zip(ours, theirs):
        for a, b in zip(x, y):
            torch.testing.assert_close(a, b, **TOLERANCE[torch.float32])


# ---- what both decline or refuse ------------------------------------------------------------------------

SGD_HYPERPARAMETERS = {
    "lr": 0.1,
    "weight_decay": 0.0,
    "momentum": 0.9,
    "dampening": 0.0,
    "nesterov": False,
    "maximize": False,
    "is_first_step": False,
}
ADAGRAD_HYPERPARAMETERS = {"lr": 0.1, "lr_decay": 0.0, "weight_decay": 0.0, "eps": 1e-10, "maximize": False}


def sgd_call(lists, **kwargs):
    return _ops.sgd_step_(*lists[:3], **SGD_HYPERPARAMETERS, **kwargs)


def adagrad_call(lists, **kwargs):
    return _ops.adagrad_step_(*lists, **ADAGRAD_HYPERPARAMETERS, **kwargs)


STEPPERS = {"sgd_step_": sgd_call, "adagrad_step_": adagrad_call}


@pytest.mark.parametrize("op", sorted(STEPPERS))
@pytest.mark.parametrize("case", ["state_in_other_order", "grad_in_other_order", "float64_step", "float16_scale"])
def test_declines_what_the_kernels_do_not_walk_and_writes_nothing(op, case):
    lists = adagrad_lists(torch.float32, sizes=(12, 5))  # params, grads, a state, steps (sgd takes three)
    kwargs = {}
    if case == "state_in_other_order":
        lists[0][0] = torch.randn(4, 3).t()
        lists[1][0], lists[2][0] = torch.randn(4, 3).t().contiguous(), torch.randn(3, 4)
    elif case == "grad_in_other_order":
        lists[0][0], lists[2][0] = torch.randn(3, 4), torch.randn(3, 4)
        lists[1][0] = torch.randn(4, 3).t()
    elif case == "float64_step":
        if op == "sgd_step_":
            pytest.skip("SGD keeps no step count")
        lists[3][1] = torch.tensor(3.0, dtype=torch.float64)
    else:
        kwargs["grad_scale"] = torch.tensor(2.0, dtype=torch.float16)
    before = copies(lists)
    assert not STEPPERS[op](lists, **kwargs)
    assert all(torch.equal(a, b) for x, y in zip(lists, before) for a, b in zip(x, y))


def test_bad_lists_raise_naming_them_before_any_write():
    lists = adagrad_lists(torch.float32, sizes=(4, 5))
    before = copies(lists)
    with pytest.raises(RuntimeError, match=r"sgd_step_: grads must have one entry per parameter \(2\), got 1"):
        _ops.sgd_step_(lists[0], lists[1][:1], lists[2], **SGD_HYPERPARAMETERS)
    with pytest.raises(RuntimeError, match="momentum_buffers must have no entries with momentum=0, got 2"):
        _ops.sgd_step_(*lists[:3], **{**SGD_HYPERPARAMETERS, "momentum": 0.0})
    with pytest.raises(RuntimeError, match=r"adagrad_step_: state_steps must have one entry per parameter \(2\)"):
        _ops.adagrad_step_(*lists[:3], lists[3][:1], **ADAGRAD_HYPERPARAMETERS)
    assert all(torch.equal(a, b) for x, y in zip(lists, before) for a, b in zip(x, y))


def test_a_step_under_inference_mode_bumps_what_it_writes():
    """As torch's foreach steps do: a graph that saved a parameter or a state tensor notices the write."""
    for op, written in (("sgd_step_", (0, 2)), ("adagrad_step_", (0, 2, 3))):
        lists = adagrad_lists(torch.float32)
        before = [[t._version for t in tensors] for tensors in lists]
        with torch.inference_mode():
            assert STEPPERS[op](lists)
        for which, tensors in enumerate(lists[: 3 if op == "sgd_step_" else 4]):
            bumped = [t._version > v for t, v in zip(tensors, before[which])]
            assert all(bumped) if which in written else not any(bumped), (op, which)


# ---- torchclip.optim.SGD / Adagrad: the folded clip's step -------------------------------------------------


def parameters(dtype=torch.float32, transposed=False):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 40, generator=generator).to(dtype)
    return [
        torch.nn.Parameter(weight.t() if transposed else weight),
        torch.nn.Parameter(torch.randn(33, generator=generator).to(dtype)),
    ]


FOLDED = {
    "SGD": {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1},
    "SGD-no-momentum": {"lr": 1e-2, "maximize": True},
    "Adagrad": {"lr": 1e-2, "lr_decay": 0.01, "weight_decay": 0.1},
}


@pytest.mark.parametrize("transposed", [False, True], ids=["kernels", "declined_group_takes_torchs_step"])
@pytest.mark.parametrize("name", sorted(FOLDED))
def test_folded_step_is_clip_then_step_with_gradients_unwritten(name, transposed, kernel_spy):
    optimizer_class = getattr(torch.optim, name.split("-")[0])
    if optimizer_class not in _read_only_step.STEPS:
        pytest.skip(f"torch's {optimizer_class.__name__} internals differ: torch's own step runs")
    ours, theirs = parameters(transposed=transposed), parameters(transposed=transposed)
    clip = ClipGradByGlobalNorm(1.0)
    optimizer = getattr(torchclip.optim, optimizer_class.__name__)(ours, fused=True, grad_clip=clip, **FOLDED[name])
    if not torchclip.optim._steps_fused(optimizer):
        pytest.skip(f"torch's fused {name} does not read grad_scale here (torch 2.11's Adagrad): not folded")
    reference = optimizer_class(theirs, fused=True, **FOLDED[name])
    hooks = []
    optimizer.register_step_pre_hook(lambda *args: hooks.append("pre"))
    optimizer.register_step_post_hook(lambda *args: hooks.append("post"))
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=generator) * 5 for p in ours]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        assert optimizer.step(lambda: torch.tensor(3.0)).item() == 3.0
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
        for q in theirs:
            q.grad.mul_(1.0 / max(norm.item(), 1.0))
        reference.step()
        for p, q, g in zip(ours, theirs, grads):
            if transposed:  # a group the kernels decline gets torch's step, which writes them back clipped
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
            else:  # read only by torchclip's step
                assert torch.equal(p.grad, g)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert hooks == ["pre", "post"] * 4
    for p, q in zip(ours, theirs):  # the state torch's step keeps
        for key, value in reference.state[q].items():
            torch.testing.assert_close(optimizer.state[p][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.optim.SGD not in _read_only_step.STEPS, reason="torch's SGD internals differ")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_16_bit_sgd_steps_every_element(dtype):
    """torch before 2.14 leaves whole 16-bit vectors unstepped in its fused SGD; torchclip's step moves them
    as 2.14's does (and as the float32 step on float32 copies, rounded once)."""
    ours, wide = parameters(dtype), [torch.nn.Parameter(p.detach().float()) for p in parameters(dtype)]
    optimizer = torchclip.optim.SGD(ours, lr=0.1, momentum=0.9, fused=True, grad_clip=ClipGradByGlobalNorm(1e9))
    reference = torch.optim.SGD(wide, lr=0.1, momentum=0.9, fused=True)
    for step in range(3):
        grads = draw(dtype, 10 + step, sizes=[p.numel() for p in ours])
        for p, q, g in zip(ours, wide, grads):
            p.grad, q.grad = g.view(p.shape).clone(), g.view(p.shape).float()
        optimizer.step()
        reference.step()
        with torch.no_grad():
            for q in wide:  # what 16-bit storage keeps
                q.copy_(q.to(dtype))
                reference.state[q]["momentum_buffer"].copy_(reference.state[q]["momentum_buffer"].to(dtype))
    for p, q in zip(ours, wide):
        torch.testing.assert_close(p, q.to(dtype), **TOLERANCE[dtype])
    if not torch_fused_sgd_steps_16_bit_vectors():
        print("torch's own fused 16-bit SGD would leave whole vectors unstepped here (pytorch#191763)")


def test_kill_switches_run_torchs_own_steps():
    code = (
        "import torch, torchclip\n"
        "from torchclip import _read_only_step\n"
        "assert not _read_only_step.STEPS, _read_only_step.STEPS\n"
        "assert 'step' not in vars(torchclip.optim.SGD)\n"
        "p = torch.nn.Parameter(torch.ones(3))\n"
        "opt = torchclip.optim.SGD([p], fused=True, grad_clip=torchclip.ClipGradByGlobalNorm(1.0))\n"
        "p.grad = torch.full((3,), 4.0)\n"
        "opt.step()\n"
        "assert torch.allclose(p.grad, torch.full((3,), 3 ** -0.5))\n"  # written back by torch's kernel
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TORCHCLIP_READ_ONLY_STEP": "0"})
    adam_only = (
        "import torch, torchclip\n"
        "assert set(torchclip._read_only_step.STEPS).isdisjoint({torch.optim.Adam, torch.optim.AdamW})\n"
        "assert 'step' not in vars(torchclip.optim.AdamW)\n"
    )
    subprocess.run([sys.executable, "-c", adam_only], check=True, env={**os.environ, "TORCHCLIP_READ_ONLY_ADAM": "0"})
