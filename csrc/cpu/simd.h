// Portable 64-byte vectors for the CPU kernels.
//
// GCC/Clang vector extensions let one source serve every instruction set: this header is compiled
// into each per-ISA kernel library with that library's flags, and the vector types take that ISA's
// native register width. Half-precision conversions use
// the F16C/AVX-512 instructions where the library is built for them and c10's exact scalar conversions
// otherwise, so every path rounds the same way (round to nearest even), which the tests check.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <type_traits>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace torchclip::cpu::simd {

// One native register per vector: 64 bytes with AVX-512, 32 with AVX2, 16 with SSE2. Every
// operation below is then a single instruction (or a short fixed sequence) at every width; wider
// vectors than the ISA has would make GCC lower compares and selects lane by lane.
#if defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX2__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif

typedef float f32v __attribute__((vector_size(kVectorBytes)));
typedef float f32half __attribute__((vector_size(kVectorBytes / 2)));
typedef double f64v __attribute__((vector_size(kVectorBytes)));
typedef int32_t i32v __attribute__((vector_size(kVectorBytes)));
typedef int64_t i64v __attribute__((vector_size(kVectorBytes)));
typedef uint32_t u32v __attribute__((vector_size(kVectorBytes)));
typedef uint64_t u64v __attribute__((vector_size(kVectorBytes)));
typedef uint16_t u16v __attribute__((vector_size(kVectorBytes / 2)));

// Whether this is an Intel CPU, whose hardware prefetchers stop at 4 KiB page boundaries, so that a loop's own asks
// ahead (__builtin_prefetch) pay; on an AMD EPYC (Zen 4) some of the same asks cost time, and 512-bit operations run
// as two 256-bit halves (norm_reduce.h's and exact_norm_kernel.cpp's loops say which, with their figures).
// TORCHCLIP_CPU_VENDOR=intel or =other takes that side's paths on any CPU: each gives the same bits, only its speed
// differs, and the tests run both on whichever machine they have.
inline bool intel_cpu() {
  static const bool intel = [] {
    const char* vendor = std::getenv("TORCHCLIP_CPU_VENDOR");
    const std::string_view chosen = vendor == nullptr ? "" : vendor;
    if (chosen == "intel" || chosen == "other") {
      return chosen == "intel";
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
#else
    return false;
#endif
  }();
  return intel;
}

// Elements per float32 vector (16, 8 or 4); every 16/32-bit kernel walks its data in blocks of this.
constexpr int64_t kBlock = kVectorBytes / 4;
// Elements per float64 vector.
constexpr int64_t kBlock64 = kVectorBytes / 8;

template <typename V>
inline V splat(std::remove_reference_t<decltype(V{}[0])> x) {
  return V{} + x;
}

// Whether any lane of a comparison's result (lanes 0 or all-ones) is set: one test of the whole register, where a
// loop over the lanes compiled to a move and an OR per lane, about 60 instructions for a check of four float64
// vectors (measured on the exact plain run's, then after every block: docs/exact-norms-record.md, "The model rows are
// the kernel's work", has the figures).
template <typename V>
inline bool any_lane(V mask) {
  static_assert(sizeof(V) == kVectorBytes, "a native register");
#if defined(__AVX512F__)
  return _mm512_test_epi64_mask((__m512i)mask, (__m512i)mask) != 0;
#elif defined(__AVX2__)
  return !_mm256_testz_si256((__m256i)mask, (__m256i)mask);
#else
  for (int i = 0; i < static_cast<int>(sizeof(V) / sizeof(mask[0])); ++i) {
    if (mask[i]) {
      return true;
    }
  }
  return false;
#endif
}

// The sum of a float64 vector's lanes, by a fixed pairwise tree (the same order every call).
inline double horizontal_sum(f64v v) {
  constexpr int kLanes = sizeof(f64v) / sizeof(double);
  double lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(lanes));
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) {
      lanes[i] += lanes[i + width];
    }
  }
  return lanes[0];
}

namespace detail {
template <int kShift, typename V, size_t... kLane>
inline V rotated(V v, std::index_sequence<kLane...>) {
  return __builtin_shufflevector(v, v, ((kLane + kShift) % sizeof...(kLane))...);
}
template <int kShift, typename V, typename Op>
inline V folded(V v, Op op) {
  if constexpr (kShift == 0) {
    return v;
  } else {
    constexpr size_t kLanes = sizeof(V) / sizeof(v[0]);
    return folded<kShift / 2>(op(v, rotated<kShift>(v, std::make_index_sequence<kLanes>())), op);
  }
}
}  // namespace detail

