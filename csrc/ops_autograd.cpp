// Autograd-key kernels for the torchclip ops. None of the ops is differentiable: they exist to run
// under torch.no_grad(), on gradients. Registering them here, unboxed, matters for speed as much as
// for semantics: without it the dispatcher sends every call through torch's boxed autograd fallback,
// which boxes a 10,000-tensor list into IValues and back (~0.3 ms per call, measured with perf).
//
// The mutating ops do what ATen's in-place ops do around their kernels: refuse to modify a tensor
// that requires grad while grad mode is on (autograd could not know), and bump each written tensor's
// version counter so autograd notices if a saved tensor was modified.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>

#include "op_handles.h"

namespace torchclip {
namespace {

// The op's name as its messages spell it, torchclip.<op>; built only when a check fails.
std::string message_name(const c10::OperatorHandle& op) {
  std::string name = op.operator_name().name;  // torchclip::<op>
  return name.replace(name.find("::"), 2, ".");
}

void check_not_differentiated(at::TensorList tensors, const c10::OperatorHandle& op) {
  if (!c10::GradMode::is_enabled()) {
    return;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(!tensors[i].requires_grad(), message_name(op), ": tensors[", i,
        "] requires grad and grad mode is "
        "on; this op modifies tensors in place and is not differentiable (call it under torch.no_grad())");
  }
}

void bump_versions(at::TensorList tensors) {
  for (const auto& t : tensors) {
    torch::autograd::impl::bump_version(t);
  }
}

// The Autograd and ADInplaceOrView kernels of an op that writes the lists at schema positions `written`
// (the first of them is the list refused when it requires grad); `handle` is its op_handles accessor.
// Each kernel receives the dispatch key set it was called with and redispatches below autograd and
// ADInplaceOrView: the backend key (CPU, ...) comes from that set, without re-reading every tensor.
template <auto handle, typename Signature, size_t... written>
struct WritingKernels;

template <auto handle, typename Result, typename... Args, size_t first, size_t... written>
struct WritingKernels<handle, Result(Args...), first, written...> {
  static Result autograd(c10::DispatchKeySet ks, Args... args) {
    const auto& op = handle();
    check_not_differentiated(std::get<first>(std::tie(args...)), op);
    return redispatch_then_bump(op, ks, args...);
  }

  // Under inference mode the Autograd kernel is skipped, but a normal tensor's ADInplaceOrView key is
  // not: ATen's in-place ops bump versions there, so a graph that saved the tensor still notices the
  // write. (Outside inference mode the Autograd kernel redispatches past this key: one bump per write.)
  static Result inplace_or_view(c10::DispatchKeySet ks, Args... args) {
    return redispatch_then_bump(handle(), ks, args...);
  }

 private:
  C10_ALWAYS_INLINE static Result redispatch_then_bump(const c10::TypedOperatorHandle<Result(Args...)>& op,
      c10::DispatchKeySet ks, Args... args) {
    const auto bump_written = [&] {
      const auto all = std::tie(args...);
      bump_versions(std::get<first>(all));
      (bump_versions(std::get<written>(all)), ...);
    };
    if constexpr (std::is_void_v<Result>) {
      {
        at::AutoDispatchBelowADInplaceOrView guard;
        op.redispatch(ks & c10::after_ADInplaceOrView_keyset, args...);
      }
      bump_written();
    } else {
      Result results;
      {
        at::AutoDispatchBelowADInplaceOrView guard;
        results = op.redispatch(ks & c10::after_ADInplaceOrView_keyset, args...);
      }
      bump_written();
      return results;
    }
  }
};

template <typename Handle>
struct SignatureOf;

template <typename Signature>
struct SignatureOf<c10::TypedOperatorHandle<Signature>> {
  using type = Signature;
};

template <auto handle, size_t... written>
using Writes = WritingKernels<handle, typename SignatureOf<std::decay_t<decltype(handle())>>::type, written...>;

// Every op that writes its arguments: visit(name, its Writes).
template <typename Visit>
void for_each_writing_op(const Visit& visit) {
  visit("multi_tensor_scale_", Writes<op_handles::multi_tensor_scale_, 0>{});
  visit("multi_tensor_clamp_", Writes<op_handles::multi_tensor_clamp_, 0>{});
  visit("clip_grad_norm_", Writes<op_handles::clip_grad_norm_, 0>{});
  visit("clip_by_tensor_norm_", Writes<op_handles::clip_by_tensor_norm_, 0>{});
  visit("unitwise_clip_", Writes<op_handles::unitwise_clip_, 0>{});
  // params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps; bumped whether or not the kernels
  // stepped: reading the flag here would be data-dependent under tracing, and an extra bump only says
  // "maybe modified".
  visit("adam_step_", Writes<op_handles::adam_step_, 0, 2, 3, 4, 5>{});
  visit("sgd_step_", Writes<op_handles::sgd_step_, 0, 2>{});                // params, momentum_buffers
  visit("adagrad_step_", Writes<op_handles::adagrad_step_, 0, 2, 3>{});  // params, state_sums, state_steps
  visit("per_sample_accumulate_", Writes<op_handles::per_sample_accumulate_, 3, 4>{});  // summed, grads
}

}  // namespace

TORCH_LIBRARY_IMPL(torchclip, ADInplaceOrView, m) {
  for_each_writing_op([&](const char* name, auto kernels) { m.impl(name, &decltype(kernels)::inplace_or_view); });
}

TORCH_LIBRARY_IMPL(torchclip, Autograd, m) {
  // Reads only, and its outputs carry no gradient history: nothing for autograd to do.
  m.impl("multi_tensor_norm", torch::CppFunction::makeFallthrough());
  m.impl("per_sample_norms", torch::CppFunction::makeFallthrough());
  for_each_writing_op([&](const char* name, auto kernels) { m.impl(name, &decltype(kernels)::autograd); });
}

}  // namespace torchclip
