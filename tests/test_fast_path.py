"""The eager fast path (csrc/walk/): the C++ walk over parameters that calls the CPU ops'
implementations without the dispatcher. Whatever it skips must not be observable: version counters,
dispatch modes, inference mode, torch's warnings, and the switch from borrowed tensors (GIL held) to
owned ones (GIL released) for large workloads."""

import warnings

import pytest
import torch
from testing import (
    NORM_RTOL,
    assert_close_rel,
    assert_norm_close,
    clone_params,
    cuda_only,
    device_params,
    make_params,
    reference_norm,
)
from torch.utils._python_dispatch import TorchDispatchMode

import torchclip

SPECS = [((7, 5), torch.float32), ((300,), torch.float32), ((3, 4, 5), torch.float64), ((2, 2), torch.bfloat16)]

# Each call with the arguments that make it write (a clip coefficient below 1, a clamp that bites).
WRITING_CALLS = {
    "clip_grad_norm_": lambda params: torchclip.clip_grad_norm_(params, 0.1),
    "clip_grad_value_": lambda params: torchclip.clip_grad_value_(params, 0.1),
    "ClipGradByGlobalNorm": lambda params: torchclip.ClipGradByGlobalNorm(0.1)(params),
    "ClipGradByNorm": lambda params: torchclip.ClipGradByNorm(0.1)(params),
    "ClipGradByValue": lambda params: torchclip.ClipGradByValue(0.1)(params),
}


@pytest.mark.parametrize("call", WRITING_CALLS)
def test_version_counters_are_bumped(call):
    # torch's in-place ops bump the version counter of every tensor they write; autograd relies on it
    # to refuse a backward through a saved tensor that changed.
    params = make_params(SPECS, seed=1, scale=10.0)
    before = [p.grad._version for p in params]
    WRITING_CALLS[call](params)
    assert all(p.grad._version > v for p, v in zip(params, before))


@pytest.mark.parametrize("call", WRITING_CALLS)
def test_a_dispatch_mode_sees_the_ops(call):
    # Under a TorchDispatchMode the walk steps aside and the ops go through the dispatcher, so tools
    # built on modes (FlopCounterMode, debug modes, tracing) see them.
    seen = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    params = make_params(SPECS, seed=2, scale=10.0)
    expected = clone_params(params)
    WRITING_CALLS[call](expected)
    with Recorder():
        WRITING_CALLS[call](params)
    assert any(name.startswith("torchclip.") for name in seen), seen
    for p, q in zip(params, expected):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("call", WRITING_CALLS)
def test_inference_mode_gives_the_same_gradients(call):
    params = make_params(SPECS, seed=3, scale=10.0)
    expected = clone_params(params)
    WRITING_CALLS[call](expected)
    with torch.inference_mode():
        WRITING_CALLS[call](params)
    for p, q in zip(params, expected):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_non_leaf_without_grad_warns_as_torch_does():
    leaf = torch.nn.Parameter(torch.ones(3))
    leaf.grad = torch.ones(3)
    non_leaf = leaf * 2
    for clip in (torch.nn.utils.clip_grad_value_, torchclip.clip_grad_value_):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            clip([non_leaf, leaf], 1.0)
        assert any("not a leaf Tensor" in str(w.message) for w in caught), clip


