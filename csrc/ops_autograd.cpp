// Autograd-key kernels for the torchclip ops. None of the ops is differentiable: they exist to run
// under torch.no_grad(), on gradients. Registering them here, unboxed, matters for speed as much as
// for semantics: without it the dispatcher sends every call through torch's boxed autograd fallback,
// which boxes a 10,000-tensor list into IValues and back (~0.3 ms per call, measured with perf).
//
// The mutating ops do what ATen's in-place ops do around their kernels: refuse to modify a tensor
// that requires grad while grad mode is on (autograd could not know), and bump each written tensor's
// version counter so autograd notices if a saved tensor was modified.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include "op_handles.h"

namespace torchclip {
namespace {

void check_not_differentiated(at::TensorList tensors, const char* op) {
  if (!c10::GradMode::is_enabled()) {
    return;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(!tensors[i].requires_grad(), op, ": tensors[", i, "] requires grad and grad mode is on; this op "
        "modifies tensors in place and is not differentiable (call it under torch.no_grad())");
  }
}

void bump_versions(at::TensorList tensors) {
  for (const auto& t : tensors) {
    torch::autograd::impl::bump_version(t);
  }
}

// Each kernel receives the dispatch key set it was called with and redispatches below autograd and
// ADInplaceOrView: the backend key (CPU, ...) comes from that set, without re-reading every tensor.
void multi_tensor_scale_autograd(c10::DispatchKeySet ks, at::TensorList tensors, const at::Tensor& scale) {
  const auto& op = op_handles::multi_tensor_scale_();
  check_not_differentiated(tensors, "torchclip.multi_tensor_scale_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, tensors, scale);
  }
  bump_versions(tensors);
}

void multi_tensor_clamp_autograd(c10::DispatchKeySet ks, at::TensorList tensors, double min, double max) {
  const auto& op = op_handles::multi_tensor_clamp_();
  check_not_differentiated(tensors, "torchclip.multi_tensor_clamp_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, tensors, min, max);
  }
  bump_versions(tensors);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> clip_grad_norm_autograd(c10::DispatchKeySet ks, at::TensorList grads,
    double max_norm, double norm_type, bool error_if_nonfinite, double eps, bool norm_at_least_float32,
    c10::string_view nonfinite) {
  const auto& op = op_handles::clip_grad_norm_();
  check_not_differentiated(grads, "torchclip.clip_grad_norm_");
  std::tuple<at::Tensor, at::Tensor, at::Tensor> results;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    results = op.redispatch(ks & c10::after_ADInplaceOrView_keyset, grads, max_norm, norm_type, error_if_nonfinite,
        eps, norm_at_least_float32, nonfinite);
  }
  bump_versions(grads);
  return results;
}

at::Tensor clip_by_tensor_norm_autograd(c10::DispatchKeySet ks, at::TensorList tensors, double max_norm,
    c10::string_view nonfinite) {
  const auto& op = op_handles::clip_by_tensor_norm_();
  check_not_differentiated(tensors, "torchclip.clip_by_tensor_norm_");
  at::Tensor norms;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    norms = op.redispatch(ks & c10::after_ADInplaceOrView_keyset, tensors, max_norm, nonfinite);
  }
  bump_versions(tensors);
  return norms;
}

void unitwise_clip_autograd(c10::DispatchKeySet ks, at::TensorList grads, at::TensorList params, double clip_factor,
    double eps, double norm_type) {
  const auto& op = op_handles::unitwise_clip_();
  check_not_differentiated(grads, "torchclip.unitwise_clip_");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, grads, params, clip_factor, eps, norm_type);
  }
  bump_versions(grads);
}

at::Tensor adam_step_autograd(c10::DispatchKeySet ks, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr, double beta1,
    double beta2, double weight_decay, double eps, bool amsgrad, bool maximize, bool decoupled_weight_decay,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  const auto& op = op_handles::adam_step_();
  check_not_differentiated(params, "torchclip.adam_step_");
  at::Tensor stepped;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    stepped = op.redispatch(ks & c10::after_ADInplaceOrView_keyset, params, grads, exp_avgs, exp_avg_sqs,
        max_exp_avg_sqs, state_steps, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay,
        grad_scale, found_inf);
  }
  // Bumped whether or not the kernels stepped: reading the flag here would be data-dependent under
  // tracing, and an extra bump only says "maybe modified".
  for (at::TensorList written : {params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps}) {
    bump_versions(written);
  }
  return stepped;
}

