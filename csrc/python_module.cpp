// torchclip._C: registers the ops (ops.cpp, cpu/ops_cpu.cpp are linked in) and exposes a few Python
// helpers. Ops go through the dispatcher (torch.ops.torchclip.*); pybind11 carries only what is not
// an op: build information, loading the per-ISA kernel library, and the eager fast path below, which
// walks the parameters in C++ and calls the CPU ops' own implementations (cpu/ops_cpu.h), or for
// CUDA tensors the ops through the dispatcher (op_handles.h).
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/version.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <memory>
#include <optional>

#include "cpu/kernel_loader.h"
#include "cpu/ops_cpu.h"
#include "op_handles.h"
#include "op_shared.h"

#ifndef TORCHCLIP_CPU_CAPABILITIES
#error "TORCHCLIP_CPU_CAPABILITIES must list the compiled CPU kernel libraries"
#endif

namespace {

// The eager fast path for plain tensors on one device: one C++ walk over the Python list (shared by
// the intra-op threads for long lists) that gathers the tensors and, for CPU tensors, sorts them for
// the kernels (the Split the CPU ops build), then the CPU ops' shared implementations, called
// directly. Why not Python: reading .grad costs ~55 ns per parameter per access (torch's filter reads
// it twice: 1.1 ms for 10,000 parameters). Why not the dispatcher: for 10,000 x 100 floats its list
// handling (key sets, refcounts, a second walk to split, the Autograd kernel's version bumps) cost
// 0.7 ms against 0.1 ms of memory traffic. CUDA tensors do go to their kernels through the dispatcher, with the list built
// here: the Python loops this replaces (collecting .grad, checking each tensor's device and type)
// cost ~0.6 us per tensor, more than the GPU work for 10,000 small gradients (clip_grad_value_ on an
// H100 machine: 8.9 ms before, 2.9 ms after, torch 7.8-12 ms; `torchclip-bench --device cuda`). The
// walk serves only the calls where skipping the dispatcher changes nothing (see eligible()); every
// other call returns None and takes torch.ops.
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

// Whether calling the implementations directly is what the dispatcher would do: no dispatch key is
// forced on or off by a mode (a TorchDispatchMode, inference mode, functorch), so the dispatcher would
// reach the Autograd kernel and then the CPU one, and nothing else could see the call.
bool eligible() {
  const c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
  return local.included_ == c10::default_included_set && local.excluded_ == c10::default_excluded_set;
}

// Below this many elements the kernels finish in about a millisecond or less, and the walk borrows the
// tensors (no refcount traffic: ~15% of the 10,000 x 100 case) and keeps the GIL, which is what keeps
// borrowed tensors alive (no other thread can reset a .grad). Above it, it owns them and lets go of
// the GIL while the kernels run.
constexpr int64_t kBorrowBelowElements = int64_t{1} << 22;

// A gradient has its parameter's shape (inline: IntArrayRef's == calls memcmp).
C10_ALWAYS_INLINE bool same_sizes(const at::Tensor& grad, const at::Tensor& param) {
  const c10::IntArrayRef a = grad.unsafeGetTensorImpl()->sizes(), b = param.unsafeGetTensorImpl()->sizes();
  if (a.size() != b.size()) {
    return false;
  }
  for (size_t d = 0; d < a.size(); ++d) {
    if (a[d] != b[d]) {
      return false;
    }
  }
  return true;
}

// The autograd meta of a TensorImpl, read from the field. TensorImpl::autograd_meta() is a call into
// libc10, reached through torch's get_autograd_meta(), a call into libtorch; the walk needs the meta
// four times per item (the item's twice, ahead and when gathering it, its gradient's once or twice),
// and in a profile of the walk on 1,000 gradients warm in cache those calls and their PLT hops took a
// third of its time. The field is private, but it is declared right before the protected
// extra_meta_, whose offset a derived class may name (&TensorImplFields::extra_meta_ has type
// `std::unique_ptr<ExtraMeta> TensorImpl::*`). autograd_meta_offset() checks the result once against
// autograd_meta() and gives -1 when it does not hold, and the walk then calls autograd_meta().
struct TensorImplFields : c10::TensorImpl {
  static const std::optional<c10::Device>& device(const c10::TensorImpl* impl) {
    return impl->*(&TensorImplFields::device_opt_);
  }
  static std::ptrdiff_t offset_before_extra_meta(const c10::TensorImpl* impl) {
    return reinterpret_cast<const char*>(&(impl->*(&TensorImplFields::extra_meta_))) -
        reinterpret_cast<const char*>(impl) - static_cast<std::ptrdiff_t>(sizeof(std::unique_ptr<c10::AutogradMetaInterface>));
  }
};

inline const torch::autograd::AutogradMeta* autograd_meta_at(const c10::TensorImpl* impl, std::ptrdiff_t offset) {
  const c10::AutogradMetaInterface* meta = offset >= 0
      ? *reinterpret_cast<c10::AutogradMetaInterface* const*>(reinterpret_cast<const char*>(impl) + offset)
      : impl->autograd_meta();
  // (torch's get_autograd_meta() casts the same way: every autograd meta is an AutogradMeta)
  return static_cast<const torch::autograd::AutogradMeta*>(meta);
}

std::ptrdiff_t autograd_meta_offset() {
  static const std::ptrdiff_t offset = [] {
    const at::Tensor plain = at::zeros({1});
    at::Tensor tracked = at::zeros({1});
    tracked.set_requires_grad(true);
    const c10::TensorImpl* impl = tracked.unsafeGetTensorImpl();
    const std::ptrdiff_t candidate = TensorImplFields::offset_before_extra_meta(impl);
    const bool holds = impl->autograd_meta() != nullptr && autograd_meta_at(impl, candidate) == impl->autograd_meta() &&
        plain.unsafeGetTensorImpl()->autograd_meta() == nullptr &&
        autograd_meta_at(plain.unsafeGetTensorImpl(), candidate) == nullptr;
    return holds ? candidate : std::ptrdiff_t{-1};
  }();
  return offset;
}

// A gradient: the field itself. Tensor::grad() first asks autograd (a virtual call into libtorch)
// whether the item is a leaf, only to warn about non-leaf items, and TensorImpl::grad() reads the
// autograd meta's vtable, often a cache line of its own.
inline const at::Tensor& grad_of(const at::Tensor& item, std::ptrdiff_t meta_offset) {
  static const at::Tensor undefined;
  const torch::autograd::AutogradMeta* meta = autograd_meta_at(item.unsafeGetTensorImpl(), meta_offset);
  return meta != nullptr ? meta->grad_ : undefined;
}

// TensorImpl::requires_grad() without its calls: into libc10, then the meta's virtual requires_grad(),
// which for a view (every gradient in a DDP bucket or a flat buffer) asks its base through libc10
// again; 5% of the warm walk's time in a profile. These are the fields those calls read, in
// DifferentiableViewMeta::requires_grad()'s order (an inline function of the headers built against),
// with the test torch's get_view_autograd_meta() uses: is_view_ marks a DifferentiableViewMeta.
inline bool requires_grad(const c10::TensorImpl* impl, std::ptrdiff_t meta_offset) {
  const torch::autograd::AutogradMeta* meta = autograd_meta_at(impl, meta_offset);
  if (meta == nullptr) {
    return false;
  }
  if (!meta->is_view_) {
    return meta->requires_grad();
  }
  const auto* view = static_cast<const torch::autograd::DifferentiableViewMeta*>(meta);
  return view->requires_grad_ || view->grad_fn_ ||
      (view->has_bw_view() && requires_grad(view->get_backward_view().base_.unsafeGetTensorImpl(), meta_offset));
}

// The walk's cost is memory latency: each item is a chain of dependent loads, Python object ->
// TensorImpl -> AutogradMeta -> gradient's TensorImpl -> StorageImpl (and its version counter), about
// 9 cache lines, which after torch's own call or a training step's other work are not in cache. A
// plain loop waits for each link in turn. The walk therefore requests the links of later items as
// it goes, one link per stage, kPrefetchStride items apart: when item i is processed, its links were
// requested 1 to 5 strides earlier, and each request only dereferences a link that its previous stage
// requested a stride before. Prefetches never fault, so a stage simply stops at a link that is not
// (yet) what the walk expects. Measured on 10,000 x 100 (walk alone, 2 cores): right after torch's
// clip_grad_value_ 427 -> 364 us, after 10 ms of other work 1015 -> 568 us; the same in a warm loop.
// Strides 1, 2, 6, 8 and 12 were no better than 4.
constexpr Py_ssize_t kPrefetchStride = 4;

inline void prefetch(const void* address, bool for_write = false) {
  if (for_write) {
    __builtin_prefetch(address, 1);
  } else {
    __builtin_prefetch(address, 0);
  }
}

// The counter a tensor's VariableVersion points to. c10 keeps its type private; this is the same
// definition, hence the same layout (checked once at run time: version_counters_writable()).
struct VersionCounterLayout : c10::intrusive_ptr_target {
  std::atomic<uint32_t> version_;
};

inline VersionCounterLayout* version_counter_of(const c10::TensorImpl* impl) {
  static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion is one pointer");
  return *reinterpret_cast<VersionCounterLayout* const*>(&impl->version_counter());
}

// Requests one link of an item's chain (stage 1: its Python object, 2: its TensorImpl, 3: its
// AutogradMeta, 4: its gradient's TensorImpl, 5: that tensor's StorageImpl and version counter; items
// gathered as themselves skip stages 3 and 4). Field offsets are torch 2.13's TensorImpl layout; in
// another layout a request may fetch a line the walk does not read, which costs only the request.
void prefetch_link(PyObject* object, int stage, bool take_grad, std::ptrdiff_t meta_offset) {
  if (stage == 1) {
    prefetch(&reinterpret_cast<THPVariable*>(object)->cdata);
    return;
  }
  if (!THPVariable_CheckExact(object)) {
    return;
  }
  const at::Tensor& item = THPVariable_Unpack(object);
  const char* impl = reinterpret_cast<const char*>(item.unsafeGetTensorImpl());
  if (stage == 2) {  // the walk reads autograd_meta_ (offset 24), the sizes (56 to 96 for 4-d) and, for
                     // a parameter, the sizes policy (166)
    prefetch(impl + 24);
    prefetch(impl + 95);
    if (take_grad) {
      prefetch(impl + 166);
    }
    return;
  }
  const at::Tensor* tensor = &item;
  if (take_grad) {
    const torch::autograd::AutogradMeta* meta = autograd_meta_at(item.unsafeGetTensorImpl(), meta_offset);
    if (meta == nullptr) {
      return;
    }
    if (stage == 3) {
      prefetch(&meta->grad_);
      return;
    }
    tensor = &meta->grad_;
    if (!tensor->defined()) {
      return;
    }
    const char* grad_impl = reinterpret_cast<const char*>(tensor->unsafeGetTensorImpl());
    if (stage == 4) {  // the walk reads bytes 16 to 175 of a TensorImpl (176 bytes): 3 or 4 lines
      for (int offset : {16, 80, 144, 175}) {
        prefetch(grad_impl + offset);
      }
      return;
    }
  } else if (stage < 5) {
    return;
  }
  const c10::TensorImpl* target = tensor->unsafeGetTensorImpl();
  // Its data pointer. (The field itself: has_storage() is a virtual call.)
  if (const c10::StorageImpl* storage = target->unsafe_storage().unsafeGetStorageImpl()) {
    prefetch(reinterpret_cast<const char*>(storage) + 16);
  }
  // The counter the version bump writes.
  if (const VersionCounterLayout* counter = version_counter_of(target)) {
    prefetch(counter, /*for_write=*/true);
  }
}

#ifdef TORCHCLIP_WITH_CUDA
constexpr bool kCudaKernels = true;  // torchclip._cuda registers them (imported with torchclip)
#else
constexpr bool kCudaKernels = false;
#endif

// Whether version_counter_of() reads the counter torch's own bump_version() writes.
bool version_counters_writable() {
  static const bool writable = [] {
    at::Tensor probe = at::zeros({1});
    VersionCounterLayout* counter = version_counter_of(probe.unsafeGetTensorImpl());
    const uint32_t before = probe._version();
    probe.unsafeGetTensorImpl()->bump_version();
    return counter != nullptr && counter->version_.load() == before + 1 && probe._version() == before + 1;
  }();
  return writable;
}

// Where the walk writes: slot i of each array is item i's, written by whichever thread walks it, so
// the arrays come out in list order with no merge pass. (A pass that gathered per-item records into
// the lists after the walk took 70-90 us on 10,000 x 100; writing the slots in the walk costs part of
// that back: value clipping came out 20-40 us faster, a diagnostic, not a claim.) An item left out
// keeps an undefined tensor; spans[i] and span_source[i] are written only where has_span[i] (a CPU
// tensor kernel_dtype() takes). PlainTensors::close_gaps() closes the arrays up when an item was left
// out or ATen serves one.
struct WalkOutput {
  at::Tensor* tensors;  // borrowed: no reference taken
  VersionCounterLayout** version_counters;
  torchclip::cpu::TensorSpan* spans;
  int64_t* span_source;
  uint8_t* has_span;
};

// The items of a fast-path call: a list or tuple as it is, or one tensor; nothing for any other
// iterable, a subclass of list or tuple included, whose iteration (what torch reads) may differ from
// its storage (the drop-ins drain those into a list first: clip_grad.py, _readable).
struct Items {
  PyObject* const* elements;
  Py_ssize_t count;
};

std::optional<Items> items_of(PyObject* const& object) {
  if (PyList_CheckExact(object) || PyTuple_CheckExact(object)) {
    return Items{PySequence_Fast_ITEMS(object), PySequence_Fast_GET_SIZE(object)};
  }
  if (THPVariable_Check(object)) {
    return Items{&object, 1};
  }
  return std::nullopt;
}

// A Python float or int as a double; nothing for anything else, which the Python path converts with
// float() or names in its error.
std::optional<double> plain_number(const py::handle& value) {
  if (PyFloat_CheckExact(value.ptr())) {
    return PyFloat_AS_DOUBLE(value.ptr());
  }
  if (PyLong_CheckExact(value.ptr())) {
    const double converted = PyLong_AsDouble(value.ptr());
    if (converted == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();  // (too large for a double: float() raises, naming the argument)
      return std::nullopt;
    }
    return converted;
  }
  return std::nullopt;
}

// What one walker adds up over the items it gathered.
struct WalkTally {
  std::optional<at::ScalarType> promoted;
  int64_t elements = 0;
  bool left_out = false;   // an item gathered nothing (no .grad, or need_clip False)
  bool aten_path = false;  // a CPU tensor the kernels do not take

