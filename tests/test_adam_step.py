"""torchclip.adam_step_ (torchclip.optim's Adam/AdamW step under a folded clip): torch's fused CPU Adam
step, arithmetic for arithmetic, except that the gradients are only read. Oracle: torch's own fused
kernels (torch._fused_adam_ / torch._fused_adamw_) on copies of the same tensors, after the same
increment of the step counts."""

import itertools

import pytest
import torch
from testing import assert_cuda_step_matches, cuda_only

import torchclip
from torchclip import ClipGradByGlobalNorm, _ops, _read_only_step

# One rounding of the storage type at the inputs' magnitude (gradients ~3, moments ~0.1): the tails
# (elements past the last whole vector) go through torch's scalar loop, which its compiler contracts
# differently from its vector loop, where ours run through the vector code; and without FMA (DEFAULT)
# the lerp is not fused as in torch's AVX kernels, which is what this machine's torch runs.
TOLERANCE = {
    torch.float32: {"rtol": 3e-7, "atol": 5e-7},
    torch.float64: {"rtol": 5e-16, "atol": 1e-15},
    torch.bfloat16: {"rtol": 8e-3, "atol": 1e-3},
    torch.float16: {"rtol": 1e-3, "atol": 1e-3},
}
SIZES = (1, 15, 16, 17, 100, 1024, 70000)
WHOLE_VECTORS = (16, 1024)  # no tail: torch's vector loop only


def state(dtype, amsgrad, seed=0, sizes=SIZES):
    generator = torch.Generator().manual_seed(seed)

    def draw(scale=1.0, positive=False):
        return [((torch.rand if positive else torch.randn)(n, generator=generator) * scale).to(dtype) for n in sizes]

    exp_avg_sqs = draw(1e-2, positive=True)
    max_exp_avg_sqs = [v + draw(1e-2, positive=True)[0][:1] for v in exp_avg_sqs] if amsgrad else []
    steps = [torch.tensor(float(2 + i % 3)) for i in range(len(sizes))]
    return [draw(), draw(3.0), draw(0.1), exp_avg_sqs, max_exp_avg_sqs, steps]


def copies(lists):
    return [[t.clone() for t in tensors] for tensors in lists]


def torch_fused_step(lists, decoupled, grad_scale=None, found_inf=None, **hyperparameters):
    torch._foreach_add_(lists[5], 1)
    (torch._fused_adamw_ if decoupled else torch._fused_adam_)(
        *lists, grad_scale=grad_scale, found_inf=found_inf, **hyperparameters
    )
    if found_inf is not None:
        torch._foreach_sub_(lists[5], [found_inf] * len(lists[5]))


OPTIONS = list(itertools.product([False, True], [False, True], [0.0, 0.1], [False, True], [None, 1.7], [0.9, 0.3]))


def step_both(dtype, options, device="cpu"):
    """One step of adam_step_ and of torch's fused kernel on copies of the same state on `device` (the gradients
    only read by ours, the step counts the same): (ours, theirs)."""
    amsgrad, maximize, weight_decay, decoupled, scale, beta1 = options
    ours = [[t.to(device) for t in tensors] for tensors in state(dtype, amsgrad)]
    theirs = copies(ours)
    gradients = copies([ours[1]])[0]
    grad_scale = None if scale is None else torch.tensor(scale, device=device)
    hyperparameters = {
        "lr": 1e-2,
        "beta1": beta1,
        "beta2": 0.999,
        "weight_decay": weight_decay,
        "eps": 1e-8,
        "amsgrad": amsgrad,
        "maximize": maximize,
    }
    assert _ops.adam_step_(*ours, decoupled_weight_decay=decoupled, grad_scale=grad_scale, **hyperparameters)
    torch_fused_step(theirs, decoupled, grad_scale, **hyperparameters)
    for ours_grad, gradient in zip(ours[1], gradients):
        assert torch.equal(ours_grad, gradient)
    assert all(torch.equal(a, b) for a, b in zip(ours[5], theirs[5]))  # the step counts
    return ours, theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_matches_torchs_fused_step_and_never_writes_gradients(dtype, cpu_capability):
    same_isa_as_torch = cpu_capability == torch.backends.cpu.get_cpu_capability() == "AVX512"
    for options in OPTIONS:
        ours, theirs = step_both(dtype, options)
        for which in (0, 2, 3, 4):  # params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs
            for n, a, b in zip(SIZES, ours[which], theirs[which]):
                torch.testing.assert_close(a, b, **TOLERANCE[dtype])
                if same_isa_as_torch and n in WHOLE_VECTORS:
                    assert torch.equal(a, b), (which, n)  # torch's vector arithmetic, bit for bit


