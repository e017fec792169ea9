"""Paddle-style gradient clipping classes on torchclip's kernels.

Paddle's documentation is the specification (paddle.nn.ClipGradByValue / ClipGradByNorm /
ClipGradByGlobalNorm, the fluid-era GradientClipBy* names with a `need_clip` predicate, ParamAttr's
need_clip, set_gradient_clip). Where Paddle and torch differ, each API keeps its own:

* ClipGradByGlobalNorm scales by clip_norm / max(global_norm, clip_norm): no epsilon, unlike
  torch.nn.utils.clip_grad_norm_'s max_norm / (total_norm + 1e-6).
* A gradient is "clipped" by ClipGradByNorm only when its norm is strictly above clip_norm.
* The global norm is accumulated in float64 for every dtype (Paddle sums float16/bfloat16 squares in
  half precision) and kept, for logging, in float32, or float64 when a gradient is float64 (Paddle's
  rule); the scale is applied in each gradient's own dtype.

Both call forms work. `clip(params_grads)` takes (param, grad) pairs, as Paddle's optimizers pass
them, and returns the pairs whose grad is not None (dropped, as in Paddle); `clip(parameters)` clips
each `.grad` (parameters: an iterable of tensors, one tensor, or an nn.Module for its parameters).
Anything else is a TypeError saying what was given, before any gradient changes: a mapping
(dict(model.named_parameters()), a state_dict), a str, model.named_parameters()'s (name, param) pairs,
and a pair whose grad is a weight (the parameter itself, its memory, or another nn.Parameter), which
would otherwise be clipped in the weight's place. Either way the gradients are clipped in place (Paddle
returns new tensors holding the same values): the fused kernels write where the data is.
`clip.last_global_norm` (ClipGradByGlobalNorm) holds the last call's norm as a tensor on the gradients'
device: logging it needs no host sync.

need_clip: a parameter whose `need_clip` attribute is False (set it with `set_need_clip`) is neither
clipped nor counted in the global norm, as Paddle's ParamAttr(need_clip=False). The legacy classes'
`need_clip` predicate excludes too: a parameter is clipped only when its attribute (default True) and
the predicate (default: all) both allow it, so either one can exclude it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from torchclip import _ops, _shards, _sparse
from torchclip.clip_grad import NotATensorError

__all__ = [
    "ClipGradBase",
    "ClipGradByGlobalNorm",
    "ClipGradByNorm",
    "ClipGradByValue",
    "GradientClipByGlobalNorm",
    "GradientClipByNorm",
    "GradientClipByValue",
    "exclude_from_clipping",
    "gradient_clip_of",
    "set_gradient_clip",
    "set_need_clip",
]


def _number(name: str, value) -> float:
    """float(value), or a TypeError naming the argument; a bool is refused (a flag where a number goes)."""
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"{name} must be a number, got {value!r:.80}")


def _positive_finite(name: str, value) -> float:
    number = _number(name, value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


_NONFINITE_POLICIES = ("propagate", "raise", "skip")

# Bumped by every call that changes which clip serves a parameter or whether it is clipped
# (set_gradient_clip, set_need_clip, exclude_from_clipping): the optimizer hook caches its plan until then.
_marks_generation = 0


def _marks_changed() -> None:
    global _marks_generation
    _marks_generation += 1


def _norm(g: Tensor) -> Tensor:
    """A gradient's L2 norm on the general path (other devices, subclasses, sparse COO), accumulated
    in at least float32."""
    if _sparse.is_sparse(g):
        return _sparse.norm64(g, 2.0)
    return torch.linalg.vector_norm(g, 2.0, dtype=torch.float64 if g.dtype == torch.float64 else torch.float32)


def _tensor_norms(tensors: list[Tensor], ord: float = 2.0) -> Tensor:
    """Each tensor's `ord`-norm in float64, on the first tensor's device: one fused kernel pass where
    the kernels serve the list and nothing needs a gradient; else one norm per tensor, differentiable
    (in float64, complex128 for complex data; sparse COO by its values)."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) and _ops.kernels_serve(tensors):
        return _ops.multi_tensor_norm(tensors, ord, False)[1]
    device = tensors[0].device
    return torch.stack([
        (_sparse.norm64(t, ord) if _sparse.is_sparse(t) else
         torch.linalg.vector_norm(t, ord, dtype=torch.complex128 if t.is_complex() else torch.float64)).to(device)
        for t in tensors
    ])