// The lanes of v combined by op (max, min: associative and commutative), in log2(lanes) shuffles rather than a
// lane-by-lane loop (64 instructions for the two bounds of a block's 32 16-bit lanes).
template <typename V, typename Op>
inline auto fold_lanes(V v, Op op) {
  return detail::folded<static_cast<int>(sizeof(V) / sizeof(v[0]) / 2)>(v, op)[0];
}

inline f32v abs(f32v v) {
  return (f32v)((u32v)v & 0x7FFFFFFFu);
}
inline f64v abs(f64v v) {
  return (f64v)((u64v)v & 0x7FFFFFFFFFFFFFFFull);
}

// Lanes are 0 or all-ones; a NaN lane compares unequal to itself.
inline i32v is_nan(f32v v) {
  return v != v;
}
inline i64v is_nan(f64v v) {
  return v != v;
}

// max/min that ignore NaN (callers track NaN separately and let it win at the end).
template <typename V>
inline V max_ignoring_nan(V a, V b) {
  return a > b ? a : b;
}
template <typename V>
inline V min_ignoring_nan(V a, V b) {
  return a < b ? a : b;
}

// Widening halves of a float32 vector to float64. Explicit instructions where there are some: GCC 12
// lowers __builtin_convertvector at 512 bits to four 128-bit converts and two inserts.
inline f64v low_half_to_f64(f32v v) {
#if defined(__AVX512F__)
  return (f64v)_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)v));
#elif defined(__AVX2__)
  return (f64v)_mm256_cvtps_pd(_mm256_castps256_ps128((__m256)v));
#else
  f32half half;
  std::memcpy(&half, &v, sizeof(half));
  return __builtin_convertvector(half, f64v);
#endif
}
inline f64v high_half_to_f64(f32v v) {
#if defined(__AVX512F__)
  return (f64v)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)v), 1)));
#elif defined(__AVX2__)
  return (f64v)_mm256_cvtps_pd(_mm256_extractf128_ps((__m256)v, 1));
#else
  f32half half;
  std::memcpy(&half, reinterpret_cast<const char*>(&v) + sizeof(half), sizeof(half));
  return __builtin_convertvector(half, f64v);
#endif
}

// kBlock float32 values at p as two float64 halves, each converted straight from memory: no extract of the high
// half from a register first (a shuffle, on the port the converts also need).
inline void load_f64_halves(const float* p, f64v& low, f64v& high) {
#if defined(__AVX512F__)
  low = (f64v)_mm512_cvtps_pd(_mm256_loadu_ps(p));
  high = (f64v)_mm512_cvtps_pd(_mm256_loadu_ps(p + kBlock / 2));
#elif defined(__AVX2__)
  low = (f64v)_mm256_cvtps_pd(_mm_loadu_ps(p));
  high = (f64v)_mm256_cvtps_pd(_mm_loadu_ps(p + kBlock / 2));
#else
  f32half half;
  std::memcpy(&half, p, sizeof(half));
  low = __builtin_convertvector(half, f64v);
  std::memcpy(&half, p + kBlock / 2, sizeof(half));
  high = __builtin_convertvector(half, f64v);
#endif
}

// ---- kBlock 16-bit patterns, zero-extended to 32-bit lanes and back --------------------------------
// GCC lowers __builtin_convertvector between these widths to a five-instruction shuffle on AVX-512
// (it splits the 512-bit widening) and narrows with vpermt2w; one vpmovzxwd / vpmovdw does each. For
// bfloat16, whose conversions are otherwise shifts, that was most of the work per element.

inline u32v load_u16_widened(const void* p) {
#if defined(__AVX512F__)
  return (u32v)_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
#else
  u16v raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(raw, u32v);
#endif
}

// Stores the low 16 bits of every lane (each lane must hold a value below 2^16).
inline void store_u16_narrowed(void* p, u32v v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)v));
#else
  const u16v narrow = __builtin_convertvector(v, u16v);
  std::memcpy(p, &narrow, sizeof(narrow));
#endif
}

// ---- loads of kBlock elements, widened to float32 -------------------------------------------------

