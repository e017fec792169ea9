// An exact sum of float64 values and of exact squares, and its correctly rounded value and square root:
// the norm as a function of the gradients alone, whatever the order, the threads or the pieces it was
// summed in. Plain C++ (no ATen), so the per-ISA kernel libraries, the ops and the CUDA kernels (host and
// device code: nvcc sees every member as __host__ __device__) share it.
//
// The sum is a fixed-point number of kDigits base-2^32 digits: bit i weighs 2^(i - kBias), from 2^-2176
// (below the square of float64's smallest subnormal, 2^-2148) to 2^2176 (above the largest square,
// 2^2048, times 2^64 terms). Each digit is an int64 holding its 32 bits plus carries not yet propagated,
// so an addition touches at most five digits and carries only every 2^30 additions. Only the window of
// digits that may be non-zero is ever read, zeroed as it widens, or copied: a small tensor's sum costs a
// few digits, not the whole 1.1 KB.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TORCHCLIP_HOST_DEVICE __host__ __device__
#else
#define TORCHCLIP_HOST_DEVICE
#endif

namespace torchclip {

namespace exact_sum_detail {
// The leading zeros of a non-zero 64-bit value, on the host and on the device.
TORCHCLIP_HOST_DEVICE inline int leading_zeros(uint64_t v) {
#if defined(__CUDA_ARCH__)
  return __clzll(static_cast<long long>(v));
#else
  return __builtin_clzll(v);
#endif
}

// v = mantissa * 2^exponent with an integer mantissa < 2^53 (v finite; its sign dropped).
TORCHCLIP_HOST_DEVICE inline uint64_t split(double v, int* exponent) {
  uint64_t bits;
  memcpy(&bits, &v, sizeof(bits));
  const int biased = static_cast<int>((bits >> 52) & 0x7FF);
  const uint64_t fraction = bits & ((uint64_t{1} << 52) - 1);
  *exponent = biased == 0 ? -1074 : biased - 1075;
  return biased == 0 ? fraction : fraction | (uint64_t{1} << 52);
}
}  // namespace exact_sum_detail

// A non-negative sum's digits after carrying (each in [0, 2^32)), read where they lie: its top bit, its
// rounding and its square root's, with no copy of the digits. ExactSum rounds through one; the CUDA kernels
// round digits in shared memory through one, where an ExactSum copy would be a 1.1 KB stack frame per thread,
// which the driver reserves for every thread the GPU can hold.
class CarriedDigits {
 public:
  static constexpr int kDigitBits = 32;
  static constexpr int kBias = 2176;  // bit 0 weighs 2^-kBias (ExactSum's digits)

  // digits[bottom, top] hold the sum (top < bottom: zero); the rest are not read.
  TORCHCLIP_HOST_DEVICE CarriedDigits(const int64_t* digits, int bottom, int top)
      : digits_(digits), bottom_(bottom), top_(top) {}

  // Carries digits[bottom, top] in place (the carry may run past top, up to `count` digits) and returns the
  // window of those non-zero after it. Every digit ends in [0, 2^32) except the last one that holds anything,
  // which keeps the sign of a negative sum (lower digits are then its positive remainder).
  TORCHCLIP_HOST_DEVICE static CarriedDigits carry(int64_t* digits, int count, int bottom, int top) {
    if (top < bottom) {
      return CarriedDigits(digits, count, -1);
    }
    int64_t carry = 0;
    int k = bottom;
    for (; k <= top || (carry != 0 && k < count); ++k) {
      const int64_t value = (k <= top ? digits[k] : 0) + carry;
      // floor division (an arithmetic shift: GCC, Clang and nvcc define it for negative values, and C++20 does)
      carry = value >> kDigitBits;
      // The remainder, in [0, 2^32). Carries are multiplied by the base, never shifted: a carry may be negative,
      // and shifting a negative value left is undefined behaviour before C++20 (UBSan's finding).
      digits[k] = value - carry * kDigitBase;
    }
    top = k - 1;
    if (carry != 0) {  // (a sum beyond the digits, or a negative one: the last digit keeps the sign)
      digits[count - 1] += carry * kDigitBase;
    }
    while (top >= bottom && digits[top] == 0) {
      --top;
    }
    while (bottom <= top && digits[bottom] == 0) {
      ++bottom;
    }
    return top < bottom ? CarriedDigits(digits, count, -1) : CarriedDigits(digits, bottom, top);
  }

  TORCHCLIP_HOST_DEVICE int bottom() const { return bottom_; }
  TORCHCLIP_HOST_DEVICE int top() const { return top_; }

