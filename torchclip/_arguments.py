"""What torchclip's clip classes, need_clip marks and optimizer hook accept, checked before anything is
written: numbers and policies, and the call forms (parameters, (param, grad) pairs), each refusal naming
what it got and what it takes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._messages import brief, shown
from torchclip.clip_grad import NotATensorError


def _number(name: str, value) -> float:
    """float(value), or a TypeError naming the argument; a bool is refused (a flag where a number goes)."""
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"{name} must be a number, got {shown(value)}")


def _positive_finite(name: str, value) -> float:
    number = _number(name, value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {shown(value)}")
    return number


_NONFINITE_POLICIES = ("propagate", "raise", "skip")


def _policy(nonfinite) -> str:
    if nonfinite not in _NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {_NONFINITE_POLICIES}, got {shown(nonfinite)}")
    return nonfinite


# The call forms, as the errors name them.
_CALL_FORMS = (
    "parameters (model.parameters(), a list of tensors, one tensor, or a torch.nn.Module) or "
    "(param, grad) pairs as Paddle's optimizers pass them, e.g. [(p, p.grad) for p in model.parameters()]"
)
_PARAMETERS = "parameters (a torch.nn.Module, an iterable of tensors such as model.parameters(), or one tensor)"
_PARAM_LIST = (
    "a list of parameters or a list of parameter names in `program` (or a torch.nn.Module, an iterable "
    "of tensors, one tensor)"
)
# The tensor types whose memory _shares_memory reads (a subclass, e.g. DTensor, may have none of its own).
_PLAIN = (Tensor, torch.nn.Parameter)


def _items_of(given, who: str, accepted: str) -> Sequence:
    """The items of a clip's (or set_need_clip's, set_gradient_clip's) argument: a Module's parameters, one
    tensor as a list, a list or tuple as it is, any other iterable drained once. A str or a mapping is
    refused: iterating it gives characters or names (dict(model.named_parameters()), a state_dict)."""
    if isinstance(given, torch.nn.Module):
        return list(given.parameters())
    if isinstance(given, Tensor):
        return [given]
    if isinstance(given, (list, tuple)):
        return given
    if isinstance(given, Mapping):
        raise TypeError(
            f"{who} got a mapping ({type(given).__name__} of {len(given)} entries: names to tensors, "
            f"as dict(model.named_parameters()) or a state_dict); it takes {accepted}: pass "
            f"model.parameters(), or the mapping's .values() if they are the parameters"
        )
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise TypeError(f"{who} got {brief(given)}; it takes {accepted}")
    return list(given)


def _checked_parameters(items: Sequence, who: str, accepted: str) -> Sequence:
    """items, checked to be tensors (NotATensorError: the AttributeError a non-tensor's .grad raised before)."""
    for i, p in enumerate(items):
        if not isinstance(p, Tensor):
            raise NotATensorError(f"{who}: item {i} is {brief(p)}, not a tensor; it takes {accepted}")
    return items


def _end(t: Tensor, start: int) -> int:
    """The end of the bytes a strided tensor's elements lie in, from its first."""
    if t.is_contiguous():
        return start + t.nbytes
    return start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    """Whether two plain strided tensors' spans of memory intersect: a grad that is a view or .detach() of its
    parameter is the weight itself."""
    if type(a) not in _PLAIN or type(b) not in _PLAIN or a.layout != torch.strided or b.layout != torch.strided:
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return (
        a_start != 0
        and b_start != 0
        and a_start < _end(b, b_start)
        and b_start < _end(a, a_start)
        and a.device == b.device
    )


def _checked_pairs(items: Sequence, who: str) -> Sequence:
    """items, checked to be (param, grad) pairs whose grad is a gradient, never a weight: not the (name,
    parameter) pairs of model.named_parameters(), not (p, p), not two parameters side by side."""
    tracing = _ops.dynamo_is_tracing()  # fake tensors have no memory to compare
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)):
            raise TypeError(
                f"{who}: item 0 is a (param, grad) pair but item {i} is {brief(item)}; it takes "
                f"{_CALL_FORMS}, not a mix"
            )
        if len(item) != 2:
            raise TypeError(
                f"{who}: item {i} is a {type(item).__name__} of {len(item)} items, not a (param, grad) "
                f"pair; it takes {_CALL_FORMS}"
            )
        param, grad = item
        if isinstance(param, str):
            raise TypeError(
                f"{who}: item {i} is ({param!r}, {type(grad).__name__}), a (name, parameter) pair as "
                f"model.named_parameters() yields, not a (param, grad) pair; it takes {_CALL_FORMS}"
            )
        if not isinstance(param, Tensor):
            raise NotATensorError(f"{who}: item {i}'s param must be a Tensor, got {brief(param)}")
        if grad is None:
            continue
        if not isinstance(grad, Tensor):
            raise TypeError(f"{who}: item {i}'s grad must be a Tensor or None, got {brief(grad)}")
        # (type() first: Parameter's isinstance is a Python-level check, slow on every pair of a long list)
        weight = type(grad) is not Tensor and isinstance(grad, torch.nn.Parameter)
        if grad is param or weight or (not tracing and _shares_memory(param, grad)):
            reason = (
                "is the parameter itself"
                if grad is param
                else "is an nn.Parameter (a weight)"
                if weight
                else "lies in the parameter's own memory"
            )
            raise TypeError(
                f"{who}: item {i}'s grad {reason}, not a gradient: clipping it would write the "
                f"weights; it takes {_CALL_FORMS}"
            )
    return items