inline f32v load_f32(const float* p) {
  f32v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline f32v load_f32(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widening is a shift, exact for every value.
  return (f32v)(load_u16_widened(p) << 16);
}

// A half-width float32 vector widened to float64.
inline f64v half_to_f64(f32half half) {
#if defined(__AVX512F__)
  return (f64v)_mm512_cvtps_pd((__m256)half);
#elif defined(__AVX2__)
  return (f64v)_mm256_cvtps_pd((__m128)half);
#else
  return __builtin_convertvector(half, f64v);
#endif
}

// The 2 * kBlock bfloat16 values at p (their magnitudes where kMagnitudes) as four float64 vectors: each half of the
// data, read as a half-width vector, split into its even and odd values as float32 (a shift, a mask: two load_f32
// would take two widening loads, on the shuffle port, and two shifts) and widened straight from there, so that no
// convert waits on an extract of a full vector's upper half (load_f64_halves' reason). Only for sums whose order does
// not matter (the exact kernels): the values come out of order.
// The exact norm's plain run, on 2 AMD EPYC cores (Zen 4, AVX-512), where full-width vectors were split and their
// upper halves extracted: 1M values in L3, one thread, 0.106-0.108 -> 0.096-0.098 ns an element; GPT-2 bfloat16's
// exact norm 0.911 (0.894-0.932) of the time on one thread, ResNet-50's 0.916 (0.882-0.936), on two 1.007
// (0.920-1.077) and 0.909 (0.858-0.956) (`TORCHCLIP_EXACT_NORM=1 bench/compare_builds.py`, 10 pairs). AVX2, whose
// extract is cheap, measured as before (one thread 0.997-1.003, two 0.981-0.999, every interval across 1).
template <bool kMagnitudes>
inline void load_f64_interleaved(const c10::BFloat16* p, f64v* wide) {
  typedef uint32_t u32half __attribute__((vector_size(kVectorBytes / 2)));
  for (int half = 0; half < 2; ++half) {
    u32half pairs;
    std::memcpy(&pairs, p + half * kBlock, sizeof(pairs));
    if constexpr (kMagnitudes) {
      pairs &= 0x7FFF7FFFu;
    }
    wide[2 * half] = half_to_f64((f32half)(pairs << 16));
    wide[2 * half + 1] = half_to_f64((f32half)(pairs & 0xFFFF0000u));
  }
}

inline f32v load_f32(const c10::Half* p) {
#if defined(__AVX512F__)
  return (f32v)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  return (f32v)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  f32v v;
  for (int i = 0; i < kBlock; ++i) {
    v[i] = static_cast<float>(p[i]);
  }
  return v;
#endif
}

// ---- stores of kBlock float32 values, rounded to nearest even into the storage type ---------------

inline void store_f32(float* p, f32v v) {
  std::memcpy(p, &v, sizeof(v));
}

inline void store_f32(c10::BFloat16* p, f32v v) {
  // Round to nearest even on the bit pattern; NaN becomes the canonical quiet NaN, as c10 does.
  u32v bits = (u32v)v;
  u32v rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  store_u16_narrowed(p, is_nan(v) ? splat<u32v>(0x7FC0u) : rounded);
}

inline void store_f32(c10::Half* p, f32v v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
#elif defined(__AVX2__) && defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < kBlock; ++i) {
    p[i] = c10::Half(v[i]);
  }
#endif
}

