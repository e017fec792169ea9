// Fused optimizer steps on CUDA that read each gradient once and never write it (adam_step_, sgd_step_): torch's
// fused CUDA kernels (torch 2.11's fused_adam_utils.cuh and FusedSgdKernel.cu) write every gradient back divided
// by grad_scale, which a folded clip hands them, 2-6 reads of the gradients in all on GPT-2 and ResNet-50.
//
// The arithmetic is torch 2.11's, operation for operation, in the opmath type (float32 for 16/32-bit storage,
// float64 for float64), each rounding spelled out with the _rn intrinsics so that no contraction is left to the
// compiler. Scalars are rounded to the opmath type as torch rounds them, and the bias corrections are powf of
// the step count, once per block. torch's build does not contract every path alike: where grad_scale is given
// (a folded clip always gives it) no element differed from torch 2.11's on an H200, in any option or dtype;
// without it its Adam with coupled weight decay and no AMSGrad rounds the product before the add, and its SGD
// with momentum and maximize fuses the momentum product (bench/cuda_step_bits.py counts).
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

// A block's chunk of its tensor: each stream's pointer to it (null for a stream the step has none of), and its
// length.
template <typename S>
struct Streams {
  __device__ Streams(const StepTable& table, const BlockWork& work) {
    const int64_t begin = work.chunk * kChunk;
    const int64_t numel = table.numel[work.t];
    n = numel - begin < kChunk ? numel - begin : kChunk;
    aligned = true;
    for (int stream = 0; stream < kStepStreams; ++stream) {
      void* const data = table.streams[stream][work.t];
      at[stream] = data == nullptr ? nullptr : static_cast<S*>(data) + begin;
      aligned = aligned && (reinterpret_cast<uintptr_t>(at[stream]) & 15) == 0;
    }
  }
  S* at[kStepStreams];
  int64_t n;
  bool aligned;  // every stream's chunk starts on 16 bytes (null counts as aligned)
};

// Calls element(v) for every index of the chunk, v[stream] the stream's value there (a stream the step has none
// of reads as 0 and is not written), and writes back every stream but the gradient (stream 1), which is only
// read. Where every stream is aligned (the caching allocator's blocks; chunks start at multiples of 16 bytes),
// each thread moves 16 bytes a stream at a time, as torch's fused kernels do; the rest element by element.
template <typename S, typename Element>
__device__ __forceinline__ void step_elements(const Streams<S>& at, Element&& element) {
  constexpr int kPack = 16 / sizeof(S);
  int64_t done = 0;
  if (at.aligned) {
    const int64_t packs = at.n / kPack;
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      S values[kStepStreams][kPack] = {};
#pragma unroll
      for (int stream = 0; stream < kStepStreams; ++stream) {
        if (at.at[stream] != nullptr) {
          const uint4* pack = reinterpret_cast<const uint4*>(at.at[stream]) + i;
          const uint4 raw = stream == 1 ? __ldg(pack) : *pack;
          memcpy(values[stream], &raw, sizeof(raw));
        }
      }
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        S v[kStepStreams];
#pragma unroll
        for (int stream = 0; stream < kStepStreams; ++stream) {
          v[stream] = values[stream][j];
        }
        element(v);
#pragma unroll
        for (int stream = 0; stream < kStepStreams; ++stream) {
          values[stream][j] = v[stream];
        }
      }
#pragma unroll
      for (int stream = 0; stream < kStepStreams; ++stream) {
        if (stream != 1 && at.at[stream] != nullptr) {
          uint4 raw;
          memcpy(&raw, values[stream], sizeof(raw));
          reinterpret_cast<uint4*>(at.at[stream])[i] = raw;
        }
      }
    }
    done = packs * kPack;
  }
  for (int64_t i = done + threadIdx.x; i < at.n; i += blockDim.x) {
    S v[kStepStreams] = {};
#pragma unroll
    for (int stream = 0; stream < kStepStreams; ++stream) {
      if (at.at[stream] != nullptr) {
        v[stream] = at.at[stream][i];
      }
    }
    element(v);
#pragma unroll
    for (int stream = 0; stream < kStepStreams; ++stream) {
      if (stream != 1 && at.at[stream] != nullptr) {
        at.at[stream][i] = v[stream];
      }
    }
  }
}

