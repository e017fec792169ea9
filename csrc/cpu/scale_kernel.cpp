// In-place scaling of many tensors, each by its own coefficient (compiled once per instruction set).
//
// Rounding follows torch's CPU mul_ by a 0-d tensor: 16/32-bit data is multiplied in float32 by the
// coefficient rounded to float32, then rounded once (to nearest even) into the storage type; float64
// data is multiplied in float64. The one exception: a coefficient that is subnormal in float32 keeps
// only a few bits there, so 16/32-bit data is multiplied by it in float64 instead (scale_span.h).
// A coefficient that rounds to exactly 1 leaves every element as it is (x * 1 == x for every x, NaN
// included), so that tensor is not read or written at all: clipping that is not needed costs no write
// pass.
#include <vector>

#include "kernels.h"
#include "scale_span.h"

namespace torchclip::cpu {

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
