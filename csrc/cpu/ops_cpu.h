// The CPU op implementations, split in two so that both callers share them: the dispatcher's CPU
// kernels (ops_cpu.cpp) split their tensor list and call the *_split functions; the eager fast path
// (python_module.cpp) builds the same Split while it walks the parameters, and calls them directly.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_table.h"

namespace torchclip {

// A std::allocator whose value-initialisation is default-initialisation: resize() leaves plain data
// as it is, for arrays about to be written in full. (The eager walk sizes a Split's arrays to the
// parameter count and writes slot i from whichever thread walks item i: zeroing them first cost
// 15-30 us of the walk on 10,000 parameters, and moved their lines to the zeroing core.)
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
  // the ATen path.
  void add(const at::Tensor& t, int64_t index);
};

// What clipping by the total norm found, besides the total: each tensor's norm (float64, 1-d) and the
// coefficient every tensor was scaled by (float64, 0-d), on the tensors' device.
struct NormClipStats {
  at::Tensor norms;
  at::Tensor coefficient;
};

// Checks every tensor (defined, CPU, strided; errors name `op` and the index) and splits the list.
Split split_tensors(at::TensorList tensors, const char* op);

// The ops on a list already split. `tensors` must be the list `split` describes.
// total_norm_split is multi_tensor_norm_split without the per-tensor norms (get_total_norm's).
at::Tensor total_norm_split(at::TensorList tensors, const Split& split, double ord, bool error_if_nonfinite);
std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_split(at::TensorList tensors, const Split& split, double ord,
    bool error_if_nonfinite);
void multi_tensor_clamp_split(at::TensorList tensors, const Split& split, double min, double max);
// clip_grad_norm_split fills `stats` where one is given.
at::Tensor clip_grad_norm_split(at::TensorList grads, const Split& split, double max_norm, double norm_type,
    bool error_if_nonfinite, double eps, bool norm_at_least_float32, c10::string_view nonfinite,
    NormClipStats* stats = nullptr);
at::Tensor clip_by_tensor_norm_split(at::TensorList tensors, const Split& split, double max_norm,
    c10::string_view nonfinite);

}  // namespace torchclip
