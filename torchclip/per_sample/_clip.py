"""Per-sample clipping's two passes over the per-sample gradients: their norms, then the clipped sum (with the
noise and the division by the expected batch size folded in). Both read each per-sample gradient once, where
it lies and in its own dtype, in C++ (csrc/cpu/per_sample_kernel.cpp); the arithmetic between them (B clip
factors) is a few tensor ops on B or B x P numbers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from torchclip import _ops
from torchclip._arguments import _number, _positive_finite
from torchclip._messages import brief, shown

# Opacus's rule min(1, C / (n + 1e-6)) ("abadi", Abadi et al. 2016) and automatic clipping C / (n + gamma)
# (Bu et al., "Automatic clipping: differentially private deep learning made easier and stronger", 2023).
CLIP_RULES = ("abadi", "automatic")
STYLES = ("flat", "per_layer")
_ABADI_EPS = 1e-6  # Opacus's


def _pieces_of(grad_samples, name: str) -> tuple[list[Tensor], list[int]]:
    """The per-sample gradients as the ops take them: every parameter's tensors in one list, and how many each
    parameter has (a list is several batches, concatenated along the batch dimension, never copied)."""
    tensors, pieces = [], []
    for j, entry in enumerate(grad_samples):
        group = entry if isinstance(entry, (list, tuple)) else [entry]
        if not group or not all(isinstance(t, Tensor) for t in group):
            raise TypeError(
                f"{name}[{j}] must be a tensor [batch, *shape] or a non-empty list of them, got {brief(entry)}"
            )
        tensors.extend(group)
        pieces.append(len(group))
    return tensors, pieces


def _norm_dtype(tensors: Sequence[Tensor]) -> torch.dtype:
    """float32, or float64 where a per-sample gradient is: a 16-bit norm would round the clip factors."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _norms_float64(tensors: list[Tensor], pieces: list[int], norm_type: float) -> tuple[Tensor, Tensor]:
    if _ops.kernels_serve(tensors):
        return _ops.per_sample_norms(tensors, pieces, norm_type)
    # Where the kernels do not serve the tensors (no kernel built for their device, subclasses): the same numbers
    # from torch's own norms, in float64.
    per_parameter, start = [], 0
    for count in pieces:
        rows = torch.cat([t.reshape(t.shape[0], -1) for t in tensors[start : start + count]]).double()
        per_parameter.append(torch.linalg.vector_norm(rows, norm_type, dim=1))
        start += count
    per_tensor = torch.stack(per_parameter, dim=1)
    return torch.linalg.vector_norm(per_tensor, norm_type, dim=1), per_tensor


