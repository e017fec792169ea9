// Clamping many tensors to [lo, hi] in one read-write pass (torch's clip_grad_value_ makes two:
// clamp_min_, then clamp_max_). The same composition as the CPU kernel (cpu/clamp_kernel.cpp): max
// with lo, then min with hi, compared in float32 for 16/32-bit data (the bounds rounded to float32, as
// torch converts a Python scalar) and in float64 for float64, rounded once into the storage type. A
// NaN element stays NaN (x < lo and x > hi are both false); a NaN bound makes every element NaN.
#include <c10/cuda/CUDAException.h>
#include <math_constants.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "cuda/multi_tensor_apply.cuh"

namespace torchclip::cuda {
namespace {

template <typename S>
__device__ void clamp_chunk(S* x, int64_t n, double lo, double hi, bool nan_bound) {
  using T = typename OpMath<S>::type;
  const T low = static_cast<T>(lo);
  const T high = static_cast<T>(hi);
  if (nan_bound) {
    update_elements(x, n, [](T) { return static_cast<T>(CUDART_NAN); });
  } else {
    update_elements(x, n, [low, high](T v) {
      v = v < low ? low : v;
      return v > high ? high : v;
    });
  }
}

template <typename Table>
__global__ void __launch_bounds__(kThreads)
    clamp_kernel(const __grid_constant__ Table table, double lo, double hi, bool nan_bound) {
  const BlockWork work = block_work(table);
  const int t = work.t;
  const int64_t begin = work.chunk * kChunk;
  const int64_t n = table.numel[t] - begin < kChunk ? table.numel[t] - begin : kChunk;
  dispatch_storage(table.dtype[t], [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    clamp_chunk(static_cast<S*>(table.data[t]) + begin, n, lo, hi, nan_bound);
  });
}

}  // namespace

void clamp(const DeviceSpan* spans, int64_t count, double lo, double hi, cudaStream_t stream) {
  const bool nan_bound = std::isnan(lo) || std::isnan(hi);
  // [-inf, inf] changes nothing: no launch at all.
  if (!nan_bound && lo == -std::numeric_limits<double>::infinity() && hi == std::numeric_limits<double>::infinity()) {
    return;
  }
  multi_tensor_apply(spans, count, [&](const auto& table, int blocks) {
    clamp_kernel<std::decay_t<decltype(table)>><<<blocks, kThreads, 0, stream>>>(table, lo, hi, nan_bound);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace torchclip::cuda
