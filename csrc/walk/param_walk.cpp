#include "walk/param_walk.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>

#include "cpu/kernel_loader.h"
#include "cpu/multi_tensor.h"
#include "op_shared.h"

namespace torchclip::walk {
namespace {

namespace py = pybind11;

#ifdef Py_GIL_DISABLED
constexpr bool kGilGuardsTheWalk = false;
#else
constexpr bool kGilGuardsTheWalk = true;
#endif

// Below this many elements the kernels take about a millisecond or less: the walk borrows the tensors
// (no reference-count traffic: ~15% of 10,000 x 100) and the GIL stays held, which keeps them alive.
constexpr int64_t kBorrowBelowElements = int64_t{1} << 22;

// Lists are walked by one thread per kItemsPerWalker items, up to at::get_num_threads(), each taking
// kWalkBlock items at a time, its own share first (cpu::parallel_for_each_item, as the kernels do). The walk waits
// on memory, about 10 lines per item, and a second core's misses overlap the first's (10,000 x 100: 400 us on one
// thread, 250 on two).
constexpr Py_ssize_t kItemsPerWalker = 1024;
constexpr Py_ssize_t kWalkBlock = 512;
// For CUDA gradients the walk is the call's only parallel work, so waking sleeping threads is all
// cost: on a 16-core H100 machine, 10,000 x 100 clip_grad_norm_ after 0.2 s idle took 4.2 ms with 16
// threads and 1.35 ms with 4 (0.8 ms warm with either).
constexpr int64_t kMaxCudaWalkers = 4;

// The keys of tensors that wrap others: their metadata are answered by the wrapper.
const c10::DispatchKeySet kWrapperKeys({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});

// Whether the call would reach the Autograd kernel and then the device kernel, with nothing between.
bool no_mode_intercepts() {
  const c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
  return local.included_ == c10::default_included_set && local.excluded_ == c10::default_excluded_set;
}

// Paddle's ParamAttr(need_clip=False), as torchclip marks it: a `need_clip` attribute that is False.
// Looked up without raising AttributeError for the (usual) parameters that have none.
C10_ALWAYS_INLINE bool need_clip(PyObject* param) {
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

// The items of a walk: a list or tuple as it is, or one tensor. Nothing for any other iterable, a
// list or tuple subclass included, whose iteration may differ from its storage (the drop-ins drain
// those into a list first).
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

// A gradient has its parameter's shape. (A loop: IntArrayRef's == calls memcmp.)
C10_ALWAYS_INLINE bool same_sizes(const c10::TensorImpl& grad, const c10::TensorImpl& param) {
  const c10::IntArrayRef a = grad.sizes(), b = param.sizes();
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

// The walk waits on memory: each item is a chain of dependent loads, Python object -> TensorImpl ->
// autograd meta -> gradient's TensorImpl -> its autograd meta and StorageImpl, which after a training
// step's other work are not in cache. So it reads each item's chain ahead of its turn, one link per
// stage, kPrefetchStride items apart, through public calls, and requests the next link's lines (whole
// objects, or a public member's line): when item i is checked, its links are in cache. The gradient's
// own meta (requires_grad) took over half of the walk's cycles until it was requested too. On 10,000 x
// 100 views after 32 MB of other writes, clip_grad_value_ takes 1.57 ms without the pipeline, 1.47 with.
constexpr Py_ssize_t kPrefetchStride = 4;
constexpr Py_ssize_t kStages = 5;
constexpr Py_ssize_t kRingSize = 32;  // a power of two above kStages * kPrefetchStride
static_assert(kRingSize > kStages * kPrefetchStride && (kRingSize & (kRingSize - 1)) == 0);

template <typename T>
inline void prefetch_object(const T* object) {
  const char* start = reinterpret_cast<const char*>(object);
  for (size_t offset = 0; offset < sizeof(T); offset += 64) {
    __builtin_prefetch(start + offset);
  }
}

inline void prefetch_line(const void* address) {
  __builtin_prefetch(address);
}

// An autograd meta's lines that the walk reads: the vtable pointer (its first line) and the public
// members the calls read: grad_ (grad()), or for requires_grad() requires_grad_, grad_fn_ and, for a
// view's DifferentiableViewMeta (a gradient in a DDP bucket or flat buffer), its backward view, which
// follows the AutogradMeta part (a whole DifferentiableViewMeta is 5 lines, 2 of them never read).
void prefetch_meta(const c10::AutogradMetaInterface* interface, bool for_requires_grad) {
  const auto* meta = static_cast<const torch::autograd::AutogradMeta*>(interface);
  prefetch_line(meta);
  if (!for_requires_grad) {
    prefetch_line(&meta->grad_);
    return;
  }
  prefetch_line(&meta->grad_fn_);
  prefetch_line(&meta->requires_grad_);
  const char* view_part = reinterpret_cast<const char*>(meta) + sizeof(torch::autograd::AutogradMeta);
  prefetch_line(view_part);
  prefetch_line(view_part + 63);
}

// One item's chain, as the pipeline has read it so far.
struct Links {
  Py_ssize_t index = -1;                               // the item these links are of
  const at::Tensor* item = nullptr;                    // null: not an exact tensor object
  const c10::AutogradMetaInterface* meta = nullptr;  // the item's (take_grad only)
  const at::Tensor* target = nullptr;                  // what is gathered: the item or its .grad
  const c10::AutogradMetaInterface* target_meta = nullptr;  // the target's (in grad mode only)
};

// What every item of one walk is checked against.
struct WalkRules {
  bool take_grad;
  const uint8_t* excluded;  // with honor_need_clip, excluded[i]: item i's need_clip is False; else null
  bool grad_mode;
  c10::Device device;
  c10::DispatchKey autograd_key;
};

// Where the walk writes: slot i of each array is item i's, written by whichever thread walks it, so the
// arrays come out in list order with no merge pass. An item left out keeps an undefined tensor;
// spans[i] and span_source[i] are written only where has_span[i] (a tensor the kernels take).
struct WalkOutput {
  at::Tensor* tensors;  // borrows (MaybeOwnedTraits) or, when owning, references
  cpu::TensorSpan* spans;
  int64_t* span_source;
  uint8_t* has_span;
  bool own;
};

// What one walker adds up over the items it gathered.
struct WalkTally {
  std::optional<at::ScalarType> promoted;
  int64_t elements = 0;
  bool left_out = false;   // an item gathered nothing (no .grad, or need_clip False)
  bool aten_path = false;  // a tensor the kernels do not take

  void add(at::ScalarType dtype) {
    promoted = !promoted || *promoted == dtype ? dtype : c10::promoteTypes(*promoted, dtype);
  }
  void merge(const WalkTally& other) {
    if (other.promoted) {
      add(*other.promoted);  // (promotion is a join: the walkers' order does not matter)
    }
    elements += other.elements;
    left_out |= other.left_out;
    aten_path |= other.aten_path;
  }
};

// Advances item j's links by one stage (1: its Python object, 2: its TensorImpl, 3: its autograd meta,
// 4: its gradient's TensorImpl, 5: that tensor's autograd meta, storage and version counter).
template <int kStage>
C10_ALWAYS_INLINE void advance(PyObject* const* elements, Py_ssize_t j, const WalkRules& rules, Links& links) {
  if constexpr (kStage == 1) {
    prefetch_object(reinterpret_cast<const THPVariable*>(elements[j]));
  } else if constexpr (kStage == 2) {
    links.index = j;
    links.item = THPVariable_CheckExact(elements[j]) ? &THPVariable_Unpack(elements[j]) : nullptr;
    links.meta = nullptr;
    links.target = rules.take_grad ? nullptr : links.item;
    links.target_meta = nullptr;
    if (links.item != nullptr) {
      prefetch_object(links.item->unsafeGetTensorImpl());
    }
  } else if constexpr (kStage == 3) {
    if (rules.take_grad && links.item != nullptr) {
      links.meta = links.item->unsafeGetTensorImpl()->autograd_meta();
      if (links.meta != nullptr) {
        prefetch_meta(links.meta, /*for_requires_grad=*/false);
      }
    }
  } else if constexpr (kStage == 4) {
    if (rules.take_grad && links.meta != nullptr) {
      const at::Tensor& grad = links.meta->grad();
      if (grad.defined()) {
        links.target = &grad;
        prefetch_object(grad.unsafeGetTensorImpl());
      }
    }
  } else {
    if (links.target == nullptr) {
      return;
    }
    const c10::TensorImpl* target = links.target->unsafeGetTensorImpl();
    if (rules.grad_mode) {  // whether it requires grad: its meta (a gradient in a bucket is a view)
      links.target_meta = target->autograd_meta();
      if (links.target_meta != nullptr) {
        prefetch_meta(links.target_meta, /*for_requires_grad=*/true);
      }
    }
    if (const c10::StorageImpl* storage = target->unsafe_storage().unsafeGetStorageImpl()) {
      prefetch_object(storage);
    }
    if (!links.target->is_inference()) {
      // A load, not a prefetch (the counter's address is private): bump_versions() then finds it in cache.
      static_cast<void>(target->version_counter().current_version());
    }
  }
}

// Walks items [begin, end) into their slots of `out`, adding them to `total`. Returns false at the
// first item the walk does not serve (see GatheredTensors::gather). Makes no Python call: any thread
// may walk while the caller holds the GIL.
bool walk_items(PyObject* const* elements, Py_ssize_t begin, Py_ssize_t end, const WalkRules& rules,
    const WalkOutput& out, WalkTally& total) {
  WalkTally tally;  // on this thread's stack: the walkers' tallies would share a cache line
  Links ring[kRingSize];
  for (Py_ssize_t i = begin; i < end; ++i) {
    if (i + 5 * kPrefetchStride < end) {
      advance<1>(elements, i + 5 * kPrefetchStride, rules, ring[(i + 5 * kPrefetchStride) & (kRingSize - 1)]);
    }
    if (i + 4 * kPrefetchStride < end) {
      advance<2>(elements, i + 4 * kPrefetchStride, rules, ring[(i + 4 * kPrefetchStride) & (kRingSize - 1)]);
    }
    if (i + 3 * kPrefetchStride < end) {
      advance<3>(elements, i + 3 * kPrefetchStride, rules, ring[(i + 3 * kPrefetchStride) & (kRingSize - 1)]);
    }
    if (i + 2 * kPrefetchStride < end) {
      advance<4>(elements, i + 2 * kPrefetchStride, rules, ring[(i + 2 * kPrefetchStride) & (kRingSize - 1)]);
    }
    if (i + kPrefetchStride < end) {
      advance<5>(elements, i + kPrefetchStride, rules, ring[(i + kPrefetchStride) & (kRingSize - 1)]);
    }
    Links& links = ring[i & (kRingSize - 1)];
    if (links.index != i) {  // the block's first items: the pipeline had not reached them
      advance<2>(elements, i, rules, links);
      advance<3>(elements, i, rules, links);
      advance<4>(elements, i, rules, links);
      advance<5>(elements, i, rules, links);
    }
    if (links.item == nullptr) {
      return false;
    }
    if (links.target == nullptr) {
      if (!links.item->is_leaf()) {
        return false;  // torch warns when a non-leaf's .grad is read: the Python path reads it
      }
      tally.left_out = true;
      continue;
    }
    if (rules.excluded != nullptr && rules.excluded[i]) {
      tally.left_out = true;
      continue;
    }
    const at::Tensor& tensor = *links.target;
    const c10::TensorImpl& impl = *tensor.unsafeGetTensorImpl();
    if (!plain_on(impl, rules.device) || !impl.key_set().has(rules.autograd_key) ||
        (links.target_meta != nullptr && links.target_meta->requires_grad()) ||  // (TensorImpl::requires_grad)
        (rules.take_grad && !same_sizes(impl, *links.item->unsafeGetTensorImpl()))) {
      return false;  // (an inference tensor has no Autograd key)
    }
    if (out.own) {
      out.tensors[i] = tensor;
    } else {
      out.tensors[i] = c10::MaybeOwnedTraits<at::Tensor>::createBorrow(tensor);
    }
    tally.add(tensor.scalar_type());
    tally.elements += tensor.numel();
    const auto kernel_dtype = torchclip::kernel_dtype(tensor);
    out.has_span[i] = kernel_dtype.has_value();
    if (kernel_dtype) {
      out.spans[i] = {tensor.data_ptr(), tensor.numel(), *kernel_dtype};
      out.span_source[i] = i;
    } else {
      tally.aten_path = true;
    }
  }
  total.merge(tally);
  return true;
}

// The device every gathered tensor must be on: the first defined one's (nullopt: an item is not an
// exact tensor object).
std::optional<c10::Device> first_device(const Items& items, bool take_grad) {
  for (Py_ssize_t i = 0; i < items.count; ++i) {
    if (!THPVariable_CheckExact(items.elements[i])) {
      return std::nullopt;
    }
    const at::Tensor& item = THPVariable_Unpack(items.elements[i]);
    const at::Tensor& tensor = take_grad ? item.unsafeGetTensorImpl()->grad() : item;
    if (tensor.defined()) {
      return tensor.device();
    }
  }
  return c10::Device(c10::kCPU);
}

// The need_clip marks, into excluded[i]; false where an item is not an exact tensor object or the list
// changed meanwhile (the general path, which holds its own references, then walks it). Any lookup may run
// Python code (a property, a __getattr__, even a key's __eq__ in the instance dict) that could empty the
// list and free an item still to be read: the items are owned until every lookup is done.
bool read_need_clip(PyObject* object, PyObject* const* elements, Py_ssize_t count, uint8_t* excluded) {
  struct OwnedItems {
    std::vector<PyObject*> items;
    ~OwnedItems() {
      for (PyObject* item : items) {
        Py_DECREF(item);  // (the list, unchanged when the walk goes on, still holds each one)
      }
    }
  } owned{std::vector<PyObject*>(elements, elements + count)};
  for (PyObject* item : owned.items) {
    Py_INCREF(item);
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (!THPVariable_CheckExact(owned.items[i])) {
      return false;
    }
    excluded[i] = !need_clip(owned.items[i]);
  }
  const std::optional<Items> after = items_of(object);
  return after && after->count == count && std::equal(owned.items.begin(), owned.items.end(), after->elements);
}

}  // namespace

bool plain_on(const c10::TensorImpl& tensor, c10::Device device) {
  return tensor.device() == device && tensor.layout() == at::kStrided && !tensor.key_set().has_any(kWrapperKeys);
}

bool kernels_built_for(c10::Device device) {
#ifdef TORCHCLIP_WITH_CUDA
  return device.is_cpu() || device.is_cuda();  // torchclip._cuda registers them, imported with torchclip
#else
  return device.is_cpu();
#endif
}

bool kernels_serve(PyObject* tensors, bool cuda_allowed) {
  const std::optional<Items> items = items_of(tensors);
  if (!items) {
    throw py::type_error("kernels_serve: tensors must be a list or tuple of tensors");
  }
  if (items->count == 0) {
    return true;
  }
  for (Py_ssize_t i = 0; i < items->count; ++i) {
    if (!THPVariable_CheckExact(items->elements[i])) {
      return false;
    }
  }
  const c10::Device device = THPVariable_Unpack(items->elements[0]).device();
  if (!kernels_built_for(device) || (device.is_cuda() && !cuda_allowed)) {
    return false;
  }
  for (Py_ssize_t i = 0; i < items->count; ++i) {
    if (!plain_on(*THPVariable_Unpack(items->elements[i]).unsafeGetTensorImpl(), device)) {
      return false;
    }
  }
  return true;
}

PyObject* defined_grads(PyObject* parameters) {
  const std::optional<Items> items = items_of(parameters);
  if (!items) {
    Py_RETURN_NONE;
  }
  py::list grads;
  Py_ssize_t mismatch = -1;
  for (Py_ssize_t i = 0; i < items->count; ++i) {
    PyObject* element = items->elements[i];
    // (a non-leaf goes to Python too: torch's .grad getter warns there, and the drop-ins warn as torch does)
    if (!THPVariable_Check(element) || THPVariable_Unpack(element).is_nested() ||
        !THPVariable_Unpack(element).is_leaf()) {
      Py_RETURN_NONE;
    }
    const at::Tensor& param = THPVariable_Unpack(element);
    const at::Tensor& grad = param.unsafeGetTensorImpl()->grad();
    if (!grad.defined()) {
      continue;
    }
    if (grad.is_nested()) {
      Py_RETURN_NONE;
    }
    if (grad.sizes() != param.sizes()) {
      mismatch = i;
      break;
    }
    grads.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(grad)));
  }
  return py::make_tuple(grads, mismatch).release().ptr();
}

GatheredTensors::~GatheredTensors() {
  if (borrowed_) {
    for (at::Tensor& t : tensors_) {
      c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
    }
  }
}

bool GatheredTensors::gather(PyObject* object, bool take_grad, bool honor_need_clip) {
  RECORD_FUNCTION("torchclip::walk_parameters", std::vector<c10::IValue>());
  if (!no_mode_intercepts()) {
    return false;
  }
#ifdef Py_GIL_DISABLED
  bool served = false;
  Py_BEGIN_CRITICAL_SECTION(object);  // the list's items stay as read until the walk is done
  served = walk(object, take_grad, honor_need_clip);
  Py_END_CRITICAL_SECTION();
  return served;
#else
  return walk(object, take_grad, honor_need_clip);
#endif
}

bool GatheredTensors::walk(PyObject* object, bool take_grad, bool honor_need_clip) {
  std::optional<Items> listed = items_of(object);
  if (!listed) {
    return false;
  }
  const Py_ssize_t count = listed->count;
  PyObject* const* elements = listed->elements;
  // The need_clip marks first, on this thread: a getattr is a Python call, which the walkers cannot make.
  std::unique_ptr<uint8_t[]> excluded;
  if (honor_need_clip) {
    excluded.reset(new uint8_t[count]);
    if (!read_need_clip(object, elements, count, excluded.get())) {
      return false;
    }
    listed = items_of(object);  // (Python code may have moved a list's item array)
    elements = listed->elements;
  }
  one_thread_after_fork();
  const std::optional<c10::Device> device = first_device(*listed, take_grad);
  if (!device || !kernels_built_for(*device)) {
    return false;
  }
  const WalkRules rules{take_grad, excluded.get(), c10::GradMode::is_enabled(), *device,
      device->is_cpu() ? c10::DispatchKey::AutogradCPU : c10::DispatchKey::AutogradCUDA};
  tensors_.resize(count);  // undefined tensors: a slot an item fills, or left empty
  std::unique_ptr<uint8_t[]> has_span(new uint8_t[count]);  // (not zeroed: written for every item kept)
  split_.spans.resize(count);  // (not zeroed either: UninitVector)
  split_.span_source.resize(count);
  // Without the GIL's guarantee every tensor is owned as it is gathered; with it, they are borrowed,
  // and taken below when the kernels will run without the GIL.
  borrowed_ = kGilGuardsTheWalk;
  const WalkOutput out{tensors_.data(), split_.spans.data(), split_.span_source.data(), has_span.get(), !borrowed_};
  const int64_t walkers = !kGilGuardsTheWalk || at::in_parallel_region()
      ? 1
      : std::min<int64_t>({at::get_num_threads(), count / kItemsPerWalker,
            device->is_cpu() ? std::numeric_limits<int64_t>::max() : kMaxCudaWalkers});
  std::vector<WalkTally> tallies(std::max<int64_t>(walkers, 1));
  if (walkers <= 1) {
    if (!walk_items(elements, 0, count, rules, out, tallies[0])) {
      return false;
    }
  } else {
    std::atomic<bool> refused{false};
    const Py_ssize_t blocks = (count + kWalkBlock - 1) / kWalkBlock;
    cpu::parallel_for_each_item(blocks, walkers, [&](int64_t b) {
      if (!refused.load(std::memory_order_relaxed) &&
          !walk_items(elements, b * kWalkBlock, std::min<Py_ssize_t>(count, (b + 1) * kWalkBlock), rules, out,
              tallies[cpu::ItemPool::taker()])) {
        refused = true;
      }
    });
    if (refused) {
      return false;
    }
  }
  WalkTally tally;
  for (const WalkTally& t : tallies) {
    tally.merge(t);
  }
  device_ = *device;
  split_.promoted = tally.promoted.value_or(at::kFloat);
  elements_ = tally.elements;
  if (tally.left_out || tally.aten_path) {
    close_gaps(has_span.get());
  }
  if (borrowed_ && elements_ >= kBorrowBelowElements) {
    for (const at::Tensor& t : tensors_) {
      c10::raw::intrusive_ptr::incref(t.unsafeGetTensorImpl());  // a borrow becomes a reference
    }
    borrowed_ = false;
  }
  return true;
}

// torch's bump is an atomic increment, ~5 ns even on a cached line: on 10,000 x 100 it is 50 us of
// clip_grad_value_'s 0.21 ms, the whole gap to the private-layout walk this replaced (plain stores).
void GatheredTensors::bump_versions() const {
  for (const at::Tensor& t : tensors_) {
    t.unsafeGetTensorImpl()->bump_version();
  }
}

// Moves the gathered tensors down over the slots left empty, in order, and files the tensors the
// kernels do not take under the Split's ATen path.
void GatheredTensors::close_gaps(const uint8_t* has_span) {
  size_t kept = 0, spans_kept = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!tensors_[i].defined()) {
      continue;
    }
    if (kept != i) {
      tensors_[kept] = std::move(tensors_[i]);  // (a pointer move: no reference counts change)
    }
    if (has_span[i]) {
      split_.spans[spans_kept] = split_.spans[i];
      split_.span_source[spans_kept++] = static_cast<int64_t>(kept);
    } else {
      split_.aten_path.push_back(static_cast<int64_t>(kept));
    }
    ++kept;
  }
  tensors_.resize(kept);  // (only undefined tensors go)
  split_.spans.resize(spans_kept);
  split_.span_source.resize(spans_kept);
}

}  // namespace torchclip::walk
