// Fused optimizer steps on CUDA that read each gradient once and never write it (adam_step_, sgd_step_): torch's
// fused CUDA kernels (torch 2.11's fused_adam_utils.cuh and FusedSgdKernel.cu) write every gradient back divided
// by grad_scale, which a folded clip hands them, 2-6 reads of the gradients in all on GPT-2 and ResNet-50.
//
// The arithmetic is torch 2.11's, operation for operation, in the opmath type (float32 for 16/32-bit storage,
// float64 for float64), each rounding spelled out with the _rn intrinsics so that no contraction is left to the
// compiler. Scalars are rounded to the opmath type as torch rounds them, and the bias corrections are powf of
// the step count, once per block. torch's build does not contract every path alike (its float32 Adam rounds
// the weight-decay product before the add where no grad_scale is given, and fuses the two where one is, as
// here), so the results are torch's within a rounding, not always its bits (bench/cuda_step_bits.py counts).
//
// Each block takes one chunk of one tensor (the multi-tensor table of multi_tensor_apply.cuh, with a pointer per
// stream) and returns at once when *found_inf is 1, as torch's blocks do: nothing is written then.
#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "cuda/multi_tensor_apply.cuh"

namespace torchclip::cuda {
namespace {

// A launch's tensors, each with its streams (param, grad, then the step's state) and its step count.
struct StepTable {
  static constexpr int capacity = 48;
  void* streams[kStepStreams][capacity];
  const float* steps[capacity];  // (null for SGD)
  int64_t numel[capacity];
  int32_t first_block[capacity];
  int32_t first_chunk[capacity];
  uint8_t dtype[capacity];
  int32_t tensors;
};
static_assert(sizeof(StepTable) <= 4096 - 256, "StepTable must fit the 4 KiB kernel parameter limit with the scalars");

// The operations in the opmath type (float or double), each rounded once.
template <typename Op>
__device__ __forceinline__ Op fma_rn(Op a, Op b, Op c) {
  if constexpr (std::is_same_v<Op, float>) {
    return __fmaf_rn(a, b, c);
  } else {
    return __fma_rn(a, b, c);
  }
}
template <typename Op>
__device__ __forceinline__ Op mul_rn(Op a, Op b) {
  if constexpr (std::is_same_v<Op, float>) {
    return __fmul_rn(a, b);
  } else {
    return __dmul_rn(a, b);
  }
}
template <typename Op>
__device__ __forceinline__ Op div_rn(Op a, Op b) {
  if constexpr (std::is_same_v<Op, float>) {
    return __fdiv_rn(a, b);
  } else {
    return __ddiv_rn(a, b);
  }
}
template <typename Op>
__device__ __forceinline__ Op add_rn(Op a, Op b) {
  if constexpr (std::is_same_v<Op, float>) {
    return __fadd_rn(a, b);
  } else {
    return __dadd_rn(a, b);
  }
}
template <typename Op>
__device__ __forceinline__ Op sqrt_rn(Op a) {
  if constexpr (std::is_same_v<Op, float>) {
    return __fsqrt_rn(a);
  } else {
    return __dsqrt_rn(a);
  }
}

// The gradient as both steps start from it: divided by grad_scale (where given), negated (maximize).
template <typename Op>
__device__ __forceinline__ Op unscaled(Op g, const float* grad_scale, bool maximize) {
  if (grad_scale != nullptr) {
    g = div_rn(g, static_cast<Op>(*grad_scale));
  }
  return maximize ? -g : g;
}

template <typename S>
__device__ void adam_chunk(S* param, const S* grad, S* exp_avg, S* exp_avg_sq, S* max_exp_avg_sq, int64_t n, float step,
    const AdamScalars& s) {
  using Op = typename OpMath<S>::type;
  const Op lr = static_cast<Op>(s.lr), beta1 = static_cast<Op>(s.beta1), beta2 = static_cast<Op>(s.beta2);
  const Op weight_decay = static_cast<Op>(s.weight_decay), eps = static_cast<Op>(s.eps);
  const Op bias_correction1 = add_rn(Op(1), -pow(beta1, static_cast<Op>(step)));
  const Op bias_correction2_sqrt = sqrt_rn(add_rn(Op(1), -pow(beta2, static_cast<Op>(step))));
  const Op step_size = div_rn(lr, bias_correction1);
  const Op decay_factor = mul_rn(lr, weight_decay);  // (AdamW)
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    Op p = widen(param[i]);
    Op g = unscaled(static_cast<Op>(widen(grad[i])), s.grad_scale, s.maximize);
    if (s.weight_decay != 0.0) {
      if (s.decoupled_weight_decay) {
        p = fma_rn(-decay_factor, p, p);
      } else {
        g = fma_rn(p, weight_decay, g);
      }
    }
    const Op m = fma_rn(beta1, static_cast<Op>(widen(exp_avg[i])), fma_rn(-beta1, g, g));
    const Op squared = mul_rn(g, g);
    const Op v = fma_rn(beta2, static_cast<Op>(widen(exp_avg_sq[i])), fma_rn(-beta2, squared, squared));
    Op second = v;
    if (s.amsgrad) {
      const Op largest = widen(max_exp_avg_sq[i]);
      second = largest < v ? v : largest;  // (a compare and select, as torch's std::max compiles)
      store(max_exp_avg_sq[i], second);
    }
    const Op denom = add_rn(div_rn(sqrt_rn(second), bias_correction2_sqrt), eps);
    p = add_rn(p, -div_rn(mul_rn(step_size, m), denom));
    store(param[i], p);
    store(exp_avg[i], m);
    store(exp_avg_sq[i], v);
  }
}

template <typename S>
__device__ void sgd_chunk(S* param, const S* grad, S* momentum_buffer, int64_t n, const SgdScalars& s) {
  using Op = typename OpMath<S>::type;
  const Op lr = static_cast<Op>(s.lr), weight_decay = static_cast<Op>(s.weight_decay);
  const Op momentum = static_cast<Op>(s.momentum), kept = add_rn(Op(1), -static_cast<Op>(s.dampening));
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const Op p = widen(param[i]);
    Op g = unscaled(static_cast<Op>(widen(grad[i])), s.grad_scale, s.maximize);
    if (s.weight_decay != 0.0) {
      g = fma_rn(weight_decay, p, g);
    }
    if (momentum_buffer != nullptr) {
      const Op buffer =
          s.is_first_step ? g : fma_rn(kept, g, mul_rn(momentum, static_cast<Op>(widen(momentum_buffer[i]))));
      store(momentum_buffer[i], buffer);
      g = s.nesterov ? fma_rn(momentum, buffer, g) : buffer;
    }
    store(param[i], fma_rn(-lr, g, p));
  }
}

