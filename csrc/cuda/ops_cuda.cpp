// CUDA implementations of the torchclip ops: the CPU ops' checks, split and cross-tensor rules
// (cpu/ops_cpu.cpp is the specification), with every number computed on the device.
//
// No op waits for the device, except where the CPU op raises on a computed value
// (error_if_nonfinite=True, nonfinite="raise"): the check needs the value on the host, and torch's
// clip_grad_norm_ synchronises there too. Per-tensor norms, the total, the clip coefficient and the
// per-tensor scales stay in device memory, and the scaling kernel reads them there.
//
// As on the CPU, dense float16/bfloat16/float32/float64 tensors go to the kernels; the rest (complex,
// integer, strided views with gaps or overlaps, lazily negated views) take ATen's ops on the device,
// which are correct for all. Every check runs before any tensor is written.
#ifdef TORCHCLIP_PYTHON_MODULE  // setup.py's torchclip._cuda; CMake's libtorchclip_cuda is a plain library
#include <Python.h>
#endif

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "cuda/kernels.h"
#include "cuda_split_ops.h"
#include "norm_total.h"  // norm_order: the same classification of p as the CPU ops
#include "op_shared.h"
#include "split.h"  // the walk's Split, which the overloads at the end take

namespace torchclip {
namespace {

using cuda::DeviceSpan;

// How a list is served: `spans` by the kernels, `aten_path` (indices) by ATen.
struct DeviceSplit {
  c10::Device device{c10::kCUDA};
  std::vector<DeviceSpan> spans;
  std::vector<int64_t> aten_path;
  at::ScalarType promoted = at::kFloat;
};

// The device an op runs on: its first CUDA tensor's (the dispatcher chose the CUDA kernel because
// some argument is on CUDA), else `other`'s (the scale of multi_tensor_scale_ with no tensors).
c10::Device op_device(at::TensorList tensors, const at::Tensor* other) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.is_cuda()) {
      return t.device();
    }
  }
  if (other != nullptr && other->defined() && other->is_cuda()) {
    return other->device();
  }
  return c10::Device(c10::kCUDA, c10::cuda::current_device());
}

// Checks every tensor (defined, on `device`, strided; errors name `op` and the index) and splits the
// list as cpu/ops_cpu.cpp's Split::add does.
DeviceSplit split_tensors(at::TensorList tensors, const char* op, c10::Device device) {
  TORCH_CHECK(tensors.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), op, ": ", tensors.size(),
      " tensors is more than the CUDA kernels take in one call (2^31 - 1)");
  DeviceSplit split;
  split.device = device;
  split.spans.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": tensors[", i, "] is an undefined tensor");
    TORCH_CHECK(t.device() == device, op, ": tensors[", i, "] is on ", t.device(), "; expected ", device,
        " (the CUDA kernels take the tensors of one call on one CUDA device)");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": tensors[", i, "] has layout ", t.layout(),
        "; only strided tensors are supported here");
    split.promoted = i == 0 ? t.scalar_type() : c10::promoteTypes(split.promoted, t.scalar_type());
    if (const auto dtype = kernel_dtype(t)) {
      split.spans.push_back({t.data_ptr(), t.numel(), *dtype, static_cast<int32_t>(i)});
    } else {
      split.aten_path.push_back(static_cast<int64_t>(i));
    }
  }
  return split;
}

// The walk's split of `tensors` (walk/param_walk.cpp, which checked every tensor) as the kernels take it.
DeviceSplit from_walk(at::TensorList tensors, const Split& walked) {
  TORCH_CHECK(tensors.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()), "torchclip: ", tensors.size(),
      " tensors is more than the CUDA kernels take in one call (2^31 - 1)");
  DeviceSplit split;
  split.device = tensors[0].device();
  split.promoted = walked.promoted;
  split.aten_path = walked.aten_path;
  split.spans.resize(walked.spans.size());
  for (size_t k = 0; k < walked.spans.size(); ++k) {
    const cpu::TensorSpan& span = walked.spans[k];
    split.spans[k] = {span.data, span.numel, span.dtype, static_cast<int32_t>(walked.span_source[k])};
  }
  return split;
}

