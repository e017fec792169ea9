// Unit-wise adaptive gradient clipping (AGC) in one pass (compiled once per instruction set).
//
// A unit is a row of a weight and the same row of its gradient. Each is finished by one thread while
// it is in cache: the weight row's norm, the gradient row's norm, the factor, and the gradient row's
// scaling, so memory sees one read of every weight and gradient and one write of the clipped rows.
// Norm passes over all units first, then a scaling pass, would read every gradient twice.
#include <algorithm>
#include <vector>

#include "kernels.h"
#include "norm_reduce.h"
#include "scale_span.h"

namespace torchclip::cpu {
namespace {

// A row is short (ResNet-50's: 64 to 4,608 elements) and the next unit's row follows it in memory, so
// the 2-norm of 16/32-bit data reads it as one stream in order, with float64 sums: sum_squares_blocked's
// four quarters suit long spans only. unitwise_clip on 2 cores: ResNet-50 shapes 6.6-7.1 -> 5.5-5.9 ms,
// GPT-2's 28.5 -> 24-26 ms.
template <typename T>
Partial reduce_row(const T* x, int64_t n, NormOrder order) {
  if constexpr (!std::is_same_v<T, double>) {
    if (order.kind == NormKind::Two) {
      return reduce_narrow<NormKind::Two>(x, n);
    }
  }
  return reduce_span(x, n, order);
}

template <typename T>
double row_norm(const TensorSpan& row, NormOrder order) {
  Partial whole;
  if (tracks_minimum(order)) {
    whole.extreme = std::numeric_limits<double>::infinity();
  }
  if (row.numel > 0) {
    combine(whole, reduce_row(static_cast<const T*>(row.data), row.numel, order), order);
  }
  return finish(whole, row, order);
}

double norm_of(const TensorSpan& row, NormOrder order) {
  double norm = 0.0;
  dispatch_dtype(row.dtype, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    norm = row_norm<T>(row, order);
  });
  return norm;
}

void clip_unit(const TensorSpan& weight, const TensorSpan& grad, NormOrder order, double clip_factor, double eps) {
  // std::max keeps a NaN first argument, as torch's clamp: NaN norms propagate.
  const double max_norm = std::max(norm_of(weight, order), eps) * clip_factor;
  const double grad_norm = norm_of(grad, order);
  if (grad_norm < max_norm) {
    return;
  }
  const double factor = max_norm / std::max(grad_norm, 1e-6);
  if (is_identity(grad.dtype, factor)) {
    return;
  }
  dispatch_dtype(grad.dtype, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    scale_span(static_cast<T*>(grad.data), grad.numel, factor);
  });
}

}  // namespace

void unitwise_clip(const TensorSpan* weights, const TensorSpan* grads, int64_t count, NormOrder order,
    double clip_factor, double eps) {
  // Units are dealt to threads by gradient elements: a thread takes the units that start in its range
  // of the concatenated gradients, so each unit is finished by exactly one thread, whatever its size.
  std::vector<int64_t> starts(count + 1, 0);
  for (int64_t u = 0; u < count; ++u) {
    starts[u + 1] = starts[u] + grads[u].numel;
  }
  const auto clip_range = [&](int64_t begin, int64_t end) {
    const int64_t first = std::lower_bound(starts.begin(), starts.end() - 1, begin) - starts.begin();
    for (int64_t u = first; u < count && starts[u] < end; ++u) {
      clip_unit(weights[u], grads[u], order, clip_factor, eps);
    }
  };
  if (at::in_parallel_region() || starts[count] < 2 * kMinElementsPerThread) {
    clip_range(0, starts[count] + 1);
  } else {
    at::parallel_for(0, starts[count] + 1, kMinElementsPerThread, clip_range);
  }
}

}  // namespace torchclip::cpu
