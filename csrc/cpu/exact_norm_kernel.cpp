// Exact norms, p = 1 and p = 2: each tensor's sum of |x| or x^2 held exactly (exact_sum.h), its norm the
// correctly rounded value, and the sum of every tensor's terms handed back exactly for the total.
//
// Why the fast paths are exact: a 16/32-bit value's magnitude (24 bits) and square (48 bits) are exact in
// float64, and a sum of float64 values is exact when every term is a multiple of some 2^b and every partial
// sum is below 2^(b + 53). Each block of kExactBlock = 2^10 values is bounded (its largest magnitude, and
// its smallest non-zero one, below whose last bit no term's last bit lies) and joins one of two runs of up to
// kRunTerms (2^13) terms, summed in float64 lanes and handed to the ExactSum only when a block cannot join or
// the run is full. A long span's whole blocks of 16-bit values or float32 squares are read once instead: the
// run adds the terms and takes the smallest magnitude in one loop, then checks its lanes for what the largest
// would have told it (add_checked), and a block that fails is bounded and joins as any other:
// - the plain run adds the terms as they are: exact while each of its float64 lanes stays below 2^53 times
//   the lowest last bit, which it checks (the terms are not negative): squares of bfloat16 values spanning up
//   to about 2^15, of float16 values about 2^12; magnitudes spanning about 2^38 (bfloat16), 2^35 (float16),
//   2^22 (float32);
// - the quanta run adds each term as q + r: q the term rounded to a multiple of the quantum 2^(top - 43),
//   in a lane biased by 2^(52 + top - 43), whose last bit is that quantum, so the rounding is the addition
//   itself and the lane's mantissa bits count its quanta; r = term - q, |r| <= half a quantum, in a plain
//   lane, exact while the terms' last bits reach no lower than 2^(top - 84).
// Blocks neither run takes (a term below about 2^-40 times the largest, for p = 2) split each term over
// more quanta, one level per 43 bits; float64 data is added term by term (its squares are 106-bit
// products). Runs span blocks, and tensors where only the total is wanted, because handing a block's sums
// to the ExactSum (horizontal sums, two additions of a few digits) cost about a third of summing the block.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "multi_tensor.h"
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
// each read once (TermSums::add_checked_blocks): the loop that adds a block's terms takes its smallest magnitude
// too, and the run checks its lanes after, where it used to bound the block in a pass of its own first (its
// largest magnitude is what the check stands in for). On 2 AMD EPYC cores (AVX2), build against build
// (`bench/compare_builds.py`, 10 pairs): bfloat16's exact norm took 0.818 (0.741-0.978) of the time on GPT-2,
// 0.754 (0.731-0.804) on ResNet-50, 0.709 (0.660-0.790) on 2,000 x 64x64, where each block was bounded first, four
// streams side by side; float32's 0.919 (0.890-1.005), 0.947 (0.875-1.137) and 0.863 (0.804-0.944) against the
// pipelined walk below. Four float32 streams read side by side did worse on small tensors (2,000 x 64x64 1.088
// (1.013-1.162)).
//
// The checked loops ask kCheckedPrefetchBytes ahead into L1 (16-bit blocks on Intel CPUs: add_checked_blocks_asking).
// A loop that sums stops taking new reads while its sums wait, and on one thread the sums and the reads added up
// rather than overlapped: on 2 AMD EPYC cores (Zen 4, AVX-512) float32 GPT-2's exact norm took 1.48x today's on one
// thread, 1.10x on two, 3.0x in L2. Asked 4 KB ahead instead of 1 KB (16-bit blocks, which had not asked there, too)
// it took 0.917 (0.912-0.933) of the time on one thread and 0.951 (0.875-1.023) on two; bfloat16 0.956
// (0.948-0.972) and 0.959 (0.913-0.983); ResNet-50 0.935-0.976 (`TORCHCLIP_EXACT_NORM=1 bench/compare_builds.py`,
// 8 pairs). 8 KB measured as 4 KB (every interval across 1).
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

  // The bounds of what was taken and of the `count` values at `rest` (fewer than a vector's).
  MagnitudeBounds result(const T* rest = nullptr, int64_t count = 0) const {
    Bits largest = fold_lanes(max_bits_, [](BitsV a, BitsV b) { return a > b ? a : b; });
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

// Terms added as they are, in four vectors of float64 lanes (four, so the additions' latency overlaps). Every
// term is a multiple of 2^lowest_bit_ and not negative, so each lane's sum only grows and is exact while it stays
// below 2^(lowest_bit_ + 53); flush hands the lanes to the ExactSum as one integer count of 2^lowest_bit_ (no
// float64 total, which would round). The bound holds a priori where the most terms one lane holds times 2^top is
// below it. A block within kHopefulBits of it is added and the lanes checked, and not kept if one
// fails: a lane sums about 2^3.5 under that bound for Gaussian squares. Bounding each lane rather than their
// total gives a run 5 more bits (4 with AVX2), so that fewer bfloat16 blocks fail to join (summed twice) or go to
// the quanta run: GPT-2 bfloat16's exact norm took 0.936 (0.843-0.952) of the time bounded by the total, ResNet-50's
// 0.911 (0.771-0.967) (`bench/compare_builds.py`, 12 pairs, AVX-512; AVX2 0.908 and 0.855).
template <NormKind kKind>
class PlainRun {
 public:
  static constexpr int kHopefulBits = 6;
  static constexpr int kFreshRoomBits = 10;  // (add_checked's comment)

  bool empty() const { return terms_ == 0; }

  // Adds the block and returns true, or leaves the run as it was and returns false (`next`: BlockLies' comment).
  template <typename T, typename Ahead>
  bool add(const T* x, int64_t vectors, const TermRange& range, Ahead& next) {
    if (!empty() && top_from_sums_) {
      top_ = binade_end(largest_lane(sums_));  // (every term is at most its lane)
      top_from_sums_ = false;
    }
    const int top = empty() ? range.top : std::max(top_, range.top);
    const int lowest_bit = empty() ? range.lowest_bit : std::min(lowest_bit_, range.lowest_bit);
    const int64_t terms = terms_ + vectors;
    // (a lane takes one term of each 4 kBlock64, and one more from a block's tail of half that: ceil)
    const int64_t lane_terms = lane_terms_ + (vectors + 4 * kBlock64 - 1) / (4 * kBlock64);
    const int bound_bits = top + count_bits(lane_terms) - lowest_bit;
    if (terms > kRunTerms || bound_bits > 53 + kHopefulBits) {
      return false;
    }
    f64v sums[4] = {sums_[0], sums_[1], sums_[2], sums_[3]};  // (in locals: see QuantaRun::add)
    Ahead ahead = next;
    int64_t i = 0;
    if constexpr (kWidensStraight<T>) {
      for (; i + 4 * kBlock64 <= vectors; i += 4 * kBlock64) {
        ahead.template take<4 * kBlock64>(i);
        for (int k = 0; k < 4; ++k) {
          add_term(widened_straight(x + i + k * kBlock64), sums[k]);
        }
      }
      if (i < vectors) {  // (vectors is whole float32 vectors: two float64 ones)
        ahead.template take<2 * kBlock64>(i);
        add_term(widened_straight(x + i), sums[0]);
        add_term(widened_straight(x + i + kBlock64), sums[1]);
      }
    } else {
      for (; i + 2 * kBlock <= vectors; i += 2 * kBlock) {
        ahead.template take<2 * kBlock>(i);
        add_pair(x + i, sums);
      }
      if (i < vectors) {
        ahead.template take<kBlock>(i);
        add_vector(load_f32(x + i), sums[0], sums[1]);
      }
    }
    next = ahead;  // (the next block's bounds hold whether or not this block stays)
    if (bound_bits > 53 && !lanes_fit(sums, lowest_bit)) {
      return false;  // (the run's own sums untouched)
    }
    std::copy(sums, sums + 4, sums_);
    top_ = top;
    lowest_bit_ = lowest_bit;
    terms_ = terms;
    lane_terms_ = lane_terms;
    return true;
  }

  // A whole block of 16-bit values read once (TermSums::add_checked_blocks): its terms added into lanes of its own
  // and its smallest non-zero magnitude taken in one loop, and the lanes checked after, so that no bounds pass reads
  // the block first. Every term is a multiple of 2^lowest_bit and not negative, so a lane below 2^(lowest_bit + 53)
  // at the end was exact all along, and so was its sum with the run's lane (both multiples of 2^lowest_bit); a NaN or
  // inf fails the check (one register test of the four vectors' comparisons, simd::any_lane). A block the run cannot
  // take flushes it into `out` and starts a fresh one, its lanes kept rather than summed again; returns false, none
  // of the block added (the run flushed where it could not take it), where the block alone fails the check.
  // kAsksIntoL2: TermSums::add_checked_blocks_asking's comment.
  //
  // The run's lowest bit is a floor that blocks keep: one whose non-zero values all lie at or above floor_bits is
  // told so by one comparison of its smallest lanes, and only a block with a value below folds its smallest to lower
  // the floor. A fresh run sets it below its first block's smallest where its lanes' room allows, as low as leaves
  // them 2^kFreshRoomBits to grow (Gaussian bfloat16 values: down to 2^-11 of their deviation).
  //
  // Summed into the run's lanes, each block folded its smallest and its largest lane, the runs' lowest bit followed
  // their running smallest down, a run was flushed every 4 or 5 blocks (before a block, with a lane within 2^8 of its
  // bound) and about 1.5% of blocks were summed twice: the exact bfloat16 norm took 0.897 (0.893-0.927) of that time
  // on GPT-2, one thread, 0.992 (0.935-1.055) on two; ResNet-50 0.888 (0.849-0.919) and 0.894 (0.847-0.930); 2,000 x
  // 64x64 0.904 and 0.903 (build against build, `TORCHCLIP_EXACT_NORM=1 bench/compare_builds.py`, 8 pairs, AVX-512).
  template <bool kAsksIntoL2, typename T>
  bool add_checked(const T* x, ExactPartial& out) {
    static_assert(SmallestBits<T>::kLanes == 2 * kBlock, "one storage vector a step");
    f64v block[4] = {};
    SmallestBits<T> smallest;
    for (int64_t i = 0; i < kExactBlock; i += 2 * kBlock) {
      const char* at = reinterpret_cast<const char*>(x + i);
      if constexpr (kAsksIntoL2) {
        __builtin_prefetch(at + kPrefetchBytes, 0, 1);
      } else {
        __builtin_prefetch(at + kCheckedPrefetchBytes, 0, 3);
      }
      smallest.take(at);
      add_pair(x + i, block);
    }
    if (!empty()) {
      int lowest_bit = lowest_bit_;
      if (smallest.any_below(floor_bits<kKind, T>(lowest_bit_))) {
        lowest_bit = std::min(lowest_bit_, lowest_term_bit<kKind, T>(smallest.result().smallest));
      }
      const f64v sums[4] = {sums_[0] + block[0], sums_[1] + block[1], sums_[2] + block[2], sums_[3] + block[3]};
      if (lanes_fit(sums, lowest_bit)) {
        std::copy(sums, sums + 4, sums_);
        lowest_bit_ = lowest_bit;
        joined(kExactBlock);
        return true;
      }
      flush(out);  // (full, or its lowest bit lowered below what its lanes allow)
    }
    const double least = smallest.result().smallest;
    if (least == std::numeric_limits<double>::infinity()) {
      return true;  // (zeros: nothing to add)
    }
    const int lowest_bit =
        std::min(lowest_term_bit<kKind, T>(least), binade_end(largest_lane(block)) - 53 + kFreshRoomBits);
    if (!lanes_fit(block, lowest_bit)) {
      return false;
    }
    std::copy(block, block + 4, sums_);
    lowest_bit_ = lowest_bit;
    joined(kExactBlock);
    return true;
  }

  void flush(ExactPartial& out) {
    if (!empty()) {
      // Each lane an integer count of 2^lowest_bit_ below 2^53, their sum below 2^58.
      const double scale = power_of_two(-lowest_bit_);
      i64v counts = i64v{};
      for (const f64v& sum : sums_) {
        counts += __builtin_convertvector(sum * scale, i64v);
      }
      int64_t count = 0;
      for (int lane = 0; lane < kBlock64; ++lane) {
        count += counts[lane];
      }
      out.sum.add_scaled(static_cast<unsigned __int128>(count), lowest_bit_, false);
    }
    *this = PlainRun();
  }

 private:
  // A checked block's count into the run: top_ is then asked of the lanes, where add needs it.
  void joined(int64_t terms) {
    terms_ += terms;
    lane_terms_ += terms / (4 * kBlock64);
    top_from_sums_ = true;
  }

  // Whether every lane is below 2^(lowest_bit + 53), where a sum of multiples of 2^lowest_bit is exact (a NaN is not).
  static bool lanes_fit(const f64v* sums, int lowest_bit) {
    return !any_lane_not_below(splat<f64v>(power_of_two(lowest_bit + 53)), sums[0], sums[1], sums[2], sums[3]);
  }

  static double largest_lane(const f64v* sums) {
    const auto larger = [](f64v a, f64v b) { return a > b ? a : b; };
    return fold_lanes(larger(larger(sums[0], sums[1]), larger(sums[2], sums[3])), larger);
  }

  // The 2 * kBlock values at x into the four sums.
  template <typename T>
  static void add_pair(const T* x, f64v* sums) {
    f32v first, second;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      load_f32_interleaved(x, first, second);  // (AVX-512: 0.171 -> 0.147 ns an element in cache)
    } else {
      first = load_f32(x);
      second = load_f32(x + kBlock);
    }
    add_vector(first, sums[0], sums[1]);
    add_vector(second, sums[2], sums[3]);
  }

  static void add_vector(f32v v, f64v& sum_low, f64v& sum_high) {
    f64v low, high;
    halves_of<kKind>(v, low, high);
    add_term(low, sum_low);
    add_term(high, sum_high);
  }

  // A magnitude's term (|x| for p = 1, x^2 for p = 2) into a sum.
  static void add_term(f64v magnitude, f64v& sum) { sum += kKind == NormKind::Two ? magnitude * magnitude : magnitude; }

  f64v sums_[4] = {};
  bool top_from_sums_ = false;  // (top_ is stale: checked blocks joined since add set it)
  int64_t terms_ = 0, lane_terms_ = 0;  // (lane_terms_: the most terms any one lane holds)
  int top_ = 0, lowest_bit_ = 0;
};

