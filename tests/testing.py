"""Shared tables and oracles for the tests: the lists of cases live here, the tests pick from them."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import math

import pytest
import torch

from torchclip import _ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
FAST_NORM_TYPES = [1.0, 2.0, math.inf]
OTHER_NORM_TYPES = [0.0, -math.inf, 0.5, 3.0, -1.0, -2.5]
NORM_TYPES = FAST_NORM_TYPES + OTHER_NORM_TYPES

# Relative tolerance of a norm returned in this dtype against the float64 reference: the result's own
# rounding (half an ulp) plus float64 accumulation error, which is negligible.
NORM_RTOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# Tolerance of a clipped gradient against torch's: torch's coefficient is computed in the norm's own
# dtype from a less accurate norm, so the two may differ by about that dtype's accumulation error.
CLIP_RTOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}

SHAPES = [(), (0,), (1,), (7,), (16,), (33,), (3, 5), (64, 64), (4, 3, 5), (100003,), (2, 0, 3)]


def make_tensor(shape, dtype, seed, scale=1.0, layout="contiguous"):
    """A tensor of `shape` with N(0, scale^2) values, in one of several memory layouts."""
    generator = torch.Generator().manual_seed(seed)
    if layout == "contiguous" or (layout == "transposed" and len(shape) < 2):
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(dtype)
    if layout == "transposed":  # dense, permuted strides: the kernels walk it as one flat span
        t = (torch.randn(tuple(reversed(shape)), generator=generator, dtype=torch.float64) * scale).to(dtype)
        return t.permute(*reversed(range(t.dim())))
    if layout == "strided":  # every other element: not dense, ATen's path
        t = (
            torch.randn((*shape[:-1], 2 * shape[-1]) if shape else (2,), generator=generator, dtype=torch.float64)
            * scale
        ).to(dtype)
        return t[..., ::2] if shape else t[0]
    if layout == "offset":  # a view starting inside its storage
        t = (torch.randn(math.prod(shape) + 3, generator=generator, dtype=torch.float64) * scale).to(dtype)
        return t[3:].view(shape)
    raise ValueError(layout)


LAYOUTS = ["contiguous", "transposed", "strided", "offset"]


def make_params(specs, seed=0, scale=1.0, none_every=0, device="cpu"):
    """Parameters with gradients on `device`; specs is a list of (shape, dtype[, layout]). Every
    none_every-th parameter (1-based) gets no gradient."""
    params = []
    for i, spec in enumerate(specs):
        shape, dtype = spec[0], spec[1]
        layout = spec[2] if len(spec) > 2 else "contiguous"
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype, device=device))
        if not (none_every and (i + 1) % none_every == 0):
            p.grad = device_tensor(shape, dtype, seed + i, device, scale, layout)
        params.append(p)
    return params


def clone_params(params, device=None):
    """Copies of params and their gradients (for the oracle: values, not layouts, must match), on
    `device` when given."""
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone().to(device))
        if p.grad is not None:
            q.grad = p.grad.clone().to(device)
        out.append(q)
    return out


# ---- the device axis (conftest.py: the `device` fixture) -------------------------------------------

# The ops with CUDA kernels (csrc/cuda/); the others run on the CPU only.
CUDA_OPS = (
    "multi_tensor_norm",
    "multi_tensor_scale_",
    "multi_tensor_clamp_",
    "clip_grad_norm_",
    "clip_by_tensor_norm_",
    "per_sample_norms",
    "per_sample_accumulate_",
)


def op_runs_on(name: str, device: str) -> bool:
    """Whether torchclip::name has a kernel for `device` (asked of the dispatcher, not guessed)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"torchclip::{name}", device.upper())


CUDA_READY = torch.cuda.is_available() and all(op_runs_on(op, "cuda") for op in CUDA_OPS)
requires_cuda = pytest.mark.skipif(
    not CUDA_READY,
    reason="no CUDA device" if not torch.cuda.is_available() else "torchclip was built without its CUDA kernels",
)

# Around the CUDA kernels' chunk of 65536 elements: one- and many-chunk tensors, and empty ones.
CHUNK_SIZES = [0, 1, 7, 16, 33, 1000, 65535, 65536, 65537, 300001]


