// Scaling one run of elements in place, with torch's mul_ rounding (the rules are scale_kernel.cpp's),
// shared by scale (scale_kernel.cpp) and unitwise_clip (unitwise_kernel.cpp). Included only by per-ISA
// kernel sources: internal linkage, compiled once per instruction set.
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include "multi_tensor.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

template <typename T>
void scale_span(T* x, int64_t n, double coefficient) {
  if constexpr (std::is_same_v<T, double>) {
    const f64v c = splat<f64v>(coefficient);
    for_each_block<kBlock64>(x, n, 0.0, /*writes=*/true, [&](double* p, int64_t count) {
      for (int64_t i = 0; i < count; i += kBlock64) {
        store_f64(p + i, load_f64(p + i) * c);
      }
    });
  } else if (const float narrow = static_cast<float>(coefficient);
      narrow != 0.0f && std::fabs(narrow) < std::numeric_limits<float>::min()) {
    // A coefficient below float32's normal range (clipping a norm near 3e38 to ~1e-3) keeps only a
    // few bits in float32: multiply in float64 instead, then round once to the storage type. Rare
    // enough for a scalar loop.
    for (int64_t i = 0; i < n; ++i) {
      x[i] = static_cast<T>(static_cast<float>(static_cast<double>(static_cast<float>(x[i])) * coefficient));
    }
  } else {
    const f32v c = splat<f32v>(narrow);
    for_each_block<kBlock>(x, n, T(0), /*writes=*/true, [&](T* p, int64_t count) {
      for (int64_t i = 0; i < count; i += kBlock) {
        store_f32(p + i, load_f32(p + i) * c);
      }
    });
  }
}

bool is_identity(DType dtype, double coefficient) {
  return dtype == DType::Float64 ? coefficient == 1.0 : static_cast<float>(coefficient) == 1.0f;
}

}  // namespace
}  // namespace torchclip::cpu
