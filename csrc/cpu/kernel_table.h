// The C ABI between the dispatcher-facing library (ops.cpp) and the CPU kernel libraries.
//
// The same kernel sources are compiled once per instruction set (baseline x86-64, AVX2, AVX-512) into
// separate shared libraries; exactly one is loaded at run time, chosen by the CPU and by
// torch.backends.cpu.get_cpu_capability(). Keeping the boundary a plain C struct of function pointers
// means no AVX-compiled inline function or static initialiser can leak into code that runs on a CPU
// without AVX (the trap of mixing per-ISA objects in one library).
#pragma once

#include <cstdint>

#include "exact_sum.h"     // ExactSum: the exact norms' accumulator
#include "kernel_types.h"  // DType, NormKind, NormOrder, PerSampleParam/Step: shared with the CUDA kernels

namespace torchclip::cpu {

class ItemPool;  // item_pool.h

// Bumped whenever a struct below changes layout or a kernel's contract, so a stale kernel library is
// refused, not misread.
constexpr int32_t kKernelAbiVersion = 8;

// A dense, non-overlapping run of `numel` elements: either a contiguous tensor or any tensor whose
// strides are a permutation of contiguous ones. Element order does not matter to any kernel here
// (norms, scaling and clamping are order-free), so every such tensor is walked as one flat array.
struct TensorSpan {
  void* data;
  int64_t numel;
  DType dtype;
};

// One Adam/AdamW step's hyperparameters (torch.optim.Adam's, for a fused step).
struct AdamStep {
  double lr, beta1, beta2, weight_decay, eps;
  bool amsgrad, maximize, decoupled_weight_decay;  // decoupled: AdamW's decay of the parameter
  const float* grad_scale;  // each gradient is divided by *grad_scale as it is read; null: not divided
};

// One SGD step's hyperparameters (torch.optim.SGD's, for a fused step).
struct SgdStep {
  double lr, weight_decay, momentum, dampening;
  bool nesterov, maximize;
  bool is_first_step;       // the momentum buffers start as the gradient (torch's first step)
  const float* grad_scale;  // as AdamStep's
};

// One Adagrad step's hyperparameters (torch.optim.Adagrad's, for a fused step).
struct AdagradStep {
  double lr, lr_decay, weight_decay, eps;
  bool maximize;
  const float* grad_scale;  // as AdamStep's
};

struct KernelTable {
  int32_t abi_version;
  const char* capability;  // "DEFAULT", "AVX2" or "AVX512": the names torch uses for its own kernels

  // norms[i] = the `order`-norm of spans[i], accumulated in float64 (scaled where float64 itself
  // would overflow or underflow), so it is exact to float64 rounding for every input dtype.
  void (*tensor_norms)(const TensorSpan* spans, int64_t count, NormOrder order, double* norms);

  // The exact norms, kind One or Two: norms[i] = spans[i]'s norm correctly rounded to float64 (NaN where
  // it holds a NaN, else inf where it holds an inf), *total = the exact sum of every span's |x| or x^2, and
  // *total_flags = 1 if a NaN was met, | 2 if an inf was. norms may be null: the total alone (each
  // tensor's root, checked exactly, is most of a small tensor's cost).
  void (*exact_norms)(const TensorSpan* spans, int64_t count, NormKind kind, double* norms, ExactSum* total,
      int32_t* total_flags);

  // spans[i] *= scales[i] in place, multiplied in float32 for 16/32-bit dtypes (as torch does, with a
  // float32 opmath) and in float64 for float64. A span whose scale rounds to exactly 1 is not written.
  void (*scale)(const TensorSpan* spans, int64_t count, const double* scales);

  // spans[i] = min(max(spans[i], lo), hi) in place, one read-write pass. NaN elements stay NaN; a NaN
  // bound makes every element NaN, as torch's clamp_min_/clamp_max_ do.
  void (*clamp)(const TensorSpan* spans, int64_t count, double lo, double hi);

  // Adaptive gradient clipping, unit by unit: for each i, with max = max(||weights[i]||, eps) *
  // clip_factor (norms of `order`, as tensor_norms computes them), grads[i] *= max / max(||grads[i]||,
  // 1e-6) unless ||grads[i]|| < max, rounded as scale. weights[i] and grads[i] are one unit (a row) of a
  // weight and of its gradient; the gradient units must not overlap.
  void (*unitwise_clip)(const TensorSpan* weights, const TensorSpan* grads, int64_t count, NormOrder order,
      double clip_factor, double eps);

  // One fused Adam/AdamW step of every tensor, torch's CPU fused kernel's arithmetic (steps[i] is
  // tensor i's step count, already counted up), except that the gradients are only read: divided by
  // *grad_scale where given, never written. All spans of one index share a dtype and an element order;
  // max_exp_avg_sqs is null unless amsgrad.
  void (*adam_step)(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* exp_avgs,
      const TensorSpan* exp_avg_sqs, const TensorSpan* max_exp_avg_sqs, const double* steps, int64_t count,
      const AdamStep* hyper);

  // One fused SGD step of every tensor, torch's CPU fused kernel's arithmetic, the gradients only read as
  // adam_step's; momentum_buffers is null without momentum.
  void (*sgd_step)(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* momentum_buffers, int64_t count,
      const SgdStep* hyper);

  // One fused Adagrad step of every tensor, torch's CPU fused kernel's arithmetic (steps[i]: tensor i's step
  // count, already counted up), the gradients only read as adam_step's.
  void (*adagrad_step)(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* state_sums,
      const double* steps, int64_t count, const AdagradStep* hyper);

  // Per-sample clipping's second pass (DP-SGD): for each parameter, summed = sum over b of factors[b] *
  // rows[b] (accumulated in float32, float64 for Float64, in sample order; plus summed's old value with
  // accumulate, added last), and where grad is given, grad = (summed as stored + noise_std * normal) /
  // divisor. With no rows and accumulate, summed is only read (grad = its noisy copy; -0.0 stays -0.0).
  // Each element is computed by one thread in a fixed order, so the results do not depend on the thread count.
  void (*per_sample_accumulate)(const PerSampleParam* params, int64_t count, const PerSampleStep* step);

  // Points the library's threaded kernels at the process's pool of helper threads (item_pool.h), the loader's,
  // which the parameter walk uses too; until then they use a pool of the library's own.
  void (*share_item_pool)(ItemPool& (*pool_of_process)());
};

}  // namespace torchclip::cpu

// Each kernel library exports exactly this symbol.
extern "C" const torchclip::cpu::KernelTable* torchclip_cpu_kernel_table();
