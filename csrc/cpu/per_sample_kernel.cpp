// Per-sample clipping's second pass (DP-SGD, compiled once per instruction set): each parameter's
// per-sample gradients weighted by their clip factors and summed over the batch, reading every per-sample
// gradient once in its own dtype (no cast copy, where Opacus casts all of them to the parameter's dtype
// first), with the noise and the division by the expected batch size folded into the same pass.
//
// Work is cut into units of one parameter's elements [begin, begin + kUnit), taken by threads one at a time;
// a unit is summed strip by strip, each strip's sums held in registers while the B rows' segments stream
// through, and each element is summed by one thread in sample order, so the result is the same on any thread
// count.
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "gaussian.h"
#include "kernels.h"

namespace torchclip::cpu {
namespace {

// 2,048 elements: its float32 sums (8 KiB; 16 KiB of float64) and noise stay in L1, each row's segment is 4-8
// KiB long (a page or two: what a hardware prefetcher follows), and a multiple of the noise group, so every
// unit's noise starts at a group.
constexpr int64_t kUnit = 2048;
static_assert(kUnit % kNoiseGroup == 0, "units start at a noise group");

template <typename T>
f32v load_first(const T* p, int64_t count) {
  if (count == kBlock) {
    return load_f32(p);
  }
  alignas(64) T block[kBlock];
  load_padded<kBlock>(block, p, count, T(0.0f));
  return load_f32(block);
}

template <typename T>
void store_first_f32(T* p, int64_t count, f32v v) {
  if (count == kBlock) {
    store_f32(p, v);
    return;
  }
  alignas(64) T block[kBlock];
  store_f32(block, v);
  store_first<kBlock>(p, block, count);
}

// v as the storage type T holds it (rounded to nearest even), back in float32.
template <typename T>
f32v as_stored(f32v v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T block[kBlock];
    store_f32(block, v);
    return load_f32(block);
  }
}

// Elements summed at once, in as many vector accumulators held in registers: a running sum kept in L1 instead
// cost a load and a store per vector per sample, which made the bfloat16 sums compute-bound (1.56 reads
// where the norms pass took 0.99, GPT-2 width 256, B = 32, 2 threads).
constexpr int64_t kStripVectors = 8;
constexpr int64_t kStrip = kStripVectors * kBlock;

// sums[0, n) = sum over b of factors[b] * rows[b][begin, begin + n), in float32, sample by sample.
template <typename Row>
void sum_rows(float* sums, int64_t n, const PerSampleParam& p, int64_t begin, int64_t batch) {
  int64_t i = 0;
  for (; i + kStrip <= n; i += kStrip) {
    f32v strip[kStripVectors] = {};
    for (int64_t b = 0; b < batch; ++b) {
      const f32v factor = splat<f32v>(static_cast<float>(p.factors[b]));
      const Row* row = static_cast<const Row*>(p.rows[b]) + begin + i;
#pragma GCC unroll 8
      for (int64_t k = 0; k < kStripVectors; ++k) {
        strip[k] = fused_multiply_add(factor, load_f32(row + k * kBlock), strip[k]);
      }
    }
#pragma GCC unroll 8
    for (int64_t k = 0; k < kStripVectors; ++k) {
      store_f32(sums + i + k * kBlock, strip[k]);
    }
  }
  // The last partial strip: vector by vector through L1, then the tail in a padded vector.
  std::fill(sums + i, sums + kUnit, 0.0f);
  const int64_t whole = n - n % kBlock;
  for (int64_t b = 0; b < batch && i < n; ++b) {
    const f32v factor = splat<f32v>(static_cast<float>(p.factors[b]));
    const Row* row = static_cast<const Row*>(p.rows[b]) + begin;
    for (int64_t j = i; j < whole; j += kBlock) {
      store_f32(sums + j, fused_multiply_add(factor, load_f32(row + j), load_f32(sums + j)));
    }
    if (whole < n) {
      store_f32(sums + whole, fused_multiply_add(factor, load_first(row + whole, n - whole), load_f32(sums + whole)));
    }
  }
}

// summed[begin, begin + n) = sums (+ its old value), and grad = (summed + noise_std * noise) / divisor.
template <typename T>
void write_sums(const float* sums, const float* noise, int64_t n, const PerSampleParam& p, int64_t begin,
    const PerSampleStep& step) {
  T* summed = static_cast<T*>(p.summed) + begin;
  T* grad = p.grad == nullptr ? nullptr : static_cast<T*>(p.grad) + begin;
  const f32v noise_std = splat<f32v>(static_cast<float>(step.noise_std));
  const f32v divisor = splat<f32v>(static_cast<float>(step.divisor));
  const bool summed_unchanged = step.batch == 0 && step.accumulate;
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t count = std::min(kBlock, n - i);
    f32v total = load_f32(sums + i);
    if (step.accumulate) {
      total = load_first(summed + i, count) + total;
    }
    if (!summed_unchanged) {
      store_first_f32(summed + i, count, total);
    }
    if (grad != nullptr) {
      f32v noisy = as_stored<T>(total);
      if (noise != nullptr) {
        noisy = fused_multiply_add(noise_std, load_f32(noise + i), noisy);
      }
      store_first_f32(grad + i, count, noisy / divisor);
    }
  }
}