// Terms added as quanta and remainders, four operations per term: each lane's quanta are summed in a
// running sum biased by 2^(52 + k), k = top_ - 43, whose last bit weighs the quantum 2^k: adding a term
// rounds it to a multiple of 2^k, and the sum's step is that multiple, exactly. A lane adds at most 512
// terms of at most 2^(k + 43) - which keeps it below 2^(53 + k), in one binade, its mantissa bits the count
// of its quanta - and the remainders, each at most 2^(k - 1), sum below 2^(k - 1 + kRunBits): exact when
// every term is a multiple of 2^(k - 1 + kRunBits - 53) = 2^(k - kRestBits). For p = 2 each use of a square
// is written out for FMA contraction (exact either way: the square is).
template <NormKind kKind>
class QuantaRun {
 public:
  static constexpr int kTopHeadroom = 2;  // a run's top above its first block's: later blocks up to 2x larger join

  static constexpr int kRestBits = 53 - kRunBits + 1;  // 41: how far below the quantum a term's bits may reach

  static bool exact_for(int top, int lowest_bit) { return lowest_bit >= top - kQuantumBits - kRestBits; }

  // (the terms a run holds are exact_for its top, which it keeps: only the block's need asking)
  bool takes(const TermRange& range, int64_t terms) const {
    return terms_ != 0 && terms_ + terms <= kRunTerms && range.top <= top_ && exact_for(top_, range.lowest_bit);
  }

