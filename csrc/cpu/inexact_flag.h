// The processor's inexact flag as the plain run's check (exact_runs.h): a sum of float64 lanes is exact exactly
// when none of the additions that built it rounded, which is what IEEE 754's sticky inexact flag records (MXCSR's
// PE bit on x86). Checked after a block's loop, it replaces the bounds the loop would otherwise take of every value
// (the smallest magnitude, three operations a vector), and it is the real condition, not a bound of it.
//
// Two traps. The compiler does not know that arithmetic touches the flag, so it may move an addition across the
// flag's clear or its read: every lane a check relies on goes through `pinned` after the clear (no addition into it
// can run before) and through `finished` before the read (every addition into it has run). And valgrind never raises
// the flag (an addition that rounds leaves PE down under it), where every check would pass: `inexact_flag_works` asks
// once, with an addition that rounds, and the plain run takes nothing where the flag stays down.
#pragma once

#include <cstdlib>
#include <string_view>

#if defined(__SSE2__)
#include <immintrin.h>
#else
#include <cfenv>
#endif

// Where the lanes live for the empty asm statements below: any vector register on x86, memory elsewhere.
#if defined(__SSE2__)
#define TORCHCLIP_LANE_PLACE "v"
#else
#define TORCHCLIP_LANE_PLACE "m"
#endif

namespace torchclip::cpu {
namespace {

#if defined(__SSE2__)
// The floating-point state, MXCSR. Every exact sum runs under exact_float_state(): round to nearest, denormals kept
// (torch.set_flush_denormal sets DAZ, which reads a subnormal operand as 0: the kernels' conversions to float64 dropped
// bfloat16, float16 and float32 subnormals), every exception masked, every flag down.
using FloatState = unsigned;
inline FloatState float_state() {
  return _mm_getcsr();
}
inline void set_float_state(FloatState state) {
  _mm_setcsr(state);
}
inline FloatState exact_float_state() {
  return _MM_MASK_MASK;
}
inline bool inexact_raised() {
  return (_mm_getcsr() & _MM_EXCEPT_INEXACT) != 0;
}
inline void lower_inexact() {
  _mm_setcsr(_mm_getcsr() & ~_MM_EXCEPT_INEXACT);
}
#else
using FloatState = std::fenv_t;
inline FloatState float_state() {
  FloatState state;
  std::fegetenv(&state);
  return state;
}
inline void set_float_state(const FloatState& state) {
  std::fesetenv(&state);
}
inline FloatState exact_float_state() {
  return *FE_DFL_ENV;
}
inline bool inexact_raised() {
  return std::fetestexcept(FE_INEXACT) != 0;
}
inline void lower_inexact() {
  std::feclearexcept(FE_INEXACT);
}
#endif

// The exact sums' state for its scope, and then the caller's back, its flags included.
class ExactFloatState {
 public:
  ExactFloatState() : saved_(float_state()) { set_float_state(exact_float_state()); }
  ~ExactFloatState() { set_float_state(saved_); }
  ExactFloatState(const ExactFloatState&) = delete;
  ExactFloatState& operator=(const ExactFloatState&) = delete;

 private:
  FloatState saved_;
};

// Lowers the inexact flag where it is raised (a write of the state costs more than a read).
inline void clear_inexact() {
  if (inexact_raised()) {
    lower_inexact();
  }
}

// A lane whose later additions the compiler may not move above this point (the clear before it).
template <typename Lane>
inline void pinned(Lane& lane) {
  asm volatile("" : "+" TORCHCLIP_LANE_PLACE(lane));
}

// A lane the compiler must have finished at this point (the read after it).
template <typename Lane>
inline void finished(const Lane& lane) {
  asm volatile("" : : TORCHCLIP_LANE_PLACE(lane));
}

// Whether an addition rounded since the flag was cleared, every addition into `lanes` counted.
template <typename... Lanes>
inline bool inexact_after(const Lanes&... lanes) {
  (finished(lanes), ...);
  return inexact_raised();
}

// Whether an addition that rounds raises the flag here (once a process; not under valgrind). TORCHCLIP_INEXACT_FLAG=off
// answers no, as valgrind would, so that the tests run the other runs' paths on every block.
inline bool inexact_flag_works() {
  static const bool works = [] {
    const char* setting = std::getenv("TORCHCLIP_INEXACT_FLAG");
    if (setting != nullptr && std::string_view(setting) == "off") {
      return false;
    }
    const ExactFloatState state;
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

#undef TORCHCLIP_LANE_PLACE