// A block's chunk of its tensor: each stream's pointer to it (null for a stream the step has none of), and its
// length.
template <typename S>
struct Streams {
  __device__ Streams(const StepTable& table, const BlockWork& work) {
    const int64_t begin = work.chunk * kChunk;
    const int64_t numel = table.numel[work.t];
    n = numel - begin < kChunk ? numel - begin : kChunk;
    for (int stream = 0; stream < kStepStreams; ++stream) {
      void* const data = table.streams[stream][work.t];
      at[stream] = data == nullptr ? nullptr : static_cast<S*>(data) + begin;
    }
  }
  __device__ S* operator[](int stream) const { return at[stream]; }
  S* at[kStepStreams];
  int64_t n;
};

__device__ __forceinline__ bool skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf == 1.0f;
}

__global__ void __launch_bounds__(kThreads) adam_kernel(const __grid_constant__ StepTable table, AdamScalars s) {
  if (skipped(s.found_inf)) {
    return;
  }
  const BlockWork work = block_work(table);
  const float step = *table.steps[work.t];
  dispatch_storage(table.dtype[work.t], [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    const Streams<S> at(table, work);
    adam_chunk<S>(at[0], at[1], at[2], at[3], at[4], at.n, step, s);
  });
}

__global__ void __launch_bounds__(kThreads) sgd_kernel(const __grid_constant__ StepTable table, SgdScalars s) {
  if (skipped(s.found_inf)) {
    return;
  }
  const BlockWork work = block_work(table);
  dispatch_storage(table.dtype[work.t], [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    const Streams<S> at(table, work);
    sgd_chunk<S>(at[0], at[1], at[2], at.n, s);
  });
}

// Fills StepTables with every chunk of every tensor, in order, and calls launch(table, blocks) for each full
// table and the last one (fill_tables' walk, for several streams a tensor).
template <typename Launch>
void step_tables(const StepTensor* tensors, int64_t count, const Launch& launch) {
  StepTable table;
  table.tensors = 0;
  int64_t blocks = 0;
  for (int64_t k = 0; k < count; ++k) {
    const StepTensor& tensor = tensors[k];
    const int64_t chunks = chunk_count(tensor.numel);
    TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "torchclip: a tensor of ", tensor.numel,
        " elements is beyond the CUDA kernels' limit of 2^31 chunks of ", kChunk);
    for (int64_t first = 0; first < chunks;) {
      const int64_t take = std::min(chunks - first, kMaxBlocksPerLaunch - blocks);
      const int t = table.tensors++;
      for (int stream = 0; stream < kStepStreams; ++stream) {
        table.streams[stream][t] = tensor.streams[stream];
      }
      table.steps[t] = tensor.step;
      table.numel[t] = tensor.numel;
      table.first_block[t] = static_cast<int32_t>(blocks);
      table.first_chunk[t] = static_cast<int32_t>(first);
      table.dtype[t] = static_cast<uint8_t>(tensor.dtype);
      blocks += take;
      first += take;
      if (table.tensors == StepTable::capacity || blocks == kMaxBlocksPerLaunch) {
        launch(table, static_cast<int>(blocks));
        table.tensors = 0;
        blocks = 0;
      }
    }
  }
  if (blocks > 0) {
    launch(table, static_cast<int>(blocks));
  }
}

}  // namespace

void adam_step(const StepTensor* tensors, int64_t count, const AdamScalars& scalars, cudaStream_t stream) {
  step_tables(tensors, count, [&](const StepTable& table, int blocks) {
    adam_kernel<<<blocks, kThreads, 0, stream>>>(table, scalars);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void sgd_step(const StepTensor* tensors, int64_t count, const SgdScalars& scalars, cudaStream_t stream) {
  step_tables(tensors, count, [&](const StepTable& table, int blocks) {
    sgd_kernel<<<blocks, kThreads, 0, stream>>>(table, scalars);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace torchclip::cuda
