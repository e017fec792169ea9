#include "walk/fast_path.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <optional>
#include <tuple>

#include "cpu/ops_cpu.h"
#include "cuda_split_ops.h"
#include "op_shared.h"  // exact_norms_for
#include "walk/param_walk.h"

namespace torchclip::walk {
namespace {

std::atomic<const CudaSplitOps*> cuda_split_ops{nullptr};

const CudaSplitOps& cuda_ops() {
  const CudaSplitOps* ops = cuda_split_ops.load(std::memory_order_acquire);
  // The walk gathers CUDA tensors only when _C was built with CUDA, and torchclip imports _cuda then.
  TORCH_CHECK(ops != nullptr, "torchclip: the CUDA kernels (torchclip._cuda) were built but not loaded");
  return *ops;
}

// A Python float or int as a double; nothing for anything else (the Python path converts it or names
// it), or for an int too large for a double (float() raises there, naming the argument).
std::optional<double> plain_number(py::handle value) {
  if (PyFloat_CheckExact(value.ptr())) {
    return PyFloat_AS_DOUBLE(value.ptr());
  }
  if (PyLong_CheckExact(value.ptr())) {
    const double converted = PyLong_AsDouble(value.ptr());
    if (converted == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return std::nullopt;
    }
    return converted;
  }
  return std::nullopt;
}

// Python's truth of a flag, as torch's `if error_if_nonfinite and ...` takes it. Read before the walk:
// __bool__ may run Python code.
bool truth(py::handle flag) {
  const int is_true = PyObject_IsTrue(flag.ptr());
  if (is_true < 0) {
    throw py::error_already_set();
  }
  return is_true != 0;
}

py::object wrap(at::Tensor tensor) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(tensor)));
}

// Runs the op on the gathered tensors, its implementation for their device (the CPU's, or CUDA's
// through CudaSplitOps) called directly on the walk's split, under a profiler event with the op's
// name (what the dispatcher would record). Without the GIL when the tensors are owned.
template <typename OnCpu, typename OnCuda>
auto run(const GatheredTensors& gathered, const char* op, const OnCpu& on_cpu, const OnCuda& on_cuda) {
  std::optional<py::gil_scoped_release> no_gil;
  if (gathered.may_release_gil()) {
    no_gil.emplace();
  }
  RECORD_FUNCTION(op, std::vector<c10::IValue>{c10::IValue(gathered.tensors())});
  if (gathered.on_cpu()) {
    return on_cpu(gathered.tensors(), gathered.split());
  }
  return on_cuda(cuda_ops(), gathered.tensors(), gathered.split());
}

}  // namespace

void use_cuda_split_ops(py::capsule ops) {
  if (!PyCapsule_IsValid(ops.ptr(), kCudaSplitOpsCapsule)) {
    throw py::import_error(std::string("torchclip._cuda and torchclip._C come from different builds (_C expects a "
                                       "capsule named ") +
        kCudaSplitOpsCapsule + "); rebuild: pip install --no-build-isolation -e .");
  }
  cuda_split_ops.store(static_cast<const CudaSplitOps*>(PyCapsule_GetPointer(ops.ptr(), kCudaSplitOpsCapsule)),
      std::memory_order_release);
}

py::object total_norm_of_plain(py::handle tensors, py::handle norm_type_arg, py::handle error_if_nonfinite,
    std::optional<bool> exact) {
  const std::optional<double> norm_type = plain_number(norm_type_arg);
  const bool nonfinite_raises = truth(error_if_nonfinite);
  GatheredTensors gathered;
  if (!norm_type || !gathered.gather(tensors.ptr(), false, false) || gathered.empty()) {
    return py::none();
  }
  return wrap(run(
      gathered, "torchclip::multi_tensor_norm",
      [&](at::TensorList list, const Split& split) {
        return total_norm_cpu_split(list, split, *norm_type, nonfinite_raises, exact_norms_for(exact));
      },
      [&](const CudaSplitOps& cuda, at::TensorList list, const Split& split) {
        return cuda.total_norm(list, split, *norm_type, nonfinite_raises, exact);
      }));
}

py::object clip_grad_norm_of_plain(py::handle parameters, py::handle max_norm_arg, py::handle norm_type_arg,
    py::handle error_if_nonfinite, double eps, bool norm_at_least_float32, bool honor_need_clip,
    const std::string& nonfinite, bool keep_stats, std::optional<bool> exact) {
  const std::optional<double> max_norm = plain_number(max_norm_arg), norm_type = plain_number(norm_type_arg);
  const bool nonfinite_raises = truth(error_if_nonfinite);
  GatheredTensors grads;
  if (!max_norm || !norm_type || !grads.gather(parameters.ptr(), true, honor_need_clip) || grads.empty()) {
    return py::none();
  }
  NormClipStats stats;
  NormClipStats* const kept = keep_stats ? &stats : nullptr;
  at::Tensor total = run(
      grads, "torchclip::clip_grad_norm_",
      [&](at::TensorList list, const Split& split) {
        return clip_grad_norm_cpu_split(list, split, *max_norm, *norm_type, nonfinite_raises, eps,
            norm_at_least_float32, nonfinite, exact_norms_for(exact), kept);
      },
      [&](const CudaSplitOps& cuda, at::TensorList list, const Split& split) {
        return cuda.clip_grad_norm_(list, split, *max_norm, *norm_type, nonfinite_raises, eps, norm_at_least_float32,
            nonfinite, exact, kept);
      });
  grads.bump_versions();
  if (keep_stats) {
    return py::make_tuple(wrap(std::move(total)), wrap(std::move(stats.norms)), wrap(std::move(stats.coefficient)));
  }
  return wrap(std::move(total));
}

py::object clip_by_tensor_norm_of_plain(py::handle parameters, double max_norm, bool honor_need_clip,
    const std::string& nonfinite, std::optional<bool> exact) {
  GatheredTensors grads;
  if (!grads.gather(parameters.ptr(), true, honor_need_clip) || grads.empty()) {
    return py::none();
  }
  at::Tensor norms = run(
      grads, "torchclip::clip_by_tensor_norm_",
      [&](at::TensorList list, const Split& split) {
        return clip_by_tensor_norm_cpu_split(list, split, max_norm, nonfinite, exact_norms_for(exact));
      },
      [&](const CudaSplitOps& cuda, at::TensorList list, const Split& split) {
        return cuda.clip_by_tensor_norm_(list, split, max_norm, nonfinite, exact);
      });
  grads.bump_versions();
  return wrap(std::move(norms));
}

bool clamp_grads_of_plain(py::handle parameters, double min, double max, bool honor_need_clip) {
  GatheredTensors grads;
  if (!grads.gather(parameters.ptr(), true, honor_need_clip)) {
    return false;
  }
  if (!grads.empty()) {
    run(
        grads, "torchclip::multi_tensor_clamp_",
        [&](at::TensorList list, const Split& split) { multi_tensor_clamp_cpu_split(list, split, min, max); },
        [&](const CudaSplitOps& cuda, at::TensorList list, const Split& split) {
          cuda.multi_tensor_clamp_(list, split, min, max);
        });
    grads.bump_versions();
  }
  return true;
}

bool clip_grad_value_of_plain(py::handle parameters, py::handle clip_value_arg) {
  const std::optional<double> clip_value = plain_number(clip_value_arg);
  return clip_value && clamp_grads_of_plain(parameters, -*clip_value, *clip_value, false);
}

}  // namespace torchclip::walk
