// Exact norms on CUDA, p = 1 and 2: the CPU's exact norms (cpu/exact_norm_kernel.cpp has the argument),
// the same bits, since both are the true norm rounded once.
//
// Each warp takes sub-blocks of 1,024 terms (32 per lane, held in registers): the sub-block's largest
// and smallest non-zero magnitude (shuffles), then each term split over quanta 2^(top - 43 j) and an
// exact remainder, as the CPU's blocks are, each level's sum exact in float64 through a fixed shuffle
// tree. Lane 0 adds those few float64 sums into the block's fixed-point digits in shared memory
// (ExactSum's digits: base 2^32 in int64, carries deferred), by integer atomics, which are exact in any
// order. A block then adds its digits to the list's total digits in global memory, and, where per-tensor
// norms are asked for, rounds a one-chunk tensor's sum itself or adds to the tensor's digits, which the
// tensor's last block (an arrival count, as the norm kernel's) rounds once. float64 data, and sub-blocks
// holding an inf or NaN or too wide a range, add term by term.
#include <c10/cuda/CUDAException.h>
#include <math_constants.h>

#include <type_traits>

#include "cuda/multi_tensor_apply.cuh"
#include "exact_sum.h"

namespace torchclip::cuda {
namespace {

constexpr int kLaneTerms = 32;  // a warp's sub-block: 32 x 32 = 1,024 terms, the CPU's block
constexpr int kQuantumBits = 43;
// A sub-block whose terms' bits span more than kMaxLevels levels of quanta (173 bits: for p = 2, float32 values
// over about 2^62 apart among its 1,024, 1e-2 beside 1e-21) adds term by term: exact too, and slower. A fourth
// level doubled the spills (ptxas: 132 bytes of stores against 56) under the register cap below.
constexpr int kMaxLevels = 3;
// Two blocks of kThreads resident per SM (registers capped at 64): on an H200 the norm took 20-30% less time
// than with one block of up to 122 registers (GPT-2 float32 0.245 against 0.313 ms of kernel time).
constexpr int kExactBlocksPerSM = 2;
constexpr int kDigits = ExactSum::kDigits;
constexpr unsigned kHasNaN = CarriedDigits::kSawNaN;
constexpr unsigned kHasInf = CarriedDigits::kSawInf;
static_assert(kExactAccumulatorWords == kDigits + 1, "an accumulator is ExactSum's digits, then the flags");

// The bits after the leading one of a storage type's mantissa (cpu/exact_norm_kernel.cpp's kTrailingBits).
template <typename S>
constexpr int kTrailingBits = std::is_same_v<S, float> ? 23 : (std::is_same_v<S, Half> ? 10 : 7);

// digits += (negative ? -1 : 1) * mantissa * 2^exponent, exactly, by atomics (shared or global digits).
__device__ void atomic_add_scaled(long long* digits, unsigned __int128 mantissa, int exponent, bool negative) {
  if (mantissa == 0) {
    return;
  }
  uint64_t parts[ExactSum::kParts];
  const int first = ExactSum::digit_parts(mantissa, exponent, parts);
  for (int k = 0; k < ExactSum::kParts && first + k < kDigits; ++k) {
    if (parts[k] != 0) {
      const unsigned long long part = negative ? 0ull - parts[k] : parts[k];  // two's complement
      atomicAdd(reinterpret_cast<unsigned long long*>(digits + first + k), part);
    }
  }
}

__device__ void atomic_add(long long* digits, double v) {
  int exponent;
  const uint64_t mantissa = ExactSum::split(v, &exponent);
  atomic_add_scaled(digits, mantissa, exponent, v < 0.0);
}

// One term |x| (p = 1) or x^2 (p = 2) of a finite x, exactly; float64 squares as 106-bit products.
template <NormKind kKind>
__device__ void atomic_add_term(long long* digits, double x) {
  if constexpr (kKind == NormKind::One) {
    atomic_add(digits, fabs(x));
  } else {
    int exponent;
    const unsigned __int128 mantissa = ExactSum::split(x, &exponent);
    atomic_add_scaled(digits, mantissa * mantissa, 2 * exponent, false);
  }
}

template <NormKind kKind>
__device__ void add_term_or_flag(long long* digits, unsigned* flags, double x) {
  if (isnan(x)) {
    atomicOr(flags, kHasNaN);
  } else if (isinf(x)) {
    atomicOr(flags, kHasInf);
  } else {
    atomic_add_term<kKind>(digits, x);
  }
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

__device__ __forceinline__ unsigned warp_max(unsigned v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ unsigned warp_min(unsigned v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    v = min(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// A warp's sub-block, the lane's terms in `values` (every term < 2^top), into the block's digits: each term
// split over kLevels levels of quanta 2^(top - 43 j) and an exact remainder, as the CPU's blocks are, each
// level's sum exact in float64 through a fixed shuffle tree (every partial sum is below 2^53 quanta). The
// level count is a template argument, the sums and rounders registers: looped to a runtime count, the levels
// not needed were issued anyway, predicated off (Nsight Compute on an H200: 16 of 32 lanes on average).
template <NormKind kKind, int kLevels>
__device__ __forceinline__ void add_levels(const float* values, int top, int lane, long long* digits) {
  double sums[kLevels], rounders[kLevels], rest = 0.0;
#pragma unroll
  for (int j = 0; j < kLevels; ++j) {
    sums[j] = 0.0;
    rounders[j] = ldexp(1.5, top - kQuantumBits * (j + 1) + 52);
  }
#pragma unroll
  for (int i = 0; i < kLaneTerms; ++i) {
    const double v = values[i];
    double term = kKind == NormKind::Two ? v * v : fabs(v);  // exact: a 24-bit value's square
#pragma unroll
    for (int j = 0; j < kLevels; ++j) {
      const double q = __dsub_rn(__dadd_rn(term, rounders[j]), rounders[j]);  // (no contraction or reassociation)
      sums[j] = __dadd_rn(sums[j], q);
      term = __dsub_rn(term, q);
    }
    rest = __dadd_rn(rest, term);
  }
#pragma unroll
  for (int j = 0; j < kLevels; ++j) {
    const double total = warp_sum(sums[j]);
    if (lane == 0) {
      atomic_add(digits, total);
    }
  }
  const double total = warp_sum(rest);
  if (lane == 0) {
    atomic_add(digits, total);
  }
}

// The lane's 32 terms of a warp's sub-block x[0, n), n <= 1,024: a whole sub-block at a 16-byte boundary in
// 16-byte loads (8 of float32, 4 of 16-bit data, where element loads took 32), the rest element by element,
// missing terms 0. Which lane holds which term does not matter: every sum below is exact.
template <typename S>
__device__ __forceinline__ void load_sub_block(const S* x, int64_t n, int lane, float* values) {
  constexpr int kPack = 16 / sizeof(S);
  if (n == 32 * kLaneTerms && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const uint4* packs = reinterpret_cast<const uint4*>(x);
#pragma unroll
    for (int k = 0; k < kLaneTerms / kPack; ++k) {
      const uint4 raw = __ldg(packs + k * 32 + lane);
      S packed[kPack];
      memcpy(packed, &raw, sizeof(raw));
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        values[k * kPack + j] = widen(packed[j]);
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kLaneTerms; ++j) {
    const int64_t i = static_cast<int64_t>(j) * 32 + lane;
    values[j] = i < n ? widen(x[i]) : 0.0f;
  }
}

// A warp's sub-block x[0, n), n <= 1,024, of 16/32-bit data, into the block's digits: every lane calls.
template <NormKind kKind, typename S>
__device__ void add_sub_block(const S* x, int64_t n, long long* digits, unsigned* flags, bool* term_by_term) {
  const int lane = threadIdx.x % 32;
  float values[kLaneTerms];
  load_sub_block(x, n, lane, values);
  unsigned largest_bits = 0, smallest_less_one = 0xFFFFFFFFu;
#pragma unroll
  for (int j = 0; j < kLaneTerms; ++j) {
    // Magnitudes order as their bits (a NaN above inf); bits - 1 sends a zero out of the minimum's way.
    const unsigned bits = __float_as_uint(values[j]) & 0x7FFFFFFFu;
    largest_bits = max(largest_bits, bits);
    smallest_less_one = min(smallest_less_one, bits - 1u);
  }
  largest_bits = warp_max(largest_bits);
  smallest_less_one = warp_min(smallest_less_one);
  const double largest = __uint_as_float(largest_bits);
  if (largest_bits == 0) {
    return;  // every term is 0
  }
  int levels = kMaxLevels + 1, top = 0;
  if (largest <= 3.4028234663852886e38) {  // (NaN fails it)
    int low_exponent;
    frexp(kKind == NormKind::Two ? largest * largest : largest, &top);  // every term < 2^top
    frexp(static_cast<double>(__uint_as_float(smallest_less_one + 1u)), &low_exponent);
    const int last_bit = low_exponent - 1 - kTrailingBits<S>;
    const int lowest_bit = kKind == NormKind::Two ? 2 * last_bit : last_bit;
    levels = 1;
    while (levels <= kMaxLevels && lowest_bit < top - kQuantumBits * levels - 44) {
      ++levels;
    }
  }
  if (levels > kMaxLevels) {  // an inf or NaN, or a range wider than the levels: term by term, read again
    *term_by_term = true;       // (a loop, not 32 copies of the 128-bit arithmetic in the hot kernel's code)
#pragma unroll 1
    for (int64_t i = lane; i < n; i += 32) {
      add_term_or_flag<kKind>(digits, flags, widen(x[i]));
    }
    return;
  }
  switch (levels) {
    case 1:
      add_levels<kKind, 1>(values, top, lane, digits);
      break;
    case 2:
      add_levels<kKind, 2>(values, top, lane, digits);
      break;
    default:
      add_levels<kKind, kMaxLevels>(values, top, lane, digits);
  }
}

// The norm of a block's digits in shared memory (a sum >= 0, carries pending), rounded where they lie by
// thread 0, which alone gets it: every thread of the block calls. Only the digits that hold anything are
// carried, a few of the 136 for most sums.
__device__ double block_digits_norm(long long* digits, unsigned long long flags, bool root) {
  __shared__ int window[2];
  if (threadIdx.x == 0) {
    window[0] = kDigits;
    window[1] = -1;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) {
    if (digits[d] != 0) {
      atomicMin(&window[0], d);
      atomicMax(&window[1], d);
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) {
    return 0.0;
  }
  const CarriedDigits sum = CarriedDigits::carry(reinterpret_cast<int64_t*>(digits), kDigits, window[0], window[1]);
  return sum.norm(static_cast<int64_t>(flags), root);
}

// digits (global) += the block's digits, and the flags, by every thread: integer additions, any order, the same sum.
__device__ void add_block_digits(long long* into, const long long* digits, unsigned flags) {
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) {
    if (digits[d] != 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(into + d), static_cast<unsigned long long>(digits[d]));
    }
  }
  if (threadIdx.x == 0 && flags != 0) {
    atomicOr(reinterpret_cast<unsigned long long*>(into + kDigits), static_cast<unsigned long long>(flags));
  }
}

// Accumulators (kExactAccumulatorWords int64s each: digits, then flags): row 0 the list's total, to which every
// block adds; row 1 + slot_base the tensor's, for a tensor of several chunks whose norm is asked for, which its
// last block rounds (numbered by chunk, as the norm kernel's slots: 1,096 bytes a chunk of 65,536 elements, of
// which each tensor uses one row). A one-chunk tensor's block rounds its own digits.
template <NormKind kKind, typename S, typename Table>
__device__ void exact_chunk(const Table& table, int t, int64_t chunk, long long* accumulators, int32_t* arrivals,
    double* norms) {
  __shared__ long long digits[kDigits];
  __shared__ unsigned flags;
  __shared__ bool term_by_term;
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) {
    digits[d] = 0;
  }
  if (threadIdx.x == 0) {
    flags = 0;
    term_by_term = std::is_same_v<S, double>;
  }
  __syncthreads();
  const S* x = static_cast<const S*>(table.data[t]);
  const int64_t numel = table.numel[t];
  const int64_t begin = chunk * kChunk;
  const int64_t n = numel - begin < kChunk ? numel - begin : kChunk;
  if constexpr (std::is_same_v<S, double>) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      add_term_or_flag<kKind>(digits, &flags, x[begin + i]);
    }
  } else {
    constexpr int64_t kSubBlock = 32 * kLaneTerms;
    const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int64_t sub = begin + warp * kSubBlock; sub < begin + n; sub += warps * kSubBlock) {
      const int64_t remaining = begin + n - sub;
      add_sub_block<kKind, S>(x + sub, remaining < kSubBlock ? remaining : kSubBlock, digits, &flags, &term_by_term);
    }
  }
  __syncthreads();
  // A block that added term by term holds digits up to 2^48 (65,536 terms of up to 2^32 each): carried into
  // [0, 2^32) here (the block's sum is >= 0). A block of level sums adds below 2^42 to a digit, so the total
  // row's int64 digits hold 2^21 blocks (1.4e11 elements, more than one GPU's memory holds) before overflow.
  if (term_by_term) {
    if (threadIdx.x == 0) {
      CarriedDigits::carry(reinterpret_cast<int64_t*>(digits), kDigits, 0, kDigits - 1);
    }
    __syncthreads();
  }
  add_block_digits(accumulators, digits, flags);
  if (norms == nullptr) {
    return;
  }
  if (numel <= kChunk) {  // the tensor's one block: its digits are the tensor's sum
    __syncthreads();      // (read by add_block_digits before they are carried)
    const double norm = block_digits_norm(digits, flags, kKind == NormKind::Two);
    if (threadIdx.x == 0) {
      norms[table.index[t]] = norm;
    }
    return;
  }
  long long* tensor_digits = accumulators + (1 + table.slot_base[t]) * kExactAccumulatorWords;
  add_block_digits(tensor_digits, digits, flags);
  // The tensor's last block rounds its sum: every thread's additions are published before the block
  // counts in, so whoever sees the final count sees every block's digits.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(arrivals + table.index[t], 1) == static_cast<int32_t>(chunk_count(numel)) - 1;
  }
  __syncthreads();
  if (!last) {
    return;
  }
  __threadfence();
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) {
    digits[d] = __ldcg(tensor_digits + d);
  }
  const unsigned long long tensor_flags = __ldcg(reinterpret_cast<unsigned long long*>(tensor_digits + kDigits));
  __syncthreads();
  const double norm = block_digits_norm(digits, tensor_flags, kKind == NormKind::Two);
  if (threadIdx.x == 0) {
    norms[table.index[t]] = norm;
  }
}

