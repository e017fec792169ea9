// torchclip._C: the Python module that registers the ops (ops.cpp and cpu/ops_cpu.cpp are linked in:
// torch.ops.torchclip.*) and binds what is not an op: build information, the choice of CPU kernel
// library, and the eager fast path (walk/fast_path.h). Bindings only.
// pybind11 with torch's type casters, not <torch/extension.h>: that one brings the whole C++ frontend (nn, optim,
// data) and made this file the slowest of the build (about 100 s of a core; this header, about 35 s).
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <string>
#include <vector>

#include "cpu/kernel_loader.h"
#include "cpu/ops_cpu.h"
#include "walk/fast_path.h"
#include "walk/param_walk.h"

#ifndef TORCHCLIP_CPU_CAPABILITIES
#error "TORCHCLIP_CPU_CAPABILITIES must list the compiled CPU kernel libraries"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchclip native extension: op registration and build information";
  m.def(
      "torch_version_built_against", [] { return std::string(TORCH_VERSION); },
      "The torch version this extension was compiled against.");
  m.def(
      "cpu_capabilities_built",
      [] {
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
  m.def(
      "cuda_built", [] { return torchclip::walk::kernels_built_for(c10::Device(c10::kCUDA)); },
      "Whether the CUDA kernels were built (torchclip._cuda).");
  m.def("use_cuda_split_ops", &torchclip::walk::use_cuda_split_ops, py::arg("ops"),
      "Hand the walk torchclip._cuda's implementations (its split_ops capsule).");
  m.def("load_cpu_kernels", &torchclip::load_cpu_kernels, py::arg("path"),
      "Load a per-ISA CPU kernel library and use it for every CPU op from now on.");
  m.def("loaded_cpu_capability", &torchclip::loaded_cpu_capability);
  m.def("set_exact_norms", &torchclip::set_exact_norms, py::arg("enabled"),
      "Exact p = 1 and 2 norms on the CPU from now on (or not); returns the previous setting.");
  m.def("exact_norms_enabled", &torchclip::exact_norms_enabled);
  m.attr("EXACT_SUM_COLUMNS") = torchclip::kExactSumColumns;
  m.def(
      "exact_sums",
      [](const std::vector<at::Tensor>& tensors, double ord, bool per_tensor) {
        return torchclip::exact_sums_cpu(tensors, ord, per_tensor);
      },
      py::arg("tensors"), py::arg("ord"), py::arg("per_tensor"),
      "Exact sums of |x| or x^2 of CPU tensors as int64 rows (cpu/ops_cpu.h), for ranks to add.");
  m.def("norms_of_exact_sums", &torchclip::norms_of_exact_sums, py::arg("sums"), py::arg("ord"),
      "The correctly rounded norms (float64) of summed exact_sums rows.");
  m.def("cpu_runs", &torchclip::cpu_runs, py::arg("capability"),
      "Whether this CPU has every instruction set of the kernel library for `capability`");
  m.def(
      "kernels_serve",
      [](py::handle tensors, bool cuda_allowed) { return torchclip::walk::kernels_serve(tensors.ptr(), cuda_allowed); },
      py::arg("tensors"), py::arg("cuda_allowed") = true,
      "Whether the torchclip ops serve every tensor of this list or tuple (walk/param_walk.h).");

  m.def(
      "defined_grads",
      [](py::handle parameters) {
        return py::reinterpret_steal<py::object>(torchclip::walk::defined_grads(parameters.ptr()));
      },
      py::arg("parameters"),
      "(the defined gradients, the first parameter whose gradient has another shape or -1), or None where an "
      "item is not a tensor (walk/param_walk.h).");

  using namespace torchclip::walk;  // the fast path's entry points: see walk/fast_path.h
  m.def("total_norm_of_plain", &total_norm_of_plain, py::arg("tensors"), py::arg("norm_type"),
      py::arg("error_if_nonfinite"), py::arg("exact") = py::none());
  m.def("clip_grad_norm_of_plain", &clip_grad_norm_of_plain, py::arg("parameters"), py::arg("max_norm"),
      py::arg("norm_type"), py::arg("error_if_nonfinite"), py::arg("eps") = 1e-6,
      py::arg("norm_at_least_float32") = false, py::arg("honor_need_clip") = false, py::arg("nonfinite") = "propagate",
      py::arg("keep_stats") = false, py::arg("exact") = py::none());
  m.def("clip_by_tensor_norm_of_plain", &clip_by_tensor_norm_of_plain, py::arg("parameters"), py::arg("max_norm"),
      py::arg("honor_need_clip"), py::arg("nonfinite") = "propagate", py::arg("exact") = py::none());
  m.def("clip_grad_value_of_plain", &clip_grad_value_of_plain, py::arg("parameters"), py::arg("clip_value"));
  m.def("clamp_grads_of_plain", &clamp_grads_of_plain, py::arg("parameters"), py::arg("min"), py::arg("max"),
      py::arg("honor_need_clip") = false);
}
