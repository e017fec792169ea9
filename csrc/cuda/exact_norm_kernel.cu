// Exact norms on CUDA, p = 1 and 2: the CPU's exact norms (cpu/exact_norm_kernel.cpp has the argument),
// the same bits, since both are the true norm rounded once.
//
// Each warp takes sub-blocks of 1,024 terms (32 per lane, held in registers): the sub-block's largest
// and smallest non-zero magnitude (shuffles), then each term split over quanta 2^(top - 43 j) and an
// exact remainder, as the CPU's blocks are, each level's sum exact in float64 through a fixed shuffle
// tree. Lane 0 adds those few float64 sums into the block's fixed-point digits in shared memory
// (ExactSum's digits: base 2^32 in int64, carries deferred), by integer atomics, which are exact in any
// order. A block then adds its digits to its tensor's digits in global memory; the tensor's last block
// (an arrival count, as the norm kernel's) rounds the tensor's sum once. float64 data, and sub-blocks
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
constexpr int kMaxLevels = 16;
constexpr int kDigits = ExactSum::kDigits;
constexpr unsigned kHasNaN = ExactSum::kSawNaN;
constexpr unsigned kHasInf = ExactSum::kSawInf;
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

// A warp's sub-block x[0, n), n <= 1,024, of 16/32-bit data, into the block's digits: every lane calls.
template <NormKind kKind, typename S>
__device__ void add_sub_block(const S* x, int64_t n, long long* digits, unsigned* flags, bool* term_by_term) {
  const int lane = threadIdx.x % 32;
  float values[kLaneTerms];
  unsigned largest_bits = 0, smallest_less_one = 0xFFFFFFFFu;
#pragma unroll
  for (int j = 0; j < kLaneTerms; ++j) {
    const int64_t i = static_cast<int64_t>(j) * 32 + lane;
    values[j] = i < n ? widen(x[i]) : 0.0f;
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
  int levels = kMaxLevels, top = 0;
  if (largest <= 3.4028234663852886e38) {  // (NaN fails it)
    int low_exponent;
    frexp(kKind == NormKind::Two ? largest * largest : largest, &top);  // every term < 2^top
    frexp(static_cast<double>(__uint_as_float(smallest_less_one + 1u)), &low_exponent);
    const int last_bit = low_exponent - 1 - kTrailingBits<S>;
    const int lowest_bit = kKind == NormKind::Two ? 2 * last_bit : last_bit;
    levels = 1;
    while (levels < kMaxLevels && lowest_bit < top - kQuantumBits * levels - 44) {
      ++levels;
    }
  }
  if (levels == kMaxLevels) {  // an inf or NaN, or a range wider than the levels: term by term
    *term_by_term = true;
#pragma unroll
    for (int j = 0; j < kLaneTerms; ++j) {
      add_term_or_flag<kKind>(digits, flags, values[j]);
    }
    return;
  }
  double sums[kMaxLevels + 1], rounders[kMaxLevels];
  for (int j = 0; j <= levels; ++j) {
    sums[j] = 0.0;
    if (j < levels) {
      rounders[j] = ldexp(1.5, top - kQuantumBits * (j + 1) + 52);
    }
  }
#pragma unroll
  for (int i = 0; i < kLaneTerms; ++i) {
    const double v = values[i];
    double term = kKind == NormKind::Two ? v * v : fabs(v);  // exact: a 24-bit value's square
    for (int j = 0; j < levels; ++j) {
      const double q = __dsub_rn(__dadd_rn(term, rounders[j]), rounders[j]);  // (no contraction or reassociation)
      sums[j] = __dadd_rn(sums[j], q);
      term = __dsub_rn(term, q);
    }
    sums[levels] = __dadd_rn(sums[levels], term);
  }
  for (int j = 0; j <= levels; ++j) {
    const double total = warp_sum(sums[j]);  // exact: every partial sum is below 2^53 quanta
    if (lane == 0) {
      atomic_add(digits, total);
    }
  }
}

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
  // [0, 2^32) here (the block's sum is >= 0), every block adds at most 2^32 per digit to its tensor's and
  // to the total, so no int64 digit overflows below 2^31 blocks. (Level sums add below 2^42 a block.)
  if (term_by_term) {
    if (threadIdx.x == 0) {
      long long carry = 0;
      for (int d = 0; d < kDigits; ++d) {
        const long long v = digits[d] + carry;
        digits[d] = v & 0xFFFFFFFFll;
        carry = v >> 32;  // (arithmetic: the floor, for negative digits too)
      }
    }
    __syncthreads();
  }
  // The block's digits into its tensor's (integer additions: any order, the same sum).
  long long* tensor_digits = accumulators + static_cast<int64_t>(table.index[t]) * kExactAccumulatorWords;
  for (int d = threadIdx.x; d < kDigits; d += blockDim.x) {
    if (digits[d] != 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(tensor_digits + d), static_cast<unsigned long long>(digits[d]));
    }
  }
  if (threadIdx.x == 0 && flags != 0) {
    atomicOr(reinterpret_cast<unsigned long long*>(tensor_digits + kDigits), static_cast<unsigned long long>(flags));
  }
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
  if (!last || threadIdx.x != 0 || norms == nullptr) {
    return;
  }
  __threadfence();
  int64_t gathered[kDigits];
  for (int d = 0; d < kDigits; ++d) {
    gathered[d] = __ldcg(tensor_digits + d);
  }
  const unsigned long long tensor_flags = __ldcg(reinterpret_cast<unsigned long long*>(tensor_digits + kDigits));
  const ExactSum sum = ExactSum::from_digits(gathered);
  norms[table.index[t]] = sum.norm(static_cast<int64_t>(tensor_flags), kKind == NormKind::Two);
}