at::TensorOptions float64_on(c10::Device device) {
  return at::TensorOptions().dtype(at::kDouble).device(device);
}

// The norm of a tensor the kernels do not take, by ATen in float64, as a 0-d device tensor. ATen does
// not scale, so |x|^p can leave float64's range (float64 squares beyond ~1e154); the CPU op then
// recomputes from x / max|x| (min|x| for p < 0). That choice depends on the norm, which the host must
// not wait for, so here both are computed and at::where picks on the device. 16/32-bit data needs
// neither for 0 < p <= 2 (|x|^p stays within [2e-90, 1.2e77]), and skips the extra passes.
at::Tensor aten_norm(const at::Tensor& t, double ord) {
  const auto wide = t.is_complex() ? at::kComplexDouble : at::kDouble;
  at::Tensor norm = at::linalg_vector_norm(t, ord, std::nullopt, false, wide);
  const bool wide_input = t.scalar_type() == at::kDouble || t.scalar_type() == at::kComplexDouble;
  if (!std::isfinite(ord) || ord == 0.0 || t.numel() == 0 || (!wide_input && ord > 0.0 && ord <= 2.0)) {
    return norm;
  }
  const at::Tensor magnitudes = t.abs();
  const at::Tensor scale = (ord > 0 ? magnitudes.max() : magnitudes.min()).to(at::kDouble);
  const at::Tensor scaled = scale * at::linalg_vector_norm(t.to(wide) / scale, ord, std::nullopt, false, wide);
  const at::Tensor may_have_left_range = norm.isinf().logical_or(norm.lt(1e-290));
  const at::Tensor usable = scale.isfinite().logical_and(scale.ne(0.0));
  return at::where(may_have_left_range.logical_and(usable), scaled, norm);
}

// Exact norms (orders 1 and 2; cpu/ops_cpu.cpp's exact_norms_wide is the specification), into the
// tensors given: per-tensor norms (norms), the total (total) and the clip coefficient (coefficient, with
// total), each float64 on the device. ATen's tensors are made dense exact terms first (exact_terms: a
// complex tensor's real view, or its magnitudes for p = 1); false, with nothing computed, where no kernel
// dtype holds one's values: the caller keeps float64 accumulation.
bool exact_norms_into(at::TensorList tensors, const DeviceSplit& split, double ord, at::Tensor* norms,
    at::Tensor* total, at::Tensor* coefficient, double max_norm, double eps, bool skip_nonfinite, cudaStream_t stream) {
  std::vector<DeviceSpan> spans = split.spans;
  const NormKind kind = ord == 1.0 ? NormKind::One : NormKind::Two;
  std::vector<at::Tensor> dense;  // (freed to the caching allocator in stream order: safe for the kernels)
  for (int64_t i : split.aten_path) {
    const auto terms = exact_terms(tensors[i], kind);
    if (!terms) {
      return false;
    }
    const auto& [real, dtype] = *terms;
    dense.push_back(real);
    spans.push_back({real.data_ptr(), real.numel(), dtype, static_cast<int32_t>(i)});
  }
  const int64_t count = static_cast<int64_t>(tensors.size());
  const at::TensorOptions options = float64_on(split.device);
  if (norms != nullptr) {
    *norms = at::zeros({count}, options);  // (an empty tensor launches no block: its norm is 0)
  }
  if (total != nullptr) {
    *total = at::empty({}, options);
  }
  if (coefficient != nullptr) {
    *coefficient = at::empty({}, options);
  }
  const int64_t span_count = static_cast<int64_t>(spans.size());
  const int64_t rows = cuda::exact_accumulator_rows(spans.data(), span_count, norms != nullptr);
  const at::Tensor accumulators = at::zeros({rows, cuda::kExactAccumulatorWords}, options.dtype(at::kLong));
  const at::Tensor arrivals = rows > 1 ? at::zeros({count}, options.dtype(at::kInt)) : at::Tensor();
  cuda::exact_norms(spans.data(), span_count, kind, norms != nullptr ? norms->data_ptr<double>() : nullptr,
      total != nullptr ? total->data_ptr<double>() : nullptr,
      coefficient != nullptr ? coefficient->data_ptr<double>() : nullptr, max_norm, eps, skip_nonfinite,
      accumulators.data_ptr<int64_t>(), rows > 1 ? arrivals.data_ptr<int32_t>() : nullptr, stream);
  return true;
}

