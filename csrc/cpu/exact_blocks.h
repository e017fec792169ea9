// The exact norms' blocks of terms (exact_norm_kernel.cpp's comment has the design): the block and its
// accumulator, a block's terms split over levels of quanta or added one by one, its magnitudes' bounds taken on
// their bit patterns, the range of its terms, and how the blocks are asked for from memory. Included only by
// exact_norm_kernel.cpp: internal linkage, compiled once per instruction set.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kernels.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

constexpr int64_t kExactBlock = 1024;
constexpr int kQuantumBits = 43;  // (add_levels: a block's 2^10 terms of < 2^43 quanta, every partial sum < 2^53)
constexpr int kMaxLevels = 16;    // 43-bit levels: more than 16-bit and 32-bit terms' range needs

struct ExactPartial {
  ExactSum sum;
  bool has_nan = false;
  bool has_inf = false;

  void add(const ExactPartial& other) {
    sum.add(other.sum);
    has_nan |= other.has_nan;
    has_inf |= other.has_inf;
  }
};

template <NormKind kKind, typename T>
void add_terms(const T* x, int64_t n, ExactPartial& out) {
  for (int64_t i = 0; i < n; ++i) {
    double v;
    if constexpr (std::is_same_v<T, double>) {
      v = x[i];
    } else {
      v = static_cast<double>(static_cast<float>(x[i]));
    }
    if (std::isnan(v)) {
      out.has_nan = true;
    } else if (std::isinf(v)) {
      out.has_inf = true;
    } else if constexpr (kKind == NormKind::One) {
      out.sum.add(std::fabs(v));
    } else if constexpr (std::is_same_v<T, double>) {
      out.sum.add_square(v);
    } else {
      out.sum.add(v * v);  // (exact: a 24-bit value's square)
    }
  }
}

// The storage type's mantissa bits after the leading one: a value's last bit weighs 2^(floor(log2|x|) - this)
// or more.
template <typename T>
constexpr int kTrailingBits = std::is_same_v<T, float> ? 23
    : std::is_same_v<T, c10::Half>                     ? 10
                                                       : 7;

// The values of a float32 vector as two float64 halves, magnitudes for p = 1 (squared where used).
template <NormKind kKind>
void halves_of(f32v v, f64v& low, f64v& high) {
  if constexpr (kKind == NormKind::One) {
    v = abs(v);
  }
  low = low_half_to_f64(v);
  high = high_half_to_f64(v);
}

// The kBlock values at x as two float64 halves, magnitudes for p = 1 (squared where used); float32 squares'
// halves converted straight from memory.
template <NormKind kKind, typename T>
void halves_at(const T* x, f64v& low, f64v& high) {
  if constexpr (std::is_same_v<T, float> && kKind == NormKind::Two) {
    load_f64_halves(x, low, high);
  } else {
    halves_of<kKind>(load_f32(x), low, high);
  }
}

// Adds a block's level sums to `out`; a NaN among the terms makes them NaN.
void add_sums(const f64v* sums, int count, ExactPartial& out) {
  double totals[kMaxLevels + 1];
  for (int j = 0; j < count; ++j) {
    totals[j] = horizontal_sum(sums[j]);  // exact: every partial sum is below 2^53 quanta
    if (std::isnan(totals[j])) {
      out.has_nan = true;
      return;
    }
  }
  for (int j = 0; j < count; ++j) {
    out.sum.add(totals[j]);
  }
}

// The terms of `vectors` elements (a multiple of kBlock) split over `levels` quanta 2^(top - 43 j),
// j = 1..levels, and the remainder: each level's sum, then the remainder's, into `out` (all exact when
// every term is a multiple of 2^(top - 43 levels - 44)).
template <NormKind kKind, typename T>
void add_levels(const T* x, int64_t vectors, int top, int levels, ExactPartial& out) {
  f64v rounders[kMaxLevels];
  f64v sums[kMaxLevels + 1] = {};
  for (int j = 0; j < levels; ++j) {
    rounders[j] = splat<f64v>(std::ldexp(1.5, top - kQuantumBits * (j + 1) + 52));
  }
  auto split = [&](f64v term) {
    for (int j = 0; j < levels; ++j) {
      const f64v q = (term + rounders[j]) - rounders[j];
      sums[j] += q;
      term -= q;
    }
    sums[levels] += term;
  };
  for (int64_t i = 0; i < vectors; i += kBlock) {
    f64v low, high;
    halves_at<kKind>(x + i, low, high);
    split(kKind == NormKind::Two ? low * low : low);
    split(kKind == NormKind::Two ? high * high : high);
  }
  add_sums(sums, levels + 1, out);
}