  // The flags the exact kernels raise beside a sum.
  static constexpr int64_t kSawNaN = 1, kSawInf = 2;

  // The norm this is the sum of terms of, correctly rounded: the sum itself (p = 1) or its square root
  // (p = 2, `root`); NaN where `flags` say a NaN was met, else inf where an inf was.
  TORCHCLIP_HOST_DEVICE double norm(int64_t flags, bool root) const {
    if (flags & (kSawNaN | kSawInf)) {
      // (from bits: std::numeric_limits is host code)
      const uint64_t bits = (flags & kSawNaN) ? 0x7FF8000000000000ull : 0x7FF0000000000000ull;
      double special;
      memcpy(&special, &bits, sizeof special);
      return special;
    }
    return root ? sqrt_rounded() : rounded(0);
  }

  // sqrt of the sum, rounded to the nearest float64 (ties to even).
  TORCHCLIP_HOST_DEVICE double sqrt_rounded() const {
    const int top_bit = this->top_bit();
    if (top_bit < 0) {
      return 0.0;
    }
    // An estimate within an ulp or two, from the sum scaled by an even power of two into float64's range.
    const int half_shift = (top_bit - kBias) / 2;
    double root = ldexp(sqrt(rounded(2 * half_shift)), half_shift);
    // Then the exact comparisons with the midpoints next to it decide.
    for (int step = 0; step < 4; ++step) {
      if (isinf(root)) {
        return root;  // (the sum's root is beyond float64's range)
      }
      const double up = nextafter(root, __builtin_huge_val());
      const int above = compare_with_midpoint_square(root);
      if (above > 0) {
        root = up;
        continue;
      }
      if (above == 0) {
        return even_of(root, up);
      }
      const double down = nextafter(root, 0.0);
      const int below = compare_with_midpoint_square(down);
      if (below < 0) {
        root = down;
        continue;
      }
      if (below == 0) {
        return even_of(down, root);
      }
      return root;
    }
    return root;  // (not reached: the estimate is within two ulps)
  }

  // The sum times 2^-shift, rounded to the nearest float64 (ties to even).
  TORCHCLIP_HOST_DEVICE double rounded(int shift) const {
    const int top_bit = this->top_bit();
    if (top_bit < 0) {
      return 0.0;
    }
    const int leading_exponent = top_bit - kBias - shift;  // the leading bit weighs 2^leading_exponent
    // Bits kept: 53, fewer where the result is subnormal (its last bit weighs 2^-1074).
    int keep = 53;
    if (leading_exponent < -1022) {
      keep = leading_exponent + 1075;
      if (keep < 0) {
        return 0.0;  // below half the smallest subnormal
      }
    }
    // The 64 bits from the leading one down, and whether anything below them is set.
    uint64_t head = 0;
    bool sticky = false;
    if (fits_128()) {  // (most tensors' sums: their digits as one integer)
      const unsigned __int128 value = low_128();
      const int length = top_bit - bottom_ * kDigitBits + 1;
      const unsigned __int128 aligned = value << (128 - length);
      head = static_cast<uint64_t>(aligned >> 64);
      sticky = static_cast<uint64_t>(aligned) != 0;
    } else {
      head = head_bits(top_bit, &sticky);
    }
    uint64_t mantissa = keep == 0 ? 0 : head >> (64 - keep);
    const uint64_t dropped = keep == 0 ? head : head << keep;  // the dropped bits, leading at bit 63
    const bool half = (dropped >> 63) != 0;
    const bool above_half = (dropped << 1) != 0 || sticky;
    if (half && (above_half || (mantissa & 1))) {
      ++mantissa;  // (2^53 after a carry out is still exact as a double)
    }
    return ldexp(static_cast<double>(mantissa), leading_exponent - keep + 1);
  }

  // The index of the highest set bit; -1 for zero.
  TORCHCLIP_HOST_DEVICE int top_bit() const {
    if (top_ < 0) {
      return -1;
    }
    const uint64_t digit = static_cast<uint64_t>(digits_[top_]);
    return top_ * kDigitBits + 63 - exact_sum_detail::leading_zeros(digit);
  }

 private:
  static constexpr int64_t kDigitBase = int64_t{1} << kDigitBits;

  TORCHCLIP_HOST_DEVICE static double even_of(double a, double b) {
    uint64_t bits;
    memcpy(&bits, &a, sizeof(bits));
    return (bits & 1) == 0 ? a : b;
  }

