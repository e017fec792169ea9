// Per-tensor p-norms of many tensors in one pass, and the total norm and clip coefficients from them.
//
// Pass: every block reduces its chunk to a Partial (sum of |x|^p or count, the largest or smallest
// |x|, NaN/inf flags; the sum alone for the 2-norm of 16/32-bit data, which needs nothing else),
// accumulating in float64. A one-chunk tensor's block finishes its norm itself.
// A longer tensor's blocks each write their Partial to the tensor's fixed slots and count themselves
// in; the block that arrives last (any block may, whichever it is) combines the slots in slot order
// and finishes the norm. The arithmetic never depends on which block that is or on timing, so the
// norms are the same bits on every run, unlike a reduction by atomic adds.
//
// Accuracy, as the CPU kernels: float64 accumulation makes 16/32-bit data overflow- and underflow-free
// (fp32 1e20 squares to 1e40; the smallest subnormal's square is 2e-90). float64 data whose squares
// could leave float64's range (largest |x| outside [2^-480, 2^480]), and p-norms whose sum of |x|^p
// overflowed or underflowed, are summed again by the finishing block, scaled, as LAPACK's dnrm2 does:
// a second read of that tensor only, and only for such inputs.
//
// Speed: a multiply-add in float64 per element is far below the memory bound on data-centre GPUs
// (H100: 67 TFLOP/s fp64 against 3.35 TB/s, i.e. ~80 fp64 operations per fp32 element read).
#include <c10/cuda/CUDAException.h>
#include <math_constants.h>

#include <cmath>
#include <type_traits>

#include "cuda/multi_tensor_apply.cuh"

