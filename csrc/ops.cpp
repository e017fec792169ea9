// The torchclip operator library: one schema line per op. Kernels are registered per device
// (cpu/ops_cpu.cpp; cuda/ when built); fake (meta) implementations live in torchclip/_ops.py.
//
// Norms come back in the dtype torch.nn.utils.get_total_norm would give (the promotion of the input
// dtypes, real for complex inputs), while per-tensor norms are float64: they feed coefficients, and
// rounding them to a 16-bit dtype first is how torch zeroes fp16 gradients whose norm exceeds 65504.
#include <torch/library.h>

TORCH_LIBRARY(torchclip, m) {
  // The total `ord`-norm of `tensors` viewed as one vector, and each tensor's own norm (float64).
  // error_if_nonfinite raises when the float64 total is NaN or inf (torch's message). exact: every norm
  // of order 1 or 2 is the true norm rounded once (None: torchclip.set_exact_norm's setting; CPU only,
  // and True is refused elsewhere). dtype: the total's (None: torch's result dtype).
  m.def(
      "multi_tensor_norm(Tensor[] tensors, float ord, bool error_if_nonfinite, bool? exact=None, "
      "ScalarType? dtype=None) -> (Tensor total_norm, Tensor per_tensor_norms)");
  // tensors[i] *= scale (a 0-d tensor) or scale[i] (a 1-d tensor with one entry per tensor).
  m.def("multi_tensor_scale_(Tensor(a!)[] tensors, Tensor scale) -> ()");
  // tensors[i].clamp_(min, max) in one pass: the composition clamp_min_(min) then clamp_max_(max).
  m.def("multi_tensor_clamp_(Tensor(a!)[] tensors, float min, float max) -> ()");
  // Clipping by the total norm, for torch.nn.utils.clip_grad_norm_ (eps = 1e-6) and Paddle's
  // ClipGradByGlobalNorm (eps = 0: clip_norm / max(global_norm, clip_norm) is the same number): every
  // tensor scaled by min(max_norm / (total_norm + eps), 1) computed from the float64 norm. Returns the
  // total norm in torch's result dtype, or in at least float32 with norm_at_least_float32 (Paddle's),
  // then the per-tensor norms (float64) and that coefficient (float64, 0-d), for logging.
  // nonfinite: what a NaN/inf norm does: "propagate" (scale by it, torch's way), "raise" (as
  // error_if_nonfinite) or "skip" (write nothing); both checks run before any write. exact as above.
  m.def(
      "clip_grad_norm_(Tensor(a!)[] grads, float max_norm, float norm_type, bool error_if_nonfinite, "
      "float eps=1e-06, bool norm_at_least_float32=False, str nonfinite=\"propagate\", bool? exact=None) -> "
      "(Tensor, Tensor, Tensor)");
  // Each tensor scaled by max_norm / its own 2-norm where that norm exceeds max_norm (Paddle's
  // ClipGradByNorm); returns the per-tensor norms before clipping (float64). nonfinite as above, for
  // any tensor's norm. exact as above.
  m.def(
      "clip_by_tensor_norm_(Tensor(a!)[] tensors, float max_norm, str nonfinite=\"propagate\", bool? exact=None) -> "
      "Tensor");
  // Adaptive gradient clipping (AGC, NFNets), unit-wise: for each output unit u of grads[i] (a row of
  // the first dimension; the whole tensor when it has at most one), with the same unit of params[i],
  // max = max(||param_u||, eps) * clip_factor, and grad_u *= max / max(||grad_u||, 1e-6) unless
  // ||grad_u|| < max (timm's adaptive_clip_grad). Norms of order norm_type > 0, in float64; exact (orders 1
  // and 2) as multi_tensor_norm's.
  m.def(
      "unitwise_clip_(Tensor(a!)[] grads, Tensor[] params, float clip_factor, float eps, float norm_type, "
      "bool? exact=None) -> ()");
  // One step of torch.optim.Adam (AdamW with decoupled_weight_decay) with torch's fused arithmetic (its CPU
  // kernels' on the CPU, torch 2.11's CUDA kernels' on CUDA), state_steps counted up by one first, each
  // gradient divided by grad_scale as it is read and never written (torch's fused kernels write the quotient
  // back); found_inf == 1 leaves everything as it was, counts included (torch's step adds one, then takes
  // found_inf off). Returns a 0-d CPU bool: false, with nothing written, when the kernels do not walk the
  // lists (a tensor off the parameters' device or of another dtype, state in another element order than its
  // parameter, a scale or step that is not a float32 number on that device); the caller then takes torch's.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] state_steps, *, float lr, float beta1, float beta2, "
      "float weight_decay, float eps, bool amsgrad, bool maximize, bool decoupled_weight_decay, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> Tensor");
  // One step of torch.optim.SGD with torch's fused arithmetic, read-only on the gradients and declining
  // as adam_step_ does; momentum_buffers is empty when momentum is 0, and is_first_step starts each buffer
  // as its (decayed) gradient.
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, *, float lr, "
      "float weight_decay, float momentum, float dampening, bool nesterov, bool maximize, bool is_first_step, "
      "Tensor? grad_scale=None, Tensor? found_inf=None) -> Tensor");
  // One step of torch.optim.Adagrad with torch's fused CPU arithmetic, state_steps counted up by one first,
  // read-only on the gradients and declining as adam_step_ does.
  m.def(
      "adagrad_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, Tensor(c!)[] state_steps, *, "
      "float lr, float lr_decay, float weight_decay, float eps, bool maximize, Tensor? grad_scale=None, "
      "Tensor? found_inf=None) -> Tensor");
  // Per-sample clipping (DP-SGD, torchclip.per_sample). grad_samples: every parameter's per-sample gradients,
  // pieces[j] consecutive tensors [b_k, *shape] for parameter j whose batches concatenate (read where they
  // lie). Returns each sample's `ord`-norm over all parameters [B] and over each parameter [B, P], float64.
  m.def("per_sample_norms(Tensor[] grad_samples, int[] pieces, float ord) -> (Tensor total, Tensor per_tensor)");
  // summed[j] = sum over samples b of factors[j or 0, b] * sample b's gradient of parameter j (plus summed[j]
  // with accumulate), in summed[j]'s dtype; grads (empty or one per parameter) = (summed + noise_std * a
  // standard normal) / divisor, the normals a function of (seed, j, element) alone. factors: float64 [1 or P, B].
  m.def(
      "per_sample_accumulate_(Tensor[] grad_samples, int[] pieces, Tensor factors, Tensor(a!)[] summed, "
      "Tensor(b!)[] grads, *, bool accumulate, float noise_std=0., int seed=0, float divisor=1.) -> ()");
}

// Lazily negated or conjugated views reach the kernels as they are: the kernels send every such view
// to ATen's path (op_shared.h's kernel_dtype), whose ops read the bits. The dispatcher's own fallbacks
// would copy them first, and refuse them outright in a mutable list, where torch.nn.utils does not.
namespace {
void fall_through_every_op(torch::Library& m) {
  for (const char* op :
      {"multi_tensor_norm", "multi_tensor_scale_", "multi_tensor_clamp_", "clip_grad_norm_", "clip_by_tensor_norm_",
          "unitwise_clip_", "adam_step_", "sgd_step_", "adagrad_step_", "per_sample_norms", "per_sample_accumulate_"}) {
    m.impl(op, torch::CppFunction::makeFallthrough());
  }
}
}  // namespace

TORCH_LIBRARY_IMPL(torchclip, Negative, m) {
  fall_through_every_op(m);
}
TORCH_LIBRARY_IMPL(torchclip, Conjugate, m) {
  fall_through_every_op(m);
}