def device_tensor(shape, dtype, seed, device, scale=1.0, layout="contiguous"):
    """make_tensor's values and memory layout (strides, storage offset), on `device`."""
    t = make_tensor(shape, dtype, seed, scale, layout)
    if device == "cpu":
        return t
    if layout == "offset":  # a view 3 elements into its storage: not 16-byte aligned, the kernels' slow path
        out = torch.empty(t.numel() + 3, dtype=dtype, device=device)[3:].view(shape)
    else:
        out = torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=device)
    return out.copy_(t)


def device_list(dtype, device, seed=0, scale=1.0, sizes=CHUNK_SIZES, layout="contiguous"):
    return [device_tensor((n,), dtype, seed + i, device, scale, layout) for i, n in enumerate(sizes)]


def device_params(dtype, device, seed, scale=1.0, sizes=(1000, 65537, 7, 300001)):
    """Parameters on `device` holding make_tensor gradients of these sizes."""
    return make_params([((n,), dtype) for n in sizes], seed, scale, device=device)


def torch_fused_sgd_steps_16_bit_vectors() -> bool:
    """Whether torch's fused CPU SGD steps whole float16/bfloat16 vectors: before 2.14 it left them as they
    were and stepped only the tail (pytorch#191763), so a 16-bit reference there is its non-fused step."""
    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=0.5, fused=True).step()
    return bool((p == 0.5).all())


def assert_cuda_step_matches(ours, theirs, positions, tolerance, context):
    """A CUDA step's lists at `positions` against torch's fused CUDA step's, within `tolerance`. Not bit for
    bit: torch's compiled kernels contract some paths and not others. On an H200 with torch 2.11 every option
    with grad_scale gave torch's bits, and without it Adam with coupled weight decay (no AMSGrad) and SGD with
    momentum and maximize parted by roundings (bench/cuda_step_bits.py; the SASS in libtorch_cuda.so shows the
    weight-decay product rounded before the add on one path and fused on the other)."""
    for position in positions:
        for a, b in zip(ours[position], theirs[position]):
            where = (position, a.numel(), context)
            torch.testing.assert_close(a, b, **tolerance, msg=lambda message, where=where: f"{message}\n{where}")


def cuda_only(test):
    """A test of something only CUDA has (streams, graphs, host synchronisation, the CPU-versus-CUDA
    agreement): skipped without a GPU, selected by `pytest -m cuda`."""
    return pytest.mark.cuda(requires_cuda(test))


@contextlib.contextmanager
def no_host_sync(device):
    """A block in which any wait of the host for `device` raises (CUDA); the CPU has no such wait."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bits(t):
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def identical(a, b):
    """Same dtype, shape and bits: for the determinism and graph-replay checks."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def assert_same_values(a, b, what=""):
    """Same dtype and exactly the same values, any NaN equal to any NaN (implementations may differ in
    the NaN payload they write)."""
    assert a.dtype == b.dtype, what
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True, msg=what)


def subnormal_spacing(dtype):
    """The absolute resolution of `dtype` near 0: a result that small is off by up to this much."""
    info = torch.finfo(dtype.to_real() if dtype.is_complex else dtype)
    return info.smallest_normal * info.eps


def has_identity(norm_type) -> bool:
    """Whether an empty tensor has a norm of this order (inf and negative orders have none)."""
    return not (norm_type in (math.inf, -math.inf) or norm_type < 0)


def grads_of(params):
    return [p.grad for p in params if p.grad is not None]


def reference_norm(tensors, norm_type) -> float:
    """torch's definition of the total norm, evaluated in float64 (and exact where float64 is); a complex
    tensor's norm is its magnitudes', as torch's."""
    if len(tensors) == 0:
        return 0.0
    norms = [
        torch.linalg.vector_norm(t.detach().to(torch.complex128 if t.is_complex() else torch.float64), norm_type)
        for t in tensors
    ]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type).item()


