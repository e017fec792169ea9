"""Exact norms (torchclip.set_exact_norm, csrc/exact_sum.h, cpu/exact_norm_kernel.cpp): p = 1 and 2 norms are
the true norm rounded once, against an oracle in integer arithmetic on every element, and the same bits
whatever the thread count, the order of the list or the views that cover a tensor."""

import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
import torch
from testing import cuda_only, make_tensor

import torchclip
from torchclip import _ops

ORDERS = [1.0, 2.0]


@pytest.fixture
def exact(cpu_capability):
    previous = torchclip.set_exact_norm(True)
    yield
    torchclip.set_exact_norm(previous)


def exact_sum(tensors, norm_type) -> Fraction:
    """sum |x| (p = 1) or x^2 (p = 2) over every element, exactly: integers over a power of two."""
    total = Fraction(0)
    for t in tensors:
        numerators, shift = [], 0
        for value in t.detach().double().reshape(-1).tolist():
            numerator, denominator = abs(value).as_integer_ratio()
            if norm_type == 2.0:
                numerator, denominator = numerator * numerator, denominator * denominator
            numerators.append((numerator, denominator.bit_length() - 1))
            shift = max(shift, denominator.bit_length() - 1)
        total += Fraction(sum(n << (shift - k) for n, k in numerators), 1 << shift)
    return total


def float_bits(value: float) -> int:
    return int.from_bytes(torch.tensor(value, dtype=torch.float64).numpy().tobytes(), "little")


def sqrt_rounded(square: Fraction) -> float:
    """sqrt(square) rounded to the nearest float64, ties to even: the neighbours of an estimate decided
    by comparing the square with the midpoints' squares, exactly."""
    if square == 0:
        return 0.0
    if square >= (Fraction(2**1024) - Fraction(2**970)) ** 2:
        return math.inf
    scale = (square.numerator.bit_length() - square.denominator.bit_length()) // 2
    root = math.ldexp(math.sqrt(float(square / Fraction(4) ** scale)), scale)

    def midpoint_square(low):
        high = math.nextafter(low, math.inf)
        return ((Fraction(low) + (Fraction(2**1024) if high == math.inf else Fraction(high))) / 2) ** 2

    for _ in range(4):
        up, down = math.nextafter(root, math.inf), math.nextafter(root, 0.0)
        if midpoint_square(root) < square:
            root = up
        elif midpoint_square(root) == square:
            return root if float_bits(root) % 2 == 0 else up
        elif midpoint_square(down) > square:
            root = down
        elif midpoint_square(down) == square:
            return down if float_bits(down) % 2 == 0 else root
        else:
            return root
    raise AssertionError("the estimate was more than four ulps off")


def exact_norm(tensors, norm_type) -> float:
    total = exact_sum(tensors, norm_type)
    if norm_type == 2.0:
        return sqrt_rounded(total)
    return math.inf if total >= Fraction(2**1024) - Fraction(2**970) else float(total)


def as_dtype(value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64).to(dtype)