  // Whether an empty run can start with this block (at the top it then keeps).
  bool starts(const TermRange& range) {
    for (int headroom = kTopHeadroom; headroom >= 0; --headroom) {
      if (exact_for(range.top + headroom, range.lowest_bit)) {
        start_at(range.top + headroom);
        return true;
      }
    }
    return false;
  }

  // An empty run given its top, with no term yet: a full run's successor keeps its top.
  void start_at(int top) {
    top_ = top;
    sums_[0] = sums_[1] = splat<f64v>(power_of_two(top_ - kQuantumBits + 52));
    started_ = true;
  }

  bool started() const { return started_; }
  int top() const { return top_; }
  bool full_for(int64_t terms) const { return terms_ + terms > kRunTerms; }

  template <typename T, typename Ahead>
  void add(const T* x, int64_t vectors, const TermRange& range, Ahead& next) {
    if constexpr (kHalvesFor<T>) {
      if (splits_wide_ops()) {
        return add_with<HalfWidthLanes>(x, vectors, next);
      }
    }
    add_with<FullWidthLanes>(x, vectors, next);
  }

  // A whole block of float32 values read once (TermSums::add_checked_blocks): its squares added and its smallest
  // magnitude taken in one loop, and what add's callers check before (each term below 2^top_, its bits reaching no
  // lower than exact_for allows: no non-zero value below floor_bits, one comparison of the smallest lanes, where the
  // smallest was folded and its last bit asked for) checked after. Squares are not negative, so a lane still below
  // 2^(52 + k) + its terms * 2^(k + 43) (k = top_ - 43) stayed in its binade, with the quantum as its last bit, all
  // along: each rounding's remainder was exact and at most half a quantum, and the lane keeps the invariant the other
  // adds count on; a NaN or inf fails the check. Returns false, the run as it was, where the check fails. The run must
  // have started, with room for the block.
  template <typename T>
  bool add_checked(const T* x) {
    static_assert(kHalvesFor<T>, "float32 squares: the quanta run's terms");
    return splits_wide_ops() ? add_checked_with<HalfWidthLanes>(x) : add_checked_with<FullWidthLanes>(x);
  }