// A block's largest magnitude (NaN where it holds a NaN) and smallest non-zero one (inf where none).
struct MagnitudeBounds {
  double largest;
  double smallest;
};

// The storage type's bits for magnitudes: magnitudes order as these unsigned integers (a NaN above inf).
template <typename T>
using StorageBits = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;

template <typename T>
double from_bits(StorageBits<T> bits) {
  T value;
  std::memcpy(&value, &bits, sizeof(value));
  return static_cast<double>(static_cast<float>(value));
}

// How the blocks come from memory. A long span's whole blocks of 16-bit values, or of float32 values squared, are
// each read once (TermSums::add_checked_blocks): the run adds a block's terms and checks its sums after (the plain
// run by the inexact flag; the quanta run's loop takes the block's smallest magnitude too, and checks its lanes),
// where it used to bound the block in a pass of its own first (its largest magnitude is what the check stands in
// for). On 2 AMD EPYC cores (AVX2), build against build
// (`bench/compare_builds.py`, 10 pairs): bfloat16's exact norm took 0.818 (0.741-0.978) of the time on GPT-2,
// 0.754 (0.731-0.804) on ResNet-50, 0.709 (0.660-0.790) on 2,000 x 64x64, where each block was bounded first, four
// streams side by side; float32's 0.919 (0.890-1.005), 0.947 (0.875-1.137) and 0.863 (0.804-0.944) against the
// pipelined walk below. Four float32 streams read side by side did worse on small tensors (2,000 x 64x64 1.088
// (1.013-1.162)).
//
// The checked loops ask kCheckedPrefetchBytes ahead into L1, but for 16-bit blocks on Intel CPUs (L2) and float32's on
// the others (none): add_checked_blocks_asking. A loop that sums stops taking new reads while its sums wait, and on one
// thread the sums and the reads added up rather than overlapped: on 2 AMD EPYC cores (Zen 4, AVX-512) float32 GPT-2's
// exact norm took 1.48x today's on one thread, 1.10x on two, 3.0x in L2. Asked 4 KB ahead instead of 1 KB (16-bit
// blocks, which had not asked there, too) it took 0.917 (0.912-0.933) of the time on one thread and 0.951
// (0.875-1.023) on two; bfloat16 0.956 (0.948-0.972) and 0.959 (0.913-0.983); ResNet-50 0.935-0.976
// (`TORCHCLIP_EXACT_NORM=1 bench/compare_builds.py`, 8 pairs). 8 KB measured as 4 KB (every interval across 1). Since
// float32's loop sums in 256-bit halves and reads two streams, its asks cost on those cores: without them it took
// 0.940 (0.925-0.947) of the time on GPT-2 on one thread and 0.925 (0.905-0.948) on ResNet-50 on two (AVX2: 0.924
// and 0.977 (0.961-1.011); 10 pairs). Not the sums' pace: a scratch loop that read each block, asking as this one did,
// and summed nothing took 1.07-1.10x today's norm on ResNet-50 (two threads, one process), the summing loop 1.01.
// bfloat16's asks still gain there (without them 1.22-1.32x today's norm against 1.19-1.27x with them, alternated
// processes).
//
// A long span of float32 magnitudes (p = 1) is walked pipelined: the loop that sums a block also bounds the next
// one (BoundsAhead), asking kPrefetchBytes ahead into L2, so the reads from memory go on at an even pace while the
// sums run instead of stopping for them and then going in a burst (64M normal float32 squares, a harness on a Xeon
// at 2.5 GHz, two threads: exact / today's norm 1.80 and 1.50 bounded then summed, 1.34 and 1.36 pipelined).
//
// Blocks on their own (a span's first and last, short spans, gathered ones) are bounded and then summed, the
// bounds asking kPrefetchBytes ahead into L2, the quanta run kL1PrefetchBytes ahead into L1 (float32 from memory,
// one stream bounded then summed: 0.59 ns an element without either, 0.38 with the first, 0.33 with both).
constexpr int64_t kPrefetchBytes = 16384;
constexpr int64_t kL1PrefetchBytes = 8192;
constexpr int64_t kCheckedPrefetchBytes = 4096;

