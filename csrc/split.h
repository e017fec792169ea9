// What the ops' implementations on a list already split take and give, the same on every device: the
// list filed into kernel spans and ATen's tensors (Split), and what clipping by the total norm found
// besides the total (NormClipStats). The CPU's dispatcher kernels build a Split (cpu/ops_cpu.cpp,
// split_tensors), the eager walk builds one as it gathers the tensors (walk/param_walk.cpp), and CUDA's
// implementations take it through cuda_split_ops.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu/kernel_table.h"  // cpu::TensorSpan

namespace torchclip {

// A std::allocator whose value-initialisation is default-initialisation: resize() leaves plain data
// as it is, for arrays about to be written in full. (The eager walk sizes a Split's arrays to the
// parameter count and writes slot i from whichever thread walks item i: zeroing them first would be
// one more pass, and would move their lines to the zeroing core.)
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>& /*unused*/) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <typename T>
using UninitVector = std::vector<T, DefaultInitAllocator<T>>;

// How a tensor list is served: `spans` go to the kernels (dense float16/bfloat16/float32/float64),
// the rest (complex, integer, strided views with gaps or overlaps) to ATen, which is correct for all.
struct Split {
  UninitVector<cpu::TensorSpan> spans;
  UninitVector<int64_t> span_source;  // spans[k] is tensors[span_source[k]]
  std::vector<int64_t> aten_path;    // indices of the tensors ATen serves
  at::ScalarType promoted = at::kFloat;

  void reserve(size_t count) {
    spans.reserve(count);
    span_source.reserve(count);
  }
  // Files tensors[index] = t (defined, strided and on the CPU: the caller has checked) under spans or
  // the ATen path. Defined in cpu/ops_cpu.cpp: the CPU's split_tensors is its one caller.
  void add(const at::Tensor& t, int64_t index);
};

// What clipping by the total norm found, besides the total: each tensor's norm (float64, 1-d) and the
// coefficient every tensor was scaled by (float64, 0-d), on the tensors' device.
struct NormClipStats {
  at::Tensor norms;
  at::Tensor coefficient;
};

}  // namespace torchclip