def wide_range(dtype, n, seed):
    """Values across the dtype's whole range: normal and subnormal magnitudes, zeros, both signs."""
    info = torch.finfo(dtype)
    generator = torch.Generator().manual_seed(seed)
    low = math.log2(info.smallest_normal * info.eps) + 1
    high = math.log2(info.max) - 2
    exponents = torch.rand(n, generator=generator, dtype=torch.float64) * (high - low) + low
    signs = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    values = (signs * torch.exp2(exponents)).to(dtype)
    values[torch.randint(0, n, (n // 10,), generator=generator)] = 0
    return values


DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SIZES = [1, 15, 1023, 1024, 1025, 5000, 70000]


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_are_the_true_norm_rounded_once(exact, dtype, norm_type):
    tensors = [make_tensor((n,), dtype, seed=n, scale=0.1) for n in SIZES]
    tensors.append(wide_range(dtype, 3000, seed=1))
    total, per_tensor = _ops.multi_tensor_norm(tensors, norm_type)
    for i, t in enumerate(tensors):
        assert per_tensor[i].item() == exact_norm([t], norm_type), f"tensors[{i}] ({t.numel()} elements)"
    expected = exact_norm(tensors, norm_type)
    assert torch.equal(total, as_dtype(expected, dtype)), (total.item(), expected)


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize(
    "dtype, values",
    [
        (torch.float32, [1e-30, 1e30, -3e-38, 1e-45, 0.0, 2.5e-40]),
        (torch.float64, [1e-300, 1e300, -5e-324, 2.2e-308, 0.0, 1e-310, 1.7e308]),
        (torch.float16, [6e-8, 65504.0, -1e-5, 0.0]),
        (torch.bfloat16, [1e-38, 3e38, -9.2e-41, 0.0]),
    ],
)
def test_a_wide_dynamic_range_loses_nothing(exact, dtype, norm_type, values):
    # The small terms are below the large one's last bit: float64 accumulation would drop them all.
    t = torch.tensor(values * 700, dtype=dtype)
    _, per_tensor = _ops.multi_tensor_norm([t], norm_type)
    assert per_tensor.item() == exact_norm([t], norm_type)


def blocks_whose_magnitudes_move(dtype, seed):
    """Blocks of 1,024 values (the kernel's block) at scales that send them to the plain run, the quanta run,
    both in turn, a fresh run or the levels: scales up and down by 2x (within a run's headroom) and by 2^20, a
    lone tiny value, all zeros, one value, magnitudes just below a power of two (the largest terms a run's
    lanes can take), the dtype's smallest and largest magnitudes; then more blocks of one scale than a run
    takes, and a tail shorter than a vector."""
    info = torch.finfo(dtype)
    generator = torch.Generator().manual_seed(seed)
    blocks = []

    def normal(scale):
        return torch.randn(1024, generator=generator, dtype=torch.float64) * scale

    jump = min(2.0**20, 2.0 ** math.floor(math.log2(info.max) / 2))  # (2^8 for float16)
    for scale in (1.0, 2.0, 4.0, 1.0, jump, 1.0, 1 / jump, 0.5, 8.0, 1.0):
        blocks.append(normal(scale))
    lone_tiny = normal(1.0)
    lone_tiny[517] = 2.0**-30
    blocks.append(lone_tiny)
    blocks.append(torch.zeros(1024, dtype=torch.float64))
    single = torch.zeros(1024, dtype=torch.float64)
    single[3] = -3.0
    blocks.append(single)
    below_powers = torch.full((1024,), 2.0 - info.eps, dtype=torch.float64)  # the largest value below 2
    below_powers[::3] *= -1
    blocks.append(below_powers)
    blocks.append(normal(1.0).sign() * info.smallest_normal * info.eps)  # subnormal: the smallest magnitude
    blocks.append(normal(1.0).clamp(-1, 1) * info.max)
    blocks.append(normal(1.0))
    blocks.extend(normal(1e-3) for _ in range(20))  # more terms of one scale than one run takes
    blocks.append(torch.randn(5, generator=generator, dtype=torch.float64))
    return torch.cat(blocks).to(dtype)


def kernel_sums(tensors, norm_type) -> list[Fraction]:
    """The kernel's exact sums themselves (_ops.exact_sums' digits), each tensor's then the total's: a sum that
    lost a low bit would still round to the right norm almost always, so the bounds are tested on these."""
    rows = torch.cat([_ops.exact_sums(tensors, norm_type, True), _ops.exact_sums(tensors, norm_type, False)])
    assert not rows[:, :2].any(), "no NaN or inf here"
    return [sum(Fraction(int(d)) * Fraction(2) ** (32 * k - 2176) for k, d in enumerate(row[2:])) for row in rows]


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_runs_across_blocks_whose_magnitudes_move(exact, dtype, norm_type):
    t = blocks_whose_magnitudes_move(dtype, seed=7)
    pieces = [t, t[1000:9000], t[4096:], t.flip(0)]
    total, per_tensor = _ops.multi_tensor_norm(pieces, norm_type)
    for i, piece in enumerate(pieces):
        assert per_tensor[i].item() == exact_norm([piece], norm_type), f"pieces[{i}]"
    assert torch.equal(total, as_dtype(exact_norm(pieces, norm_type), dtype))
    assert kernel_sums(pieces, norm_type) == [
        *(exact_sum([piece], norm_type) for piece in pieces),
        exact_sum(pieces, norm_type),
    ]


def runs_at_their_bounds(dtype, norm_type, seed):
    """Runs as large as the kernel takes, of blocks whose largest terms are close to 2^top and whose one small
    value's last bit sweeps across the plain and the quanta runs' bounds: a run that took a block beyond its
    bound would round that bit away. For float32 squares, whose runs are quanta runs, the large values are
    those whose squares' remainders under the quantum 2^-39 are all +57/128 of it, so the remainders' sum is
    as large as it can be."""
    generator = torch.Generator().manual_seed(seed)
    eps = torch.finfo(dtype).eps
    if dtype == torch.float32 and norm_type == 2.0:
        m = torch.randint(int(1.5 * 2**23), 2**24, (200_000,), generator=generator, dtype=torch.int64)
        m = m[(m * m) % 128 == 57]
        large = m.double() * 2.0**-23
    else:
        large = 2 - eps * torch.randint(1, 4, (4096,), generator=generator).double()  # |x| < 2, squares < 4
    blocks = []
    for exponent in range(-4, -52, -1):  # (float32 squares: past the quanta run's floor, 2^(top - 43 - 48))
        small = (1 + eps) * 2.0**exponent  # its last bit set: 2^(exponent - mantissa bits)
        if small < torch.finfo(dtype).smallest_normal:
            break
        for _ in range(9):  # more than a run's 8,192 terms
            block = large[torch.randint(0, len(large), (1024,), generator=generator)].clone()
            block[torch.randint(0, 1024, (1,), generator=generator)] = small
            blocks.append(block)
    return torch.cat(blocks).to(dtype)


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_runs_stop_at_their_bounds(exact, dtype, norm_type):
    t = runs_at_their_bounds(dtype, norm_type, seed=11)
    assert kernel_sums([t], norm_type)[0] == exact_sum([t], norm_type)
    # A long span's first block is cut at a block's edge in memory, so its runs meet blocks that straddle these;
    # as tensors of three blocks each the runs meet them as built, across the tensors for the total, and fill up
    # to their bounds.
    pieces = list(t.split(3 * 1024))
    assert kernel_sums(pieces, norm_type)[-1] == exact_sum(pieces, norm_type)


def at_a_block_edge(values: torch.Tensor) -> torch.Tensor:
    """values in a view whose data starts where the kernel's blocks of a long span start (a multiple of a block's
    bytes), so that its blocks are the kernel's."""
    block_bytes = 1024 * values.element_size()
    buffer = torch.empty(values.numel() + 1024, dtype=values.dtype)
    start = (-buffer.data_ptr()) % block_bytes // values.element_size()
    view = buffer[start : start + values.numel()]
    view.copy_(values)
    return view


def small_values_at_the_run_floor(dtype, seed):
    """Pairs of blocks: one of magnitudes in [1, 2), which starts or joins a run, then one of magnitudes up to
    2^11, its last value small, with its last bit set. The scales take the run's lanes close to their limit,
    where a term whose last bit lies below the run's lowest bit would be rounded; the small value's exponent
    sweeps across the floor that a run of 16-bit values sets from its first block (below it, a block's lowest
    bit is folded from its smallest value)."""
    info = torch.finfo(dtype)
    generator = torch.Generator().manual_seed(seed)
    blocks = []
    for scale in (1.0, 2.0**2, 2.0**4, 2.0**4.5, 2.0**5, 2.0**8, 2.0**10):
        for exponent in range(-2, -40, -1):
            small = (1 + info.eps) * 2.0**exponent
            if small < info.smallest_normal:
                break
            blocks.append(1 + torch.rand(1024, generator=generator, dtype=torch.float64))
            block = scale * (1 + torch.rand(1024, generator=generator, dtype=torch.float64))
            block[-1] = small
            blocks.append(block)
    return at_a_block_edge(torch.cat(blocks).to(dtype))


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_value_below_the_run_floor_lowers_the_runs_lowest_bit(exact, dtype, norm_type):
    t = small_values_at_the_run_floor(dtype, seed=17)
    assert kernel_sums([t], norm_type) == [exact_sum([t], norm_type)] * 2


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_long_spans_walked_block_by_block(exact, dtype, norm_type):
    # Spans of four blocks or more: a short first block up to a block's edge in memory (from 8 blocks on), whole
    # blocks each read once into a run that checks its sums after (16-bit values, float32 squares) or walked
    # pipelined, each block bounded by the loop that sums the one before (float32 magnitudes), a tail; at several
    # offsets from the edge, at the sizes where the cut begins, and with blocks of different scales meeting in the
    # runs. Among float32's, a block with one value far below the rest, whose squares are too wide for either run:
    # the check refuses it, it goes to the levels, and for |x| no run's loop bounds the block after it, whose
    # bounds are then read on their own. Spans starting at a page, so no short first block: 15, 16 and 17 whole
    # blocks, around where a span's blocks are read as two streams (an odd one left for the end). And one value far
    # below its block's, 24 values into a block from a page: in the vectors a checked loop adds into its second set
    # of sums, where it keeps more than one (AVX2), whose smallest values the check must see as well. And a block
    # with a zero and a value far below the block's others in the same lane of the checked loops, a block of zeros,
    # and a block with a zero and such a value in lanes of their own.
    scales = torch.exp2(torch.randint(-12, 4, (48,), generator=torch.Generator().manual_seed(5)).double())
    base = (make_tensor((48 * 1024,), torch.float64, seed=3) * scales.repeat_interleave(1024)).to(dtype)
    base[5000:6000] = 0
    if dtype == torch.float32:
        base[9 * 1024 + 17] = 2.0**-40
    at_page = (-base.data_ptr() % 4096) // base.element_size()
    tiny = 2.0**-24 if dtype == torch.float16 else 2.0**-40
    base[at_page + 11 * 1024 + 24] = tiny
    base[at_page + 12 * 1024 + 100], base[at_page + 12 * 1024 + 164] = -0.0, tiny  # (164: 100's lane on every ISA)
    base[at_page + 13 * 1024 : at_page + 14 * 1024] = 0
    base[at_page + 14 * 1024 + 37], base[at_page + 14 * 1024 + 301] = 0.0, -tiny  # (in lanes of their own)
    spans = [
        base[offset : offset + n]
        for offset, n in [
            (0, 4096),
            (0, 4097),
            (1, 4095 + 1024),
            (7, 5 * 1024),
            (1000, 8 * 1024 + 3),
            (1024, 16 * 1024),
            (333, 17 * 1024 + 100),
            (2, 30_000),
            (0, 48 * 1024),
            (at_page, 15 * 1024),
            (at_page, 16 * 1024),
            (at_page + 1024, 17 * 1024 + 5),
        ]
    ]
    expected = [*(exact_sum([s], norm_type) for s in spans), exact_sum(spans, norm_type)]
    for threads in (1, 2):  # (two threads cut the long spans into pieces: walks that start mid-span)
        torch.set_num_threads(threads)
        assert kernel_sums(spans, norm_type) == expected, threads


def small_spans_of_every_type(seed):
    """Where only the total is wanted, the kernel gathers blocks shorter than 1,024 values into whole ones: tensors
    of 1 to 1,100 values in runs of one type, then another (a new type adds the gathered block as it is), long
    views starting past a block's edge (their first and last blocks gathered), and magnitudes that send gathered
    blocks to either run and past both."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [1, 3, 15, 16, 17, 100, 511, 1000, 1023, 1024, 1025, 1100]
    tensors = []
    for i in range(120):
        dtype = DTYPES[(i // 7) % len(DTYPES)]
        n = sizes[int(torch.randint(0, len(sizes), (1,), generator=generator))]
        if i % 5 == 0:
            values = wide_range(dtype, n, seed=seed + i)
        else:
            low, high = (-20, 10) if dtype == torch.float16 else (-40, 20)  # (float16's largest: 65504)
            scale = 2.0 ** int(torch.randint(low, high, (1,), generator=generator))
            values = (torch.randn(n, generator=generator, dtype=torch.float64) * scale).to(dtype)
        tensors.append(values)
    for dtype in (torch.float32, torch.bfloat16):
        tensors.append(torch.randn(10_000, generator=generator, dtype=torch.float64).to(dtype)[5:9_003])
    return tensors


@pytest.mark.parametrize("norm_type", ORDERS)
def test_small_spans_gathered_into_whole_blocks(exact, norm_type):
    tensors = small_spans_of_every_type(seed=5)
    expected = [*(exact_sum([t], norm_type) for t in tensors), exact_sum(tensors, norm_type)]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert kernel_sums(tensors, norm_type) == expected, threads
    # (an odd count is never whole vectors, so gathered on every capability)
    victim = next(
        i for i, t in enumerate(tensors) if 16 < t.numel() < 1024 and t.numel() % 2 and t.dtype != torch.float64
    )
    for bad, flags in ((math.inf, [0, 1]), (math.nan, [1, 0])):  # the total's (NaN, inf) flags
        spoiled = [t.clone() for t in tensors]
        spoiled[victim][-1] = bad  # in a gathered block, beside finite values of other tensors
        assert _ops.exact_sums(spoiled, norm_type, False)[0, :2].tolist() == flags, bad


def views_end_to_end(dtype, seed):
    """Views that cover one buffer end to end, as DDP's buckets and FSDP's flat parameters hand gradients: sizes from 1
    value to several blocks, each view's values at its own scale (some across the dtype's range), an empty view
    among them, and one of 70,000 values in the middle, so that a joined run is longer than two of the walk's chunks
    (65,536 values) and two threads take pieces of it. Where only the total is wanted, the kernel reads each run of
    them as one span."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [1, 3, 15, 16, 17, 100, 1000, 1023, 1024, 1025, 3000, 0]
    chosen = [sizes[int(i)] for i in torch.randint(0, len(sizes), (60,), generator=generator)]
    chosen[25] = 70_000
    buffer = torch.empty(sum(chosen), dtype=dtype)
    views, start = [], 0
    for i, n in enumerate(chosen):
        view = buffer[start : start + n]
        if i % 7 == 0:
            view.copy_(wide_range(dtype, n, seed=seed + i))
        else:
            low, high = (-20, 10) if dtype == torch.float16 else (-40, 20)
            scale = 2.0 ** int(torch.randint(low, high, (1,), generator=generator))
            view.copy_((torch.randn(n, generator=generator, dtype=torch.float64) * scale).to(dtype))
        views.append(view)
        start += n
    return buffer, views


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_views_end_to_end_are_summed_as_one_span(exact, dtype, norm_type):
    buffer, views = views_end_to_end(dtype, seed=11)
    other = torch.randn(100, generator=torch.Generator().manual_seed(2)).to(dtype)
    # Lists with runs that meet end to end between ones that do not: the views in order, reversed (no two meet), a
    # view listed twice in a row and views that overlap (each listing counted: neither meets its neighbour's end),
    # another tensor between two runs, and, for 16-bit dtypes, the buffer's first bytes seen as float32 and the rest
    # (which starts where the float32 view ends, in another dtype).
    lists = {
        "in order": views,
        "reversed": views[::-1],
        "twice in a row": [*views[:10], views[9], *views[10:]],
        "overlapping": [*views[:20], buffer[5:4000], *views[20:]],
        "another between": [*views[:30], other, *views[30:]],
    }
    if dtype.itemsize == 2:
        lists["another dtype"] = [buffer[:64].view(torch.float32), buffer[64:]]
    for name, tensors in lists.items():
        expected = [*(exact_sum([t], norm_type) for t in tensors), exact_sum(tensors, norm_type)]
        for threads in (1, 2):  # (two threads cut a joined span into pieces)
            torch.set_num_threads(threads)
            assert kernel_sums(tensors, norm_type) == expected, (name, threads)
            total = torchclip.get_total_norm(tensors, norm_type)  # (the total alone, as the clip takes it)
            assert torch.equal(total, as_dtype(exact_norm(tensors, norm_type), total.dtype)), (name, threads)
    for bad, flags in ((math.inf, [0, 1]), (math.nan, [1, 0])):  # the total's (NaN, inf) flags, in a joined span
        _, spoiled = views_end_to_end(dtype, seed=11)
        next(view for view in spoiled[30:] if view.numel() > 16)[-1] = bad
        assert _ops.exact_sums(spoiled, norm_type, False)[0, :2].tolist() == flags, bad


def extremes_at_the_end(dtype, seed):
    """Tensors of 1 to 66 values (every tail a vector leaves, 16-bit lanes on AVX-512 included), 100 and 1,000,
    of values near 1 whose last one or two are the largest and the smallest magnitudes: a block copied into a
    buffer (gathered, or padded where each tensor's norm is wanted) takes its bounds with the copy, and a tail
    shorter than a vector is taken as the vector that ends with the tensor."""
    info = torch.finfo(dtype)
    generator = torch.Generator().manual_seed(seed)
    large, small = info.max / 8, info.smallest_normal * (1 + info.eps)  # (small: its last bit the lowest)
    tensors = []
    for n in [*range(1, 67), 100, 1000]:
        for last in ([large], [small], [small, large], [large, small]):
            values = 1 + torch.rand(n, generator=generator, dtype=torch.float64)
            values[-len(last) :] = torch.tensor(last[-n:], dtype=torch.float64)
            tensors.append(values.to(dtype))
    return tensors


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_copied_blocks_are_bounded_by_every_value(exact, dtype, norm_type):
    tensors = extremes_at_the_end(dtype, seed=3)
    expected = [*(exact_sum([t], norm_type) for t in tensors), exact_sum(tensors, norm_type)]
    for threads in (1, 2):  # (two threads gather into two blocks, each list's part its own)
        torch.set_num_threads(threads)
        assert kernel_sums(tensors, norm_type) == expected, threads


@pytest.mark.parametrize("norm_type", ORDERS)
def test_the_same_bits_for_any_threads_order_and_views(exact, norm_type):
    whole = make_tensor((300_001,), torch.float32, seed=3)
    others = [make_tensor((n,), torch.bfloat16, seed=n) for n in (5, 70_000, 1)]
    reference = _ops.multi_tensor_norm([whole, *others], norm_type)[0]
    assert reference.item() == as_dtype(exact_norm([whole, *others], norm_type), torch.float32).item()
    covers = {
        "halves": list(whole.split(150_000)),
        "uneven": list(whole.split([1, 99_999, 3, 200_000 - 2])),
        "strided halves": [whole[::2], whole[1::2]],
    }
    for name, pieces in covers.items():
        assert torch.equal(_ops.multi_tensor_norm([*pieces, *others], norm_type)[0], reference), name
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        listed = [whole, *others]
        listed = [listed[i] for i in torch.randperm(len(listed), generator=generator).tolist()]
        assert torch.equal(_ops.multi_tensor_norm(listed, norm_type)[0], reference)
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        assert torch.equal(_ops.multi_tensor_norm([whole, *others], norm_type)[0], reference), threads


def test_clipping_by_an_exact_norm_gives_the_same_bits_in_any_order(exact):
    def params(order):
        made = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 300_001, 7)]
        for p, n in zip(made, (1000, 300_001, 7)):
            p.grad = make_tensor((n,), torch.float32, seed=n)
        return [made[i] for i in order]

    first, second = params([0, 1, 2]), params([2, 0, 1])
    total = torchclip.clip_grad_norm_(first, 1.0)
    torch.set_num_threads(1)
    assert torch.equal(torchclip.clip_grad_norm_(second, 1.0), total)
    by_size = sorted(second, key=lambda p: p.numel())
    for a, b in zip(sorted(first, key=lambda p: p.numel()), by_size):
        assert torch.equal(a.grad, b.grad)
    clip = torchclip.ClipGradByGlobalNorm(1.0)
    clip(params([1, 2, 0]))
    expected = exact_norm([make_tensor((n,), torch.float32, seed=n) for n in (1000, 300_001, 7)], 2.0)
    assert clip.last_global_norm.item() == as_dtype(expected, torch.float32).item()


