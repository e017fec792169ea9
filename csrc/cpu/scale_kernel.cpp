// In-place scaling of many tensors, each by its own coefficient (compiled once per instruction set).
//
// Rounding follows torch's CPU mul_ by a 0-d tensor: 16/32-bit data is multiplied in float32 by the
// coefficient rounded to float32, then rounded once (to nearest even) into the storage type; float64
// data is multiplied in float64. The one exception: a coefficient that is subnormal in float32. A coefficient that rounds to exactly 1 leaves every element as it is
// (x * 1 == x for every x, NaN included), so that tensor is not read or written at all: clipping
// that is not needed costs no write pass.
#include <cmath>
#include <limits>
#include <type_traits>

#include "kernels.h"
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

void scale(const TensorSpan* spans, int64_t count, const double* scales) {
  std::vector<TensorSpan> to_write;
  std::vector<double> coefficients;
  for (int64_t i = 0; i < count; ++i) {
    if (!is_identity(spans[i].dtype, scales[i])) {
      to_write.push_back(spans[i]);
      coefficients.push_back(scales[i]);
    }
  }
  if (to_write.empty()) {
    return;
  }
  const ChunkPlan plan = plan_chunks(to_write.data(), static_cast<int64_t>(to_write.size()));
  parallel_for_pieces(plan, to_write.data(), [&](const Piece& piece) {
    const TensorSpan& span = to_write[piece.tensor];
    dispatch_dtype(span.dtype, [&](auto* typed) {
      using T = std::remove_pointer_t<decltype(typed)>;
      scale_span(static_cast<T*>(span.data) + piece.begin, piece.end - piece.begin, coefficients[piece.tensor]);
    });
  });
}

}  // namespace torchclip::cpu
