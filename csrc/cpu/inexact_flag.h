// The processor's inexact flag as the plain run's check (exact_runs.h): a sum of float64 lanes is exact exactly
// when none of the additions that built it rounded, which is what IEEE 754's sticky inexact flag records (MXCSR's
// PE bit on x86). Checked after a block's loop, it replaces the bounds the loop would otherwise take of every value
// (the smallest magnitude, three operations a vector), and it is the real condition, not a bound of it.
//
// Two traps. The compiler does not know that arithmetic touches the flag, so it may move an addition across the
// flag's read or clear: every lane a check relies on goes through `pinned` after the clear (no addition into it can
// run before) and is an operand of the read (none can run after). And some emulators never raise it (valgrind keeps
// MXCSR's rounding mode only), where a check would pass every sum: `inexact_flag_works` asks once, with an addition
// that rounds, and the plain run takes nothing where it does not.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string_view>

#if defined(__SSE2__)
#include <immintrin.h>
#else
#include <cfenv>
#endif

namespace torchclip::cpu {
namespace {

#if defined(__SSE2__)
// The floating-point state every exact sum runs under: round to nearest, denormals kept (torch.set_flush_denormal
// sets DAZ, which read a bfloat16 subnormal as 0 in the conversions to float64), every exception masked.
constexpr unsigned kExactCsr = _MM_MASK_MASK;

// Sets kExactCsr for its scope and then puts the caller's state back, its flags included.
class ExactFloatState {
 public:
  ExactFloatState() : saved_(_mm_getcsr()) { _mm_setcsr(kExactCsr); }
  ~ExactFloatState() { _mm_setcsr(saved_); }
  ExactFloatState(const ExactFloatState&) = delete;
  ExactFloatState& operator=(const ExactFloatState&) = delete;

 private:
  unsigned saved_;
};

// Lowers the inexact flag where it is raised (a write of MXCSR costs more than a read).
inline void clear_inexact() {
  const unsigned csr = _mm_getcsr();
  if ((csr & _MM_EXCEPT_INEXACT) != 0) {
    _mm_setcsr(csr & ~_MM_EXCEPT_INEXACT);
  }
}

// Whether an addition rounded since the flag was cleared, every addition into `lanes` counted.
// A lane the compiler must have finished at this point.
template <typename Lane>
inline void finished(const Lane& lane) {
  asm volatile("" : : "v"(lane));
}

template <typename... Lanes>
inline bool inexact_after(const Lanes&... lanes) {
  (finished(lanes), ...);
  return (_mm_getcsr() & _MM_EXCEPT_INEXACT) != 0;
}

// A lane whose later additions the compiler may not move above this point (the clear before it).
template <typename Lane>
inline void pinned(Lane& lane) {
  asm volatile("" : "+v"(lane));
}
#else
class ExactFloatState {
 public:
  ExactFloatState() {
    std::fegetenv(&saved_);
    std::fesetround(FE_TONEAREST);
  }
  ~ExactFloatState() { std::fesetenv(&saved_); }
  ExactFloatState(const ExactFloatState&) = delete;
  ExactFloatState& operator=(const ExactFloatState&) = delete;

 private:
  std::fenv_t saved_;
};

inline void clear_inexact() {
  std::feclearexcept(FE_INEXACT);
}

template <typename Lane>
inline void finished(const Lane& lane) {
  asm volatile("" : : "m"(lane));
}

template <typename... Lanes>
inline bool inexact_after(const Lanes&... lanes) {
  (finished(lanes), ...);
  return std::fetestexcept(FE_INEXACT) != 0;
}

template <typename Lane>
inline void pinned(Lane& lane) {
  asm volatile("" : "+m"(lane));
}
#endif

// Whether an addition that rounds raises the flag here (once a process; not under valgrind). TORCHCLIP_INEXACT_FLAG=off
// answers no, as valgrind would, so that the tests run the other runs' paths on every block.
inline bool inexact_flag_works() {
  static const bool works = [] {
    const char* setting = std::getenv("TORCHCLIP_INEXACT_FLAG");
    if (setting != nullptr && std::string_view(setting) == "off") {
      return false;
    }
    ExactFloatState state;
    volatile double one = 1.0, tiny = 0x1p-60;
    double sum = one;
    pinned(sum);
    sum += tiny;
    return inexact_after(sum);
  }();
  return works;
}

}  // namespace
}  // namespace torchclip::cpu
