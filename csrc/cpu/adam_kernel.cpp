// Adam and AdamW steps over many tensors with the gradient divided by grad_scale as it is read, never
// written back (compiled once per instruction set).
//
// The arithmetic is torch's CPU fused Adam kernel's (aten/src/ATen/native/cpu/FusedAdamKernel.cpp),
// operation for operation: float32 opmath for 16/32-bit storage and float64 for float64, the lerp of
// exp_avg as one fused multiply-add where torch's vectors have one, bias corrections in float64, and
// every stored state rounded once to its storage type. Only the gradient write-back differs: torch's
// kernel stores grad / grad_scale over the gradient, a fifth stream of writes that cost ~1.5 reads of
// the gradients on a 24 x 1M AdamW step (2 cores), more than the clip's own norm pass.
#include <cmath>
#include <vector>

#include "kernels.h"
#include "multi_tensor.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

// a * b + c rounded once where the instruction set has FMA, as torch's CPU kernel is compiled: its
// vectors' fmadd and the products GCC contracts into their sums. Every multiply-add of the step goes
// through here, so no contraction is left to the compiler and the results match torch's bit for bit
// (checked for every dtype and option in tests/test_adam_step.py).
inline f32v fused_multiply_add(f32v a, f32v b, f32v c) {
#if defined(__AVX512F__)
  return (f32v)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (f32v)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;  // torch's vectors without FMA multiply, then add
#endif
}
inline f64v fused_multiply_add(f64v a, f64v b, f64v c) {
#if defined(__AVX512F__)
  return (f64v)_mm512_fmadd_pd((__m512d)a, (__m512d)b, (__m512d)c);
#elif defined(__FMA__)
  return (f64v)_mm256_fmadd_pd((__m256d)a, (__m256d)b, (__m256d)c);
#else
  return a * b + c;
#endif
}

inline f32v square_root(f32v v) {
#if defined(__AVX512F__)
  return (f32v)_mm512_sqrt_ps((__m512)v);
#elif defined(__AVX2__)
  return (f32v)_mm256_sqrt_ps((__m256)v);
#else
  for (int i = 0; i < kBlock; ++i) {
    v[i] = std::sqrt(v[i]);
  }
  return v;
#endif
}
inline f64v square_root(f64v v) {
#if defined(__AVX512F__)
  return (f64v)_mm512_sqrt_pd((__m512d)v);
#elif defined(__AVX2__)
  return (f64v)_mm256_sqrt_pd((__m256d)v);
#else
  for (int i = 0; i < kBlock64; ++i) {
    v[i] = std::sqrt(v[i]);
  }
  return v;
#endif
}

// torch's vector maximum: NaN in either lane wins.
template <typename V>
inline V maximum(V a, V b) {
  const V larger = a > b ? a : b;
  return (is_nan(a) | is_nan(b)) ? a + b : larger;
}

// The numbers one tensor's step needs, in the precision torch rounds them to before the vector loop.
template <typename Opmath>
struct Coefficients {
  Opmath inverse_scale_divisor;  // grad_scale (divided by), or 1
  Opmath weight_decay;           // Adam: added to the gradient as weight_decay * param
  Opmath decay_factor;           // AdamW: param *= 1 - lr * weight_decay
  Opmath lerp_weight;            // 1 - beta1
  Opmath beta2;
  Opmath one_minus_beta2;
  Opmath bias_correction2_sqrt;
  Opmath eps;
  Opmath negative_step_size;  // -lr / (1 - beta1^step)
};

template <typename Opmath>
Coefficients<Opmath> coefficients(const AdamStep& h, double step) {
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  return {h.grad_scale ? static_cast<Opmath>(*h.grad_scale) : Opmath(1), static_cast<Opmath>(h.weight_decay),
      static_cast<Opmath>(1 - h.lr * h.weight_decay), static_cast<Opmath>(1 - h.beta1), static_cast<Opmath>(h.beta2),
      static_cast<Opmath>(1 - h.beta2), static_cast<Opmath>(std::sqrt(bias_correction2)), static_cast<Opmath>(h.eps),
      static_cast<Opmath>(-(h.lr / bias_correction1))};
}

// Vector loads and stores of one block in the opmath type: float32 for 16/32-bit storage (rounded to
// nearest even on the way back, as torch's convert_from_float), float64 for float64.
template <typename T>
struct Lanes {
  using Opmath = float;
  using V = f32v;
  static constexpr int64_t kWidth = kBlock;
  static V load(const T* p) { return load_f32(p); }
  static void store(T* p, V v) { store_f32(p, v); }
};
template <>
struct Lanes<double> {
  using Opmath = double;
  using V = f64v;
  static constexpr int64_t kWidth = kBlock64;
  static V load(const double* p) { return load_f64(p); }
  static void store(double* p, V v) { store_f64(p, v); }
};

struct Streams {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // null unless amsgrad
};

