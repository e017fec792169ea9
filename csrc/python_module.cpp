// torchclip._C: registers the ops (ops.cpp, cpu/ops_cpu.cpp are linked in) and exposes a few Python
// helpers. Ops go through the dispatcher (torch.ops.torchclip.*); pybind11 carries only what is not
// an op: build information, loading the per-ISA kernel library, and the eager fast path below, which
// walks the parameters in C++ and calls the same ops through the C++ dispatcher.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "cpu/kernel_loader.h"

#ifndef TORCHCLIP_CPU_CAPABILITIES
#error "TORCHCLIP_CPU_CAPABILITIES must list the compiled CPU kernel libraries"
#endif

namespace {

// The eager fast path for plain CPU tensors: one C++ walk over the Python list, then the op through
// the C++ dispatcher. Why not Python: reading .grad costs ~55 ns per parameter per access (torch's
// filter reads it twice: 1.1 ms for 10,000 parameters), and passing a 10,000-tensor list through
// torch.ops costs ~0.5 ms more; both exceed what the kernels spend on 10,000 x 100 floats.
//
// Paddle's ParamAttr(need_clip=False), as torchclip marks it: a `need_clip` attribute that is False.
// Looked up without raising AttributeError for the (usual) parameters that have none.
bool need_clip(PyObject* param) {
  static PyObject* const name = PyUnicode_InternFromString("need_clip");
  PyObject* value = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  const int found = PyObject_GetOptionalAttr(param, name, &value);
#else
  const int found = _PyObject_LookupAttr(param, name, &value);
#endif
  if (found < 0) {
    throw py::error_already_set();
  }
  if (found == 0) {
    return true;
  }
  const bool excluded = value == Py_False;
  Py_DECREF(value);
  return !excluded;
}

// Collects `items` (a list or tuple) themselves, or with take_grad their defined .grad, into `out`;
// with honor_need_clip, items whose need_clip attribute is False are left out.
// Returns false, and the caller takes the general Python path, unless every item is a plain
// torch.Tensor / nn.Parameter (a subclass may give .grad another meaning) and every collected tensor
// a strided CPU tensor without a Python dispatch key (no tensor subclass, fake or functional tensor).
bool collect_plain_cpu(py::handle items, bool take_grad, bool honor_need_clip, std::vector<at::Tensor>& out) {
  PyObject* seq = items.ptr();
  if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
    return false;
  }
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
  PyObject** elements = PySequence_Fast_ITEMS(seq);
  out.reserve(count);
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!THPVariable_CheckExact(elements[i])) {
      return false;
    }
    const at::Tensor& item = THPVariable_Unpack(elements[i]);
    const at::Tensor& tensor = take_grad ? item.grad() : item;
    if (!tensor.defined() || (honor_need_clip && !need_clip(elements[i]))) {
      continue;
    }
    if (!tensor.device().is_cpu() || tensor.layout() != at::kStrided ||
        tensor.key_set().has(c10::DispatchKey::Python)) {
      return false;
    }
    if (take_grad && tensor.sizes() != item.sizes()) {
      return false;  // the Python path raises, naming the parameter and both shapes
    }
    out.push_back(tensor);
  }
  return true;
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> torchclip_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// get_total_norm: the total norm, or None when the general path must serve these tensors.
py::object total_norm_of_plain_cpu(py::handle tensors, double norm_type, bool error_if_nonfinite) {
  static const auto op = torchclip_op<std::tuple<at::Tensor, at::Tensor>(at::TensorList, double, bool)>(
      "torchclip::multi_tensor_norm");
  std::vector<at::Tensor> list;
  if (!collect_plain_cpu(tensors, false, false, list) || list.empty()) {
    return py::none();
  }
  at::Tensor total;
  {
    py::gil_scoped_release no_gil;
    total = std::get<0>(op.call(list, norm_type, error_if_nonfinite));
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(total)));
}