def _policy(nonfinite) -> str:
    if nonfinite not in _NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {_NONFINITE_POLICIES}, got {nonfinite!r}")
    return nonfinite


def add_to_count(count: Tensor | None, found: Tensor) -> Tensor:
    """count + found, as a 0-d int64 tensor on found's device. While a CUDA graph is being captured the
    sum goes into `count` in place: a new tensor would be rewritten by every replay with the captured
    call's sum, so replays would not count. Elsewhere a new tensor, so a count read earlier stays as read."""
    if count is None:
        return found.to(torch.int64)
    if found.is_cuda and count.device == found.device and torch.cuda.is_current_stream_capturing():
        return count.add_(found)
    return found.to(torch.int64) + count.to(found.device)


# ---- what a clip is called with -------------------------------------------------------------------

# The call forms, as the errors name them.
_CALL_FORMS = ("parameters (model.parameters(), a list of tensors, one tensor, or a torch.nn.Module) or "
               "(param, grad) pairs as Paddle's optimizers pass them, e.g. [(p, p.grad) for p in model.parameters()]")
_PARAMETERS = "parameters (a torch.nn.Module, an iterable of tensors such as model.parameters(), or one tensor)"
_PARAM_LIST = ("a list of parameters or a list of parameter names in `program` (or a torch.nn.Module, an iterable "
               "of tensors, one tensor)")
# The tensor types whose memory _shares_memory reads (a subclass, e.g. DTensor, may have none of its own).
_PLAIN = (Tensor, torch.nn.Parameter)


def _brief(value) -> str:
    """A value for an error message: its type, and its repr cut short (a tensor by its shape, a tuple by its
    items' types)."""
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return f"{type(value).__name__} of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        shown = ", ".join(type(v).__name__ for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{type(value).__name__} ({shown})"
    return f"{type(value).__name__} {value!r:.60}"


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
        raise TypeError(f"{who} got a mapping ({type(given).__name__} of {len(given)} entries: names to tensors, "
                        f"as dict(model.named_parameters()) or a state_dict); it takes {accepted}: pass "
                        f"model.parameters(), or the mapping's .values() if they are the parameters")
    if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
        raise TypeError(f"{who} got {_brief(given)}; it takes {accepted}")
    return list(given)


def _checked_parameters(items: Sequence, who: str, accepted: str) -> Sequence:
    """items, checked to be tensors (NotATensorError: the AttributeError a non-tensor's .grad raised before)."""
    for i, p in enumerate(items):
        if not isinstance(p, Tensor):
            raise NotATensorError(f"{who}: item {i} is {_brief(p)}, not a tensor; it takes {accepted}")
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
    return (a_start != 0 and b_start != 0 and a_start < _end(b, b_start) and b_start < _end(a, a_start)
            and a.device == b.device)