template <typename S>
__device__ void adam_chunk(const Streams<S>& at, float step, const AdamScalars& s) {
  using Op = typename OpMath<S>::type;
  const Op lr = static_cast<Op>(s.lr), beta1 = static_cast<Op>(s.beta1), beta2 = static_cast<Op>(s.beta2);
  const Op weight_decay = static_cast<Op>(s.weight_decay), eps = static_cast<Op>(s.eps);
  const Op bias_correction1 = add_rn(Op(1), -pow(beta1, static_cast<Op>(step)));
  const Op bias_correction2_sqrt = sqrt_rn(add_rn(Op(1), -pow(beta2, static_cast<Op>(step))));
  const Op step_size = div_rn(lr, bias_correction1);
  const Op decay_factor = mul_rn(lr, weight_decay);  // (AdamW)
  // v: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq
  step_elements(at, [&](S* v) {
    Op p = widen(v[0]);
    Op g = unscaled(static_cast<Op>(widen(v[1])), s.grad_scale, s.maximize);
    if (s.weight_decay != 0.0) {
      if (s.decoupled_weight_decay) {
        p = fma_rn(-decay_factor, p, p);
      } else {
        g = fma_rn(p, weight_decay, g);
      }
    }
    const Op m = fma_rn(beta1, static_cast<Op>(widen(v[2])), fma_rn(-beta1, g, g));
    const Op squared = mul_rn(g, g);
    const Op second_moment = fma_rn(beta2, static_cast<Op>(widen(v[3])), fma_rn(-beta2, squared, squared));
    Op second = second_moment;
    if (s.amsgrad) {
      const Op largest = widen(v[4]);
      second = largest < second_moment ? second_moment : largest;  // (a compare and select, as torch's std::max)
      store(v[4], second);
    }
    const Op denom = add_rn(div_rn(sqrt_rn(second), bias_correction2_sqrt), eps);
    p = add_rn(p, -div_rn(mul_rn(step_size, m), denom));
    store(v[0], p);
    store(v[2], m);
    store(v[3], second_moment);
  });
}

template <typename S>
__device__ void sgd_chunk(const Streams<S>& at, const SgdScalars& s) {
  using Op = typename OpMath<S>::type;
  const Op lr = static_cast<Op>(s.lr), weight_decay = static_cast<Op>(s.weight_decay);
  const Op momentum = static_cast<Op>(s.momentum), kept = add_rn(Op(1), -static_cast<Op>(s.dampening));
  const bool has_buffer = at.at[2] != nullptr;
  // v: param, grad, momentum_buffer
  step_elements(at, [&](S* v) {
    const Op p = widen(v[0]);
    Op g = unscaled(static_cast<Op>(widen(v[1])), s.grad_scale, s.maximize);
    if (s.weight_decay != 0.0) {
      g = fma_rn(weight_decay, p, g);
    }
    if (has_buffer) {
      const Op buffer = s.is_first_step ? g : fma_rn(kept, g, mul_rn(momentum, static_cast<Op>(widen(v[2]))));
      store(v[2], buffer);
      g = s.nesterov ? fma_rn(momentum, buffer, g) : buffer;
    }
    store(v[0], fma_rn(-lr, g, p));
  });
}

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
    adam_chunk<S>(Streams<S>(table, work), step, s);
  });
}

__global__ void __launch_bounds__(kThreads) sgd_kernel(const __grid_constant__ StepTable table, SgdScalars s) {
  if (skipped(s.found_inf)) {
    return;
  }
  const BlockWork work = block_work(table);
  dispatch_storage(table.dtype[work.t], [&](auto* tag) {
    using S = std::remove_pointer_t<decltype(tag)>;
    sgd_chunk<S>(Streams<S>(table, work), s);
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