  void add(at::ScalarType dtype) {
    promoted = !promoted || *promoted == dtype ? dtype : c10::promoteTypes(*promoted, dtype);
  }
  void merge(const WalkTally& other) {
    if (other.promoted) {
      add(*other.promoted);  // (promotion is a join: the order of the walkers does not matter)
    }
    elements += other.elements;
    left_out |= other.left_out;
    aten_path |= other.aten_path;
  }
};

// The keys of tensors that wrap others (a Python subclass, fake or functional tensor): their metadata
// are answered by the wrapper, and their data are not theirs to write.
const c10::DispatchKeySet kWrapperKeys({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});

// What every item of one walk is checked against.
struct WalkRules {
  std::ptrdiff_t meta_offset;  // autograd_meta_offset()
  bool take_grad;
  const uint8_t* excluded;  // with honor_need_clip, excluded[i]: item i's need_clip is False; else null
  bool grad_mode;
  c10::Device device;
  c10::DispatchKey autograd_key;
};

// Walks items [begin, end) of `elements` into their slots of `out`, and adds them to `total`. Returns
// false at the first item the fast path does not serve (see PlainTensors::collect()). Reads only C++
// state, without a Python call: any thread may walk while the caller holds the GIL.
bool walk_items(PyObject* const* elements, Py_ssize_t begin, Py_ssize_t end, const WalkRules& rules,
    const WalkOutput& out, WalkTally& total) {
  WalkTally tally;  // on this thread's stack: the walkers' tallies share a cache line
  for (Py_ssize_t i = begin; i < end; ++i) {
    for (int stage = 1; stage <= 5; ++stage) {
      const Py_ssize_t ahead = i + (6 - stage) * kPrefetchStride;
      if (ahead < end) {
        prefetch_link(elements[ahead], stage, rules.take_grad, rules.meta_offset);
      }
    }
    if (!THPVariable_CheckExact(elements[i])) {
      return false;
    }
    const at::Tensor& item = THPVariable_Unpack(elements[i]);
    const at::Tensor& tensor = rules.take_grad ? grad_of(item, rules.meta_offset) : item;
    if (!tensor.defined()) {
      if (rules.take_grad && !item.is_leaf()) {
        return false;  // torch warns when a non-leaf's .grad is read: the Python path reads it
      }
      tally.left_out = true;
      continue;
    }
    if (rules.excluded != nullptr && rules.excluded[i]) {
      tally.left_out = true;
      continue;
    }
    const c10::TensorImpl* impl = tensor.unsafeGetTensorImpl();
    const c10::DispatchKeySet keys = impl->key_set();
    // The device from the field: device() is a call into libc10, which asks the tensor only when it is a
    // wrapper (a Python subclass or a functional tensor, keys refused here).
    if (TensorImplFields::device(impl) != rules.device || tensor.layout() != at::kStrided || keys.has_any(kWrapperKeys) ||
        !keys.has(rules.autograd_key) || (rules.grad_mode && requires_grad(impl, rules.meta_offset)) ||
        (rules.take_grad && !same_sizes(tensor, item))) {
      return false;  // (an inference tensor has no Autograd key)
    }
    VersionCounterLayout* const version_counter = version_counter_of(impl);
    if (version_counter == nullptr) {
      return false;  // (only inference tensors have none; torch's bump would raise)
    }
    // A borrow, as MaybeOwnedTraits<at::Tensor>::createBorrow() makes, over the undefined tensor the
    // slot holds (whose destruction would do nothing).
    ::new (&out.tensors[i]) at::Tensor(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
        const_cast<c10::TensorImpl*>(impl), c10::raw::DontIncreaseRefcount{}));
    out.version_counters[i] = version_counter;
    tally.add(tensor.scalar_type());
    tally.elements += tensor.numel();
    if (rules.device.is_cpu()) {
      const auto kernel_dtype = torchclip::kernel_dtype(tensor);
      out.has_span[i] = kernel_dtype.has_value();
      if (kernel_dtype) {
        out.spans[i] = {tensor.data_ptr(), tensor.numel(), *kernel_dtype};
        out.span_source[i] = i;
      } else {
        tally.aten_path = true;
      }
    }
  }
  total.merge(tally);
  return true;
}

