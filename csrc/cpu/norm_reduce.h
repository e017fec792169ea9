// The per-span norm reduction behind tensor_norms (norm_kernel.cpp) and unitwise_clip
// (unitwise_kernel.cpp): reduce a run of elements to a Partial, combine Partials, finish a norm. The
// accuracy and speed notes are norm_kernel.cpp's. Included only by per-ISA kernel sources: everything
// here has internal linkage, compiled once per instruction set.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "multi_tensor.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

struct Partial {
  double sum = 0.0;      // sum of |x|^p (p = 1, 2, general), or the count of non-zeros (p = 0)
  double extreme = 0.0;  // max |x| (p = inf, and p = 2 on float64 for the rescaling test) or min |x|
  bool has_nan = false;
};

template <typename V>
inline double horizontal_max(V v) {
  double m = v[0];
  for (int i = 1; i < static_cast<int>(sizeof(V) / sizeof(v[0])); ++i) {
    m = v[i] > m ? v[i] : m;
  }
  return m;
}

// p in {1, 2, inf} over float16 / bfloat16 / float32: widen each block to float32, then
// each half of it to float64.
template <NormKind kKind, typename T>
Partial reduce_narrow(const T* x, int64_t n) {
  f64v acc0{}, acc1{}, acc2{}, acc3{};
  f32v max_abs{};
  i32v nan_lanes{};
  auto body = [&](const T* p, int64_t count) {
    int64_t i = 0;
    // Two blocks per iteration: four independent float64 accumulators hide the add latency.
    for (; i + 2 * kBlock <= count; i += 2 * kBlock) {
      f32v v = load_f32(p + i);
      f32v w = load_f32(p + i + kBlock);
      if constexpr (kKind == NormKind::Two) {
        f64v v0 = low_half_to_f64(v), v1 = high_half_to_f64(v);
        f64v w0 = low_half_to_f64(w), w1 = high_half_to_f64(w);
        acc0 += v0 * v0;
        acc1 += v1 * v1;
        acc2 += w0 * w0;
        acc3 += w1 * w1;
      } else if constexpr (kKind == NormKind::One) {
        v = abs(v);
        w = abs(w);
        acc0 += low_half_to_f64(v);
        acc1 += high_half_to_f64(v);
        acc2 += low_half_to_f64(w);
        acc3 += high_half_to_f64(w);
      } else {
        max_abs = max_ignoring_nan(max_abs, max_ignoring_nan(abs(v), abs(w)));
        nan_lanes |= is_nan(v) | is_nan(w);
      }
    }
    for (; i < count; i += kBlock) {
      f32v v = load_f32(p + i);
      if constexpr (kKind == NormKind::Two) {
        f64v v0 = low_half_to_f64(v), v1 = high_half_to_f64(v);
        acc0 += v0 * v0;
        acc1 += v1 * v1;
      } else if constexpr (kKind == NormKind::One) {
        v = abs(v);
        acc0 += low_half_to_f64(v);
        acc1 += high_half_to_f64(v);
      } else {
        max_abs = max_ignoring_nan(max_abs, abs(v));
        nan_lanes |= is_nan(v);
      }
    }
  };
  // Zero padding is neutral for sums of |x|^p and for max |x|.
  for_each_block<kBlock>(const_cast<T*>(x), n, T(0), /*writes=*/false, body);
  Partial out;
  out.sum = horizontal_sum((acc0 + acc1) + (acc2 + acc3));
  out.extreme = horizontal_max(max_abs);
  out.has_nan = any_lane(nan_lanes);
  return out;
}

// p = 2 over float16 / bfloat16 / float32: float32 squares within blocks, float64 across them.
//
// The data is read as four interleaved streams (the four quarters of the span, in lockstep): more
// independent memory streams keep more cache-line requests in flight, worth ~20% on cache-resident
// data (25M floats, one core: 5.1 ms for one stream, 4.1 ms for four).
//
// Where the loop also asks for each stream's lines 256 elements ahead (kAsksAhead): always for 16-bit data, and for
// float32 on Intel CPUs, whose hardware prefetchers stop at 4 KiB page boundaries (an Intel Xeon, 8M
// cache-resident floats: -7% time). On an AMD EPYC (Zen 4, 2 cores) float32's asks cost time and 16-bit data's
// saved it, build against build (`bench/compare_builds.py`, 10 pairs) without any asks: get_total_norm on one
// thread, float32 GPT-2 0.856 (0.784-0.908), 2,000 x 64x64 0.871 (0.758-0.996); bfloat16 ResNet-50 1.141
// (1.051-1.261).
template <typename T>
bool asks_ahead() {
  return sizeof(T) == 2 || intel_cpu();
}

