// Declarations of the per-ISA kernels; each kernel library defines them and exports them only
// through its KernelTable (kernel_library.cpp).
#pragma once

#include "kernel_table.h"

namespace torchclip::cpu {

void tensor_norms(const TensorSpan* spans, int64_t count, NormOrder order, double* norms);
void exact_norms(const TensorSpan* spans, int64_t count, NormKind kind, double* norms, ExactSum* total,
    int32_t* total_flags);
void scale(const TensorSpan* spans, int64_t count, const double* scales);
void clamp(const TensorSpan* spans, int64_t count, double lo, double hi);
void unitwise_clip(const TensorSpan* weights, const TensorSpan* grads, int64_t count, NormOrder order,
    double clip_factor, double eps);
void adam_step(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* exp_avgs,
    const TensorSpan* exp_avg_sqs, const TensorSpan* max_exp_avg_sqs, const double* steps, int64_t count,
    const AdamStep* hyper);
void sgd_step(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* momentum_buffers, int64_t count,
    const SgdStep* hyper);
void adagrad_step(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* state_sums, const double* steps,
    int64_t count, const AdagradStep* hyper);
void per_sample_accumulate(const PerSampleParam* params, int64_t count, const PerSampleStep* step);

}  // namespace torchclip::cpu
