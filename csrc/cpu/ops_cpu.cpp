// CPU implementations of the torchclip ops: argument checks, the split between tensors the per-ISA
// kernels walk and tensors that take ATen's own path, and the cross-tensor arithmetic (total norms,
// clip coefficients). Every check runs before any tensor is written, so an error leaves every
// gradient as it was.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "kernel_loader.h"
#include "norm_total.h"
#include "op_shared.h"
#include "ops_cpu.h"

namespace torchclip {

bool exact_norms_enabled() {
  return exact_norms_setting().load(std::memory_order_relaxed);
}

bool set_exact_norms(bool enabled) {
  return exact_norms_setting().exchange(enabled);
}

void Split::add(const at::Tensor& t, int64_t index) {
  promoted = index == 0 ? t.scalar_type() : c10::promoteTypes(promoted, t.scalar_type());
  if (const auto dtype = kernel_dtype(t)) {
    spans.push_back({t.data_ptr(), t.numel(), *dtype});
    span_source.push_back(index);
  } else {
    aten_path.push_back(index);
  }
}

Split split_tensors(at::TensorList tensors, const char* op) {
  Split split;
  split.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": tensors[", i, "] is an undefined tensor");
    TORCH_CHECK(t.device().is_cpu(), op, ": tensors[", i, "] is on ", t.device(),
        "; the CPU kernel takes CPU tensors only");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": tensors[", i, "] has layout ", t.layout(),
        "; only strided tensors are supported here");
    split.add(t, static_cast<int64_t>(i));
  }
  return split;
}

namespace {

// The norm of a tensor the kernels do not take (complex, strided with gaps), by ATen in float64.
// ATen does not scale: |x|^p leaves float64's range for magnitudes near its limits (squares beyond
// ~1e154 or below ~1e-154). When that could have happened, the tensor is divided by its largest
// magnitude (p > 0) or smallest (p < 0) first, as the kernels do, so the norm is right whenever it is
// representable.
double aten_norm(const at::Tensor& t, double ord) {
  const auto wide = t.is_complex() ? at::kComplexDouble : at::kDouble;
  const double norm = at::linalg_vector_norm(t, ord, std::nullopt, false, wide).item<double>();
  const bool may_have_left_range = std::isinf(norm) || norm < 1e-290;
  if (!std::isfinite(ord) || ord == 0.0 || !may_have_left_range || t.numel() == 0) {
    return norm;
  }
  const at::Tensor magnitudes = t.abs();
  const double scale = (ord > 0 ? magnitudes.max() : magnitudes.min()).to(at::kDouble).item<double>();
  if (!std::isfinite(scale) || scale == 0.0) {
    return norm;
  }
  return scale * at::linalg_vector_norm(t.to(wide) / scale, ord, std::nullopt, false, wide).item<double>();
}

// Per-tensor norms in float64, and under exact norms the total too, from the exact sum of every term.
struct WideNorms {
  std::vector<double> norms;
  std::optional<double> exact_total;  // correctly rounded; set where the exact norms took the total
};

// A list as the exact kernel's input: the kernels' spans, then ATen's tensors as dense exact terms
// (exact_terms: a complex tensor's real view, or its magnitudes for p = 1). check_norm_inputs has refused
// what no kernel dtype holds. The split's spans are read where they lie unless ATen serves a tensor: copying
// them took 0.32M of an exact total norm's 9.0M instructions on 10,000 x 100 (callgrind, AVX2).
class ExactInput {
 public:
  ExactInput(at::TensorList tensors, const Split& split, NormKind kind) : split_(split) {
    if (split.aten_path.empty()) {
      return;
    }
    spans_.assign(split.spans.begin(), split.spans.end());
    sources_.assign(split.span_source.begin(), split.span_source.end());
    for (int64_t i : split.aten_path) {
      const auto terms = exact_terms(tensors[i], kind);
      TORCH_INTERNAL_ASSERT(terms, "torchclip: exact norms of a ", tensors[i].scalar_type(), " tensor");
      const auto& [real, dtype] = *terms;
      dense_.push_back(real);
      spans_.push_back({real.data_ptr(), real.numel(), dtype});
      sources_.push_back(i);
    }
  }

  const cpu::TensorSpan* spans() const { return copied() ? spans_.data() : split_.spans.data(); }
  int64_t count() const { return static_cast<int64_t>(copied() ? spans_.size() : split_.spans.size()); }
  // spans()[k] is tensors[source(k)].
  int64_t source(int64_t k) const { return copied() ? sources_[k] : split_.span_source[k]; }

 private:
  bool copied() const { return !split_.aten_path.empty(); }

