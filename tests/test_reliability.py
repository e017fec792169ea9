"""Defects where torchclip was silently wrong, hung or crashed and torch.nn.utils is right (issue 34): gradients
that share memory, a child made by fork, Python code run while the walk holds a list, and inference mode.
Each oracle is torch's own behaviour on the same input (its CPU path: every listed tensor in list order)."""

import subprocess
import sys
import textwrap

import pytest
import torch
from testing import CLIP_RTOL, params_with

import torchclip

LARGE = 300_000  # elements per gradient: enough for two threads to split the list


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def shared_gradient_lists(kind, device="cpu"):
    """Two copies of one list of parameters whose gradients share memory, built the same way."""
    generator = torch.Generator().manual_seed(0)
    buffer = torch.randn(2 * LARGE + 64, generator=generator) * 0.01
    copies = []
    for _ in range(2):
        data = buffer.to(device, copy=True)
        if kind == "same tensor twice":
            p = params_with([data[:LARGE]])[0]
            copies.append([p, p])
        elif kind == "views overlapping by all but 64":
            copies.append(params_with([data[:LARGE], data[64 : LARGE + 64]]))
        elif kind == "a view inside another":
            copies.append(params_with([data[: 2 * LARGE], data[LARGE // 2 : LARGE // 2 + 1000]]))
        else:  # adjacent views of one buffer (DDP buckets, flat parameters): no element shared
            copies.append(params_with([data[:LARGE], data[LARGE : 2 * LARGE]]))
    return copies


KINDS = ["same tensor twice", "views overlapping by all but 64", "a view inside another", "adjacent views"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_of_shared_gradients_is_torchs(kind, max_norm, two_threads, device):
    ours, theirs = shared_gradient_lists(kind, device)
    total = torchclip.clip_grad_norm_(ours, max_norm)
    # torch's loop (foreach=False; its CUDA default, foreach, scales a tensor listed twice in one launch whose
    # blocks race: on an H200 85% of the shared elements came out scaled once)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=False)
    torch.testing.assert_close(total, expected, rtol=CLIP_RTOL[torch.float32], atol=0)  # torch sums in float32
    for p, q in zip(ours, theirs):  # shared elements scaled once per listing, as torch's loop scales them
        torch.testing.assert_close(p.grad, q.grad, rtol=CLIP_RTOL[torch.float32], atol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_clip_grad_value_of_shared_gradients_is_torchs(kind, two_threads, device):
    ours, theirs = shared_gradient_lists(kind, device)
    torchclip.clip_grad_value_(ours, 0.005)
    torch.nn.utils.clip_grad_value_(theirs, 0.005)
    for p, q in zip(ours, theirs):
        assert torch.equal(p.grad, q.grad)


def clip_each_in_order(params, clip_norm):
    """Paddle's per-tensor rule applied as a loop over the list: each gradient by its norm as the ones
    before it left it (float64 norm, float32 scale as the kernels round)."""
    for p in params:
        norm = torch.linalg.vector_norm(p.grad.double()).item()
        if norm > clip_norm:
            p.grad.mul_(clip_norm / norm)


@pytest.mark.parametrize("kind", KINDS)
def test_per_tensor_clip_of_shared_gradients_is_a_loop_over_the_list(kind, two_threads, device):
    ours, theirs = shared_gradient_lists(kind, device)
    torchclip.ClipGradByNorm(0.3)(ours)
    clip_each_in_order(theirs, 0.3)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=CLIP_RTOL[torch.float32], atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_global_clip_class_of_shared_gradients_scales_each_listing(kind, two_threads, device):
    ours, theirs = shared_gradient_lists(kind, device)
    torchclip.ClipGradByGlobalNorm(0.5)(ours)
    norm = torch.nn.utils.get_total_norm([q.grad.double() for q in theirs]).item()  # each listing counted
    for q in theirs:  # Paddle's coefficient, clip_norm / max(norm, clip_norm), applied per listing
        q.grad.mul_(0.5 / max(norm, 0.5))
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=CLIP_RTOL[torch.float32], atol=0)


def test_the_same_small_gradient_many_times_in_a_long_list(two_threads, cpu_capability):
    """Thousands of tensors (the walk's own threads and the kernels' chunks) with one repeated among them."""
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(100, generator=generator) for _ in range(3000)]
    ours, theirs = params_with([g.clone() for g in grads]), params_with([g.clone() for g in grads])
    ours = ours + [ours[7]] * 5 + ours
    theirs = theirs + [theirs[7]] * 5 + theirs
    torch.testing.assert_close(torchclip.clip_grad_norm_(ours, 1.0), torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=CLIP_RTOL[torch.float32], atol=0)


VIEW = 5000  # elements per view below: 200 of them split across two threads


def views_out_of_order(seed):
    """Two copies of 200 adjacent views of one buffer (64 elements to spare), listed in a random order:
    ~100 runs in address order for the overlap check to merge. Each copy: (buffer, views, the order)."""
    generator = torch.Generator().manual_seed(seed)
    count = 200
    buffer = torch.randn(count * VIEW + 64, generator=generator) * 0.01
    order = torch.randperm(count, generator=generator).tolist()
    copies = []
    for _ in range(2):
        data = buffer.clone()
        copies.append((data, [data[i * VIEW : (i + 1) * VIEW] for i in order], order))
    return copies


def assert_clip_grad_norm_is_torchs(ours, theirs):
    torch.testing.assert_close(
        torchclip.clip_grad_norm_(ours, 0.5),
        torch.nn.utils.clip_grad_norm_(theirs, 0.5),
        rtol=CLIP_RTOL[torch.float32],
        atol=0,
    )
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=CLIP_RTOL[torch.float32], atol=0)


@pytest.mark.parametrize("shared", ["none", "the same elements", "all but 64 elements"])
def test_views_listed_out_of_address_order_with_one_pair_sharing_memory(shared, two_threads, cpu_capability):
    """The overlap check merges runs of ranges in address order: here ~100 runs, the shared pair far apart."""
    copies = []
    for data, views, order in views_out_of_order(seed=2):
        if shared != "none":
            start = order[0] * VIEW + (0 if shared == "the same elements" else 64)
            views.insert(len(views) // 2, data[start : start + VIEW])  # where the second thread starts
        copies.append(params_with(views))
    assert_clip_grad_norm_is_torchs(*copies)


def test_a_list_found_disjoint_then_changed_to_share_memory_is_checked_again(two_threads, cpu_capability):
    """The check keeps its last disjoint verdict for a list that comes again range for range: one moved
    gradient must not hide behind it."""
    copies = []
    for (data, views, order), clip in zip(
        views_out_of_order(seed=3), [torchclip.clip_grad_value_, torch.nn.utils.clip_grad_value_]
    ):
        params = params_with(views)
        clip(params, 1.0)  # nothing clipped; the list found disjoint
        params[len(params) // 2].grad = data[order[0] * VIEW + 64 : order[0] * VIEW + 64 + VIEW]  # the first, moved
        copies.append(params)
    assert_clip_grad_norm_is_torchs(*copies)


# ---- fork ------------------------------------------------------------------------------------------


FORK_CHILD = """
import multiprocessing, os, sys, traceback, torch, torchclip
torch.set_num_threads(2)
def params():
    ps = [torch.nn.Parameter(torch.zeros(100)) for _ in range(1000)]
    for p in ps:
        p.grad = torch.randn(100)
    return ps
torchclip.clip_grad_norm_(params(), 1.0)  # the parent runs parallel regions first
big = torch.nn.Parameter(torch.zeros(4_000_000))
big.grad = torch.randn(4_000_000)
torchclip.clip_grad_value_([big], 1.0)
def child():
    ps = params()
    total = torchclip.clip_grad_norm_(ps, 1.0)
    torchclip.clip_grad_value_(ps + [big], 0.01)
    torchclip.ClipGradByGlobalNorm(1.0)(ps)
    torchclip.ClipGradByUnitwiseNorm(0.01)(ps)
    assert torch.isfinite(total)
if sys.argv[1] == "os.fork":
    pid = os.fork()
    if pid == 0:
        try:
            child()
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
process = multiprocessing.get_context("fork").Process(target=child)
process.start()
process.join()
sys.exit(process.exitcode)
"""


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_a_forked_child_clips_instead_of_hanging(how):
    result = subprocess.run([sys.executable, "-c", FORK_CHILD, how], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# ---- Python code while the walk holds a list ---------------------------------------------------------


def test_a_need_clip_property_that_changes_the_list_does_not_crash():
    script = textwrap.dedent("""
        import torch, torchclip
        def fresh():
            params = []
            for _ in range(64):
                p = torch.nn.Parameter(torch.zeros(1000))
                p.grad = torch.ones(1000)
                params.append(p)
            return params
        current = []
        def need_clip(self):
            current.clear()  # frees the list's item array and the only references to the other parameters
            return True
        torch.nn.Parameter.need_clip = property(need_clip)
        for clip in (torchclip.ClipGradByGlobalNorm(0.1), torchclip.ClipGradByNorm(0.1), torchclip.ClipGradByValue(0.1)):
            current[:] = fresh()
            clip(current)
        print("survived")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "survived" in result.stdout, (result.returncode, result.stderr[-2000:])


@pytest.mark.parametrize("where", ["a class attribute", "a __getattr__"])
def test_need_clip_from_the_class_is_honoured_as_from_the_parameter(where, cpu_capability):
    # The walk reads the marks by attribute lookup: a class attribute is found on the type, a __getattr__
    # runs Python code for every parameter without a mark of its own.
    params = params_with([torch.full((10,), 3.0) for _ in range(3)])
    torchclip.set_need_clip(params[1], True)

    def unmarked_are_excluded(self, name):
        if name == "need_clip":
            return False
        raise AttributeError(name)

    if where == "a class attribute":
        torch.nn.Parameter.need_clip = False
    else:
        torch.nn.Parameter.__getattr__ = unmarked_are_excluded
    try:
        torchclip.ClipGradByValue(1.0)(params)
    finally:
        if where == "a class attribute":
            del torch.nn.Parameter.need_clip
        else:
            del torch.nn.Parameter.__getattr__
    assert [p.grad[0].item() for p in params] == [3.0, 1.0, 3.0]


def test_a_need_clip_property_that_replaces_items_is_read_as_the_list_then_is(cpu_capability):
    params = params_with([torch.full((10,), 3.0) for _ in range(4)])
    replacement = params_with([torch.full((10,), 4.0)])[0]
    calls = []

    def need_clip(self):
        if not calls:
            listed[2] = replacement  # the walk must not keep reading the list as it was
        calls.append(self)
        return True

    listed = list(params)
    torch.nn.Parameter.need_clip = property(need_clip)
    try:
        torchclip.ClipGradByGlobalNorm(1.0)(listed)
    finally:
        del torch.nn.Parameter.need_clip
    clipped = [p for p in listed]
    total = torch.linalg.vector_norm(torch.cat([torch.full((30,), 3.0), torch.full((10,), 4.0)]).double()).item()
    for p in clipped:
        assert torch.isfinite(p.grad).all()
    assert replacement.grad[0].item() == pytest.approx(4.0 / total, rel=1e-6)
    assert params[2].grad[0].item() == 3.0  # no longer listed: untouched


# ---- inference mode ---------------------------------------------------------------------------------


CLIPS_IN_PLACE = {
    "clip_grad_norm_": lambda m, ps: m.clip_grad_norm_(ps, 0.1),
    "clip_grad_value_": lambda m, ps: m.clip_grad_value_(ps, 0.01),
}


@pytest.mark.parametrize("call", sorted(CLIPS_IN_PLACE))
def test_a_write_under_inference_mode_is_seen_by_autograd_as_torchs_is(call, cpu_capability):
    def run(module):
        p = torch.nn.Parameter(torch.zeros(1000))
        p.grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
        x = torch.randn(1000, requires_grad=True)
        y = (x * p.grad).sum()  # saves the gradient for backward
        with torch.inference_mode():
            CLIPS_IN_PLACE[call](module, [p])
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()

    run(torch.nn.utils)
    run(torchclip)


@pytest.mark.parametrize("call", sorted(CLIPS_IN_PLACE))
def test_an_inference_gradient_is_not_written_outside_inference_mode(call, cpu_capability):
    def gradients():
        p = torch.nn.Parameter(torch.zeros(1000))
        with torch.inference_mode():
            p.grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
        return [p]

    theirs = gradients()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        CLIPS_IN_PLACE[call](torch.nn.utils, theirs)
    ours = gradients()
    before = ours[0].grad.clone()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        CLIPS_IN_PLACE[call](torchclip, ours)
    assert torch.equal(ours[0].grad, before)
    with torch.inference_mode():  # inside inference mode both clip it
        CLIPS_IN_PLACE[call](torchclip, ours)
        CLIPS_IN_PLACE[call](torch.nn.utils, theirs)
    torch.testing.assert_close(ours[0].grad, theirs[0].grad, rtol=CLIP_RTOL[torch.float32], atol=0)