// Lists are walked by one thread per kItemsPerWalker items, up to at::get_num_threads(), each taking
// blocks of kWalkBlock items from a shared counter (a worker that wakes late takes fewer). The walk's
// cost is memory latency, about 10 lines per item, and one core can wait on only so many lines at
// once: a second core's misses overlap the first's. On 10,000 x 100 (a diagnostic, not a claim) the
// walk took 400 us on one thread and 250 us on two; the OpenMP worker it wakes is also awake when
// the kernels' pass starts (that pass, right after torch's clip_grad_value_: 220 -> 135 us). Blocks
// keep the prefetch pipeline's warm-up (its first 20 items) small against the block.
constexpr Py_ssize_t kItemsPerWalker = 1024;
constexpr Py_ssize_t kWalkBlock = 512;

// The tensors of one fast-path call and, on the CPU, their Split, gathered in one walk over a Python
// list or tuple.
class PlainTensors {
 public:
  PlainTensors() = default;
  PlainTensors(const PlainTensors&) = delete;
  PlainTensors& operator=(const PlainTensors&) = delete;
  ~PlainTensors() {
    if (borrowed_) {
      for (at::Tensor& t : tensors_) {
        c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
      }
    }
  }

  // Gathers `items` themselves, or with take_grad their defined .grad; with honor_need_clip, items
  // whose need_clip attribute is False are left out. Returns false (the caller takes the general
  // path) unless the call is eligible(), every item is a plain torch.Tensor / nn.Parameter (a subclass
  // may give .grad another meaning), and every gathered tensor is a strided tensor on one CPU or CUDA
  // device (CUDA when its kernels were built) without a wrapper's key (kWrapperKeys: no subclass, fake
  // or functional tensor), not an inference tensor, not requiring grad while grad mode is on (the
  // dispatcher's path raises there), and, for a gradient, of its parameter's shape (the Python path
  // raises, naming both shapes).
  bool collect(py::handle items, bool take_grad, bool honor_need_clip) {
    PyObject* const object = items.ptr();  // (a lone tensor's Items point here)
    const std::optional<Items> listed = items_of(object);
    if (!eligible() || !listed) {
      return false;
    }
    const Py_ssize_t count = listed->count;
    PyObject* const* elements = listed->elements;
    // The need_clip marks first, all of them, on this thread: a getattr is a Python call, which the
    // walkers (without the GIL) cannot make, and it may run Python code (a property) that could drop
    // a gradient the walk has borrowed. Then the walk may take every thread, as the drop-ins' does
    // (ClipGradByValue on 10,000 x 100 walked on one thread before: 0.8-0.9 ms against
    // clip_grad_value_'s 0.45-0.5 ms).
    std::unique_ptr<uint8_t[]> excluded;
    if (honor_need_clip) {
      excluded.reset(new uint8_t[count]);
      for (Py_ssize_t i = 0; i < count; ++i) {
        if (i + kPrefetchStride < count) {  // the object's header, and the dict pointer before it
          prefetch(elements[i + kPrefetchStride]);
          prefetch(reinterpret_cast<const char*>(elements[i + kPrefetchStride]) - 3 * sizeof(void*));
        }
        if (!THPVariable_CheckExact(elements[i])) {
          return false;
        }
        excluded[i] = !need_clip(elements[i]);
      }
    }
    WalkRules rules{autograd_meta_offset(), take_grad, excluded.get(), c10::GradMode::is_enabled(),
        c10::Device(c10::kCPU), c10::DispatchKey::AutogradCPU};
    // The device every tensor must be on: the first defined tensor's.
    for (Py_ssize_t i = 0; i < count; ++i) {
      if (!THPVariable_CheckExact(elements[i])) {
        return false;
      }
      const at::Tensor& item = THPVariable_Unpack(elements[i]);
      const at::Tensor& tensor = take_grad ? grad_of(item, rules.meta_offset) : item;
      if (tensor.defined()) {
        rules.device = tensor.device();
        if (!rules.device.is_cpu() && !(kCudaKernels && rules.device.is_cuda())) {
          return false;
        }
        rules.autograd_key = rules.device.is_cpu() ? c10::DispatchKey::AutogradCPU : c10::DispatchKey::AutogradCUDA;
        break;
      }
    }
    const bool on_cpu = rules.device.is_cpu();
    tensors_.resize(count);  // undefined tensors: a slot an item fills, or left empty
    version_counters_.resize(count);
    std::unique_ptr<uint8_t[]> has_span;  // (not zeroed: written for every item kept)
    if (on_cpu) {
      split_.spans.resize(count);  // (neither: see DefaultInitAllocator)
      split_.span_source.resize(count);
      has_span.reset(new uint8_t[count]);
    }
    const WalkOutput out{tensors_.data(), version_counters_.data(), split_.spans.data(), split_.span_source.data(),
        has_span.get()};
    const int64_t walkers =
        at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), count / kItemsPerWalker);
    std::vector<WalkTally> tallies(std::max<int64_t>(walkers, 1));
    bool served = true;
    if (walkers <= 1) {
      served = walk_items(elements, 0, count, rules, out, tallies[0]);
    } else {
      std::atomic<Py_ssize_t> next_block{0};
      std::atomic<bool> refused{false};
      const Py_ssize_t blocks = (count + kWalkBlock - 1) / kWalkBlock;
      at::parallel_for(0, walkers, 1, [&](int64_t walker, int64_t) {
        WalkTally& tally = tallies[walker];
        for (Py_ssize_t b = next_block++; b < blocks && !refused.load(std::memory_order_relaxed); b = next_block++) {
          if (!walk_items(elements, b * kWalkBlock, std::min(count, (b + 1) * kWalkBlock), rules, out, tally)) {
            refused = true;
          }
        }
      });
      served = !refused;
    }
    if (!served) {
      return false;
    }
    WalkTally tally;
    for (const WalkTally& t : tallies) {
      tally.merge(t);
    }
    device_ = rules.device;
    split_.promoted = tally.promoted.value_or(at::kFloat);
    elements_ = tally.elements;
    if (tally.left_out || tally.aten_path) {
      close_gaps(has_span.get());
    }
    if (elements_ >= kBorrowBelowElements) {
      for (const at::Tensor& t : tensors_) {
        c10::raw::intrusive_ptr::incref(t.unsafeGetTensorImpl());  // a +0 borrow becomes a +1 owner
      }
      borrowed_ = false;
    }
    return true;
  }

  bool empty() const { return tensors_.empty(); }

  // Runs on_cpu(tensors, split) for CPU tensors, else through_dispatcher(tensors): with the GIL kept
  // while the tensors are borrowed, else not.
  template <typename OnCpu, typename ThroughDispatcher>
  auto run(const OnCpu& on_cpu, const ThroughDispatcher& through_dispatcher) {
    std::optional<py::gil_scoped_release> no_gil;
    if (!borrowed_) {
      no_gil.emplace();
    }
    const at::TensorList list(tensors_);
    return device_.is_cpu() ? on_cpu(list, split_) : through_dispatcher(list);
  }

  // What the Autograd kernels of the mutating ops do after writing (ops_autograd.cpp); the dispatcher
  // path went through those kernels, which did it. Without a lock: a locked increment holds back every
  // later load until it completes, so the bumps wait on one counter line after another. On 10,000 x
  // 100 after the kernels' pass (a diagnostic, not a claim): separately allocated gradients 78 us
  // locked, 45-60 us not; views of one buffer, which share one counter, 50 us against 6. No lock is
  // needed: another thread writing these gradients during this call would race with the kernels on
  // the data itself.
  void bump_versions() {
    if (!device_.is_cpu()) {
      return;
    }
    if (!version_counters_writable()) {
      for (const at::Tensor& t : tensors_) {
        t.unsafeGetTensorImpl()->bump_version();
      }
      return;
    }
    for (VersionCounterLayout* counter : version_counters_) {
      counter->version_.store(counter->version_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    }
  }

 private:
  // Moves the gathered items down over the slots left empty, in order, and files the tensors the
  // kernels do not take under the Split's ATen path.
  void close_gaps(const uint8_t* has_span) {
    size_t kept = 0, spans_kept = 0;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (!tensors_[i].defined()) {
        continue;
      }
      if (kept != i) {
        tensors_[kept] = std::move(tensors_[i]);  // (a pointer move: no reference counts change)
        version_counters_[kept] = version_counters_[i];
      }
      if (device_.is_cpu()) {
        if (has_span[i]) {
          split_.spans[spans_kept] = split_.spans[i];
          split_.span_source[spans_kept++] = static_cast<int64_t>(kept);
        } else {
          split_.aten_path.push_back(static_cast<int64_t>(kept));
        }
      }
      ++kept;
    }
    tensors_.resize(kept);  // (only undefined tensors go)
    version_counters_.resize(kept);
    if (device_.is_cpu()) {
      split_.spans.resize(spans_kept);
      split_.span_source.resize(spans_kept);
    }
  }

  std::vector<at::Tensor> tensors_;
  torchclip::UninitVector<VersionCounterLayout*> version_counters_;
  c10::Device device_{c10::kCPU};
  torchclip::Split split_;
  int64_t elements_ = 0;
  bool borrowed_ = true;
};

