// Clamping many tensors to [lo, hi] in one read-write pass (compiled once per instruction set).
//
// torch's clip_grad_value_ makes two passes (clamp_min_, then clamp_max_); this is the same
// composition, max then min, in one. Comparisons run in float32 for 16/32-bit data (the bound rounded
// to float32, as torch converts the Python scalar) and in float64 for float64, and the result is
// rounded once into the storage type. A NaN element stays NaN (x < lo and x > hi are both false).
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels.h"
#include "multi_tensor.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

template <typename V>
inline V clamp_vector(V v, V lo, V hi) {
  v = v < lo ? lo : v;
  return v > hi ? hi : v;
}

template <typename T>
void clamp_span(T* x, int64_t n, double lo, double hi) {
  if constexpr (std::is_same_v<T, double>) {
    const f64v vlo = splat<f64v>(lo), vhi = splat<f64v>(hi);
    for_each_block<kBlock64>(x, n, 0.0, /*writes=*/true, [&](double* p, int64_t count) {
      for (int64_t i = 0; i < count; i += kBlock64) {
        store_f64(p + i, clamp_vector(load_f64(p + i), vlo, vhi));
      }
    });
  } else {
    const f32v vlo = splat<f32v>(static_cast<float>(lo)), vhi = splat<f32v>(static_cast<float>(hi));
    for_each_block<kBlock>(x, n, T(0), /*writes=*/true, [&](T* p, int64_t count) {
      for (int64_t i = 0; i < count; i += kBlock) {
        store_f32(p + i, clamp_vector(load_f32(p + i), vlo, vhi));
      }
    });
  }
}

// bfloat16: every result is the element itself (exact: a bfloat16 is a float32 with a shorter
// mantissa), a bound rounded once, or the canonical NaN, so the kernel selects among those bit
// patterns instead of rounding every element back. That halves the instructions per element, which
// is what bounds this 2-byte type (13.8 GB/s before, against float16's 46 with hardware conversions).
// The results are the same bits as the float32 clamp followed by store_f32's rounding.
void clamp_span(c10::BFloat16* x, int64_t n, double lo, double hi) {
  const float flo = static_cast<float>(lo), fhi = static_cast<float>(hi);
  const f32v vlo = splat<f32v>(flo), vhi = splat<f32v>(fhi);
  // Below lo the float32 clamp yields lo, or hi when lo > hi; c10 rounds to nearest even, as store_f32.
  const u32v below = splat<u32v>(c10::BFloat16(flo > fhi ? fhi : flo).x);
  const u32v above = splat<u32v>(c10::BFloat16(fhi).x);
  const u32v nan = splat<u32v>(0x7FC0u);
  for_each_block<kBlock>(x, n, c10::BFloat16(0.0f), /*writes=*/true, [&](c10::BFloat16* p, int64_t count) {
    for (int64_t i = 0; i < count; i += kBlock) {
      const u32v bits = load_u16_widened(p + i);
      const f32v v = (f32v)(bits << 16);
      store_u16_narrowed(p + i, v < vlo ? below : (v > vhi ? above : (is_nan(v) ? nan : bits)));
    }
  });
}

template <typename T>
void fill_nan(T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    x[i] = static_cast<T>(std::numeric_limits<float>::quiet_NaN());
  }
}

}  // namespace

void clamp(const TensorSpan* spans, int64_t count, double lo, double hi) {
  const bool nan_bound = std::isnan(lo) || std::isnan(hi);
  // [-inf, inf] changes nothing: skip the write pass entirely.
  if (!nan_bound && lo == -std::numeric_limits<double>::infinity() && hi == std::numeric_limits<double>::infinity()) {
    return;
  }
  const ChunkPlan plan = plan_chunks(spans, count);
  parallel_for_pieces(plan, spans, [&](const Piece& piece) {
    const TensorSpan& span = spans[piece.tensor];
    dispatch_dtype(span.dtype, [&](auto* typed) {
      using T = std::remove_pointer_t<decltype(typed)>;
      T* data = static_cast<T*>(span.data) + piece.begin;
      if (nan_bound) {
        // torch's clamp_min_/clamp_max_ with a NaN bound yield NaN everywhere.
        fill_nan(data, piece.end - piece.begin);
      } else {
        clamp_span(data, piece.end - piece.begin, lo, hi);
      }
    });
  });
}

}  // namespace torchclip::cpu