def test_nan_and_inf(exact):
    x = torch.randn(5000)
    x[77] = math.inf
    y = torch.randn(10)
    assert math.isinf(_ops.multi_tensor_norm([x, y], 2.0)[0].item())
    y[3] = math.nan
    total, per_tensor = _ops.multi_tensor_norm([x, y], 1.0)
    assert math.isnan(total.item()) and math.isinf(per_tensor[0].item()) and math.isnan(per_tensor[1].item())
    for where in (0, 1234, 4095, 4999):  # a NaN where the block's largest magnitude does not see it
        z = torch.randn(5000)
        z[where] = math.nan
        assert all(math.isnan(n) for n in _ops.multi_tensor_norm([z], 2.0)[1].tolist() + [z.sum().item()])


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_nan_or_inf_in_a_checked_block_is_seen(exact, dtype, norm_type):
    # The runs that check their sums after a block (no bounds pass reads it first) see a NaN or inf only in their
    # lanes: one at a block's start, middle and end, in a span's first and later whole blocks, and beside values
    # whose own runs would take them, for each tensor and the total. And whole blocks (from a block's edge in
    # memory, read once) of infs, of infs among zeros (their smallest non-zero magnitude is inf), and of NaNs.
    ones = [(8192, math.nan), (8192 + 511, math.inf), (2 * 8192 - 1, -math.inf), (12 * 1024 + 7, math.nan)]
    blocks = [(8, 1, -math.inf), (4, 3, math.inf), (9, 1, math.nan)]  # (which whole block, every how many, what)
    for threads in (1, 2):  # (two threads cut the span into pieces: its whole blocks are read once either way)
        torch.set_num_threads(threads)
        for where, every, bad in [(where, None, bad) for where, bad in ones] + blocks:
            x = torch.randn(16 * 1024 + 100, generator=torch.Generator().manual_seed(where)).to(dtype)
            if every is None:
                x[where] = bad
            else:
                edge = (-x.data_ptr() % (1024 * x.element_size())) // x.element_size()
                block = x[edge + where * 1024 : edge + (where + 1) * 1024]
                block.zero_()
                block[::every] = bad
            clean = torch.randn(9 * 1024, generator=torch.Generator().manual_seed(1)).to(dtype)
            total, per_tensor = _ops.multi_tensor_norm([clean, x], norm_type)
            expected = math.nan if math.isnan(bad) else math.inf
            for got in (total.item(), per_tensor[1].item()):
                assert math.isnan(got) if math.isnan(expected) else got == expected, (where, got)
            assert per_tensor[0].item() == exact_norm([clean], norm_type)


