// In-place scaling of many tensors by coefficients that live in device memory.
//
// The coefficient is read by each block from device memory, not passed from the host: clip_grad_norm_
// computes it on the device (norm_kernel.cu), and reading it here is what lets the whole clip run
// without the host ever waiting for the norm. A block whose coefficient is exactly 1 (after rounding
// to float32 for 16/32-bit data, the precision the multiply runs in) returns before touching its
// chunk, so a clip that is not needed costs a launch but no memory traffic.
//
// Rounding follows the CPU kernel (cpu/scale_kernel.cpp), which follows torch's mul_ by a 0-d tensor:
// 16/32-bit data multiplied in float32 by the coefficient rounded to float32, rounded once into the
// storage type; float64 in float64. A coefficient that is subnormal in float32 (clipping a norm near
// 3e38) would keep only a few bits there, so such blocks multiply in float64 and round once to float32.
#include <c10/cuda/CUDAException.h>

#include <cfloat>
#include <type_traits>

#include "cuda/multi_tensor_apply.cuh"

namespace torchclip::cuda {
namespace {

template <typename S>
__device__ void scale_chunk(S* x, int64_t n, double coefficient) {
  if constexpr (std::is_same_v<S, double>) {
    if (coefficient == 1.0) {
      return;
    }
    update_elements(x, n, [coefficient](double v) { return v * coefficient; });
  } else {
    const float narrow = static_cast<float>(coefficient);
    if (narrow == 1.0f) {
      return;
    }
    if (narrow != 0.0f && fabsf(narrow) < FLT_MIN) {
      update_elements(x, n,
          [coefficient](float v) { return static_cast<float>(static_cast<double>(v) * coefficient); });
    } else {
      update_elements(x, n, [narrow](float v) { return v * narrow; });
    }
  }
}

template <typename Table>
__global__ void __launch_bounds__(kThreads)
    scale_kernel(const __grid_constant__ Table table, const double* scales, int64_t stride) {
  const BlockWork work = block_work(table);
  const int t = work.t;
  const int64_t begin = work.chunk * kChunk;
  const int64_t n = table.numel[t] - begin < kChunk ? table.numel[t] - begin : kChunk;
  // The same address for every thread of the block: one transaction, broadcast.
  const double coefficient = scales[table.index[t] * stride];
  dispatch_storage(table.dtype[t], [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    scale_chunk(static_cast<S*>(table.data[t]) + begin, n, coefficient);
  });
}

}  // namespace

void scale(const DeviceSpan* spans, int64_t count, const double* scales, int64_t stride, cudaStream_t stream) {
  multi_tensor_apply(spans, count, [&](const auto& table, int blocks) {
    scale_kernel<std::decay_t<decltype(table)>><<<blocks, kThreads, 0, stream>>>(table, scales, stride);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace torchclip::cuda