  // Whether the window's digits make one 128-bit integer (at most four digits).
  TORCHCLIP_HOST_DEVICE bool fits_128() const { return top_ - bottom_ < 128 / kDigitBits; }

  // The window's digits as one integer (fits_128): the sum is it times 2^(32 bottom_ - kBias).
  TORCHCLIP_HOST_DEVICE unsigned __int128 low_128() const {
    unsigned __int128 value = 0;
    for (int k = top_; k >= bottom_; --k) {
      value = (value << kDigitBits) | static_cast<uint32_t>(digits_[k]);
    }
    return value;
  }

  // The 64 bits from top_bit down, and whether anything below them is set, bit by bit.
  TORCHCLIP_HOST_DEVICE uint64_t head_bits(int top_bit, bool* sticky) const {
    uint64_t head = 0;
    for (int bit = top_bit, filled = 0; filled < 64; ++filled, --bit) {
      head = (head << 1) | (bit >= 0 ? bit_at(bit) : 0);
    }
    *sticky = false;
    for (int k = bottom_; k <= top_ && !*sticky; ++k) {
      const int lowest_kept = top_bit - 63;
      const int digit_low = k * kDigitBits;
      if (digit_low >= lowest_kept) {
        break;
      }
      uint64_t digit = static_cast<uint64_t>(digits_[k]);
      const int bits_below = lowest_kept - digit_low;
      if (bits_below < kDigitBits) {
        digit &= (uint64_t{1} << bits_below) - 1;
      }
      *sticky = digit != 0;
    }
    return head;
  }

  TORCHCLIP_HOST_DEVICE uint64_t bit_at(int bit) const {
    const int k = bit / kDigitBits;
    if (k < bottom_ || k > top_) {
      return 0;
    }
    return (static_cast<uint64_t>(digits_[k]) >> (bit % kDigitBits)) & 1;
  }

  // The sign of (sum - m^2), m the midpoint between `low` (>= 0, finite) and the double above it.
  TORCHCLIP_HOST_DEVICE int compare_with_midpoint_square(double low) const {
    int exponent;
    const uint64_t mantissa = exact_sum_detail::split(low, &exponent);
    // m = (2 * mantissa + 1) * 2^(exponent - 1): a 54-bit integer times a power of two, squared exactly.
    const unsigned __int128 m = (static_cast<unsigned __int128>(mantissa) << 1) | 1;
    const unsigned __int128 square = m * m;
    const int square_exponent = 2 * (exponent - 1);
    if (fits_128()) {
      return compare_128(low_128(), bottom_ * kDigitBits - kBias, square, square_exponent);
    }
    // Digit by digit from the top: both are non-negative integers in base 2^32 with digits in [0, 2^32), so
    // the first digit where they differ decides. The square's digits: its 32-bit pieces from its position on,
    // ExactSum::digit_parts' pieces taken one by one here (its array, indexed by the digit, put a stack frame
    // and spills into the CUDA exact kernels: ptxas, 16 -> 72 bytes for p = 1).
    const int position = square_exponent + kBias;
    const int first = position / kDigitBits, shift = position % kDigitBits;
    const unsigned __int128 low_bits = square << shift;
    const uint64_t high_bits = shift == 0 ? 0 : static_cast<uint64_t>(square >> (128 - shift));
    for (int k = (top_ > first + 4 ? top_ : first + 4); k >= 0; --k) {
      const uint64_t mine = k >= bottom_ && k <= top_ ? static_cast<uint64_t>(digits_[k]) : 0;
      const int piece = k - first;
      const uint64_t theirs = piece < 0 || piece > 4
          ? 0
          : (piece == 4 ? high_bits : static_cast<uint32_t>(low_bits >> (kDigitBits * piece)));
      if (mine != theirs) {
        return mine > theirs ? 1 : -1;
      }
      if (k < bottom_ && piece < 0) {
        break;  // (both zero from here down)
      }
    }
    return 0;
  }

  // The sign of a * 2^ea - b * 2^eb (b > 0, below 2^108): by where their leading bits fall, then aligned.
  TORCHCLIP_HOST_DEVICE static int compare_128(unsigned __int128 a, int ea, unsigned __int128 b, int eb) {
    if (a == 0) {
      return -1;
    }
    const int length_a = bit_length(a), length_b = bit_length(b);
    if (length_a + ea != length_b + eb) {
      return length_a + ea > length_b + eb ? 1 : -1;
    }
    // Leading bits level: the one with the larger exponent shifts up to the other's, within 128 bits.
    if (ea >= eb) {
      a <<= ea - eb;
    } else {
      b <<= eb - ea;
    }
    return a > b ? 1 : (a < b ? -1 : 0);
  }