def test_tensors_atens_path_would_take_are_exact_too(exact):
    strided = make_tensor((4000,), torch.float32, seed=1, layout="strided")
    negated = torch._neg_view(make_tensor((3000,), torch.float64, seed=2))
    z = torch.complex(make_tensor((500,), torch.float32, seed=3), make_tensor((500,), torch.float32, seed=4))
    real_view = torch.view_as_real(z)
    total, per_tensor = _ops.multi_tensor_norm([strided, negated, z], 2.0)
    assert per_tensor[0].item() == exact_norm([strided], 2.0)
    assert per_tensor[1].item() == exact_norm([negated.resolve_neg()], 2.0)
    assert per_tensor[2].item() == exact_norm([real_view], 2.0)
    assert total.item() == exact_norm([strided, negated.resolve_neg(), real_view], 2.0)


def test_the_switch(cpu_capability):
    previous = torchclip.set_exact_norm(True)
    try:
        assert torchclip.get_exact_norm() is True
        assert torchclip.set_exact_norm(False) is True and torchclip.get_exact_norm() is False
        with pytest.raises(TypeError, match="enabled must be a bool, got 1"):
            torchclip.set_exact_norm(1)
    finally:
        torchclip.set_exact_norm(previous)
    code = "import torchclip; print(torchclip.get_exact_norm())"
    for value, expected in (("1", "True"), ("0", "False")):
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "TORCHCLIP_EXACT_NORM": value},
        )
        assert result.stdout.strip() == expected, result.stderr
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "TORCHCLIP_EXACT_NORM": "yes"}
    )
    assert "TORCHCLIP_EXACT_NORM must be 0 or 1, got 'yes'" in result.stderr


