// Host-side pieces every device's op implementation shares (cpu/ops_cpu.cpp, cuda/ops_cuda.cpp), so
// that an op takes the same tensors to its kernels, checks the same things and says the same words on
// every device: which tensors the kernels take, the checks made before any write, the non-finite
// policies, the result dtype and the messages. Header-only: each extension module (torchclip._C,
// torchclip._cuda) compiles its own copy, as they share no link-time symbols.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/view_as_real.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <c10/util/string_view.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernel_types.h"

namespace torchclip {

// The kernels' storage type for a dtype: float16, bfloat16, float32 or float64; nullopt for every other.
inline std::optional<DType> kernel_dtype_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf:
      return DType::Float16;
    case at::kBFloat16:
      return DType::BFloat16;
    case at::kFloat:
      return DType::Float32;
    case at::kDouble:
      return DType::Float64;
    default:
      return std::nullopt;
  }
}

// The storage type the kernels take a tensor as, or nullopt when ATen must serve it: the kernels walk
// dense float16/bfloat16/float32/float64 runs; complex, integer, views with gaps or overlaps go to
// ATen, which is correct for all. A lazily negated view (neg bit) holds -x in memory as x: only ATen
// knows to flip it.
inline std::optional<DType> kernel_dtype(const at::Tensor& t) {
  if (!t.is_non_overlapping_and_dense() || t.is_neg()) {
    return std::nullopt;
  }
  return kernel_dtype_of(t.scalar_type());
}

// A tensor the kernels do not walk as it is (ATen's path), as dense real terms an exact sum of squares (kind
// Two) or absolute values (One) can walk: a complex tensor by its real view for p = 2 (|z|^2 is its parts'
// squares), for p = 1 by its magnitudes, each sqrt(re * re + im * im) in float64, one IEEE operation at a time
// in ATen's kernels (no contraction across kernels, a correctly rounded square root), so the CPU and CUDA give
// the same terms and their sum is one function of the data; a lazy negation or conjugation resolved; nullopt
// where no kernel dtype holds the values (integers). The copy lives as long as the returned tensor.
inline std::optional<std::pair<at::Tensor, DType>> exact_terms(const at::Tensor& t, NormKind kind) {
  if (t.is_complex() && kind == NormKind::One) {
    const at::Tensor parts = at::view_as_real(t.resolve_conj()).to(at::kDouble);
    const at::Tensor re = parts.select(-1, 0), im = parts.select(-1, 1);
    return std::pair{at::sqrt(at::add(at::mul(re, re), at::mul(im, im))).contiguous(), DType::Float64};
  }
  const at::Tensor real = (t.is_complex() ? at::view_as_real(t.resolve_conj()) : t).resolve_neg().contiguous();
  const std::optional<DType> dtype = kernel_dtype(real);
  if (!dtype) {
    return std::nullopt;
  }
  return std::pair{real, *dtype};
}

// The dtype torch.nn.utils.get_total_norm returns: the promotion of the inputs, real for complex.
inline at::ScalarType total_norm_dtype(at::ScalarType promoted) {
  return at::isComplexType(promoted) ? c10::toRealValueType(promoted) : promoted;
}

// ATen refuses to write in place into a tensor whose elements share memory (an expanded view);
// refusing it before the first write keeps the promise that an error leaves every tensor as it was.
// (The kernels' spans are non-overlapping by construction; only ATen's path can hold such a tensor.)
inline void check_writable(at::TensorList tensors, const std::vector<int64_t>& aten_path, const char* op) {
  for (int64_t i : aten_path) {
    TORCH_CHECK(at::has_internal_overlap(tensors[i]) != at::MemOverlap::Yes, op, ": tensors[", i,
        "] has elements that share memory (an expanded view?), so it cannot be modified in place");
  }
}

// The bytes a tensor's elements can touch, [first, last + 1): exact for a dense tensor, a bound for a
// strided view with gaps. Empty for an empty tensor.
inline std::pair<uintptr_t, uintptr_t> byte_range(const at::Tensor& t) {
  if (t.numel() == 0) {
    return {0, 0};
  }
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    last += (t.size(d) - 1) * t.stride(d);
  }
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {first, first + static_cast<uintptr_t>((last + 1) * static_cast<int64_t>(t.element_size()))};
}

