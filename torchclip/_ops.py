"""Loads the native extension and wraps the torchclip ops.

One wrapper and one fake (meta) implementation per op in csrc/ops.cpp, in the same order. The fakes
let the ops trace under torch.compile and FakeTensorMode; `torch.library.opcheck` checks each pair.
"""

from __future__ import annotations

import glob
import importlib
import math
import os
from collections.abc import Sequence

import torch

from torchclip._messages import shown

_REBUILD = "Rebuild it against the installed torch from the repository root: pip install --no-build-isolation -e ."

try:
    from torchclip import _C  # registers the torchclip::* ops with the dispatcher
except ImportError as error:  # the message must say how to fix it, whatever the loader said
    raise ImportError(
        f"torchclip's native extension could not be loaded ({error}). It is missing or was built for "
        f"another torch/Python. {_REBUILD}"
    ) from error

_built_against = _C.torch_version_built_against()
if _built_against != torch.__version__.split("+")[0]:
    raise ImportError(
        f"torchclip's native extension was built against torch {_built_against}, but torch "
        f"{torch.__version__} is installed. {_REBUILD}"
    )

if _C.cuda_built():
    # Importing it registers the CUDA kernels into _C's library (so: after _C); its capsule gives the
    # C++ walk the same implementations to call directly (_C checks that both come from one build).
    _cuda = importlib.import_module("torchclip._cuda")
    if not hasattr(_cuda, "split_ops"):
        raise ImportError(f"torchclip._cuda comes from an older build than torchclip._C. {_REBUILD}")
    _C.use_cuda_split_ops(_cuda.split_ops)

# ---- CPU kernel library selection -----------------------------------------------------------------

# Weakest first: a CPU that runs one runs all before it.
_CAPABILITY_ORDER = ("DEFAULT", "AVX2", "AVX512")


def _kernel_library_path(capability: str) -> str:
    pattern = os.path.join(os.path.dirname(__file__), f"_cpu_{capability.lower()}.*")
    matches = [p for p in glob.glob(pattern) if p.endswith((".so", ".pyd", ".dylib"))]
    if not matches:
        raise ImportError(f"torchclip: the {capability} CPU kernel library is missing. {_REBUILD}")
    return matches[0]


def cpu_capabilities() -> list[str]:
    """The CPU kernel libraries that were built and that this CPU can run, weakest first.

    Returns:
        A list of names from 'DEFAULT', 'AVX2', 'AVX512'.

    Example:
        >>> torchclip.cpu_capabilities()
        ['DEFAULT', 'AVX2', 'AVX512']
    """
    built = _C.cpu_capabilities_built()  # (in the order TORCHCLIP_CPU_ISAS named them at build time)
    return [c for c in _CAPABILITY_ORDER if c in built and _C.cpu_runs(c)]


def set_cpu_capability(capability: str) -> str:
    """Switch every CPU op to the kernel library for `capability`, live.

    The default is the best one this CPU runs, capped by torch's own choice (so ATEN_CPU_CAPABILITY
    caps torchclip too); TORCHCLIP_CPU_CAPABILITY overrides it at import.

    Args:
        capability: 'DEFAULT', 'AVX2' or 'AVX512' (any case).

    Returns:
        The name of the library loaded.

    Raises:
        ValueError: an unknown name, a library that was not built, or one this CPU cannot run.

    Example:
        >>> torchclip.set_cpu_capability("AVX2")
        'AVX2'
    """
    name = str(capability).upper()
    if name not in _CAPABILITY_ORDER:
        raise ValueError(f"set_cpu_capability: capability must be one of {_CAPABILITY_ORDER}, got {shown(capability)}")
    if name not in _C.cpu_capabilities_built():
        raise ValueError(
            f"set_cpu_capability: no {name} kernel library was built (built: {_C.cpu_capabilities_built()})"
        )
    if not _C.cpu_runs(name):
        raise ValueError(f"set_cpu_capability: this CPU cannot run {name} code")
    return _C.load_cpu_kernels(_kernel_library_path(name))


def get_cpu_capability() -> str:
    """The instruction set of the CPU kernel library in use: 'DEFAULT', 'AVX2' or 'AVX512'."""
    return _C.loaded_cpu_capability()