def intel_cpu() -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        return any(line.split(":")[-1].strip() == "GenuineIntel" for line in cpuinfo if line.startswith("vendor_id"))


# The tests that hold the kernels to the oracle, run again where a setting takes other paths.
ORACLE_TESTS = (
    "true_norm_rounded_once or wide_dynamic_range or runs_across_blocks or runs_stop_at_their_bounds"
    " or below_the_run_floor or long_spans or small_spans_gathered or views_end_to_end or copied_blocks"
    " or a_nan_or_inf_in_a_checked_block or subnormals_count"
)


def assert_oracle_tests_pass_with(setting: str, value: str) -> None:
    """ORACLE_TESTS in a fresh process with the environment variable `setting` set to `value` (read once a process)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", ORACLE_TESTS],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(__file__),
        env={**os.environ, setting: value},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="the CPU's vendor is read from /proc/cpuinfo")
def test_the_other_vendors_paths_are_exact_too():
    """The kernels choose some loops by the CPU's vendor (simd::intel_cpu: how far to ask ahead, float32 squares in
    512-bit or 256-bit lanes): the oracle tests again with the paths of the vendor this CPU is not."""
    assert_oracle_tests_pass_with("TORCHCLIP_CPU_VENDOR", "other" if intel_cpu() else "intel")


def test_without_the_inexact_flag_the_other_runs_are_exact_too():
    """The plain run checks its sums by the processor's inexact flag (cpu/inexact_flag.h), and takes nothing where an
    addition that rounds does not raise it (valgrind); TORCHCLIP_INEXACT_FLAG=off has it so here: the oracle tests
    again, every block on the quanta run or the levels."""
    assert_oracle_tests_pass_with("TORCHCLIP_INEXACT_FLAG", "off")


@pytest.mark.parametrize("norm_type", ORDERS)
def test_subnormals_count_where_torch_flushes_them_and_the_setting_stays(exact, norm_type):
    """torch.set_flush_denormal(True) sets the processor to read subnormal operands as 0 (DAZ), which would drop
    them in the kernels' conversions to float64: the exact kernels run under a state of their own and put the
    caller's back."""
    generator = torch.Generator().manual_seed(5)
    tensors = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        # Whole blocks of subnormals (the runs take them: a narrow range), then the dtype's whole range (the levels).
        subnormals = torch.rand(5000, generator=generator, dtype=torch.float64) * torch.finfo(dtype).smallest_normal
        tensors += [(subnormals * (torch.randint(0, 2, (5000,), generator=generator) * 2 - 1)).to(dtype)]
        tensors += [wide_range(dtype, 3000, seed=5)]
    assert all(t.count_nonzero() > 0 for t in tensors)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        _, per_tensor = _ops.multi_tensor_norm(tensors, norm_type)
        still_flushed = (torch.tensor([1e-310], dtype=torch.float64) * 1.0).item()
    finally:
        torch.set_flush_denormal(False)
    assert [n.item() for n in per_tensor] == [exact_norm([t], norm_type) for t in tensors]
    assert still_flushed == 0.0


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plain_lanes_far_apart_are_each_counted(exact, dtype, norm_type):
    """Even and odd values go to different float64 lanes of the plain run: with magnitudes 2^10 apart (squares 2^20),
    the lanes lie too far apart to be counted in one unit, and the flush adds them one by one."""
    t = torch.empty(8 * 1024, dtype=torch.float64)
    t[0::2], t[1::2] = 1.5, -1.25 * 2.0**-10
    t = at_a_block_edge(t.to(dtype))
    assert kernel_sums([t], norm_type) == [exact_sum([t], norm_type)] * 2


