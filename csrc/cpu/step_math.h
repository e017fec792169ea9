// The arithmetic the fused optimizer steps share (adam_kernel.cpp, sgd_kernel.cpp, adagrad_kernel.cpp):
// torch's CPU fused kernels' multiply-add, square root and vector loads in the opmath type. Included only by
// per-ISA kernel sources: everything here has internal linkage, compiled once per instruction set.
#pragma once

#include <cmath>

#include "multi_tensor.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

// a * b + c rounded once where the instruction set has FMA, as torch's CPU kernels are compiled: their
// vectors' fmadd and the products GCC contracts into their sums. Every multiply-add of a step goes
// through here, so no contraction is left to the compiler and the results match torch's bit for bit
// (tests/test_adam_step.py, tests/test_sgd_adagrad_step.py).
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

// The gradient as torch's fused steps start from it: divided by grad_scale (where scaled), negated (maximize),
// and with weight_decay * param added (coupled weight decay, where decay), in that order.
//
// The division stays one, though on Adagrad (whose square root and division already queue on the divider) a
// folded clip's grad_scale costs: 1.053 reads added on 24 x 1M float32, 0.998 with a multiply by the reciprocal,
// which is not torch's rounding. What rounds as the division does cost more than it saved (bench/compare_builds.py
// --step, twelve pairs): widening to float64 times the float64 reciprocal (exact for every float32 pair) 1.57; a
// reciprocal and one residual correction (exact while every value is normal) with a per-vector range check, 1.32.
template <typename V>
inline V step_gradient(V g, V p, bool scaled, V grad_scale, bool maximize, bool decay, V weight_decay) {
  if (scaled) {
    g = g / grad_scale;
  }
  if (maximize) {
    g = g * splat<V>(-1);
  }
  if (decay) {
    g = fused_multiply_add(p, weight_decay, g);
  }
  return g;
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

// A step over n elements of several streams (param first): whole vectors in place, then the tail
// through the same vector code in zero-padded blocks whose padded lanes are discarded. `blocks(ptrs, n)`
// steps n elements at the pointers; null pointers (streams a step does not use) stay null; streams[1] is
// the gradient, only read.
template <typename T, int kStreams, typename Blocks>
inline void step_with_tail(T* const (&streams)[kStreams], int64_t n, const Blocks& blocks) {
  constexpr int64_t kWidth = Lanes<T>::kWidth;
  const int64_t whole = n - n % kWidth;
  blocks(streams, whole);
  const int64_t rest = n - whole;
  if (rest == 0) {
    return;
  }
  alignas(64) T tail[kStreams][kWidth];
  T* padded[kStreams];
  for (int s = 0; s < kStreams; ++s) {
    padded[s] = streams[s] ? tail[s] : nullptr;
    if (streams[s]) {
      load_padded<kWidth>(tail[s], streams[s] + whole, rest, T(0));
    }
  }
  blocks(padded, kWidth);
  for (int s = 0; s < kStreams; ++s) {
    if (streams[s] && s != 1) {
      store_first<kWidth>(streams[s] + whole, tail[s], rest);
    }
  }
}

// Every tensor's step, its pieces across the threads: for a piece of tensor i, stored as T, each list's span
// at the piece (a null list: a stream the step does not use) goes to step_with_tail with
// make_blocks(i, T* tag), which returns what steps n elements at given pointers (the tensor's coefficients
// computed once per piece). lists[0] are the parameters, lists[1] the gradients (only read).
template <int kStreams, typename MakeBlocks>
inline void step_every_tensor(const TensorSpan* const (&lists)[kStreams], int64_t count,
    const MakeBlocks& make_blocks) {
  const ChunkPlan plan = plan_chunks(lists[0], count);
  parallel_for_pieces(plan, lists[0], [&](const Piece& piece) {
    const int64_t i = piece.tensor;
    dispatch_dtype(lists[0][i].dtype, [&](auto* typed) {
      using T = std::remove_pointer_t<decltype(typed)>;
      T* streams[kStreams];
      for (int s = 0; s < kStreams; ++s) {
        streams[s] = lists[s] ? static_cast<T*>(lists[s][i].data) + piece.begin : nullptr;
      }
      step_with_tail(streams, piece.end - piece.begin, make_blocks(i, typed));
    });
  });
}

}  // namespace
}  // namespace torchclip::cpu