  const Split& split_;
  std::vector<cpu::TensorSpan> spans_;
  std::vector<int64_t> sources_;
  std::vector<at::Tensor> dense_;  // (kept alive while the kernels read them)
};

NormKind exact_kind(double ord) {
  return ord == 1.0 ? NormKind::One : NormKind::Two;
}

// The correctly rounded norm of an exact sum, NaN and inf as the kernels flag them (ExactSum::norm).
double exact_norm_of(const ExactSum& sum, int32_t flags, NormKind kind) {
  return sum.norm(flags, kind == NormKind::Two);
}

// Exact norms (p = 1, 2): the kernels' exact sums over every tensor. Without per_tensor, only the total is
// wanted: `norms` is left empty.
WideNorms exact_norms_wide(at::TensorList tensors, const Split& split, double ord, bool per_tensor) {
  const NormKind kind = exact_kind(ord);
  const ExactInput input(tensors, split, kind);
  WideNorms out{std::vector<double>(per_tensor ? tensors.size() : 0), std::nullopt};
  std::vector<double> span_norms(per_tensor ? input.count() : 0);
  ExactSum total;
  int32_t flags = 0;
  cpu_kernels().exact_norms(input.spans(), input.count(), kind, per_tensor ? span_norms.data() : nullptr, &total,
      &flags);
  for (size_t k = 0; k < span_norms.size(); ++k) {
    out.norms[input.source(static_cast<int64_t>(k))] = span_norms[k];
  }
  out.exact_total = exact_norm_of(total, flags, kind);
  return out;
}

// Per-tensor norms in float64: kernels for the spans, ATen (in float64) for the rest. per_tensor = false:
// the caller wants the total alone (exact norms then skip each tensor's correctly rounded root).
WideNorms tensor_norms_wide(at::TensorList tensors, const Split& split, double ord, const char* op, bool exact,
    bool per_tensor = true) {
  check_norm_inputs(tensors, split.aten_path, ord, op);
  if (exact && (ord == 1.0 || ord == 2.0)) {
    return exact_norms_wide(tensors, split, ord, per_tensor);
  }
  std::vector<double> norms(tensors.size());
  if (!split.spans.empty()) {
    std::vector<double> span_norms(split.spans.size());
    cpu_kernels().tensor_norms(split.spans.data(), static_cast<int64_t>(split.spans.size()), norm_order(ord),
        span_norms.data());
    for (size_t k = 0; k < split.spans.size(); ++k) {
      norms[split.span_source[k]] = span_norms[k];
    }
  }
  for (int64_t i : split.aten_path) {
    norms[i] = aten_norm(tensors[i], ord);
  }
  return {std::move(norms), std::nullopt};
}

at::Tensor float64_vector(const std::vector<double>& values) {
  at::Tensor out = at::empty({static_cast<int64_t>(values.size())}, at::kDouble);
  std::copy(values.begin(), values.end(), out.data_ptr<double>());
  return out;
}

at::Tensor scalar_in_dtype(double value, at::ScalarType dtype) {
  // Cast through a float64 tensor: a Scalar fill would refuse a value that overflows a 16-bit dtype,
  // where torch's own result is inf.
  return at::scalar_tensor(value, at::kDouble).to(dtype);
}

// Calls on_span(k) for a tensor the kernels take (spans[k]) or on_aten(i) for tensors[i], one tensor at a
// time in list order: how the in-place ops treat a list whose tensors may share memory.
template <typename OnSpan, typename OnAten>
void in_list_order(at::TensorList tensors, const Split& split, const OnSpan& on_span, const OnAten& on_aten) {
  std::vector<int64_t> span_of(tensors.size(), -1);
  for (size_t k = 0; k < split.spans.size(); ++k) {
    span_of[split.span_source[k]] = static_cast<int64_t>(k);
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (span_of[i] >= 0) {
      on_span(span_of[i]);
    } else {
      on_aten(static_cast<int64_t>(i));
    }
  }
}

// tensors[i] *= scales[i]; scales of exactly 1 are skipped by the kernels (and here, for ATen's path).
// `aten_scale(i)` gives the factor ATen's path multiplies by: a double, or a 0-d tensor where torch's
// type promotion must be reproduced exactly.
template <typename AtenScale>
void apply_scales(at::TensorList tensors, const Split& split, const std::vector<double>& scales,
    const AtenScale& aten_scale) {
  if (std::all_of(scales.begin(), scales.end(), [](double scale) { return scale == 1.0; })) {
    return;  // nothing is written (a clip that is not needed): no order to keep, no overlap to look for
  }
  if (may_overlap(split.spans.data(), split.spans.size(), tensors, split.aten_path)) {
    in_list_order(
        tensors, split, [&](int64_t k) { cpu_kernels().scale(&split.spans[k], 1, &scales[split.span_source[k]]); },
        [&](int64_t i) {
          if (scales[i] != 1.0) {
            tensors[i].mul_(aten_scale(i));
          }
        });
    return;
  }
  if (!split.spans.empty()) {
    std::vector<double> span_scales(split.spans.size());
    for (size_t k = 0; k < split.spans.size(); ++k) {
      span_scales[k] = scales[split.span_source[k]];
    }
    cpu_kernels().scale(split.spans.data(), static_cast<int64_t>(split.spans.size()), span_scales.data());
  }
  for (int64_t i : split.aten_path) {
    if (scales[i] != 1.0) {
      // A const reference to a list element: mul_ writes the shared storage in place.
      tensors[i].mul_(aten_scale(i));
    }
  }
}

void apply_scales(at::TensorList tensors, const Split& split, const std::vector<double>& scales) {
  apply_scales(tensors, split, scales, [&](int64_t i) { return scales[i]; });
}

// The total norm, in torch's result dtype, of per-tensor norms already computed; raises as torch
// does when asked to and it is not finite.
double total_of(const WideNorms& wide, double ord) {
  return wide.exact_total ? *wide.exact_total
                          : total_norm(wide.norms.data(), static_cast<int64_t>(wide.norms.size()), norm_order(ord));
}

at::Tensor total_of_norms(const WideNorms& norms, const Split& split, double ord, bool error_if_nonfinite,
    std::optional<at::ScalarType> dtype = std::nullopt) {
  const double total = total_of(norms, ord);
  check_finite_total(total, ord, error_if_nonfinite);
  return scalar_in_dtype(total, dtype.value_or(total_norm_dtype(split.promoted)));
}

}  // namespace