def test_other_orders_keep_float64_accumulation(exact):
    tensors = [make_tensor((1000,), torch.float32, seed=1)]
    for norm_type in (math.inf, 3.0, 0.5):
        total, _ = _ops.multi_tensor_norm(tensors, norm_type)
        torchclip.set_exact_norm(False)
        assert torch.equal(total, _ops.multi_tensor_norm(tensors, norm_type)[0])
        torchclip.set_exact_norm(True)


# ---- exact= on every norm-taking function and class -------------------------------------------------

# float64 gradients: their float64 accumulation rounds on almost every addition, so an exact norm that was
# not taken would show in the last bits (test_exact_decides_the_last_bits holds the data to that).
EXACT_GRAD_SIZES = (50_000, 3001, 7)


def exact_grads():
    return [make_tensor((n,), torch.float64, seed=n) for n in EXACT_GRAD_SIZES]


def exact_params():
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in EXACT_GRAD_SIZES]
    for p, g in zip(params, exact_grads()):
        p.grad = g
    return params


@pytest.fixture(scope="module")
def oracle():
    grads = exact_grads()
    return {"total": exact_norm(grads, 2.0), "per_tensor": [exact_norm([g], 2.0) for g in grads]}


def _clip_state(clip, read):
    def take(exact):
        made = clip(exact)
        made(exact_params())
        return read(made)

    return take


def _folded_step(exact):
    params = exact_params()
    clip = torchclip.ClipGradByGlobalNorm(1e30, exact=exact)
    torchclip.optim.AdamW(params, lr=1e-3, fused=True, grad_clip=clip).step()
    return clip.last_global_norm


# name -> (what it returns: "total" or "per_tensor", a function of exact giving that)
NORM_TAKERS = {
    "get_total_norm": ("total", lambda exact: torchclip.get_total_norm(exact_grads(), exact=exact)),
    "clip_grad_norm_": ("total", lambda exact: torchclip.clip_grad_norm_(exact_params(), 1e30, exact=exact)),
    "ClipGradByGlobalNorm": (
        "total",
        _clip_state(lambda exact: torchclip.ClipGradByGlobalNorm(1e30, exact=exact), lambda c: c.last_global_norm),
    ),
    "GradientClipByGlobalNorm (Python walk)": (
        "total",
        _clip_state(
            lambda exact: torchclip.GradientClipByGlobalNorm(1e30, need_clip=lambda p: True, exact=exact),
            lambda c: c.last_global_norm,
        ),
    ),
    "ClipGradByNorm": (
        "per_tensor",
        _clip_state(lambda exact: torchclip.ClipGradByNorm(1e30, exact=exact), lambda c: c.last_norms),
    ),
    "GradientClipByNorm (Python walk)": (
        "per_tensor",
        _clip_state(
            lambda exact: torchclip.GradientClipByNorm(1e30, need_clip=lambda p: True, exact=exact),
            lambda c: c.last_norms,
        ),
    ),
    "ClipGradByZScore": (
        "total",
        _clip_state(lambda exact: torchclip.ClipGradByZScore(exact=exact), lambda c: c.last_global_norm),
    ),
    "ClipGradByQuantile": (
        "total",
        _clip_state(
            lambda exact: torchclip.ClipGradByQuantile(0.9, 4, global_threshold=True, exact=exact),
            lambda c: c.last_norms,
        ),
    ),
    "ClipGradByNormEMA": (
        "per_tensor",
        _clip_state(lambda exact: torchclip.ClipGradByNormEMA(exact=exact), lambda c: c.last_norms),
    ),
    "SkipStepOnSpike": (
        "total",
        _clip_state(lambda exact: torchclip.SkipStepOnSpike(exact=exact), lambda c: c.history[0]),
    ),
    "grad_norm": (
        "total",
        lambda exact: torchclip.grad_norm(_module_of(exact_params()), 2, exact=exact)["grad_2.0_norm_total"],
    ),
    "global_norm": ("total", lambda exact: torchclip.global_norm(exact_grads(), exact=exact)),
    "clip_by_global_norm": ("total", lambda exact: torchclip.clip_by_global_norm(exact_grads(), 1e30, exact=exact)[1]),
    "folded optimizer step": ("total", _folded_step),
}


def _module_of(params):
    module = torch.nn.Module()
    for i, p in enumerate(params):
        module.register_parameter(f"p{i}", p)
    return module


def test_exact_decides_the_last_bits(cpu_capability, oracle):
    inexact = torchclip.get_total_norm(exact_grads(), exact=False).item()
    assert inexact != oracle["total"], "the test data no longer tells an exact norm from float64 accumulation"


@pytest.mark.parametrize("name", list(NORM_TAKERS))
def test_exact_is_taken_per_call_whatever_the_process_setting(cpu_capability, oracle, name):
    kind, take = NORM_TAKERS[name]
    previous = torchclip.set_exact_norm(False)
    try:
        got = take(True)
        if kind == "total":
            assert got.item() == oracle["total"], (got.item(), oracle["total"])
        else:
            assert got.tolist() == oracle["per_tensor"]
        inexact = take(None)
        torchclip.set_exact_norm(True)
        assert torch.equal(take(False), inexact)  # exact=False wins over the process-wide setting
        assert torch.equal(take(None), got)
    finally:
        torchclip.set_exact_norm(previous)


