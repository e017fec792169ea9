// Gaussian noise from a counter-based generator, for differentially private steps (per_sample_kernel.cpp).
//
// Each normal is a pure function of (seed, stream, element index): Philox4x32-10 (Salmon et al., "Parallel
// random numbers: as easy as 1, 2, 3", SC'11; the generator torch and JAX use on GPUs) turns a 128-bit
// counter and a 64-bit key into four 32-bit words, and Box-Muller turns two words into two normals. So the
// noise of an element does not depend on which thread computes it, how the work is cut, or the vector
// width: a run repeats bit for bit from its seed on any thread count (opacus #692 reports runs that cannot).
//
// Layout: elements come in groups of 64. Group g uses the 16 counters (16 g + l, stream, 0), l = 0..15 (the
// 64-bit count in words 0 and 1). Counter l's words 0 and 1 make the normals of elements 64 g + l and
// 64 g + 16 + l, its words 2 and 3 those of 64 g + 32 + l and 64 g + 48 + l: each of the four outputs is 16
// consecutive elements, stored without a shuffle at every vector width.
//
// Box-Muller in float32: u1 = (w0 + 1/2) / 2^32 in (0, 1], w0 rounded to float32, keeps w0's bits where they
// matter (near 0), so the largest normal is sqrt(-2 ln 2^-33) = 6.76 (a uniform from 24 bits would stop at
// 5.77); the angle comes from w1's top 24 bits. The logarithm and the sine and cosine are polynomials accurate to a
// few float32 ulps (the tests compare them against a float64 evaluation of the same words). Every product
// that meets a sum goes through `rounded`, so no instruction set fuses it into an FMA: the normals are the
// same bits on every capability, not only on every thread count. Included only by per-ISA kernel sources:
// internal linkage, compiled once per instruction set.
#pragma once

#include <cstdint>

#include "step_math.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

// a * b rounded to float32 before anything adds to it: the empty asm hides the product from GCC, which
// would otherwise contract it with the sum into an FMA on AVX2 and AVX-512 (-ffp-contract=fast) but not on
// the baseline, and the last bit would depend on the machine.
inline f32v rounded(f32v a, f32v b) {
  f32v product = a * b;
  asm("" : "+v"(product));
  return product;
}

// high:low = a * m, lane by lane (the 32 x 32 -> 64-bit products Philox is built on). With AVX2 and AVX-512 both
// halves come from the two 64-bit products of the even and odd lanes, shuffled into place by shifts and blends:
// a separate 32-bit low multiply (vpmulld) is two slow micro-ops more.
inline void multiply_wide(u32v a, uint32_t m, u32v& high, u32v& low) {
#if defined(__AVX512F__)
  const __m512i factor = _mm512_set1_epi32(static_cast<int>(m));
  const __m512i even = _mm512_mul_epu32((__m512i)a, factor);  // lanes 2i: 64-bit products
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64((__m512i)a, 32), factor);
  high = (u32v)_mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  low = (u32v)_mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
#elif defined(__AVX2__)
  const __m256i factor = _mm256_set1_epi32(static_cast<int>(m));
  const __m256i even = _mm256_mul_epu32((__m256i)a, factor);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64((__m256i)a, 32), factor);
  high = (u32v)_mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  low = (u32v)_mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
#else
  low = a * m;
  for (int i = 0; i < kBlock; ++i) {
    high[i] = static_cast<uint32_t>((static_cast<uint64_t>(a[i]) * m) >> 32);
  }
#endif
}

struct PhiloxWords {
  u32v w0, w1, w2, w3;
};

// Philox4x32-10 of the counters (c0, c1, c2, c3) under the key (k0, k1).
inline PhiloxWords philox4x32_10(u32v c0, u32v c1, u32v c2, u32v c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    u32v high0, low0, high1, low1;
    multiply_wide(c0, 0xD2511F53u, high0, low0);
    multiply_wide(c2, 0xCD9E8D57u, high1, low1);
    const u32v next0 = high1 ^ c1 ^ k0;
    const u32v next2 = high0 ^ c3 ^ k1;
    c0 = next0;
    c1 = low1;
    c2 = next2;
    c3 = low0;
    k0 += 0x9E3779B9u;  // the key schedule's Weyl increments
    k1 += 0xBB67AE85u;
  }
  return {c0, c1, c2, c3};
}