  TORCHCLIP_HOST_DEVICE static int bit_length(unsigned __int128 v) {
    const uint64_t high = static_cast<uint64_t>(v >> 64), low = static_cast<uint64_t>(v);
    return high != 0 ? 128 - exact_sum_detail::leading_zeros(high)
                     : (low != 0 ? 64 - exact_sum_detail::leading_zeros(low) : 0);
  }

  const int64_t* digits_;
  int bottom_, top_;
};

class ExactSum {
 public:
  static constexpr int kDigitBits = CarriedDigits::kDigitBits;
  static constexpr int kDigits = 136;
  static constexpr int kBias = CarriedDigits::kBias;  // kDigits * 32 = 2 * kBias: 2^0 in the middle

  TORCHCLIP_HOST_DEVICE ExactSum() = default;
  TORCHCLIP_HOST_DEVICE ExactSum(const ExactSum& other) { *this = other; }
  TORCHCLIP_HOST_DEVICE ExactSum& operator=(const ExactSum& other) {
    bottom_ = other.bottom_;
    top_ = other.top_;
    pending_ = other.pending_;
    if (top_ >= bottom_) {
      memcpy(digits_ + bottom_, other.digits_ + bottom_, sizeof(int64_t) * (top_ - bottom_ + 1));
    }
    return *this;
  }

  // += v, exactly; v finite.
  TORCHCLIP_HOST_DEVICE void add(double v) {
    int exponent;
    const uint64_t mantissa = split(v, &exponent);
    add_scaled(mantissa, exponent, v < 0.0);
  }

  // += v * v, exactly (106-bit integer product); v finite.
  TORCHCLIP_HOST_DEVICE void add_square(double v) {
    int exponent;
    const unsigned __int128 mantissa = split(v, &exponent);
    add_scaled(mantissa * mantissa, 2 * exponent, false);
  }

  // += (negative ? -1 : 1) * mantissa * 2^exponent, exactly; mantissa < 2^110, exponent >= -kBias.
  TORCHCLIP_HOST_DEVICE void add_scaled(unsigned __int128 mantissa, int exponent, bool negative) {
    if (mantissa == 0) {
      return;
    }
    uint64_t parts[kParts];
    const int digit = digit_parts(mantissa, exponent, parts);
    widen(digit, digit + kParts - 1);
    for (int k = 0; k < kParts && digit + k < kDigits; ++k) {
      const int64_t part = static_cast<int64_t>(parts[k]);
      digits_[digit + k] += negative ? -part : part;
    }
    if (++pending_ == kCarryEvery) {
      propagate_carries();
    }
  }

  // mantissa * 2^exponent (mantissa < 2^110, exponent >= -kBias) as kParts values below 2^32 (the last
  // below 2^13) to add to digits first, first + 1, ...; returns first. What add_scaled adds, for callers
  // that add into digits of their own (the CUDA kernels' atomics).
  static constexpr int kParts = 5;
  TORCHCLIP_HOST_DEVICE static int digit_parts(unsigned __int128 mantissa, int exponent, uint64_t* parts) {
    const int position = exponent + kBias;
    const int shift = position % kDigitBits;
    const unsigned __int128 low = mantissa << shift;  // (bits shifted out of 128 go to the last part)
    parts[0] = static_cast<uint32_t>(low);
    parts[1] = static_cast<uint32_t>(low >> 32);
    parts[2] = static_cast<uint32_t>(low >> 64);
    parts[3] = static_cast<uint32_t>(low >> 96);
    parts[4] = shift == 0 ? 0 : static_cast<uint64_t>(mantissa >> (128 - shift));
    return position / kDigitBits;
  }

  // v = mantissa * 2^exponent with an integer mantissa < 2^53 (v finite; its sign dropped).
  TORCHCLIP_HOST_DEVICE static uint64_t split(double v, int* exponent) { return exact_sum_detail::split(v, exponent); }

  TORCHCLIP_HOST_DEVICE void add(const ExactSum& other) {
    if (other.top_ < 0) {
      return;
    }
    if (pending_ + other.pending_ + 1 < kCarryEvery) {
      // The other's digits as they are, carries and all: each digit then holds what both sums' pending
      // additions put there, plus its 32 bits from each, within the budget that keeps an int64 from
      // overflowing. (Propagating both first cost 270 instructions a tensor on 10,000 x 100, two-thirds of what
      // summing its 100 values did.)
      widen(other.bottom_, other.top_);
      for (int k = other.bottom_; k <= other.top_; ++k) {
        digits_[k] += other.digits_[k];
      }
      pending_ += other.pending_ + 1;
      return;
    }
    if (other.pending_ != 0) {
      ExactSum normalised = other;
      normalised.propagate_carries();
      add(normalised);
      return;
    }
    propagate_carries();
    widen(other.bottom_, other.top_);
    for (int k = other.bottom_; k <= other.top_; ++k) {
      digits_[k] += other.digits_[k];
    }
    pending_ = 1;
  }