def _checked_pairs(items: Sequence, who: str) -> Sequence:
    """items, checked to be (param, grad) pairs whose grad is a gradient, never a weight: not the (name,
    parameter) pairs of model.named_parameters(), not (p, p), not two parameters side by side."""
    tracing = _ops.dynamo_is_tracing()  # fake tensors have no memory to compare
    for i, item in enumerate(items):
        if not isinstance(item, (tuple, list)):
            raise TypeError(f"{who}: item 0 is a (param, grad) pair but item {i} is {_brief(item)}; it takes "
                            f"{_CALL_FORMS}, not a mix")
        if len(item) != 2:
            raise TypeError(f"{who}: item {i} is a {type(item).__name__} of {len(item)} items, not a (param, grad) "
                            f"pair; it takes {_CALL_FORMS}")
        param, grad = item
        if isinstance(param, str):
            raise TypeError(f"{who}: item {i} is ({param!r}, {type(grad).__name__}), a (name, parameter) pair as "
                            f"model.named_parameters() yields, not a (param, grad) pair; it takes {_CALL_FORMS}")
        if not isinstance(param, Tensor):
            raise NotATensorError(f"{who}: item {i}'s param must be a Tensor, got {_brief(param)}")
        if grad is None:
            continue
        if not isinstance(grad, Tensor):
            raise TypeError(f"{who}: item {i}'s grad must be a Tensor or None, got {_brief(grad)}")
        # (type() first: Parameter's isinstance is a Python-level check, slow on every pair of a long list)
        weight = type(grad) is not Tensor and isinstance(grad, torch.nn.Parameter)
        if grad is param or weight or (not tracing and _shares_memory(param, grad)):
            reason = ("is the parameter itself" if grad is param else "is an nn.Parameter (a weight)" if weight else
                      "lies in the parameter's own memory")
            raise TypeError(f"{who}: item {i}'s grad {reason}, not a gradient: clipping it would write the "
                            f"weights; it takes {_CALL_FORMS}")
    return items


class ClipGradBase:
    """What every clip shares: choosing the gradients to clip and the two call forms.

    Norm-based clips take `nonfinite`, what a NaN or inf norm does: "propagate" (scale by it, as torch
    and Paddle do: the gradients become NaN or zero), "raise" (a RuntimeError, gradients unchanged) or
    "skip" (gradients unchanged; an optimizer hook then skips the step). `found_nonfinite` (a 0-d bool
    tensor) says whether the last call met one and `nonfinite_steps` (0-d int64) counts the calls that
    did, both on the gradients' device, for logging without a host sync.
    """

    _need_clip_predicate: Callable[[Tensor], bool] | None = None
    nonfinite: str = "propagate"
    found_nonfinite: Tensor | None = None
    nonfinite_steps: Tensor | None = None

    def _record(self, norms: Tensor) -> None:
        """Update found_nonfinite / nonfinite_steps from the last call's norm(s)."""
        if norms.dim() == 0 and norms.device.type == "cpu":
            return self._record_found_on_host(not math.isfinite(norms.item()))
        self._record_found(~torch.isfinite(norms).all())

    def _record_found(self, found: Tensor) -> None:
        self.found_nonfinite = found
        self.nonfinite_steps = add_to_count(self.nonfinite_steps, found)

    def _record_found_on_host(self, found: bool) -> None:
        """_record_found for a flag the host already has (a CPU clip): two new CPU tensors, no ops,
        which after a step's memory pass run with their code out of cache."""
        steps = self.nonfinite_steps
        if steps is not None and steps.device.type != "cpu":
            return self._record_found(torch.tensor(found, device=steps.device))
        self.found_nonfinite = torch.tensor(found)
        self.nonfinite_steps = torch.tensor((0 if steps is None else int(steps)) + found)

    def _step_refused(self) -> Tensor | None:
        """Whether the last call asks an optimizer hook to skip the step (a 0-d bool tensor), or None:
        a NaN/inf norm under nonfinite="skip"."""
        return self.found_nonfinite if self.nonfinite == "skip" else None

    def _wants(self, param) -> bool:
        if getattr(param, "need_clip", True) is False:  # the same test as the C++ walk's
            return False
        return self._need_clip_predicate is None or bool(self._need_clip_predicate(param))

    def __call__(self, params_grads):
        """clip(pairs) -> clipped pairs (grad None dropped); clip(parameters or a Module) -> None.

        The one route of every clip: the C++ walk over the parameters and their need_clip marks (a
        need_clip predicate is Python, so it takes the Python walk), else the general path under one
        no_grad()."""
        who = type(self).__name__
        items = _items_of(params_grads, who, _CALL_FORMS)
        pairs_form = bool(items) and isinstance(items[0], (tuple, list))
        if pairs_form:
            pairs = [(p, g) for p, g in _checked_pairs(items, who) if g is not None]
        else:
            # The C++ walk takes only tensors (it declines anything else), so the items are checked after it.
            if self._need_clip_predicate is None and not _ops.dynamo_is_tracing() and self._clip_parameters(items):
                return None
            pairs = [(p, p.grad) for p in _checked_parameters(items, who, _CALL_FORMS) if p.grad is not None]
        with torch.no_grad():
            self._clip_pairs([(p, g) for p, g in pairs if self._wants(p)])
        return pairs if pairs_form else None

    def _clip_pairs(self, pairs: list) -> None:
        """Clip the selected (param, grad) pairs; the parameters matter only to sharded clipping."""
        self._clip([g for _, g in pairs])

    def _clip_parameters(self, params: list) -> bool:
        """Clip the marked-for-clipping gradients of plain CPU or CUDA parameters in one C++ call;
        False when some parameter needs the general path."""
        raise NotImplementedError  # each subclass calls its op

    def _clip(self, grads: list[Tensor]) -> None:
        raise NotImplementedError  # each subclass defines its rule