inline f64v load_f64(const double* p) {
  f64v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_f64(double* p, f64v v) {
  std::memcpy(p, &v, sizeof(v));
}

// ---- a span's tail in a padded block -------------------------------------------------------------
// The first `count` (< kLanes) elements of `src` into `block`, the other lanes `fill`, by one masked
// load and one full-width store, and back by one masked store. Copied element by element, the kernel's
// next vector load waited on a failed store forward: half of the clamp kernel's time on 10,000 x 100.
// (Masked lanes are never touched, so neither copy reads or writes past the span.)

template <typename T>
inline auto lane_bits(T value) {
  using Bits = std::conditional_t<sizeof(T) == 8, int64_t, std::conditional_t<sizeof(T) == 4, int32_t, int16_t>>;
  Bits bits;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 masks are vectors: lanes below count are all-ones.
inline __m256i first_lanes32(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256i first_lanes64(int64_t count) {
  return _mm256_cmpgt_epi64(_mm256_set1_epi64x(count), _mm256_setr_epi64x(0, 1, 2, 3));
}
#endif

template <int64_t kLanes, typename T>
inline void load_padded(T* block, const T* src, int64_t count, T fill) {
  [[maybe_unused]] constexpr size_t kBytes = kLanes * sizeof(T);
#if defined(__AVX512F__)
  const unsigned mask = (1u << count) - 1;
  if constexpr (kBytes == 64 && sizeof(T) == 4) {
    _mm512_store_si512(block, _mm512_mask_loadu_epi32(_mm512_set1_epi32(lane_bits(fill)), mask, src));
    return;
  } else if constexpr (kBytes == 64 && sizeof(T) == 8) {
    _mm512_store_si512(block, _mm512_mask_loadu_epi64(_mm512_set1_epi64(lane_bits(fill)), mask, src));
    return;
  } else if constexpr (kBytes == 32 && sizeof(T) == 2) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(block),
        _mm256_mask_loadu_epi16(_mm256_set1_epi16(lane_bits(fill)), mask, src));
    return;
  } else if constexpr (kBytes == 64 && sizeof(T) == 2) {
    _mm512_store_si512(block, _mm512_mask_loadu_epi16(_mm512_set1_epi16(lane_bits(fill)), mask, src));
    return;
  }
#elif defined(__AVX2__)
  if constexpr (kBytes == 32 && sizeof(T) == 4) {
    const __m256i lanes = first_lanes32(count);
    const __m256i loaded = _mm256_maskload_epi32(reinterpret_cast<const int*>(src), lanes);
    _mm256_store_si256(reinterpret_cast<__m256i*>(block),
        _mm256_blendv_epi8(_mm256_set1_epi32(lane_bits(fill)), loaded, lanes));
    return;
  } else if constexpr (kBytes == 32 && sizeof(T) == 8) {
    const __m256i lanes = first_lanes64(count);
    const __m256i loaded = _mm256_maskload_epi64(reinterpret_cast<const long long*>(src), lanes);
    _mm256_store_si256(reinterpret_cast<__m256i*>(block),
        _mm256_blendv_epi8(_mm256_set1_epi64x(lane_bits(fill)), loaded, lanes));
    return;
  }
#endif
  for (int64_t i = 0; i < kLanes; ++i) {  // (16-bit lanes on AVX2, and SSE2: no masked loads)
    block[i] = i < count ? src[i] : fill;
  }
}

template <int64_t kLanes, typename T>
inline void store_first(T* dst, const T* block, int64_t count) {
  [[maybe_unused]] constexpr size_t kBytes = kLanes * sizeof(T);
#if defined(__AVX512F__)
  const unsigned mask = (1u << count) - 1;
  if constexpr (kBytes == 64 && sizeof(T) == 4) {
    _mm512_mask_storeu_epi32(dst, mask, _mm512_load_si512(block));
    return;
  } else if constexpr (kBytes == 64 && sizeof(T) == 8) {
    _mm512_mask_storeu_epi64(dst, mask, _mm512_load_si512(block));
    return;
  } else if constexpr (kBytes == 32 && sizeof(T) == 2) {
    _mm256_mask_storeu_epi16(dst, mask, _mm256_load_si256(reinterpret_cast<const __m256i*>(block)));
    return;
  }
#elif defined(__AVX2__)
  if constexpr (kBytes == 32 && sizeof(T) == 4) {
    _mm256_maskstore_epi32(reinterpret_cast<int*>(dst), first_lanes32(count),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(block)));
    return;
  } else if constexpr (kBytes == 32 && sizeof(T) == 8) {
    _mm256_maskstore_epi64(reinterpret_cast<long long*>(dst), first_lanes64(count),
        _mm256_load_si256(reinterpret_cast<const __m256i*>(block)));
    return;
  }
#endif
  std::memcpy(dst, block, count * sizeof(T));
}

// Runs `body(pointer, count)` over [data, data + n): whole blocks in place, then the tail copied into
// a padded block so the tail takes exactly the vector code path (same rounding, same NaN handling).
// The padding is `fill`, chosen by the caller to be neutral for its operation. `writes` says whether
// the block must be copied back.
template <int64_t kLanes, typename T, typename Body>
inline void for_each_block(T* data, int64_t n, T fill, bool writes, Body&& body) {
  const int64_t whole = n - n % kLanes;
  body(data, whole);
  if (whole == n) {
    return;
  }
  alignas(64) T tail[kLanes];
  load_padded<kLanes>(tail, data + whole, n - whole, fill);
  body(tail, kLanes);
  if (writes) {
    store_first<kLanes>(data + whole, tail, n - whole);
  }
}

}  // namespace torchclip::cpu::simd