at::Tensor total_norm_cpu_split(at::TensorList tensors, const Split& split, double ord, bool error_if_nonfinite,
    bool exact) {
  return total_of_norms(tensor_norms_wide(tensors, split, ord, "torchclip.multi_tensor_norm", exact, false), split, ord,
      error_if_nonfinite);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_cpu_split(at::TensorList tensors, const Split& split, double ord,
    bool error_if_nonfinite, bool exact, std::optional<at::ScalarType> dtype) {
  const WideNorms norms = tensor_norms_wide(tensors, split, ord, "torchclip.multi_tensor_norm", exact);
  return {total_of_norms(norms, split, ord, error_if_nonfinite, dtype), float64_vector(norms.norms)};
}

at::Tensor exact_sums_cpu(at::TensorList tensors, double ord, bool per_tensor) {
  constexpr const char* op = "torchclip.exact_sums";
  TORCH_CHECK_VALUE(ord == 1.0 || ord == 2.0, op, ": exact sums are of |x| (ord 1) or x^2 (ord 2), got ord ",
      python_float(ord));
  const Split split = split_tensors(tensors, op);
  check_norm_inputs(tensors, split.aten_path, ord, op);
  const NormKind kind = exact_kind(ord);
  const ExactInput input(tensors, split, kind);
  const int64_t rows = per_tensor ? static_cast<int64_t>(tensors.size()) : 1;
  at::Tensor out = at::zeros({rows, kExactSumColumns}, at::kLong);
  int64_t* const data = out.data_ptr<int64_t>();
  const auto write_row = [&](int64_t row, const ExactSum& sum, int32_t flags) {
    int64_t* const columns = data + row * kExactSumColumns;
    columns[0] = flags & 1;
    columns[1] = (flags >> 1) & 1;
    sum.to_digits(columns + 2);
  };
  if (!per_tensor) {
    ExactSum total;
    int32_t flags = 0;
    cpu_kernels().exact_norms(input.spans(), input.count(), kind, nullptr, &total, &flags);
    write_row(0, total, flags);
    return out;
  }
  for (int64_t k = 0; k < input.count(); ++k) {  // one call per tensor: each row its own sum
    ExactSum sum;
    int32_t flags = 0;
    cpu_kernels().exact_norms(input.spans() + k, 1, kind, nullptr, &sum, &flags);
    write_row(input.source(k), sum, flags);
  }
  return out;
}

at::Tensor norms_of_exact_sums(const at::Tensor& sums, double ord) {
  constexpr const char* op = "torchclip.norms_of_exact_sums";
  TORCH_CHECK_VALUE(ord == 1.0 || ord == 2.0, op, ": ord must be 1 or 2, got ", python_float(ord));
  TORCH_CHECK_VALUE(
      sums.device().is_cpu() && sums.scalar_type() == at::kLong && sums.dim() == 2 && sums.size(1) == kExactSumColumns,
      op, ": sums must be a CPU int64 tensor of shape (rows, ", kExactSumColumns, ") (exact_sums' rows), got ",
      sums.scalar_type(), " ", sums.sizes(), " on ", sums.device());
  const at::Tensor rows = sums.contiguous();
  TORCH_CHECK_VALUE(rows.ge(0).all().item<bool>(), op, ": sums holds a negative entry; exact sums are >= 0");
  const int64_t* const data = rows.data_ptr<int64_t>();
  std::vector<double> norms(rows.size(0));
  for (int64_t r = 0; r < rows.size(0); ++r) {
    const int64_t* const columns = data + r * kExactSumColumns;
    const int32_t flags = (columns[0] != 0 ? 1 : 0) | (columns[1] != 0 ? 2 : 0);
    norms[r] = exact_norm_of(ExactSum::from_digits(columns + 2), flags, exact_kind(ord));
  }
  return float64_vector(norms);
}

void multi_tensor_clamp_cpu_split(at::TensorList tensors, const Split& split, double min, double max) {
  constexpr const char* op = "torchclip.multi_tensor_clamp_";
  check_clampable(tensors, split.aten_path, op);
  if (may_overlap(split.spans.data(), split.spans.size(), tensors, split.aten_path)) {
    in_list_order(
        tensors, split, [&](int64_t k) { cpu_kernels().clamp(&split.spans[k], 1, min, max); },
        [&](int64_t i) { clamp_on_aten(tensors[i], min, max); });
    return;
  }
  if (!split.spans.empty()) {
    cpu_kernels().clamp(split.spans.data(), static_cast<int64_t>(split.spans.size()), min, max);
  }
  for (int64_t i : split.aten_path) {
    clamp_on_aten(tensors[i], min, max);
  }
}

at::Tensor clip_grad_norm_cpu_split(at::TensorList grads, const Split& split, double max_norm, double norm_type,
    bool error_if_nonfinite, double eps, bool norm_at_least_float32, c10::string_view nonfinite, bool exact,
    NormClipStats* stats) {
  constexpr const char* op = "torchclip.clip_grad_norm_";
  const NonFinite policy = parse_nonfinite(nonfinite, op);
  check_writable(grads, split.aten_path, op);
  const WideNorms wide = tensor_norms_wide(grads, split, norm_type, op, exact, stats != nullptr);
  const std::vector<double>& norms = wide.norms;
  const double total = total_of(wide, norm_type);
  check_finite_total(total, norm_type, error_if_nonfinite || policy == NonFinite::Raise);
  // torch's coefficient, max_norm / (total_norm + eps) clamped to at most 1, but from the float64 norm.
  // std::min keeps a NaN coefficient NaN, as torch.clamp does; a zero norm with eps = 0 gives 1.
  const bool skip = policy == NonFinite::Skip && !std::isfinite(total);
  const double coefficient = skip ? 1.0 : std::min(max_norm * (1.0 / (total + eps)), 1.0);
  apply_scales(grads, split, std::vector<double>(grads.size(), coefficient));
  if (stats != nullptr) {
    *stats = {float64_vector(norms), scalar_in_dtype(coefficient, at::kDouble)};
  }
  at::ScalarType dtype = grads.empty() ? at::kFloat : total_norm_dtype(split.promoted);
  if (norm_at_least_float32) {
    dtype = c10::promoteTypes(dtype, at::kFloat);
  }
  return scalar_in_dtype(total, dtype);
}

at::Tensor clip_by_tensor_norm_cpu_split(at::TensorList tensors, const Split& split, double max_norm,
    c10::string_view nonfinite, bool exact) {
  constexpr const char* op = "torchclip.clip_by_tensor_norm_";
  const NonFinite policy = parse_nonfinite(nonfinite, op);
  check_writable(tensors, split.aten_path, op);
  const std::vector<double> norms = tensor_norms_wide(tensors, split, 2.0, op, exact).norms;
  const bool any_nonfinite = std::any_of(norms.begin(), norms.end(), [](double n) { return !std::isfinite(n); });
  TORCH_CHECK(!(any_nonfinite && policy == NonFinite::Raise), op, kTensorNormNonFinite);
  // Unchanged when norm <= max_norm; otherwise max_norm / norm (NaN for a NaN norm: propagated).
  const auto scale_for = [&](double norm) { return norm <= max_norm ? 1.0 : max_norm / norm; };
  if (any_nonfinite && policy == NonFinite::Skip) {
    return float64_vector(norms);
  }
  if (may_overlap(split.spans.data(), split.spans.size(), tensors, split.aten_path)) {
    // Each tensor clipped by its norm as the ones before it left it, as a loop over the list does.
    std::vector<double> seen(norms.size());
    const auto norm_now = [&](int64_t i) {
      const at::TensorList one = tensors.slice(i, 1);
      return tensor_norms_wide(one, split_tensors(one, op), 2.0, op, exact).norms[0];
    };
    in_list_order(
        tensors, split,
        [&](int64_t k) {
          seen[split.span_source[k]] = norm_now(split.span_source[k]);
          const double scale = scale_for(seen[split.span_source[k]]);
          cpu_kernels().scale(&split.spans[k], 1, &scale);
        },
        [&](int64_t i) {
          seen[i] = norm_now(i);
          if (const double scale = scale_for(seen[i]); scale != 1.0) {
            tensors[i].mul_(scale);
          }
        });
    return float64_vector(seen);
  }
  std::vector<double> scales(norms.size());
  std::transform(norms.begin(), norms.end(), scales.begin(), scale_for);
  apply_scales(tensors, split, scales);
  return float64_vector(norms);
}

namespace {

// The dispatcher's CPU kernels: split, then the shared implementations above.
std::tuple<at::Tensor, at::Tensor> multi_tensor_norm_cpu(at::TensorList tensors, double ord, bool error_if_nonfinite,
    std::optional<bool> exact, std::optional<at::ScalarType> dtype) {
  return multi_tensor_norm_cpu_split(tensors, split_tensors(tensors, "torchclip.multi_tensor_norm"), ord,
      error_if_nonfinite, exact_norms_for(exact), dtype);
}

void multi_tensor_scale_cpu(at::TensorList tensors, const at::Tensor& scale) {
  constexpr const char* op = "torchclip.multi_tensor_scale_";
  const int64_t count = static_cast<int64_t>(tensors.size());
  TORCH_CHECK(scale.dim() == 0 || (scale.dim() == 1 && scale.size(0) == count), op,
      ": scale must be a 0-d tensor or a 1-d tensor with one entry per tensor (", count, "), got shape ",
      scale.sizes());
  TORCH_CHECK(scale.device().is_cpu(), op, ": scale is on ", scale.device(), "; expected CPU");
  TORCH_CHECK(!scale.is_complex(), op, ": scale has dtype ", scale.scalar_type(), "; expected a real dtype");
  check_not_inference(tensors, op);
  Split split = split_tensors(tensors, op);
  check_writable(tensors, split.aten_path, op);
  // torch multiplies a 0-d tensor by a 0-d scale in their promoted dtype (float32 x float64 in
  // float64), unlike any tensor with dimensions: leave those to ATen, which knows the rule.
  UninitVector<cpu::TensorSpan> spans;
  UninitVector<int64_t> sources;
  for (size_t k = 0; k < split.spans.size(); ++k) {
    const at::Tensor& t = tensors[split.span_source[k]];
    if (t.dim() == 0 && at::promote_types(t.scalar_type(), scale.scalar_type()) != t.scalar_type()) {
      split.aten_path.push_back(split.span_source[k]);
    } else {
      spans.push_back(split.spans[k]);
      sources.push_back(split.span_source[k]);
    }
  }
  split.spans = std::move(spans);
  split.span_source = std::move(sources);
  const at::Tensor wide = scale.to(at::kDouble).contiguous();
  const double* values = wide.data_ptr<double>();
  std::vector<double> scales(count, scale.dim() == 0 ? values[0] : 0.0);
  if (scale.dim() == 1) {
    std::copy(values, values + count, scales.begin());
  }
  apply_scales(tensors, split, scales, [&](int64_t i) { return scale.dim() == 0 ? scale : scale[i]; });
}

void multi_tensor_clamp_cpu(at::TensorList tensors, double min, double max) {
  check_not_inference(tensors, "torchclip.multi_tensor_clamp_");
  multi_tensor_clamp_cpu_split(tensors, split_tensors(tensors, "torchclip.multi_tensor_clamp_"), min, max);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> clip_grad_norm_cpu(at::TensorList grads, double max_norm,
    double norm_type, bool error_if_nonfinite, double eps, bool norm_at_least_float32, c10::string_view nonfinite,
    std::optional<bool> exact) {
  check_not_inference(grads, "torchclip.clip_grad_norm_");
  NormClipStats stats;
  at::Tensor total = clip_grad_norm_cpu_split(grads, split_tensors(grads, "torchclip.clip_grad_norm_"), max_norm,
      norm_type, error_if_nonfinite, eps, norm_at_least_float32, nonfinite, exact_norms_for(exact), &stats);
  return {std::move(total), std::move(stats.norms), std::move(stats.coefficient)};
}

at::Tensor clip_by_tensor_norm_cpu(at::TensorList tensors, double max_norm, c10::string_view nonfinite,
    std::optional<bool> exact) {
  check_not_inference(tensors, "torchclip.clip_by_tensor_norm_");
  return clip_by_tensor_norm_cpu_split(tensors, split_tensors(tensors, "torchclip.clip_by_tensor_norm_"), max_norm,
      nonfinite, exact_norms_for(exact));
}

// ---- unit-wise clipping (AGC) ----------------------------------------------------------------------

// A weight's units, as timm's unitwise_norm: rows of the first dimension (the output units of Linear
// and ConvNd weights), or the whole tensor for 0-d and 1-d tensors (biases, norm-layer gains).
int64_t unit_count(const at::Tensor& t) {
  return t.dim() <= 1 ? 1 : t.size(0);
}

// Unit norms in float64 by ATen, for a pair the kernels do not take (non-contiguous, another dtype).
at::Tensor aten_unit_norms(const at::Tensor& t, double ord) {
  std::vector<int64_t> dims;
  for (int64_t d = 1; d < t.dim(); ++d) {
    dims.push_back(d);
  }
  const at::Tensor norms = t.dim() <= 1 ? at::linalg_vector_norm(t, ord, std::nullopt, false, at::kDouble)
                                        : at::linalg_vector_norm(t, ord, dims, false, at::kDouble);
  return norms.reshape({unit_count(t)});
}

// A contiguous tensor's units as kernel spans, one per row.
void add_unit_spans(const at::Tensor& t, DType dtype, std::vector<cpu::TensorSpan>& spans) {
  const int64_t units = unit_count(t);
  const int64_t inner = units == 0 ? 0 : t.numel() / units;
  char* data = static_cast<char*>(t.data_ptr());
  for (int64_t u = 0; u < units; ++u) {
    spans.push_back({data + u * inner * t.element_size(), inner, dtype});
  }
}

// AGC with exact unit norms (orders 1 and 2): each unit's norm the true norm rounded once, the factors
// as the fused kernel computes them, each clipped unit scaled as it scales. ATen's pairs (views with
// gaps) are read through dense copies and scaled by ATen.
void unitwise_clip_exact(at::TensorList grads, at::TensorList params, const std::vector<int64_t>& kernel_pairs,
    const std::vector<int64_t>& aten_pairs, double clip_factor, double eps, double norm_type) {
  std::vector<at::Tensor> dense;  // (kept alive while the kernels read them)
  std::vector<cpu::TensorSpan> weight_units, grad_units;
  for (int64_t i : kernel_pairs) {
    add_unit_spans(params[i], *kernel_dtype(params[i]), weight_units);
    add_unit_spans(grads[i], *kernel_dtype(grads[i]), grad_units);
  }
  const size_t kernel_units = grad_units.size();
  for (int64_t i : aten_pairs) {
    for (const at::Tensor* t : {&params[i], &grads[i]}) {
      dense.push_back(t->resolve_neg().contiguous());
      add_unit_spans(dense.back(), *kernel_dtype(dense.back()), t == &params[i] ? weight_units : grad_units);
    }
  }
  const int64_t units = static_cast<int64_t>(grad_units.size());
  std::vector<double> weight_norms(units), grad_norms(units), factors(units);
  ExactSum unused;
  int32_t flags = 0;
  const NormKind kind = exact_kind(norm_type);
  cpu_kernels().exact_norms(weight_units.data(), units, kind, weight_norms.data(), &unused, &flags);
  cpu_kernels().exact_norms(grad_units.data(), units, kind, grad_norms.data(), &unused, &flags);
  for (int64_t u = 0; u < units; ++u) {
    // std::max keeps a NaN first argument, as the fused kernel and torch's clamp: NaN norms propagate.
    const double max_norm = std::max(weight_norms[u], eps) * clip_factor;
    factors[u] = grad_norms[u] < max_norm ? 1.0 : max_norm / std::max(grad_norms[u], 1e-6);
  }
  if (kernel_units > 0) {
    cpu_kernels().scale(grad_units.data(), static_cast<int64_t>(kernel_units), factors.data());
  }
  size_t next = kernel_units;
  for (int64_t i : aten_pairs) {
    const at::Tensor& g = grads[i];
    const int64_t count = unit_count(g);
    at::Tensor unit_factors =
        float64_vector(std::vector<double>(factors.begin() + next, factors.begin() + next + count));
    next += count;
    std::vector<int64_t> shape(std::max<int64_t>(g.dim(), 1), 1);
    shape[0] = count;
    unit_factors = unit_factors.to(g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).reshape(shape);
    g.mul_(g.dim() == 0 ? unit_factors.reshape({}) : unit_factors);
  }
}

void unitwise_clip_cpu(at::TensorList grads, at::TensorList params, double clip_factor, double eps, double norm_type,
    std::optional<bool> exact) {
  constexpr const char* op = "torchclip.unitwise_clip_";
  TORCH_CHECK(grads.size() == params.size(), op, ": got ", grads.size(), " gradients and ", params.size(),
      " parameters; they come in pairs");
  TORCH_CHECK(norm_type > 0, op, ": norm_type must be > 0 (inf allowed), got ", python_float(norm_type));
  for (size_t i = 0; i < grads.size(); ++i) {
    using Named = std::pair<const char*, const at::Tensor&>;
    for (const auto& [name, t] : {Named{"grads", grads[i]}, Named{"params", params[i]}}) {
      TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is an undefined tensor");
      TORCH_CHECK(t.device().is_cpu(), op, ": ", name, "[", i, "] is on ", t.device(),
          "; the CPU kernel takes CPU tensors only");
      TORCH_CHECK(t.layout() == at::kStrided, op, ": ", name, "[", i, "] has layout ", t.layout(),
          "; only strided tensors are supported here");
    }
    TORCH_CHECK(at::has_internal_overlap(grads[i]) != at::MemOverlap::Yes, op, ": grads[", i,
        "] has elements that share memory (an expanded view?), so it cannot be modified in place");
  }
  check_not_inference(grads, op);
  // Pairs whose two tensors are contiguous and of kernel dtypes go to the kernels unit by unit (a row
  // each); the rest to ATen, tensor by tensor.
  std::vector<int64_t> kernel_pairs, aten_pairs;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor &g = grads[i], &p = params[i];
    TORCH_CHECK(g.sizes() == p.sizes(), op, ": grads[", i, "] has shape ", g.sizes(), " but params[", i, "] has shape ",
        p.sizes());
    TORCH_CHECK(g.is_floating_point() && p.is_floating_point(), op, ": grads[", i, "] and params[", i,
        "] must be floating point, got ", g.scalar_type(), " and ", p.scalar_type());
    const bool kernels_take = g.is_contiguous() && p.is_contiguous() && kernel_dtype(g) && kernel_dtype(p);
    (kernels_take ? kernel_pairs : aten_pairs).push_back(static_cast<int64_t>(i));
  }
  if (tensors_may_overlap(grads)) {  // each pair as a loop over the list clips it, after the ones before
    for (size_t i = 0; i < grads.size(); ++i) {
      unitwise_clip_cpu(grads.slice(i, 1), params.slice(i, 1), clip_factor, eps, norm_type, exact);
    }
    return;
  }
  if (exact_norms_for(exact) && (norm_type == 1.0 || norm_type == 2.0)) {
    unitwise_clip_exact(grads, params, kernel_pairs, aten_pairs, clip_factor, eps, norm_type);
    return;
  }
  std::vector<cpu::TensorSpan> weight_units, grad_units;
  for (int64_t i : kernel_pairs) {
    add_unit_spans(params[i], *kernel_dtype(params[i]), weight_units);
    add_unit_spans(grads[i], *kernel_dtype(grads[i]), grad_units);
  }
  if (!grad_units.empty()) {
    cpu_kernels().unitwise_clip(weight_units.data(), grad_units.data(), static_cast<int64_t>(grad_units.size()),
        norm_order(norm_type), clip_factor, eps);
  }
  for (int64_t i : aten_pairs) {
    const at::Tensor& g = grads[i];
    const at::Tensor max_norm = aten_unit_norms(params[i], norm_type).clamp_min(eps).mul_(clip_factor);
    const at::Tensor grad_norm = aten_unit_norms(g, norm_type);
    at::Tensor factors =
        at::where(grad_norm < max_norm, at::ones_like(grad_norm), max_norm / grad_norm.clamp_min(1e-6));
    std::vector<int64_t> shape(std::max<int64_t>(g.dim(), 1), 1);
    shape[0] = unit_count(g);
    // Multiplied as the kernels do: in float32 for 16/32-bit data, rounded once.
    factors = factors.to(g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).reshape(shape);
    g.mul_(g.dim() == 0 ? factors.reshape({}) : factors);
  }
}

// ---- fused optimizer steps that read the gradients only ----------------------------------------
// Declining (false, nothing written) is for what the kernels do not walk; the caller then runs torch's own
// step. Every check comes before the first write.

// A 1-element float32 CPU tensor's value, or nullopt for anything else (torch's fused steps read
// grad_scale, found_inf and the step counts as float32 on the host).
std::optional<float> host_float(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.scalar_type() != at::kFloat || t.numel() != 1) {
    return std::nullopt;
  }
  return *static_cast<const float*>(t.data_ptr());
}

// grad_scale and found_inf as the kernels take them: each absent, or a float32 CPU number.
struct ScaleAndSkip {
  std::optional<float> scale, skip;
};
std::optional<ScaleAndSkip> scale_and_skip(const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf) {
  ScaleAndSkip read;
  for (const auto& [given, value] : {std::pair{&grad_scale, &read.scale}, std::pair{&found_inf, &read.skip}}) {
    if (given->has_value()) {
      *value = host_float(**given);
      if (!*value) {
        return std::nullopt;
      }
    }
  }
  return read;
}

// The spans of params and of each list walked beside them (grads first), or nullopt where one is not.
std::optional<std::vector<std::vector<cpu::TensorSpan>>> step_spans(at::TensorList params,
    std::initializer_list<at::TensorList> beside) {
  std::vector<std::vector<cpu::TensorSpan>> spans(1 + beside.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const auto dtype = p.defined() && p.device().is_cpu() ? kernel_dtype(p) : std::nullopt;
    if (!dtype) {
      return std::nullopt;
    }
    spans[0].push_back({p.data_ptr(), p.numel(), *dtype});
    size_t list = 1;
    for (const at::TensorList& tensors : beside) {
      if (!walks_beside(tensors[i], p)) {
        return std::nullopt;
      }
      spans[list++].push_back({tensors[i].data_ptr(), p.numel(), *dtype});
    }
  }
  return spans;
}

// Whether every step count is a float32 CPU number.
bool counts_on_host(at::TensorList state_steps) {
  return std::all_of(state_steps.begin(), state_steps.end(), [](const at::Tensor& t) { return host_float(t); });
}

// The counts after torch's `+= 1`, which it makes before its kernel reads them.
std::vector<double> count_steps(at::TensorList state_steps) {
  std::vector<double> steps;
  for (const at::Tensor& t : state_steps) {
    float& step = *static_cast<float*>(t.data_ptr());
    step += 1.0f;
    steps.push_back(step);
  }
  return steps;
}

at::Tensor adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr, double beta1,
    double beta2, double weight_decay, double eps, bool amsgrad, bool maximize, bool decoupled_weight_decay,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "torchclip.adam_step_";
  const size_t n = params.size();
  check_adam_lists(op, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad);
  const auto read = scale_and_skip(grad_scale, found_inf);
  const auto spans = amsgrad ? step_spans(params, {grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs})
                             : step_spans(params, {grads, exp_avgs, exp_avg_sqs});
  if (!read || !spans || !counts_on_host(state_steps)) {
    return stepped(false);
  }
  if (read->skip == 1.0f) {  // torch's fused step leaves everything as it was when found_inf is 1
    return stepped(true);
  }
  const std::vector<double> steps = count_steps(state_steps);
  const cpu::AdamStep hyper{lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, decoupled_weight_decay,
      read->scale ? &*read->scale : nullptr};
  const auto& s = *spans;
  cpu_kernels().adam_step(s[0].data(), s[1].data(), s[2].data(), s[3].data(), amsgrad ? s[4].data() : nullptr,
      steps.data(), static_cast<int64_t>(n), &hyper);
  return stepped(true);
}