  void flush(ExactPartial& out) {
    if (terms_ != 0) {
      // The lanes' quanta and the remainders as one count of 2^(k - kRestBits), one ExactSum addition: every
      // remainder is a multiple of it (exact_for), their sum below 2^(k + 12), and the total, the terms'
      // sum, is not negative.
      constexpr uint64_t kMantissa = (uint64_t{1} << 52) - 1;
      const int k = top_ - kQuantumBits;
      const u64v quanta = ((u64v)sums_[0] & kMantissa) + ((u64v)sums_[1] & kMantissa);
      __int128 count = 0;
      for (int lane = 0; lane < kBlock64; ++lane) {
        count += quanta[lane];
      }
      const double rest = horizontal_sum(rests_[0] + rests_[1]);
      count = count * (__int128{1} << kRestBits) + static_cast<int64_t>(rest * power_of_two(kRestBits - k));
      out.sum.add_scaled(static_cast<unsigned __int128>(count), k - kRestBits, false);
    }
    *this = QuantaRun();
  }

 private:
  // float32 squares: the terms HalfWidthLanes adds.
  template <typename T>
  static constexpr bool kHalvesFor = kKind == NormKind::Two && std::is_same_v<T, float>;

  // One term added to a quanta lane and its remainder lane (the class comment's four operations).
  template <typename V>
  static void add_term(V term_root, V& sum, V& rest) {
    if constexpr (kKind == NormKind::Two) {
      const V next = term_root * term_root + sum;
      rest += term_root * term_root - (next - sum);
      sum = next;
    } else {
      const V next = term_root + sum;
      rest += term_root - (next - sum);
      sum = next;
    }
  }

  // The run's lanes while a loop adds to them, in locals: as members, behind `this` or a reference, the compiler
  // must assume the data's loads may alias them.
  struct FullWidthLanes {
    f64v sum_low, sum_high, rest_low, rest_high;

    explicit FullWidthLanes(const QuantaRun& run)
        : sum_low(run.sums_[0]), sum_high(run.sums_[1]), rest_low(run.rests_[0]), rest_high(run.rests_[1]) {}

    // One vector of kBlock values' terms.
    template <typename T>
    void add(const T* at) {
      f64v low, high;
      halves_at<kKind>(at, low, high);
      add_term(low, sum_low, rest_low);
      add_term(high, sum_high, rest_high);
    }

    f64v sums_low() const { return sum_low; }
    f64v sums_high() const { return sum_high; }

    void store(QuantaRun& run) const {
      run.sums_[0] = sum_low;
      run.sums_[1] = sum_high;
      run.rests_[0] = rest_low;
      run.rests_[1] = rest_high;
    }
  };

  // The same lanes, float32 squares added to them a 256-bit half at a time (four chains of additions instead of two),
  // on AVX-512 CPUs that run each 512-bit operation as two 256-bit halves (AMD's). Each half holds the lanes it holds
  // in the full-width vectors, so the sums are the same bits. On 2 AMD EPYC cores (Zen 4), 1M Gaussian float32 values
  // in L3, one thread: the exact norm took 0.149-0.153 ns an element against 0.163-0.166 at full width (alternated
  // runs), and the loop alone in a harness 0.122 against 0.144. Intel's AVX-512 cores run 512-bit operations whole,
  // and keep the full width (not measured this way).
#if defined(__AVX512F__)
  struct HalfWidthLanes {
    typedef double f64half __attribute__((vector_size(kVectorBytes / 2)));
    f64half sums[4], rests[4];

