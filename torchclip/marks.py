"""Which parameters are clipped, and by which clip: need_clip marks (Paddle's ParamAttr(need_clip=...)) and
the clips set_gradient_clip gives parameters (Paddle's fluid.clip.set_gradient_clip). Every change counts
in `generation()`, which the optimizer hook's cached plan compares."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from torchclip._arguments import _PARAM_LIST, _PARAMETERS, _checked_parameters, _items_of
from torchclip._messages import brief, shown
from torchclip.clip_base import ClipGradBase

__all__ = ["exclude_from_clipping", "gradient_clip_of", "set_gradient_clip", "set_need_clip"]

# Bumped by every call that changes which clip serves a parameter or whether it is clipped
# (set_gradient_clip, set_need_clip, exclude_from_clipping): the optimizer hook caches its plan until then.
_generation = 0


def _marks_changed() -> None:
    global _generation
    _generation += 1


def generation() -> int:
    """How many calls have changed a mark or a parameter's clip so far."""
    return _generation


def set_need_clip(target: torch.nn.Module | Tensor | Iterable[Tensor], need_clip: bool) -> int:
    """Mark parameters as clipped or not, as Paddle's `ParamAttr(need_clip=...)`.

    A parameter marked False is neither clipped nor counted in a global norm by every clip class and
    optimizer hook; the drop-ins (`clip_grad_norm_`, ...) ignore marks, as torch's do. Paddle sets the
    mark when a parameter is made; here it is an attribute, `param.need_clip`, set at any time.

    Args:
        target: a Module (its parameters), an iterable of parameters, or one.
        need_clip: True to clip, False to leave out.

    Returns:
        How many parameters were marked.

    Raises:
        TypeError: `need_clip` is not a bool; `target` is a mapping, a str or holds something other than
            tensors.

    Example:
        >>> torchclip.set_need_clip(model.fc, False)  # the classifier is left out of clipping
    """
    if not isinstance(need_clip, bool):
        raise TypeError(f"need_clip must be a bool, got {shown(need_clip)}")
    params = _checked_parameters(
        _items_of(target, "set_need_clip: target", _PARAMETERS), "set_need_clip: target", _PARAMETERS
    )
    for p in params:
        p.need_clip = need_clip
    _marks_changed()
    return len(params)


_NORM_LAYERS = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
    torch.nn.RMSNorm,
)


def exclude_from_clipping(module: torch.nn.Module, *, biases: bool = True, norm_layers: bool = True) -> int:
    """Leave every bias and every normalisation layer's parameters out of clipping (`need_clip = False`).

    The usual exclusion for weight decay, and for AGC (NFNets): batch, layer, group, RMS and local
    response norm layers. torchclip's own helper; Paddle marks parameters one by one.

    Args:
        module: the model.
        biases: mark every parameter named `bias`.
        norm_layers: mark every parameter of a normalisation layer.

    Returns:
        How many parameters were marked.

    Raises:
        TypeError: `module` is not a Module, or a flag is not a bool.

    Example:
        >>> torchclip.exclude_from_clipping(model)
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    for name, flag in (("biases", biases), ("norm_layers", norm_layers)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {shown(flag)}")
    marked = set()
    for _, sub in module.named_modules():
        for name, p in sub.named_parameters(recurse=False):
            if (norm_layers and isinstance(sub, _NORM_LAYERS)) or (biases and name == "bias"):
                marked.add(p)
    for p in marked:
        p.need_clip = False
    _marks_changed()
    return len(marked)


# ---- set_gradient_clip ----------------------------------------------------------------------------

# The clip for parameters that have none of their own, when set_gradient_clip got no parameters.
_default_clip: ClipGradBase | None = None


def set_gradient_clip(
    clip: ClipGradBase | None,
    param_list: torch.nn.Module | Tensor | Iterable[Tensor] | Iterable[str] | None = None,
    program: torch.nn.Module | None = None,
) -> None:
    """Set a default clip for parameters (Paddle's `fluid.clip.set_gradient_clip`).

    An optimizer hook (`torchclip.optim`) clips a parameter with its param group's clip, else the
    optimizer's `grad_clip`, else this one. ClipGradByGlobalNorm clips set this way that share a
    group_name compute one global norm and must share clip_norm (Paddle's rule: a ValueError at the step
    otherwise). An optimizer's own grad_clip takes precedence, with a warning (Paddle's fourth example).

    Args:
        clip: the clip; None clears the defaults set for those parameters.
        param_list: parameters (an iterable, one tensor, or a Module's), or their names resolved in
            `program`; None means all of `program`'s parameters, or, with no program, every parameter an
            optimizer hook meets.
        program: the Module that owns the named parameters (torch has no global program).

    Raises:
        TypeError: `clip` is not a clip, `program` not a Module, or `param_list` mixes names and tensors.
        ValueError: a name `program` has no parameter for, or names without a `program`.

    Example:
        >>> torchclip.set_gradient_clip(torchclip.ClipGradByGlobalNorm(1.0), ["fc.weight"], program=model)
    """
    global _default_clip
    if clip is not None and not isinstance(clip, ClipGradBase):
        raise TypeError(f"clip must be a ClipGradBase instance (e.g. ClipGradByGlobalNorm), got {shown(clip)}")
    if program is not None and not isinstance(program, torch.nn.Module):
        raise TypeError(f"program must be the torch.nn.Module owning the parameters, got {type(program).__name__}")
    if param_list is None:
        params = None if program is None else list(program.parameters())
    else:
        params = _resolve_params(_items_of(param_list, "set_gradient_clip: param_list", _PARAM_LIST), program)
    _marks_changed()
    if params is None:
        _default_clip = clip
        return
    for p in params:
        p.gradient_clip_attr = clip


def _resolve_params(items: Sequence, program) -> Sequence[Tensor]:
    if items and all(isinstance(i, str) for i in items):
        if program is None:
            raise ValueError("set_gradient_clip: parameter names need `program`, the nn.Module that owns them")
        named = dict(program.named_parameters())
        unknown = [name for name in items if name not in named]
        if unknown:
            raise ValueError(
                f"set_gradient_clip: no parameter named {unknown} in {type(program).__name__} "
                f"(it has {sorted(named)[:8]}{'...' if len(named) > 8 else ''})"
            )
        return [named[name] for name in items]
    kind = str if items and isinstance(items[0], str) else Tensor
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise TypeError(
                f"set_gradient_clip: param_list item {i} is {brief(item)}; it takes {_PARAM_LIST}, not a mix"
            )
    return items


def gradient_clip_of(param) -> ClipGradBase | None:
    """The clip set_gradient_clip gave `param` (or the global default), None if neither."""
    return getattr(param, "gradient_clip_attr", None) or _default_clip