template <NormKind kKind, typename Table>
__global__ void __launch_bounds__(kThreads, kExactBlocksPerSM)
    exact_norm_kernel(const __grid_constant__ Table table, long long* accumulators, int32_t* arrivals, double* norms) {
  const BlockWork work = block_work(table);
  dispatch_storage(table.dtype[work.t], [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    exact_chunk<kKind, S>(table, work.t, work.chunk, accumulators, arrivals, norms);
  });
}

// The total from the total row, rounded once, and the clip coefficient as total_kernel computes it: one block.
constexpr int kTotalThreads = 160;  // (one thread per word of the row)

__global__ void __launch_bounds__(kTotalThreads) exact_total_kernel(const long long* total_row, NormKind kind,
    double* total, double* coefficient, double max_norm, double eps, bool skip_nonfinite) {
  __shared__ long long digits[kDigits];
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) {
    digits[d] = total_row[d];
  }
  const unsigned long long flags = static_cast<unsigned long long>(total_row[kDigits]);
  __syncthreads();
  const double result = block_digits_norm(digits, flags, kind == NormKind::Two);
  if (threadIdx.x != 0) {
    return;
  }
  *total = result;
  if (coefficient != nullptr) {
    const double c = max_norm * (1.0 / (result + eps));
    *coefficient = skip_nonfinite && !isfinite(result) ? 1.0 : (1.0 < c ? 1.0 : c);
  }
}