template <bool kAsksAhead, typename T>
Partial sum_squares_blocked(const T* x, int64_t n) {
  constexpr int64_t kStreams = 4;
  constexpr int64_t kStreamBlock = 16 * kBlock;  // per stream: each accumulator lane adds 16 squares
  constexpr int64_t kPrefetchAhead = 256;  // elements
  constexpr float kTiny = 0x1p-80f;
  constexpr float kLargest = 3.4028234663852886e+38f;
  const int64_t quarter = n / kStreams / kStreamBlock * kStreamBlock;
  f64v widened{};
  double redone = 0.0;
  for (int64_t start = 0; start < quarter; start += kStreamBlock) {
    f32v a0{}, a1{}, a2{}, a3{};
    for (int64_t i = start; i < start + kStreamBlock; i += kBlock) {
      if constexpr (kAsksAhead) {  // (past the end is harmless)
        __builtin_prefetch(x + i + kPrefetchAhead);
        __builtin_prefetch(x + quarter + i + kPrefetchAhead);
        __builtin_prefetch(x + 2 * quarter + i + kPrefetchAhead);
        __builtin_prefetch(x + 3 * quarter + i + kPrefetchAhead);
      }
      f32v v0 = load_f32(x + i), v1 = load_f32(x + quarter + i);
      f32v v2 = load_f32(x + 2 * quarter + i), v3 = load_f32(x + 3 * quarter + i);
      a0 += v0 * v0;
      a1 += v1 * v1;
      a2 += v2 * v2;
      a3 += v3 * v3;
    }
    const f32v block = (a0 + a1) + (a2 + a3);
    // Every lane finite (a NaN fails the <=) and the largest not tiny: the float32 sums are exact to
    // float32 rounding. Otherwise these blocks' squares take the float64 route.
    const bool trusted = !any_lane(!(block <= splat<f32v>(kLargest))) && horizontal_max(block) >= kTiny;
    if (trusted) {
      widened += low_half_to_f64(block) + high_half_to_f64(block);
    } else {
      for (int64_t s = 0; s < kStreams; ++s) {
        redone += reduce_narrow<NormKind::Two>(x + s * quarter + start, kStreamBlock).sum;
      }
    }
  }
  Partial out;
  const int64_t done = kStreams * quarter;
  out.sum = horizontal_sum(widened) + redone + reduce_narrow<NormKind::Two>(x + done, n - done).sum;
  return out;
}

// p in {1, 2, inf} over float64.
template <NormKind kKind>
Partial reduce_double(const double* x, int64_t n) {
  f64v acc0{}, acc1{}, max_abs{};
  i64v nan_lanes{};
  auto body = [&](const double* p, int64_t count) {
    int64_t i = 0;
    for (; i + 2 * kBlock64 <= count; i += 2 * kBlock64) {
      f64v v = abs(load_f64(p + i));
      f64v w = abs(load_f64(p + i + kBlock64));
      if constexpr (kKind == NormKind::Two) {
        acc0 += v * v;
        acc1 += w * w;
      } else if constexpr (kKind == NormKind::One) {
        acc0 += v;
        acc1 += w;
      }
      // The max is kept for p = 2 too: it decides whether the sum needs the scaled second pass.
      max_abs = max_ignoring_nan(max_abs, max_ignoring_nan(v, w));
      nan_lanes |= is_nan(v) | is_nan(w);
    }
    for (; i < count; i += kBlock64) {
      f64v v = abs(load_f64(p + i));
      if constexpr (kKind == NormKind::Two) {
        acc0 += v * v;
      } else if constexpr (kKind == NormKind::One) {
        acc0 += v;
      }
      max_abs = max_ignoring_nan(max_abs, v);
      nan_lanes |= is_nan(v);
    }
  };
  for_each_block<kBlock64>(const_cast<double*>(x), n, 0.0, /*writes=*/false, body);
  Partial out;
  out.sum = horizontal_sum(acc0 + acc1);
  out.extreme = horizontal_max(max_abs);
  out.has_nan = any_lane(nan_lanes);
  return out;
}

// Whether Partial::extreme is a minimum (|x| for -inf, and the scale for negative orders).
bool tracks_minimum(NormOrder order) {
  return order.kind == NormKind::NegInf || (order.kind == NormKind::General && order.p < 0);
}