    static f64half lower(f64v v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); }
    static f64half upper(f64v v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); }
    static f64v joined(f64half a, f64half b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7); }

    explicit HalfWidthLanes(const QuantaRun& run)
        : sums{lower(run.sums_[0]), upper(run.sums_[0]), lower(run.sums_[1]), upper(run.sums_[1])},
          rests{lower(run.rests_[0]), upper(run.rests_[0]), lower(run.rests_[1]), upper(run.rests_[1])} {}

    // One vector of kBlock values' terms, four values at a time (the intrinsic: GCC lowered __builtin_convertvector
    // of four floats to two 128-bit widenings and a merge).
    void add(const float* at) {
      for (int part = 0; part < 4; ++part) {
        add_term((f64half)_mm256_cvtps_pd(_mm_loadu_ps(at + part * kBlock / 4)), sums[part], rests[part]);
      }
    }

    f64v sums_low() const { return joined(sums[0], sums[1]); }
    f64v sums_high() const { return joined(sums[2], sums[3]); }

    void store(QuantaRun& run) const {
      run.sums_[0] = joined(sums[0], sums[1]);
      run.sums_[1] = joined(sums[2], sums[3]);
      run.rests_[0] = joined(rests[0], rests[1]);
      run.rests_[1] = joined(rests[2], rests[3]);
    }
  };
  static bool splits_wide_ops() { return !intel_cpu(); }
#else
  using HalfWidthLanes = FullWidthLanes;
  static bool splits_wide_ops() { return false; }
#endif

  template <typename Lanes, typename T, typename Ahead>
  void add_with(const T* x, int64_t vectors, Ahead& next) {
    terms_ += vectors;
    Lanes lanes(*this);
    Ahead ahead = next;
    // The next block's bounds taken four vectors at a time: AVX2's 16 registers do not hold them beside the sums,
    // and spilled, the running bounds went through memory at every vector, a store and a load on each step's path.
    // Taken four at a time, AVX2's float32 exact norms took 0.86-0.89 of the time (GPT-2 0.861 (0.756-0.968),
    // ResNet-50 0.887 (0.537-0.957), 2,000 x 64x64 0.885 (0.785-0.972); `bench/compare_builds.py`, 12 pairs).
    constexpr int64_t kStep = 4 * kBlock;
    int64_t i = 0;
    for (; i + kStep <= vectors; i += kStep) {
      ahead.template take<kStep>(i);
      for (int64_t k = i; k < i + kStep; k += kBlock) {
        prefetch_ahead_of_run<kBlock, Ahead>(x + k);
        lanes.add(x + k);
      }
    }
    for (; i < vectors; i += kBlock) {
      prefetch_ahead_of_run<kBlock, Ahead>(x + i);
      ahead.template take<kBlock>(i);
      lanes.add(x + i);
    }
    lanes.store(*this);
    next = ahead;
  }

  template <typename Lanes, typename T>
  bool add_checked_with(const T* x) {
    Lanes lanes(*this);
    SmallestBits<T> smallest;
    for (int64_t i = 0; i < kExactBlock; i += kBlock) {
      const char* at = reinterpret_cast<const char*>(x + i);
      __builtin_prefetch(at + kCheckedPrefetchBytes, 0, 3);
      smallest.take(at);
      lanes.add(x + i);
    }
    const int64_t terms = terms_ + kExactBlock;
    const int k = top_ - kQuantumBits;
    const f64v limit = splat<f64v>(power_of_two(k + 52) + static_cast<double>(terms / kBlock) * power_of_two(top_));
    if (smallest.any_below(floor_bits<kKind, T>(k - kRestBits)) ||
        any_lane_not_below(limit, lanes.sums_low(), lanes.sums_high())) {
      return false;
    }
    lanes.store(*this);
    terms_ = terms;
    return true;
  }

  f64v sums_[2] = {}, rests_[2] = {};
  bool started_ = false;
  int64_t terms_ = 0;
  int top_ = 0;
};

// A block too wide for either run, split over as many levels as its terms need (or term by term).
template <NormKind kKind, typename T>
void add_wide_block(const T* x, int64_t vectors, const TermRange& range, ExactPartial& out) {
  int levels = 1;
  while (levels < kMaxLevels && range.lowest_bit < range.top - kQuantumBits * levels - 44) {
    ++levels;
  }
  if (levels == kMaxLevels) {
    add_terms<kKind>(x, vectors, out);
  } else {
    add_levels<kKind>(x, vectors, range.top, levels, out);
  }
}

// Spans' terms into runs and an ExactPartial. One per piece where each tensor's norm is wanted; one per thread
// for every piece it takes where only the total is: the runs then go on across small tensors, which 10,000
// tensors of 100 values otherwise each paid a flush and an ExactSum merge for, and the blocks shorter than
// kExactBlock (small tensors, a long span's first and last) are gathered into whole ones (`gathers`).
template <NormKind kKind>
class TermSums {
 public:
  explicit TermSums(bool gathers) : gathers_(gathers) {}

  static constexpr int64_t kGatherBelow = kExactBlock / 8;  // (shorter blocks gathered even when whole vectors)

  // Whose terms a run takes without a bounds pass first (add_checked): float32 squares, the quanta run's; 16-bit
  // terms, the plain run's. (float32 magnitudes walk pipelined.)
  template <typename T>
  static constexpr bool kTakesQuanta = std::is_same_v<T, float> && kKind == NormKind::Two;
  template <typename T>
  static constexpr bool kChecksPlain = sizeof(T) == 2;
  template <typename T>
  static constexpr bool kChecks = kTakesQuanta<T> || kChecksPlain<T>;

