"""Drop-ins for torch.nn.utils' gradient clipping, on torchclip's fused multi-tensor kernels.

torch.nn.utils (of the installed torch, 2.11 to 2.15) is the specification: same signatures, defaults, return
values (dtype, shape, device), warnings and errors. Plain strided CPU tensors take the kernels, and CUDA tensors too
when the CUDA kernels are built; anything else (other devices, sparse or subclassed tensors) takes
torch's own implementation, so it is never wrong.

Where torchclip differs, on purpose, it is more accurate, never less:

* Norms accumulate in float64 (scaled where even float64 would overflow), so fp32 gradients of 1e20
  have their true norm 3.2e21 instead of inf, and 1e-30 gradients a norm of 1.7e-30 instead of 0.
* clip_grad_norm_ computes its coefficient, min(max_norm / (total_norm + 1e-6), 1), from the float64
  norm. fp16 gradients whose norm exceeds 65504 are scaled correctly (torch zeroes them); the norm it
  returns still has torch's dtype, so it reads inf there, as torch's does.
* error_if_nonfinite raises when the gradients' norm is NaN or inf (a NaN or inf in them), not when a
  finite norm merely overflows a 16-bit result dtype.
* Sparse COO gradients (nn.Embedding(sparse=True)) are clipped: norms of the coalesced values,
  scaling in place (torch raises NotImplementedError).
* clip_grad_value_ with every gradient None does nothing (torch raises an internal error), and a
  clip_value beyond float16's range clamps float16 gradients as the maths says (torch raises "value
  cannot be converted to type c10::Half without overflow").

Values torch accepts keep torch's meaning, odd as some are: max_norm < 0 flips every gradient's sign
(pytorch issue 31367), max_norm NaN makes them NaN, max_norm inf leaves them unchanged; clip_value < 0
sets every gradient to clip_value, clip_value NaN makes them NaN. (The Paddle-style classes refuse
such values.) What torch does not check is refused with an error naming the argument and its value,
before any gradient changes: a norm_type, max_norm or clip_value that is not a number, a total_norm
that is not a 0-d tensor (torch's error classes, with the argument named), an item that
is not a tensor (NotATensorError, both a TypeError and the AttributeError torch raises), a gradient
whose shape is not its parameter's, and (for norms) an integer or bool gradient.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.nn.utils import clip_grad as _torch_clip_grad
from typing_extensions import deprecated

from torchclip import _ops, _sparse
from torchclip._gradients import Gradients, Route, raise_if_nonfinite
from torchclip._messages import brief, shown

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


_tensor_or_tensors = Tensor | Iterable[Tensor]

# torch's own implementations, captured before patch() can replace the public names: the path for
# tensors the kernels do not serve.
_torch_get_total_norm = _torch_clip_grad._get_total_norm
_torch_clip_grads_with_norm_ = _torch_clip_grad._clip_grads_with_norm_
_torch_clip_grad_value_ = _torch_clip_grad.clip_grad_value_


def _readable(tensors: _tensor_or_tensors) -> Tensor | Sequence[Tensor]:
    """What the fast path reads (csrc/walk/param_walk.cpp, items_of): a list, a tuple or one tensor as it
    is; any other iterable (model.parameters(), a generator, as Lightning, timm and accelerate pass it;
    a list or tuple subclass) drained once into a list, so no path reads it twice."""
    if type(tensors) is list or type(tensors) is tuple or isinstance(tensors, Tensor):
        return tensors
    return list(tensors)


def _as_list(tensors: _tensor_or_tensors) -> Sequence[Tensor]:
    """For the general paths: _readable, with a single tensor as a list."""
    return [tensors] if isinstance(tensors, Tensor) else _readable(tensors)


class NotATensorError(TypeError, AttributeError):
    """An item that should be a tensor is not. Both a TypeError (what it is) and an AttributeError
    (what torch raises there, reading .grad), so code catching either keeps working."""


def _as_number(name: str, value) -> float:
    """float(value), or the error float() raises, naming the argument and the value."""
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name} must be a number, got {shown(value)}") from None


def _check_tensors(items: list, name: str) -> None:
    for i, item in enumerate(items):
        if isinstance(item, Tensor):
            continue
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            fix = (
                "model.parameters()"
                if name == "parameters"
                else "the tensors, e.g. [p.grad for p in model.parameters()]"
            )
            raise NotATensorError(
                f"{name}[{i}] is ({item[0]!r:.60}, {type(item[1]).__name__}), a (name, parameter) pair as "
                f"model.named_parameters() yields, not a Tensor; pass {fix}"
            )
        raise NotATensorError(f"{name}[{i}] must be a Tensor, got {brief(item)}")


def _grads(parameters: list) -> list[Tensor]:
    """The defined gradients, after checking what torch leaves unchecked: that every item is a tensor
    and that every gradient has its parameter's shape (in one C++ pass outside traces: _ops.defined_grads)."""
    found = None if _ops.dynamo_is_tracing() else _ops.defined_grads(parameters)
    if found is None:
        _check_tensors(parameters, "parameters")
        grads = [p.grad for p in parameters]
        mismatch = next(
            (i for i, (p, g) in enumerate(zip(parameters, grads)) if g is not None and g.shape != p.shape), -1
        )
        grads = [g for g in grads if g is not None]
    else:
        grads, mismatch = found
    if mismatch >= 0:
        p = parameters[mismatch]
        raise ValueError(
            f"parameters[{mismatch}] has shape {tuple(p.shape)} but its gradient has shape {tuple(p.grad.shape)}"
        )
    return grads