// What a run's loop does beside its sums, by where its block lies (`ahead`). A block read in place asks for what
// follows it in memory (kRunPrefetches); one copied into a buffer (gathered, padded) does not, as what follows the
// buffer is not data: 10,000 x 100 float32's exact norm, all of it gathered, took 0.902 (0.895-0.969) of the time
// without those asks (`bench/compare_builds.py`, 20 pairs, AVX-512; bfloat16's blocks, which take the plain run
// that never asked, 1.021 (0.927-1.111)). A block of a pipelined walk bounds the next block (BoundsAhead).
template <bool kPrefetches>
struct BlockLies {
  static constexpr bool kRunPrefetches = kPrefetches;
  template <int64_t kElements>
  void take(int64_t) {}
};
using InPlace = BlockLies<true>;
using InBuffer = BlockLies<false>;

// The quanta run's prefetch for the kElements it sums at x, a cache line at a time, where its block lies in place.
template <int64_t kElements, typename Ahead, typename T>
void prefetch_ahead_of_run(const T* x) {
  constexpr int64_t kLine = 64;
  if constexpr (Ahead::kRunPrefetches) {
    for (int64_t byte = 0; byte < kElements * static_cast<int64_t>(sizeof(T)); byte += kLine) {
      __builtin_prefetch(reinterpret_cast<const char*>(x) + byte + kL1PrefetchBytes, 0, 3);
    }
  }
}

// The running bounds of magnitudes, on their bit patterns in full-width vectors of the storage type (32 16-bit
// lanes with AVX-512: no conversion to float32, half the work of the float32 lanes per element); bits - 1
// sends a zero to the top, out of the minimum's way.
template <typename T, bool kTakesLargest = true>
class BitsBounds {
 public:
  using Bits = StorageBits<T>;
  typedef Bits BitsV __attribute__((vector_size(kVectorBytes)));
  static constexpr int64_t kLanes = kVectorBytes / sizeof(Bits);

  // The kLanes values at `at`.
  void take(const char* at) {
    BitsV bits;
    std::memcpy(&bits, at, sizeof(bits));
    take(bits);
  }

  // The n values at x copied to `to`, taken on the way: a gathered or padded block's bounds with its copy, not
  // in a second pass over it (10,000 x 100 float32's exact total, AVX2: 9.59M -> 8.99M instructions a call). A tail
  // shorter than a vector is the vector that ends at x + n, which copies and takes some values twice (the same values,
  // the same bounds); with fewer than a vector's values, the vector is stored whole, its lanes past n zeros (which
  // neither bound sees), so `to` needs a vector's room past n.
  // (`running`, a local: the stores through `to` may alias *this, which would keep the bounds in memory.)
  void copy_taking(const T* x, int64_t n, T* to) {
    BitsBounds running = *this;
    const auto copy_vector = [&](const T* from, int64_t i) {
      BitsV bits;
      std::memcpy(&bits, from, sizeof(bits));
      std::memcpy(to + i, &bits, sizeof(bits));
      running.take(bits);
    };
    if (n < kLanes) {
      alignas(kVectorBytes) T lanes[kLanes];
      load_padded<kLanes>(lanes, x, n, T(0.0f));
      copy_vector(lanes, 0);
    } else {
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        copy_vector(x + i, i);
      }
      if (i < n) {
        copy_vector(x + n - kLanes, n - kLanes);
      }
    }
    *this = running;
  }

  // Whether a non-zero value taken lies below `floor` (as magnitude bits).
  bool any_below(Bits floor) const { return any_lane(min_less_one_ < splat<BitsV>(static_cast<Bits>(floor - 1))); }

  // The bounds of what was taken and of the `count` values at `rest` (fewer than a vector's); the largest 0 where
  // not taken (the quanta run's checked loop asks for the smallest alone: no fold of the largest beside it).
  MagnitudeBounds result(const T* rest = nullptr, int64_t count = 0) const {
    Bits largest = 0;
    if constexpr (kTakesLargest) {
      largest = fold_lanes(max_bits_, [](BitsV a, BitsV b) { return a > b ? a : b; });
    }
    Bits smallest_less_one = fold_lanes(min_less_one_, [](BitsV a, BitsV b) { return a < b ? a : b; });
    for (int64_t k = 0; k < count; ++k) {
      Bits bits;
      std::memcpy(&bits, rest + k, sizeof(bits));
      bits &= kSignless;
      largest = std::max(largest, bits);
      smallest_less_one = std::min(smallest_less_one, static_cast<Bits>(bits - 1));
    }
    const Bits smallest = static_cast<Bits>(smallest_less_one + 1);  // 0 when every value is 0
    return {from_bits<T>(largest), smallest == 0 ? std::numeric_limits<double>::infinity() : from_bits<T>(smallest)};
  }

 private:
  static constexpr Bits kAllOnes = std::numeric_limits<Bits>::max(), kSignless = kAllOnes >> 1;

  void take(BitsV bits) {
    bits &= kSignless;
    if constexpr (kTakesLargest) {
      max_bits_ = max_bits_ > bits ? max_bits_ : bits;
    }
    const BitsV less_one = bits - splat<BitsV>(1);
    min_less_one_ = min_less_one_ < less_one ? min_less_one_ : less_one;
  }

  BitsV max_bits_ = BitsV{}, min_less_one_ = splat<BitsV>(kAllOnes);
};