py::object wrap(at::Tensor tensor) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(tensor)));
}

// Python's truth of a flag, as torch's `if error_if_nonfinite and ...` takes it.
bool truth(const py::handle& flag) {
  const int is_true = PyObject_IsTrue(flag.ptr());
  if (is_true < 0) {
    throw py::error_already_set();
  }
  return is_true != 0;
}

// The entry points take the drop-ins' arguments as the caller passed them, so that the drop-ins
// call here first thing: a Python-side conversion (a list, a float) cost 10-20 us of a 0.5 ms call
// on 10,000 parameters, its code and objects cold after the step's other work (a diagnostic, not a
// claim). Numbers other than a float or an int are left to the Python path, which converts them or
// names them in its error; other iterables than a list, a tuple or a tensor arrive drained into a list.

// get_total_norm: the total norm, or None when the general path must serve these tensors.
py::object total_norm_of_plain(py::handle tensors, py::handle norm_type_arg, py::handle error_if_nonfinite) {
  const std::optional<double> norm_type = plain_number(norm_type_arg);
  const bool nonfinite_raises = truth(error_if_nonfinite);  // (before the walk: __bool__ may run Python)
  PlainTensors gathered;
  if (!norm_type || !gathered.collect(tensors, false, false) || gathered.empty()) {
    return py::none();
  }
  return wrap(gathered.run(
      [&](at::TensorList list, const torchclip::Split& split) {
        return torchclip::total_norm_split(list, split, *norm_type, nonfinite_raises);
      },
      [&](at::TensorList list) {
        return std::get<0>(torchclip::op_handles::multi_tensor_norm().call(list, *norm_type, nonfinite_raises));
      }));
}