  template <typename T>
  void add_span(const T* x, int64_t n) {
    if constexpr (std::is_same_v<T, double>) {
      add_terms<kKind>(x, n, partial_);
    } else {
      // A long span's blocks end where the address is a multiple of a block's bytes (4 KiB for float32: a
      // page), its first one short: blocks across two pages, as the data of a torch tensor starting past a
      // page's start makes every one, read from memory at 0.37 against 0.31 ns an element (float32, one
      // core). A span of fewer than 8 blocks pays more for the extra block than the pages save: with spans of 4
      // to 7 blocks no longer split, 2,000 x 64x64 float32's exact norm took 0.945 (0.862-0.958) of the time,
      // ResNet-50's 0.997 (0.949-1.069) and bfloat16's 0.927 (0.855-0.995) (`bench/compare_builds.py`, 12
      // pairs, AVX-512).
      constexpr auto kBlockBytes = static_cast<uintptr_t>(kExactBlock * sizeof(T));
      const auto to_boundary = n < 8 * kExactBlock
          ? 0
          : static_cast<int64_t>(
                (kBlockBytes - reinterpret_cast<uintptr_t>(x) % kBlockBytes) % kBlockBytes / sizeof(T));
      int64_t begin = 0;
      if (to_boundary != 0) {
        add_short(x, to_boundary);
        begin = to_boundary;
      }
      // The whole blocks after it read once each, checked after (float32's |x| pipelined), the rest block by block.
      const int64_t blocks = (n - begin) / kExactBlock;
      if (blocks != 0) {
        if constexpr (kChecks<T>) {
          add_checked_blocks(x + begin, blocks);
        } else {
          add_pipelined(x + begin, blocks);
        }
        begin += blocks * kExactBlock;
      }
      for (int64_t count = 0; begin < n; begin += count) {
        count = std::min(kExactBlock, n - begin);
        add_short(x + begin, count);
      }
    }
  }

  // A sum finished elsewhere, added to this one's.
  void add_partial(const ExactPartial& partial) { partial_.add(partial); }

  // The sum of every term added, flushed out of the gathered block and the runs.
  const ExactPartial& finish() {
    if (gathered_ != 0) {
      (this->*add_gathered_)();
    }
    plain_.flush(partial_);
    quanta_.flush(partial_);
    return partial_;
  }

 private:
  // A span of float32 values this many whole blocks long or longer is read as two streams, its two halves' blocks
  // in turn: on 2 AMD EPYC cores (Zen 4) one thread's exact norm of ResNet-50's float32 gradients took 0.79-0.87x
  // the time of one stream, GPT-2's 0.93x; on two threads, each reading its own chunks, 0.98-1.01x (a scratch build
  // switching per call, 30-60 alternated calls). 16-bit blocks stay one stream (bfloat16 ResNet-50 1.03x).
  static constexpr int64_t kTwoStreamsFrom = 16;

  // Elements rounded up to whole vectors (kBlock's, the float32 lanes every loop steps by).
  static int64_t whole_vectors(int64_t count) { return (count + kBlock - 1) / kBlock * kBlock; }

  // `blocks` whole blocks from x, each read once into a run that checks its sums after (add_checked); a block
  // refused is bounded and added as any other.
  template <typename T>
  void add_checked_blocks(const T* x, int64_t blocks) {
    if (intel_cpu()) {
      add_checked_blocks_asking<true>(x, blocks);
    } else {
      add_checked_blocks_asking<false>(x, blocks);
    }
  }

  // kAsksIntoL2: 16-bit blocks read once ask for their lines kPrefetchBytes ahead into L2 on Intel CPUs
  // (simd::intel_cpu), and kCheckedPrefetchBytes ahead into L1 elsewhere, as float32's checked loop does. On an AMD
  // EPYC (Zen 4, 2 cores, AVX-512) the L2 asks cost the exact bfloat16 get_total_norm a few percent (without them
  // 0.954 (0.942-0.986) of the time on GPT-2, 0.916 (0.892-0.986) on ResNet-50; `bench/compare_builds.py`, 12 pairs),
  // and the L1 asks gained as much (the figures above kCheckedPrefetchBytes).
  template <bool kAsksIntoL2, typename T>
  void add_checked_blocks_asking(const T* x, int64_t blocks) {
    const auto add_block = [&](const T* block) {
      if (!add_checked<kAsksIntoL2>(block)) {
        // (a 16-bit block a fresh plain run refused: add's would sum it again, against the same bound)
        add_bounded(block, kExactBlock, magnitude_bounds(block, kExactBlock), InPlace(),
            /*tries_plain=*/!kChecksPlain<T>);
      }
    };
    if (!std::is_same_v<T, float> || blocks < kTwoStreamsFrom) {
      for (int64_t j = 0; j < blocks; ++j) {
        add_block(x + j * kExactBlock);
      }
      return;
    }
    const int64_t half = blocks / 2;
    const T* second = x + half * kExactBlock;
    for (int64_t j = 0; j < half; ++j) {
      add_block(x + j * kExactBlock);
      add_block(second + j * kExactBlock);
    }
    if (blocks % 2 != 0) {
      add_block(x + (blocks - 1) * kExactBlock);
    }
  }

  // A whole block into the run its terms take, read once, or false, nothing added. 16-bit terms go to the plain run,
  // which starts a fresh one where it cannot take the block. float32 squares go to the quanta run: a full run's
  // successor starts at its top, a run with no top starts from the block's bounds (a span's first block, or after
  // blocks the check sent elsewhere).
  template <bool kAsksIntoL2, typename T>
  bool add_checked(const T* block) {
    if constexpr (kTakesQuanta<T>) {
      if (!quanta_.started()) {
        const MagnitudeBounds bounds = magnitude_bounds(block, kExactBlock);
        if (!(bounds.largest <= std::numeric_limits<float>::max()) || bounds.largest == 0.0 ||
            !quanta_.starts(term_range<kKind, T>(bounds))) {
          return false;  // (an inf or NaN, zeros, or terms too wide: add_bounded's)
        }
      } else if (quanta_.full_for(kExactBlock)) {
        const int top = quanta_.top();
        quanta_.flush(partial_);
        quanta_.start_at(top);
      }
      return quanta_.add_checked(block);
    } else {
      return plain_.template add_checked<kAsksIntoL2>(block, partial_);
    }
  }

