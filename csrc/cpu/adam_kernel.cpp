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
#include "step_math.h"

namespace torchclip::cpu {
namespace {

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

template <typename T, bool kDecoupled>
void step_blocks(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, T* max_exp_avg_sq, int64_t n, const AdamStep& h,
    const Coefficients<typename Lanes<T>::Opmath>& c) {
  using L = Lanes<T>;
  using V = typename L::V;
  const bool lerp_from_exp_avg = std::fabs(c.lerp_weight) < 0.5;  // torch's lerp: the side nearer the weight
  const V lerp_coefficient = splat<V>(lerp_from_exp_avg ? c.lerp_weight : c.lerp_weight - 1);
  for (int64_t i = 0; i < n; i += L::kWidth) {
    V p = L::load(param + i);
    const V g = step_gradient(L::load(grad + i), p, h.grad_scale != nullptr, splat<V>(c.inverse_scale_divisor),
        h.maximize, !kDecoupled && h.weight_decay != 0, splat<V>(c.weight_decay));
    if (kDecoupled && h.weight_decay != 0) {
      p = p * splat<V>(c.decay_factor);
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

}  // namespace

void adam_step(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* exp_avgs,
    const TensorSpan* exp_avg_sqs, const TensorSpan* max_exp_avg_sqs, const double* steps, int64_t count,
    const AdamStep* hyper) {
  const AdamStep& h = *hyper;
  const TensorSpan* const lists[] = {params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs};
  step_every_tensor(lists, count, [&](int64_t i, auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const auto c = coefficients<typename Lanes<T>::Opmath>(h, steps[i]);
    return [&h, c](T* const(&at)[5], int64_t n) {
      if (h.decoupled_weight_decay) {
        step_blocks<T, true>(at[0], at[1], at[2], at[3], at[4], n, h, c);
      } else {
        step_blocks<T, false>(at[0], at[1], at[2], at[3], at[4], n, h, c);
      }
    };
  });
}

}  // namespace torchclip::cpu