class ClipGradByValue(ClipGradBase):
    """Clamp every gradient element to [min, max] (Paddle's paddle.nn.ClipGradByValue).

    min=None means min = -max, and then max must be > 0; min > max is an error. NaN stays NaN.
    """

    def __init__(self, max: float, min: float | None = None):
        upper = _number("max", max)
        if min is None:
            if not upper > 0:
                raise ValueError(f"ClipGradByValue: max must be > 0 when min is None, got max={max!r}")
            lower = -upper
        else:
            lower = _number("min", min)
            if lower > upper:
                raise ValueError(f"ClipGradByValue: min must be <= max, got min={min!r}, max={max!r}")
        if math.isnan(lower) or math.isnan(upper):
            raise ValueError(f"ClipGradByValue: bounds must not be NaN, got min={lower!r}, max={upper!r}")
        self.min, self.max = lower, upper

    def _clip_parameters(self, params):
        return _ops.clamp_grads_of_plain(params, self.min, self.max, honor_need_clip=True)

    def _clip(self, grads):
        if not grads:
            return
        if _ops.kernels_serve(grads):
            _ops.multi_tensor_clamp_(grads, self.min, self.max)
        else:
            for g in grads:
                if _sparse.is_sparse(g):
                    _sparse.clamp_(g, self.min, self.max)
                else:
                    g.clamp_(self.min, self.max)

    def __repr__(self):
        return f"{type(self).__name__}(min={self.min}, max={self.max})"