// Under inference mode the Autograd kernels above are skipped, but a normal tensor's ADInplaceOrView key is
// not: ATen's in-place ops bump versions there, so a graph that saved the tensor still notices the write.
// (Outside inference mode the Autograd kernels redispatch past this key, so each write bumps once.)
template <typename Op, typename... Args>
void redispatch_then_bump(const Op& op, c10::DispatchKeySet ks, at::TensorList written, Args&&... args) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(ks & c10::after_ADInplaceOrView_keyset, std::forward<Args>(args)...);
  }
  bump_versions(written);
}

void multi_tensor_scale_inplace_or_view(c10::DispatchKeySet ks, at::TensorList tensors, const at::Tensor& scale) {
  redispatch_then_bump(op_handles::multi_tensor_scale_(), ks, tensors, tensors, scale);
}

void multi_tensor_clamp_inplace_or_view(c10::DispatchKeySet ks, at::TensorList tensors, double min, double max) {
  redispatch_then_bump(op_handles::multi_tensor_clamp_(), ks, tensors, tensors, min, max);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> clip_grad_norm_inplace_or_view(c10::DispatchKeySet ks,
    at::TensorList grads, double max_norm, double norm_type, bool error_if_nonfinite, double eps,
    bool norm_at_least_float32, c10::string_view nonfinite) {
  std::tuple<at::Tensor, at::Tensor, at::Tensor> results;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    results = op_handles::clip_grad_norm_().redispatch(ks & c10::after_ADInplaceOrView_keyset, grads, max_norm,
        norm_type, error_if_nonfinite, eps, norm_at_least_float32, nonfinite);
  }
  bump_versions(grads);
  return results;
}

at::Tensor clip_by_tensor_norm_inplace_or_view(c10::DispatchKeySet ks, at::TensorList tensors, double max_norm,
    c10::string_view nonfinite) {
  at::Tensor norms;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    norms = op_handles::clip_by_tensor_norm_().redispatch(ks & c10::after_ADInplaceOrView_keyset, tensors, max_norm,
        nonfinite);
  }
  bump_versions(tensors);
  return norms;
}

void unitwise_clip_inplace_or_view(c10::DispatchKeySet ks, at::TensorList grads, at::TensorList params,
    double clip_factor, double eps, double norm_type) {
  redispatch_then_bump(op_handles::unitwise_clip_(), ks, grads, grads, params, clip_factor, eps, norm_type);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchclip, ADInplaceOrView, m) {
  m.impl("multi_tensor_scale_", &multi_tensor_scale_inplace_or_view);
  m.impl("multi_tensor_clamp_", &multi_tensor_clamp_inplace_or_view);
  m.impl("clip_grad_norm_", &clip_grad_norm_inplace_or_view);
  m.impl("clip_by_tensor_norm_", &clip_by_tensor_norm_inplace_or_view);
  m.impl("unitwise_clip_", &unitwise_clip_inplace_or_view);
}

TORCH_LIBRARY_IMPL(torchclip, Autograd, m) {
  // Reads only, and its outputs carry no gradient history: nothing for autograd to do.
  m.impl("multi_tensor_norm", torch::CppFunction::makeFallthrough());
  m.impl("multi_tensor_scale_", &multi_tensor_scale_autograd);
  m.impl("multi_tensor_clamp_", &multi_tensor_clamp_autograd);
  m.impl("clip_grad_norm_", &clip_grad_norm_autograd);
  m.impl("clip_by_tensor_norm_", &clip_by_tensor_norm_autograd);
  m.impl("unitwise_clip_", &unitwise_clip_autograd);
  m.impl("adam_step_", &adam_step_autograd);
}

}  // namespace torchclip
