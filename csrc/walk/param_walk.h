// The parameter walk: one C++ pass over a Python list of parameters (or tensors) that gathers their
// gradients (or themselves), checks that the ops' implementations may be called on them directly, and
// files them into the Split those implementations take on every device (split.h).
//
// Why a walk in C++ at all: reading .grad from Python costs ~55 ns per parameter, and the dispatcher's
// list handling (key sets, refcounts, a second walk to split, the Autograd kernel's version bumps)
// cost 0.7 ms on 10,000 x 100 floats against 0.1 ms of memory traffic. Everything here is torch's
// public C++ API (TensorImpl's accessors, the autograd meta's interface, MaybeOwned borrows).
//
// Threads: with the GIL, the caller holds it for the whole walk, so no Python code can change a list
// or a .grad while torch's intra-op threads read them. Free-threaded CPython (Py_GIL_DISABLED) has no
// such guarantee: there the walk runs on the calling thread, inside a critical section on the list,
// and owns every tensor it gathers.
#pragma once

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <vector>

#include "split.h"

namespace torchclip::walk {

// The one rule for which tensors the torchclip ops take (the walk checks it for every tensor it
// gathers, and Python's routing asks it through kernels_serve): a strided tensor on `device`, with no
// dispatch key that hands its operations to a wrapper (a Python subclass with __torch_dispatch__, a
// fake or functional tensor), whose data would not be its own to write.
bool plain_on(const c10::TensorImpl& tensor, c10::Device device);

// Whether the devices' kernels were built: the CPU always, CUDA when torchclip._cuda was.
bool kernels_built_for(c10::Device device);

// Whether the torchclip ops serve every item of `tensors` (a list or tuple): each an exact torch.Tensor
// or nn.Parameter (a subclass may give its arithmetic another meaning), plain_on() one device whose
// kernels were built, the CPU, or CUDA when `cuda_allowed`. True for no tensors.
bool kernels_serve(PyObject* tensors, bool cuda_allowed);

// The general path's read of a parameter list (a list or tuple of tensors of any type: DTensor parameters
// too): a new reference to (a list of the defined gradients, the index of the first parameter whose gradient's
// shape is not its own or -1), or to None where an item is not a tensor, is nested or is not a leaf (whose
// .grad torch's getter warns about), for Python to take.
// One pass in C++: in Python, p.grad and two .shape reads cost ~1.5 us a DTensor parameter. A gradient is
// read as the tensor's own (TensorImpl::grad), which is what .grad returns for every tensor type that does
// not override the property in Python (torch's own, Parameter, DTensor).
PyObject* defined_grads(PyObject* parameters);

// The tensors of one fast-path call, gathered from a Python list, tuple or lone tensor.
class GatheredTensors {
 public:
  GatheredTensors() = default;
  GatheredTensors(const GatheredTensors&) = delete;
  GatheredTensors& operator=(const GatheredTensors&) = delete;
  ~GatheredTensors();

  // Gathers the items themselves or, with take_grad, their defined .grad; with honor_need_clip, items
  // whose need_clip attribute is False are left out. Returns false (the caller then takes the general
  // path, which serves or names every case) unless: no dispatch key is forced on or off by a mode
  // (a TorchDispatchMode, inference mode, functorch), so the dispatcher would reach the Autograd and
  // then the device kernel and nothing else could see the call; every item is an exact tensor object;
  // every gathered tensor is plain_on() one device whose kernels were built, tracked by autograd's
  // version counter (not an inference tensor), not requiring grad while grad mode is on (the
  // dispatcher's path raises there), and, for a gradient, of its parameter's shape (the Python path
  // raises, naming both shapes); and no undefined .grad belongs to a non-leaf (torch warns there).
  bool gather(PyObject* items, bool take_grad, bool honor_need_clip);

  bool empty() const { return tensors_.empty(); }
  bool on_cpu() const { return device_.is_cpu(); }
  at::TensorList tensors() const { return tensors_; }
  const Split& split() const { return split_; }
  // Whether the kernels may run without the GIL: only when the tensors are owned, not borrowed.
  bool may_release_gil() const { return !borrowed_; }

  // What the Autograd kernels of the mutating ops do after writing (ops_autograd.cpp), which the
  // dispatcher's path would have run.
  void bump_versions() const;

 private:
  bool walk(PyObject* items, bool take_grad, bool honor_need_clip);
  void close_gaps(const uint8_t* has_span);

  std::vector<at::Tensor> tensors_;
  c10::Device device_{c10::kCPU};
  Split split_;
  int64_t elements_ = 0;
  bool borrowed_ = true;
};

}  // namespace torchclip::walk