// The smallest non-zero magnitude alone (inf where none), for the walk that checks its sums after the fact.
template <typename T>
using SmallestBits = BitsBounds<T, false>;

// The MagnitudeBounds of the n values at x.
template <typename T>
MagnitudeBounds magnitude_bounds(const T* x, int64_t n) {
  BitsBounds<T> running;
  int64_t i = 0;
  for (; i + BitsBounds<T>::kLanes <= n; i += BitsBounds<T>::kLanes) {
    const char* at = reinterpret_cast<const char*>(x + i);
    __builtin_prefetch(at + kPrefetchBytes, 0, 1);
    running.take(at);
  }
  return running.result(x + i, n - i);
}

// The bounds of a whole block (kExactBlock elements) taken by the loop that sums the block before it: as that
// loop sums the elements [i, i + kElements) of its block, it takes the same elements of this one. Where no run's
// loop took them (the block before went term by term, or to the levels), result() reads them itself.
template <typename T>
class BoundsAhead {
 public:
  static constexpr bool kRunPrefetches = false;  // (its own reads ask ahead)

  explicit BoundsAhead(const T* block) : block_(block) {}

  template <int64_t kElements>
  void take(int64_t i) {
    constexpr int64_t kBytes = kElements * static_cast<int64_t>(sizeof(T));
    static_assert(kBytes % kVectorBytes == 0, "a run's loop steps by whole vectors of the storage type");
    const char* at = reinterpret_cast<const char*>(block_ + i);
    for (int64_t byte = 0; byte < kBytes; byte += kVectorBytes) {
      __builtin_prefetch(at + byte + kPrefetchBytes, 0, 1);
      bounds_.take(at + byte);
    }
    taken_ = true;  // (a loop takes all of it: the blocks are the same length; one that takes it again changes nothing)
  }

  MagnitudeBounds result() const {
    if (taken_) {
      return bounds_.result();
    }
    return magnitude_bounds(block_, kExactBlock);
  }

 private:
  const T* block_;
  BitsBounds<T> bounds_;
  bool taken_ = false;
};

// frexp's exponent of a positive, normal double (every 16/32-bit value and square is one), from its bits:
// v < 2^binade_end(v) <= 2v.
inline int binade_end(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<int>(bits >> 52) - 1022;
}

