// What the per-sample ops (cpu/per_sample_cpu.cpp, cuda/per_sample_cuda.cpp) share: the per-sample gradients
// filed into rows, one per sample and parameter, and the checks made on them and on the sums' tensors, in the
// same words on every device. Header-only, as op_shared.h (each extension module compiles its own copy).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <vector>

#include "op_shared.h"

namespace torchclip {

// Every parameter's per-sample gradients as rows: parameter j's gradients are pieces[j] consecutive tensors of
// the op's list, [b_k, *shape] each, whose batches concatenate (Opacus keeps a list of them when gradients are
// accumulated over several batches); they are read where they lie.
struct SampleRows {
  int64_t batch = 0;
  std::vector<const void*> rows;   // rows[j * batch + b]: sample b's gradient of parameter j
  std::vector<DType> dtypes;       // per parameter
  std::vector<int64_t> numels;     // per parameter: elements in a row
  std::vector<at::Tensor> firsts;  // per parameter: its first piece (for its shape)
  std::vector<at::Tensor> kept;    // copies made of pieces whose rows were not dense (kept alive)
};

// Whether each row t[r] is one dense run: the strides past the batch dimension are contiguous ones.
inline bool rows_are_dense(const at::Tensor& t) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) {
      return false;
    }
    expected *= t.size(d);
  }
  return !t.is_neg() && !t.is_conj();
}

// The dtype rows are summed from into `into`'s dtype: their own, except across float64 (the kernels sum
// 16/32-bit rows in float32 and float64 rows in float64), where Opacus's own cast to the parameter's dtype is
// made (a copy; only a float64 parameter with 16/32-bit gradients or the reverse needs one).
inline at::ScalarType per_sample_read_as(at::ScalarType row, at::ScalarType into) {
  return (row == at::kDouble) != (into == at::kDouble) ? into : row;
}

// The rows of grad_samples, every tensor checked to be on `device`. `sums`, where given, holds the tensor each
// parameter's rows are summed into (per_sample_read_as's `into`).
inline SampleRows sample_rows(at::TensorList grad_samples, at::IntArrayRef pieces, const char* op, c10::Device device,
    at::TensorList sums = {}) {
  SampleRows out;
  const int64_t params = static_cast<int64_t>(pieces.size());
  int64_t listed = 0;
  for (int64_t j = 0; j < params; ++j) {
    TORCH_CHECK(pieces[j] >= 1, op, ": pieces[", j, "] is ", pieces[j],
        "; every parameter needs at least one tensor of per-sample gradients");
    listed += pieces[j];
  }
  TORCH_CHECK(listed == static_cast<int64_t>(grad_samples.size()), op, ": pieces add up to ", listed,
      " tensors but grad_samples holds ", grad_samples.size());
  std::vector<at::Tensor> readable;  // the pieces as the kernels read them
  int64_t offset = 0;
  for (int64_t j = 0; j < params; ++j) {
    const at::Tensor& first = grad_samples[offset];
    int64_t batch = 0;
    for (int64_t k = offset; k < offset + pieces[j]; ++k) {
      const at::Tensor& t = grad_samples[k];
      TORCH_CHECK(t.defined(), op, ": parameter ", j, "'s per-sample gradient is an undefined tensor");
      TORCH_CHECK(t.device() == device, op, ": parameter ", j, "'s per-sample gradient is on ", t.device(),
          "; expected ", device, " (the tensors of one call on one device)");
      TORCH_CHECK(t.layout() == at::kStrided, op, ": parameter ", j, "'s per-sample gradient has layout ", t.layout(),
          "; only strided tensors are supported");
      TORCH_CHECK(t.dim() >= 1, op, ": parameter ", j,
          "'s per-sample gradient is 0-d; per-sample gradients are [batch, *parameter.shape]");
      TORCH_CHECK(kernel_dtype_of(t.scalar_type()), op, ": parameter ", j, "'s per-sample gradient has dtype ",
          t.scalar_type(), "; per-sample clipping takes float16, bfloat16, float32 or float64 gradients");
      TORCH_CHECK(t.sizes().slice(1) == first.sizes().slice(1) && t.scalar_type() == first.scalar_type(), op,
          ": parameter ", j, "'s per-sample gradients disagree: ", first.scalar_type(), first.sizes(), " and ",
          t.scalar_type(), t.sizes(), " (the batches of one parameter must share a dtype and a sample shape)");
      batch += t.size(0);
      at::Tensor read = t;
      if (!sums.empty() && per_sample_read_as(t.scalar_type(), sums[j].scalar_type()) != t.scalar_type()) {
        read = t.to(sums[j].scalar_type());
      }
      if (!rows_are_dense(read)) {
        read = read.resolve_conj().resolve_neg().contiguous();
      }
      if (!read.is_same(t)) {
        out.kept.push_back(read);
      }
      readable.push_back(read);
    }
    TORCH_CHECK(j == 0 || batch == out.batch, op, ": parameter ", j, "'s per-sample gradients hold ", batch,
        " samples but parameter 0's hold ", out.batch, "; every parameter needs one gradient per sample");
    out.batch = batch;
    out.firsts.push_back(first);
    out.numels.push_back(c10::multiply_integers(first.sizes().slice(1)));
    out.dtypes.push_back(*kernel_dtype_of(readable.back().scalar_type()));
    offset += pieces[j];
  }
  out.rows.resize(params * out.batch);
  offset = 0;
  for (int64_t j = 0; j < params; ++j) {
    int64_t b = 0;
    for (int64_t k = offset; k < offset + pieces[j]; ++k) {
      const at::Tensor& t = readable[k];
      const auto* base = static_cast<const char*>(t.data_ptr());
      for (int64_t r = 0; r < t.size(0); ++r) {
        out.rows[j * out.batch + b++] = base + r * t.stride(0) * static_cast<int64_t>(t.element_size());
      }
    }
    offset += pieces[j];
  }
  return out;
}