namespace torchclip::cuda {
namespace {

constexpr unsigned kHasNaN = 1;
constexpr unsigned kHasInf = 2;

// One chunk's or one tensor's reduction. A plain aggregate: it lives in shared and global memory.
struct Partial {
  double sum;      // sum of |x|^p (p = 1, 2, general) or the count of non-zeros (p = 0)
  double extreme;  // the largest |x| (NaN ignored), or the smallest for -inf and negative p
  unsigned flags;  // kHasNaN | kHasInf
};
static_assert(sizeof(Partial) == kNormSlotBytes, "kNormSlotBytes must match the slot layout");

__host__ __device__ constexpr bool tracks_minimum(NormKind kind, double p) {
  return kind == NormKind::NegInf || (kind == NormKind::General && p < 0);
}

__device__ __forceinline__ Partial empty_partial(bool minimum) {
  return {0.0, minimum ? CUDART_INF : 0.0, 0u};
}

template <NormKind kKind, typename S>
__device__ __forceinline__ void accumulate(Partial& acc, double v, double p) {
  if constexpr (kKind == NormKind::Two && !std::is_same_v<S, double>) {
    // finish() reads neither the flags nor the largest |x| for 16/32-bit data (a NaN or inf carries
    // through the sum): one widening and one multiply-add per element, where the full bookkeeping
    // tied up the float64 units on bfloat16 data.
    acc.sum = fma(v, v, acc.sum);
    return;
  }
  const double m = fabs(v);
  // The non-finite flags come from the same read as the sum.
  acc.flags |= isnan(v) ? kHasNaN : (isinf(v) ? kHasInf : 0u);
  if constexpr (kKind == NormKind::One) {
    acc.sum += m;
  } else if constexpr (kKind == NormKind::Two) {
    acc.sum = fma(m, m, acc.sum);
    acc.extreme = fmax(acc.extreme, m);  // decides whether float64 data needs the scaled pass
  } else if constexpr (kKind == NormKind::Inf) {
    acc.extreme = fmax(acc.extreme, m);  // fmax ignores NaN; the flag brings it back
  } else if constexpr (kKind == NormKind::NegInf) {
    acc.extreme = fmin(acc.extreme, m);
  } else if constexpr (kKind == NormKind::Zero) {
    acc.sum += m != 0.0 ? 1.0 : 0.0;  // NaN counts as non-zero, as in torch.linalg.vector_norm
  } else {
    acc.sum += pow(m, p);
    acc.extreme = p > 0 ? fmax(acc.extreme, m) : fmin(acc.extreme, m);
  }
}

__device__ __forceinline__ Partial combine(const Partial& a, const Partial& b, bool minimum) {
  return {a.sum + b.sum, minimum ? fmin(a.extreme, b.extreme) : fmax(a.extreme, b.extreme), a.flags | b.flags};
}

// A slot written by another block: read from L2 (ld.global.cg), never from this SM's L1, which is
// not coherent with other SMs' writes.
__device__ __forceinline__ Partial load_slot(const Partial* slot) {
  return {__ldcg(&slot->sum), __ldcg(&slot->extreme), __ldcg(&slot->flags)};
}

// sum over x of (|x| * 2^-e)^2 for p = 2 (exact scaling by a power of two), or of (|x| / scale)^p, by
// the whole block in a fixed order.
template <typename S>
__device__ double scaled_sum(const S* x, int64_t n, double p, double scale, int exponent) {
  double sum = 0.0;
  if (p == 2.0) {
    read_elements(x, n, [&](double v) {
      const double s = ldexp(v, -exponent);
      sum = fma(s, s, sum);
    });
  } else {
    read_elements(x, n, [&](double v) { sum += pow(fabs(v) / scale, p); });
  }
  return block_reduce<kThreads>(sum, [](double a, double b) { return a + b; });
}

// The tensor's norm from its combined Partial (the same rules as the CPU kernels' finish()). Called
// by every thread of the finishing block with the same arguments, so the branches are uniform.
template <NormKind kKind, typename S>
__device__ double finish(const Partial& acc, const S* x, int64_t n, double p) {
  const bool has_nan = acc.flags & kHasNaN;
  if constexpr (kKind == NormKind::One || kKind == NormKind::Zero) {
    return acc.sum;
  } else if constexpr (kKind == NormKind::Inf || kKind == NormKind::NegInf) {
    return has_nan ? CUDART_NAN : acc.extreme;
  } else if constexpr (kKind == NormKind::Two) {
    const bool squares_may_leave_range =
        isfinite(acc.extreme) && acc.extreme > 0.0 && (acc.extreme > 0x1p+480 || acc.extreme < 0x1p-480);
    if (std::is_same_v<S, double> && !has_nan && squares_may_leave_range) {
      // 2^(e-1) <= max |x| < 2^e: every scaled square is below 1 and the largest at least 1/4.
      int exponent = 0;
      frexp(acc.extreme, &exponent);
      return ldexp(sqrt(scaled_sum(x, n, 2.0, 0.0, exponent)), exponent);
    }
    return sqrt(acc.sum);
  } else {
    const bool may_have_left_range = isinf(acc.sum) || acc.sum < 1e-290;
    if (may_have_left_range && !has_nan && isfinite(acc.extreme) && acc.extreme > 0.0) {
      // Every term (|x| / scale)^p is at most 1 and one is exactly 1.
      return acc.extreme * pow(scaled_sum(x, n, p, acc.extreme, 0), 1.0 / p);
    }
    return pow(acc.sum, 1.0 / p);
  }
}

template <NormKind kKind, typename S, typename Table>
__device__ void norm_chunk(const Table& table, int t, int64_t chunk, double p, Partial* slots, int32_t* arrivals,
    double* norms) {
  const bool minimum = tracks_minimum(kKind, p);
  const S* x = static_cast<const S*>(table.data[t]);
  const int64_t numel = table.numel[t];
  const int64_t begin = chunk * kChunk;
  const int64_t n = numel - begin < kChunk ? numel - begin : kChunk;

  Partial mine = empty_partial(minimum);
  read_elements(x + begin, n, [&](auto v) { accumulate<kKind, S>(mine, static_cast<double>(v), p); });
  auto merge = [minimum](const Partial& a, const Partial& b) { return combine(a, b, minimum); };
  Partial acc = block_reduce<kThreads>(mine, merge);

  const int64_t chunks = chunk_count(numel);
  if (chunks > 1) {
    __shared__ bool last;
    if (threadIdx.x == 0) {
      Partial* slot = slots + table.slot_base[t] + chunk;
      slot->sum = acc.sum;
      slot->extreme = acc.extreme;
      slot->flags = acc.flags;
      // Publish the slot before counting in: whoever sees the final count sees every slot.
      __threadfence();
      last = atomicAdd(arrivals + table.index[t], 1) == chunks - 1;
    }
    __syncthreads();
    if (!last) {
      return;
    }
    __threadfence();
    Partial gathered = empty_partial(minimum);
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      gathered = merge(gathered, load_slot(slots + table.slot_base[t] + c));
    }
    acc = block_reduce<kThreads>(gathered, merge);
  }
  const double norm = finish<kKind>(acc, x, numel, p);
  if (threadIdx.x == 0) {
    norms[table.index[t]] = norm;
  }
}

template <NormKind kKind, typename Table>
__global__ void __launch_bounds__(kThreads)
    norm_kernel(const __grid_constant__ Table table, double p, Partial* slots, int32_t* arrivals, double* norms) {
  const BlockWork work = block_work(table);
  dispatch_storage(table.dtype[work.t], [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    norm_chunk<kKind, S>(table, work.t, work.chunk, p, slots, arrivals, norms);
  });
}

template <NormKind kKind>
void launch_norms(const DeviceSpan* spans, int64_t count, double p, double* norms, void* slots, int32_t* arrivals,
    cudaStream_t stream) {
  multi_tensor_apply(spans, count, [&](const auto& table, int blocks) {
    using Table = std::decay_t<decltype(table)>;
    norm_kernel<kKind, Table><<<blocks, kThreads, 0, stream>>>(table, p, static_cast<Partial*>(slots), arrivals, norms);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// ---- totals and coefficients: one block, fixed order -------------------------------------------

constexpr int kTotalThreads = 512;

struct Extremes {
  double largest;   // NaN ignored (n > largest is false for NaN), as norm_total.h
  double smallest;
  double sum;
  double nonzero;
  unsigned has_nan;
};

__global__ void __launch_bounds__(kTotalThreads) total_kernel(const double* norms, int64_t count, NormKind kind,
    double p, double* total, double* coefficient, double max_norm, double eps, bool skip_nonfinite) {
  Extremes mine{0.0, CUDART_INF, 0.0, 0.0, 0u};
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const double n = norms[i];
    mine.has_nan |= isnan(n) ? 1u : 0u;
    mine.largest = n > mine.largest ? n : mine.largest;
    mine.smallest = n < mine.smallest ? n : mine.smallest;
    mine.sum += n;
    mine.nonzero += n != 0.0 ? 1.0 : 0.0;
  }
  const Extremes all = block_reduce<kTotalThreads>(mine, [](const Extremes& a, const Extremes& b) {
    return Extremes{b.largest > a.largest ? b.largest : a.largest, b.smallest < a.smallest ? b.smallest : a.smallest,
        a.sum + b.sum, a.nonzero + b.nonzero, a.has_nan | b.has_nan};
  });
  double result = 0.0;
  switch (kind) {
    case NormKind::One:
      result = all.sum;
      break;
    case NormKind::Zero:
      result = all.nonzero;  // torch's p = 0 total counts the tensors with a non-zero element
      break;
    case NormKind::Inf:
      result = all.has_nan ? CUDART_NAN : all.largest;
      break;
    case NormKind::NegInf:
      result = count == 0 ? 0.0 : (all.has_nan ? CUDART_NAN : all.smallest);
      break;
    case NormKind::Two:
    case NormKind::General: {
      // The norm of the norms, scaled by the largest (p > 0) or smallest (p < 0) so that no power
      // leaves float64's range; a zero or infinite scale is the answer itself.
      const double scale = p < 0 ? all.smallest : all.largest;
      if (all.has_nan) {
        result = CUDART_NAN;
      } else if (scale == 0.0 || isinf(scale)) {
        result = scale;
      } else {
        double powers = 0.0;
        for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
          const double r = norms[i] / scale;
          powers += p == 2.0 ? r * r : pow(r, p);
        }
        powers = block_reduce<kTotalThreads>(powers, [](double a, double b) { return a + b; });
        result = scale * (p == 2.0 ? sqrt(powers) : pow(powers, 1.0 / p));
      }
      break;
    }
  }
  if (threadIdx.x == 0) {
    *total = result;
    if (coefficient != nullptr) {
      // The CPU op's std::min(c, 1.0): (1 < c) ? 1 : c, so a NaN coefficient stays NaN as torch's clamp.
      const double c = max_norm * (1.0 / (result + eps));
      *coefficient = skip_nonfinite && !isfinite(result) ? 1.0 : (1.0 < c ? 1.0 : c);
    }
  }
}

__global__ void __launch_bounds__(kTotalThreads) clip_scales_kernel(const double* norms, int64_t count, double max_norm,
    bool skip_nonfinite, double* scales, int32_t* any_nonfinite) {
  unsigned mine = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    mine |= isfinite(norms[i]) ? 0u : 1u;
  }
  const unsigned any = block_reduce<kTotalThreads>(mine, [](unsigned a, unsigned b) { return a | b; });
  const bool keep_all = skip_nonfinite && any;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const double n = norms[i];
    // Unchanged when n <= max_norm; else max_norm / n (NaN for a NaN norm: propagated).
    scales[i] = keep_all || n <= max_norm ? 1.0 : max_norm / n;
  }
  if (threadIdx.x == 0) {
    *any_nonfinite = any ? 1 : 0;
  }
}

}  // namespace

