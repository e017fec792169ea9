"""How an error message shows a value the caller gave: a tensor by what it is (type, shape, dtype), never by its
contents, which for anything but a scalar run over many lines and are cut off mid-row."""

from __future__ import annotations

from torch import Tensor


def brief(value) -> str:
    """A value's type and its repr cut short: a tensor as shown(), a tuple or list by its items' types."""
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return shown(value)
    if isinstance(value, (tuple, list)):
        items = ", ".join(type(v).__name__ for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__name__} ({items})"
    return f"{type(value).__name__} {value!r:.60}"


def shown(value) -> str:
    """repr(value) cut short, but a tensor as its type, shape and dtype (and its one value where it is a 0-d
    tensor in memory: a number given as a tensor)."""
    if not isinstance(value, Tensor):
        return f"{value!r:.80}"
    kind = f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    if value.dim() == 0 and value.device.type == "cpu" and type(value) is Tensor and not value.requires_grad:
        return f"{kind} holding {value.item()!r}"
    return kind
