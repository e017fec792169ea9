// CUDA implementations of the per-sample clipping ops (cpu/per_sample_cpu.cpp is the specification): the rows
// filed as the CPU files them (per_sample_rows.h), the norms by the multi-tensor norm kernel over the rows (each
// row one span), the clipped sum by cuda/per_sample_kernel.cu. Nothing waits for the device: the row pointers
// and the parameters' table travel to it by a copy in stream order.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "cuda/kernels.h"
#include "norm_total.h"
#include "op_shared.h"
#include "per_sample_rows.h"

namespace torchclip {
namespace {

c10::Device first_device(at::TensorList tensors, const at::Tensor* other) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.is_cuda()) {
      return t.device();
    }
  }
  return other != nullptr && other->defined() && other->is_cuda()
      ? other->device()
      : c10::Device(c10::kCUDA, c10::cuda::current_device());
}

// `bytes` host bytes in a device buffer, copied in stream order (the host buffer is pinned, so the copy does
// not wait; the caching allocator keeps it until the copy has run).
at::Tensor on_device(const void* bytes, size_t size, c10::Device device) {
  at::Tensor host = at::empty({static_cast<int64_t>(size)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), bytes, size);
  return host.to(device, /*non_blocking=*/true);
}

std::tuple<at::Tensor, at::Tensor> per_sample_norms_cuda(at::TensorList grad_samples, at::IntArrayRef pieces,
    double ord) {
  constexpr const char* op = "torchclip.per_sample_norms";
  const c10::Device device = first_device(grad_samples, nullptr);
  const c10::cuda::CUDAGuard guard(device);
  const SampleRows rows = sample_rows(grad_samples, pieces, op, device);
  check_per_sample_norm_order(rows, ord, op);
  const int64_t params = static_cast<int64_t>(pieces.size()), batch = rows.batch;
  const at::TensorOptions wide = at::TensorOptions().dtype(at::kDouble).device(device);
  std::vector<cuda::DeviceSpan> spans;
  spans.reserve(params * batch);
  for (int64_t j = 0; j < params; ++j) {
    for (int64_t b = 0; b < batch; ++b) {
      spans.push_back({const_cast<void*>(rows.rows[j * batch + b]), rows.numels[j], rows.dtypes[j],
          static_cast<int32_t>(j * batch + b)});
    }
  }
  // (zeros: the kernel launches no block for an empty row, whose norm is 0)
  const at::Tensor norms = at::zeros({params, batch}, wide);
  if (!spans.empty()) {
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    const int64_t count = static_cast<int64_t>(spans.size());
    const int64_t slot_count = cuda::norm_slot_count(spans.data(), count);
    at::Tensor slots, arrivals;
    if (slot_count > 0) {
      slots = at::empty({slot_count * cuda::kNormSlotBytes}, wide.dtype(at::kByte));
      arrivals = at::zeros({count}, wide.dtype(at::kInt));
    }
    cuda::tensor_norms(spans.data(), count, norm_order(ord), norms.data_ptr<double>(),
        slot_count > 0 ? slots.data_ptr() : nullptr, slot_count > 0 ? arrivals.data_ptr<int32_t>() : nullptr, stream);
  }
  const at::Tensor per_tensor = norms.t().contiguous();
  // torch.nn.utils.get_total_norm's definition over each sample's parameters (float64: no range to leave here
  // short of norms beyond 1e154, which ATen's vector norm would square to inf; the CPU scales them)
  const at::Tensor total = params == 0 ? at::zeros({batch}, wide) : at::linalg_vector_norm(per_tensor, ord, 1);
  return {total, per_tensor};
}

void per_sample_accumulate_cuda(at::TensorList grad_samples, at::IntArrayRef pieces, const at::Tensor& factors,
    at::TensorList summed, at::TensorList grads, bool accumulate, double noise_std, int64_t seed, double divisor) {
  constexpr const char* op = "torchclip.per_sample_accumulate_";
  const c10::Device device = first_device(grad_samples, &factors);
  const c10::cuda::CUDAGuard guard(device);
  const SampleRows rows =
      checked_accumulate_rows(grad_samples, pieces, factors, summed, grads, noise_std, divisor, device, op);
  if (pieces.empty()) {
    return;
  }
  const at::Tensor row_table = on_device(rows.rows.data(), rows.rows.size() * sizeof(void*), device);
  const at::Tensor dense_factors = factors.contiguous();
  const std::vector<PerSampleParam> table =
      per_sample_params(rows, static_cast<const void* const*>(row_table.data_ptr()), dense_factors, summed, grads);
  const int64_t max_numel = *std::max_element(rows.numels.begin(), rows.numels.end());
  const at::Tensor param_table = on_device(table.data(), table.size() * sizeof(PerSampleParam), device);
  const PerSampleStep step{rows.batch, accumulate, noise_std, divisor, static_cast<uint64_t>(seed)};
  cuda::per_sample_accumulate(static_cast<const PerSampleParam*>(param_table.data_ptr()),
      static_cast<int64_t>(table.size()), max_numel, step, c10::cuda::getCurrentCUDAStream().stream());
}

}  // namespace

TORCH_LIBRARY_IMPL(torchclip, CUDA, m) {
  m.impl("per_sample_norms", &per_sample_norms_cuda);
  m.impl("per_sample_accumulate_", &per_sample_accumulate_cuda);
}

}  // namespace torchclip