// clip_grad_norm_ and ClipGradByGlobalNorm: the total norm, or None (general path, or no gradients).
py::object clip_grad_norm_of_plain(py::handle parameters, py::handle max_norm_arg, py::handle norm_type_arg,
    py::handle error_if_nonfinite, double eps, bool norm_at_least_float32, bool honor_need_clip,
    const std::string& nonfinite) {
  const std::optional<double> max_norm = plain_number(max_norm_arg), norm_type = plain_number(norm_type_arg);
  const bool nonfinite_raises = truth(error_if_nonfinite);  // (before the walk: __bool__ may run Python)
  PlainTensors grads;
  if (!max_norm || !norm_type || !grads.collect(parameters, true, honor_need_clip) || grads.empty()) {
    return py::none();
  }
  at::Tensor total = grads.run(
      [&](at::TensorList list, const torchclip::Split& split) {
        return torchclip::clip_grad_norm_split(list, split, *max_norm, *norm_type, nonfinite_raises, eps,
            norm_at_least_float32, nonfinite);
      },
      [&](at::TensorList list) {
        return torchclip::op_handles::clip_grad_norm_().call(list, *max_norm, *norm_type, nonfinite_raises, eps,
            norm_at_least_float32, nonfinite);
      });
  grads.bump_versions();
  return wrap(std::move(total));
}

