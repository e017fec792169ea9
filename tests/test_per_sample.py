"""torchclip.per_sample against a float64 reference written from the formulas (DP-SGD's per-sample clipping:
Abadi et al.'s rule as Opacus computes it, automatic clipping as Bu et al. define it), on every dtype, flat and
per layer, accumulated over batches, with the noise checked against a float64 Philox4x32-10 + Box-Muller and by
its statistics; on every CPU capability and on 1 and 2 threads. Opacus's own optimizers are the oracle in
tests/test_integration_opacus.py."""

import math

import numpy as np
import pytest
import torch
from testing import cuda_only

from torchclip import _ops
from torchclip.per_sample import add_noise_, clip_and_accumulate_, per_sample_norms

# Sample shapes that cross the kernels' edges: vectors, partial vector blocks, a 2,048-element unit and one
# past it, an empty parameter.
SHAPES = [(3, 5), (7,), (2048,), (2049,), (40, 61), (0,), (1,)]
SAMPLE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# The sums are float32 (float64 for float64) over B terms: a few float32 roundings of the largest term.
SUM_ATOL = {torch.float32: 2e-6, torch.bfloat16: 2e-6, torch.float16: 2e-6, torch.float64: 1e-13}


def make_params(shapes, batch, sample_dtype, param_dtype=None, seed=0, pieces=1, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=generator).to(device, param_dtype or torch.float32))
        scale = torch.rand((batch,) + (1,) * len(shape), generator=generator) * 3
        full = (torch.randn((batch, *shape), generator=generator) * scale).to(device, sample_dtype)
        p.grad_sample = list(full.tensor_split(pieces)) if pieces > 1 else full
        params.append(p)
    return params


def samples_of(p):
    gs = p.grad_sample
    return torch.cat(gs) if isinstance(gs, list) else gs


def reference(params, max_norm, style="flat", clip="abadi", gamma=0.01):
    """(summed in float64, the norms used): the formulas, in float64 from the per-sample gradients' values."""
    rows = [samples_of(p).cpu().double().reshape(samples_of(p).shape[0], -1) for p in params]
    by_parameter = torch.stack([r.norm(dim=1) for r in rows], dim=1)
    norms = by_parameter.norm(dim=1) if style == "flat" else by_parameter
    bound = torch.tensor(max_norm, dtype=torch.float64)
    factors = (bound / (norms + 1e-6)).clamp(max=1.0) if clip == "abadi" else bound / (norms + gamma)
    summed = []
    for j, r in enumerate(rows):
        f = factors if style == "flat" else factors[:, j]
        summed.append((f[:, None] * r).sum(0).reshape(params[j].shape))
    return summed, norms