def _default_cpu_capability() -> str:
    override = os.environ.get("TORCHCLIP_CPU_CAPABILITY")
    if override:
        return override
    torch_choice = torch.backends.cpu.get_cpu_capability()
    cap = _CAPABILITY_ORDER.index(torch_choice) if torch_choice in _CAPABILITY_ORDER else 0
    runnable = [c for c in cpu_capabilities() if _CAPABILITY_ORDER.index(c) <= cap]
    return runnable[-1] if runnable else "DEFAULT"


set_cpu_capability(_default_cpu_capability())


def set_exact_norm(enabled: bool) -> bool:
    """Take every p = 1 and p = 2 norm of gradients exactly, process-wide, from now on (or not).

    An exact norm is the true norm rounded once: the sum of every |x| or x^2 is held exactly (a
    fixed-point accumulator over float64's range), then rounded (p = 1) or square-rooted (p = 2) correctly
    to float64, and a narrower result rounded from that. It is a function of the gradients alone: the same
    bits whatever the thread count, the order of the list or how tensors are cut into views. The clip
    coefficient follows from it in one fixed way, so the clipped gradients are the same bits too.
    TORCHCLIP_EXACT_NORM=1 sets it at import; every norm-taking function and class also takes `exact=`
    for one call or one clip, which wins over this setting. Sharded gradients exchange exact sums, so
    any number of ranks gives one process's bits, and CUDA gradients the CPU's. Other orders keep float64
    accumulation (docs/performance.md#exact-norms says what exact costs).

    Args:
        enabled: True for exact norms, False for float64 accumulation (the default).

    Returns:
        The previous setting.

    Raises:
        TypeError: `enabled` is not a bool.

    Example:
        >>> previous = torchclip.set_exact_norm(True)
        >>> torchclip.get_total_norm([torch.full((3,), 1e-30), torch.full((1,), 1e30)]).item()
        1.0000000150474662e+30
        >>> torchclip.set_exact_norm(previous)
        True
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_exact_norm: enabled must be a bool, got {shown(enabled)}")
    previous = _C.exact_norms_enabled()
    # torchclip._cuda may hold a copy of the setting of its own (op_shared.h), or share _C's.
    if _C.cuda_built():
        _cuda.set_exact_norms(enabled)
    _C.set_exact_norms(enabled)
    return previous


def get_exact_norm() -> bool:
    """Whether p = 1 and p = 2 norms of CPU gradients are taken exactly (`set_exact_norm`)."""
    return _C.exact_norms_enabled()


# The orders whose norms are exact with exact=True: 1 and 2 by the exact kernels; 0 (a count), inf and -inf (the
# largest and smallest magnitude) are exact in any case.
EXACT_ORDERS = (1.0, 2.0, 0.0, math.inf, -math.inf)


def check_exact(exact, norm_type=2.0) -> bool | None:
    """A norm-taking call's `exact` argument, checked: True, False, or None (the process-wide setting).
    exact=True is a promise, so an order it cannot keep (`norm_type`, as given) is a ValueError; the
    process-wide setting applies where it can and leaves other orders as they are."""
    if exact is not None and not isinstance(exact, bool):
        raise TypeError(f"exact must be True, False or None (the process-wide setting), got {shown(exact)}")
    if exact is True and norm_type is not None:
        try:
            order = float(norm_type)
        except (TypeError, ValueError):
            return exact  # not a number: the caller's norm_type check names it
        if order not in EXACT_ORDERS:
            raise ValueError(
                f"exact=True: norm_type={shown(norm_type)} has no exact norm; exact norms are of order 1 and 2 "
                "(and 0, inf and -inf, exact in any case): pass exact=False or None for other orders"
            )
    return exact


def exact_norms(exact: bool | None) -> bool:
    """Whether a call with this `exact` argument takes exact norms (None: set_exact_norm's setting)."""
    return get_exact_norm() if exact is None else exact


def _exact_norm_from_environment() -> bool:
    value = os.environ.get("TORCHCLIP_EXACT_NORM", "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"TORCHCLIP_EXACT_NORM must be 0 or 1, got {value!r}")
    return value == "1"


set_exact_norm(_exact_norm_from_environment())

# ---- op wrappers and fakes (same order as csrc/ops.cpp) ------------------------------------------

_ops = torch.ops.torchclip


def total_norm_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """torch's dtype for a total norm: the promotion of the inputs' dtypes, real for complex
    (float32, torch's default, for no tensors)."""
    if not tensors:
        return torch.float32
    dtypes = iter({t.dtype: None for t in tensors})  # (distinct, in order: one promotion per dtype)
    dtype = next(dtypes)
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    return dtype.to_real() if dtype.is_complex else dtype


def multi_tensor_norm(
    tensors: Sequence[torch.Tensor],
    ord: float = 2.0,
    error_if_nonfinite: bool = False,
    exact: bool | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(total norm in `dtype`, torch's result dtype by default; per-tensor norms in float64) of a non-empty
    tensor list; exact: exact norms for this call (None: the process-wide setting)."""
    return _ops.multi_tensor_norm(tensors, float(ord), bool(error_if_nonfinite), exact, dtype)


@torch.library.register_fake("torchclip::multi_tensor_norm")
def _multi_tensor_norm_fake(tensors, ord, error_if_nonfinite, exact=None, dtype=None):
    first = tensors[0]
    total = first.new_empty((), dtype=total_norm_dtype(tensors) if dtype is None else dtype)
    return total, first.new_empty((len(tensors),), dtype=torch.float64)


def multi_tensor_scale_(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """tensors[i] *= scale (0-d) or scale[i] (1-d), in place."""
    _ops.multi_tensor_scale_(tensors, scale)


@torch.library.register_fake("torchclip::multi_tensor_scale_")
def _multi_tensor_scale_fake(tensors, scale):
    return None


def multi_tensor_clamp_(tensors: Sequence[torch.Tensor], min: float, max: float) -> None:
    """tensors[i].clamp_(min, max) for every tensor, in one pass."""
    _ops.multi_tensor_clamp_(tensors, float(min), float(max))


@torch.library.register_fake("torchclip::multi_tensor_clamp_")
def _multi_tensor_clamp_fake(tensors, min, max):
    return None


def clip_grad_norm_(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    eps: float = 1e-6,
    norm_at_least_float32: bool = False,
    nonfinite: str = "propagate",
    exact: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm and scale of a non-empty gradient list in one call; returns (the total norm, each gradient's
    norm in float64, the float64 coefficient every gradient was scaled by)."""
    return _ops.clip_grad_norm_(
        grads,
        float(max_norm),
        float(norm_type),
        bool(error_if_nonfinite),
        float(eps),
        bool(norm_at_least_float32),
        nonfinite,
        exact,
    )


@torch.library.register_fake("torchclip::clip_grad_norm_")
def _clip_grad_norm_fake(
    grads,
    max_norm,
    norm_type,
    error_if_nonfinite,
    eps=1e-6,
    norm_at_least_float32=False,
    nonfinite="propagate",
    exact=None,
):
    dtype = total_norm_dtype(grads)
    if norm_at_least_float32:
        dtype = torch.promote_types(dtype, torch.float32)
    return (
        grads[0].new_empty((), dtype=dtype),
        grads[0].new_empty((len(grads),), dtype=torch.float64),
        grads[0].new_empty((), dtype=torch.float64),
    )


def clip_by_tensor_norm_(
    tensors: Sequence[torch.Tensor], max_norm: float, nonfinite: str = "propagate", exact: bool | None = None
) -> torch.Tensor:
    """Each tensor scaled by max_norm / its 2-norm where that exceeds max_norm; returns the norms."""
    return _ops.clip_by_tensor_norm_(tensors, float(max_norm), nonfinite, exact)


@torch.library.register_fake("torchclip::clip_by_tensor_norm_")
def _clip_by_tensor_norm_fake(tensors, max_norm, nonfinite="propagate", exact=None):
    return tensors[0].new_empty((len(tensors),), dtype=torch.float64)


def unitwise_clip_(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    clip_factor: float,
    eps: float,
    norm_type: float,
    exact: bool | None = None,
) -> None:
    """Adaptive gradient clipping, unit-wise (each output unit's gradient norm against its weight's)."""
    _ops.unitwise_clip_(grads, params, float(clip_factor), float(eps), float(norm_type), exact)


@torch.library.register_fake("torchclip::unitwise_clip_")
def _unitwise_clip_fake(grads, params, clip_factor, eps, norm_type, exact=None):
    return None


def adam_step_(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> bool:
    """One Adam/AdamW step with torch's fused arithmetic (CPU, or CUDA as torch 2.11 computes it) that only
    reads the gradients (divided by grad_scale); False, with nothing written, where the kernels do not walk
    the lists."""
    return bool(
        _ops.adam_step_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            lr=float(lr),
            beta1=float(beta1),
            beta2=float(beta2),
            weight_decay=float(weight_decay),
            eps=float(eps),
            amsgrad=bool(amsgrad),
            maximize=bool(maximize),
            decoupled_weight_decay=bool(decoupled_weight_decay),
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
    )


def _stepped_fake():
    """The fused steps' fake result: a 0-d CPU bool on every device (the caller reads it on the host, and a
    CUDA step's answer is the host's: reading one from the device would wait for it)."""
    return torch.empty((), dtype=torch.bool)


@torch.library.register_fake("torchclip::adam_step_")
def _adam_step_fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, **hyperparameters):
    return _stepped_fake()


def sgd_step_(
    params,
    grads,
    momentum_buffers,
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    maximize: bool,
    is_first_step: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> bool:
    """One SGD step with torch's fused arithmetic (CPU, or CUDA as torch 2.11 computes it) that only reads
    the gradients (divided by grad_scale); False, with nothing written, where the kernels do not walk the
    lists."""
    return bool(
        _ops.sgd_step_(
            params,
            grads,
            momentum_buffers,
            lr=float(lr),
            weight_decay=float(weight_decay),
            momentum=float(momentum),
            dampening=float(dampening),
            nesterov=bool(nesterov),
            maximize=bool(maximize),
            is_first_step=bool(is_first_step),
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
    )


@torch.library.register_fake("torchclip::sgd_step_")
def _sgd_step_fake(params, grads, momentum_buffers, **hyperparameters):
    return _stepped_fake()


def adagrad_step_(
    params,
    grads,
    state_sums,
    state_steps,
    *,
    lr: float,
    lr_decay: float,
    weight_decay: float,
    eps: float,
    maximize: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> bool:
    """One Adagrad step with torch's fused CPU arithmetic that only reads the gradients (divided by
    grad_scale); False, with nothing written, where the kernels do not walk the lists."""
    return bool(
        _ops.adagrad_step_(
            params,
            grads,
            state_sums,
            state_steps,
            lr=float(lr),
            lr_decay=float(lr_decay),
            weight_decay=float(weight_decay),
            eps=float(eps),
            maximize=bool(maximize),
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
    )


@torch.library.register_fake("torchclip::adagrad_step_")
def _adagrad_step_fake(params, grads, state_sums, state_steps, **hyperparameters):
    return _stepped_fake()


def per_sample_norms(
    grad_samples: Sequence[torch.Tensor], pieces: Sequence[int], ord: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's norm over all parameters [B] and over each parameter [B, P] (float64); parameter j's
    per-sample gradients are pieces[j] consecutive tensors of grad_samples, batches concatenated."""
    return _ops.per_sample_norms(grad_samples, pieces, float(ord))


def _sample_count(grad_samples, pieces) -> int:
    return sum(t.shape[0] for t in grad_samples[: pieces[0]]) if pieces else 0


@torch.library.register_fake("torchclip::per_sample_norms")
def _per_sample_norms_fake(grad_samples, pieces, ord):
    batch = _sample_count(grad_samples, pieces)
    like = grad_samples[0] if grad_samples else torch.empty(0, device="meta")
    return like.new_empty((batch,), dtype=torch.float64), like.new_empty((batch, len(pieces)), dtype=torch.float64)


def per_sample_accumulate_(
    grad_samples: Sequence[torch.Tensor],
    pieces: Sequence[int],
    factors: torch.Tensor,
    summed: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    accumulate: bool,
    noise_std: float = 0.0,
    seed: int = 0,
    divisor: float = 1.0,
) -> None:
    """summed[j] (+)= the factor-weighted sum of parameter j's per-sample gradients; grads[j] = (summed[j] +
    noise_std * normals from seed) / divisor where grads is given (one pass over the per-sample gradients)."""
    _ops.per_sample_accumulate_(
        grad_samples,
        pieces,
        factors,
        summed,
        grads,
        accumulate=accumulate,
        noise_std=float(noise_std),
        seed=int(seed),
        divisor=float(divisor),
    )


@torch.library.register_fake("torchclip::per_sample_accumulate_")
def _per_sample_accumulate_fake(grad_samples, pieces, factors, summed, grads, **arguments):
    return None


# The devices whose kernels were built: the CPU always, CUDA when torchclip._cuda was (setup.py).
KERNEL_DEVICES = ("cpu", "cuda") if _C.cuda_built() else ("cpu",)

# Whether dynamo is tracing (torch.compile): it reads this as True and traces the Python paths, as it
# cannot trace into _C. The other tracers (make_fx, non-strict export) run with dispatch modes or fake
# tensors, which the walk and kernels_serve refuse. (torch.compiler.is_compiling() would also ask
# torch.jit.is_scripting(): one more Python call, cold after a training step's other work.)
dynamo_is_tracing = torch.compiler.is_dynamo_compiling


def kernels_serve(tensors: Sequence[torch.Tensor], devices: Sequence[str] = KERNEL_DEVICES) -> bool:
    """Whether the torchclip ops serve all these tensors (a list or tuple): plain strided tensors (no
    subclass, fake or functional wrapper) on one device of a type in `devices`. The rule is the
    parameter walk's own (csrc/walk/param_walk.h, plain_on); under dynamo, which cannot call it and
    sees plain tensors, the device and the layout decide (kernels_serve_traced)."""
    if dynamo_is_tracing():
        return kernels_serve_traced(tensors, devices)
    return _C.kernels_serve(tensors, "cuda" in devices)


def defined_grads(parameters: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], int] | None:
    """(the defined gradients of a list or tuple of tensors, the index of the first whose gradient's shape is
    not its own or -1), in one C++ pass; None where an item is not a tensor (walk/param_walk.h)."""
    return _C.defined_grads(parameters)


def kernels_serve_traced(tensors: Sequence[torch.Tensor], devices: Sequence[str] = KERNEL_DEVICES) -> bool:
    """kernels_serve's rule where dynamo traces: plain_on's device and layout tests, in Python. It equals
    the C++ rule on every tensor that is not a subclass or a wrapper (tests/test_gradients.py holds it
    so); dynamo hands the traced code plain tensors."""
    if not tensors:
        return True
    device = tensors[0].device
    return device.type in devices and all(t.device == device and t.layout == torch.strided for t in tensors)


# ---- the eager fast path (csrc/walk/fast_path.h) ---------------------------------------------------
# The parameter walk in C++, then the ops' own implementations for the tensors' device (the CPU's, or
# CUDA's from torchclip._cuda's capsule). Each returns None (False for the clamps) when the walk
# declines; the caller then takes the general path. Never called while dynamo traces (dynamo_is_tracing).
total_norm_of_plain = _C.total_norm_of_plain
clip_grad_norm_of_plain = _C.clip_grad_norm_of_plain
clip_by_tensor_norm_of_plain = _C.clip_by_tensor_norm_of_plain
clamp_grads_of_plain = _C.clamp_grads_of_plain
clip_grad_value_of_plain = _C.clip_grad_value_of_plain

# ---- exact sums that ranks add (torchclip.distributed) -------------------------------------------
# exact_sums(tensors, ord, per_tensor): int64 rows whose element-wise sum over ranks is exact;
# norms_of_exact_sums(rows, ord): each summed row's norm, rounded once (cpu/ops_cpu.h).
exact_sums = _C.exact_sums
norms_of_exact_sums = _C.norms_of_exact_sums
EXACT_SUM_COLUMNS = _C.EXACT_SUM_COLUMNS
