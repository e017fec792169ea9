// The CUDA ops on a list that the parameter walk has already checked and split: the CUDA twins of the
// CPU's <op>_cpu_split functions (cpu/ops_cpu.h), each member pointing at cuda/ops_cuda.cpp's
// <op>_cuda_split on the walk's Split. torchclip._cuda defines them and hands this table to
// torchclip._C at import, in a capsule (torchclip/_ops.py), so that the walk calls them directly, as it
// calls the CPU's: the dispatcher's route checked and split every tensor a second time on one thread,
// after the walk's parallel pass.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

#include "split.h"

namespace torchclip {

// Member <name> holds <name>_cuda_split, the overload on the walk's Split (cuda/ops_cuda.cpp). `exact`
// is the call's argument, None resolved by torchclip._cuda's copy of the process-wide setting.
struct CudaSplitOps {
  at::Tensor (*total_norm)(at::TensorList tensors, const Split& split, double ord, bool error_if_nonfinite,
      std::optional<bool> exact);
  at::Tensor (*clip_grad_norm_)(at::TensorList grads, const Split& split, double max_norm, double norm_type,
      bool error_if_nonfinite, double eps, bool norm_at_least_float32, c10::string_view nonfinite,
      std::optional<bool> exact, NormClipStats* stats);
  at::Tensor (*clip_by_tensor_norm_)(at::TensorList tensors, const Split& split, double max_norm,
      c10::string_view nonfinite, std::optional<bool> exact);
  void (*multi_tensor_clamp_)(at::TensorList tensors, const Split& split, double min, double max);
};

// The capsule's name, which _C checks: change its version with CudaSplitOps' layout, so that a _cuda
// module left from another build is refused at import instead of called.
constexpr const char* kCudaSplitOpsCapsule = "torchclip._cuda.split_ops.v3";

}  // namespace torchclip
