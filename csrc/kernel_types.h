// The vocabulary every device's kernels share: the element types they take and the norm orders
// they know. Plain enums and structs (no ATen), so that the per-ISA CPU kernel libraries and nvcc can
// include them.
#pragma once

#include <cstdint>

namespace torchclip {

enum class DType : int32_t { Float16 = 0, BFloat16 = 1, Float32 = 2, Float64 = 3 };

enum class NormKind : int32_t { One = 0, Two = 1, Inf = 2, NegInf = 3, Zero = 4, General = 5 };

struct NormOrder {
  NormKind kind;
  double p;  // the order itself; only read for NormKind::General
};

}  // namespace torchclip