@pytest.mark.parametrize("sample_dtype", SAMPLE_DTYPES)
@pytest.mark.parametrize("style", ["flat", "per_layer"])
@pytest.mark.parametrize("clip", ["abadi", "automatic"])
def test_clip_and_accumulate_matches_the_formulas(device, sample_dtype, style, clip):
    batch = 13
    param_dtype = torch.float64 if sample_dtype == torch.float64 else None
    params = make_params(SHAPES, batch, sample_dtype, param_dtype=param_dtype, device=device)
    max_norm = 1.5 if style == "flat" else [0.5 + j for j in range(len(SHAPES))]
    expected, expected_norms = reference(params, max_norm, style, clip)
    norms = clip_and_accumulate_(params, max_norm, style=style, clip=clip)
    torch.testing.assert_close(norms.cpu().double(), expected_norms, rtol=1e-6, atol=0)
    for p, e in zip(params, expected):
        assert p.summed_grad.dtype == p.dtype and p.summed_grad.shape == p.shape and p.summed_grad.device == p.device
        torch.testing.assert_close(p.summed_grad.cpu().double(), e, rtol=1e-5, atol=SUM_ATOL[sample_dtype] * batch)
        assert p.grad is None  # no noise, no divisor: p.grad is not written


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_summed_in_the_parameters_dtype(param_dtype):
    params = make_params([(5, 7), (100,)], 6, torch.float32, param_dtype=param_dtype)
    expected, _ = reference(params, 1.0)
    clip_and_accumulate_(params, 1.0)
    for p, e in zip(params, expected):
        assert p.summed_grad.dtype == param_dtype
        # rounded once, from a float32 (float64) sum
        torch.testing.assert_close(p.summed_grad, e.to(param_dtype), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_accumulates_over_two_batches_and_lists_of_batches(threads):
    torch.set_num_threads(threads)
    first = make_params(SHAPES, 9, torch.float32, seed=1)
    second = make_params(SHAPES, 5, torch.bfloat16, seed=2, pieces=2)  # a list, as Opacus keeps it
    clip_and_accumulate_(first, 0.7)
    for p, q in zip(first, second):
        p.grad_sample = q.grad_sample
    clip_and_accumulate_(first, 0.7)
    e1, _ = reference(make_params(SHAPES, 9, torch.float32, seed=1), 0.7)
    e2, _ = reference(second, 0.7)
    for p, a, b in zip(first, e1, e2):
        torch.testing.assert_close(p.summed_grad.double(), a + b, rtol=1e-5, atol=1e-4)


def test_empty_batch_sums_nothing():
    params = make_params([(3, 4), (6,)], 0, torch.float32)
    norms = clip_and_accumulate_(params, 1.0, expected_batch_size=4)
    assert norms.shape == (0,)
    for p in params:
        assert torch.equal(p.summed_grad, torch.zeros_like(p)) and torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_per_sample_norms_per_tensor(device, norm_type):
    params = make_params(SHAPES[:5], 11, torch.bfloat16, pieces=3, device=device)
    total, by_parameter = per_sample_norms([p.grad_sample for p in params], norm_type, per_tensor=True)
    rows = [samples_of(p).cpu().double().reshape(11, -1) for p in params]
    expected = torch.stack([torch.linalg.vector_norm(r, norm_type, dim=1) for r in rows], dim=1)
    torch.testing.assert_close(by_parameter.cpu().double(), expected, rtol=1e-6, atol=0)
    expected_total = torch.linalg.vector_norm(expected, norm_type, dim=1)
    torch.testing.assert_close(total.cpu().double(), expected_total, rtol=1e-6, atol=0)
    assert total.dtype == torch.float32 and by_parameter.shape == (11, 5)


def test_nonfinite_sample_propagates_as_opacus_or_raises_with_nothing_written():
    params = make_params([(4,), (3,)], 5, torch.float32)
    params[1].grad_sample[2, 1] = float("nan")
    params[0].grad_sample[4, 0] = float("inf")
    clip_and_accumulate_(params, 1.0)
    assert params[0].summed_grad.isnan().all()  # inf * factor 0 (Opacus: the same einsum)
    assert params[1].summed_grad.isnan()[1]
    for p in params:
        p.summed_grad = None
    with pytest.raises(RuntimeError, match="sample 2 is nan.*nothing was written"):
        clip_and_accumulate_(params, 1.0, error_if_nonfinite=True, expected_batch_size=2)
    assert all(p.summed_grad is None and p.grad is None for p in params)


# ---- the noise -----------------------------------------------------------------------------------

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_MASK = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, key):
    """Random123's Philox4x32-10, in numpy: four uint64 arrays of 32-bit words, a key of two ints."""
    c = [np.asarray(w, dtype=np.uint64) for w in counter]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for _ in range(10):
        p0, p1 = c[0] * np.uint64(_M0), c[2] * np.uint64(_M1)
        c = [
            ((p1 >> np.uint64(32)) ^ c[1] ^ k0) & _MASK,
            p1 & _MASK,
            ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & _MASK,
            p0 & _MASK,
        ]
        k0, k1 = (k0 + np.uint64(_W0)) & _MASK, (k1 + np.uint64(_W1)) & _MASK
    return c