@pytest.mark.parametrize(
    "call",
    [
        lambda params: torchclip.clip_grad_norm_(params, 0.1, exact=1),
        lambda params: torchclip.get_total_norm([p.grad for p in params], exact="yes"),
        lambda params: torchclip.ClipGradByGlobalNorm(0.1, exact=0),
        lambda params: torchclip.ClipGradByNorm(0.1, exact=1.0),
        lambda params: torchclip.ClipGradByZScore(exact="no"),
        lambda params: torchclip.grad_norm(_module_of(params), 2, exact=1),
        lambda params: torchclip.clip_by_global_norm([p.grad for p in params], 0.1, exact=1),
        lambda params: torchclip.distributed.global_norms(params, exact=1),
        lambda params: torchclip.ClipGradByUnitwiseNorm(exact="no"),
    ],
    ids=[
        "clip_grad_norm_",
        "get_total_norm",
        "ClipGradByGlobalNorm",
        "ClipGradByNorm",
        "ZScore",
        "grad_norm",
        "tf",
        "dist",
        "AGC",
    ],
)
def test_a_bad_exact_is_named_and_changes_nothing(cpu_capability, call):
    import torchclip.distributed  # noqa: F401  (the lambdas reach it as an attribute)

    params = exact_params()
    with pytest.raises(TypeError, match="exact must be True, False or None"):
        call(params)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, exact_grads()))


def test_exact_sparse_gradients(cpu_capability):
    dense = make_tensor((5000,), torch.float64, seed=1)
    indices = torch.tensor([[0, 3, 3, 9]])
    values = make_tensor((4,), torch.float64, seed=2)
    sparse = torch.sparse_coo_tensor(
        indices, values, (12,), check_invariants=True
    )  # index 3 listed twice: its value is the sum
    coalesced = sparse.coalesce().values()
    total = torchclip.get_total_norm([dense, sparse], exact=True)
    assert total.item() == exact_norm([dense, coalesced], 2.0)
    assert torchclip.get_total_norm([dense, sparse], 1.0, exact=True).item() == exact_norm([dense, coalesced], 1.0)


def test_exact_true_is_refused_where_norms_are_not_exact(cpu_capability):
    leaf = make_tensor((100,), torch.float32, seed=1).requires_grad_()
    with pytest.raises(ValueError, match="exact=True: exact norms are taken of plain CPU and CUDA tensors"):
        torchclip.global_norm([leaf * 2], exact=True)  # differentiable: torch's ops take it
    with pytest.raises(ValueError, match="norms over axes are not taken exactly"):
        torchclip.clip_by_norm(make_tensor((4, 5), torch.float32, seed=2), 1.0, axes=1, exact=True)


def cuda_exact_cases(dtype):
    """Lists around the CUDA kernels' sub-block (1,024) and chunk (65,536) edges, normal data, blocks whose
    magnitudes move (each count of quanta levels a sub-block takes), each dtype's whole range with zeros,
    subnormals, and a strided view (ATen's path, copied dense)."""
    tensors = [make_tensor((n,), dtype, seed=n, scale=0.1) for n in (1, 31, 1023, 1024, 1025, 65535, 65537, 300_001)]
    tensors.append(blocks_whose_magnitudes_move(dtype, seed=7))
    # Sub-blocks of normal values, each with one tiny value planted: 1, 2, 3 quanta levels and more (term by term)
    planted = make_tensor((6, 1024), torch.float64, seed=11)
    planted[:, 100] = torch.tensor([2.0**-10, 2.0**-30, 2.0**-50, 2.0**-70, 2.0**-110, 2.0**-130])
    tensors.append(planted.flatten().to(dtype))
    tensors.append(wide_range(dtype, 70_000, seed=5))
    tensors.append(make_tensor((4000,), dtype, seed=6, layout="strided"))
    tensors.append(torch.zeros(0, dtype=dtype))
    return tensors


@cuda_only
@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_gives_the_cpu_bits(dtype, norm_type):
    tensors = cuda_exact_cases(dtype)
    on_cuda = [t.cuda() for t in tensors]
    total, per_tensor = _ops.multi_tensor_norm(tensors, norm_type, exact=True)
    cuda_total, cuda_per_tensor = _ops.multi_tensor_norm(on_cuda, norm_type, exact=True)
    assert torch.equal(cuda_per_tensor.cpu(), per_tensor)
    assert torch.equal(cuda_total.cpu(), total)
    assert torch.equal(torchclip.get_total_norm(on_cuda, norm_type, exact=True).cpu(), total)
    expected = as_dtype(exact_norm([t for t in tensors if t.numel()], norm_type), dtype)
    assert torch.equal(total, expected)
    # Clipping: the same coefficient, so the same clipped bits (the scale kernels agree, test_kernels.py).
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    cuda_params = [torch.nn.Parameter(torch.zeros_like(t)) for t in on_cuda]
    for p, q, t, u in zip(params, cuda_params, tensors, on_cuda):
        p.grad, q.grad = t.clone(), u.clone()
    expected = torchclip.clip_grad_norm_(params, 0.5, norm_type, exact=True)
    assert torch.equal(torchclip.clip_grad_norm_(cuda_params, 0.5, norm_type, exact=True).cpu(), expected)
    for p, q in zip(params, cuda_params):
        assert torch.equal(q.grad.cpu(), p.grad)


@cuda_only
@pytest.mark.parametrize("norm_type", ORDERS)
def test_cuda_exact_over_more_tensors_than_one_launch_takes(norm_type):
    """1,000 tensors (a launch's table takes 864): tensors of several chunks among them, on both sides of the
    tables' edge, and a complex one (its 1-norm from its magnitudes, which ATen rounds alike on either device):
    each norm and the total as the CPU's."""
    sizes = [1 + (i * 37) % 3000 for i in range(1000)]
    for i in (5, 500, 863, 864, 999):
        sizes[i] = 3 * 65536 + 17
    tensors = [make_tensor((n,), torch.float32, seed=i, scale=0.1) for i, n in enumerate(sizes)]
    tensors[300] = torch.complex(make_tensor((700,), torch.float32, seed=1), make_tensor((700,), torch.float32, seed=2))
    total, per_tensor = _ops.multi_tensor_norm(tensors, norm_type, exact=True)
    cuda_total, cuda_per_tensor = _ops.multi_tensor_norm([t.cuda() for t in tensors], norm_type, exact=True)
    assert torch.equal(cuda_per_tensor.cpu(), per_tensor)
    assert torch.equal(cuda_total.cpu(), total)


