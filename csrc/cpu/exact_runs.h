// The runs that sum the exact norms' blocks in float64 lanes (exact_norm_kernel.cpp's comment has the design):
// the plain run, terms added as they are, and the quanta run, terms added as quanta and remainders; a block too
// wide for either goes to the levels. Included only by exact_norm_kernel.cpp: internal linkage, compiled once per
// instruction set.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "exact_blocks.h"
#include "inexact_flag.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

// Terms added as they are, in four vectors of float64 lanes (four, so the additions' latency overlaps), checked after
// the fact by the processor's inexact flag (inexact_flag.h): the lanes are exact sums while no addition into them
// rounded. A block read once is summed into lanes of its own, refused where that rounds, and its lanes added into the
// run's; where that rounds, the run is flushed and the block's lanes start a fresh one (add_checked). A NaN or inf
// adds without rounding and stays in its lane, for flush to report.
//
// The flag replaced bounds the run kept of its terms: the smallest non-zero magnitude of every 16-bit value (three
// operations a vector in the checked loop, beside ten that sum), the lowest bit and top they gave, and a check of
// every lane against them after each block, which refused sums that had not rounded (a lane's bound a priori, 2^53
// times the lowest bit any term could have). 1M values in L3, one thread, 2 AMD EPYC cores (Zen 4): bfloat16 0.096 ->
// 0.0855 ns an element with AVX-512, 0.118-0.124 -> 0.113 with AVX2; float16 0.119 -> 0.112 and 0.114 -> 0.108. Build
// against build (`TORCHCLIP_EXACT_NORM=1 bench/compare_builds.py`, 10 pairs, AVX-512): GPT-2 bfloat16's exact norm
// took 0.905 (0.888-0.915) of the time on one thread, ResNet-50's 0.892 (0.818-0.907), float16's 0.939 and 0.946;
// on two threads, bound by memory more than by the loop, 0.96-1.00 (every interval but GPT-2 float16's across 1).
// What is left of the loop is its conversions to float64: on these cores a 512-bit vcvtps2pd issues every other
// cycle, so the four a 64-byte step takes cost 8 cycles, its four fused multiply-adds 4 (docs/exact-norms-record.md,
// "The inexact flag as the plain run's check", has the harness's figures and the widenings tried instead).
template <NormKind kKind>
class PlainRun {
 public:
  // A block whose own bounds leave its lanes more than this many bits over 53 is not tried (add): it would round, its
  // sum spent for nothing.
  static constexpr int kHopefulBits = 6;

  bool empty() const { return terms_ == 0; }

  // Adds the block and returns true, or leaves the run as it was and returns false (`next`: BlockLies' comment).
  template <typename T, typename Ahead>
  bool add(const T* x, int64_t vectors, const TermRange& range, Ahead& next) {
    // (a lane takes one term of each 4 kBlock64, and one more from a block's tail of half that: ceil)
    const int64_t lane_terms = (vectors + 4 * kBlock64 - 1) / (4 * kBlock64);
    if (!inexact_flag_works() || range.top + count_bits(lane_terms) - range.lowest_bit > 53 + kHopefulBits) {
      return false;
    }
    clear_inexact();
    f64v sums[4] = {sums_[0], sums_[1], sums_[2], sums_[3]};  // (in locals: see QuantaRun::add)
    for (f64v& sum : sums) {
      pinned(sum);
    }
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
    if (inexact_after(sums[0], sums[1], sums[2], sums[3])) {
      return false;  // (the run's own sums untouched)
    }
    for (int j = 0; j < 4; ++j) {
      sums_[j] = sums[j];  // (sum_block's comment)
    }
    terms_ += vectors;
    return true;
  }

  // A whole block of 16-bit values read once (TermSums::add_checked_blocks), summed into lanes of its own and checked
  // after by the flag alone: no bounds are taken of it. Returns false, nothing of the block added, where it rounds
  // alone (the caller bounds it and finds it a run that takes it). Its lanes then join the run's where each lane's sum
  // is exact (join); where one is not, the run is flushed into `out` and the block's lanes start a fresh one. Summed
  // into the run's lanes as they stood, a block that rounded there was read and summed again after the flush: 5% of
  // Gaussian blocks and 10% of a GPT-2-style model's bfloat16 gradients (the bench's gpt2-small-backward). Joined,
  // the exact norm of those took 0.927 (0.895-0.948) of the time on one thread and 0.902 (0.867-0.951) on two, for a
  // second read of the flag a block: float16's took 1.013 (1.001-1.016) on one thread
  // (docs/exact-norms-record.md, "Real gradients rise more").
  // The flag must be down when it is called, and is when it returns: a read of it on entry too, to lower it, cost
  // 3-4% (1M bfloat16 values in L3: 0.088 against 0.085 ns an element).
  // kOnIntel: which side's asks ahead (TermSums::add_checked_blocks_asking's comment).
  template <bool kOnIntel, typename T>
  bool add_checked(const T* x, ExactPartial& out) {
    if (!inexact_flag_works()) {
      return false;
    }
    f64v block[4];
    if (!sum_block<kOnIntel>(x, block)) {
      return false;
    }
    if (!join(block)) {
      flush(out);
      clear_inexact();  // (raised by the join's sums, and whatever the flush's arithmetic did)
      for (int j = 0; j < 4; ++j) {
        sums_[j] = block[j];
      }
    }
    terms_ += kExactBlock;
    return true;
  }

