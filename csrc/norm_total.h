// The total norm from per-tensor norms, as torch.nn.utils.get_total_norm defines it: the norm of the
// vector of per-tensor norms (for p = 0 that counts the tensors with a non-zero element, torch's
// result). Evaluated in float64, scaled by the largest norm for p > 0 and by the smallest for p < 0,
// so that raising to the power p cannot overflow even for float64 inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "kernel_types.h"

namespace torchclip {

inline NormOrder norm_order(double ord) {
  if (ord == 1.0) {
    return {NormKind::One, ord};
  }
  if (ord == 2.0) {
    return {NormKind::Two, ord};
  }
  if (ord == std::numeric_limits<double>::infinity()) {
    return {NormKind::Inf, ord};
  }
  if (ord == -std::numeric_limits<double>::infinity()) {
    return {NormKind::NegInf, ord};
  }
  if (ord == 0.0) {
    return {NormKind::Zero, ord};
  }
  return {NormKind::General, ord};
}

inline double total_norm(const double* norms, int64_t count, NormOrder order) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  bool has_nan = false;
  double largest = 0.0, smallest = kInf, sum = 0.0, nonzero = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double n = norms[i];
    has_nan |= std::isnan(n);
    largest = n > largest ? n : largest;
    smallest = n < smallest ? n : smallest;
    sum += n;
    nonzero += (n != 0.0) ? 1.0 : 0.0;
  }
  switch (order.kind) {
    case NormKind::One:
      return sum;
    case NormKind::Zero:
      return nonzero;
    case NormKind::Inf:
      return has_nan ? kNaN : largest;
    case NormKind::NegInf:
      return count == 0 ? 0.0 : (has_nan ? kNaN : smallest);
    case NormKind::Two:
    case NormKind::General:
      break;
  }
  const double p = order.p;
  if (has_nan) {
    return kNaN;
  }
  if (p < 0) {
    // Scaled by the smallest norm, so (n / smallest)^p <= 1 cannot overflow (it would for a norm
    // of 1e-300); a zero norm makes the total 0, as torch's formula gives.
    if (smallest == 0.0 || std::isinf(smallest)) {
      return smallest;
    }
    double powers = 0.0;
    for (int64_t i = 0; i < count; ++i) {
      powers += std::pow(norms[i] / smallest, p);
    }
    return smallest * std::pow(powers, 1.0 / p);
  }
  if (largest == 0.0 || std::isinf(largest)) {
    return largest;
  }
  double scaled = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double r = norms[i] / largest;
    scaled += p == 2.0 ? r * r : std::pow(r, p);
  }
  return largest * (p == 2.0 ? std::sqrt(scaled) : std::pow(scaled, 1.0 / p));
}

}  // namespace torchclip