template <NormKind kKind, typename Table>
__global__ void __launch_bounds__(kThreads)
    exact_norm_kernel(const __grid_constant__ Table table, long long* accumulators, int32_t* arrivals, double* norms) {
  const BlockWork work = block_work(table);
  dispatch_storage(table.dtype[work.t], [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    exact_chunk<kKind, S>(table, work.t, work.chunk, accumulators, arrivals, norms);
  });
}

// The total from every list position's digits: one block, each digit summed over the tensors by one
// thread (integers: exact), then rounded once, and the clip coefficient as total_kernel computes it.
constexpr int kTotalThreads = 256;

__global__ void __launch_bounds__(kTotalThreads) exact_total_kernel(const long long* accumulators, int64_t count,
    NormKind kind, double* total, double* coefficient, double max_norm, double eps, bool skip_nonfinite) {
  __shared__ long long digits[kDigits];
  __shared__ unsigned long long flags;
  for (int d = threadIdx.x; d <= kDigits; d += blockDim.x) {
    unsigned long long sum = 0;
    for (int64_t i = 0; i < count; ++i) {
      const unsigned long long word = accumulators[i * kExactAccumulatorWords + d];
      sum = d < kDigits ? sum + word : (sum | word);
    }
    if (d < kDigits) {
      digits[d] = static_cast<long long>(sum);
    } else {
      flags = sum;
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) {
    return;
  }
  int64_t gathered[kDigits];
  for (int d = 0; d < kDigits; ++d) {
    gathered[d] = digits[d];
  }
  const ExactSum sum = ExactSum::from_digits(gathered);
  const double result = sum.norm(static_cast<int64_t>(flags), kind == NormKind::Two);
  *total = result;
  if (coefficient != nullptr) {
    const double c = max_norm * (1.0 / (result + eps));
    *coefficient = skip_nonfinite && !isfinite(result) ? 1.0 : (1.0 < c ? 1.0 : c);
  }
}

// The float64 1-norm of a tensor the kernels do not read (a complex one, as the CPU takes it) as the term of
// its list position: its accumulator and its norm.
__global__ void exact_add_norm_kernel(const double* value, long long* accumulator, double* norm) {
  add_term_or_flag<NormKind::One>(accumulator, reinterpret_cast<unsigned*>(accumulator + kDigits), *value);
  if (norm != nullptr) {
    *norm = *value;
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

void exact_add_norm(const double* value, int64_t position, int64_t* accumulators, double* norms, cudaStream_t stream) {
  long long* accumulator = reinterpret_cast<long long*>(accumulators) + position * kExactAccumulatorWords;
  exact_add_norm_kernel<<<1, 1, 0, stream>>>(value, accumulator, norms != nullptr ? norms + position : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void exact_norms(const DeviceSpan* spans, int64_t count, NormKind kind, int64_t list_size, double* norms, double* total,
    double* coefficient, double max_norm, double eps, bool skip_nonfinite, int64_t* accumulators, int32_t* arrivals,
    cudaStream_t stream) {
  long long* digits = reinterpret_cast<long long*>(accumulators);
  if (count > 0) {
    if (kind == NormKind::One) {
      launch_exact<NormKind::One>(spans, count, digits, arrivals, norms, stream);
    } else {
      launch_exact<NormKind::Two>(spans, count, digits, arrivals, norms, stream);
    }
  }
  if (total != nullptr) {
    exact_total_kernel<<<1, kTotalThreads, 0, stream>>>(digits, list_size, kind, total, coefficient, max_norm, eps,
        skip_nonfinite);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace torchclip::cuda