class ClipGradByNorm(ClipGradBase):
    """Clip each gradient by its own L2 norm (Paddle's paddle.nn.ClipGradByNorm).

    A gradient whose norm is <= clip_norm is unchanged; otherwise it is multiplied by clip_norm / norm.
    `last_norms` holds the last call's per-gradient norms (float64, before clipping) and
    `last_clip_coef` the factors they were scaled by, on the gradients' device.
    """

    def __init__(self, clip_norm: float, *, nonfinite: str = "propagate"):
        self.clip_norm = _positive_finite("clip_norm", clip_norm)
        self.nonfinite = _policy(nonfinite)
        self.last_norms: Tensor | None = None

    def _clip_parameters(self, params):
        norms = _ops.clip_by_tensor_norm_of_plain(params, self.clip_norm, honor_need_clip=True,
                                                  nonfinite=self.nonfinite)
        if norms is not None:
            self.last_norms = norms
            self._record(norms)
        return norms is not None

    def _clip(self, grads):
        if not grads:
            return
        if _ops.kernels_serve(grads):
            self.last_norms = _ops.clip_by_tensor_norm_(grads, self.clip_norm, self.nonfinite)
            self._record(self.last_norms)
            return
        norms = torch.stack([_norm(g).to(grads[0].device, torch.float64) for g in grads])
        finite = torch.isfinite(norms).all()
        if self.nonfinite == "raise" and not finite:  # raising needs the answer on the host
            raise RuntimeError("ClipGradByNorm: a gradient's norm is non-finite (NaN or inf), so it cannot be "
                               "clipped; no gradient was changed")
        keep = ~finite if self.nonfinite == "skip" else torch.zeros((), dtype=torch.bool, device=norms.device)
        for g, norm in zip(grads, norms):
            # As the kernel: unchanged only when norm <= clip_norm, so a NaN norm propagates.
            scale = torch.where((norm <= self.clip_norm) | keep, torch.ones_like(norm), self.clip_norm / norm)
            g.mul_(scale.to(g.device, g.dtype))
        self.last_norms = norms
        self._record(norms)

    @property
    def last_clip_coef(self) -> Tensor | None:
        """The last call's factor per gradient (float64): 1 where the norm is <= clip_norm (and for every
        gradient of a call that "skip" left unchanged), else clip_norm / norm. Computed on first read
        from last_norms, on their device: the clipping call itself pays nothing for it."""
        norms = self.last_norms
        if norms is None:
            return None
        unchanged = norms <= self.clip_norm
        if self.nonfinite == "skip":
            unchanged = unchanged | self.found_nonfinite.to(norms.device)
        return torch.where(unchanged, torch.ones_like(norms), self.clip_norm / norms)

    def __repr__(self):
        return f"{type(self).__name__}(clip_norm={self.clip_norm})"