def clip_by_hand(grads, clip_norm):
    """Paddle's ClipGradByGlobalNorm in float64, applied in place; returns the global norm (0-d float64)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    coefficient = clip_norm / max(norm.item(), clip_norm)
    for g in grads:
        g.copy_((g.double() * coefficient).to(g.dtype))
    return norm


def assert_close_rel(actual: float, expected: float, rtol: float, what: str = ""):
    if math.isnan(expected):
        assert math.isnan(actual), f"{what}: expected nan, got {actual}"
        return
    if math.isinf(expected) or expected == 0.0:
        assert actual == expected, f"{what}: expected {expected}, got {actual}"
        return
    rel = abs(actual - expected) / abs(expected)
    assert rel <= rtol, f"{what}: {actual!r} vs {expected!r} (relative error {rel:.3g} > {rtol:.3g})"


def assert_norm_close(total: torch.Tensor, reference: float, what: str = "", inputs=None):
    """`total` (in its dtype) against the float64 reference rounded to that dtype: a norm too large
    for float16 is inf there, whatever the float64 value. A float64 total of a list holding narrower
    tensors is held to the narrow tensors' guarantee (1e-6: squares summed in float32 blocks)."""
    expected = torch.tensor(reference, dtype=torch.float64).to(total.dtype).item()
    rtol = NORM_RTOL[total.dtype]
    if inputs is not None and any(t.dtype != torch.float64 for t in inputs):
        rtol = max(rtol, NORM_RTOL[torch.float32])
    assert_close_rel(total.item(), expected, rtol, what)


# ---- proving torchclip ran (conftest.py: the kernel_spy fixture) ----------------------------------

# torchclip's entry points into its kernels: the C++ fast paths (which return None / False when they step
# aside for the general path) and the general path's ops. Every drop-in and every clip class goes through
# one of them; they are read as `_ops.NAME` at call time, so a spy there sees every call.
_FAST_PATHS = (
    "clip_grad_norm_of_plain",
    "clip_by_tensor_norm_of_plain",
    "clamp_grads_of_plain",
    "clip_grad_value_of_plain",
    "total_norm_of_plain",
)
_GENERAL_OPS = (
    "clip_grad_norm_",
    "clip_by_tensor_norm_",
    "multi_tensor_clamp_",
    "multi_tensor_scale_",
    "multi_tensor_norm",
)
_NORM_ONLY = ("total_norm_of_plain", "multi_tensor_norm")  # compute a norm, change no gradient


class KernelSpy:
    """Counts the calls into torchclip's kernels that did the work (a fast path that stepped aside is not
    counted: the general path's op that took over is)."""

    def __init__(self, monkeypatch):
        self.calls = collections.Counter()
        for name in _FAST_PATHS + _GENERAL_OPS:
            monkeypatch.setattr(_ops, name, self._wrap(name, getattr(_ops, name), name in _FAST_PATHS))

    def _wrap(self, name, function, fast):
        @functools.wraps(function)
        def spy(*args, **kwargs):
            result = function(*args, **kwargs)
            if not fast or (result is not None and result is not False):
                self.calls[name] += 1
            return result

        return spy

    @property
    def clips(self) -> int:
        """Calls that clipped gradients (one per clip_grad_norm_ / clip_grad_value_ / clip object call)."""
        return sum(n for name, n in self.calls.items() if name not in _NORM_ONLY)

    def reset(self):
        self.calls.clear()


def params_with(grads):
    """A parameter for each gradient (zeros of its shape and dtype), holding it as .grad, not a copy."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype, device=g.device))
        p.grad = g
        params.append(p)
    return params


# ---- the adaptive clips' tests (tests/test_adaptive_*.py): a small model, and gradient runs with loss spikes

SPIKES = {7: 40.0, 31: 25.0, 32: 60.0, 45: 0.02, 50: 300.0}


def model_pair(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    return model, copy.deepcopy(model)


def gradient_run(model, steps, seed=1, spikes=SPIKES):
    """Per step, fresh gradients for every parameter: a slowly drifting scale, with spikes."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [p.shape for p in model.parameters()]
    for step in range(steps):
        scale = (1.0 + 0.3 * math.sin(step / 5)) * spikes.get(step, 1.0)
        yield [torch.randn(s, generator=generator) * scale for s in shapes]


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def assert_same_grads(reference, ours, step):
    for (name, a), b in zip(reference.named_parameters(), ours.parameters()):
        torch.testing.assert_close(
            b.grad, a.grad, rtol=2e-6, atol=1e-9, msg=lambda m, name=name: f"step {step}, {name}: {m}"
        )


def fused_like_torch(cpu_capability) -> bool:
    """Whether our kernels and torch's both fuse multiply-adds (both AVX2 or AVX-512): then whole vectors
    of the fused optimizer steps match bit for bit."""
    with_fma = {"AVX2", "AVX512"}
    return cpu_capability in with_fma and torch.backends.cpu.get_cpu_capability() in with_fma
