// Multi-tensor apply: one kernel launch walks many tensors, each cut into fixed chunks of kChunk
// elements, one thread block per chunk (NVIDIA apex's design). What a block needs to find its chunk,
// the tensors' addresses, sizes and dtypes and the block each tensor's chunks start at, travels in a
// table passed by value as the kernel's parameter: no host buffer, no copy, nothing a CUDA graph replay
// would read again. A block finds its tensor by a binary search of the table (uniform across the
// block: constant-cache broadcasts), so a table's size bounds its tensors, never its blocks. A list
// with more tensors than one table holds is walked by several launches in stream order.
//
// Sizes are int64 throughout (apex's int limits a tensor to 2^31 elements); only the chunk number
// within one tensor is int32, which caps a tensor at 2^31 chunks (1.4e14 elements).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cuda/kernels.h"

namespace torchclip::cuda {

// 512 threads x 128 elements: long enough per block that the block's fixed costs (the table lookup,
// the final tree reduction) are small, short enough that a 25M-element tensor still makes 380 blocks.
constexpr int kThreads = 512;
constexpr int64_t kChunk = 65536;

// A launch's blocks; the grid's x dimension takes up to 2^31 - 1.
constexpr int64_t kMaxBlocksPerLaunch = std::numeric_limits<int32_t>::max();

template <int kCapacity>
struct LaunchTable {
  static constexpr int capacity = kCapacity;
  void* data[kCapacity];
  int64_t numel[kCapacity];
  int64_t slot_base[kCapacity];    // the first of the tensor's partial-sum slots; -1 for one-chunk tensors
  int32_t first_block[kCapacity];  // the launch's block that takes the entry's first chunk; ascending
  int32_t first_chunk[kCapacity];  // that chunk (not 0 for a tensor continued from the previous launch)
  int32_t index[kCapacity];        // the tensor's position in the op's list (DeviceSpan::index)
  uint8_t dtype[kCapacity];        // a DType
  int32_t tensors;
};

// Tables for the two limits on kernel parameters: 4 KiB on every CUDA version and GPU, 32 KiB with
// CUDA 12.1+ on Volta and newer. On 10,000 x 100 (H100) 64-tensor tables took 157 launches per
// kernel; the large takes 12, and clip_grad_norm_'s host time fell 1.85 -> 1.01 ms. Each leaves 256
// bytes for the kernels' own arguments.
using SmallTable = LaunchTable<100>;
using LargeTable = LaunchTable<864>;
static_assert(sizeof(SmallTable) <= 4096 - 256, "SmallTable must fit the 4 KiB kernel parameter limit");
static_assert(sizeof(LargeTable) <= 32764 - 256, "LargeTable must fit the 32 KiB kernel parameter limit");

__host__ __device__ constexpr int64_t chunk_count(int64_t numel) {
  return (numel + kChunk - 1) / kChunk;
}

// Whether LargeTable kernels were compiled: ptxas refuses parameters over 4 KiB for any target below
// sm_70, so an architecture list that reaches back to Maxwell or Pascal builds small tables only.
// (nvcc defines __CUDA_ARCH_LIST__, every target of the compilation, in the host pass too.)
#if CUDART_VERSION >= 12010 && defined(__CUDA_ARCH_LIST__)
constexpr int kTargetArchs[] = {__CUDA_ARCH_LIST__};
constexpr bool every_target_at_least(int arch) {
  for (const int target : kTargetArchs) {
    if (target < arch) {
      return false;
    }
  }
  return true;
}
constexpr bool kLargeTablesBuilt = every_target_at_least(700);
#else
constexpr bool kLargeTablesBuilt = false;
#endif

// Whether the current device takes a LargeTable: the kernels built, a 12.1+ driver (minor-version
// compatibility runs 12.x builds on 12.0 drivers) and compute capability 7.0+.
inline bool large_tables_allowed() {
#if CUDART_VERSION >= 12010
  constexpr int kCachedDevices = 64;
  static std::atomic<int8_t> allowed[kCachedDevices] = {};  // 0 unknown, 1 no, 2 yes
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device < kCachedDevices && allowed[device].load(std::memory_order_relaxed) != 0) {
    return allowed[device].load(std::memory_order_relaxed) == 2;
  }
  int major = 0;
  int driver = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDriverGetVersion(&driver));
  const bool allows = major >= 7 && driver >= 12010;
  if (device < kCachedDevices) {
    allowed[device].store(allows ? 2 : 1, std::memory_order_relaxed);
  }
  return allows;
#else
  return false;
#endif
}

// Fills tables with every chunk of every span, in list order, and calls launch(table, blocks) for each
// table that is full (of tensors, or of a launch's blocks) and for the last one. The slots of
// multi-chunk spans are numbered in the same order as norm_slot_count counts them.
template <typename Table, typename Launch>
void fill_tables(const DeviceSpan* spans, int64_t count, Launch& launch) {
  Table table;
  table.tensors = 0;
  int64_t blocks = 0;
  int64_t slot = 0;
  for (int64_t k = 0; k < count; ++k) {
    const DeviceSpan& span = spans[k];
    const int64_t chunks = chunk_count(span.numel);
    TORCH_CHECK(chunks <= std::numeric_limits<int32_t>::max(), "torchclip: a tensor of ", span.numel,
        " elements is beyond the CUDA kernels' limit of 2^31 chunks of ", kChunk);
    const int64_t slot_base = chunks > 1 ? slot : -1;
    slot += chunks > 1 ? chunks : 0;
    for (int64_t first = 0; first < chunks;) {
      const int64_t take = std::min(chunks - first, kMaxBlocksPerLaunch - blocks);
      const int t = table.tensors++;
      table.data[t] = span.data;
      table.numel[t] = span.numel;
      table.slot_base[t] = slot_base;
      table.first_block[t] = static_cast<int32_t>(blocks);
      table.first_chunk[t] = static_cast<int32_t>(first);
      table.index[t] = span.index;
      table.dtype[t] = static_cast<uint8_t>(span.dtype);
      blocks += take;
      first += take;
      if (table.tensors == Table::capacity || blocks == kMaxBlocksPerLaunch) {
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

// launch(table, blocks) is generic over the table type: lists that fit a SmallTable keep the smaller
// parameter copy per launch.
template <typename Launch>
void multi_tensor_apply(const DeviceSpan* spans, int64_t count, Launch&& launch) {
  if constexpr (kLargeTablesBuilt) {  // (a discarded branch instantiates no LargeTable kernel)
    if (count > SmallTable::capacity && large_tables_allowed()) {
      fill_tables<LargeTable>(spans, count, launch);
      return;
    }
  }
  fill_tables<SmallTable>(spans, count, launch);
}

// ---- device side -------------------------------------------------------------------------------

// The block's table entry and chunk: the last entry whose first block is at most blockIdx.x. Every
// thread reads the same addresses, so each step of the search is one constant-cache broadcast.
struct BlockWork {
  int t;
  int64_t chunk;
};

template <typename Table>
__device__ __forceinline__ BlockWork block_work(const Table& table) {
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  int lo = 0;
  int hi = table.tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {lo, static_cast<int64_t>(table.first_chunk[lo]) + (block - table.first_block[lo])};
}

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