bool exact_order(bool exact, double ord) {
  return exact && (ord == 1.0 || ord == 2.0);
}

// Per-tensor norms in float64, on the device: kernels for the spans, ATen for the rest; exact norms
// (orders 1 and 2) where `exact` says so.
at::Tensor tensor_norms(at::TensorList tensors, const DeviceSplit& split, double ord, const char* op,
    cudaStream_t stream, bool exact = false) {
  const NormOrder order = norm_order(ord);
  check_norm_inputs(tensors, split.aten_path, ord, op);
  at::Tensor exact_norms;
  if (exact_order(exact, ord) &&
      exact_norms_into(tensors, split, ord, &exact_norms, nullptr, nullptr, 0.0, 0.0, false, stream)) {
    return exact_norms;
  }
  const int64_t count = static_cast<int64_t>(tensors.size());
  // The kernels launch no block for an empty tensor, whose norm (for the orders that allow one) is 0.
  const bool any_empty =
      std::any_of(split.spans.begin(), split.spans.end(), [](const DeviceSpan& s) { return s.numel == 0; });
  at::Tensor norms =
      any_empty ? at::zeros({count}, float64_on(split.device)) : at::empty({count}, float64_on(split.device));
  if (!split.spans.empty()) {
    const int64_t span_count = static_cast<int64_t>(split.spans.size());
    const int64_t slot_count = cuda::norm_slot_count(split.spans.data(), span_count);
    at::Tensor slots, arrivals;
    if (slot_count > 0) {
      slots = at::empty({slot_count * cuda::kNormSlotBytes}, float64_on(split.device).dtype(at::kByte));
      arrivals = at::zeros({count}, float64_on(split.device).dtype(at::kInt));
    }
    cuda::tensor_norms(split.spans.data(), span_count, order, norms.data_ptr<double>(),
        slot_count > 0 ? slots.data_ptr() : nullptr, slot_count > 0 ? arrivals.data_ptr<int32_t>() : nullptr, stream);
  }
  for (int64_t i : split.aten_path) {
    norms.select(0, i).copy_(aten_norm(tensors[i], ord));
  }
  return norms;
}

// t *= coefficient (a 0-d float64 device tensor) for a tensor ATen serves, rounded as the CPU op's
// mul_(double) rounds: 16-bit data multiplied in float32 and rounded once, 32/64-bit data in its own
// precision. (Multiplying by the float64 tensor itself would leave the rounding to type promotion.)
void aten_scale(const at::Tensor& t, const at::Tensor& coefficient) {
  const at::ScalarType type = t.scalar_type();
  if (type == at::kHalf || type == at::kBFloat16) {
    t.copy_(t.to(at::kFloat).mul_(coefficient.to(at::kFloat)));
  } else if (at::isComplexType(type)) {
    t.mul_(coefficient.to(c10::toRealValueType(type)));
  } else {
    t.mul_(coefficient.to(type));
  }
}

cudaStream_t current_stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

// Runs an in-place op over a split list: launch(spans, count) over the kernels' spans in one launch,
// then on_aten(i) for each tensor ATen serves; or, when two listed tensors may share memory, one tensor
// at a time in list order, as torch's loops (and the CPU ops) take them: the blocks of one launch run
// concurrently and would race on shared elements, and products taken in another order round otherwise.
template <typename Launch, typename OnAten>
void apply_in_place(at::TensorList tensors, const std::vector<DeviceSpan>& spans, const std::vector<int64_t>& aten_path,
    const Launch& launch, const OnAten& on_aten) {
  if (!may_overlap(spans.data(), spans.size(), tensors, aten_path)) {
    if (!spans.empty()) {
      launch(spans.data(), static_cast<int64_t>(spans.size()));
    }
    for (int64_t i : aten_path) {
      on_aten(i);
    }
    return;
  }
  std::vector<const DeviceSpan*> span_of(tensors.size(), nullptr);
  for (const DeviceSpan& span : spans) {
    span_of[span.index] = &span;
  }
  std::vector<bool> on_aten_path(tensors.size(), false);
  for (int64_t i : aten_path) {
    on_aten_path[i] = true;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (span_of[i] != nullptr) {
      launch(span_of[i], int64_t{1});
    } else if (on_aten_path[i]) {
      on_aten(static_cast<int64_t>(i));
    }
  }
}

