// SGD steps (momentum, dampening, Nesterov, weight decay, maximize) over many tensors with the gradient
// divided by grad_scale as it is read, never written back (compiled once per instruction set).
//
// The arithmetic is torch's CPU fused SGD kernel's (aten/src/ATen/native/cpu/FusedSGDKernel.cpp) as
// torch 2.14 has it, operation for operation: float32 opmath for 16/32-bit storage and float64 for
// float64, the multiply-adds fused where torch's vectors fuse them, every stored value rounded once to its
// storage type. torch before 2.14 skipped the update of whole 16-bit vectors (pytorch#191763); this
// kernel steps them as 2.14 does. Only the gradient write-back differs: torch stores grad / grad_scale
// over the gradient, a third stream of writes beside the parameter's.
#include "kernels.h"
#include "step_math.h"

namespace torchclip::cpu {
namespace {

// The hyperparameters as torch rounds them before its vector loop.
template <typename Opmath>
struct SgdCoefficients {
  Opmath grad_scale;  // divided by, or 1
  Opmath weight_decay;
  Opmath momentum;
  Opmath one_minus_dampening;
  Opmath negative_lr;
};

// n whole vectors of one tensor: param, grad, momentum buffer (null without momentum).
template <typename T>
void sgd_blocks(T* const (&at)[3], int64_t n, const SgdStep& h, const SgdCoefficients<typename Lanes<T>::Opmath>& c) {
  using L = Lanes<T>;
  using V = typename L::V;
  T* param = at[0];
  const T* grad = at[1];
  T* momentum_buffer = at[2];
  for (int64_t i = 0; i < n; i += L::kWidth) {
    const V p = L::load(param + i);
    V g = step_gradient(L::load(grad + i), p, h.grad_scale != nullptr, splat<V>(c.grad_scale), h.maximize,
        h.weight_decay != 0, splat<V>(c.weight_decay));
    if (momentum_buffer) {
      V b = g;
      if (!h.is_first_step) {
        b = fused_multiply_add(g, splat<V>(c.one_minus_dampening), L::load(momentum_buffer + i) * splat<V>(c.momentum));
      }
      L::store(momentum_buffer + i, b);
      g = h.nesterov ? fused_multiply_add(b, splat<V>(c.momentum), g) : b;
    }
    L::store(param + i, fused_multiply_add(g, splat<V>(c.negative_lr), p));
  }
}

}  // namespace

void sgd_step(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* momentum_buffers, int64_t count,
    const SgdStep* hyper) {
  const SgdStep& h = *hyper;
  const TensorSpan* const lists[] = {params, grads, momentum_buffers};
  step_every_tensor(lists, count, [&](int64_t, auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    using Opmath = typename Lanes<T>::Opmath;
    const SgdCoefficients<Opmath> c{h.grad_scale ? static_cast<Opmath>(*h.grad_scale) : Opmath(1),
        static_cast<Opmath>(h.weight_decay), static_cast<Opmath>(h.momentum), static_cast<Opmath>(1 - h.dampening),
        static_cast<Opmath>(-h.lr)};
    return [&h, c](T* const(&at)[3], int64_t n) { sgd_blocks<T>(at, n, h, c); };
  });
}

}  // namespace torchclip::cpu