// 2^exponent, built from its bits, for the exponents the runs ask for (normal doubles: a 16/32-bit value's
// magnitude or square, and the last bit its block's bounds give it, lie between 2^-350 and 2^260, and the runs
// ask for at most 2^53 and 2^84 beyond those). libm's ldexp, a call, took 12% of an AVX2 exact norm of float32
// values in L3 (each quanta run's start and flush) once those were no longer inlined.
inline double power_of_two(int exponent) {
  const uint64_t bits = static_cast<uint64_t>(exponent + 1023) << 52;
  double value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// A block's terms (|x| for p = 1, x^2 for p = 2) from its magnitude bounds: every non-zero term is below
// 2^top and a multiple of 2^lowest_bit.
struct TermRange {
  int top;
  int lowest_bit;
};

// The last bit no term's lies below, from the smallest non-zero magnitude (finite: the caller checks for none).
template <NormKind kKind, typename T>
int lowest_term_bit(double smallest) {
  // The smallest magnitude's last bit (a normal value's; a subnormal's lies above it): no term's is lower.
  const int last_bit = binade_end(smallest) - 1 - kTrailingBits<T>;
  return kKind == NormKind::Two ? 2 * last_bit : last_bit;
}

// lowest_term_bit's inverse: the least magnitude, as the storage type's bits, whose term's last bit is not below
// 2^lowest_bit, so that a block whose non-zero values are all at or above it needs no bound of its own (1 where every
// non-zero value's is: a subnormal's last bit is the least normal binade's).
template <NormKind kKind, typename T>
StorageBits<T> floor_bits(int lowest_bit) {
  constexpr int kPower = kKind == NormKind::Two ? 2 : 1;
  constexpr int kBias = std::is_same_v<T, c10::Half> ? 15 : 127;
  constexpr int kInfField = std::is_same_v<T, c10::Half> ? 31 : 255;
  const int least_exponent = (lowest_bit >= 0 ? (lowest_bit + kPower - 1) / kPower : -(-lowest_bit / kPower)) +
      kTrailingBits<T>;  // (the least e with kPower * (e - kTrailingBits) >= lowest_bit)
  const int field = least_exponent + kBias;
  return field <= 1 ? 1 : static_cast<StorageBits<T>>(std::min(field, kInfField) << kTrailingBits<T>);
}

template <NormKind kKind, typename T>
TermRange term_range(const MagnitudeBounds& bounds) {
  const int top = kKind == NormKind::Two ? binade_end(bounds.largest * bounds.largest) : binade_end(bounds.largest);
  return {top, lowest_term_bit<kKind, T>(bounds.smallest)};
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// With AVX2, bfloat16 bits go straight into float64's: the exponent and mantissa fields shifted into float64's
// and the value scaled back by 2^(1023 - 127), exact for every finite value, subnormals included (the sign
// cleared first; an inf or NaN block never reaches a run). One zero-extension and a shift per four values,
// where widening to float32 and then to float64 took three instructions per eight and two converts: the plain
// run's loop from 0.18 to 0.135 ns an element (in cache, one core). Not float16, whose F16C widening is faster
// (0.126 against 0.147), nor AVX-512, where the two ways cost the same (0.10-0.11).
template <typename T>
constexpr bool kWidensStraight = std::is_same_v<T, c10::BFloat16>;

inline f64v widened_straight(const c10::BFloat16* x) {
  typedef uint16_t Quarter __attribute__((vector_size(kVectorBytes / 4)));
  Quarter bits;
  std::memcpy(&bits, x, sizeof(bits));
  return (f64v)(__builtin_convertvector(bits & uint16_t{0x7fff}, u64v) << (52 - kTrailingBits<c10::BFloat16>)) *
      0x1p896;
}
#else
template <typename T>
constexpr bool kWidensStraight = false;
#endif

// How many sets of sums a checked loop (TermSums::add_checked_blocks) adds its vectors into in turn. Each set's
// additions are chains, one fused multiply-add (4 cycles' latency) per vector on each; AVX2's loops issue a vector's
// work in less, and waited on the chains. With two sets, in one process alternating per call (2 AMD EPYC cores, Zen
// 4, AVX2 library): float32's exact norm of 1M values in L3 took 0.89x the time, GPT-2's and ResNet-50's 0.94-0.95x
// on one thread; bfloat16's 0.96-0.98x. The AVX-512 library, on the same cores, measured 1.00-1.03x with two: it
// keeps one.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kCheckedSumSets = 2;
#else
constexpr int kCheckedSumSets = 1;
#endif

// Whether a lane of any of the sums is not below `limit` (a NaN is not below): a run's check after the fact, its
// comparisons joined into one register test.
template <typename... Sums>
bool any_lane_not_below(f64v limit, Sums... sums) {
  return any_lane(((!(sums < limit)) | ...));
}

// A run's terms at most: 512 per float64 lane of the quanta run's two accumulators (8,192 with AVX-512,
// 4,096 with AVX2); kRunBits bounds its log2 on every ISA.
constexpr int64_t kRunTerms = 512 * 2 * kBlock64;
constexpr int kRunBits = 13;
static_assert(kRunTerms <= (int64_t{1} << kRunBits), "kRunBits bounds every run");

// The bits a sum of n terms below 2^top may need above 2^top: ceil(log2 n).
inline int count_bits(int64_t n) {
  return n <= 1 ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(n - 1));
}

}  // namespace
}  // namespace torchclip::cpu