# Each public function is one door: the C++ walk first thing, with the arguments as given
# (csrc/walk/fast_path.h; an iterable other than a list or tuple drained into a list first), then,
# where the walk declines, the general path under one no_grad(), a rule over the gradients' route
# (torchclip/_gradients.py). The walk serves only tensors autograd does not track, so grad mode changes
# nothing there. Each Python step before it cost 4-10 us of a 0.5 ms call on 10,000 parameters.


def get_total_norm(
    tensors: _tensor_or_tensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: ProcessGroup | None = None,
    exact: bool | None = None,
) -> Tensor:
    r"""torchclip's get_total_norm: the norm of tensors, as if they were concatenated into one vector.

    Drop-in for `torch.nn.utils.get_total_norm`, with its result: torch's dtype (the promotion of the
    inputs' dtypes), on the first tensor's device; `tensor(0.)` for no tensors. Unlike torch's, the norm
    is accumulated in float64, so it neither overflows nor underflows where the result's dtype holds it,
    and sparse COO tensors are accepted.

    Args:
        tensors: a tensor, or an iterable of them (read once).
        norm_type: the order p: any float torch accepts, `'inf'` included; 1, 2 and inf take the
            fastest kernels.
        error_if_nonfinite: raise when the norm is NaN or inf.
        foreach: accepted for torch's signature; the fused kernels serve either way.
        process_group: torchclip only: the tensors are this rank's shard of the group's; the result is
            the norm of all of them, the same on every rank (one all_gather of one scalar).
        exact: torchclip only: for p = 1 and 2, the true norm rounded once, the same bits for any thread
            count, list order, views or shards (None: `torchclip.set_exact_norm`'s setting; True raises
            where torch's own ops would take them: tensors autograd tracks, subclasses, CUDA DTensors).

    Returns:
        The total norm, a 0-d tensor.

    Raises:
        RuntimeError: `error_if_nonfinite` and a NaN or inf norm (torch's message).
        TypeError: an item that is not a tensor (`NotATensorError`), a `norm_type` that is not a number.

    Example:
        >>> grads = [torch.ones(3), torch.ones(4, 4)]
        >>> torchclip.get_total_norm(grads)
        tensor(4.3589)
    """
    tensors = _readable(tensors)
    _ops.check_exact(exact, norm_type)
    if process_group is None and not _ops.dynamo_is_tracing():
        total_norm = _ops.total_norm_of_plain(tensors, norm_type, error_if_nonfinite, exact)
        if total_norm is not None:
            return total_norm
    tensors = _as_list(tensors)
    norm_type = _as_number("norm_type", norm_type)
    _check_tensors(tensors, "tensors")
    with torch.no_grad():
        return _total_norm_general(tensors, norm_type, error_if_nonfinite, foreach, process_group, exact)