// clip_grad_norm_ and ClipGradByGlobalNorm: the total norm, or None (general path, or no gradients).
py::object clip_grad_norm_of_plain_cpu(py::handle parameters, double max_norm, double norm_type,
    bool error_if_nonfinite, double eps, bool norm_at_least_float32, bool honor_need_clip, const std::string& nonfinite) {
  static const auto op = torchclip_op<at::Tensor(at::TensorList, double, double, bool, double, bool, c10::string_view)>(
      "torchclip::clip_grad_norm_");
  std::vector<at::Tensor> grads;
  if (!collect_plain_cpu(parameters, true, honor_need_clip, grads) || grads.empty()) {
    return py::none();
  }
  at::Tensor total;
  {
    py::gil_scoped_release no_gil;
    total = op.call(grads, max_norm, norm_type, error_if_nonfinite, eps, norm_at_least_float32, nonfinite);
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(total)));
}

// ClipGradByNorm: the per-tensor norms, or None (general path, or no gradients).
py::object clip_by_tensor_norm_of_plain_cpu(py::handle parameters, double max_norm, bool honor_need_clip,
    const std::string& nonfinite) {
  static const auto op =
      torchclip_op<at::Tensor(at::TensorList, double, c10::string_view)>("torchclip::clip_by_tensor_norm_");
  std::vector<at::Tensor> grads;
  if (!collect_plain_cpu(parameters, true, honor_need_clip, grads) || grads.empty()) {
    return py::none();
  }
  at::Tensor norms;
  {
    py::gil_scoped_release no_gil;
    norms = op.call(grads, max_norm, nonfinite);
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(norms)));
}

// clip_grad_value_ and ClipGradByValue: True when done here (including "no gradients"), False for
// the general path.
bool clamp_grads_of_plain_cpu(py::handle parameters, double min, double max, bool honor_need_clip) {
  static const auto op = torchclip_op<void(at::TensorList, double, double)>("torchclip::multi_tensor_clamp_");
  std::vector<at::Tensor> grads;
  if (!collect_plain_cpu(parameters, true, honor_need_clip, grads)) {
    return false;
  }
  if (!grads.empty()) {
    py::gil_scoped_release no_gil;
    op.call(grads, min, max);
  }
  return true;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchclip native extension: op registration and build information";
  m.def("torch_version_built_against", [] { return std::string(TORCH_VERSION); },
      "The torch version this extension was compiled against.");
  m.def("cpu_capabilities_built", [] {
        std::vector<std::string> names;
        std::string all = TORCHCLIP_CPU_CAPABILITIES;
        for (size_t start = 0, comma; start <= all.size(); start = comma + 1) {
          comma = all.find(',', start);
          if (comma == std::string::npos) {
            comma = all.size();
          }
          names.push_back(all.substr(start, comma - start));
        }
        return names;
      },
      "The CPU instruction sets a kernel library was compiled for.");
  m.def("cuda_built", [] {
#ifdef TORCHCLIP_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("load_cpu_kernels", &torchclip::load_cpu_kernels, py::arg("path"),
      "Load a per-ISA CPU kernel library and use it for every CPU op from now on.");
  m.def("loaded_cpu_capability", &torchclip::loaded_cpu_capability);
  m.def("total_norm_of_plain_cpu", &total_norm_of_plain_cpu, py::arg("tensors"), py::arg("norm_type"),
      py::arg("error_if_nonfinite"));
  m.def("clip_grad_norm_of_plain_cpu", &clip_grad_norm_of_plain_cpu, py::arg("parameters"), py::arg("max_norm"),
      py::arg("norm_type"), py::arg("error_if_nonfinite"), py::arg("eps") = 1e-6,
      py::arg("norm_at_least_float32") = false, py::arg("honor_need_clip") = false,
      py::arg("nonfinite") = "propagate");
  m.def("clip_by_tensor_norm_of_plain_cpu", &clip_by_tensor_norm_of_plain_cpu, py::arg("parameters"),
      py::arg("max_norm"), py::arg("honor_need_clip"), py::arg("nonfinite") = "propagate");
  m.def("clamp_grads_of_plain_cpu", &clamp_grads_of_plain_cpu, py::arg("parameters"), py::arg("min"),
      py::arg("max"), py::arg("honor_need_clip") = false);
}
