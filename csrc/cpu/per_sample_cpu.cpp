// CPU implementations of the per-sample clipping ops (DP-SGD, torchclip.per_sample): the per-sample gradients
// filed into rows (per_sample_rows.h), one per sample and parameter, for the kernels' two passes. Every check
// runs before any write, so an error leaves every tensor as it was.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "kernel_loader.h"
#include "norm_total.h"
#include "op_shared.h"
#include "per_sample_rows.h"

namespace torchclip {
namespace {

const c10::Device kCpu(c10::kCPU);

std::tuple<at::Tensor, at::Tensor> per_sample_norms_cpu(at::TensorList grad_samples, at::IntArrayRef pieces,
    double ord) {
  constexpr const char* op = "torchclip.per_sample_norms";
  const SampleRows rows = sample_rows(grad_samples, pieces, op, kCpu);
  check_per_sample_norm_order(rows, ord, op);
  const int64_t params = static_cast<int64_t>(pieces.size()), batch = rows.batch;
  // Each row a span, parameter-major: the multi-tensor norm kernel's one pass over all of them.
  std::vector<cpu::TensorSpan> spans(params * batch);
  for (int64_t j = 0; j < params; ++j) {
    for (int64_t b = 0; b < batch; ++b) {
      spans[j * batch + b] = {const_cast<void*>(rows.rows[j * batch + b]), rows.numels[j], rows.dtypes[j]};
    }
  }
  std::vector<double> norms(spans.size());
  const NormOrder order = norm_order(ord);
  if (!spans.empty()) {
    cpu_kernels().tensor_norms(spans.data(), static_cast<int64_t>(spans.size()), order, norms.data());
  }
  at::Tensor per_tensor = at::empty({batch, params}, at::kDouble);
  at::Tensor total = at::empty({batch}, at::kDouble);
  double* by_sample = per_tensor.data_ptr<double>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t j = 0; j < params; ++j) {
      by_sample[b * params + j] = norms[j * batch + b];
    }
    total.data_ptr<double>()[b] = total_norm(by_sample + b * params, params, order);
  }
  return {total, per_tensor};
}

void per_sample_accumulate_cpu(at::TensorList grad_samples, at::IntArrayRef pieces, const at::Tensor& factors,
    at::TensorList summed, at::TensorList grads, bool accumulate, double noise_std, int64_t seed, double divisor) {
  constexpr const char* op = "torchclip.per_sample_accumulate_";
  const SampleRows rows =
      checked_accumulate_rows(grad_samples, pieces, factors, summed, grads, noise_std, divisor, kCpu, op);
  const at::Tensor dense_factors = factors.contiguous();
  const std::vector<PerSampleParam> work = per_sample_params(rows, rows.rows.data(), dense_factors, summed, grads);
  const PerSampleStep step{rows.batch, accumulate, noise_std, divisor, static_cast<uint64_t>(seed)};
  if (!work.empty()) {
    cpu_kernels().per_sample_accumulate(work.data(), static_cast<int64_t>(work.size()), &step);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torchclip, CPU, m) {
  m.impl("per_sample_norms", &per_sample_norms_cpu);
  m.impl("per_sample_accumulate_", &per_sample_accumulate_cpu);
}

}  // namespace torchclip