def _total_norm_general(
    tensors: Sequence[Tensor], norm_type: float, error_if_nonfinite, foreach, process_group, exact: bool | None
):
    gradients = Gradients(tensors, process_group=process_group)
    gradients.refuse_exact(exact)
    if gradients.route is Route.SHARDED:
        total = gradients.sharded_total_norm(norm_type, error_if_nonfinite, exact)
        return total.to(_ops.total_norm_dtype(tensors))
    if len(tensors) == 0:
        return torch.tensor(0.0)
    if gradients.route is Route.KERNELS:
        total_norm, _ = _ops.multi_tensor_norm(tensors, norm_type, error_if_nonfinite, exact)
        return total_norm
    if gradients.route is Route.SPARSE:
        total_wide, dtype = _total_norm_with_sparse(gradients, norm_type, error_if_nonfinite, exact)
        return total_wide.to(dtype)
    # DTensors the sharded route does not take: torch's result is itself a DTensor, returned as torch does.
    return _torch_get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)


def _total_norm_with_sparse(gradients: Gradients, norm_type: float, error_if_nonfinite: bool, exact: bool | None):
    """(total norm in float64 on the first tensor's device, torch's result dtype) of a list holding
    sparse COO tensors, by torch's definition: the norm of the per-tensor norms (with exact norms, the
    true total rounded once)."""
    tensors = gradients.tensors
    if _ops.exact_norms(exact) and norm_type in (1.0, 2.0) and _sparse.on_cpu(tensors):
        _, total = gradients.norms(norm_type, exact)
        raise_if_nonfinite(total, norm_type, error_if_nonfinite)
        return total, _ops.total_norm_dtype(tensors)
    device = tensors[0].device
    sparse = [t for t in tensors if _sparse.is_sparse(t)]
    dense = [t for t in tensors if not _sparse.is_sparse(t)]
    kernel_served = Gradients(dense).route is Route.KERNELS and all(t.numel() > 0 for t in dense)
    norms = [_sparse.norm64(t, norm_type).to(device) for t in sparse]
    if dense and kernel_served:  # one kernel call for all the dense ones
        norms.append(_ops.multi_tensor_norm(dense, norm_type)[1].to(device))
    else:
        norms += [torch.linalg.vector_norm(t.abs().to(torch.float64), norm_type).to(device) for t in dense]
    total = torch.linalg.vector_norm(torch.cat([n.reshape(-1) for n in norms]), norm_type)
    raise_if_nonfinite(total, norm_type, error_if_nonfinite)
    return total, _ops.total_norm_dtype(tensors)


def clip_grads_with_norm_(
    parameters: _tensor_or_tensors,
    max_norm: float,
    total_norm: Tensor,
    foreach: bool | None = None,
) -> None:
    r"""torchclip's clip_grads_with_norm_: scale the gradients by `min(max_norm / (total_norm + 1e-6), 1)`.

    Drop-in for `torch.nn.utils.clip_grads_with_norm_`: the coefficient is computed exactly as torch
    computes it, in `total_norm`'s dtype and on its device. A coefficient of exactly 1 writes nothing.

    Args:
        parameters: a tensor, or an iterable of them, whose `.grad` is scaled (None is skipped).
        max_norm: the largest norm allowed.
        total_norm: the norm to clip by, a 0-d tensor (`get_total_norm`'s result).
        foreach: accepted for torch's signature.

    Raises:
        TypeError: `total_norm` is not a tensor; an item is not a tensor (`NotATensorError`).
        RuntimeError: `total_norm` is not 0-d.
        ValueError: a gradient's shape is not its parameter's.

    Example:
        >>> norm = torchclip.get_total_norm([p.grad for p in model.parameters()])
        >>> torchclip.clip_grads_with_norm_(model.parameters(), 1.0, norm)
    """
    parameters = _as_list(parameters)
    grads = _grads(parameters)
    max_norm = _as_number("max_norm", max_norm)
    _check_total_norm(total_norm)
    with torch.no_grad():
        gradients = Gradients(grads)
        # Sharded gradients are scaled through their local shards, by one coefficient across any meshes
        # (torch's mul_ refuses mixed meshes); a DTensor total_norm (torch's own get_total_norm's) goes to torch.
        served = gradients.route is Route.KERNELS or (gradients.route is Route.SHARDED and type(total_norm) is Tensor)
        if not served:
            return _torch_clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
        if grads:
            gradients.scale_(_coefficient(max_norm, total_norm, 1e-6).to(gradients.local[0].device))
    return None