def test_philox_reference_is_random123s():
    # Random123's known-answer vectors for philox4x32-10.
    assert [int(w) for w in philox4x32_10([0, 0, 0, 0], [0, 0])] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    pi = philox4x32_10([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0])
    assert [int(w) for w in pi] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def reference_normals(n, key, stream):
    """csrc/cpu/gaussian.h's normals in float64: groups of 64 from 16 counters, Box-Muller on word pairs."""
    out = np.empty(-(-n // 64) * 64)
    lanes = np.arange(16, dtype=np.uint64)
    for g in range(len(out) // 64):
        count = np.uint64(16 * g) + lanes
        counter = [count & _MASK, count >> np.uint64(32), np.full(16, stream, np.uint64), np.zeros(16, np.uint64)]
        words = philox4x32_10(counter, [key & 0xFFFFFFFF, key >> 32])
        for pair in range(2):
            u = words[2 * pair].astype(np.float64) * 2.0**-32 + 2.0**-33
            turns = (words[2 * pair + 1] >> np.uint64(8)).astype(np.float64) * 2.0**-24
            radius = np.sqrt(-2 * np.log(u))
            out[64 * g + 32 * pair : 64 * g + 32 * pair + 16] = radius * np.cos(2 * np.pi * turns)
            out[64 * g + 32 * pair + 16 : 64 * g + 32 * pair + 32] = radius * np.sin(2 * np.pi * turns)
    return out[:n]


def noise_only(shapes, seed, std=1.0, divisor=1.0, dtype=torch.float32, device="cpu"):
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype, device=device)) for s in shapes]
    for p in params:
        p.summed_grad = torch.zeros_like(p)
    add_noise_(params, std, divisor=divisor, seed=seed)
    return [p.grad for p in params]


@pytest.mark.parametrize("threads", [1, 2])
def test_noise_is_philox_box_muller_on_every_device_and_thread_count(device, threads):
    torch.set_num_threads(threads)
    key = (7 << 32) + 12345
    shapes = [(3000,), (70, 70), (5,)]
    grads = noise_only(shapes, key, std=2.0, divisor=4.0, device=device)
    for j, g in enumerate(grads):
        expected = reference_normals(g.numel(), key, j) * 2.0 / 4.0
        # float32 polynomials for ln, sin and cos: within a few float32 ulps of the normal's magnitude
        np.testing.assert_allclose(g.cpu().numpy().ravel(), expected, rtol=0, atol=2e-6)


def test_noise_is_the_same_bits_on_any_thread_count_and_capability():
    seen = []
    for capability in _ops._C.cpu_capabilities_built():
        if not _ops._C.cpu_runs(capability):
            continue
        _ops.set_cpu_capability(capability)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            seen.append(torch.cat([g.ravel() for g in noise_only([(200_000,), (17,)], 99)]))
    _ops.set_cpu_capability(_ops._default_cpu_capability())
    assert all(torch.equal(seen[0], s) for s in seen[1:])


@cuda_only
def test_cuda_normals_are_the_cpus():
    key = (3 << 40) + 77
    cpu = noise_only([(100_003,), (64, 65)], key, std=1.5, divisor=3.0)
    gpu = noise_only([(100_003,), (64, 65)], key, std=1.5, divisor=3.0, device="cuda")
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0)  # the same polynomials, no contraction either side


def test_noise_statistics_and_reruns():
    torch.manual_seed(0)
    (first,) = noise_only([(1_000_000,)], None, std=3.0)
    z = first.double() / 3.0
    assert abs(z.mean().item()) < 5 / 1000  # 5 standard errors of the mean
    assert abs(z.std().item() - 1) < 5 * math.sqrt(2 / 1e6)
    assert abs((z**4).mean().item() - 3) < 5 * math.sqrt(96 / 1e6)  # a normal's fourth moment
    assert 4.5 < z.abs().max().item() < 6.8  # a million normals reach ~5; the generator's largest is 6.76
    torch.manual_seed(0)
    (again,) = noise_only([(1_000_000,)], None, std=3.0)
    assert torch.equal(first, again)
    (next_step,) = noise_only([(1_000_000,)], None, std=3.0)
    assert not torch.equal(first, next_step)


def test_noise_from_a_generator_repeats():
    def run():
        params = make_params([(50, 3), (9,)], 4, torch.float32)
        clip_and_accumulate_(
            params, 1.0, noise_multiplier=1.1, expected_batch_size=4, generator=torch.Generator().manual_seed(5)
        )
        return [p.grad.clone() for p in params], params

    (a, params), (b, _) = run(), run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    expected, _ = reference(params, 1.0)
    noise = torch.cat([(g.double() * 4 - e).ravel() for g, e in zip(a, expected)])
    assert 0.5 < noise.std().item() / 1.1 < 1.5


