"""Gradient statistics for logging, from the clipping kernels' own norm pass."""

from __future__ import annotations

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._gradients import Gradients
from torchclip._messages import shown

__all__ = ["grad_norm"]


def grad_norm(
    module: torch.nn.Module, norm_type: float | str, group_separator: str = "/", *, exact: bool | None = None
) -> dict[str, Tensor]:
    """Each parameter's gradient norm and their total, for logging: Lightning's `grad_norm`.

    A drop-in for `lightning.pytorch.utilities.grad_norm`, with its keys and values. Lightning runs one
    norm per parameter and reads each back to the host to build the total; here one fused pass computes
    every norm (accumulated in float64) and the total, and one device-to-host copy brings them back.

    Args:
        module: the model; parameters without a gradient are left out.
        norm_type: the order p, a number > 0 or 'inf'.
        group_separator: between the prefix and the parameter's name in each key.
        exact: torchclip only: for p = 1 and 2, every norm and the total the true value rounded once
            (None: `torchclip.set_exact_norm`'s setting; True raises where torch's own ops
            would take them).

    Returns:
        `{"grad_{p}_norm{sep}{name}": norm, ..., "grad_{p}_norm_total": total}` (p as a float), 0-d CPU
        tensors, each in its gradient's (real) dtype (the total in the gradients' promoted dtype).

    Raises:
        TypeError: module is not a Module; group_separator is not a str.
        ValueError: norm_type is not a number > 0 (Lightning's message).

    Example:
        >>> self.log_dict(torchclip.grad_norm(self, norm_type=2))  # in on_before_optimizer_step
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(group_separator, str):
        raise TypeError(f"group_separator must be a str, got {shown(group_separator)}")
    refused = "`norm_type` must be a positive number or 'inf' (infinity norm). Got"  # Lightning's words
    try:
        number = float(norm_type)
    except (TypeError, ValueError) as error:  # float()'s class, as Lightning raises
        raise type(error)(f"{refused} {shown(norm_type)}") from None
    if not number > 0:  # NaN too, which Lightning lets through to NaN norms
        raise ValueError(f"{refused} {number}")
    _ops.check_exact(exact, norm_type)
    norm_type = number
    named = [(name, p.grad.detach()) for name, p in module.named_parameters() if p.grad is not None]
    if not named:
        return {}
    grads = [g for _, g in named]
    with torch.no_grad():
        norms, total = Gradients(grads).norms(norm_type, exact)
        on_host = torch.cat([norms, total.reshape(1)]).cpu()  # the one device-to-host copy
    out = {
        f"grad_{norm_type}_norm{group_separator}{name}": on_host[i].to(g.dtype.to_real())
        for i, (name, g) in enumerate(named)
    }
    out[f"grad_{norm_type}_norm_total"] = on_host[-1].to(_ops.total_norm_dtype(grads))
    return out