  // The sum (>= 0) as kDigits digits, digit k in [0, 2^32) weighing 2^(32 k - kBias): what ranks exchange.
  // Up to 2^31 such rows add element-wise in int64 without overflow, and from_digits reads their sum.
  TORCHCLIP_HOST_DEVICE void to_digits(int64_t* out) const {
    ExactSum carried = *this;
    carried.propagate_carries();
    memset(out, 0, sizeof(int64_t) * kDigits);
    if (carried.top_ >= carried.bottom_) {
      memcpy(out + carried.bottom_, carried.digits_ + carried.bottom_,
          sizeof(int64_t) * (carried.top_ - carried.bottom_ + 1));
    }
  }

  // The sum (>= 0) whose digits are `digits`, carries not yet propagated: a digit may be negative or above
  // 2^32 (the CUDA kernels' level sums), as long as the value they weigh is not.
  TORCHCLIP_HOST_DEVICE static ExactSum from_digits(const int64_t* digits) {
    ExactSum sum;
    int bottom = 0, top = kDigits - 1;
    while (bottom < kDigits && digits[bottom] == 0) {
      ++bottom;
    }
    while (top >= bottom && digits[top] == 0) {
      --top;
    }
    if (top >= bottom) {
      sum.widen(bottom, top);
      memcpy(sum.digits_ + bottom, digits + bottom, sizeof(int64_t) * (top - bottom + 1));
      sum.propagate_carries();
    }
    return sum;
  }

  // The flags the exact kernels raise beside a sum.
  static constexpr int64_t kSawNaN = CarriedDigits::kSawNaN, kSawInf = CarriedDigits::kSawInf;

  // The sum (>= 0) rounded to the nearest float64 (ties to even).
  TORCHCLIP_HOST_DEVICE double to_double() const { return carried_copy().view().rounded(0); }

  // sqrt of the sum (>= 0), rounded to the nearest float64 (ties to even).
  TORCHCLIP_HOST_DEVICE double sqrt_rounded() const { return carried_copy().view().sqrt_rounded(); }

  // CarriedDigits::norm of this sum (>= 0).
  TORCHCLIP_HOST_DEVICE double norm(int64_t flags, bool root) const { return carried_copy().view().norm(flags, root); }

 private:
  static constexpr int kCarryEvery = 1 << 30;  // each addition moves a digit by < 2^32: no int64 overflow

  TORCHCLIP_HOST_DEVICE ExactSum carried_copy() const {
    ExactSum copy = *this;
    copy.propagate_carries();
    return copy;
  }

  TORCHCLIP_HOST_DEVICE CarriedDigits view() const { return CarriedDigits(digits_, bottom_, top_); }

  // Takes digits [bottom, top] into the window, zeroing those new to it.
  TORCHCLIP_HOST_DEVICE void widen(int bottom, int top) {
    top = top < kDigits ? top : kDigits - 1;
    if (top_ < bottom_) {
      memset(digits_ + bottom, 0, sizeof(int64_t) * (top - bottom + 1));
      bottom_ = bottom;
      top_ = top;
      return;
    }
    if (bottom < bottom_) {
      memset(digits_ + bottom, 0, sizeof(int64_t) * (bottom_ - bottom));
      bottom_ = bottom;
    }
    if (top > top_) {
      memset(digits_ + top_ + 1, 0, sizeof(int64_t) * (top - top_));
      top_ = top;
    }
  }

  // Every digit into [0, 2^32) (CarriedDigits::carry).
  TORCHCLIP_HOST_DEVICE void propagate_carries() {
    pending_ = 0;
    const CarriedDigits carried = CarriedDigits::carry(digits_, kDigits, bottom_, top_);
    bottom_ = carried.bottom();
    top_ = carried.top();
  }

  int64_t digits_[kDigits];          // (only [bottom_, top_] is ever read; the rest is not initialised)
  int bottom_ = kDigits, top_ = -1;  // the digits that may be non-zero
  int32_t pending_ = 0;              // additions since the carries were last propagated
};

}  // namespace torchclip