// Whether two of a list's tensors may share memory (the same gradient twice, overlapping views): the
// kernels' spans (`spans`, `count`: anything with data, numel and dtype) and the tensors ATen serves
// (`tensors[i]` for i in `aten_path`). The in-place ops then take the list one tensor at a time, in
// order, as torch's loops do: split across threads, two writers would race on the shared elements
// (some scaled twice, some once). Read from the spans, which the walk has just written, never from the
// tensors themselves: on 10,000 separate gradients, reading each TensorImpl again after the walk cost
// 0.2-0.3 ms a call (cold lines). A natural merge sort: the list falls into runs of ranges that each
// start past the previous one's end (views of one buffer are one run; 10,000 separate allocations were
// ~46), found by a first pass that writes nothing, and runs are merged pairwise, each merge checking
// its neighbours (std::sort of those ranges cost ~4x more).
template <typename Span>
bool may_overlap(const Span* spans, size_t count, at::TensorList tensors, const std::vector<int64_t>& aten_path) {
  if (count + aten_path.size() < 2) {
    return false;
  }
  using Range = std::pair<uintptr_t, uintptr_t>;
  const auto span_range = [&](size_t k) {
    constexpr uintptr_t kBytes[] = {2, 2, 4, 8};  // DType's order: Float16, BFloat16, Float32, Float64
    const auto first = reinterpret_cast<uintptr_t>(spans[k].data);
    return Range{first, first + static_cast<uintptr_t>(spans[k].numel) * kBytes[static_cast<int>(spans[k].dtype)]};
  };
  // Calls visit(range, starts_run) for every non-empty range; a run ends where a range starts before
  // the previous range's end.
  const auto each_range = [&](const auto& visit) {
    uintptr_t previous_end = 0;
    bool first = true;
    const auto file = [&](const Range& range) {
      if (range.first != range.second) {
        visit(range, first || range.first < previous_end);
        first = false;
        previous_end = range.second;
      }
    };
    for (size_t k = 0; k < count; ++k) {
      file(span_range(k));
    }
    for (int64_t i : aten_path) {
      file(byte_range(tensors[i]));
    }
  };
  // The last list this thread found disjoint, range for range in list order: training steps clip the same
  // gradients again (or the allocator hands back the same blocks), and comparing is a fraction of checking
  // (10,000 ranges in ~46 runs: ~60 us cold, most of what the check added to the benchmark's in-place rows).
  static thread_local std::vector<Range> last_disjoint;
  size_t runs = 0, nonempty = 0;  // the common answers in one pass that writes nothing
  bool seen_last = true;
  each_range([&](const Range& range, bool starts_run) {
    runs += starts_run;
    seen_last = seen_last && nonempty < last_disjoint.size() && last_disjoint[nonempty] == range;
    ++nonempty;
  });
  if (runs <= 1 || (seen_last && nonempty == last_disjoint.size())) {
    return false;
  }
  // Kept between calls: a fresh 160 KB for 10,000 ranges is an mmap and its page faults on every call.
  static thread_local std::vector<Range> ranges_kept, merged_kept, listed_kept;
  static thread_local std::vector<size_t> run_starts_kept;
  std::vector<Range>& ranges = ranges_kept;
  std::vector<Range>& merged = merged_kept;
  std::vector<Range>& listed = listed_kept;  // the ranges in list order, to keep if they are disjoint
  std::vector<size_t>& run_starts = run_starts_kept;  // run r is [run_starts[r], run_starts[r + 1])
  ranges.clear();
  run_starts.clear();
  each_range([&](const Range& range, bool starts_run) {
    if (starts_run) {
      run_starts.push_back(ranges.size());
    }
    ranges.push_back(range);
  });
  run_starts.push_back(ranges.size());
  listed.assign(ranges.begin(), ranges.end());
  merged.resize(ranges.size());
  // Invariant: every run is sorted and disjoint, so two merged runs overlap iff two neighbours do.
  while (run_starts.size() > 2) {
    size_t kept = 0;
    for (size_t r = 0; r + 1 < run_starts.size(); r += 2) {
      const size_t begin = run_starts[r], middle = run_starts[r + 1];
      const size_t end = r + 2 < run_starts.size() ? run_starts[r + 2] : middle;  // a last odd run is copied
      std::merge(ranges.begin() + begin, ranges.begin() + middle, ranges.begin() + middle, ranges.begin() + end,
          merged.begin() + begin);
      for (size_t i = begin + 1; middle != end && i < end; ++i) {
        if (merged[i].first < merged[i - 1].second) {
          return true;
        }
      }
      run_starts[kept++] = begin;
    }
    run_starts[kept++] = ranges.size();
    run_starts.resize(kept);
    ranges.swap(merged);
  }
  last_disjoint.swap(listed);
  return false;
}

