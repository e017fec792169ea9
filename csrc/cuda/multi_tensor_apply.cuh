// Multi-tensor apply: one kernel launch walks many tensors, each cut into fixed chunks of kChunk
// elements, one thread block per chunk (NVIDIA apex's design). What a block needs to find its chunk,
// the tensors' addresses, sizes and dtypes and the block -> (tensor, chunk) map, travels in a table
// passed by value as the kernel's parameter: no host buffer, no copy, nothing a CUDA graph replay
// would read again. A list with more tensors or chunks than one table holds is walked by several
// launches in stream order; a tensor cut by a launch boundary continues in the next table.
//
// Sizes are int64 throughout (apex's int limits a tensor to 2^31 elements); only the chunk number
// within one tensor is int32, which caps a tensor at 2^31 chunks (1.4e14 elements).
#pragma once

#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include "cuda/kernels.h"

namespace torchclip::cuda {

// 512 threads x 128 elements: long enough per block that the block's fixed costs (the table lookup,
// the final tree reduction) are small, short enough that a 25M-element tensor still makes 380 blocks.
constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;

// The table's capacity, chosen to stay under the 4 KiB of kernel parameters every CUDA version and
// architecture accepts (3,264 bytes, leaving room for each kernel's own arguments).
constexpr int kMaxTensors = 64;
constexpr int kMaxBlocks = 256;

struct LaunchTable {
  void* data[kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t slot_base[kMaxTensors];  // the first of the tensor's partial-sum slots; -1 for one-chunk tensors
  int32_t index[kMaxTensors];      // the tensor's position in the op's list (DeviceSpan::index)
  uint8_t dtype[kMaxTensors];      // a DType
  uint8_t block_tensor[kMaxBlocks];
  int32_t block_chunk[kMaxBlocks];
};
static_assert(sizeof(LaunchTable) <= 3328, "LaunchTable must leave room within the 4 KiB kernel parameter limit");
static_assert(kMaxTensors <= 256, "block_tensor is a uint8_t");

__host__ __device__ constexpr int64_t chunk_count(int64_t numel) {
  return (numel + kChunk - 1) / kChunk;
}

// Fills tables with every chunk of every span, in list order, and calls launch(table, blocks) for each
// full table and for the last one. The slots of multi-chunk spans are numbered in the same order as
// norm_slot_count counts them.
template <typename Launch>
void multi_tensor_apply(const DeviceSpan* spans, int64_t count, Launch&& launch) {
  LaunchTable table;
  int tensors = 0;
  int blocks = 0;
  int64_t slot = 0;
  for (int64_t k = 0; k < count; ++k) {
    const DeviceSpan& span = spans[k];
    const int64_t chunks = chunk_count(span.numel);
    if (chunks == 0) {
      continue;
    }
    TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "torchclip: a tensor of ", span.numel,
        " elements is beyond the CUDA kernels' limit of 2^31 chunks of ", kChunk);
    int t = tensors++;
    table.data[t] = span.data;
    table.numel[t] = span.numel;
    table.slot_base[t] = chunks > 1 ? slot : -1;
    table.index[t] = span.index;
    table.dtype[t] = static_cast<uint8_t>(span.dtype);
    if (chunks > 1) {
      slot += chunks;
    }
    for (int64_t c = 0; c < chunks; ++c) {
      table.block_tensor[blocks] = static_cast<uint8_t>(t);
      table.block_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c + 1 == chunks;
      if (blocks == kMaxBlocks || (last_chunk && tensors == kMaxTensors)) {
        launch(table, blocks);
        blocks = 0;
        tensors = 0;
        if (!last_chunk) {
          // The rest of this tensor goes into the next table, as its first entry.
          table.data[0] = table.data[t];
          table.numel[0] = table.numel[t];
          table.slot_base[0] = table.slot_base[t];
          table.index[0] = table.index[t];
          table.dtype[0] = table.dtype[t];
          t = 0;
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) {
    launch(table, blocks);
  }
}

// ---- device side -------------------------------------------------------------------------------

// Storage types: 16-bit floats are moved as raw bits and converted explicitly (torch builds with
// __CUDA_NO_HALF_OPERATORS__, and explicit conversions make the rounding visible).
struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

// The type arithmetic runs in: float32 for 16/32-bit storage (as torch's opmath), float64 for float64.
template <typename S>
struct OpMath {
  using type = float;
};
template <>
struct OpMath<double> {
  using type = double;
};

__device__ __forceinline__ float widen(Half x) {
  return __half2float(__ushort_as_half(x.bits));
}
__device__ __forceinline__ float widen(BFloat16 x) {
  return __bfloat162float(__ushort_as_bfloat16(x.bits));
}
__device__ __forceinline__ float widen(float x) {
  return x;
}
__device__ __forceinline__ double widen(double x) {
  return x;
}

// Round-to-nearest-even into the storage type, NaN kept NaN.
__device__ __forceinline__ void store(Half& out, float v) {
  out.bits = __half_as_ushort(__float2half_rn(v));
}
__device__ __forceinline__ void store(BFloat16& out, float v) {
  out.bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ void store(float& out, float v) {
  out = v;
}
__device__ __forceinline__ void store(double& out, double v) {
  out = v;
}

// Calls f(dtype tag) with a null pointer of the storage type of `dtype`; the whole block takes the
// same branch (one tensor, one dtype per block), so there is no divergence.
template <typename F>
__device__ __forceinline__ void dispatch_storage(uint8_t dtype, F&& f) {
  switch (static_cast<DType>(dtype)) {
    case DType::Float16:
      f(static_cast<Half*>(nullptr));
      break;
    case DType::BFloat16:
      f(static_cast<BFloat16*>(nullptr));
      break;
    case DType::Float32:
      f(static_cast<float*>(nullptr));
      break;
    case DType::Float64:
      f(static_cast<double*>(nullptr));
      break;
  }
}

// The block's threads call f(value) on every element of x[0, n), value widened to OpMath. Aligned
// data (the common case: the caching allocator returns 512-byte aligned blocks and every chunk starts
// a multiple of 16 bytes after the tensor's start) is read 16 bytes per thread and load; anything else
// element by element. Which thread sees which element is fixed by n and the alignment alone, so a
// reduction over the values is deterministic.
template <typename S, typename F>
__device__ __forceinline__ void read_elements(const S* x, int64_t n, F&& f) {
  constexpr int kPack = 16 / sizeof(S);
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const int64_t packs = n / kPack;
    const uint4* p = reinterpret_cast<const uint4*>(x);
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      const uint4 raw = __ldg(p + i);
      S values[kPack];
      memcpy(values, &raw, sizeof(raw));
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        f(widen(values[j]));
      }
    }
    done = packs * kPack;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    f(widen(x[i]));
  }
}

// x[i] = f(x[i]) for every element of x[0, n), in OpMath, one read and one write per element.
template <typename S, typename F>
__device__ __forceinline__ void update_elements(S* x, int64_t n, F&& f) {
  constexpr int kPack = 16 / sizeof(S);
  int64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const int64_t packs = n / kPack;
    uint4* p = reinterpret_cast<uint4*>(x);
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < packs; i += blockDim.x) {
      uint4 raw = p[i];
      S values[kPack];
      memcpy(values, &raw, sizeof(raw));
#pragma unroll
      for (int j = 0; j < kPack; ++j) {
        store(values[j], f(widen(values[j])));
      }
      memcpy(&raw, values, sizeof(raw));
      p[i] = raw;
    }
    done = packs * kPack;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) {
    store(x[i], f(widen(x[i])));
  }
}

