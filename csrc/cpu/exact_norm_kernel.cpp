// Exact norms, p = 1 and p = 2: each tensor's sum of |x| or x^2 held exactly (exact_sum.h), its norm the
// correctly rounded value, and the sum of every tensor's terms handed back exactly for the total.
//
// Why the fast path is exact: a 16/32-bit value's magnitude (24 bits) and square (48 bits) are exact in
// float64. A block of kExactBlock = 2^10 terms, all below 2^top, is summed in float64 lanes as q + r per
// term: q is the term rounded to a multiple of 2^(top - 43) (adding and subtracting 1.5 * 2^52 times that
// quantum), r = term - q the exact remainder, |r| <= 2^(top - 44). The q sum is below 2^53 quanta, so
// exact; the r sum is below 2^(top - 34) and exact when every term is a multiple of 2^(top - 87), which
// the block's smallest non-zero magnitude tells (a term's last bit is no lower than its own). Blocks that
// fail it (a term below about 2^-40 times the largest, for p = 2) split each term over more quanta, one
// level per 43 bits; float64 data is added term by term (its squares are 106-bit products).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "multi_tensor.h"
#include "simd.h"

namespace torchclip::cpu {
namespace {

using namespace simd;

constexpr int64_t kExactBlock = 1024;
constexpr int kQuantumBits = 43;  // 2^10 terms of < 2^43 quanta each: every partial sum below 2^53 quanta
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
    halves_of<kKind>(load_f32(x + i), low, high);
    split(kKind == NormKind::Two ? low * low : low);
    split(kKind == NormKind::Two ? high * high : high);
  }
  add_sums(sums, levels + 1, out);
}

// add_levels with one level, the common case, in four operations per term: each lane's quanta are
// summed in a running sum biased by 2^(52 + k), k = top - 43, whose last bit weighs the quantum 2^k:
// adding a term rounds it to a multiple of 2^k, and the sum's step is that multiple, exactly. A lane
// adds at most 256 terms below 2^top = 2^(k + 43), so it stays below 2^(53 + k), in one binade. For
// p = 2 each use of a square is written out for FMA contraction (exact either way: the square is).
template <NormKind kKind, typename T>
void add_one_level(const T* x, int64_t vectors, int top, ExactPartial& out) {
  const f64v bias = splat<f64v>(std::ldexp(1.0, top - kQuantumBits + 52));
  f64v sum_low = bias, sum_high = bias, rest_low{}, rest_high{};
  for (int64_t i = 0; i < vectors; i += kBlock) {
    f64v low, high;
    halves_of<kKind>(load_f32(x + i), low, high);
    if constexpr (kKind == NormKind::Two) {
      const f64v next_low = low * low + sum_low, next_high = high * high + sum_high;
      rest_low += low * low - (next_low - sum_low);
      rest_high += high * high - (next_high - sum_high);
      sum_low = next_low;
      sum_high = next_high;
    } else {
      const f64v next_low = low + sum_low, next_high = high + sum_high;
      rest_low += low - (next_low - sum_low);
      rest_high += high - (next_high - sum_high);
      sum_low = next_low;
      sum_high = next_high;
    }
  }
  const f64v sums[2] = {(sum_low - bias) + (sum_high - bias), rest_low + rest_high};
  add_sums(sums, 2, out);
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

// magnitude_bounds over n elements, on the bit patterns in full-width vectors of the storage type (32
// 16-bit lanes with AVX-512: no conversion to float32, half the work of the float32 lanes per element);
// bits - 1 sends a zero to the top, out of the minimum's way.
template <typename T>
MagnitudeBounds magnitude_bounds(const T* x, int64_t n) {
  using Bits = StorageBits<T>;
  typedef Bits BitsV __attribute__((vector_size(kVectorBytes)));
  constexpr int64_t kLanes = kVectorBytes / sizeof(Bits);
  constexpr Bits kAllOnes = std::numeric_limits<Bits>::max(), kSignless = kAllOnes >> 1;
  BitsV max_bits{}, min_less_one = splat<BitsV>(kAllOnes);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    BitsV bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bits &= kSignless;
    max_bits = max_bits > bits ? max_bits : bits;
    const BitsV less_one = bits - splat<BitsV>(1);
    min_less_one = min_less_one < less_one ? min_less_one : less_one;
  }
  Bits largest = 0, smallest_less_one = kAllOnes;
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    largest = std::max<Bits>(largest, max_bits[lane]);
    smallest_less_one = std::min<Bits>(smallest_less_one, min_less_one[lane]);
  }
  for (; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    bits &= kSignless;
    largest = std::max(largest, bits);
    smallest_less_one = std::min(smallest_less_one, static_cast<Bits>(bits - 1));
  }
  const Bits smallest = static_cast<Bits>(smallest_less_one + 1);  // 0 when every value is 0
  return {from_bits<T>(largest), smallest == 0 ? std::numeric_limits<double>::infinity() : from_bits<T>(smallest)};
}