// may_overlap for a list the kernels do not walk as spans: every tensor read through its own metadata.
inline bool tensors_may_overlap(at::TensorList tensors) {
  struct NoSpan {
    void* data;
    int64_t numel;
    DType dtype;
  };
  std::vector<int64_t> all(tensors.size());
  std::iota(all.begin(), all.end(), int64_t{0});
  return may_overlap(static_cast<const NoSpan*>(nullptr), 0, tensors, all);
}

// torch's refusal, from an inference tensor's version counter, to write it outside inference mode;
// made before any write (ATen's in-place ops raise from the same check).
inline void check_not_inference(at::TensorList tensors, const char* op) {
  if (c10::InferenceMode::is_enabled()) {
    return;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(!tensors[i].is_inference(), op, ": tensors[", i,
        "]: Inplace update to inference tensor outside "
        "InferenceMode is not allowed. You can make a clone to get a normal tensor before doing inplace update.");
  }
}

// Python's repr of a float, so messages read as torch's ("2.0", "inf").
inline std::string python_float(double value) {
  if (std::isnan(value)) {
    return "nan";
  }
  if (std::isinf(value)) {
    return value > 0 ? "inf" : "-inf";
  }
  char buffer[64];
  auto end = std::to_chars(buffer, buffer + sizeof(buffer), value).ptr;
  std::string text(buffer, end);
  if (text.find_first_of(".en") == std::string::npos) {
    text += ".0";
  }
  return text;
}

// The process-wide exact-norm setting (torchclip.set_exact_norm), for a call whose `exact` is None. Each
// library that includes this may hold its own copy (torchclip._C's and torchclip._cuda's): set_exact_norm
// sets every one.
inline std::atomic<bool>& exact_norms_setting() {
  static std::atomic<bool> enabled{false};
  return enabled;
}

// Whether a call takes exact norms: its own `exact` argument where given, else the process-wide setting.
inline bool exact_norms_for(std::optional<bool> exact) {
  return exact.value_or(exact_norms_setting().load(std::memory_order_relaxed));
}

// The non-finite policies of the clipping ops (see ops.cpp).
enum class NonFinite { Propagate, Raise, Skip };

inline NonFinite parse_nonfinite(c10::string_view name, const char* op) {
  if (name == "propagate") {
    return NonFinite::Propagate;
  }
  if (name == "raise") {
    return NonFinite::Raise;
  }
  TORCH_CHECK(name == "skip", op, ": nonfinite must be 'propagate', 'raise' or 'skip', got '", std::string(name), "'");
  return NonFinite::Skip;
}

// torch's error for error_if_nonfinite, raised from the float64 total: finite gradients whose norm
// only overflows a 16-bit result dtype are not an error (they can still be clipped exactly).
inline void check_finite_total(double total, double norm_type, bool error_if_nonfinite) {
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(total), "The total norm of order ", python_float(norm_type),
      " for gradients from `parameters` is non-finite, so it cannot be clipped. To disable this error and "
      "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`");
}

// What clamping in place needs of the tensors ATen serves (the kernels' spans are all fine): elements
// that do not share memory, and a dtype that is ordered and not bool.
inline void check_clampable(at::TensorList tensors, const std::vector<int64_t>& aten_path, const char* op) {
  check_writable(tensors, aten_path, op);
  for (int64_t i : aten_path) {
    // (NotImplementedError, a RuntimeError, as torch's clamp raises for complex tensors)
    TORCH_CHECK_NOT_IMPLEMENTED(!tensors[i].is_complex(), op, ": tensors[", i, "] has dtype ", tensors[i].scalar_type(),
        "; clamping is not defined for complex numbers");
    TORCH_CHECK(tensors[i].scalar_type() != at::kBool, op, ": tensors[", i,
        "] has dtype bool; clamping "
        "needs a numeric dtype");
  }
}

// A clamp bound as the kernels apply it to `dtype`: rounded to that dtype (they compare in float and round
// the result, the same answer), so a bound beyond the dtype's range is inf where ATen would refuse it.
inline double clamp_bound_in(at::ScalarType dtype, double bound) {
  switch (dtype) {
    case at::kHalf:
      return static_cast<float>(c10::Half(static_cast<float>(bound)));
    case at::kBFloat16:
      return static_cast<float>(c10::BFloat16(static_cast<float>(bound)));
    case at::kFloat:
      return static_cast<float>(bound);  // (IEEE: an overflow rounds to inf)
    default:
      return bound;
  }
}