// The float64 unit: float64 rows into float64 sums; the noise is drawn in float32 and widened.
void unit_f64(const PerSampleParam& p, int64_t begin, int64_t n, const PerSampleStep& step, const float* noise) {
  alignas(64) double sums[kUnit] = {};
  const int64_t whole = n - n % kBlock64;
  for (int64_t b = 0; b < step.batch; ++b) {
    const f64v factor = splat<f64v>(p.factors[b]);
    const double* row = static_cast<const double*>(p.rows[b]) + begin;
    for (int64_t i = 0; i < whole; i += kBlock64) {
      store_f64(sums + i, fused_multiply_add(factor, load_f64(row + i), load_f64(sums + i)));
    }
    if (whole < n) {
      alignas(64) double tail[kBlock64];
      load_padded<kBlock64>(tail, row + whole, n - whole, 0.0);
      store_f64(sums + whole, fused_multiply_add(factor, load_f64(tail), load_f64(sums + whole)));
    }
  }
  double* summed = static_cast<double*>(p.summed) + begin;
  double* grad = static_cast<double*>(p.grad);
  const bool summed_unchanged = step.batch == 0 && step.accumulate;
  for (int64_t i = 0; i < n; ++i) {
    const double total = step.accumulate ? summed[i] + sums[i] : sums[i];
    if (!summed_unchanged) {
      summed[i] = total;
    }
    if (grad != nullptr) {
      const double noisy = noise == nullptr ? total : total + step.noise_std * static_cast<double>(noise[i]);
      grad[begin + i] = noisy / step.divisor;
    }
  }
}

void run_unit(const PerSampleParam& p, uint32_t stream, int64_t begin, const PerSampleStep& step) {
  const int64_t n = std::min(kUnit, p.numel - begin);
  alignas(64) float noise_buffer[kUnit];
  const float* noise = nullptr;
  if (p.grad != nullptr && step.noise_std != 0.0) {
    standard_normals(noise_buffer, begin / kNoiseGroup, (n + kNoiseGroup - 1) / kNoiseGroup, step.seed, stream);
    noise = noise_buffer;
  }
  if (p.dtype == DType::Float64) {
    unit_f64(p, begin, n, step, noise);
    return;
  }
  alignas(64) float sums[kUnit];
  dispatch_dtype(p.row_dtype, [&](auto* row_type) {
    using Row = std::remove_pointer_t<decltype(row_type)>;
    if constexpr (!std::is_same_v<Row, double>) {  // (float64 rows come with float64 parameters only)
      sum_rows<Row>(sums, n, p, begin, step.batch);
    }
  });
  dispatch_dtype(p.dtype, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    if constexpr (!std::is_same_v<T, double>) {
      write_sums<T>(sums, noise, n, p, begin, step);
    }
  });
}

}  // namespace

void per_sample_accumulate(const PerSampleParam* params, int64_t count, const PerSampleStep* step) {
  std::vector<int64_t> first_unit(count + 1, 0);
  for (int64_t j = 0; j < count; ++j) {
    first_unit[j + 1] = first_unit[j] + (params[j].numel + kUnit - 1) / kUnit;
  }
  // Threads when every one has kMinElementsPerThread of the per-sample gradients to read.
  int64_t elements = 0;
  for (int64_t j = 0; j < count; ++j) {
    elements += params[j].numel * step->batch;
  }
  const int64_t threads =
      std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, elements / kMinElementsPerThread));
  parallel_for_each_item(first_unit[count], threads, [&](int64_t u) {
    const int64_t j = std::upper_bound(first_unit.begin(), first_unit.end(), u) - first_unit.begin() - 1;
    run_unit(params[j], static_cast<uint32_t>(j), (u - first_unit[j]) * kUnit, *step);
  });
}

}  // namespace torchclip::cpu
