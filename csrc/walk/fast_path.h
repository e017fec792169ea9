// The eager fast path: each entry point walks the parameters (param_walk.h) and calls the ops'
// implementations for their device directly, on the walk's split: the CPU's (cpu/ops_cpu.h) or
// CUDA's (cuda_split_ops.h). Each answers None (False for the clamps) when the walk declines, and the
// Python routing (torchclip/clip_grad.py, clip.py) then takes the general path. Bound in
// python_module.cpp.
//
// They take the drop-ins' arguments as the caller passed them, so that the drop-ins call here first
// thing: converting in Python first cost 10-20 us of a 0.5 ms call on 10,000 parameters. A number
// other than a float or an int is left to the Python path, which converts it or names it in its error.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

namespace torchclip::walk {

namespace py = pybind11;

// Where the walk finds the CUDA implementations: torchclip._cuda's split_ops capsule, handed over by
// torchclip._ops at import.
void use_cuda_split_ops(py::capsule ops);

// `exact` (the norm-taking entries): the call's exact argument (None: the process-wide setting).

// get_total_norm: the total norm.
py::object total_norm_of_plain(py::handle tensors, py::handle norm_type, py::handle error_if_nonfinite,
    std::optional<bool> exact);

// clip_grad_norm_ and ClipGradByGlobalNorm: the total norm, or with keep_stats (total, per-tensor norms,
// coefficient) as the op's schema returns them (None also when there is no gradient).
py::object clip_grad_norm_of_plain(py::handle parameters, py::handle max_norm, py::handle norm_type,
    py::handle error_if_nonfinite, double eps, bool norm_at_least_float32, bool honor_need_clip,
    const std::string& nonfinite, bool keep_stats, std::optional<bool> exact);

// ClipGradByNorm: the per-tensor norms (None also when there is no gradient).
py::object clip_by_tensor_norm_of_plain(py::handle parameters, double max_norm, bool honor_need_clip,
    const std::string& nonfinite, std::optional<bool> exact);

// ClipGradByValue: True when done here, "no gradients" included.
bool clamp_grads_of_plain(py::handle parameters, double min, double max, bool honor_need_clip);

// clip_grad_value_: True when done here, "no gradients" included.
bool clip_grad_value_of_plain(py::handle parameters, py::handle clip_value);

}  // namespace torchclip::walk