@cuda_only
def test_cuda_exact_follows_the_process_setting_and_flags_nan_and_inf():
    x = make_tensor((100_000,), torch.float32, seed=1)
    previous = torchclip.set_exact_norm(True)
    try:
        assert torch.equal(torchclip.get_total_norm([x.cuda()]).cpu(), torchclip.get_total_norm([x]))
        clip, cuda_clip = torchclip.ClipGradByNorm(1.0), torchclip.ClipGradByNorm(1.0)
        p, q = torch.nn.Parameter(torch.zeros_like(x)), torch.nn.Parameter(torch.zeros_like(x).cuda())
        p.grad, q.grad = x.clone(), x.cuda()
        clip([p])
        cuda_clip([q])
        assert torch.equal(cuda_clip.last_norms.cpu(), clip.last_norms) and torch.equal(q.grad.cpu(), p.grad)
    finally:
        torchclip.set_exact_norm(previous)
    y = x.clone()
    y[70_000] = math.inf
    z = x.clone()
    z[5] = math.nan
    total, per_tensor = _ops.multi_tensor_norm([y.cuda(), z.cuda(), x.cuda()], 2.0, exact=True)
    assert math.isnan(total.item()) and math.isinf(per_tensor[0].item()) and math.isnan(per_tensor[1].item())
    assert per_tensor[2].item() == _ops.multi_tensor_norm([x], 2.0, exact=True)[1].item()


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_a_complex_1_norm_is_the_exact_sum_of_its_rounded_magnitudes(dtype, cpu_capability):
    # |z| is no finite sum of bits: each magnitude is sqrt(re * re + im * im) in float64, one IEEE operation at a
    # time (Python's floats round as ATen's kernels do), and their sum is exact, so the total is one function of
    # the list, whatever its order.
    part = dtype.to_real()
    z = torch.complex(make_tensor((500,), part, seed=1), make_tensor((500,), part, seed=2))
    x = make_tensor((3000,), torch.float64, seed=3)
    magnitudes = sum(Fraction(math.sqrt(a * a + b * b)) for a, b in zip(z.real.tolist(), z.imag.tolist()))
    expected = float(magnitudes + exact_sum([x], 1.0))
    assert _ops.multi_tensor_norm([z, x], 1.0, exact=True)[1][0].item() == float(magnitudes)
    for call in (
        lambda: torchclip.get_total_norm([z, x], 1.0, exact=True),
        lambda: torchclip.get_total_norm([x, z], 1.0, exact=True),
        lambda: _ops.multi_tensor_norm([z, x], 1.0, exact=True)[0],
    ):
        assert call().item() == expected


def test_agc_unit_norms_are_exact(cpu_capability):
    """ClipGradByUnitwiseNorm(exact=True): each unit's norm is the true norm rounded once (the factor, and
    so the clipped gradient, follow from it as timm's rule says), for a contiguous pair and a pair ATen
    serves (a transposed view)."""
    weights = [
        make_tensor((64, 50), torch.float64, seed=1, scale=0.05),
        make_tensor((30, 40), torch.float64, seed=2).t(),
    ]
    grads = [make_tensor((64, 50), torch.float64, seed=3), make_tensor((30, 40), torch.float64, seed=4).t()]
    clip_factor, eps = 0.01, 1e-3
    for norm_type in ORDERS:
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        torchclip.ClipGradByUnitwiseNorm(clip_factor, eps, norm_type, exact=True)(params)
        for p, w, g in zip(params, weights, grads):
            expected = g.clone()
            for u in range(g.shape[0]):
                max_norm = max(exact_norm([w[u]], norm_type), eps) * clip_factor
                grad_norm = exact_norm([g[u]], norm_type)
                if not grad_norm < max_norm:
                    expected[u] *= max_norm / max(grad_norm, 1e-6)
            assert torch.equal(p.grad, expected), norm_type


def test_agc_refuses_exact_where_its_norms_are_not_exact(cpu_capability):
    grad = torch.full((4, 3), 5.0, requires_grad=True)  # autograd tracks it: torch's ops would take it
    with pytest.raises(ValueError, match="exact=True: unit norms are taken exactly of plain CPU tensors"):
        torchclip.ClipGradByUnitwiseNorm(exact=True).clip_gradients_([grad], [torch.ones(4, 3)])
    assert torch.equal(grad.detach(), torch.full((4, 3), 5.0))


def test_square_roots_halfway_between_two_floats_round_to_even(device):
    # a^2 + b^2 = h^2 with h a 54-bit odd integer: sqrt is exactly halfway between two float64 values. With a
    # tiny third term the sum's digits are too wide for one 128-bit integer: the comparison with the midpoint's
    # square then goes digit by digit, and the tiny term, in the sum's last digits, rounds the root up.
    for m in range(int(2**26.6), int(2**26.6) + 40):
        n = m // 2 + (1 if m % 2 == (m // 2) % 2 else 0)  # opposite parity: h odd
        legs = torch.tensor([float(m * m - n * n), float(2 * m * n)], dtype=torch.float64)
        h = m * m + n * n
        assert h.bit_length() == 54 and h % 2 == 1
        for scale in (1.0, 2.0**-600, 2.0**400):
            terms = (legs * scale).to(device)
            norm = _ops.multi_tensor_norm([terms], 2.0, exact=True)[1].item()
            assert norm == sqrt_rounded(exact_sum([legs * scale], 2.0)), (m, n, scale)
            assert norm in (float(h - 1) * scale, float(h + 1) * scale) and float_bits(norm) % 2 == 0
            with_tiny = torch.cat([terms, torch.tensor([2.0**-400 * scale], dtype=torch.float64, device=device)])
            assert _ops.multi_tensor_norm([with_tiny], 2.0, exact=True)[1].item() == float(h + 1) * scale
