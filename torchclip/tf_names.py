"""TensorFlow's clipping functions for torch tensors (tf.clip_by_value, tf.clip_by_norm,
tf.linalg.global_norm, tf.clip_by_global_norm), with TensorFlow 2.x's names, arguments and results.

As TensorFlow's, they are out of place (inputs are never modified) and differentiable, so they clip
activations as well as gradients. Norms are accumulated in float64 (TensorFlow sums squares in the
tensors' own dtype, so a float16 norm above 255 or a float32 norm above 1.8e19 overflows there); where
nothing needs a gradient, a list's norm is one fused pass of torchclip's kernel, and its scaled copies
one torch._foreach_mul per dtype.

Keras 3's optimizer arguments (clipnorm=, clipvalue=, global_clipnorm=) are in torchclip.optim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._gradients import Gradients
from torchclip._messages import shown

__all__ = ["clip_by_global_norm", "clip_by_norm", "clip_by_value", "global_norm"]


def _tensor(name: str, t) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _clip_norm(name: str, value) -> float | Tensor:
    """A clip norm: a number, or a 0-d tensor (checked where reading it waits for nothing, on the CPU)."""
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"{name} must be a number or a 0-d tensor, got a tensor of shape {tuple(value.shape)}")
        if value.device.type != "cpu":
            return value
        number = value.item()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        raise TypeError(f"{name} must be a number or a 0-d tensor, got {shown(value)}")
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {shown(value)}")
    return value if isinstance(value, Tensor) else number


def _needs_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a factor multiplies `dtype` data in: float32 for 16/32-bit data, as torch's opmath."""
    return torch.float64 if dtype.to_real() == torch.float64 else torch.float32


def _scaled(t: Tensor, factor: Tensor) -> Tensor:
    """t * factor (float64), a new tensor of t's dtype, rounded once."""
    return (t * factor.to(t.device, _math_dtype(t.dtype))).to(t.dtype)


def clip_by_value(t: Tensor, clip_value_min: float | Tensor, clip_value_max: float | Tensor) -> Tensor:
    """`tf.clip_by_value`: t's elements limited to [clip_value_min, clip_value_max], as a new tensor.

    Out of place and differentiable, as TensorFlow's. Unlike TensorFlow, min > max is an error.

    Args:
        t: the tensor (real).
        clip_value_min: the lower bound, a number or a tensor that broadcasts against t.
        clip_value_max: the upper bound, likewise.

    Returns:
        A new tensor of t's dtype; NaN elements stay NaN.

    Raises:
        TypeError: t is not a tensor, or is complex; a bound is neither a number nor a tensor.
        ValueError: a number bound min > max.

    Example:
        >>> torchclip.clip_by_value(torch.tensor([-2.0, 0.5, 3.0]), -1.0, 1.0)
        tensor([-1.0000,  0.5000,  1.0000])
    """
    _tensor("t", t)
    if t.is_complex():
        raise TypeError(f"clip_by_value: t has dtype {t.dtype}; clipping by value needs real numbers")
    numbers = [b for b in (clip_value_min, clip_value_max) if not isinstance(b, Tensor)]
    for name, bound in (("clip_value_min", clip_value_min), ("clip_value_max", clip_value_max)):
        if not isinstance(bound, (Tensor, int, float)) or isinstance(bound, bool):
            raise TypeError(f"{name} must be a number or a tensor, got {shown(bound)}")
    if len(numbers) == 2 and clip_value_min > clip_value_max:
        raise ValueError(
            f"clip_value_min must be <= clip_value_max, got clip_value_min={shown(clip_value_min)}, "
            f"clip_value_max={shown(clip_value_max)}"
        )
    if len(numbers) == 2:
        return torch.clamp(t, clip_value_min, clip_value_max)
    # Tensor bounds (both, as clamp takes them) in t's dtype, as TensorFlow requires: no type promotion.
    low, high = (torch.as_tensor(b).to(t.device, t.dtype) for b in (clip_value_min, clip_value_max))
    return torch.clamp(t, low, high)


