// The vocabulary every device's kernels share: the element types they take, the norm orders they know,
// and a per-sample clipping step's description. Plain enums and structs (no ATen), so that the per-ISA CPU kernel
// libraries and nvcc can include them.
#pragma once

#include <cstdint>

namespace torchclip {

enum class DType : int32_t { Float16 = 0, BFloat16 = 1, Float32 = 2, Float64 = 3 };

enum class NormKind : int32_t { One = 0, Two = 1, Inf = 2, NegInf = 3, Zero = 4, General = 5 };

struct NormOrder {
  NormKind kind;
  double p;  // the order itself; only read for NormKind::General
};

// One parameter of a per-sample clipping step (the per_sample_accumulate kernels): its per-sample gradients, row by
// row, and where the clipped sum goes.
struct PerSampleParam {
  const void* const* rows;  // rows[b]: sample b's gradient, numel dense elements of row_dtype
  const double* factors;    // factors[b]: sample b's clip factor for this parameter
  void* summed;             // numel elements of dtype: set to the clipped sum, or added to (accumulate)
  void* grad;               // null, or numel elements of dtype: (summed + noise) / divisor
  int64_t numel;
  DType row_dtype;
  DType dtype;  // Float64 only with Float64 rows
};

// What a per-sample clipping step does besides summing (the per_sample_accumulate kernels).
struct PerSampleStep {
  int64_t batch;       // rows per parameter
  bool accumulate;     // add to summed instead of overwriting it
  double noise_std;    // the noise's standard deviation (0: none)
  double divisor;      // grad = (summed + noise) / divisor
  uint64_t seed;       // the noise: element i of parameter j is gaussian.h's normal (seed, stream j, index i)
};

}  // namespace torchclip
