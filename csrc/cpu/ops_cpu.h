// The CPU op implementations, split in two so that both callers share them: the dispatcher's CPU
// kernels (<op>_cpu, ops_cpu.cpp) split their tensor list and call the <op>_cpu_split functions; the
// eager fast path (walk/fast_path.cpp) builds the same Split while it walks the parameters
// (walk/param_walk.cpp), and calls them directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <tuple>

#include "split.h"

namespace torchclip {

// Exact norms for p = 1 and 2 on the CPU (exact_sum.h), process-wide: torchclip.set_exact_norm.
bool exact_norms_enabled();
bool set_exact_norms(bool enabled);  // returns the previous setting

// Checks every tensor (defined, CPU, strided; errors name `op` and the index) and splits the list.
Split split_tensors(at::TensorList tensors, const char* op);

// The ops on a list already split. `tensors` must be the list `split` describes.
// total_norm_cpu_split is multi_tensor_norm_cpu_split without the per-tensor norms (get_total_norm's).
at::Tensor total_norm_cpu_split(at::TensorList tensors, const Split& split, double ord, bool error_if_nonfinite);
std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_cpu_split(at::TensorList tensors, const Split& split, double ord,
    bool error_if_nonfinite);
void multi_tensor_clamp_cpu_split(at::TensorList tensors, const Split& split, double min, double max);
// clip_grad_norm_cpu_split fills `stats` where one is given.
at::Tensor clip_grad_norm_cpu_split(at::TensorList grads, const Split& split, double max_norm, double norm_type,
    bool error_if_nonfinite, double eps, bool norm_at_least_float32, c10::string_view nonfinite,
    NormClipStats* stats = nullptr);
at::Tensor clip_by_tensor_norm_cpu_split(at::TensorList tensors, const Split& split, double max_norm,
    c10::string_view nonfinite);

}  // namespace torchclip