template <typename T, bool kDecoupled>
void step_blocks(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, T* max_exp_avg_sq, int64_t n, const AdamStep& h,
    const Coefficients<typename Lanes<T>::Opmath>& c) {
  using L = Lanes<T>;
  using V = typename L::V;
  const bool lerp_from_exp_avg = std::fabs(c.lerp_weight) < 0.5;  // torch's lerp: the side nearer the weight
  const V lerp_coefficient = splat<V>(lerp_from_exp_avg ? c.lerp_weight : c.lerp_weight - 1);
  for (int64_t i = 0; i < n; i += L::kWidth) {
    V p = L::load(param + i);
    V g = L::load(grad + i);
    if (h.grad_scale) {
      g = g / splat<V>(c.inverse_scale_divisor);
    }
    if (h.maximize) {
      g = g * splat<V>(-1);
    }
    if (h.weight_decay != 0) {
      if constexpr (kDecoupled) {
        p = p * splat<V>(c.decay_factor);
      } else {
        g = fused_multiply_add(p, splat<V>(c.weight_decay), g);
      }
    }
    V m = L::load(exp_avg + i);
    m = fused_multiply_add(lerp_coefficient, g - m, lerp_from_exp_avg ? m : g);
    const V v = fused_multiply_add(splat<V>(c.one_minus_beta2) * g, g, L::load(exp_avg_sq + i) * splat<V>(c.beta2));
    L::store(exp_avg + i, m);
    L::store(exp_avg_sq + i, v);
    V second_moment = v;
    if (max_exp_avg_sq) {
      second_moment = maximum(L::load(max_exp_avg_sq + i), v);
      L::store(max_exp_avg_sq + i, second_moment);
    }
    const V denominator = square_root(second_moment) / splat<V>(c.bias_correction2_sqrt) + splat<V>(c.eps);
    p = p + splat<V>(c.negative_step_size) * m / denominator;
    L::store(param + i, p);
  }
}

template <typename T, bool kDecoupled>
void step_run(const Streams& s, int64_t n, const AdamStep& h, double step) {
  using L = Lanes<T>;
  const auto c = coefficients<typename L::Opmath>(h, step);
  T* param = static_cast<T*>(s.param);
  const T* grad = static_cast<const T*>(s.grad);
  T* exp_avg = static_cast<T*>(s.exp_avg);
  T* exp_avg_sq = static_cast<T*>(s.exp_avg_sq);
  T* max_exp_avg_sq = static_cast<T*>(s.max_exp_avg_sq);
  const int64_t whole = n - n % L::kWidth;
  step_blocks<T, kDecoupled>(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, whole, h, c);
  const int64_t rest = n - whole;
  if (rest == 0) {
    return;
  }
  // The tail through the same vector code, in zero-padded blocks (the padded lanes are discarded).
  alignas(64) T tail[5][L::kWidth];
  load_padded<L::kWidth>(tail[0], param + whole, rest, T(0));
  load_padded<L::kWidth>(tail[1], grad + whole, rest, T(0));
  load_padded<L::kWidth>(tail[2], exp_avg + whole, rest, T(0));
  load_padded<L::kWidth>(tail[3], exp_avg_sq + whole, rest, T(0));
  if (max_exp_avg_sq) {
    load_padded<L::kWidth>(tail[4], max_exp_avg_sq + whole, rest, T(0));
  }
  step_blocks<T, kDecoupled>(tail[0], tail[1], tail[2], tail[3], max_exp_avg_sq ? tail[4] : nullptr, L::kWidth, h, c);
  store_first<L::kWidth>(param + whole, tail[0], rest);
  store_first<L::kWidth>(exp_avg + whole, tail[2], rest);
  store_first<L::kWidth>(exp_avg_sq + whole, tail[3], rest);
  if (max_exp_avg_sq) {
    store_first<L::kWidth>(max_exp_avg_sq + whole, tail[4], rest);
  }
}

}  // namespace

void adam_step(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* exp_avgs,
    const TensorSpan* exp_avg_sqs, const TensorSpan* max_exp_avg_sqs, const double* steps, int64_t count,
    const AdamStep* hyper) {
  const AdamStep& h = *hyper;
  const ChunkPlan plan = plan_chunks(params, count);
  parallel_for_pieces(plan, params, [&](const Piece& piece) {
    const int64_t i = piece.tensor;
    dispatch_dtype(params[i].dtype, [&](auto* typed) {
      using T = std::remove_pointer_t<decltype(typed)>;
      const auto at = [&](const TensorSpan& span) { return static_cast<T*>(span.data) + piece.begin; };
      const Streams s{at(params[i]), at(grads[i]), at(exp_avgs[i]), at(exp_avg_sqs[i]),
          max_exp_avg_sqs ? at(max_exp_avg_sqs[i]) : nullptr};
      const int64_t n = piece.end - piece.begin;
      if (h.decoupled_weight_decay) {
        step_run<T, true>(s, n, h, steps[i]);
      } else {
        step_run<T, false>(s, n, h, steps[i]);
      }
    });
  });
}

}  // namespace torchclip::cpu