  // The lanes into `out`, and a fresh run: as one integer count of the least lane's last bit where the lanes lie within
  // kFlushSpanBits binades of each other (a block's lanes hold like sums), else lane by lane.
  void flush(ExactPartial& out) {
    if (!empty()) {
      if (any_lane_not_below(splat<f64v>(std::numeric_limits<double>::infinity()), sums_[0], sums_[1], sums_[2],
              sums_[3])) {
        add_non_finite(out);
      } else {
        add_finite(out);
      }
    }
    *this = PlainRun();
  }

 private:
  static constexpr int kFlushSpanBits = 6;

  // The block's terms summed into `block`'s lanes (true), or false where an addition rounded. Its vectors go into
  // kCheckedSumSets sets of lanes in turn (that constant's comment).
  template <bool kOnIntel, typename T>
  static bool sum_block(const T* x, f64v (&block)[4]) {
    f64v sets[kCheckedSumSets][4] = {};
    for (f64v(&set)[4] : sets) {
      for (f64v& sum : set) {
        pinned(sum);
      }
    }
    for (int64_t i = 0; i < kExactBlock; i += kCheckedSumSets * 2 * kBlock) {
      for (int set = 0; set < kCheckedSumSets; ++set) {
        const T* at = x + i + set * 2 * kBlock;
        if constexpr (kOnIntel) {
          __builtin_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, 0, 1);
        } else {
          __builtin_prefetch(reinterpret_cast<const char*>(at) + kCheckedPrefetchBytes, 0, 3);
        }
        add_pair(at, sets[set]);
      }
    }
    for (int set = 1; set < kCheckedSumSets; ++set) {
      for (int j = 0; j < 4; ++j) {
        sets[0][j] += sets[set][j];
      }
    }
    if (inexact_after(sets[0][0], sets[0][1], sets[0][2], sets[0][3])) {
      clear_inexact();
      return false;
    }
    for (int j = 0; j < 4; ++j) {
      block[j] = sets[0][j];
    }
    return true;
  }

  // The block's lanes added into the run's where every lane's sum is exact (true), else the run's lanes as they were
  // and the flag raised: the flag's second read in a block, after the one that found the block's own sums exact.
  bool join(const f64v (&block)[4]) {
    f64v sums[4];
    for (int j = 0; j < 4; ++j) {
      sums[j] = sums_[j] + block[j];
    }
    if (inexact_after(sums[0], sums[1], sums[2], sums[3])) {
      return false;
    }
    // (lane by lane: through std::copy the lanes went by way of the stack, with AVX2 in 16-byte moves, which the next
    // block's 32-byte loads of them waited on; 1M bfloat16 values in L3, one thread: 0.113 -> 0.105 ns an element with
    // AVX2, 0.0855 -> 0.0825 with AVX-512)
    for (int j = 0; j < 4; ++j) {
      sums_[j] = sums[j];
    }
    return true;
  }

  // Lanes of exact sums, not negative: each non-zero lane v lies in [2^(e - 1), 2^e) for e = binade_end(v), so it is
  // a multiple of its last bit 2^(e - 53), and of the least lane's; counted in that unit, the largest is below
  // 2^(53 + kFlushSpanBits), four vectors' sum below 2^61.
  void add_finite(ExactPartial& out) const {
    const auto larger = [](f64v a, f64v b) { return a > b ? a : b; };
    const double largest = fold_lanes(larger(larger(sums_[0], sums_[1]), larger(sums_[2], sums_[3])), larger);
    if (largest == 0.0) {
      return;
    }
    const auto smaller_non_zero = [](f64v a, f64v b) { return (((a < b) & (a != 0.0)) | (b == 0.0)) ? a : b; };
    const double least = fold_lanes(
        smaller_non_zero(smaller_non_zero(sums_[0], sums_[1]), smaller_non_zero(sums_[2], sums_[3])), smaller_non_zero);
    const int least_bit = binade_end(least) - 53;
    if (binade_end(largest) - binade_end(least) > kFlushSpanBits) {
      for (const f64v& sum : sums_) {
        for (int lane = 0; lane < kBlock64; ++lane) {
          out.sum.add(sum[lane]);
        }
      }
      return;
    }
    const double scale = power_of_two(-least_bit);
    i64v counts = i64v{};
    for (const f64v& sum : sums_) {
      counts += __builtin_convertvector(sum * scale, i64v);
    }
    unsigned __int128 count = 0;
    for (int lane = 0; lane < kBlock64; ++lane) {
      count += counts[lane];
    }
    out.sum.add_scaled(count, least_bit, false);
  }

  // A NaN or inf in the lanes: the sum is NaN or inf whatever the finite lanes add.
  void add_non_finite(ExactPartial& out) const {
    for (const f64v& sum : sums_) {
      for (int lane = 0; lane < kBlock64; ++lane) {
        out.has_nan |= std::isnan(sum[lane]);
        out.has_inf |= std::isinf(sum[lane]);
      }
    }
  }

  // The 2 * kBlock values at x into the four sums.
  template <typename T>
  static void add_pair(const T* x, f64v* sums) {
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      f64v wide[4];
      load_f64_interleaved<kKind == NormKind::One>(x, wide);
      for (int k = 0; k < 4; ++k) {
        add_term(wide[k], sums[k]);
      }
    } else {
      add_vector(load_f32(x), sums[0], sums[1]);
      add_vector(load_f32(x + kBlock), sums[2], sums[3]);
    }
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
  int64_t terms_ = 0;
};

