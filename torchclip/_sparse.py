"""Sparse COO gradients (nn.Embedding(sparse=True) makes them), which torch.nn.utils cannot clip.

A COO gradient may list an index several times; its value there is the sum. Norms are taken over
the coalesced values (duplicates summed first), counting the implicit zeros where an order needs
them; clamping coalesces the gradient in place first, so the sum is what is clamped. Scaling needs
neither: multiplying every stored value scales every sum.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def is_sparse(t: Tensor) -> bool:
    return t.layout == torch.sparse_coo


def norm64(t: Tensor, norm_type: float) -> Tensor:
    """The norm_type-norm of a sparse COO tensor, in float64, on its device."""
    values = t.coalesce()._values()
    magnitudes = values.abs().to(torch.float64).flatten()
    has_implicit_zeros = magnitudes.numel() < t.numel()
    if norm_type == 0:
        return (magnitudes != 0).sum().to(torch.float64)
    if norm_type == math.inf:
        return magnitudes.max() if magnitudes.numel() else torch.zeros((), dtype=torch.float64, device=t.device)
    if norm_type < 0 and has_implicit_zeros:  # a zero element makes -inf and negative-order norms 0
        return torch.zeros((), dtype=torch.float64, device=t.device)
    if norm_type == -math.inf:
        return magnitudes.min()
    return torch.linalg.vector_norm(magnitudes, norm_type)


def on_cpu(tensors) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def dense_terms(tensors) -> list[Tensor]:
    """The tensors with each sparse COO one replaced by its coalesced values: the same norm for orders
    > 0 (implicit zeros add nothing), and dense, so the norm kernels (exact ones included) take them."""
    return [t.coalesce()._values() if is_sparse(t) else t for t in tensors]


def clamp_(t: Tensor, lo: float, hi: float) -> None:
    """Clamp a sparse COO tensor in place: coalesce it (sums of duplicates), then clamp the values.
    Implicit zeros stay zero, which is right whenever lo <= 0 <= hi (value clipping's case)."""
    if t.is_complex():
        raise RuntimeError("clip_grad_value_: a complex gradient cannot be clamped (complex numbers have no order)")
    if not t.is_coalesced():
        t.copy_(t.coalesce())
    t._values().clamp_(lo, hi)
