// The CUDA kernels' host-side entry points, over plain spans so that the ATen-facing code
// (ops_cuda.cpp, compiled by the host compiler) and the device code (*.cu, compiled by nvcc) share
// no heavy headers: nvcc only ever sees these declarations, the CUDA runtime and c10's error macros.
//
// Every function only enqueues work on `stream` and returns: none reads a device value on the host,
// so none synchronises, and all of them can be captured in a CUDA graph (their metadata travels as
// kernel parameters, never through host buffers that a replay would read again).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernel_types.h"  // DType, NormKind, NormOrder, PerSampleParam: the same vocabulary as the CPU kernels

namespace torchclip::cuda {

// A dense, non-overlapping float16/bfloat16/float32/float64 run of `numel` elements (element order is
// irrelevant to every op, as on the CPU), and `index`, its position in the op's tensor list: where
// its norm is written and where its scale is read.
struct DeviceSpan {
  void* data;
  int64_t numel;
  DType dtype;
  int32_t index;
};

// The norm pass's scratch: one fixed slot per chunk of every span longer than one chunk, each chunk's
// partial result written to its own slot and summed in slot order (never by atomics), so the result
// does not depend on the order blocks run in.
int64_t norm_slot_count(const DeviceSpan* spans, int64_t count);
constexpr int64_t kNormSlotBytes = 24;

// norms[spans[k].index] = the `order`-norm of spans[k], in float64, with the CPU kernels' guarantees:
// every element widened to float64 before it is accumulated (fp32 values of 1e20 square to 1e40, fine
// in float64), and float64 data whose |x|^p would leave float64's range summed again, scaled.
// `slots` holds norm_slot_count() slots; `arrivals` one zeroed int32 per list position (both may be
// null when no span is longer than one chunk).
void tensor_norms(const DeviceSpan* spans, int64_t count, NormOrder order, double* norms, void* slots,
    int32_t* arrivals, cudaStream_t stream);

// *total = the `order`-norm of norms[0, count) (torch.nn.utils.get_total_norm's definition, as
// norm_total.h evaluates it). When `coefficient` is not null, also
// *coefficient = min(max_norm / (*total + eps), 1), NaN kept, or 1 when skip_nonfinite and the total is
// NaN or inf: the clip coefficient, computed where the norm is, so the host never waits for it.
void total_norm(const double* norms, int64_t count, NormOrder order, double* total, double* coefficient,
    double max_norm, double eps, bool skip_nonfinite, cudaStream_t stream);

// Exact norms, kind One or Two (cpu/exact_norm_kernel.cpp's, the same bits): norms[spans[k].index] =
// each span's norm correctly rounded (NaN where it holds a NaN, else inf where an inf; norms may be null,
// and positions with no span are left as they are), and where total is not null, *total = the total over
// every span rounded once and *coefficient as total_norm's (coefficient may be null). `accumulators` holds
// exact_accumulator_rows() zeroed rows of kExactAccumulatorWords int64s (ExactSum's digits, then NaN/inf
// flags): the total's, then, where norms are asked for, one per chunk of the spans longer than one chunk
// (norm_slot_count's numbering); `arrivals` one zeroed int32 per list position where norms are asked for
// (else it may be null).
constexpr int64_t kExactAccumulatorWords = 137;
int64_t exact_accumulator_rows(const DeviceSpan* spans, int64_t count, bool per_tensor_norms);
void exact_norms(const DeviceSpan* spans, int64_t count, NormKind kind, double* norms, double* total,
    double* coefficient, double max_norm, double eps, bool skip_nonfinite, int64_t* accumulators, int32_t* arrivals,
    cudaStream_t stream);

// Per-tensor clipping coefficients from per-tensor 2-norms: scales[i] = 1 where norms[i] <= max_norm,
// else max_norm / norms[i] (NaN for a NaN norm); all 1 when skip_nonfinite and any norm is NaN or inf.
// *any_nonfinite is set to 1 or 0.
void tensor_clip_scales(const double* norms, int64_t count, double max_norm, bool skip_nonfinite, double* scales,
    int32_t* any_nonfinite, cudaStream_t stream);

// spans[k] *= scales[spans[k].index * stride] in place (stride 0: one coefficient for all), read from
// device memory by each block, which returns at once when it is exactly 1 (rounded to float32 for
// 16/32-bit data): clipping that is not needed writes nothing. Rounding as the CPU kernel's.
void scale(const DeviceSpan* spans, int64_t count, const double* scales, int64_t stride, cudaStream_t stream);

// spans[k] = min(max(spans[k], lo), hi) in one read-write pass; NaN elements stay NaN, a NaN bound
// makes every element NaN (torch's clamp_min_ then clamp_max_).
void clamp(const DeviceSpan* spans, int64_t count, double lo, double hi, cudaStream_t stream);

// One tensor of a fused optimizer step (step_kernel.cu): its streams, dense, of one dtype and element order
// (param, grad, then the step's state: Adam's exp_avg, exp_avg_sq and max_exp_avg_sq, SGD's momentum buffer;
// null where the step has none), and its step count (a float32 on the device; null for SGD).
constexpr int kStepStreams = 5;
struct StepTensor {
  void* streams[kStepStreams];
  const float* step;
  int64_t numel;
  DType dtype;
};

// The step's hyperparameters as the host has them (the kernels round them to the opmath type, as torch's do),
// and grad_scale / found_inf: device float32 numbers or null.
struct AdamScalars {
  double lr, beta1, beta2, weight_decay, eps;
  bool amsgrad, maximize, decoupled_weight_decay;
  const float* grad_scale;
  const float* found_inf;
};
struct SgdScalars {
  double lr, weight_decay, momentum, dampening;
  bool nesterov, maximize, is_first_step;
  const float* grad_scale;
  const float* found_inf;
};

// One step of torch.optim.Adam / AdamW (torch 2.11's fused CUDA arithmetic) over `count` tensors whose step
// counts are already counted up, the gradients read once and never written; nothing is written where
// *found_inf is 1.
void adam_step(const StepTensor* tensors, int64_t count, const AdamScalars& scalars, cudaStream_t stream);
// One step of torch.optim.SGD, likewise (momentum buffers where momentum is not 0).
void sgd_step(const StepTensor* tensors, int64_t count, const SgdScalars& scalars, cudaStream_t stream);

// Per-sample clipping's second pass (cpu/per_sample_kernel.cpp's contract, the same normals): `params` is a
// device array of `count` entries whose rows and factors are device arrays too; max_numel is the largest
// parameter's element count.
void per_sample_accumulate(const PerSampleParam* params, int64_t count, int64_t max_numel, const PerSampleStep& step,
    cudaStream_t stream);

}  // namespace torchclip::cuda