// __shfl_down_sync for any trivially copyable T, word by word.
template <typename T>
__device__ __forceinline__ T shuffle_down(const T& value, int offset) {
  static_assert(sizeof(T) % 4 == 0, "shuffled in 32-bit words");
  unsigned words[sizeof(T) / 4];
  memcpy(words, &value, sizeof(T));
#pragma unroll
  for (int w = 0; w < static_cast<int>(sizeof(T) / 4); ++w) {
    words[w] = __shfl_down_sync(0xffffffffu, words[w], offset);
  }
  T out;
  memcpy(&out, words, sizeof(T));
  return out;
}

// One shared array per value type (not per combine function: every lambda is a type of its own, and
// an array per instantiation would add up past the 48 KiB of static shared memory).
template <typename T>
__device__ __forceinline__ T* warp_results() {
  __shared__ T results[32];
  return results;
}

// Reduces one value per thread of a kN-thread block with `combine`, by a fixed tree (shuffles within
// each warp, then across the warps' results): the same inputs give the same bits whatever the
// scheduling. Every thread gets the result. T must be a trivially constructible aggregate (it passes
// through shared memory); lanes outside the tree's inputs only ever feed lanes whose result is unused.
template <int kN, typename T, typename Combine>
__device__ __forceinline__ T block_reduce(T value, Combine&& combine) {
  constexpr int kWarps = kN / 32;
  static_assert(kN % 32 == 0 && (kWarps & (kWarps - 1)) == 0 && kWarps <= 32, "a power-of-two number of warps");
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value = combine(value, shuffle_down(value, offset));
  }
  T* results = warp_results<T>();
  if (lane == 0) {
    results[warp] = value;
  }
  __syncthreads();
  if (warp == 0) {
    value = results[lane % kWarps];
#pragma unroll
    for (int offset = kWarps / 2; offset > 0; offset /= 2) {
      value = combine(value, shuffle_down(value, offset));
    }
    if (lane == 0) {
      results[0] = value;
    }
  }
  __syncthreads();
  const T result = results[0];
  __syncthreads();  // before a later call in the same kernel writes `results` again
  return result;
}

}  // namespace torchclip::cuda
