// The CPU op implementations, split in two so that both callers share them: the dispatcher's CPU
// kernels (<op>_cpu, ops_cpu.cpp) split their tensor list and call the <op>_cpu_split functions; the
// eager fast path (walk/fast_path.cpp) builds the same Split while it walks the parameters
// (walk/param_walk.cpp), and calls them directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

#include "split.h"

namespace torchclip {

// Exact norms for p = 1 and 2 (exact_sum.h), process-wide: torchclip.set_exact_norm (op_shared.h's
// exact_norms_setting, this library's copy).
bool exact_norms_enabled();
bool set_exact_norms(bool enabled);  // returns the previous setting

// Checks every tensor (defined, CPU, strided; errors name `op` and the index) and splits the list.
Split split_tensors(at::TensorList tensors, const char* op);

// The ops on a list already split. `tensors` must be the list `split` describes.
// total_norm_cpu_split is multi_tensor_norm_cpu_split without the per-tensor norms (get_total_norm's).
// `exact`: exact norms (p = 1, 2); dtype: the total's (None: torch's result dtype).
at::Tensor total_norm_cpu_split(at::TensorList tensors, const Split& split, double ord, bool error_if_nonfinite,
    bool exact);
std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_cpu_split(at::TensorList tensors, const Split& split, double ord,
    bool error_if_nonfinite, bool exact, std::optional<at::ScalarType> dtype = std::nullopt);
void multi_tensor_clamp_cpu_split(at::TensorList tensors, const Split& split, double min, double max);
// clip_grad_norm_cpu_split fills `stats` where one is given.
at::Tensor clip_grad_norm_cpu_split(at::TensorList grads, const Split& split, double max_norm, double norm_type,
    bool error_if_nonfinite, double eps, bool norm_at_least_float32, c10::string_view nonfinite, bool exact,
    NormClipStats* stats = nullptr);
at::Tensor clip_by_tensor_norm_cpu_split(at::TensorList tensors, const Split& split, double max_norm,
    c10::string_view nonfinite, bool exact);

// Exact sums across ranks (torchclip.distributed): rows of kExactSumColumns int64s, [NaN seen, inf seen,
// ExactSum::to_digits], one for the whole list or one per tensor. Rows from any number of ranks below 2^31
// add element-wise in int64 exactly, in any order; norms_of_exact_sums rounds each summed row once
// (float64 norms of order ord, 1 or 2). A complex tensor's 1-norm enters as its magnitudes (exact_terms).
constexpr int64_t kExactSumColumns = 2 + ExactSum::kDigits;
at::Tensor exact_sums_cpu(at::TensorList tensors, double ord, bool per_tensor);
at::Tensor norms_of_exact_sums(const at::Tensor& sums, double ord);

}  // namespace torchclip