class ClipGradByGlobalNorm(ClipGradBase):
    """Scale every gradient by clip_norm / max(global_norm, clip_norm) (paddle.nn.ClipGradByGlobalNorm).

    global_norm is the L2 norm of all clipped gradients together. With auto_skip_clip=True Paddle
    leaves the gradients untouched when global_norm <= clip_norm; the CPU kernel does so in every case
    (the scale is exactly 1 there and it skips the write pass), so the flag changes no result here.
    On an optimizer, one clip object computes one global norm over every parameter it serves; clips
    given by set_gradient_clip that share a group_name compute one global norm together and must
    share clip_norm (Paddle's rule).

    For logging without a host sync, on the gradients' device: `last_global_norm` (float32, float64
    for float64 gradients), `last_norms` (each gradient's norm, float64; None for sharded gradients,
    whose per-tensor norms would cost another collective) and `last_clip_coef` (the factor every
    gradient was scaled by, 0-d float64: 1 when nothing was clipped).
    """

    def __init__(self, clip_norm: float, group_name: str = "default_group", auto_skip_clip: bool = False, *,
                 nonfinite: str = "propagate", process_group=None):
        self.clip_norm = _positive_finite("clip_norm", clip_norm)
        self.nonfinite = _policy(nonfinite)
        # torchclip's addition: the gradients are this rank's shard of the group's (see
        # torchclip.distributed); every rank then clips by the same global norm.
        self.process_group = process_group
        if not isinstance(group_name, str):
            raise TypeError(f"group_name must be a str, got {group_name!r}")
        if not isinstance(auto_skip_clip, bool):
            raise TypeError(f"auto_skip_clip must be a bool, got {auto_skip_clip!r}")
        self.group_name = group_name
        self.auto_skip_clip = auto_skip_clip
        self.last_global_norm: Tensor | None = None
        self.last_norms: Tensor | None = None
        self.last_clip_coef: Tensor | None = None

    def _keep(self, global_norm: Tensor, norms: Tensor | None, coefficient: Tensor) -> None:
        self.last_global_norm, self.last_norms, self.last_clip_coef = global_norm, norms, coefficient

    def _clip_pairs(self, pairs) -> None:
        grads = [g for _, g in pairs]
        if self.process_group is not None:
            shards = _shards.hand_shards(grads, [p for p, _ in pairs], self.process_group)
        else:  # DTensor gradients (FSDP2): their local shards
            shards = _shards.dtensor_shards(grads)
            if shards is None:
                return super()._clip_pairs(pairs)
        global_norm = _shards.sharded_norm(shards, 2.0, self.nonfinite == "raise")
        self._record(global_norm)
        skip = self.nonfinite == "skip" and not torch.isfinite(global_norm)
        coefficient = torch.ones_like(global_norm) if skip else torch.clamp(self.clip_norm / global_norm, max=1.0)
        self._keep(global_norm.to(torch.float32), None, coefficient.to(torch.float64))
        if not skip:
            _shards.scale_shards(shards, coefficient)

    def _global_norm_of_parameters(self, params, nonfinite: str) -> tuple[Tensor, Tensor] | None:
        """(the global norm, each gradient's norm) of the marked gradients of plain CPU or CUDA parameters,
        read by the C++ walk and written nowhere (a fused optimizer step then applies the coefficient);
        None where the walk declines. max_norm = inf makes every coefficient exactly 1, and the kernels
        skip a scale by 1; nonfinite is "raise" or "skip" (a non-finite norm must not turn into a scale
        of NaN here)."""
        if self.process_group is not None:
            return None
        found = _ops.clip_grad_norm_of_plain(params, math.inf, 2.0, False, eps=0.0, norm_at_least_float32=True,
                                             honor_need_clip=True, nonfinite=nonfinite, keep_stats=True)
        return None if found is None else found[:2]

    def _clip_parameters(self, params):
        if self.process_group is not None:
            return False  # sharded clipping needs the (param, grad) pairs: the Python walk
        # Paddle's formula is torch's with eps = 0: min(clip_norm / global_norm, 1).
        found = _ops.clip_grad_norm_of_plain(params, self.clip_norm, 2.0, False, eps=0.0,
                                             norm_at_least_float32=True, honor_need_clip=True,
                                             nonfinite=self.nonfinite, keep_stats=True)
        if found is not None:
            self._keep(*found)
            self._record(found[0])
        return found is not None

    def _clip(self, grads):
        if not grads:
            return
        if _ops.kernels_serve(grads):
            self._keep(*_ops.clip_grad_norm_tensors_(grads, self.clip_norm, 2.0, False, eps=0.0,
                                                     norm_at_least_float32=True, nonfinite=self.nonfinite))
            self._record(self.last_global_norm)
            return
        wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        device = grads[0].device
        norms = [_norm(g).to(device, wide) for g in grads]
        global_norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        finite = torch.isfinite(global_norm)
        if self.nonfinite == "raise" and not finite:  # raising needs the answer on the host
            raise RuntimeError("ClipGradByGlobalNorm: the global norm is non-finite (NaN or inf), so it cannot be "
                               "clipped; no gradient was changed")
        scale = self.clip_norm / torch.clamp(global_norm, min=self.clip_norm)
        if self.nonfinite == "skip":
            scale = torch.where(finite, scale, torch.ones_like(scale))
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
        self._keep(global_norm, torch.stack(norms).to(torch.float64), scale.to(torch.float64))
        self._record(global_norm)

    def __repr__(self):
        return f"{type(self).__name__}(clip_norm={self.clip_norm}, group_name={self.group_name!r})"


# ---- the fluid-era names, with a need_clip predicate ------------------------------------------------


def _predicate(need_clip):
    if need_clip is not None and not callable(need_clip):
        raise TypeError(
            f"need_clip must be a function taking a parameter and returning True (clip it) or False, "
            f"got {need_clip!r}"
        )
    return need_clip