int64_t norm_slot_count(const DeviceSpan* spans, int64_t count) {
  int64_t slots = 0;
  for (int64_t k = 0; k < count; ++k) {
    const int64_t chunks = chunk_count(spans[k].numel);
    slots += chunks > 1 ? chunks : 0;
  }
  return slots;
}

void tensor_norms(const DeviceSpan* spans, int64_t count, NormOrder order, double* norms, void* slots,
    int32_t* arrivals, cudaStream_t stream) {
  switch (order.kind) {
    case NormKind::One:
      launch_norms<NormKind::One>(spans, count, order.p, norms, slots, arrivals, stream);
      break;
    case NormKind::Two:
      launch_norms<NormKind::Two>(spans, count, order.p, norms, slots, arrivals, stream);
      break;
    case NormKind::Inf:
      launch_norms<NormKind::Inf>(spans, count, order.p, norms, slots, arrivals, stream);
      break;
    case NormKind::NegInf:
      launch_norms<NormKind::NegInf>(spans, count, order.p, norms, slots, arrivals, stream);
      break;
    case NormKind::Zero:
      launch_norms<NormKind::Zero>(spans, count, order.p, norms, slots, arrivals, stream);
      break;
    case NormKind::General:
      launch_norms<NormKind::General>(spans, count, order.p, norms, slots, arrivals, stream);
      break;
  }
}

void total_norm(const double* norms, int64_t count, NormOrder order, double* total, double* coefficient,
    double max_norm, double eps, bool skip_nonfinite, cudaStream_t stream) {
  total_kernel<<<1, kTotalThreads, 0, stream>>>(norms, count, order.kind, order.p, total, coefficient, max_norm, eps,
      skip_nonfinite);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void tensor_clip_scales(const double* norms, int64_t count, double max_norm, bool skip_nonfinite, double* scales,
    int32_t* any_nonfinite, cudaStream_t stream) {
  clip_scales_kernel<<<1, kTotalThreads, 0, stream>>>(norms, count, max_norm, skip_nonfinite, scales, any_nonfinite);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace torchclip::cuda