def per_sample_norms(
    grad_samples: Sequence[Tensor | Sequence[Tensor]], norm_type: float = 2.0, *, per_tensor: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Each sample's gradient norm over all parameters, in one pass over the per-sample gradients.

    Args:
        grad_samples: one entry per parameter: its per-sample gradients, a tensor [B, *shape] or a list of
            them (several batches, concatenated along the batch dimension without a copy), as Opacus keeps
            them in ``p.grad_sample``. B must be the same for every parameter.
        norm_type: the order of the norms (2 for DP-SGD; any order torch.linalg.vector_norm takes).
        per_tensor: also return each sample's norm per parameter, [B, P].

    Returns:
        The B norms (float32, or float64 when a gradient is float64; accumulated in float64), or with
            ``per_tensor`` the pair (norms [B], per-parameter norms [B, P]).
    """
    tensors, pieces = _pieces_of(grad_samples, "grad_samples")
    norm_type = _number("norm_type", norm_type)
    dtype = _norm_dtype(tensors)
    total, by_parameter = _norms_float64(tensors, pieces, norm_type)
    if per_tensor:
        return total.to(dtype), by_parameter.to(dtype)
    return total.to(dtype)


def clip_factors(norms: Tensor, max_norm: float | Sequence[float], clip: str = "abadi", gamma: float = 0.01) -> Tensor:
    """The per-sample clip factors (float64) of norms [B] (or [B, P], max_norm one bound per column):
    "abadi" min(1, C / (n + 1e-6)), Opacus's; "automatic" C / (n + gamma)."""
    bound = torch.as_tensor(max_norm, dtype=torch.float64, device=norms.device)
    if clip == "abadi":
        return (bound / (norms + _ABADI_EPS)).clamp(max=1.0)
    return bound / (norms + gamma)


def _parameter_list(params) -> list[Tensor]:
    if isinstance(params, Tensor):
        return [params]
    if not isinstance(params, Iterable):
        raise TypeError(f"params must be a parameter or an iterable of parameters, got {brief(params)}")
    listed = list(params)
    for i, p in enumerate(listed):
        if not isinstance(p, Tensor):
            raise TypeError(f"params[{i}] must be a tensor (a parameter), got {brief(p)}")
    return listed


def _grad_samples_of(params: list[Tensor], name: str) -> list:
    """Every parameter's per-sample gradients, checked: present, [B, *p.shape] pieces, one B for all."""
    samples, batch = [], None
    for i, p in enumerate(params):
        gs = getattr(p, "grad_sample", None)
        if gs is None:
            raise ValueError(
                f"{name}: params[{i}] (shape {tuple(p.shape)}) has no per-sample gradient (p.grad_sample is "
                "missing or None): was it computed in the backward pass (Opacus's GradSampleModule)?"
            )
        group = gs if isinstance(gs, (list, tuple)) else [gs]
        if not group or not all(isinstance(t, Tensor) for t in group):
            raise TypeError(f"{name}: params[{i}].grad_sample must be a tensor or a list of tensors, got {brief(gs)}")
        for t in group:
            if t.dim() == 0 or t.shape[1:] != p.shape:
                raise ValueError(
                    f"{name}: params[{i}].grad_sample has shape {tuple(t.shape)}, but a parameter of shape "
                    f"{tuple(p.shape)} needs per-sample gradients [batch, {', '.join(map(str, p.shape))}]"
                )
        rows = sum(t.shape[0] for t in group)
        if batch is None:
            batch = rows
        elif rows != batch:
            raise ValueError(
                f"{name}: params[{i}].grad_sample holds {rows} samples but params[0]'s hold {batch}; every "
                "parameter needs one gradient per sample"
            )
        samples.append(gs)
    return samples


def _bounds(max_norm, style: str, count: int, name: str) -> float | list[float]:
    if style == "flat":
        return _positive_finite("max_norm", max_norm)
    if isinstance(max_norm, Tensor) or not isinstance(max_norm, Iterable):
        raise TypeError(f"{name}: style='per_layer' takes one max_norm per parameter (a list), got {shown(max_norm)}")
    bounds = [_positive_finite(f"max_norm[{j}]", c) for j, c in enumerate(max_norm)]
    if len(bounds) != count:
        raise ValueError(f"{name}: style='per_layer' needs one max_norm per parameter ({count}), got {len(bounds)}")
    return bounds


def _noise_key(seed, generator) -> int:
    """The 64-bit key of this call's noise, as the op's int64: `seed` as given, else drawn from `generator`
    (or torch's default CPU generator), so that torch.manual_seed or a seeded generator repeats a run and
    each call draws a new key."""
    if seed is None:
        device = generator.device if generator is not None else "cpu"
        return int(torch.randint(-(2**63), 2**63 - 1, (), generator=generator, device=device, dtype=torch.int64))
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {shown(seed)}")
    bits = seed & 0xFFFFFFFFFFFFFFFF
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _writable_like(p: Tensor, existing) -> Tensor:
    """`existing` where the kernels can write it as p's (dense, p's shape, dtype and device), else a new tensor:
    Opacus's zero_grad(set_to_none=False) leaves p.grad for the next step to fill."""
    if (
        isinstance(existing, Tensor)
        and existing.shape == p.shape
        and existing.dtype == p.dtype
        and existing.device == p.device
        and existing.is_contiguous()
        and not existing.requires_grad
    ):
        return existing
    return torch.empty(p.shape, dtype=p.dtype, device=p.device)


def clip_and_accumulate_(
    params: Tensor | Iterable[Tensor],
    max_norm: float | Sequence[float],
    *,
    style: str = "flat",
    clip: str = "abadi",
    gamma: float = 0.01,
    noise_multiplier: float | None = None,
    expected_batch_size: float | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """Clip every sample's gradient and sum the batch into each parameter's ``summed_grad``: DP-SGD's step
    before the optimizer, Opacus's ``clip_and_accumulate`` (+ ``add_noise`` + ``scale_grad``) in two passes.

    Pass one takes each sample's norm (over all parameters, or per parameter with ``style="per_layer"``);
    pass two sums ``factor[b] * p.grad_sample[b]`` over the batch in the parameter's dtype (float32
    accumulation, float64 for float64), reading each per-sample gradient once in its own dtype (no cast
    copy), and adds it to ``p.summed_grad`` where that is already a tensor (gradient accumulation over
    several batches) or sets it. With ``noise_multiplier`` or ``expected_batch_size``, the same pass writes
    ``p.grad = (p.summed_grad + N(0, (noise_multiplier * C)^2)) / expected_batch_size``.

    Args:
        params: parameters whose ``grad_sample`` holds their per-sample gradients ([B, *p.shape], or a list
            of such tensors to concatenate), as Opacus's GradSampleModule leaves them.
        max_norm: C, the clip bound; with ``style="per_layer"`` one bound per parameter (Opacus's
            DPPerLayerOptimizer), whose L2 norm is then C for the noise.
        style: "flat" (one norm per sample over all parameters) or "per_layer" (one per sample and parameter).
        clip: "abadi": factor min(1, C / (n + 1e-6)), Opacus's; "automatic": C / (n + gamma) (Bu et al.).
        gamma: automatic clipping's stabiliser (> 0).
        noise_multiplier: sigma; the noise's standard deviation is sigma * C. Writes ``p.grad``.
        expected_batch_size: the divisor of ``p.grad`` (Opacus's expected batch size times the batches
            accumulated, for loss_reduction="mean"; 1 for "sum"). Writes ``p.grad``.
        generator: the noise's source: element i of parameter j gets the normal of (key, j, i) from a
            counter-based generator (Philox4x32-10 + Box-Muller), so the noise is the same for any thread
            count and CPU capability; the key is drawn from ``generator`` (else torch's default CPU
            generator), so a run seeded by torch.manual_seed or a seeded generator repeats bit for bit.
        seed: the key itself, instead of a draw (the caller then varies it from step to step).
        error_if_nonfinite: raise, writing nothing, when a per-sample norm is NaN or inf. Otherwise a NaN
            norm's factor is NaN and an inf norm's is 0, as in Opacus (a NaN or inf sample makes the sum NaN).

    Returns:
        The per-sample norms clipping used: [B] (flat) or [B, P] (per_layer), float32 (float64 for float64
            gradients).
    """
    name = "clip_and_accumulate_"
    if style not in STYLES:
        raise ValueError(f"{name}: style must be one of {STYLES}, got {shown(style)}")
    if clip not in CLIP_RULES:
        raise ValueError(f"{name}: clip must be one of {CLIP_RULES}, got {shown(clip)}")
    gamma = _positive_finite("gamma", gamma)
    params = _parameter_list(params)
    bounds = _bounds(max_norm, style, len(params), name)
    writes_grad = noise_multiplier is not None or expected_batch_size is not None
    sigma = 0.0 if noise_multiplier is None else _number("noise_multiplier", noise_multiplier)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {shown(noise_multiplier)}")
    divisor = 1.0 if expected_batch_size is None else _positive_finite("expected_batch_size", expected_batch_size)
    samples = _grad_samples_of(params, name)
    for i, p in enumerate(params):
        summed = getattr(p, "summed_grad", None)
        if summed is not None and (
            not isinstance(summed, Tensor) or summed.shape != p.shape or summed.dtype != p.dtype
        ):
            raise ValueError(
                f"{name}: params[{i}].summed_grad is {brief(summed)}; to add to it, it must have the parameter's "
                f"shape {tuple(p.shape)} and dtype {p.dtype}"
            )
    tensors, pieces = _pieces_of(samples, "grad_sample")
    total, by_parameter = _norms_float64(tensors, pieces, 2.0)
    norms = total if style == "flat" else by_parameter
    if error_if_nonfinite and not bool(torch.isfinite(norms).all()):
        first = tuple(int(k) for k in (~torch.isfinite(norms)).nonzero()[0])
        where = f"sample {first[0]}" + ("" if style == "flat" else f", parameter {first[1]}")
        raise RuntimeError(
            f"{name}: the per-sample gradient norm of {where} is {norms[first].item()}, so it cannot be clipped; "
            "nothing was written (error_if_nonfinite=False clips it as Opacus does)"
        )
    factors = clip_factors(norms, bounds, clip, gamma)  # [B] or [B, P]
    factors = factors.reshape(1, -1) if style == "flat" else factors.t()
    noise_bound = bounds if style == "flat" else math.sqrt(sum(c * c for c in bounds))
    noise_std = sigma * noise_bound if writes_grad else 0.0
    key = _noise_key(seed, generator) if noise_std != 0.0 else 0
    accumulate = any(getattr(p, "summed_grad", None) is not None for p in params)
    summed = [
        p.summed_grad
        if getattr(p, "summed_grad", None) is not None
        else (torch.zeros_like(p) if accumulate else torch.empty_like(p, memory_format=torch.contiguous_format))
        for p in params
    ]
    summed = [s if s.is_contiguous() else s.contiguous() for s in summed]
    grads = [_writable_like(p, p.grad) for p in params] if writes_grad else []
    if grads and any(g.data_ptr() == s.data_ptr() for g, s in zip(grads, summed) if g.numel()):
        grads = [torch.empty_like(s) for s in summed]  # (p.grad can be summed_grad's view: Opacus's rank != 0)
    _accumulate(tensors, pieces, factors, summed, grads, accumulate, noise_std, key, divisor)
    for p, s in zip(params, summed):
        p.summed_grad = s
    for p, g in zip(params, grads):
        if p.grad is not g:
            p.grad = g
    return norms.to(_norm_dtype(tensors))


def _accumulate(tensors, pieces, factors, summed, grads, accumulate, noise_std, key, divisor):
    if _ops.kernels_serve([*tensors, *summed, *grads]):
        _ops.per_sample_accumulate_(
            tensors,
            pieces,
            factors.contiguous(),
            summed,
            grads,
            accumulate=accumulate,
            noise_std=noise_std,
            seed=key,
            divisor=divisor,
        )
        return
    # Where the kernels do not serve the tensors: torch's ops, the same sums, the noise from torch.normal under a
    # generator seeded with the key (reproducible, but not the kernels' bits).
    noise_source = None
    if grads and noise_std:
        noise_source = torch.Generator(device=summed[0].device)
        noise_source.manual_seed(key & 0xFFFFFFFFFFFFFFFF)
    start = 0
    for j, (count, s) in enumerate(zip(pieces, summed)):
        rows = torch.cat(list(tensors[start : start + count])) if count > 1 else tensors[start]
        weights = factors[0 if factors.shape[0] == 1 else j].to(device=s.device, dtype=s.dtype)
        clipped = torch.einsum("i,i...", weights, rows.to(s.dtype))
        s.copy_(s + clipped if accumulate else clipped)
        if grads:
            noise = 0.0
            if noise_source is not None:
                noise = torch.normal(0.0, noise_std, s.shape, generator=noise_source, device=s.device, dtype=s.dtype)
            grads[j].copy_((s + noise) / divisor)
        start += count


def add_noise_(
    params: Tensor | Iterable[Tensor],
    noise_std: float,
    *,
    divisor: float = 1.0,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> None:
    """``p.grad = (p.summed_grad + N(0, noise_std^2)) / divisor`` for every parameter, in one pass, the noise
    drawn as clip_and_accumulate_'s (a counter-based generator keyed by ``seed`` or a draw from
    ``generator``): the noise step on its own, for a sum already made (Opacus's ``add_noise``)."""
    name = "add_noise_"
    params = _parameter_list(params)
    noise_std = _number("noise_std", noise_std)
    if not (math.isfinite(noise_std) and noise_std >= 0):
        raise ValueError(f"noise_std must be a finite number >= 0, got {shown(noise_std)}")
    divisor = _positive_finite("divisor", divisor)
    summed = []
    for i, p in enumerate(params):
        s = getattr(p, "summed_grad", None)
        if not isinstance(s, Tensor) or s.shape != p.shape:
            raise ValueError(
                f"{name}: params[{i}].summed_grad is {brief(s)}; it needs the clipped sum, shape {tuple(p.shape)}"
            )
        summed.append(s if s.is_contiguous() else s.contiguous())
    grads = [_writable_like(s, p.grad) for p, s in zip(params, summed)]
    grads = [torch.empty_like(s) if g.numel() and g.data_ptr() == s.data_ptr() else g for g, s in zip(grads, summed)]
    key = _noise_key(seed, generator) if noise_std != 0.0 else 0
    # No rows and accumulate: the kernels only read summed (csrc/cpu/kernel_table.h).
    empty_rows = [s.new_empty((0, *s.shape)) for s in summed]
    factors = torch.empty((1, 0), dtype=torch.float64, device=summed[0].device if summed else "cpu")
    _accumulate(empty_rows, [1] * len(summed), factors, summed, grads, True, noise_std, key, divisor)
    for p, g in zip(params, grads):
        if p.grad is not g:
            p.grad = g.view_as(p)