def on_cuda(lists):
    return [[t.cuda() for t in tensors] for tensors in lists]


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cuda_matches_torchs_fused_cuda_step_and_never_writes_gradients(dtype):
    for options in OPTIONS:
        ours, theirs = step_both(dtype, options, "cuda")
        assert_cuda_step_matches(ours, theirs, (0, 2, 3, 4), TOLERANCE[dtype], options)


@cuda_only
def test_cuda_found_inf_leaves_everything_and_zero_steps():
    hyperparameters = {**HYPERPARAMETERS, "amsgrad": True, "decoupled_weight_decay": False}
    ours = on_cuda(state(torch.float32, amsgrad=True))
    before = copies(ours)
    assert _ops.adam_step_(*ours, found_inf=torch.tensor(1.0, device="cuda"), **hyperparameters)
    assert all(torch.equal(a, b) for x, y in zip(ours, before) for a, b in zip(x, y))
    theirs = copies(ours)
    assert _ops.adam_step_(*ours, found_inf=torch.tensor(0.0, device="cuda"), **hyperparameters)
    del hyperparameters["decoupled_weight_decay"]
    torch_fused_step(theirs, False, found_inf=torch.tensor(0.0, device="cuda"), **hyperparameters)
    for x, y in zip(ours, theirs):
        for a, b in zip(x, y):
            torch.testing.assert_close(a, b, **TOLERANCE[torch.float32])


@cuda_only
def test_cuda_declines_host_numbers_and_mixed_devices():
    hyperparameters = {**HYPERPARAMETERS}
    ours = on_cuda(state(torch.float32, amsgrad=False))
    before = copies(ours)
    assert not _ops.adam_step_(*ours, grad_scale=torch.tensor(2.0), **hyperparameters)  # a host grad_scale
    ours[5][0] = ours[5][0].cpu()  # a host step count
    assert not _ops.adam_step_(*ours, **hyperparameters)
    ours[5][0] = ours[5][0].cuda()
    ours[2][1] = ours[2][1].cpu()  # a state off the device
    assert not _ops.adam_step_(*ours, **hyperparameters)
    assert all(torch.equal(a.cpu(), b.cpu()) for x, y in zip(ours, before) for a, b in zip(x, y))


# One step's arguments (AdamW).
HYPERPARAMETERS = {
    "lr": 1e-2,
    "beta1": 0.9,
    "beta2": 0.999,
    "weight_decay": 0.0,
    "eps": 1e-8,
    "amsgrad": False,
    "maximize": False,
    "decoupled_weight_decay": True,
}


def test_found_inf_leaves_everything_and_zero_steps(cpu_capability):
    hyperparameters = {**HYPERPARAMETERS, "amsgrad": True, "decoupled_weight_decay": False}
    ours = state(torch.float32, amsgrad=True)
    before = copies(ours)
    assert _ops.adam_step_(*ours, found_inf=torch.tensor(1.0), **hyperparameters)
    assert all(torch.equal(a, b) for x, y in zip(ours, before) for a, b in zip(x, y))
    theirs = copies(ours)
    assert _ops.adam_step_(*ours, found_inf=torch.tensor(0.0), **hyperparameters)
    del hyperparameters["decoupled_weight_decay"]
    torch_fused_step(theirs, False, found_inf=torch.tensor(0.0), **hyperparameters)
    for x, y in zip(ours, theirs):
        for a, b in zip(x, y):
            torch.testing.assert_close(a, b, **TOLERANCE[torch.float32])