  // `blocks` whole blocks from x, each summed by a loop that bounds the next (kPrefetchBytes' comment).
  template <typename T>
  void add_pipelined(const T* x, int64_t blocks) {
    MagnitudeBounds bounds = magnitude_bounds(x, kExactBlock);
    for (int64_t j = 0; j + 1 < blocks; ++j) {
      BoundsAhead<T> ahead(x + (j + 1) * kExactBlock);
      add_bounded(x + j * kExactBlock, kExactBlock, bounds, ahead);
      bounds = ahead.result();
    }
    add_bounded(x + (blocks - 1) * kExactBlock, kExactBlock, bounds);
  }

  // A block of at most kExactBlock values on its own: gathered, padded, or as it is.
  template <typename T>
  void add_short(const T* x, int64_t count) {
    if (gathers_ && (count % kBlock != 0 || count < kGatherBelow)) {
      gather(x, count);
    } else {
      add_padded(x, count);
    }
  }

  // A block that is not whole vectors, zero-padded (zeros add nothing; the bounds skip them), where its terms
  // one by one into the ExactSum cost as much as 100 elements' vector sums.
  template <typename T>
  void add_padded(const T* x, int64_t count) {
    const int64_t vectors = whole_vectors(count);
    if (vectors == count) {
      add_bounded(x, count, magnitude_bounds(x, count));
      return;
    }
    alignas(64) T padded[kExactBlock + BitsBounds<T>::kLanes];  // (copy_taking's room past the values)
    BitsBounds<T> bounds;
    bounds.copy_taking(x, count, padded);
    std::fill(padded + count, padded + vectors, T(0.0f));
    add_bounded(padded, vectors, bounds.result(), InBuffer());
  }

  // Values copied into the gathered block, their bounds taken with the copy, the block added when full, when
  // values of another type come, and at finish. 10,000 tensors of 100 float32 values, each its own padded block (its
  // bounds folded, its runs chosen, its copy), took 11.0M instructions a call, gathered 9.9M (today's norm 7.0M;
  // bfloat16 10.4M and 8.8M against 8.1M; callgrind, AVX2). Only blocks a copy would pad anyway, or too short to pay
  // for a block's work: copying whole-vector ones too, as 2,000 x 64x64's short first and last blocks are, took that
  // row's exact norm from 1.64 to 1.98x today's.
  template <typename T>
  void gather(const T* x, int64_t n) {
    const AddGathered add_these = &TermSums::add_gathered<T>;
    if (gathered_ != 0 && add_gathered_ != add_these) {
      (this->*add_gathered_)();
    }
    add_gathered_ = add_these;
    T* block = reinterpret_cast<T*>(gathered_bytes_);
    while (n > 0) {
      const int64_t taken = std::min(n, kExactBlock - gathered_);
      std::get<BitsBounds<T>>(gathered_bounds_).copy_taking(x, taken, block + gathered_);
      gathered_ += taken;
      x += taken;
      n -= taken;
      if (gathered_ == kExactBlock) {
        add_gathered<T>();
      }
    }
  }

  template <typename T>
  void add_gathered() {
    T* block = reinterpret_cast<T*>(gathered_bytes_);
    const int64_t vectors = whole_vectors(gathered_);
    std::fill(block + gathered_, block + vectors, T(0.0f));
    gathered_ = 0;
    BitsBounds<T>& running = std::get<BitsBounds<T>>(gathered_bounds_);
    const MagnitudeBounds bounds = running.result();
    running = BitsBounds<T>();
    add_bounded(block, vectors, bounds, InBuffer());
  }

  // A block whose bounds are known into the runs (`ahead`: BlockLies' comment; tries_plain false: to the quanta run
  // or the levels).
  template <typename T, typename Ahead = InPlace>
  void add_bounded(const T* block, int64_t vectors, const MagnitudeBounds& bounds, Ahead&& ahead = Ahead(),
      bool tries_plain = true) {
    if (!(bounds.largest <= std::numeric_limits<float>::max())) {
      add_terms<kKind>(block, vectors, partial_);  // an inf or NaN
      return;
    }
    if (bounds.largest == 0.0) {
      return;
    }
    const TermRange range = term_range<kKind, T>(bounds);
    if (tries_plain) {
      if (plain_.add(block, vectors, range, ahead)) {
        return;
      }
      if (!plain_.empty()) {  // a fresh plain run, with this block alone
        plain_.flush(partial_);
        if (plain_.add(block, vectors, range, ahead)) {
          return;
        }
      }
    }
    if (quanta_.takes(range, vectors)) {
      quanta_.add(block, vectors, range, ahead);
    } else {
      quanta_.flush(partial_);
      if (quanta_.starts(range)) {
        quanta_.add(block, vectors, range, ahead);
      } else {
        add_wide_block<kKind>(block, vectors, range, partial_);
      }
    }
  }

  using AddGathered = void (TermSums::*)();

  PlainRun<kKind> plain_;
  QuantaRun<kKind> quanta_;
  ExactPartial partial_;
  bool gathers_;
  int64_t gathered_ = 0;
  AddGathered add_gathered_ = nullptr;
  // (no double: added term by term; a vector's room past the values for copy_taking)
  alignas(64) unsigned char gathered_bytes_[kExactBlock * sizeof(float) + kVectorBytes];
  std::tuple<BitsBounds<float>, BitsBounds<c10::BFloat16>, BitsBounds<c10::Half>> gathered_bounds_;
};

