// Per-sample clipping's second pass on CUDA: each parameter's per-sample gradients weighted by their clip factors
// and summed over the batch, read once in their own dtype, with the noise and the division folded in.
// cpu/per_sample_kernel.cpp is the specification, and cpu/gaussian.h the noise's: the same counters, the same
// Philox4x32-10, the same Box-Muller polynomials, every product rounded before it meets a sum (__fmul_rn and
// __fadd_rn: nvcc would contract them into FMAs), so the normals are meant to be the CPU's bits.
//
// A thread owns counters: counter 16 g + l of a parameter gives the normals of its elements 64 g + l + 16 k,
// k = 0..3, and the thread sums those four elements over the batch (across a warp, each k reads two runs of 16
// consecutive elements). blockIdx.y is the parameter.
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/kernels.h"

namespace torchclip::cuda {
namespace {

constexpr int kPerSampleThreads = 256;
constexpr int64_t kMaxParamsPerLaunch = 65535;  // gridDim.y
constexpr int64_t kMaxBlocksX = 4096;

template <typename T>
__device__ __forceinline__ float widened(T v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return v;
  }
}

__device__ __forceinline__ float load_float(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::Float16:
      return __half2float(static_cast<const __half*>(p)[i]);
    case DType::BFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// v rounded to `dtype` and stored at p[i]; returns the value stored, back in float32.
__device__ __forceinline__ float store_float(void* p, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::Float16: {
      const __half h = __float2half_rn(v);
      static_cast<__half*>(p)[i] = h;
      return __half2float(h);
    }
    case DType::BFloat16: {
      const __nv_bfloat16 h = __float2bfloat16_rn(v);
      static_cast<__nv_bfloat16*>(p)[i] = h;
      return __bfloat162float(h);
    }
    default:
      static_cast<float*>(p)[i] = v;
      return v;
  }
}

__device__ __forceinline__ float as_stored(DType dtype, float v) {
  switch (dtype) {
    case DType::Float16:
      return __half2float(__float2half_rn(v));
    case DType::BFloat16:
      return __bfloat162float(__float2bfloat16_rn(v));
    default:
      return v;
  }
}

struct PhiloxWords {
  uint32_t w0, w1, w2, w3;
};

__device__ PhiloxWords philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t high0 = __umulhi(0xD2511F53u, c0), low0 = 0xD2511F53u * c0;
    const uint32_t high1 = __umulhi(0xCD9E8D57u, c2), low1 = 0xCD9E8D57u * c2;
    const uint32_t next0 = high1 ^ c1 ^ k0, next2 = high0 ^ c3 ^ k1;
    c0 = next0;
    c1 = low1;
    c2 = next2;
    c3 = low0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {c0, c1, c2, c3};
}

__device__ float natural_log(float u) {
  const int bits = __float_as_int(u);
  int exponent = (bits >> 23) - 127;
  float m = __int_as_float((bits & 0x007FFFFF) | 0x3F800000);
  if (m > 1.41421356f) {
    m = __fmul_rn(m, 0.5f);
    exponent += 1;
  }
  const float t = __fdiv_rn(__fadd_rn(m, -1.0f), __fadd_rn(m, 1.0f));
  const float t2 = __fmul_rn(t, t);
  float series = __fadd_rn(1.0f / 7, __fmul_rn(t2, 1.0f / 9));
  series = __fadd_rn(1.0f / 5, __fmul_rn(t2, series));
  series = __fadd_rn(1.0f / 3, __fmul_rn(t2, series));
  series = __fadd_rn(1.0f, __fmul_rn(t2, series));
  return __fadd_rn(__fmul_rn(static_cast<float>(exponent), 0.693147181f), __fmul_rn(__fadd_rn(t, t), series));
}

__device__ void sin_cos_of_turns(float v, float& sine, float& cosine) {
  const int quarter = __float2int_rz(__fadd_rn(__fmul_rn(v, 4.0f), 0.5f));
  const float r = __fadd_rn(v, -__fmul_rn(static_cast<float>(quarter), 0.25f));
  const float x = __fmul_rn(r, 6.28318531f);
  const float x2 = __fmul_rn(x, x);
  float s = __fadd_rn(-1.0f / 5040, __fmul_rn(x2, 1.0f / 362880));
  s = __fadd_rn(1.0f / 120, __fmul_rn(x2, s));
  s = __fadd_rn(-1.0f / 6, __fmul_rn(x2, s));
  s = __fadd_rn(x, __fmul_rn(__fmul_rn(x, x2), s));
  float c = __fadd_rn(1.0f / 40320, __fmul_rn(x2, -1.0f / 3628800));
  c = __fadd_rn(-1.0f / 720, __fmul_rn(x2, c));
  c = __fadd_rn(1.0f / 24, __fmul_rn(x2, c));
  c = __fadd_rn(-0.5f, __fmul_rn(x2, c));
  c = __fadd_rn(1.0f, __fmul_rn(x2, c));
  const int q = quarter & 3;
  const float sine_base = (q & 1) ? c : s;
  const float cosine_base = (q & 1) ? s : c;
  sine = q >= 2 ? -sine_base : sine_base;
  cosine = (q == 1 || q == 2) ? -cosine_base : cosine_base;
}