// One block (n <= kExactBlock elements of a 16/32-bit type) into `out`.
template <NormKind kKind, typename T>
void add_block(const T* x, int64_t n, ExactPartial& out) {
  const int64_t vectors = n / kBlock * kBlock;
  const auto [largest, smallest] = magnitude_bounds(x, vectors);
  int levels = 1, top = 0;
  if (largest > 0.0 && largest <= std::numeric_limits<float>::max()) {
    int low_exponent;
    std::frexp(kKind == NormKind::Two ? largest * largest : largest, &top);  // every term < 2^top
    std::frexp(smallest, &low_exponent);
    // Every term is a multiple of 2^lowest_bit; a remainder sum is exact from 2^(top - 43 levels - 44) up.
    const int last_bit = low_exponent - 1 - kTrailingBits<T>;
    const int lowest_bit = kKind == NormKind::Two ? 2 * last_bit : last_bit;
    while (levels < kMaxLevels && lowest_bit < top - kQuantumBits * levels - 44) {
      ++levels;
    }
  }
  if (!(largest <= std::numeric_limits<float>::max()) || levels == kMaxLevels) {
    add_terms<kKind>(x, vectors, out);  // an inf or NaN
  } else if (largest > 0.0) {
    if (levels == 1) {
      add_one_level<kKind>(x, vectors, top, out);
    } else {
      add_levels<kKind>(x, vectors, top, levels, out);
    }
  }
  add_terms<kKind>(x + vectors, n - vectors, out);
}

template <NormKind kKind, typename T>
void add_span(const T* x, int64_t n, ExactPartial& out) {
  if constexpr (std::is_same_v<T, double>) {
    add_terms<kKind>(x, n, out);
  } else {
    for (int64_t begin = 0; begin < n; begin += kExactBlock) {
      add_block<kKind>(x + begin, std::min(kExactBlock, n - begin), out);
    }
  }
}

ExactPartial reduce_piece(const TensorSpan& span, int64_t begin, int64_t end, NormKind kind) {
  ExactPartial partial;
  dispatch_dtype(span.dtype, [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    const T* data = static_cast<const T*>(span.data) + begin;
    if (kind == NormKind::One) {
      add_span<NormKind::One>(data, end - begin, partial);
    } else {
      add_span<NormKind::Two>(data, end - begin, partial);
    }
  });
  return partial;
}

int64_t flags_of(const ExactPartial& partial) {
  return (partial.has_nan ? ExactSum::kSawNaN : 0) | (partial.has_inf ? ExactSum::kSawInf : 0);
}

double rounded_norm(const ExactPartial& partial, NormKind kind) {
  return partial.sum.norm(flags_of(partial), kind == NormKind::Two);
}

}  // namespace

void exact_norms(const TensorSpan* spans, int64_t count, NormKind kind, double* norms, ExactSum* total,
    int32_t* total_flags) {
  const ChunkPlan plan = plan_chunks(spans, count);
  // The pieces of a tensor cut into several each get a slot, merged below; whole tensors are finished
  // where they were summed. Every thread adds into its own total: exact sums merge in any order.
  std::vector<int64_t> slot_of_piece(plan.pieces, -1);
  int64_t slots = 0;
  for (const Chunk& chunk : plan.chunks) {
    if (chunk.end_tensor - chunk.first_tensor == 1 && chunk.end - chunk.begin < spans[chunk.first_tensor].numel) {
      slot_of_piece[chunk.first_piece] = slots++;
    }
  }
  std::vector<ExactPartial> pieces(slots);
  std::vector<ExactPartial> per_thread(at::get_num_threads());
  parallel_for_pieces(plan, spans, [&](const Piece& piece) {
    const ExactPartial partial = reduce_piece(spans[piece.tensor], piece.begin, piece.end, kind);
    if (slot_of_piece[piece.index] >= 0) {
      pieces[slot_of_piece[piece.index]] = partial;
      return;
    }
    if (norms != nullptr) {
      norms[piece.tensor] = rounded_norm(partial, kind);
    }
    per_thread[at::get_thread_num()].add(partial);
  });
  ExactPartial all;
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
      if (norms != nullptr) {
        norms[chunk.first_tensor] = rounded_norm(whole, kind);
      }
      all.add(whole);
    }
  }
  for (int64_t i = 0; i < count && norms != nullptr; ++i) {
    if (spans[i].numel == 0) {
      norms[i] = 0.0;
    }
  }
  for (const ExactPartial& partial : per_thread) {
    all.add(partial);
  }
  *total = all.sum;
  *total_flags = static_cast<int32_t>(flags_of(all));
}

}  // namespace torchclip::cpu