// per_sample_norms' refusal of orders without an identity (inf, -inf, negative) on empty rows.
inline void check_per_sample_norm_order(const SampleRows& rows, double ord, const char* op) {
  if (std::isinf(ord) || ord < 0) {
    for (size_t j = 0; j < rows.numels.size(); ++j) {
      TORCH_CHECK(rows.numels[j] > 0 || rows.batch == 0, op, ": cannot compute the ", python_float(ord),
          " norm of parameter ", j, "'s per-sample gradients: they are empty, and that norm has no identity");
    }
  }
}

// per_sample_accumulate_'s checks of its other arguments, before the rows are read: the sums and the noisy
// gradients (dense, on `device`, one per parameter), the noise and the divisor.
inline void check_per_sample_sums(at::TensorList summed, at::TensorList grads, int64_t params, double noise_std,
    double divisor, c10::Device device, const char* op) {
  TORCH_CHECK(static_cast<int64_t>(summed.size()) == params, op, ": summed must have one tensor per parameter (",
      params, "), got ", summed.size());
  TORCH_CHECK(grads.empty() || static_cast<int64_t>(grads.size()) == params, op,
      ": grads must be empty or have one tensor per parameter (", params, "), got ", grads.size());
  TORCH_CHECK(std::isfinite(noise_std) && noise_std >= 0, op, ": noise_std must be a finite number >= 0, got ",
      python_float(noise_std));
  TORCH_CHECK(std::isfinite(divisor) && divisor > 0, op, ": divisor must be a finite number > 0, got ",
      python_float(divisor));
  for (int64_t j = 0; j < params; ++j) {
    const at::Tensor& s = summed[j];
    TORCH_CHECK(s.defined() && s.device() == device && kernel_dtype(s), op, ": summed[", j,
        "] must be a dense float16, bfloat16, float32 or float64 tensor on ", device, ", got ",
        s.defined() ? s.toString() : "None", s.defined() ? c10::str(s.sizes(), " on ", s.device()) : "");
    if (!grads.empty()) {
      const at::Tensor& g = grads[j];
      TORCH_CHECK(g.defined() && g.device() == device && kernel_dtype(g) && g.scalar_type() == s.scalar_type() &&
              g.sizes() == s.sizes(),
          op, ": grads[", j, "] must be a dense tensor of summed[", j, "]'s dtype, shape and device (", s.scalar_type(),
          s.sizes(), ")");
    }
  }
}

// The rows' shapes against the sums', and the factors' shape [1 or P, B] (float64, on `device`).
inline void check_per_sample_shapes(const SampleRows& rows, at::TensorList summed, const at::Tensor& factors,
    c10::Device device, const char* op) {
  const int64_t params = static_cast<int64_t>(summed.size());
  for (int64_t j = 0; j < params; ++j) {
    TORCH_CHECK(summed[j].sizes() == rows.firsts[j].sizes().slice(1), op, ": summed[", j, "] has shape ",
        summed[j].sizes(), " but parameter ", j, "'s per-sample gradients are ", rows.firsts[j].sizes(),
        "; they must be [batch, *summed.shape]");
  }
  TORCH_CHECK(factors.device() == device && factors.scalar_type() == at::kDouble && factors.dim() == 2 &&
          factors.size(1) == rows.batch && (factors.size(0) == 1 || factors.size(0) == params),
      op, ": factors must be a float64 tensor [1 or ", params, ", ", rows.batch, "] on ", device, ", got ",
      factors.scalar_type(), factors.sizes(), " on ", factors.device());
}

// per_sample_accumulate_'s rows, after every check the op makes before its first write: the arguments, the rows,
// their shapes against the sums', and the written tensors (none refused under inference mode, no two sharing
// memory: the kernels write each element once).
inline SampleRows checked_accumulate_rows(at::TensorList grad_samples, at::IntArrayRef pieces,
    const at::Tensor& factors, at::TensorList summed, at::TensorList grads, double noise_std, double divisor,
    c10::Device device, const char* op) {
  check_per_sample_sums(summed, grads, static_cast<int64_t>(pieces.size()), noise_std, divisor, device, op);
  SampleRows rows = sample_rows(grad_samples, pieces, op, device, summed);
  check_per_sample_shapes(rows, summed, factors, device, op);
  std::vector<at::Tensor> written(summed.begin(), summed.end());
  written.insert(written.end(), grads.begin(), grads.end());
  check_not_inference(written, op);
  TORCH_CHECK(!tensors_may_overlap(written), op, ": summed and grads must not share memory");
  return rows;
}

// The kernels' description of every parameter: `row_pointers` holds rows.rows where the kernels read them (the
// host's array on the CPU, a device copy on CUDA), `dense_factors` the [1 or P, B] factors, contiguous.
inline std::vector<PerSampleParam> per_sample_params(const SampleRows& rows, const void* const* row_pointers,
    const at::Tensor& dense_factors, at::TensorList summed, at::TensorList grads) {
  const double* factor_rows = dense_factors.data_ptr<double>();
  std::vector<PerSampleParam> params(summed.size());
  for (size_t j = 0; j < params.size(); ++j) {
    const auto jj = static_cast<int64_t>(j);
    params[j] = {row_pointers + jj * rows.batch, factor_rows + (dense_factors.size(0) == 1 ? 0 : jj * rows.batch),
        summed[j].data_ptr(), grads.empty() ? nullptr : grads[j].data_ptr(), rows.numels[j], rows.dtypes[j],
        *kernel_dtype(summed[j])};
  }
  return params;
}

}  // namespace torchclip