@pytest.mark.parametrize("numel", [1000, 3_000_000])
def test_small_and_large_workloads_agree_with_torch(numel):
    # Below 4M elements the walk borrows the tensors and keeps the GIL; above, it owns them and
    # releases the GIL: both must clip as torch does.
    params = make_params([((numel,), torch.float32), ((numel // 2,), torch.float32)], seed=4)
    theirs = clone_params(params)
    reference = reference_norm([p.grad for p in params], 2.0)
    total = torchclip.clip_grad_norm_(params, 1.0)
    torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert_close_rel(total.item(), reference, NORM_RTOL[torch.float32])
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_gradients_stay_alive_while_borrowed():
    # The walk holds no reference to the gradients it borrows; the parameters do. Dropping every other
    # reference before the call must not matter.
    params = [torch.nn.Parameter(torch.zeros(100)) for _ in range(50)]
    for p in params:
        p.grad = torch.full((100,), 5.0)
    torchclip.clip_grad_value_(params, 1.0)
    assert all(torch.equal(p.grad, torch.ones(100)) for p in params)


# Lists this long are walked by every intra-op thread (kItemsPerWalker = 1,024 items per walker, in
# blocks of 512 taken from a shared counter): what one walker refuses deep in the list, every
# gradient must survive, and the result must not depend on which thread walked which block.
LONG = 5000


def long_params(seed, none_every=0):
    return make_params(
        [((3 + i % 5,), torch.float32) for i in range(LONG)], seed=seed, scale=10.0, none_every=none_every
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_list_is_clipped_as_torch_does_on_any_thread_count(threads):
    torch.set_num_threads(threads)  # (conftest restores it)
    params = long_params(seed=5, none_every=7)
    theirs = clone_params(params)
    torchclip.clip_grad_value_(params, 1.0)
    torch.nn.utils.clip_grad_value_(theirs, 1.0)
    for p, q in zip(params, theirs):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    grads = [p.grad for p in long_params(seed=6)]
    ours = torchclip.get_total_norm(grads)
    assert_close_rel(ours.item(), reference_norm(grads, 2.0), NORM_RTOL[torch.float32])
    assert ours.dtype == torch.float32 and ours.shape == ()


def test_a_long_list_bumps_each_version_once():
    # Separate gradients: each counter once. Views of one buffer share one counter: once per view,
    # as torch's in-place op on each view would.
    params = long_params(seed=7)
    flat = torch.full((LONG * 2,), 5.0)
    views = [torch.nn.Parameter(torch.zeros(2)) for _ in range(LONG)]
    for k, p in enumerate(views):
        p.grad = flat[2 * k : 2 * k + 2]
    before, flat_before = [p.grad._version for p in params], flat._version
    torchclip.clip_grad_value_(params + views, 1.0)
    assert [p.grad._version for p in params] == [v + 1 for v in before]
    assert flat._version == flat_before + LONG
    assert torch.equal(flat, torch.ones_like(flat))


@pytest.mark.parametrize("where", [1, LONG // 2, LONG - 1])
def test_an_item_refused_deep_in_a_long_list_leaves_every_gradient_unchanged(where):
    # The walk refuses a gradient whose shape is not its parameter's; torch's path then raises, naming
    # both shapes, before anything is written.
    params = long_params(seed=8)
    params[where].grad.data = torch.zeros(99)
    expected = [p.grad.clone() for p in params]
    for clip in (torchclip.clip_grad_value_, torchclip.clip_grad_norm_):
        with pytest.raises(ValueError, match=rf"parameters\[{where}\] has shape"):
            clip(params, 1.0)
        assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))


class Tagged(torch.Tensor):
    pass


def test_a_long_list_with_a_tensor_the_walk_refuses_takes_the_general_path():
    # A tensor subclass deep in the list (it may give its data another meaning): the walk steps aside
    # and the general path serves the whole list.
    grads = [p.grad for p in long_params(seed=9)]
    reference = reference_norm(grads, 2.0)
    grads[LONG - 3] = grads[LONG - 3].as_subclass(Tagged)
    assert_close_rel(torchclip.get_total_norm(grads).item(), reference, NORM_RTOL[torch.float32])


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_grad_mode_changes_nothing():
    # The drop-ins try the walk before entering no_grad(): under grad mode it must serve the same
    # gradients the same way, return a norm autograd does not track, and step aside for gradients
    # autograd does track (backward(create_graph=True)), which torch clips under no_grad.
    params = long_params(seed=10)
    theirs = clone_params(params)
    with torch.enable_grad():
        total = torchclip.clip_grad_norm_(params, 1.0)
        expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        assert not total.requires_grad and total.grad_fn is None
        assert_close_rel(total.item(), expected.item(), 1e-5)
        for p, q in zip(params, theirs):
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-5, atol=1e-7)

    weight = torch.nn.Parameter(torch.tensor([3.0, -4.0]))
    (weight**3).sum().backward(create_graph=True)
    assert weight.grad.requires_grad
    reference = weight.grad.detach().clone()
    with torch.enable_grad():
        total = torchclip.clip_grad_norm_([weight], 1.0)
        torchclip.clip_grad_value_([weight], 1.0)
        norm = torchclip.get_total_norm([weight.grad])
    assert not total.requires_grad and not norm.requires_grad
    assert_close_rel(total.item(), reference.norm().item(), 1e-6)
    torch.testing.assert_close(weight.grad.detach(), (reference / (reference.norm() + 1e-6)).clamp(-1, 1))
    weight.grad = None  # (breaks the reference cycle create_graph made)


PROFILED_CALLS = {
    "clip_grad_norm_": (lambda params: torchclip.clip_grad_norm_(params, 0.1), "torchclip::clip_grad_norm_"),
    "clip_grad_value_": (lambda params: torchclip.clip_grad_value_(params, 0.1), "torchclip::multi_tensor_clamp_"),
    "get_total_norm": (
        lambda params: torchclip.get_total_norm([p.grad for p in params]),
        "torchclip::multi_tensor_norm",
    ),
    "ClipGradByNorm": (lambda params: torchclip.ClipGradByNorm(0.1)(params), "torchclip::clip_by_tensor_norm_"),
}


@pytest.mark.parametrize("call", PROFILED_CALLS)
def test_the_profiler_sees_the_fast_path(device, call, kernel_spy):
    # Users profile training steps: the walk and the op it runs must show up under their own names,
    # although the op's implementation is called without the dispatcher (which records dispatched ops).
    clip, op_name = PROFILED_CALLS[call]
    params = make_params(SPECS, seed=21, device=device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        clip(params)
    names = [event.name for event in profile.events()]
    assert sum(kernel_spy.calls.values()) == 1 and all(name.endswith("_of_plain") for name in kernel_spy.calls)
    assert names.count("torchclip::walk_parameters") == 1
    assert names.count(op_name) == 1


def test_a_view_whose_base_requires_grad_is_seen_to_require_grad(kernel_spy):
    # A gradient that is a view, made under no_grad, of a tensor that requires grad requires grad
    # through its base only (no grad_fn, no flag of its own). In grad mode the walk must see that and
    # step aside (calling the implementation directly would skip the Autograd kernel's refusal); the
    # general path then clips under no_grad, as torch's drop-ins do, the classes too.
    def view_gradient():
        base = torch.linspace(-3, 3, 10, requires_grad=True)
        with torch.no_grad():
            view = base[:5]
        assert view.requires_grad and view.grad_fn is None and view._is_view()
        weight = torch.nn.Parameter(torch.zeros(5))
        weight.grad = view
        return weight

    for clip in (lambda ps: torchclip.clip_grad_value_(ps, 1.0), lambda ps: torchclip.ClipGradByValue(1.0)(ps)):
        ours, theirs = view_gradient(), view_gradient()
        kernel_spy.reset()
        with torch.enable_grad():
            clip([ours])
            torch.nn.utils.clip_grad_value_([theirs], 1.0)
        assert dict(kernel_spy.calls) == {"multi_tensor_clamp_": 1}  # the general path's op, not the walk
        torch.testing.assert_close(ours.grad.detach(), theirs.grad.detach(), rtol=0, atol=0)


# What the drop-ins receive, as callers pass it: one tensor, a tuple, numbers of other types, a flag
# that is not a bool. The walk takes plain floats and ints and lists, tuples or one tensor; the
# Python path converts the rest. Every form must give torch's result.
ARGUMENT_FORMS = {
    "one tensor": lambda params: (params[0], 0.5),
    "a tuple": lambda params: (tuple(params), 0.5),
    "an int": lambda params: (params, 1),
    "a numpy float": lambda params: (params, pytest.importorskip("numpy").float64(0.5)),
    "a 0-d tensor": lambda params: (params, torch.tensor(0.5)),
    "a float subclass": lambda params: (params, type("Half", (float,), {})(0.5)),
}


def grads_in_form(params):
    """The gradients of `params` in the form `params` has: one tensor, a tuple or a list."""
    if isinstance(params, torch.Tensor):
        return params.grad
    return type(params)(p.grad for p in params)


@pytest.mark.parametrize("form", ARGUMENT_FORMS)
def test_every_argument_form_gives_torchs_result(form):
    calls = [
        (torchclip.clip_grad_value_, torch.nn.utils.clip_grad_value_, lambda ps, x: (ps, x)),
        (torchclip.clip_grad_norm_, torch.nn.utils.clip_grad_norm_, lambda ps, x: (ps, x, 2.0, 1)),
        (torchclip.get_total_norm, torch.nn.utils.get_total_norm, lambda ps, x: (grads_in_form(ps), 2 * x)),
    ]
    for ours, theirs, arguments in calls:
        params = make_params(SPECS, seed=11, scale=10.0)
        expected = clone_params(params)
        got = ours(*arguments(*ARGUMENT_FORMS[form](params)))
        want = theirs(*arguments(*ARGUMENT_FORMS[form](expected)))
        if want is not None:
            assert got.dtype == want.dtype and got.shape == want.shape
            assert_close_rel(got.item(), want.item(), 1e-5)
        for p, q in zip(params, expected):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_a_list_subclass_is_read_as_it_iterates():
    # torch reads its parameters by iterating; a list subclass may iterate over other items than it
    # stores. The walk reads exact lists and tuples only, so this one is iterated, as torch does.
    class EveryOther(list):
        def __iter__(self):
            return iter(list.__getitem__(self, slice(None, None, 2)))

    params = make_params([((6,), torch.float32) for _ in range(6)], seed=12, scale=10.0)
    theirs = clone_params(params)
    torchclip.clip_grad_value_(EveryOther(params), 1.0)
    torch.nn.utils.clip_grad_value_(EveryOther(theirs), 1.0)
    for p, q in zip(params, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert not torch.equal(params[1].grad, params[1].grad.clamp(-1, 1))  # (left alone by both)


FAST_PATH_ENTRIES = {  # drop-in -> its fast-path entry in _ops, and a call of it with an iterable of parameters
    "clip_grad_norm_": ("clip_grad_norm_of_plain", lambda clip, items: clip.clip_grad_norm_(items, 0.1)),
    "clip_grad_value_": ("clip_grad_value_of_plain", lambda clip, items: clip.clip_grad_value_(items, 0.1)),
    "get_total_norm": ("total_norm_of_plain", lambda clip, items: clip.get_total_norm(p.grad for p in items)),
}


@pytest.mark.parametrize("drop_in", FAST_PATH_ENTRIES)
def test_a_generator_takes_the_fast_path_and_is_read_once(drop_in, monkeypatch):
    # Lightning, timm and accelerate pass model.parameters(): a generator, drained once into a list
    # that the walk reads (before, generators took the general path).
    entry, call = FAST_PATH_ENTRIES[drop_in]
    walked = []
    original = getattr(torchclip._ops, entry)

    def spy(items, *args, **kwargs):
        result = original(items, *args, **kwargs)
        walked.append((type(items), result is not None and result is not False))
        return result

    monkeypatch.setattr(torchclip._ops, entry, spy)
    params = make_params(SPECS[:3], seed=13, scale=10.0)  # (no bfloat16: torch sums it less exactly)
    expected = clone_params(params)
    reads = []

    def yielding_once(items):
        for p in items:
            reads.append(p)
            yield p

    got = call(torchclip, yielding_once(params))
    assert walked == [(list, True)]  # one call, on a list, served
    assert len(reads) == len(params)  # the generator was read once
    want = call(torch.nn.utils, iter(expected))
    if want is not None:
        assert_close_rel(got.item(), want.item(), 1e-5)
    for p, q in zip(params, expected):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_the_walk_serves_every_kernel_device(device):
    # The C++ walk gathers the gradients, splits them and calls the device's implementations directly
    # (on CUDA through cuda_split_ops.h); it bumps each version once, as the ops' Autograd kernels do.
    params = device_params(torch.float32, device, seed=61, scale=3.0)
    expected = [p.grad.clamp(-0.5, 0.5) for p in params]
    versions = [p.grad._version for p in params]
    assert torchclip._ops.clamp_grads_of_plain(params, -0.5, 0.5)
    assert [p.grad._version for p in params] == [v + 1 for v in versions]
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    reference = reference_norm([p.grad for p in params], 2.0)
    total = torchclip._ops.total_norm_of_plain([p.grad for p in params], 2.0, False)
    assert total.device.type == device
    assert_norm_close(total, reference)
    total = torchclip._ops.clip_grad_norm_of_plain(params, 1.0, 2.0, False)
    assert_norm_close(total, reference)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params])).item()
    assert_close_rel(clipped, reference / (reference + 1e-6), 1e-6, "clipped norm")
    norms = torchclip._ops.clip_by_tensor_norm_of_plain(params, 0.1, False)
    assert norms.shape == (len(params),) and norms.dtype == torch.float64
    assert all(torch.linalg.vector_norm(p.grad.double()).item() <= 0.1 * (1 + 1e-6) for p in params)

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():  # under a dispatch mode: the general path
        assert torchclip._ops.clip_grad_norm_of_plain(params, 1.0, 2.0, False) is None


@cuda_only
def test_the_walk_leaves_gradients_on_two_devices_to_the_general_path():
    params = device_params(torch.float32, "cuda", seed=61)
    on_cpu = torch.nn.Parameter(torch.randn(3))
    on_cpu.grad = torch.randn(3)
    assert torchclip._ops.clip_grad_norm_of_plain(params + [on_cpu], 1.0, 2.0, False) is None


def test_the_walk_splits_the_gradients_the_kernels_do_not_take(device):
    # A strided view and a complex gradient go to ATen from the walk's split, beside the kernels' spans.
    def params():
        found = device_params(torch.float32, device, seed=63, scale=3.0)
        strided = torch.nn.Parameter(torch.zeros(500, device=device))
        strided.grad = torch.randn(500, 3, device=device)[:, 1]
        complex_weight = torch.nn.Parameter(torch.zeros(40, dtype=torch.complex64, device=device))
        complex_weight.grad = torch.randn(40, dtype=torch.complex64, device=device)
        return [strided] + found + [complex_weight]

    torch.manual_seed(0)
    ours = params()
    theirs = clone_params(ours)
    total = torchclip._ops.clip_grad_norm_of_plain(ours, 1.0, 2.0, False)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, 2.0)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    torch.manual_seed(0)
    ours = params()
    expected = [p.grad.clamp(-0.5, 0.5) for p in ours[:-1]]
    assert torchclip._ops.clamp_grads_of_plain(ours[:-1], -0.5, 0.5)
    assert all(torch.equal(p.grad, e) for p, e in zip(ours[:-1], expected))