@pytest.mark.parametrize(
    "case", ["state_in_other_order", "grad_in_other_order", "float64_step", "float16_scale", "complex"]
)
def test_declines_what_the_kernels_do_not_walk_and_writes_nothing(case):
    lists = state(torch.float32, amsgrad=False, sizes=(12, 5))
    kwargs = {}
    if case == "state_in_other_order":
        lists[0][0] = torch.randn(4, 3).t()
        lists[1][0], lists[2][0], lists[3][0] = (torch.randn(3, 4) for _ in range(3))
    elif case == "grad_in_other_order":
        lists[0][0], lists[2][0], lists[3][0] = (torch.randn(3, 4) for _ in range(3))
        lists[1][0] = torch.randn(4, 3).t()
    elif case == "float64_step":
        lists[5][1] = torch.tensor(3.0, dtype=torch.float64)
    elif case == "float16_scale":
        kwargs["grad_scale"] = torch.tensor(2.0, dtype=torch.float16)
    else:
        lists = [[torch.randn(3, dtype=torch.complex64)] for _ in range(4)] + [[], [torch.tensor(1.0)]]
    before = copies(lists)
    assert not _ops.adam_step_(*lists, **kwargs, **HYPERPARAMETERS)
    assert all(torch.equal(a, b) for x, y in zip(lists, before) for a, b in zip(x, y))


def test_bad_lists_raise_naming_them_before_any_write():
    lists = state(torch.float32, amsgrad=False, sizes=(4, 5))
    before = copies(lists)
    with pytest.raises(RuntimeError, match=r"grads must have one entry per parameter \(2\), got 1"):
        _ops.adam_step_(lists[0], lists[1][:1], *lists[2:], **HYPERPARAMETERS)
    with pytest.raises(RuntimeError, match="max_exp_avg_sqs must have one entry per parameter with amsgrad=True"):
        _ops.adam_step_(*lists, **{**HYPERPARAMETERS, "amsgrad": True})
    assert all(torch.equal(a, b) for x, y in zip(lists, before) for a, b in zip(x, y))


# ---- torchclip.optim.Adam / AdamW: the folded clip's step -------------------------------------------


def parameters(seed=0, transposed=False):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, 4, generator=generator)
    return [
        torch.nn.Parameter(weight.t() if transposed else weight),
        torch.nn.Parameter(torch.randn(33, generator=generator)),
    ]


def clip_then_step(params, grads, optimizer, clip_norm):
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    coefficient = clip_norm / max(norm.item(), clip_norm)
    for p in params:
        p.grad.mul_(coefficient)
    optimizer.step()


@pytest.mark.skipif(
    torch.optim.AdamW not in _read_only_step.STEPS, reason="torch's Adam internals differ: torch's own step runs"
)
@pytest.mark.parametrize("transposed", [False, True], ids=["kernels", "declined_group_takes_torchs_step"])
def test_folded_adamw_steps_as_clip_then_step_with_hooks_once(transposed, kernel_spy):
    ours, theirs = parameters(transposed=transposed), parameters(transposed=transposed)
    optimizer = torchclip.optim.AdamW(ours, lr=1e-2, weight_decay=0.1, fused=True, grad_clip=ClipGradByGlobalNorm(1.0))
    reference = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    hooks = []
    optimizer.register_step_pre_hook(lambda *args: hooks.append("pre"))
    optimizer.register_step_post_hook(lambda *args: hooks.append("post"))
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=generator) * 5 for p in ours]
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        loss = optimizer.step(lambda: torch.tensor(3.0))
        assert loss.item() == 3.0
        clip_then_step(theirs, grads, reference, 1.0)
        for p, g, q in zip(ours, grads, theirs):
            if transposed:  # a group the kernels decline gets torch's step, which writes them back clipped
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
            else:  # read only by torchclip's step
                assert torch.equal(p.grad, g)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert hooks == ["pre", "post"] * 4
    assert optimizer.state[ours[0]]["step"].item() == 4.0


def test_a_step_under_inference_mode_bumps_what_it_writes():
    """As torch's foreach step does (its fused kernel bumps nothing): a graph that saved a parameter or a
    state tensor notices the write, in inference mode too (the ADInplaceOrView kernel)."""
    ours = state(torch.float32, amsgrad=True)
    before = [[t._version for t in tensors] for tensors in ours]
    with torch.inference_mode():
        assert _ops.adam_step_(*ours, **{**HYPERPARAMETERS, "amsgrad": True})
    for which, tensors in enumerate(ours):
        bumped = [t._version > v for t, v in zip(tensors, before[which])]
        assert all(bumped) if which != 1 else not any(bumped), which  # the gradients are only read