// ln(u) for u in [2^-33, 1] (normal, positive): u = m 2^e with m in [sqrt(1/2), sqrt(2)), and
// ln(m) = 2 atanh(t), t = (m - 1) / (m + 1), |t| <= 0.172, whose odd series to t^9 is within 2e-9.
inline f32v natural_log(f32v u) {
  const i32v bits = (i32v)u;
  i32v exponent = (bits >> 23) - 127;
  f32v m = (f32v)((bits & 0x007FFFFF) | 0x3F800000);  // [1, 2)
  const i32v above = m > splat<f32v>(1.41421356f);   // lanes all-ones (-1) or 0
  m = above ? m * 0.5f : m;
  exponent -= above;
  const f32v t = (m - 1.0f) / (m + 1.0f);
  const f32v t2 = t * t;
  f32v series = 1.0f / 7 + rounded(t2, splat<f32v>(1.0f / 9));
  series = 1.0f / 5 + rounded(t2, series);
  series = 1.0f / 3 + rounded(t2, series);
  series = 1.0f + rounded(t2, series);
  return rounded(__builtin_convertvector(exponent, f32v), splat<f32v>(0.693147181f)) + rounded(t + t, series);
}

// sin and cos of 2 pi v for v in [0, 1): v = q / 4 + r exactly, |r| <= 1/8, then Taylor series to x^9 and
// x^10 at x = 2 pi r in [-pi/4, pi/4] (within 2e-9), rotated by q quarter turns.
inline void sin_cos_of_turns(f32v v, f32v& sine, f32v& cosine) {
  const i32v quarter = __builtin_convertvector(v * 4.0f + 0.5f, i32v);  // round to nearest, v >= 0
  const f32v r = v - __builtin_convertvector(quarter, f32v) * 0.25f;  // exact (Sterbenz)
  const f32v x = r * 6.28318531f;
  const f32v x2 = x * x;
  f32v s = -1.0f / 5040 + rounded(x2, splat<f32v>(1.0f / 362880));
  s = 1.0f / 120 + rounded(x2, s);
  s = -1.0f / 6 + rounded(x2, s);
  s = x + rounded(x * x2, s);
  f32v c = -1.0f / 720 + rounded(x2, 1.0f / 40320 + rounded(x2, splat<f32v>(-1.0f / 3628800)));
  c = 1.0f / 24 + rounded(x2, c);
  c = -0.5f + rounded(x2, c);
  c = 1.0f + rounded(x2, c);
  const i32v q = quarter & 3;
  const i32v odd = (q & 1) != 0;
  const i32v sine_negative = q >= 2;
  const i32v cosine_negative = (q == 1) | (q == 2);
  const f32v sine_base = odd ? c : s;
  const f32v cosine_base = odd ? s : c;
  sine = sine_negative ? -sine_base : sine_base;
  cosine = cosine_negative ? -cosine_base : cosine_base;
}

// Two standard normals from two words of one counter.
inline void box_muller(u32v radius_word, u32v angle_word, f32v& first, f32v& second) {
  // (Products by powers of two are exact: fused or not, the same bits.)
  const f32v u = __builtin_convertvector(radius_word, f32v) * 0x1p-32f + 0x1p-33f;
  const f32v radius = square_root(-2.0f * natural_log(u));
  const f32v turns = __builtin_convertvector((i32v)(angle_word >> 8), f32v) * 0x1p-24f;
  f32v sine, cosine;
  sin_cos_of_turns(turns, sine, cosine);
  first = radius * cosine;
  second = radius * sine;
}

constexpr int64_t kNoiseGroup = 64;

// out[0, 64 n_groups) = the standard normals of elements [64 first_group, 64 (first_group + n_groups)) of
// `stream` under `seed` (the layout above).
inline void standard_normals(float* out, int64_t first_group, int64_t n_groups, uint64_t seed, uint32_t stream) {
  static_assert(16 % kBlock == 0, "a group's 16 counters fill whole vectors");
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  u32v lane;
  for (int i = 0; i < kBlock; ++i) {
    lane[i] = static_cast<uint32_t>(i);
  }
  for (int64_t g = 0; g < n_groups; ++g) {
    float* group = out + g * kNoiseGroup;
    for (int64_t part = 0; part < 16; part += kBlock) {
      const uint64_t first_counter = static_cast<uint64_t>(first_group + g) * 16 + static_cast<uint64_t>(part);
      // (16 g + l never carries into the high word within a group: 16 g is a multiple of 16.)
      const u32v c0 = static_cast<uint32_t>(first_counter) + lane;
      const u32v c1 = splat<u32v>(static_cast<uint32_t>(first_counter >> 32));
      const PhiloxWords words = philox4x32_10(c0, c1, splat<u32v>(stream), splat<u32v>(0u), k0, k1);
      f32v z0, z1, z2, z3;
      box_muller(words.w0, words.w1, z0, z1);
      box_muller(words.w2, words.w3, z2, z3);
      store_f32(group + part, z0);
      store_f32(group + 16 + part, z1);
      store_f32(group + 32 + part, z2);
      store_f32(group + 48 + part, z3);
    }
  }
}

}  // namespace
}  // namespace torchclip::cpu