// Each op below in two parts, as the CPU ops (cpu/ops_cpu.h): <op>_cuda_split takes a split list, from
// the dispatcher kernel <op>_cuda's split_tensors, or from the walk (the overloads on the walk's Split
// at the end, which CudaSplitOps holds).
constexpr const char* kNormOp = "torchclip.multi_tensor_norm";

std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_cuda_split(at::TensorList tensors, const DeviceSplit& split,
    double ord, bool error_if_nonfinite, bool exact, std::optional<at::ScalarType> dtype = std::nullopt) {
  const c10::cuda::CUDAGuard guard(split.device);
  const cudaStream_t stream = current_stream();
  at::Tensor norms, total;
  check_norm_inputs(tensors, split.aten_path, ord, kNormOp);
  if (!exact_order(exact, ord) ||
      !exact_norms_into(tensors, split, ord, &norms, &total, nullptr, 0.0, 0.0, false, stream)) {
    norms = tensor_norms(tensors, split, ord, kNormOp, stream);
    total = at::empty({}, float64_on(split.device));
    cuda::total_norm(norms.data_ptr<double>(), norms.numel(), norm_order(ord), total.data_ptr<double>(), nullptr, 0.0,
        0.0, false, stream);
  }
  if (error_if_nonfinite) {
    check_finite_total(total.item<double>(), ord, true);  // the check needs the value: a sync, as torch's
  }
  return {total.to(dtype.value_or(total_norm_dtype(split.promoted))), norms};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_cuda(at::TensorList tensors, double ord, bool error_if_nonfinite,
    std::optional<bool> exact, std::optional<at::ScalarType> dtype) {
  const c10::Device device = op_device(tensors, nullptr);
  return multi_tensor_norm_cuda_split(tensors, split_tensors(tensors, kNormOp, device), ord, error_if_nonfinite,
      exact_norms_for(exact), dtype);
}

void multi_tensor_scale_cuda(at::TensorList tensors, const at::Tensor& scale) {
  constexpr const char* op = "torchclip.multi_tensor_scale_";
  const int64_t count = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(scale.dim() == 0 || (scale.dim() == 1 && scale.size(0) == count), op,
      ": scale must be a 0-d tensor or a 1-d tensor with one entry per tensor (", count, "), got shape ",
      scale.sizes());
  const c10::Device device = op_device(tensors, &scale);
  // A CPU scale is accepted, as torch's mul_ accepts a CPU scalar tensor with CUDA tensors.
  TORCH_CHECK(scale.is_cpu() || scale.device() == device, op, ": scale is on ", scale.device(), "; expected ", device,
      " or the CPU");
  TORCH_CHECK(!scale.is_complex(), op, ": scale has dtype ", scale.scalar_type(), "; expected a real dtype");
  const c10::cuda::CUDAGuard guard(device);
  check_not_inference(tensors, op);
  DeviceSplit split = split_tensors(tensors, op, device);
  check_writable(tensors, split.aten_path, op);
  // torch multiplies a 0-d tensor by a 0-d scale in their promoted dtype (float32 x float64 in
  // float64), unlike any tensor with dimensions: leave those to ATen, which knows the rule.
  std::vector<DeviceSpan> spans;
  for (const DeviceSpan& span : split.spans) {
    const at::Tensor& t = tensors[span.index];
    if (t.dim() == 0 && at::promote_types(t.scalar_type(), scale.scalar_type()) != t.scalar_type()) {
      split.aten_path.push_back(span.index);
    } else {
      spans.push_back(span);
    }
  }
  // The factors as float64 on the device. A CPU 0-d scale is read on the host (no device involved)
  // and written by a fill kernel; a CPU 1-d scale is copied over.
  const at::Tensor factors = scale.is_cpu() && scale.dim() == 0 ? at::full({}, scale.item<double>(), float64_on(device))
                                                                : scale.to(device, at::kDouble).contiguous();
  // The CPU op skips ATen's multiply when the factor is exactly 1; that test would need the value on
  // the host, and x * 1 == x for every x, so here it always multiplies.
  apply_in_place(
      tensors, spans, split.aten_path,
      [&](const DeviceSpan* some, int64_t count) {
        cuda::scale(some, count, factors.data_ptr<double>(), scale.dim() == 0 ? 0 : 1, current_stream());
      },
      [&](int64_t i) { tensors[i].mul_(scale.dim() == 0 ? scale : scale[i]); });
}

constexpr const char* kClampOp = "torchclip.multi_tensor_clamp_";

void multi_tensor_clamp_cuda_split(at::TensorList tensors, const DeviceSplit& split, double min, double max) {
  const c10::cuda::CUDAGuard guard(split.device);
  check_clampable(tensors, split.aten_path, kClampOp);
  apply_in_place(
      tensors, split.spans, split.aten_path,
      [&](const DeviceSpan* some, int64_t count) { cuda::clamp(some, count, min, max, current_stream()); },
      [&](int64_t i) { clamp_on_aten(tensors[i], min, max); });
}

void multi_tensor_clamp_cuda(at::TensorList tensors, double min, double max) {
  check_not_inference(tensors, kClampOp);
  const c10::Device device = op_device(tensors, nullptr);
  multi_tensor_clamp_cuda_split(tensors, split_tensors(tensors, kClampOp, device), min, max);
}

constexpr const char* kClipGradNormOp = "torchclip.clip_grad_norm_";

at::Tensor clip_grad_norm_cuda_split(at::TensorList grads, const DeviceSplit& split, double max_norm, double norm_type,
    bool error_if_nonfinite, double eps, bool norm_at_least_float32, NonFinite policy, bool exact,
    NormClipStats* stats) {
  constexpr const char* op = kClipGradNormOp;
  const c10::cuda::CUDAGuard guard(split.device);
  check_writable(grads, split.aten_path, op);
  const cudaStream_t stream = current_stream();
  at::Tensor norms, total, coefficient;
  check_norm_inputs(grads, split.aten_path, norm_type, op);
  // torch's coefficient, max_norm / (total_norm + eps) clamped to at most 1, from the float64 norm and
  // on the device; 1 for a non-finite norm under "skip".
  if (!exact_order(exact, norm_type) ||
      !exact_norms_into(grads, split, norm_type, stats != nullptr ? &norms : nullptr, &total, &coefficient, max_norm,
          eps, policy == NonFinite::Skip, stream)) {
    norms = tensor_norms(grads, split, norm_type, op, stream);
    total = at::empty({}, float64_on(split.device));
    coefficient = at::empty({}, float64_on(split.device));
    cuda::total_norm(norms.data_ptr<double>(), norms.numel(), norm_order(norm_type), total.data_ptr<double>(),
        coefficient.data_ptr<double>(), max_norm, eps, policy == NonFinite::Skip, stream);
  }
  if (error_if_nonfinite || policy == NonFinite::Raise) {
    check_finite_total(total.item<double>(), norm_type, true);  // the check needs the value: a sync, as torch's
  }
  apply_in_place(
      grads, split.spans, split.aten_path,
      [&](const DeviceSpan* some, int64_t count) {
        cuda::scale(some, count, coefficient.data_ptr<double>(), 0, stream);
      },
      [&](int64_t i) { aten_scale(grads[i], coefficient); });
  if (stats != nullptr) {
    *stats = {norms, coefficient};
  }
  at::ScalarType dtype = grads.empty() ? at::kFloat : total_norm_dtype(split.promoted);
  if (norm_at_least_float32) {
    dtype = c10::promoteTypes(dtype, at::kFloat);
  }
  return total.to(dtype);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> clip_grad_norm_cuda(at::TensorList grads, double max_norm,
    double norm_type, bool error_if_nonfinite, double eps, bool norm_at_least_float32, c10::string_view nonfinite,
    std::optional<bool> exact) {
  const NonFinite policy = parse_nonfinite(nonfinite, kClipGradNormOp);
  const c10::Device device = op_device(grads, nullptr);
  check_not_inference(grads, kClipGradNormOp);
  NormClipStats stats;
  at::Tensor total = clip_grad_norm_cuda_split(grads, split_tensors(grads, kClipGradNormOp, device), max_norm,
      norm_type, error_if_nonfinite, eps, norm_at_least_float32, policy, exact_norms_for(exact), &stats);
  return {std::move(total), std::move(stats.norms), std::move(stats.coefficient)};
}

constexpr const char* kClipByTensorNormOp = "torchclip.clip_by_tensor_norm_";

at::Tensor clip_by_tensor_norm_cuda_split(at::TensorList tensors, const DeviceSplit& split, double max_norm,
    NonFinite policy, bool exact) {
  constexpr const char* op = kClipByTensorNormOp;
  const c10::cuda::CUDAGuard guard(split.device);
  check_writable(tensors, split.aten_path, op);
  const cudaStream_t stream = current_stream();
  const at::Tensor norms = tensor_norms(tensors, split, 2.0, op, stream, exact);
  const at::Tensor scales = at::empty({norms.numel()}, float64_on(split.device));
  const at::Tensor any_nonfinite = at::empty({}, float64_on(split.device).dtype(at::kInt));
  cuda::tensor_clip_scales(norms.data_ptr<double>(), norms.numel(), max_norm, policy == NonFinite::Skip,
      scales.data_ptr<double>(), any_nonfinite.data_ptr<int32_t>(), stream);
  if (policy == NonFinite::Raise) {
    TORCH_CHECK(any_nonfinite.item<int32_t>() == 0, op, kTensorNormNonFinite);  // a sync, for the check
  }
  if (may_overlap(split.spans.data(), split.spans.size(), tensors, split.aten_path)) {
    // Each tensor clipped by its norm as the ones before it left it, as a loop over the list does (and
    // the CPU op): a launch per tensor, for lists whose tensors share memory only. Under "skip", a
    // non-finite norm among the first ones leaves every tensor as it was.
    const at::Tensor skipped =
        policy == NonFinite::Skip ? any_nonfinite.ne(0) : at::zeros({}, float64_on(split.device).dtype(at::kBool));
    const at::Tensor one_nonfinite = at::empty_like(any_nonfinite);
    at::Tensor seen = at::empty({norms.numel()}, float64_on(split.device));
    for (size_t i = 0; i < tensors.size(); ++i) {
      const at::TensorList one = tensors.slice(i, 1);
      const DeviceSplit one_split = split_tensors(one, op, split.device);
      const at::Tensor norm = tensor_norms(one, one_split, 2.0, op, stream, exact);
      seen.narrow(0, static_cast<int64_t>(i), 1).copy_(norm);
      at::Tensor scale = at::empty({1}, float64_on(split.device));
      cuda::tensor_clip_scales(norm.data_ptr<double>(), 1, max_norm, false, scale.data_ptr<double>(),
          one_nonfinite.data_ptr<int32_t>(), stream);
      scale = at::where(skipped, at::ones_like(scale), scale);
      if (!one_split.spans.empty()) {
        cuda::scale(one_split.spans.data(), 1, scale.data_ptr<double>(), 0, stream);
      } else {
        aten_scale(one[0], scale.select(0, 0));
      }
    }
    return seen;
  }
  apply_in_place(
      tensors, split.spans, split.aten_path,
      [&](const DeviceSpan* some, int64_t count) { cuda::scale(some, count, scales.data_ptr<double>(), 1, stream); },
      [&](int64_t i) { aten_scale(tensors[i], scales.select(0, i)); });
  return norms;
}

at::Tensor clip_by_tensor_norm_cuda(at::TensorList tensors, double max_norm, c10::string_view nonfinite,
    std::optional<bool> exact) {
  const NonFinite policy = parse_nonfinite(nonfinite, kClipByTensorNormOp);
  const c10::Device device = op_device(tensors, nullptr);
  check_not_inference(tensors, kClipByTensorNormOp);
  return clip_by_tensor_norm_cuda_split(tensors, split_tensors(tensors, kClipByTensorNormOp, device), max_norm, policy,
      exact_norms_for(exact));
}

// ---- the same on the walk's Split (CudaSplitOps: the fast path's entries) -----------------------

at::Tensor total_norm_cuda_split(at::TensorList tensors, const Split& walked, double ord, bool error_if_nonfinite,
    std::optional<bool> exact) {
  return std::get<0>(multi_tensor_norm_cuda_split(tensors, from_walk(tensors, walked), ord, error_if_nonfinite,
      exact_norms_for(exact)));
}

at::Tensor clip_grad_norm_cuda_split(at::TensorList grads, const Split& walked, double max_norm, double norm_type,
    bool error_if_nonfinite, double eps, bool norm_at_least_float32, c10::string_view nonfinite,
    std::optional<bool> exact, NormClipStats* stats) {
  const NonFinite policy = parse_nonfinite(nonfinite, kClipGradNormOp);
  return clip_grad_norm_cuda_split(grads, from_walk(grads, walked), max_norm, norm_type, error_if_nonfinite, eps,
      norm_at_least_float32, policy, exact_norms_for(exact), stats);
}

at::Tensor clip_by_tensor_norm_cuda_split(at::TensorList tensors, const Split& walked, double max_norm,
    c10::string_view nonfinite, std::optional<bool> exact) {
  const NonFinite policy = parse_nonfinite(nonfinite, kClipByTensorNormOp);
  return clip_by_tensor_norm_cuda_split(tensors, from_walk(tensors, walked), max_norm, policy, exact_norms_for(exact));
}

void multi_tensor_clamp_cuda_split(at::TensorList tensors, const Split& walked, double min, double max) {
  multi_tensor_clamp_cuda_split(tensors, from_walk(tensors, walked), min, max);
}

const CudaSplitOps kSplitOps{&total_norm_cuda_split, &clip_grad_norm_cuda_split, &clip_by_tensor_norm_cuda_split,
    &multi_tensor_clamp_cuda_split};

}  // namespace

TORCH_LIBRARY_IMPL(torchclip, CUDA, m) {
  m.impl("multi_tensor_norm", &multi_tensor_norm_cuda);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_cuda);
  m.impl("multi_tensor_clamp_", &multi_tensor_clamp_cuda);
  m.impl("clip_grad_norm_", &clip_grad_norm_cuda);
  m.impl("clip_by_tensor_norm_", &clip_by_tensor_norm_cuda);
}

}  // namespace torchclip