def _axes(axes, ndim: int) -> tuple[int, ...] | None:
    if axes is None:
        return None
    items = [axes] if isinstance(axes, int) else list(axes) if isinstance(axes, (list, tuple)) else None
    if items is None or any(isinstance(a, bool) or not isinstance(a, int) for a in items):
        raise TypeError(f"axes must be an int or a list of ints, got {shown(axes)}")
    for a in items:
        if not -max(ndim, 1) <= a < max(ndim, 1):
            raise ValueError(f"axes: {a} is out of range for a tensor of {ndim} dimensions (axes={shown(axes)})")
    return tuple(a % max(ndim, 1) for a in items)


def clip_by_norm(
    t: Tensor, clip_norm: float | Tensor, axes: int | Sequence[int] | None = None, *, exact: bool | None = None
) -> Tensor:
    """`tf.clip_by_norm`: t * clip_norm / max(||t||, clip_norm), a new tensor of t's dtype.

    The norm accumulates in float64 (TensorFlow's, in t's dtype, overflows for float32 norms above
    1.8e19). Out of place and differentiable.

    Args:
        t: the tensor (floating point or complex).
        clip_norm: the largest norm, a number or a 0-d tensor, finite and > 0.
        axes: None for the whole tensor's L2 norm; an int or list of ints: the norms over those
            dimensions, one per remaining slice, each slice clipped by its own.
        exact: torchclip only: the norm the true value rounded once (None: `torchclip.set_exact_norm`'s
            setting; True raises for tensors autograd tracks, and with axes).

    Returns:
        A new tensor of t's dtype; a zero tensor stays zero.

    Raises:
        TypeError: t is not a tensor, or is an integer tensor.
        ValueError: clip_norm <= 0 or not finite; an axis out of range.

    Example:
        >>> torchclip.clip_by_norm(torch.tensor([3.0, 4.0]), 1.0)
        tensor([0.6000, 0.8000])
    """
    _tensor("t", t)
    clip_norm = _clip_norm("clip_norm", clip_norm)
    if not (t.is_floating_point() or t.is_complex()):
        raise TypeError(f"clip_by_norm: t has dtype {t.dtype}; a norm needs a floating point or complex dtype")
    dims = _axes(axes, t.dim())
    if _ops.check_exact(exact) and dims is not None:
        raise ValueError(
            f"exact=True: norms over axes are not taken exactly; exact norms need axes=None, got {shown(axes)}"
        )
    wide = torch.complex128 if t.is_complex() else torch.float64
    if dims is None:
        norm = Gradients([t]).tensor_norms(exact=exact)[0]
    else:
        norm = torch.linalg.vector_norm(t, 2.0, dim=dims, keepdim=True, dtype=wide)
    limit = clip_norm.to(norm.device, torch.float64) if isinstance(clip_norm, Tensor) else clip_norm
    return _scaled(t, limit / torch.maximum(norm, torch.as_tensor(limit, dtype=torch.float64, device=norm.device)))


def _tensors_of(t_list) -> tuple[list[Tensor], list[int]]:
    """The tensors of t_list and their positions; None entries are skipped."""
    if isinstance(t_list, Tensor) or not isinstance(t_list, Sequence) or isinstance(t_list, str):
        raise TypeError(f"t_list must be a sequence (list or tuple) of tensors, got {type(t_list).__name__}")
    tensors, positions = [], []
    for i, t in enumerate(t_list):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"t_list[{i}] must be a torch.Tensor or None, got {type(t).__name__}")
        tensors.append(t)
        positions.append(i)
    return tensors, positions


def _global_norm64(tensors: list[Tensor], exact: bool | None) -> Tensor:
    """The L2 norm of all tensors together, float64, on the first tensor's device."""
    return Gradients(tensors).norms(2.0, exact)[1]