// Clamps a tensor the kernels do not serve as they would: every layout of a list gives the same answer.
inline void clamp_on_aten(const at::Tensor& tensor, double min, double max) {
  const at::ScalarType dtype = tensor.scalar_type();
  tensor.clamp_min_(clamp_bound_in(dtype, min)).clamp_max_(clamp_bound_in(dtype, max));
}

// torch 2.15's vector_norm refuses an integer or bool tensor with NotImplementedError, earlier releases with
// RuntimeError: ask the installed torch (once, and only on that error path) so the drop-ins raise as it does.
inline bool torch_norm_of_integers_is_not_implemented() {
  static const bool not_implemented = [] {
    try {
      at::linalg_vector_norm(at::ones({1}, at::kLong));
    } catch (const c10::NotImplementedError&) {
      return true;
    } catch (const c10::Error&) {
    }
    return false;
  }();
  return not_implemented;
}

// What a norm of order `ord` needs of its inputs, as torch's vector_norm: orders without an identity
// (inf, -inf, negative) refuse empty tensors, and ATen's path a dtype that is not floating or complex.
inline void check_norm_inputs(at::TensorList tensors, const std::vector<int64_t>& aten_path, double ord,
    const char* op) {
  if (std::isinf(ord) || ord < 0) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      TORCH_CHECK(tensors[i].numel() > 0, op, ": cannot compute the ", python_float(ord),
          " norm on an empty tensor because the operation does not have an identity (tensors[", i, "])");
    }
  }
  for (int64_t i : aten_path) {
    if (tensors[i].is_floating_point() || tensors[i].is_complex()) {
      continue;
    }
    const std::string message = c10::str(op, ": tensors[", i, "] has dtype ", tensors[i].scalar_type(),
        "; a norm needs a floating point or complex dtype");
    TORCH_CHECK_NOT_IMPLEMENTED(!torch_norm_of_integers_is_not_implemented(), message);
    TORCH_CHECK(false, message);
  }
}

// The message of the per-tensor clipping op when any norm is non-finite and the policy is "raise".
constexpr const char* kTensorNormNonFinite =
    ": a gradient's norm is non-finite (NaN or inf), so it cannot be clipped; no gradient was changed";

// ---- the fused optimizer steps (adam_step_, sgd_step_, adagrad_step_), on either device ----------------------

// Each list beside the parameters must have one entry per parameter.
inline void check_one_per_parameter(const char* op, size_t n,
    std::initializer_list<std::pair<const char*, size_t>> lists) {
  for (const auto& [name, size] : lists) {
    TORCH_CHECK(size == n, op, ": ", name, " must have one entry per parameter (", n, "), got ", size);
  }
}

// adam_step_'s lists: one entry per parameter each, max_exp_avg_sqs only with amsgrad.
inline void check_adam_lists(const char* op, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps, bool amsgrad) {
  const size_t n = params.size();
  check_one_per_parameter(op, n,
      {{"grads", grads.size()}, {"exp_avgs", exp_avgs.size()}, {"exp_avg_sqs", exp_avg_sqs.size()},
          {"state_steps", state_steps.size()}});
  TORCH_CHECK(max_exp_avg_sqs.size() == (amsgrad ? n : 0), op, ": max_exp_avg_sqs must have ",
      amsgrad ? "one entry per parameter" : "no entries", " with amsgrad=", amsgrad ? "True" : "False", ", got ",
      max_exp_avg_sqs.size());
}

// sgd_step_'s lists: grads one entry per parameter, momentum_buffers too where momentum is not 0, else none.
inline void check_sgd_lists(const char* op, at::TensorList params, at::TensorList grads,
    at::TensorList momentum_buffers, double momentum) {
  const size_t n = params.size();
  const bool has_momentum = momentum != 0.0;
  check_one_per_parameter(op, n, {{"grads", grads.size()}});
  TORCH_CHECK(momentum_buffers.size() == (has_momentum ? n : 0), op, ": momentum_buffers must have ",
      has_momentum ? "one entry per parameter" : "no entries", " with momentum=", momentum, ", got ",
      momentum_buffers.size());
}

// Whether `state` can be walked beside `param`: the same device, dtype, shape and element order, dense.
inline bool walks_beside(const at::Tensor& state, const at::Tensor& param) {
  return state.defined() && state.device() == param.device() && state.layout() == at::kStrided &&
      state.scalar_type() == param.scalar_type() && state.sizes() == param.sizes() &&
      state.strides() == param.strides() && !state.is_neg();
}

// A step op's answer: whether it took the step (false: nothing was written, the caller takes torch's).
inline at::Tensor stepped(bool done) {
  return at::scalar_tensor(done, at::kBool);
}

}  // namespace torchclip