// Terms added as quanta and remainders, four operations per term: each lane's quanta are summed in a
// running sum biased by 2^(52 + k), k = top_ - 43, whose last bit weighs the quantum 2^k: adding a term
// rounds it to a multiple of 2^k, and the sum's step is that multiple, exactly. A lane adds at most 512
// terms of at most 2^(k + 43) - which keeps it below 2^(53 + k), in one binade, its mantissa bits the count
// of its quanta - and the remainders, each at most 2^(k - 1), are summed in lanes of their own over one block
// at most (kBlockLaneTerms a lane), below 2^(k - 1 + kBlockLaneBits): exact when every term is a multiple of
// 2^(k - 1 + kBlockLaneBits - 53) = 2^(k - kRestBits). After each block those lanes become integer counts of that
// unit (count_rests), and start the next at 0. For p = 2 each use of a square is written out for FMA contraction
// (exact either way: the square is).
template <NormKind kKind>
class QuantaRun {
 public:
  static constexpr int kTopHeadroom = 2;  // a run's top above its first block's: later blocks up to 2x larger join

  // A block's terms each remainder lane takes at most, and its log2: 64 with AVX-512, 128 with AVX2.
  static constexpr int64_t kBlockLaneTerms = kExactBlock / (2 * kBlock64);
  static constexpr int kBlockLaneBits = kBlockLaneTerms == 64 ? 6 : kBlockLaneTerms == 128 ? 7 : 8;
  static_assert(int64_t{1} << kBlockLaneBits == kBlockLaneTerms, "a lane's terms a block: a power of two");

  // How far below the quantum a term's bits may reach: 48 with AVX-512, 47 with AVX2. With the remainders summed over a
  // whole run (8,192 terms) it was 41: a float32 block with a value below about 2^-16 of its largest failed the
  // checked loop's check and was bounded and split over levels, which took 1.6% of the samples of a one-thread exact
  // norm of 1M Gaussian values in L3 (`perf record`, 2 AMD EPYC cores, AVX-512), 0.2% now; the norm took 0.146-0.147 ns
  // an element against 0.146-0.151. Gradients with more values near zero send more blocks there.
  static constexpr int kRestBits = 53 - kBlockLaneBits + 1;

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
  void add(const T* x, int64_t vectors, Ahead& next) {
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
  // kOnIntel: which side's asks ahead (TermSums::add_checked_blocks_asking's comment).
  template <bool kOnIntel, typename T>
  bool add_checked(const T* x) {
    static_assert(kHalvesFor<T>, "float32 squares: the quanta run's terms");
    if constexpr (kCheckedSumSets == 2) {
      return add_checked_with<PairedLanes, kOnIntel>(x);
    } else {
      return splits_wide_ops() ? add_checked_with<HalfWidthLanes, kOnIntel>(x)
                               : add_checked_with<FullWidthLanes, kOnIntel>(x);
    }
  }

  void flush(ExactPartial& out) {
    if (terms_ != 0) {
      // The lanes' quanta and the remainders' counts as one count of 2^(k - kRestBits), one ExactSum addition: the
      // total, the terms' sum, is not negative.
      constexpr uint64_t kMantissa = (uint64_t{1} << 52) - 1;
      const int k = top_ - kQuantumBits;
      const u64v quanta = ((u64v)sums_[0] & kMantissa) + ((u64v)sums_[1] & kMantissa);
      __int128 count = 0;
      for (int lane = 0; lane < kBlock64; ++lane) {
        count += quanta[lane];
      }
      int64_t rest = 0;  // (a run's 8,192 remainders, each at most 2^(kRestBits - 1) units: below 2^60)
      for (int lane = 0; lane < kBlock64; ++lane) {
        rest += rest_counts_[lane];
      }
      count = count * (__int128{1} << kRestBits) + rest;
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
    static constexpr int64_t kVectors = 1;  // (a step's vectors: add's)
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
    static constexpr int64_t kVectors = 1;
    typedef double f64half __attribute__((vector_size(kVectorBytes / 2)));
    f64half sums[4], rests[4];

    static f64half lower(f64v v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); }
    static f64half upper(f64v v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); }
    static f64v whole(f64half a, f64half b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7); }

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

