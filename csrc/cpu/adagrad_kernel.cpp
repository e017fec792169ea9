// Adagrad steps over many tensors with the gradient divided by grad_scale as it is read, never written
// back (compiled once per instruction set).
//
// The arithmetic is torch's CPU fused Adagrad kernel's (aten/src/ATen/native/cpu/FusedAdagradKernel.cpp)
// as torch 2.14 has it, operation for operation: float32 opmath for 16/32-bit storage and float64 for
// float64, the sum's multiply-add fused where torch's vectors fuse it, the decayed learning rate in
// float64, every stored value rounded once to its storage type. Only the gradient write-back differs.
#include "kernels.h"
#include "step_math.h"

namespace torchclip::cpu {
namespace {

template <typename Opmath>
struct AdagradCoefficients {
  Opmath grad_scale;  // divided by, or 1
  Opmath weight_decay;
  Opmath eps;
  Opmath decayed_lr;  // lr / (1 + (step - 1) * lr_decay)
};

// n whole vectors of one tensor: param, grad, state sum.
template <typename T>
void adagrad_blocks(T* const (&at)[3], int64_t n, const AdagradStep& h,
    const AdagradCoefficients<typename Lanes<T>::Opmath>& c) {
  using L = Lanes<T>;
  using V = typename L::V;
  T* param = at[0];
  const T* grad = at[1];
  T* state_sum = at[2];
  for (int64_t i = 0; i < n; i += L::kWidth) {
    const V p = L::load(param + i);
    const V g = step_gradient(L::load(grad + i), p, h.grad_scale != nullptr, splat<V>(c.grad_scale), h.maximize,
        h.weight_decay != 0, splat<V>(c.weight_decay));
    const V sum = fused_multiply_add(g, g, L::load(state_sum + i));
    L::store(state_sum + i, sum);
    const V deviation = square_root(sum) + splat<V>(c.eps);
    L::store(param + i, p - splat<V>(c.decayed_lr) * g / deviation);
  }
}

}  // namespace

void adagrad_step(const TensorSpan* params, const TensorSpan* grads, const TensorSpan* state_sums, const double* steps,
    int64_t count, const AdagradStep* hyper) {
  const AdagradStep& h = *hyper;
  const TensorSpan* const lists[] = {params, grads, state_sums};
  step_every_tensor(lists, count, [&](int64_t i, auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    using Opmath = typename Lanes<T>::Opmath;
    const double decayed_lr = h.lr / (1.0 + (steps[i] - 1.0) * h.lr_decay);
    const AdagradCoefficients<Opmath> c{h.grad_scale ? static_cast<Opmath>(*h.grad_scale) : Opmath(1),
        static_cast<Opmath>(h.weight_decay), static_cast<Opmath>(h.eps), static_cast<Opmath>(decayed_lr)};
    return [&h, c](T* const(&at)[3], int64_t n) { adagrad_blocks<T>(at, n, h, c); };
  });
}

}  // namespace torchclip::cpu
