// torchclip._C: registers the ops (ops.cpp, cpu/ops_cpu.cpp are linked in) and exposes a few Python
// helpers. Ops go through the dispatcher (torch.ops.torchclip.*); pybind11 carries only what is not
// an op: build information, loading the per-ISA kernel library, and the parameter walk below.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/version.h>

#include "cpu/kernel_loader.h"

#ifndef TORCHCLIP_CPU_CAPABILITIES
#error "TORCHCLIP_CPU_CAPABILITIES must list the compiled CPU kernel libraries"
#endif

namespace {

// The tensors the CPU kernels can serve, collected in one C++ walk: the items of `items` (a list or
// tuple) themselves, or with take_grad their .grad, skipping undefined ones. Returns None unless every
// item is a plain torch.Tensor / nn.Parameter and every collected tensor a plain strided CPU tensor;
// the caller then takes the general path (other devices, sparse gradients, tensor subclasses whose
// .grad or arithmetic may mean something else).
//
// Why C++: reading .grad from Python costs ~55 ns per parameter per access and torch's filter reads
// it twice: 1.1 ms for 10,000 parameters, more than the kernels spend on their data.
py::object plain_cpu_tensors(py::handle items_handle, bool take_grad) {
  PyObject* seq = items_handle.ptr();
  TORCH_CHECK(PyList_Check(seq) || PyTuple_Check(seq), "plain_cpu_tensors expects a list or tuple");
  const Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  py::list tensors;
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = items[i];
    if (!THPVariable_CheckExact(item)) {
      return py::none();
    }
    const at::Tensor& tensor = take_grad ? THPVariable_Unpack(item).grad() : THPVariable_Unpack(item);
    if (!tensor.defined()) {
      continue;
    }
    if (!tensor.device().is_cpu() || tensor.layout() != at::kStrided) {
      return py::none();
    }
    if (!take_grad) {
      tensors.append(item);
      continue;
    }
    py::object wrapped = py::reinterpret_steal<py::object>(THPVariable_Wrap(tensor));
    if (!THPVariable_CheckExact(wrapped.ptr())) {
      return py::none();
    }
    tensors.append(wrapped);
  }
  return std::move(tensors);
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
  m.def("plain_cpu_tensors", &plain_cpu_tensors, py::arg("items"), py::arg("take_grad"));
}