at::Tensor sgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, double lr,
    double weight_decay, double momentum, double dampening, bool nesterov, bool maximize, bool is_first_step,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "torchclip.sgd_step_";
  const size_t n = params.size();
  const bool has_momentum = momentum != 0.0;
  check_sgd_lists(op, params, grads, momentum_buffers, momentum);
  const auto read = scale_and_skip(grad_scale, found_inf);
  const auto spans = has_momentum ? step_spans(params, {grads, momentum_buffers}) : step_spans(params, {grads});
  if (!read || !spans) {
    return stepped(false);
  }
  if (read->skip == 1.0f) {
    return stepped(true);
  }
  const cpu::SgdStep hyper{lr, weight_decay, momentum, dampening, nesterov, maximize, is_first_step,
      read->scale ? &*read->scale : nullptr};
  const auto& s = *spans;
  cpu_kernels().sgd_step(s[0].data(), s[1].data(), has_momentum ? s[2].data() : nullptr, static_cast<int64_t>(n),
      &hyper);
  return stepped(true);
}

at::Tensor adagrad_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList state_sums,
    at::TensorList state_steps, double lr, double lr_decay, double weight_decay, double eps, bool maximize,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf) {
  constexpr const char* op = "torchclip.adagrad_step_";
  const size_t n = params.size();
  check_one_per_parameter(op, n,
      {{"grads", grads.size()}, {"state_sums", state_sums.size()}, {"state_steps", state_steps.size()}});
  const auto read = scale_and_skip(grad_scale, found_inf);
  const auto spans = step_spans(params, {grads, state_sums});
  if (!read || !spans || !counts_on_host(state_steps)) {
    return stepped(false);
  }
  if (read->skip == 1.0f) {
    return stepped(true);
  }
  const std::vector<double> steps = count_steps(state_steps);
  const cpu::AdagradStep hyper{lr, lr_decay, weight_decay, eps, maximize, read->scale ? &*read->scale : nullptr};
  const auto& s = *spans;
  cpu_kernels().adagrad_step(s[0].data(), s[1].data(), s[2].data(), steps.data(), static_cast<int64_t>(n), &hyper);
  return stepped(true);
}

}  // namespace

TORCH_LIBRARY_IMPL(torchclip, CPU, m) {
  m.impl("multi_tensor_norm", &multi_tensor_norm_cpu);
  m.impl("multi_tensor_scale_", &multi_tensor_scale_cpu);
  m.impl("multi_tensor_clamp_", &multi_tensor_clamp_cpu);
  m.impl("clip_grad_norm_", &clip_grad_norm_cpu);
  m.impl("clip_by_tensor_norm_", &clip_by_tensor_norm_cpu);
  m.impl("unitwise_clip_", &unitwise_clip_cpu);
  m.impl("adam_step_", &adam_step_cpu);
  m.impl("sgd_step_", &sgd_step_cpu);
  m.impl("adagrad_step_", &adagrad_step_cpu);
}

}  // namespace torchclip