template <NormKind kKind>
void launch_exact(const DeviceSpan* spans, int64_t count, long long* accumulators, int32_t* arrivals, double* norms,
    cudaStream_t stream) {
  multi_tensor_apply(spans, count, [&](const auto& table, int blocks) {
    using Table = std::decay_t<decltype(table)>;
    exact_norm_kernel<kKind, Table><<<blocks, kThreads, 0, stream>>>(table, accumulators, arrivals, norms);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

int64_t exact_accumulator_rows(const DeviceSpan* spans, int64_t count, bool per_tensor_norms) {
  return 1 + (per_tensor_norms ? norm_slot_count(spans, count) : 0);
}

void exact_norms(const DeviceSpan* spans, int64_t count, NormKind kind, double* norms, double* total,
    double* coefficient, double max_norm, double eps, bool skip_nonfinite, int64_t* accumulators, int32_t* arrivals,
    cudaStream_t stream) {
  long long* rows = reinterpret_cast<long long*>(accumulators);
  if (count > 0) {
    if (kind == NormKind::One) {
      launch_exact<NormKind::One>(spans, count, rows, arrivals, norms, stream);
    } else {
      launch_exact<NormKind::Two>(spans, count, rows, arrivals, norms, stream);
    }
  }
  if (total != nullptr) {
    exact_total_kernel<<<1, kTotalThreads, 0, stream>>>(rows, kind, total, coefficient, max_norm, eps, skip_nonfinite);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace torchclip::cuda