__device__ void box_muller(uint32_t radius_word, uint32_t angle_word, float& first, float& second) {
  const float u = __fadd_rn(__fmul_rn(__uint2float_rn(radius_word), 0x1p-32f), 0x1p-33f);
  const float radius = __fsqrt_rn(__fmul_rn(-2.0f, natural_log(u)));
  const float turns = __fmul_rn(static_cast<float>(angle_word >> 8), 0x1p-24f);
  float sine, cosine;
  sin_cos_of_turns(turns, sine, cosine);
  first = __fmul_rn(radius, cosine);
  second = __fmul_rn(radius, sine);
}

// The four normals of counter `unit` (16 g + l) of `stream`: elements 64 g + l + 16 k, k = 0..3.
__device__ void normals_of(int64_t unit, uint32_t stream, uint64_t seed, float (&z)[4]) {
  const auto counter = static_cast<uint64_t>(unit);
  const PhiloxWords words = philox4x32_10(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), stream,
      0u, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  box_muller(words.w0, words.w1, z[0], z[1]);
  box_muller(words.w2, words.w3, z[2], z[3]);
}

template <typename Row>
__device__ void accumulate_unit(const PerSampleParam& p, uint32_t stream, int64_t unit, const PerSampleStep& step) {
  const int64_t base = (unit / 16) * 64 + unit % 16;
  float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t b = 0; b < step.batch; ++b) {
    const float factor = static_cast<float>(p.factors[b]);
    const Row* row = static_cast<const Row*>(p.rows[b]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = base + 16 * k;
      if (i < p.numel) {
        sums[k] = fmaf(factor, widened(row[i]), sums[k]);
      }
    }
  }
  float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (p.grad != nullptr && step.noise_std != 0.0) {
    normals_of(unit, stream, step.seed, z);
  }
  const bool summed_unchanged = step.batch == 0 && step.accumulate;
  const float noise_std = static_cast<float>(step.noise_std), divisor = static_cast<float>(step.divisor);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t i = base + 16 * k;
    if (i >= p.numel) {
      continue;
    }
    const float total = step.accumulate ? __fadd_rn(load_float(p.summed, p.dtype, i), sums[k]) : sums[k];
    const float stored = summed_unchanged ? as_stored(p.dtype, total) : store_float(p.summed, p.dtype, i, total);
    if (p.grad != nullptr) {
      const float noisy = step.noise_std != 0.0 ? fmaf(noise_std, z[k], stored) : stored;
      store_float(p.grad, p.dtype, i, __fdiv_rn(noisy, divisor));
    }
  }
}

// float64 parameters with float64 rows, summed in float64 (the noise drawn in float32 and widened).
__device__ void accumulate_unit_f64(const PerSampleParam& p, uint32_t stream, int64_t unit, const PerSampleStep& step) {
  const int64_t base = (unit / 16) * 64 + unit % 16;
  double sums[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t b = 0; b < step.batch; ++b) {
    const double factor = p.factors[b];
    const double* row = static_cast<const double*>(p.rows[b]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = base + 16 * k;
      if (i < p.numel) {
        sums[k] = fma(factor, row[i], sums[k]);
      }
    }
  }
  float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (p.grad != nullptr && step.noise_std != 0.0) {
    normals_of(unit, stream, step.seed, z);
  }
  auto* summed = static_cast<double*>(p.summed);
  auto* grad = static_cast<double*>(p.grad);
  const bool summed_unchanged = step.batch == 0 && step.accumulate;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int64_t i = base + 16 * k;
    if (i >= p.numel) {
      continue;
    }
    const double total = step.accumulate ? summed[i] + sums[k] : sums[k];
    if (!summed_unchanged) {
      summed[i] = total;
    }
    if (grad != nullptr) {
      grad[i] = (total + step.noise_std * static_cast<double>(z[k])) / step.divisor;
    }
  }
}

__global__ void per_sample_accumulate_kernel(const PerSampleParam* params, int64_t first_param, PerSampleStep step) {
  const int64_t j = first_param + blockIdx.y;
  const PerSampleParam& p = params[j];
  const int64_t units = (p.numel + 63) / 64 * 16;
  const auto stream = static_cast<uint32_t>(j);
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; unit < units;
      unit += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (p.dtype == DType::Float64) {
      accumulate_unit_f64(p, stream, unit, step);
      continue;
    }
    switch (p.row_dtype) {
      case DType::Float16:
        accumulate_unit<__half>(p, stream, unit, step);
        break;
      case DType::BFloat16:
        accumulate_unit<__nv_bfloat16>(p, stream, unit, step);
        break;
      default:
        accumulate_unit<float>(p, stream, unit, step);
        break;
    }
  }
}

}  // namespace

void per_sample_accumulate(const PerSampleParam* params, int64_t count, int64_t max_numel, const PerSampleStep& step,
    cudaStream_t stream) {
  if (count == 0 || max_numel == 0) {
    return;
  }
  const int64_t units = (max_numel + 63) / 64 * 16;
  const auto blocks_x =
      static_cast<unsigned>(std::min(kMaxBlocksX, (units + kPerSampleThreads - 1) / kPerSampleThreads));
  for (int64_t first = 0; first < count; first += kMaxParamsPerLaunch) {
    const auto blocks_y = static_cast<unsigned>(std::min(kMaxParamsPerLaunch, count - first));
    per_sample_accumulate_kernel<<<dim3(blocks_x, blocks_y), kPerSampleThreads, 0, stream>>>(params, first, step);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace torchclip::cuda