// The orders torch accepts beyond 1, 2 and inf. Rare in training, so a plain float64 loop; it follows
// torch.linalg.vector_norm's definitions (p = 0 counts non-zeros, NaN included; -inf is min |x|).
template <typename T>
Partial reduce_general(const T* x, int64_t n, NormOrder order) {
  Partial out;
  if (tracks_minimum(order)) {
    out.extreme = std::numeric_limits<double>::infinity();
  }
  for (int64_t i = 0; i < n; ++i) {
    double v;
    if constexpr (std::is_same_v<T, double>) {
      v = std::fabs(x[i]);
    } else {
      v = std::fabs(static_cast<double>(static_cast<float>(x[i])));
    }
    switch (order.kind) {
      case NormKind::NegInf:
        out.has_nan |= std::isnan(v);
        out.extreme = v < out.extreme ? v : out.extreme;
        break;
      case NormKind::Zero:
        out.sum += (v != 0.0) ? 1.0 : 0.0;
        break;
      default:
        out.sum += std::pow(v, order.p);
        // For the scaled second pass: the largest |x| for p > 0, the smallest for p < 0.
        out.extreme = (order.p > 0 ? v > out.extreme : v < out.extreme) ? v : out.extreme;
        break;
    }
  }
  return out;
}

template <typename T>
Partial reduce_span(const T* x, int64_t n, NormOrder order) {
  switch (order.kind) {
    case NormKind::One:
      if constexpr (std::is_same_v<T, double>) {
        return reduce_double<NormKind::One>(x, n);
      } else {
        return reduce_narrow<NormKind::One>(x, n);
      }
    case NormKind::Two:
      if constexpr (std::is_same_v<T, double>) {
        return reduce_double<NormKind::Two>(x, n);
      } else {
        return asks_ahead<T>() ? sum_squares_blocked<true>(x, n) : sum_squares_blocked<false>(x, n);
      }
    case NormKind::Inf:
      if constexpr (std::is_same_v<T, double>) {
        return reduce_double<NormKind::Inf>(x, n);
      } else {
        return reduce_narrow<NormKind::Inf>(x, n);
      }
    default:
      return reduce_general(x, n, order);
  }
}

void combine(Partial& into, const Partial& chunk, NormOrder order) {
  into.sum += chunk.sum;
  into.has_nan |= chunk.has_nan;
  if (tracks_minimum(order)) {
    into.extreme = chunk.extreme < into.extreme ? chunk.extreme : into.extreme;
  } else {
    into.extreme = chunk.extreme > into.extreme ? chunk.extreme : into.extreme;
  }
}

// The 2-norm of float64 data whose squares could leave float64's range: sum (x * 2^-e)^2 with
// 2^(e-1) <= max |x| < 2^e, so every scaled square is < 1 and the largest is >= 1/4.
double scaled_two_norm(const double* x, int64_t n, double max_abs) {
  int exponent = 0;
  std::frexp(max_abs, &exponent);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double scaled = std::ldexp(x[i], -exponent);
    sum += scaled * scaled;
  }
  return std::ldexp(std::sqrt(sum), exponent);
}

// sum |x|^p could leave float64's range even when the norm is representable (p = 3 on 1e200, p = -1.5
// on 1e-308): sum (|x| / scale)^p instead, with scale the largest |x| for p > 0 and the smallest for
// p < 0, so every term is <= 1 and one is exactly 1.
double scaled_general_norm(const TensorSpan& span, double p, double scale) {
  double sum = 0.0;
  dispatch_dtype(span.dtype, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const T* x = static_cast<const T*>(span.data);
    for (int64_t i = 0; i < span.numel; ++i) {
      double v;
      if constexpr (std::is_same_v<T, double>) {
        v = std::fabs(x[i]);
      } else {
        v = std::fabs(static_cast<double>(static_cast<float>(x[i])));
      }
      sum += std::pow(v / scale, p);
    }
  });
  return scale * std::pow(sum, 1.0 / p);
}

double finish(const Partial& acc, const TensorSpan& span, NormOrder order) {
  switch (order.kind) {
    case NormKind::One:
    case NormKind::Zero:
      return acc.sum;
    case NormKind::Two: {
      const bool squares_may_leave_range =
          std::isfinite(acc.extreme) && acc.extreme > 0.0 && (acc.extreme > 0x1p+480 || acc.extreme < 0x1p-480);
      if (span.dtype == DType::Float64 && !acc.has_nan && squares_may_leave_range) {
        return scaled_two_norm(static_cast<const double*>(span.data), span.numel, acc.extreme);
      }
      return std::sqrt(acc.sum);
    }
    case NormKind::Inf:
    case NormKind::NegInf:
      return acc.has_nan ? std::numeric_limits<double>::quiet_NaN() : acc.extreme;
    case NormKind::General: {
      const double norm = std::pow(acc.sum, 1.0 / order.p);
      const bool may_have_left_range = std::isinf(acc.sum) || acc.sum < 1e-290;
      if (may_have_left_range && !acc.has_nan && std::isfinite(acc.extreme) && acc.extreme > 0.0) {
        return scaled_general_norm(span, order.p, acc.extreme);
      }
      return norm;
    }
  }
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace
}  // namespace torchclip::cpu