template <NormKind kKind>
void add_piece(TermSums<kKind>& sums, const TensorSpan& span, int64_t begin, int64_t end) {
  dispatch_dtype(span.dtype, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    sums.add_span(static_cast<const T*>(span.data) + begin, end - begin);
  });
}

int64_t flags_of(const ExactPartial& partial) {
  return (partial.has_nan ? ExactSum::kSawNaN : 0) | (partial.has_inf ? ExactSum::kSawInf : 0);
}

template <NormKind kKind>
double rounded_norm(const ExactPartial& partial) {
  return partial.sum.norm(flags_of(partial), kKind == NormKind::Two);
}

int64_t bytes_of(DType dtype) {
  int64_t bytes = 0;
  dispatch_dtype(dtype, [&](auto* typed) { bytes = sizeof(*typed); });
  return bytes;
}

// The spans of a total alone, each run of spans that lie end to end in memory (one dtype) joined into one, or
// nothing where no two do. Gradients that are views of one buffer (DDP's buckets, FSDP's flat parameters, the
// benchmark's default) then are read as one long span: whole blocks read once and checked after, where 10,000
// tensors of 100 values were each copied into gathered blocks. An exact sum is a function of the values alone, so
// joining changes no bit of it. Only spans that meet end to end are joined, so a list naming a tensor twice, or
// views that overlap, still adds each listing.
std::vector<TensorSpan> joined_end_to_end(const TensorSpan* spans, int64_t count) {
  std::vector<TensorSpan> joined;
  const auto meets = [](const TensorSpan& before, const TensorSpan& after) {
    return before.dtype == after.dtype &&
        static_cast<const char*>(before.data) + before.numel * bytes_of(before.dtype) == after.data;
  };
  int64_t previous = -1;  // the last non-empty span
  bool any = false;
  for (int64_t k = 0; k < count && !any; ++k) {
    if (spans[k].numel != 0) {
      any = previous >= 0 && meets(spans[previous], spans[k]);
      previous = k;
    }
  }
  if (!any) {
    return joined;
  }
  for (int64_t k = 0; k < count; ++k) {
    if (spans[k].numel == 0) {
      continue;
    }
    if (!joined.empty() && meets(joined.back(), spans[k])) {
      joined.back().numel += spans[k].numel;
    } else {
      joined.push_back(spans[k]);
    }
  }
  return joined;
}

template <NormKind kKind>
void exact_norms_of(const TensorSpan* spans, int64_t count, double* norms, ExactSum* total, int32_t* total_flags) {
  std::vector<TensorSpan> joined;
  if (norms == nullptr) {
    joined = joined_end_to_end(spans, count);
    if (!joined.empty()) {
      spans = joined.data();
      count = static_cast<int64_t>(joined.size());
    }
  }
  const ChunkPlan plan = plan_chunks(spans, count);
  // Every thread adds into its own sums: exact sums merge in any order.
  std::vector<TermSums<kKind>> per_thread(at::get_num_threads(), TermSums<kKind>(norms == nullptr));
  ExactPartial all;
  if (norms == nullptr) {  // the total alone
    parallel_for_pieces(plan, spans, [&](const Piece& piece) {
      add_piece(per_thread[ItemPool::taker()], spans[piece.tensor], piece.begin, piece.end);
    });
  } else {
    // The pieces of a tensor cut into several each get a slot, merged below; whole tensors are finished where
    // they were summed.
    std::vector<int64_t> slot_of_piece(plan.pieces, -1);
    int64_t slots = 0;
    for (const Chunk& chunk : plan.chunks) {
      if (chunk.end_tensor - chunk.first_tensor == 1 && chunk.end - chunk.begin < spans[chunk.first_tensor].numel) {
        slot_of_piece[chunk.first_piece] = slots++;
      }
    }
    std::vector<ExactPartial> pieces(slots);
    parallel_for_pieces(plan, spans, [&](const Piece& piece) {
      TermSums<kKind> sums(false);
      add_piece(sums, spans[piece.tensor], piece.begin, piece.end);
      const ExactPartial& partial = sums.finish();
      if (slot_of_piece[piece.index] >= 0) {
        pieces[slot_of_piece[piece.index]] = partial;
        return;
      }
      norms[piece.tensor] = rounded_norm<kKind>(partial);
      per_thread[ItemPool::taker()].add_partial(partial);
    });
    ExactPartial whole;
    for (const Chunk& chunk : plan.chunks) {
      const int64_t slot = slot_of_piece[chunk.first_piece];
      if (slot < 0) {
        continue;
      }
      if (chunk.begin == 0) {
        whole = ExactPartial();
      }
      whole.add(pieces[slot]);
      if (chunk.end == spans[chunk.first_tensor].numel) {
        norms[chunk.first_tensor] = rounded_norm<kKind>(whole);
        all.add(whole);
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      if (spans[i].numel == 0) {
        norms[i] = 0.0;
      }
    }
  }
  for (TermSums<kKind>& sums : per_thread) {
    all.add(sums.finish());
  }
  *total = all.sum;
  *total_flags = static_cast<int32_t>(flags_of(all));
}

}  // namespace

void exact_norms(const TensorSpan* spans, int64_t count, NormKind kind, double* norms, ExactSum* total,
    int32_t* total_flags) {
  if (kind == NormKind::One) {
    exact_norms_of<NormKind::One>(spans, count, norms, total, total_flags);
  } else {
    exact_norms_of<NormKind::Two>(spans, count, norms, total, total_flags);
  }
}

}  // namespace torchclip::cpu
