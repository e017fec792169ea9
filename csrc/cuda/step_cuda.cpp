// CUDA implementations of the fused step ops adam_step_ and sgd_step_ (cpu/ops_cpu.cpp's are the
// specification): the same lists, checks and declines, the gradients read once and never written
// (cuda/step_kernel.cu). grad_scale, found_inf and the step counts stay on the device, as torch's fused CUDA
// steps keep them: nothing is read back, so a step can be captured in a CUDA graph. The counts go up by one
// before the kernel reads them and down by found_inf after it, as torch.optim's fused CUDA step does.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "cuda/kernels.h"
#include "op_shared.h"

namespace torchclip {
namespace {

// A float32 number on `device` (grad_scale, found_inf, a step count), as torch's fused CUDA steps take them.
bool device_float(const at::Tensor& t, c10::Device device) {
  return t.defined() && t.device() == device && t.scalar_type() == at::kFloat && t.numel() == 1;
}

// The address of an optional device number, null where absent; nullopt where it is given but not one.
std::optional<const float*> number_at(const std::optional<at::Tensor>& t, c10::Device device) {
  if (!t.has_value()) {
    return static_cast<const float*>(nullptr);
  }
  if (!device_float(*t, device)) {
    return std::nullopt;
  }
  return static_cast<const float*>(t->data_ptr());
}

// Each parameter with the lists walked beside it (grads first) as the kernels' tensors, or nullopt where one is
// not: every tensor on params[0]'s CUDA device, dense, each list's entry of its parameter's dtype and layout.
std::optional<std::vector<cuda::StepTensor>> step_tensors(at::TensorList params,
    std::initializer_list<at::TensorList> beside, at::TensorList state_steps) {
  std::vector<cuda::StepTensor> tensors;
  tensors.reserve(params.size());
  const c10::Device device = params[0].device();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const auto dtype = p.defined() && p.device() == device ? kernel_dtype(p) : std::nullopt;
    if (!dtype || (!state_steps.empty() && !device_float(state_steps[i], device))) {
      return std::nullopt;
    }
    cuda::StepTensor tensor{{p.data_ptr()}, nullptr, p.numel(), *dtype};
    int stream = 1;
    for (const at::TensorList& list : beside) {
      if (!walks_beside(list[i], p)) {
        return std::nullopt;
      }
      tensor.streams[stream++] = list[i].data_ptr();
    }
    if (!state_steps.empty()) {
      tensor.step = static_cast<const float*>(state_steps[i].data_ptr());
    }
    tensors.push_back(tensor);
  }
  return tensors;
}

// The step counts' `+= 1` before the kernel and `-= found_inf` after it (torch.optim's fused CUDA step).
void uncount_skipped(at::TensorList state_steps, const std::optional<at::Tensor>& found_inf) {
  if (found_inf.has_value()) {
    at::_foreach_sub_(state_steps, std::vector<at::Tensor>(state_steps.size(), *found_inf));
  }
}

// A step's launch: the kernels' tensors, grad_scale and found_inf on the device, or nullopt where the kernels
// decline (the caller then takes torch's step).
struct StepLaunch {
  std::vector<cuda::StepTensor> tensors;
  const float* grad_scale;
  const float* found_inf;
  c10::Device device;
};
std::optional<StepLaunch> step_launch(at::TensorList params, std::initializer_list<at::TensorList> beside,
    at::TensorList state_steps, const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf) {
  const c10::Device device = params[0].device();
  if (!device.is_cuda()) {
    return std::nullopt;
  }
  const auto scale = number_at(grad_scale, device), skip = number_at(found_inf, device);
  auto tensors = step_tensors(params, beside, state_steps);
  if (!scale || !skip || !tensors) {
    return std::nullopt;
  }
  return StepLaunch{std::move(*tensors), *scale, *skip, device};
}

at::Tensor adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr, double beta1,
    double beta2, double weight_decay, double eps, bool amsgrad, bool maximize, bool decoupled_weight_decay,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_adam_lists("torchclip.adam_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad);
  if (params.empty()) {
    return stepped(true);
  }
  const auto launch = amsgrad
      ? step_launch(params, {grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs}, state_steps, grad_scale, found_inf)
      : step_launch(params, {grads, exp_avgs, exp_avg_sqs}, state_steps, grad_scale, found_inf);
  if (!launch) {
    return stepped(false);
  }
  const c10::cuda::CUDAGuard guard(launch->device);
  at::_foreach_add_(state_steps, 1);
  const cuda::AdamScalars scalars{lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay,
      launch->grad_scale, launch->found_inf};
  cuda::adam_step(launch->tensors.data(), static_cast<int64_t>(launch->tensors.size()), scalars,
      c10::cuda::getCurrentCUDAStream().stream());
  uncount_skipped(state_steps, found_inf);
  return stepped(true);
}

at::Tensor sgd_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr,
    double weight_decay, double momentum, double dampening, bool nesterov, bool maximize, bool is_first_step,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  check_sgd_lists("torchclip.sgd_step_", params, grads, momentum_buffers, momentum);
  if (params.empty()) {
    return stepped(true);
  }
  const auto launch = momentum != 0.0 ? step_launch(params, {grads, momentum_buffers}, {}, grad_scale, found_inf)
                                      : step_launch(params, {grads}, {}, grad_scale, found_inf);
  if (!launch) {
    return stepped(false);
  }
  const c10::cuda::CUDAGuard guard(launch->device);
  const cuda::SgdScalars scalars{lr, weight_decay, momentum, dampening, nesterov, maximize, is_first_step,
      launch->grad_scale, launch->found_inf};
  cuda::sgd_step(launch->tensors.data(), static_cast<int64_t>(launch->tensors.size()), scalars,
      c10::cuda::getCurrentCUDAStream().stream());
  return stepped(true);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchclip, CUDA, m) {
  m.impl("adam_step_", &adam_step_cuda);
  m.impl("sgd_step_", &sgd_step_cuda);
}

}  // namespace torchclip