#ifdef TORCHCLIP_PYTHON_MODULE
// torchclip._cuda is a Python extension module so that `import` can load it; loading it runs the
// registration above (into the library torchclip._C defines, so _C is imported first). Its one name,
// split_ops, is the capsule torchclip._ops hands to _C for the walk.
namespace {
// set_exact_norms(enabled): this library's copy of the process-wide exact-norm setting (op_shared.h), set
// by torchclip.set_exact_norm beside _C's; returns the previous setting.
PyObject* set_exact_norms(PyObject* /*module*/, PyObject* enabled) {
  const int truth = PyObject_IsTrue(enabled);
  if (truth < 0) {
    return nullptr;
  }
  return PyBool_FromLong(torchclip::exact_norms_setting().exchange(truth != 0));
}

PyMethodDef methods[] = {
    {"set_exact_norms", &set_exact_norms, METH_O, "Exact p = 1 and 2 norms on CUDA from now on (or not)."},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

PyMODINIT_FUNC PyInit__cuda(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "torchclip._cuda",
      "torchclip's CUDA kernels, registered with the dispatcher on import.", -1, methods, nullptr, nullptr, nullptr,
      nullptr};
  PyObject* created = PyModule_Create(&module);
  if (created == nullptr) {
    return nullptr;
  }
  PyObject* capsule = PyCapsule_New(const_cast<torchclip::CudaSplitOps*>(&torchclip::kSplitOps),
      torchclip::kCudaSplitOpsCapsule, nullptr);
  if (capsule == nullptr || PyModule_AddObject(created, "split_ops", capsule) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(created);
    return nullptr;
  }
  return created;
}
#endif
