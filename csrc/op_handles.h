// Typed dispatcher handles for the torchclip ops (schemas in ops.cpp), one per op with its C++
// signature, for the C++ callers that go through the dispatcher: the Autograd kernels
// (ops_autograd.cpp) redispatch through them.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace torchclip::op_handles {

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline const auto& multi_tensor_norm() {
  static const auto op = find<std::tuple<at::Tensor, at::Tensor>(at::TensorList, double, bool, std::optional<bool>,
      std::optional<at::ScalarType>)>("torchclip::multi_tensor_norm");
  return op;
}

inline const auto& multi_tensor_scale_() {
  static const auto op = find<void(at::TensorList, const at::Tensor&)>("torchclip::multi_tensor_scale_");
  return op;
}

inline const auto& multi_tensor_clamp_() {
  static const auto op = find<void(at::TensorList, double, double)>("torchclip::multi_tensor_clamp_");
  return op;
}

inline const auto& clip_grad_norm_() {
  static const auto op = find<std::tuple<at::Tensor, at::Tensor, at::Tensor>(at::TensorList, double, double, bool,
      double, bool, c10::string_view, std::optional<bool>)>("torchclip::clip_grad_norm_");
  return op;
}

inline const auto& clip_by_tensor_norm_() {
  static const auto op = find<at::Tensor(at::TensorList, double, c10::string_view, std::optional<bool>)>(
      "torchclip::clip_by_tensor_norm_");
  return op;
}

inline const auto& unitwise_clip_() {
  static const auto op = find<void(at::TensorList, at::TensorList, double, double, double, std::optional<bool>)>(
      "torchclip::unitwise_clip_");
  return op;
}

inline const auto& adam_step_() {
  static const auto op = find<at::Tensor(at::TensorList, at::TensorList, at::TensorList, at::TensorList, at::TensorList,
      at::TensorList, double, double, double, double, double, bool, bool, bool, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&)>("torchclip::adam_step_");
  return op;
}

inline const auto& sgd_step_() {
  static const auto op = find<at::Tensor(at::TensorList, at::TensorList, at::TensorList, double, double, double, double,
      bool, bool, bool, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>("torchclip::sgd_step_");
  return op;
}

inline const auto& adagrad_step_() {
  static const auto op =
      find<at::Tensor(at::TensorList, at::TensorList, at::TensorList, at::TensorList, double, double, double, double,
          bool, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>("torchclip::adagrad_step_");
  return op;
}

inline const auto& per_sample_norms() {
  static const auto op =
      find<std::tuple<at::Tensor, at::Tensor>(at::TensorList, at::IntArrayRef, double)>("torchclip::per_sample_norms");
  return op;
}

inline const auto& per_sample_accumulate_() {
  static const auto op = find<void(at::TensorList, at::IntArrayRef, const at::Tensor&, at::TensorList, at::TensorList,
      bool, double, int64_t, double)>("torchclip::per_sample_accumulate_");
  return op;
}

}  // namespace torchclip::op_handles