# ---- bad input: named, nothing written -------------------------------------------------------------


def snapshot(params):
    return [(getattr(p, "summed_grad", None), p.grad) for p in params]


@pytest.mark.parametrize(
    "spoil, error, match",
    [
        (lambda ps: setattr(ps[1], "grad_sample", None), ValueError, r"params\[1\] \(shape \(7,\)\) has no per-sample"),
        (lambda ps: delattr(ps[0], "grad_sample"), ValueError, r"params\[0\].*has no per-sample"),
        (
            lambda ps: setattr(ps[1], "grad_sample", torch.zeros(4, 8)),
            ValueError,
            r"params\[1\].grad_sample has shape \(4, 8\)",
        ),
        (
            lambda ps: setattr(ps[1], "grad_sample", torch.zeros(3, 7)),
            ValueError,
            r"params\[1\].grad_sample holds 3 samples but params\[0\]'s hold 4",
        ),
        (lambda ps: setattr(ps[0], "grad_sample", "x"), TypeError, r"params\[0\].grad_sample must be a tensor"),
        (lambda ps: setattr(ps[0], "summed_grad", torch.zeros(2)), ValueError, r"params\[0\].summed_grad is"),
        (
            lambda ps: setattr(ps[0], "grad_sample", torch.zeros(4, 2, 3, dtype=torch.int32)),
            RuntimeError,
            r"parameter 0's per-sample gradient has dtype Int",
        ),
    ],
)
def test_bad_per_sample_gradients_are_named_and_nothing_is_written(spoil, error, match):
    params = make_params([(2, 3), (7,)], 4, torch.float32)
    spoil(params)
    before = snapshot(params)
    with pytest.raises(error, match=match):
        clip_and_accumulate_(params, 1.0, noise_multiplier=1.0, expected_batch_size=4)
    assert all(a is c and b is d for (a, b), (c, d) in zip(before, snapshot(params)))


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        ({"max_norm": -1.0}, ValueError, r"max_norm must be a finite number > 0, got -1.0"),
        ({"max_norm": float("nan")}, ValueError, r"max_norm must be a finite number > 0"),
        ({"max_norm": [1.0], "style": "per_layer"}, ValueError, r"one max_norm per parameter \(2\), got 1"),
        ({"max_norm": 1.0, "style": "per_layer"}, TypeError, r"style='per_layer' takes one max_norm per parameter"),
        ({"max_norm": 1.0, "style": "layer"}, ValueError, r"style must be one of \('flat', 'per_layer'\), got 'layer'"),
        ({"max_norm": 1.0, "clip": "auto"}, ValueError, r"clip must be one of \('abadi', 'automatic'\), got 'auto'"),
        (
            {"max_norm": 1.0, "clip": "automatic", "gamma": 0.0},
            ValueError,
            r"gamma must be a finite number > 0, got 0.0",
        ),
        (
            {"max_norm": 1.0, "noise_multiplier": -0.5},
            ValueError,
            r"noise_multiplier must be a finite number >= 0, got -0.5",
        ),
        (
            {"max_norm": 1.0, "expected_batch_size": 0},
            ValueError,
            r"expected_batch_size must be a finite number > 0, got 0",
        ),
        ({"max_norm": 1.0, "noise_multiplier": 1.0, "seed": 1.5}, TypeError, r"seed must be an int, got 1.5"),
    ],
)
def test_bad_arguments_are_named_and_nothing_is_written(arguments, error, match):
    params = make_params([(2, 3), (7,)], 4, torch.float32)
    with pytest.raises(error, match=match):
        clip_and_accumulate_(params, **arguments)
    assert all(getattr(p, "summed_grad", None) is None and p.grad is None for p in params)


def test_norms_of_mismatched_batches_are_refused():
    with pytest.raises(
        RuntimeError, match="parameter 1's per-sample gradients hold 2 samples but parameter 0's hold 3"
    ):
        per_sample_norms([torch.zeros(3, 4), torch.zeros(2, 4)])
    with pytest.raises(TypeError, match=r"grad_samples\[0\] must be a tensor \[batch, \*shape\] or a non-empty list"):
        per_sample_norms([[]])