class GradientClipByValue(ClipGradByValue):
    """fluid.clip.GradientClipByValue: ClipGradByValue plus a need_clip(param) -> bool predicate."""

    def __init__(self, max: float, min: float | None = None, need_clip: Callable[[Tensor], bool] | None = None):
        super().__init__(max, min)
        self._need_clip_predicate = _predicate(need_clip)


class GradientClipByNorm(ClipGradByNorm):
    """fluid.clip.GradientClipByNorm: ClipGradByNorm plus a need_clip(param) -> bool predicate."""

    def __init__(self, clip_norm: float, need_clip: Callable[[Tensor], bool] | None = None):
        super().__init__(clip_norm)
        self._need_clip_predicate = _predicate(need_clip)


class GradientClipByGlobalNorm(ClipGradByGlobalNorm):
    """fluid.clip.GradientClipByGlobalNorm: ClipGradByGlobalNorm plus a need_clip predicate."""

    def __init__(self, clip_norm: float, group_name: str = "default_group",
                 need_clip: Callable[[Tensor], bool] | None = None):
        super().__init__(clip_norm, group_name)
        self._need_clip_predicate = _predicate(need_clip)


# ---- need_clip marks ----------------------------------------------------------------------------


def set_need_clip(target, need_clip: bool) -> int:
    """Mark parameters (a module's, an iterable's, or one) as clipped or not, as Paddle's
    ParamAttr(need_clip=...). Returns how many were marked."""
    if not isinstance(need_clip, bool):
        raise TypeError(f"need_clip must be a bool, got {need_clip!r}")
    params = _checked_parameters(_items_of(target, "set_need_clip: target", _PARAMETERS), "set_need_clip: target",
                                 _PARAMETERS)
    for p in params:
        p.need_clip = need_clip
    _marks_changed()
    return len(params)


_NORM_LAYERS = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm,
                torch.nn.LocalResponseNorm, torch.nn.RMSNorm)


def exclude_from_clipping(module: torch.nn.Module, *, biases: bool = True, norm_layers: bool = True) -> int:
    """Set need_clip = False on every bias and/or every parameter of a normalisation layer of
    `module` (a common choice for weight decay and clipping alike). Returns how many were marked."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    for name, flag in (("biases", biases), ("norm_layers", norm_layers)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r:.60}")
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


def set_gradient_clip(clip: ClipGradBase, param_list=None, program: torch.nn.Module | None = None) -> None:
    """Set a default clip for parameters (Paddle's fluid.clip.set_gradient_clip).

    param_list: parameters (an iterable, one tensor, or a Module's), or their names resolved in `program`
    (the nn.Module that owns them, since torch has no global program); None means all of `program`'s
    parameters, or, with no program, every parameter an optimizer hook meets. ClipGradByGlobalNorm clips
    set this way that share a group_name compute one global norm and must share clip_norm (Paddle's rule:
    a ValueError at the step otherwise). An optimizer's own grad_clip takes precedence, with a warning (Paddle's fourth
    example). clip=None clears the defaults set for those parameters.
    """
    global _default_clip
    if clip is not None and not isinstance(clip, ClipGradBase):
        raise TypeError(f"clip must be a ClipGradBase instance (e.g. ClipGradByGlobalNorm), got {clip!r}")
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
            raise ValueError(f"set_gradient_clip: no parameter named {unknown} in {type(program).__name__} "
                             f"(it has {sorted(named)[:8]}{'...' if len(named) > 8 else ''})")
        return [named[name] for name in items]
    kind = str if items and isinstance(items[0], str) else Tensor
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise TypeError(f"set_gradient_clip: param_list item {i} is {_brief(item)}; it takes {_PARAM_LIST}, "
                            f"not a mix")
    return items


def gradient_clip_of(param) -> ClipGradBase | None:
    """The clip set_gradient_clip gave `param` (or the global default), None if neither."""
    return getattr(param, "gradient_clip_attr", None) or _default_clip