def _check_total_norm(total_norm) -> None:
    """torch's errors for a total_norm that is not a 0-d tensor (TypeError, RuntimeError), naming it; the
    kernels would take a 1-d one as a scale per gradient."""
    if not isinstance(total_norm, Tensor):
        raise TypeError(f"total_norm must be a 0-d tensor (get_total_norm's result), got {shown(total_norm)}")
    if total_norm.dim() != 0:
        raise RuntimeError(
            f"total_norm must be a 0-d tensor (get_total_norm's result), got a tensor of shape "
            f"{tuple(total_norm.shape)}"
        )


def _coefficient(max_norm: float, total_norm: Tensor, eps: float) -> Tensor:
    """torch's clip coefficient, min(max_norm / (total_norm + eps), 1), in total_norm's dtype and device."""
    return torch.clamp(max_norm / (total_norm + eps), max=1.0)


def clip_grad_norm_(
    parameters: _tensor_or_tensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: ProcessGroup | None = None,
    exact: bool | None = None,
) -> Tensor:
    r"""torchclip's clip_grad_norm_: clip the gradients' total norm, in place; return the norm.

    Drop-in for `torch.nn.utils.clip_grad_norm_`: the norm of all gradients viewed as one vector, then
    every gradient multiplied by `min(max_norm / (total_norm + 1e-6), 1)`. The norm, the check and the
    scaling are one native call; the write pass is skipped when no clipping is needed. Where it differs
    from torch, it is more accurate: the norm accumulates in float64 and the coefficient comes from it,
    so float32 gradients of 1e20 and float16 gradients whose norm exceeds 65504 are clipped correctly
    (torch zeroes them); sparse COO gradients are clipped (torch raises).

    Args:
        parameters: a tensor, or an iterable of them (`model.parameters()`, read once) whose `.grad`
            is clipped; gradients that are None are skipped.
        max_norm: the largest total norm allowed. Values torch accepts keep torch's meaning (a negative
            one flips the gradients' sign, as torch's does).
        norm_type: the order p of the norm, `'inf'` included.
        error_if_nonfinite: raise, with no gradient changed, when the norm is NaN or inf.
        foreach: accepted for torch's signature.
        process_group: torchclip only: the parameters are this rank's shard; every rank gets the global
            norm and clips with the same coefficient, at the cost of one all_gather of one scalar.
        exact: torchclip only: for p = 1 and 2, the true norm rounded once, so the norm and the clipped
            gradients are the same bits for any thread count, list order or sharding (None:
            `torchclip.set_exact_norm`'s setting; True raises where torch's own ops
            would take them: tensors autograd tracks, subclasses, CUDA DTensors).

    Returns:
        The total norm of the gradients before clipping, a 0-d tensor in their promoted dtype.

    Raises:
        RuntimeError: `error_if_nonfinite` and a NaN or inf norm.
        TypeError: an item that is not a tensor (`NotATensorError`); `max_norm` or `norm_type` not a number.
        ValueError: a gradient's shape is not its parameter's.

    Example:
        >>> loss.backward()
        >>> total_norm = torchclip.clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    given = parameters
    parameters = _readable(parameters)
    _ops.check_exact(exact, norm_type)
    if process_group is None and not _ops.dynamo_is_tracing():
        total_norm = _ops.clip_grad_norm_of_plain(parameters, max_norm, norm_type, error_if_nonfinite, exact=exact)
        if total_norm is not None:
            return total_norm
    parameters = _as_list(parameters)
    if not parameters and isinstance(given, types.GeneratorType):
        # The caller's line, as torch's warning names it.
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    # Bad numbers raise here, before any gradient is read.
    max_norm = _as_number("max_norm", max_norm)
    norm_type = _as_number("norm_type", norm_type)
    grads = _grads(parameters)
    with torch.no_grad():
        return _clip_grad_norm_general(
            parameters, grads, max_norm, norm_type, error_if_nonfinite, foreach, process_group, exact
        )


def _clip_grad_norm_general(
    parameters, grads, max_norm: float, norm_type: float, error_if_nonfinite, foreach, process_group, exact
) -> Tensor:
    params = [p for p in parameters if p.grad is not None] if process_group is not None else None
    gradients = Gradients(grads, params, process_group=process_group)
    gradients.refuse_exact(exact)
    if gradients.shards is not None:  # DTensors (FSDP2, TP, ...), pipeline stages, hand shards
        total = gradients.sharded_total_norm(norm_type, error_if_nonfinite, exact)
        gradients.scale_(_coefficient(max_norm, total, 1e-6))
        return total.to(_ops.total_norm_dtype(grads))
    if grads and gradients.route is Route.KERNELS:
        return _ops.clip_grad_norm_(grads, max_norm, norm_type, error_if_nonfinite, exact=exact)[0]
    if gradients.route is Route.SPARSE:
        total_wide, dtype = _total_norm_with_sparse(gradients, norm_type, error_if_nonfinite, exact)
        gradients.scale_(_coefficient(max_norm, total_wide, 1e-6))
        return total_wide.to(dtype)
    # Other devices, subclasses, or no gradient at all: torch's composition.
    total_norm = _torch_get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    _torch_clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)
    return total_norm


@deprecated(
    "`torchclip.clip_grad_norm` is deprecated in favor of `torchclip.clip_grad_norm_` "
    "(as torch.nn.utils.clip_grad_norm is in favor of torch.nn.utils.clip_grad_norm_).",
    category=FutureWarning,
)
def clip_grad_norm(
    parameters: _tensor_or_tensors,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    r"""torchclip's clip_grad_norm: a deprecated alias of `clip_grad_norm_`, called with the same arguments.

    Warns with a FutureWarning, as `torch.nn.utils.clip_grad_norm` does.
    """
    return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


def clip_grad_value_(
    parameters: _tensor_or_tensors,
    clip_value: float,
    foreach: bool | None = None,
) -> None:
    r"""torchclip's clip_grad_value_: clamp every gradient to `[-clip_value, clip_value]`, in place.

    Drop-in for `torch.nn.utils.clip_grad_value_`, in one read-write pass (torch makes two). Where it
    differs from torch: with every gradient None it does nothing (torch raises an internal error), a
    `clip_value` beyond float16's range clamps float16 gradients as the maths says, and sparse COO
    gradients are clamped after summing their duplicates.

    Args:
        parameters: a tensor, or an iterable of them, whose `.grad` is clamped; None is skipped.
        clip_value: the bound. A negative one sets every gradient to it, as torch's does.
        foreach: accepted for torch's signature.

    Raises:
        TypeError: an item that is not a tensor (`NotATensorError`); `clip_value` not a number.
        RuntimeError: a bool or complex gradient.

    Example:
        >>> torchclip.clip_grad_value_(model.parameters(), clip_value=0.5)
    """
    parameters = _readable(parameters)
    if not _ops.dynamo_is_tracing() and _ops.clip_grad_value_of_plain(parameters, clip_value):
        return
    parameters = _as_list(parameters)
    clip_value = _as_number("clip_value", clip_value)
    grads = _grads(parameters)
    if not grads:
        return
    with torch.no_grad():
        gradients = Gradients(grads)
        if gradients.route in (Route.KERNELS, Route.SPARSE):
            gradients.clamp_(-clip_value, clip_value)
        else:
            _torch_clip_grad_value_(parameters, clip_value, foreach)