// ClipGradByNorm: the per-tensor norms, or None (general path, or no gradients).
py::object clip_by_tensor_norm_of_plain(py::handle parameters, double max_norm, bool honor_need_clip,
    const std::string& nonfinite) {
  PlainTensors grads;
  if (!grads.collect(parameters, true, honor_need_clip) || grads.empty()) {
    return py::none();
  }
  at::Tensor norms = grads.run(
      [&](at::TensorList list, const torchclip::Split& split) {
        return torchclip::clip_by_tensor_norm_split(list, split, max_norm, nonfinite);
      },
      [&](at::TensorList list) { return torchclip::op_handles::clip_by_tensor_norm_().call(list, max_norm, nonfinite); });
  grads.bump_versions();
  return wrap(std::move(norms));
}

// clip_grad_value_ and ClipGradByValue: True when done here (including "no gradients"), False for
// the general path.
bool clamp_grads_of_plain(py::handle parameters, double min, double max, bool honor_need_clip) {
  PlainTensors grads;
  if (!grads.collect(parameters, true, honor_need_clip)) {
    return false;
  }
  if (!grads.empty()) {
    grads.run([&](at::TensorList list,
                  const torchclip::Split& split) { torchclip::multi_tensor_clamp_split(list, split, min, max); },
        [&](at::TensorList list) { torchclip::op_handles::multi_tensor_clamp_().call(list, min, max); });
    grads.bump_versions();
  }
  return true;
}

