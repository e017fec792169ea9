// Exact norms, p = 1 and p = 2: each tensor's sum of |x| or x^2 held exactly (exact_sum.h), its norm the
// correctly rounded value, and the sum of every tensor's terms handed back exactly for the total.
//
// Why the fast paths are exact: a 16/32-bit value's magnitude (24 bits) and square (48 bits) are exact in
// float64, and a sum of float64 values is exact when every term is a multiple of some 2^b and every partial
// sum is below 2^(b + 53). Each block of kExactBlock = 2^10 values is bounded (its largest magnitude, and
// its smallest non-zero one, below whose last bit no term's last bit lies) and joins one of two runs summed in
// float64 lanes, handed to the ExactSum only when a block cannot join or the run is full (the quanta run's
// kRunTerms, 2^13 terms). A long span's whole blocks of 16-bit values or float32 squares are read once instead: the
// run adds the terms, then checks that they were exact (add_checked), and a block that fails is bounded and joins
// as any other:
// - the plain run adds the terms as they are, exact while none of its additions rounds, which the processor's
//   inexact flag tells it (inexact_flag.h): a lane holds squares of bfloat16 values spanning about 2^15, of float16
//   values about 2^12, magnitudes spanning about 2^38 (bfloat16), 2^35 (float16), 2^22 (float32), fewer the more
//   terms it holds;
// - the quanta run adds each term as q + r: q the term rounded to a multiple of the quantum 2^(top - 43),
//   in a lane biased by 2^(52 + top - 43), whose last bit is that quantum, so the rounding is the addition
//   itself and the lane's mantissa bits count its quanta; r = term - q, |r| <= half a quantum, in a plain
//   lane, exact while the terms' last bits reach no lower than 2^(top - 84).
// Blocks neither run takes (a term below about 2^-40 times the largest, for p = 2) split each term over
// more quanta, one level per 43 bits; float64 data is added term by term (its squares are 106-bit
// products). Runs span blocks, and tensors where only the total is wanted, because handing a block's sums
// to the ExactSum (horizontal sums, two additions of a few digits) cost about a third of summing the block.
//
// A block's terms and bounds are exact_blocks.h's, the two runs exact_runs.h's; here, the walk: spans cut into
// blocks (read once and checked, pipelined, or gathered) and the norms from the sums.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "exact_blocks.h"
#include "exact_runs.h"
#include "inexact_flag.h"
#include "kernels.h"
#include "multi_tensor.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

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
  // A span this many whole blocks long or longer is read as two streams, its two halves' blocks in turn: on 2 AMD
  // EPYC cores (Zen 4) one thread's exact norm of ResNet-50's float32 gradients took 0.79-0.87x the time of one
  // stream, GPT-2's 0.93x; on two threads 0.98-1.01x (a scratch build switching per call, 30-60 alternated calls),
  // and 0.90x for GPT-2 once tensors were cut into longer pieces (multi_tensor.h). 16-bit blocks had measured
  // 1.03-1.08x in pieces of 64K elements; in the longer pieces, build against build (`TORCHCLIP_EXACT_NORM=1
  // bench/compare_builds.py`, 12 pairs), bfloat16 and float16 GPT-2 and ResNet-50 took 0.93-0.99x the time of one
  // stream on 1 and 2 threads.
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

  // kOnIntel: the asks ahead of Intel CPUs (simd::intel_cpu), whose hardware prefetchers stop at 4 KiB pages, or
  // of the others. On Intel, 16-bit blocks read once ask for their lines kPrefetchBytes ahead into L2, float32's
  // kCheckedPrefetchBytes ahead into L1. Elsewhere 16-bit blocks ask kCheckedPrefetchBytes ahead into L1, and float32's
  // ask nothing. On an AMD EPYC (Zen 4, 2 cores, AVX-512) the L2 asks cost the exact bfloat16 get_total_norm a few
  // percent (without them 0.954 (0.942-0.986) of the time on GPT-2, 0.916 (0.892-0.986) on ResNet-50;
  // `bench/compare_builds.py`, 12 pairs), and the L1 asks gained as much (the figures above kCheckedPrefetchBytes, in
  // exact_blocks.h); float32's L1 asks cost what the figures there say.
  template <bool kOnIntel, typename T>
  void add_checked_blocks_asking(const T* x, int64_t blocks) {
    clear_inexact();  // (PlainRun::add_checked's precondition; the other runs raise it)
    const auto add_block = [&](const T* block) {
      if (!add_checked<kOnIntel>(block)) {
        // (a 16-bit block a fresh plain run refused: it rounds alone, and add's would find that again)
        add_bounded(block, kExactBlock, magnitude_bounds(block, kExactBlock), InPlace(),
            /*tries_plain=*/!kChecksPlain<T>);
        clear_inexact();
      }
    };
    if (blocks < kTwoStreamsFrom) {
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
  template <bool kOnIntel, typename T>
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
      return quanta_.template add_checked<kOnIntel>(block);
    } else {
      return plain_.template add_checked<kOnIntel>(block, partial_);
    }
  }

  // `blocks` whole blocks from x, each summed by a loop that bounds the next (kPrefetchBytes' comment, exact_blocks.h).
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
      quanta_.add(block, vectors, ahead);
    } else {
      quanta_.flush(partial_);
      if (quanta_.starts(range)) {
        quanta_.add(block, vectors, ahead);
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
    parallel_for_pieces<ExactFloatState>(plan, spans, [&](const Piece& piece) {
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
    parallel_for_pieces<ExactFloatState>(plan, spans, [&](const Piece& piece) {
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
  const ExactFloatState state;  // (the runs' last flushes)
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