    f64v sums_low() const { return whole(sums[0], sums[1]); }
    f64v sums_high() const { return whole(sums[2], sums[3]); }

    void store(QuantaRun& run) const {
      run.sums_[0] = sums_low();
      run.sums_[1] = sums_high();
      run.rests_[0] = whole(rests[0], rests[1]);
      run.rests_[1] = whole(rests[2], rests[3]);
    }
  };
  static bool splits_wide_ops() { return !intel_cpu(); }
#else
  using HalfWidthLanes = FullWidthLanes;
  static bool splits_wide_ops() { return false; }
#endif

  // Two FullWidthLanes, the second adding every other vector (kCheckedSumSets). Both are biased by 2^(52 + k): the
  // second's quanta, its lanes less the bias (exact within the binade), join the first's in one addition; a lane that
  // left its binade makes the joined lane fail add_checked's check.
  struct PairedLanes {
    static constexpr int64_t kVectors = 2;
    FullWidthLanes first, second;
    f64v bias;

    explicit PairedLanes(const QuantaRun& run) : first(run), second(fresh_like(run)), bias(second.sum_low) {}

    static QuantaRun fresh_like(const QuantaRun& run) {
      QuantaRun fresh;
      fresh.start_at(run.top_);
      return fresh;
    }

    template <typename T>
    void add(const T* at) {
      first.add(at);
      second.add(at + kBlock);
    }

    f64v sums_low() const { return first.sum_low + (second.sum_low - bias); }
    f64v sums_high() const { return first.sum_high + (second.sum_high - bias); }

    void store(QuantaRun& run) const {
      run.sums_[0] = sums_low();
      run.sums_[1] = sums_high();
      run.rests_[0] = first.rest_low + second.rest_low;  // (exact: every remainder is a multiple of 2^(k - kRestBits))
      run.rests_[1] = first.rest_high + second.rest_high;
    }
  };

  template <typename Lanes, typename T, typename Ahead>
  void add_with(const T* x, int64_t vectors, Ahead& next) {
    static_assert(Lanes::kVectors == 1, "a vector a step");
    // (vectors: a block's at most, each lane's remainders within kRestBits' bound: add_bounded's blocks)
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
    count_rests();
    next = ahead;
  }

  template <typename Lanes, bool kOnIntel, typename T>
  bool add_checked_with(const T* x) {
    Lanes lanes(*this);
    SmallestBits<T> smallest;
    for (int64_t i = 0; i < kExactBlock; i += Lanes::kVectors * kBlock) {
      for (int64_t vector = 0; vector < Lanes::kVectors; ++vector) {
        const char* at = reinterpret_cast<const char*>(x + i + vector * kBlock);
        if constexpr (kOnIntel) {
          __builtin_prefetch(at + kCheckedPrefetchBytes, 0, 3);
        }
        smallest.take(at);
      }
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
    count_rests();
    terms_ = terms;
    return true;
  }

  // The remainder lanes of a block as integer counts of 2^(k - kRestBits) (each a multiple of it, exact_for, below
  // 2^(k - 1 + kBlockLaneBits): below 2^53 of the unit), added to the run's, the lanes then 0 for the next block.
  void count_rests() {
    const f64v unit = splat<f64v>(power_of_two(kRestBits - (top_ - kQuantumBits)));
    rest_counts_ += __builtin_convertvector(rests_[0] * unit, i64v) + __builtin_convertvector(rests_[1] * unit, i64v);
    rests_[0] = rests_[1] = f64v{};
  }

  f64v sums_[2] = {}, rests_[2] = {};
  i64v rest_counts_ = {};
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

}  // namespace
}  // namespace torchclip::cpu