// clip_grad_value_: True when done here (including "no gradients"), False for the general path.
bool clip_grad_value_of_plain(py::handle parameters, py::handle clip_value_arg) {
  const std::optional<double> clip_value = plain_number(clip_value_arg);
  return clip_value && clamp_grads_of_plain(parameters, -*clip_value, *clip_value, false);
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
  m.def("walk_reads_fields", [] { return autograd_meta_offset() >= 0 && version_counters_writable(); },
      "Whether the parameter walk reads autograd metas and version counters from the fields (tests).");
  m.def("load_cpu_kernels", &torchclip::load_cpu_kernels, py::arg("path"),
      "Load a per-ISA CPU kernel library and use it for every CPU op from now on.");
  m.def("loaded_cpu_capability", &torchclip::loaded_cpu_capability);
  m.def("cpu_runs", &torchclip::cpu_runs, py::arg("capability"),
      "Whether this CPU has every instruction set of the kernel library for `capability`");
  m.def("total_norm_of_plain", &total_norm_of_plain, py::arg("tensors"), py::arg("norm_type"),
      py::arg("error_if_nonfinite"));
  m.def("clip_grad_norm_of_plain", &clip_grad_norm_of_plain, py::arg("parameters"), py::arg("max_norm"),
      py::arg("norm_type"), py::arg("error_if_nonfinite"), py::arg("eps") = 1e-6,
      py::arg("norm_at_least_float32") = false, py::arg("honor_need_clip") = false,
      py::arg("nonfinite") = "propagate");
  m.def("clip_by_tensor_norm_of_plain", &clip_by_tensor_norm_of_plain, py::arg("parameters"),
      py::arg("max_norm"), py::arg("honor_need_clip"), py::arg("nonfinite") = "propagate");
  m.def("clip_grad_value_of_plain", &clip_grad_value_of_plain, py::arg("parameters"), py::arg("clip_value"));
  m.def("clamp_grads_of_plain", &clamp_grads_of_plain, py::arg("parameters"), py::arg("min"),
      py::arg("max"), py::arg("honor_need_clip") = false);
}