def global_norm(t_list: Sequence[Tensor | None], *, exact: bool | None = None) -> Tensor:
    """`tf.linalg.global_norm`: sqrt(sum of ||t||^2) over the tensors of t_list.

    Args:
        t_list: a list or tuple of tensors; None entries are ignored.
        exact: torchclip only: the norm the true value rounded once (None: `torchclip.set_exact_norm`'s
            setting; True raises for tensors autograd tracks).

    Returns:
        A 0-d tensor in the tensors' promoted (real) dtype, accumulated in float64; 0 when there are none.

    Raises:
        TypeError: t_list is not a sequence, or holds something other than tensors and None.

    Example:
        >>> torchclip.global_norm([torch.tensor([3.0]), None, torch.tensor([4.0])])
        tensor(5.)
    """
    tensors, _ = _tensors_of(t_list)
    _ops.check_exact(exact)
    if not tensors:
        return torch.tensor(0.0)
    return _global_norm64(tensors, exact).to(_ops.total_norm_dtype(tensors))


def clip_by_global_norm(
    t_list: Sequence[Tensor | None],
    clip_norm: float | Tensor,
    use_norm: float | Tensor | None = None,
    *,
    exact: bool | None = None,
) -> tuple[list[Tensor | None], Tensor]:
    """`tf.clip_by_global_norm`: every tensor times clip_norm / max(global_norm, clip_norm).

    Out of place and differentiable; where nothing needs a gradient, one fused norm pass and one scaled
    copy per dtype. A NaN or inf global norm makes every clipped tensor NaN, as TensorFlow does.

    Args:
        t_list: a list or tuple of tensors; None entries stay None in their place.
        clip_norm: the largest global norm, a number or a 0-d tensor, finite and > 0.
        use_norm: a number or 0-d tensor taken as the global norm instead of computing it.
        exact: torchclip only: the norm the true value rounded once (None: `torchclip.set_exact_norm`'s
            setting; True raises for tensors autograd tracks).

    Returns:
        (list_clipped, global_norm): the new tensors, and the global norm (use_norm as it was given).

    Raises:
        TypeError: t_list is not a sequence of tensors and None; use_norm is not a number or tensor.
        ValueError: clip_norm <= 0 or not finite; use_norm not 0-d.

    Example:
        >>> clipped, norm = torchclip.clip_by_global_norm([torch.tensor([3.0]), torch.tensor([4.0])], 1.0)
        >>> norm
        tensor(5.)
    """
    tensors, positions = _tensors_of(t_list)
    clip_norm = _clip_norm("clip_norm", clip_norm)
    _ops.check_exact(exact)
    if use_norm is not None and not (isinstance(use_norm, (int, float, Tensor)) and not isinstance(use_norm, bool)):
        raise TypeError(f"use_norm must be a number or a 0-d tensor, got {shown(use_norm)}")
    if isinstance(use_norm, Tensor) and use_norm.dim() != 0:
        raise ValueError(f"use_norm must be a number or a 0-d tensor, got a tensor of shape {tuple(use_norm.shape)}")
    if not tensors:
        return list(t_list), torch.as_tensor(0.0 if use_norm is None else use_norm)
    device = tensors[0].device
    norm64 = (
        _global_norm64(tensors, exact)
        if use_norm is None
        else torch.as_tensor(use_norm, dtype=torch.float64).to(device)
    )
    limit = clip_norm.to(device, torch.float64) if isinstance(clip_norm, Tensor) else clip_norm
    # TensorFlow's: clip_norm * min(1 / norm, 1 / clip_norm), plus (norm - norm), NaN for inf or NaN.
    scale = limit * torch.minimum(1.0 / norm64, torch.as_tensor(1.0 / limit, dtype=torch.float64, device=device)) + (
        norm64 - norm64
    )
    out: list[Tensor | None] = list(t_list)
    if _needs_grad(tensors) or not all(t.layout == torch.strided for t in tensors):
        for i, t in zip(positions, tensors):
            out[i] = _scaled(t, scale)
    else:  # one fused pass per dtype
        by_dtype: dict[torch.dtype, list[int]] = {}
        for k, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(k)
        for dtype, members in by_dtype.items():
            scaled = torch._foreach_mul([tensors[k] for k in members], scale.to(_math_dtype(dtype)))
            for k, s in zip(members, scaled):
                out[positions[k]] = s.to(dtype)
    returned = (
        norm64.to(_ops.total_norm_dtype(tensors))
        if use_norm is None
        else (use_norm if isinstance(use_norm, Tensor) else torch.as_tensor(use_norm))
    )
    return out, returned
