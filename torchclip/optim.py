"""Clipping as an optimizer hook: configure it once, on the optimizer, as Paddle users do.

    opt = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=ClipGradByGlobalNorm(1.0))
    opt = torchclip.optim.with_grad_clip(MyOptimizer)(params, ..., grad_clip=clip)   # any class
    handle = torchclip.optim.attach(existing_optimizer, clip)                        # any instance
    opt = torchclip.optim.AdamW(params, lr=1e-3, global_clipnorm=1.0)   # Keras 3's clipnorm=, clipvalue=, too

The clip runs when optimizer.step() is called, before the update, so it sees what the update will
use: with step(closure) it runs after the closure has made the gradients (LBFGS: after every
evaluation), and with torch.amp.GradScaler it sees unscaled gradients and a step GradScaler skips for
inf/NaN is not clipped. A clip built with nonfinite="skip" that meets a NaN/inf norm leaves the
gradients alone and the step is skipped (counted in the handle's skipped_steps; with a closure, its
first evaluation decides, and the step returns its loss); so is a step SkipStepOnSpike refuses. On a
fused optimizer the refusal is handed to the kernel as its found_inf instead of being read here.

Folded into fused steps: on torch's fused optimizers (Adam, AdamW, SGD, Adagrad with fused=True; those
whose step torch marks as reading grad_scale, _step_supports_amp_scaling, which torch 2.11's Adagrad lacks,
so there the clip runs in place), when one ClipGradByGlobalNorm serves every parameter, the hook computes
the global norm alone and hands 1 / the coefficient to the fused kernel as its grad_scale (multiplied by
GradScaler's scale, when the gradients are still scaled), and nonfinite="skip" as its found_inf: the
kernel divides each gradient as it reads it, so the clip costs one read of the gradients and no host
sync. torch's kernels write the clipped gradient back; torchclip.optim's Adam, AdamW, SGD and Adagrad on
the CPU step with torchclip's own fused kernels (torchclip/_read_only_step.py), which leave the
gradients as they were. With norm_in_backward=True even the norm is taken while backward runs
(torchclip/backward_norm.py). Other clips (per tensor, per element, excluded parameters) clip in place
first; under GradScaler they unscale the gradients first, as scaler.unscale_ would.

Which clip a parameter gets: its param group's 'grad_clip' (Paddle's per-group setting), else the
optimizer's grad_clip, else what set_gradient_clip gave it. Parameters sharing one clip object are
clipped together (one global norm over all of them, as Paddle's documentation describes the
optimizer's clip: "the gradients of all parameters set in optimizer"); different clip objects clip
separately, except ClipGradByGlobalNorm clips from set_gradient_clip, which are grouped by
group_name. Clips are not saved in state_dict() (a checkpoint holds tensors, and torch.load's
weights_only mode refuses arbitrary objects); load_state_dict() keeps the optimizer's clips.

A copy of the optimizer (copy.copy, copy.deepcopy, pickle, torch.save with torch.load(weights_only=False))
clips as the original does: it carries the clips, whose statistics continue bit for bit (a deepcopy of a
model with its optimizer clips the copied parameters), the skip count and a remove()d hook's removal.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import Tensor

from torchclip import _ops, _read_only_step
from torchclip._arguments import _positive_finite
from torchclip._messages import shown
from torchclip._plan import _GROUP_KEY, _check_clip, _clip_in_place, _Plan, _steps_fused
from torchclip.backward_norm import BackwardNorms
from torchclip.clip import ClipGradByGlobalNorm, ClipGradByNorm, ClipGradByValue
from torchclip.clip_base import ClipGradBase, add_to_count

__all__ = [
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "attach",
    "with_grad_clip",
]

# What a step reads from the instance: torch's fused steps read grad_scale and found_inf (the attributes
# GradScaler.step sets); torchclip's Adam / AdamW read the third (with_grad_clip).
_STEP_ATTRIBUTES = ("grad_scale", "found_inf", "_torchclip_read_only_step")


def _fused_step(optimizer, step, *, grad_scale, found_inf, read_only=False):
    """The one place a step is handed a grad_scale and found_inf: torch's fused optimizers take them only
    from the instance, so they are set for the call and then put back as they were (GradScaler deletes
    its own after the step). Going through the instance's step keeps its hooks and LR-scheduler wrappers.
    read_only: grad_scale is a folded clip's, so torchclip's Adam, AdamW, SGD and Adagrad may take their
    read-only step, which leaves the gradients unclipped."""
    saved = {name: optimizer.__dict__[name] for name in _STEP_ATTRIBUTES if name in optimizer.__dict__}
    optimizer.grad_scale, optimizer.found_inf, optimizer._torchclip_read_only_step = grad_scale, found_inf, read_only
    try:
        return step()
    finally:
        for name in _STEP_ATTRIBUTES:
            if name in saved:
                setattr(optimizer, name, saved[name])
            else:
                delattr(optimizer, name)


class _ClosureEvaluatedFirst:
    """The closure of step(closure) under a clip. The closure makes the gradients, so the clip comes after
    it and before the update (Lightning always steps this way): its first evaluation runs when this is
    made, so that a "skip" clip can still refuse the step, and the step gets that evaluation back when it
    calls the closure. A later evaluation (LBFGS re-evaluates) is clipped as it comes, by `clip_again`
    (too late to skip: the step is under way)."""

    def __init__(self, closure, clip_again):
        self._closure, self._clip_again = closure, clip_again
        with torch.enable_grad():  # as torch's optimizers call a closure
            self.loss = closure()
        self._evaluations = 0

    def __call__(self):
        self._evaluations += 1
        if self._evaluations == 1:
            return self.loss
        loss = self._closure()
        self._clip_again()
        return loss


class _Attachment:
    """What attach() installs: a wrapper around the instance's step (clip first, or fold the clip into a
    fused step; skip the step when a "skip" clip met a non-finite norm) and the state_dict hooks.
    With enabled = False the wrapper passes through; remove() does that for good (it is not unwrapped: an
    LR scheduler or GradScaler may have wrapped it since).

    Copies: torch's Optimizer.__getstate__ keeps only defaults, state and param_groups, never what was set
    on the instance (the wrapped step, the hooks), so attach() gives the instance a __reduce_ex__ that
    rebuilds a copy with each attachment installed again on it (_rebuild_attached)."""

    # What a copy's attachment starts from; the wrapped step, the hooks and the plan are its optimizer's own.
    _COPIED = ("clip", "_skipped_on_host", "_skipped_on_device", "enabled", "_removed", "_norm_in_backward")

    def __init__(self, optimizer, clip, norm_in_backward=False):
        self.clip = clip
        self._skipped_on_host = 0
        self._skipped_on_device: Tensor | None = None  # folded steps' skips, never read during a step
        self.enabled = True
        self._removed = False
        self._norm_in_backward = norm_in_backward
        self._install(optimizer)

    def _install(self, optimizer) -> None:
        """Wrap the instance's step, register the state_dict hooks (unless removed) and list the attachment
        where _reduce_attached finds it."""
        self._plan: _Plan | None = None
        original_step = optimizer.step
        attachment = self

        @functools.wraps(original_step)
        def step(optimizer, *args, **kwargs):
            return attachment._step(optimizer, original_step, args, kwargs)

        # A bound method, as torch's LR schedulers expect (they re-wrap optimizer.step.__func__).
        optimizer.step = types.MethodType(step, optimizer)
        self._handles = (
            []
            if self._removed
            else [
                optimizer.register_state_dict_post_hook(_drop_clips_from_state),
                optimizer.register_load_state_dict_pre_hook(_remember_clips),
                optimizer.register_load_state_dict_post_hook(_restore_clips),
            ]
        )
        exact = _ops.exact_norms(getattr(self.clip, "exact", None))
        self.backward_norms = BackwardNorms(optimizer, exact) if self._norm_in_backward and not self._removed else None
        optimizer.__dict__.setdefault("_torchclip_attachments", []).append(self)
        optimizer.__reduce_ex__ = types.MethodType(_reduce_attached, optimizer)  # (copy and pickle read the instance's)

    def _step(self, optimizer, original_step, args, kwargs):
        """optimizer.step(*args, **kwargs) with the clip."""
        if not self.enabled:
            return original_step(*args, **kwargs)
        closure = args[0] if args else kwargs.get("closure")
        if closure is None:
            return self._clip_and_step(optimizer, lambda: original_step(*args, **kwargs), None)
        evaluated = _ClosureEvaluatedFirst(closure, lambda: _clip_in_place(optimizer, self.plan_for(optimizer)))
        if args:
            call = functools.partial(original_step, evaluated, *args[1:], **kwargs)
        else:
            call = functools.partial(original_step, **{**kwargs, "closure": evaluated})
        return self._clip_and_step(optimizer, call, evaluated.loss)

    @property
    def skipped_steps(self) -> int:
        """Steps a clip refused (a non-finite norm under nonfinite="skip", a SkipStepOnSpike spike);
        reading it waits for fused steps' flags."""
        pending = 0 if self._skipped_on_device is None else int(self._skipped_on_device)
        return self._skipped_on_host + pending

    def plan_for(self, optimizer) -> _Plan:
        if self._plan is None or not self._plan.serves(optimizer, self.clip):
            self._plan = _Plan(optimizer, self.clip)
        return self._plan

    def _clip_and_step(self, optimizer, step, skipped_result):
        """Clip and step, one of three ways; `skipped_result` when the step is skipped:
        - folded (plan.folded: one ClipGradByGlobalNorm over a fused step): only the norm is taken here,
          and the coefficient goes to the kernel as its grad_scale;
        - on a fused step otherwise: clip in place, and a clip's refusal goes to the kernel as found_inf,
          never read here;
        - on any other step: clip in place, and a refusal, read here, skips the step."""
        plan = self.plan_for(optimizer)
        if plan.folded is not None:
            folding = plan.folded.fold_into_fused_step(
                plan.entries[0][1],
                getattr(optimizer, "grad_scale", None),
                getattr(optimizer, "found_inf", None),
                taken=self.backward_norms,
            )
            if folding is not None:
                refused = plan.folded.step_refused()
                if refused is not None:
                    self._count_skips_on_device(refused)
                grad_scale, found_inf = folding
                return _fused_step(optimizer, step, grad_scale=grad_scale, found_inf=found_inf, read_only=True)
        if self.backward_norms is not None:
            self.backward_norms.discard()  # (the clips below read the gradients themselves)
        if _steps_fused(optimizer):
            refusal = _clip_in_place(optimizer, plan, on_device=True)
            if refusal is None:
                return step()
            self._count_skips_on_device(refusal)
            scaler_found = getattr(optimizer, "found_inf", None)
            skip = refusal.to(torch.float32)
            found_inf = skip if scaler_found is None else torch.maximum(scaler_found, skip.to(scaler_found.device))
            return _fused_step(optimizer, step, grad_scale=getattr(optimizer, "grad_scale", None), found_inf=found_inf)
        if not _clip_in_place(optimizer, plan):
            self._skipped_on_host += 1
            return skipped_result
        return step()

    def _count_skips_on_device(self, found: Tensor) -> None:
        self._skipped_on_device = add_to_count(self._skipped_on_device, found)

    def remove(self):
        self.enabled = False
        self._removed = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.backward_norms is not None:
            self.backward_norms.remove()
            self.backward_norms = None


def _reduce_attached(optimizer, protocol):
    """copy.copy, copy.deepcopy, pickle and torch.save of an optimizer attach() hooked: the class's state,
    then its attachments' (a with_grad_clip class goes by its base: pickle may not find it by name)."""
    optimizer_class = type(optimizer)
    base = vars(optimizer_class).get("_torchclip_base")
    # The parameters go first, so a clip's per-parameter state copied later finds their copies in the memo.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    attachments = [{name: vars(a)[name] for name in _Attachment._COPIED} for a in optimizer._torchclip_attachments]
    return _rebuild_attached, (base or optimizer_class, base is not None, params, optimizer.__getstate__(), attachments)


def _rebuild_attached(optimizer_class, by_with_grad_clip, params, state, attachments):
    """A copy of an attached optimizer: the class's own __setstate__, then each attachment installed anew
    (`params` only ordered the copy)."""
    optimizer_class = with_grad_clip(optimizer_class) if by_with_grad_clip else optimizer_class
    optimizer = optimizer_class.__new__(optimizer_class)
    optimizer.__setstate__(state)
    for saved in attachments:
        attachment = _Attachment.__new__(_Attachment)
        attachment.__dict__.update(saved)
        attachment._install(optimizer)
    return optimizer


def _drop_clips_from_state(optimizer, state_dict):
    for group in state_dict["param_groups"]:
        group.pop(_GROUP_KEY, None)
    return state_dict


def _remember_clips(optimizer, state_dict):
    optimizer._torchclip_group_clips = [group.get(_GROUP_KEY) for group in optimizer.param_groups]
    return state_dict


def _restore_clips(optimizer):
    for group, clip in zip(optimizer.param_groups, getattr(optimizer, "_torchclip_group_clips", [])):
        if clip is not None:
            group[_GROUP_KEY] = clip


def attach(
    optimizer: torch.optim.Optimizer, grad_clip: ClipGradBase | None = None, *, norm_in_backward: bool = False
) -> _Attachment:
    """Clip gradients before every `optimizer.step()` of an optimizer that already exists.

    Paddle configures clipping on the optimizer; this adds it to any torch optimizer instance. The clip
    runs inside step(): after a closure made the gradients, on unscaled gradients under GradScaler, and
    folded into the kernel of torch's fused steps where one ClipGradByGlobalNorm serves every parameter.

    Args:
        optimizer: the optimizer.
        grad_clip: the optimizer-wide clip; param groups may carry their own under 'grad_clip'; with
            neither, set_gradient_clip's defaults apply.
        norm_in_backward: measure each gradient for a folded clip's norm while backward runs, as soon as
            it is final (torchclip.backward_norm), so that the step only combines the measurements.

    Returns:
        A handle: `remove()` detaches it, `enabled = False` pauses it, `skipped_steps` counts the steps a
        clip refused (a NaN or inf norm under nonfinite="skip", a SkipStepOnSpike spike);
        `backward_norms` (with norm_in_backward) has `no_sync()` and what the last step took from backward.

    Raises:
        TypeError: grad_clip is not a clip, or norm_in_backward not a bool.

    Example:
        >>> handle = torchclip.optim.attach(optimizer, torchclip.ClipGradByGlobalNorm(1.0))
        >>> handle.remove()
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_clip(grad_clip, "grad_clip")
    for i, group in enumerate(optimizer.param_groups):
        _check_clip(group.get(_GROUP_KEY), f"param_groups[{i}]['grad_clip']")
    if not isinstance(norm_in_backward, bool):
        raise TypeError(f"norm_in_backward must be True or False, got {shown(norm_in_backward)}")
    return _Attachment(optimizer, grad_clip, norm_in_backward)


def _keras_clip(grad_clip, **keras) -> ClipGradBase | None:
    """The clip for Keras 3's optimizer arguments: clipnorm (each gradient by its own norm:
    g * c / max(||g||, c)), clipvalue (each element into [-c, c]) or global_clipnorm (all gradients by
    their global norm: g * c / max(global_norm, c)); at most one of them, and not with grad_clip."""
    given = {name: value for name, value in keras.items() if value is not None}
    if len(given) > 1:
        raise ValueError(
            "Only one of clipnorm, clipvalue and global_clipnorm can be set (as in Keras), got "
            + ", ".join(f"{name}={shown(value)}" for name, value in given.items())
        )
    if not given:
        return grad_clip
    ((name, value),) = given.items()
    if grad_clip is not None:
        raise ValueError(
            f"grad_clip and {name} both set (grad_clip={shown(grad_clip)}, {name}={shown(value)}): give one of them"
        )
    limit = _positive_finite(name, value)
    if name == "clipnorm":
        return ClipGradByNorm(limit)
    if name == "clipvalue":
        return ClipGradByValue(limit)
    return ClipGradByGlobalNorm(limit)


@functools.cache
def with_grad_clip(optimizer_class: type) -> type:
    """A subclass of `optimizer_class` whose constructor takes `grad_clip=` (Paddle) or Keras 3's
    `clipnorm=`, `clipvalue=`, `global_clipnorm=`, and `norm_in_backward=` (attach's).

    Args:
        optimizer_class: any torch.optim.Optimizer subclass.

    Returns:
        The subclass, of the same name; its instances have `grad_clip` and `grad_clip_attachment`.

    Example:
        >>> ClippedLion = torchclip.optim.with_grad_clip(Lion)
        >>> optimizer = ClippedLion(model.parameters(), lr=1e-4, global_clipnorm=1.0)
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {shown(optimizer_class)}")

    def __init__(
        self,
        params,
        *args,
        grad_clip: ClipGradBase | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        norm_in_backward: bool = False,
        **kwargs,
    ):
        grad_clip = _keras_clip(grad_clip, clipnorm=clipnorm, clipvalue=clipvalue, global_clipnorm=global_clipnorm)
        optimizer_class.__init__(self, params, *args, **kwargs)
        attach(self, grad_clip, norm_in_backward=norm_in_backward)

    def add_param_group(self, param_group):
        _check_clip(param_group.get(_GROUP_KEY), "param_group['grad_clip']")
        optimizer_class.add_param_group(self, param_group)

    members = {
        "__init__": __init__,
        "add_param_group": add_param_group,
        "__module__": __name__,
        "__doc__": f"{optimizer_class.__name__} with grad_clip= (see torchclip.optim).",
        "_torchclip_base": optimizer_class,
        # The attachment __init__ made: the first (a copy installs its attachments again, in order).
        "grad_clip_attachment": property(lambda self: self._torchclip_attachments[0]),
        "grad_clip": property(lambda self: self.grad_clip_attachment.clip),
    }
    read_only_step = _read_only_step.STEPS.get(optimizer_class)
    if read_only_step is not None:
        torch_step = _read_only_step.unhooked_step(optimizer_class)

        def step(self, closure=None):
            if self.__dict__.get("_torchclip_read_only_step"):
                return read_only_step(self, closure)
            return torch_step(self, closure)

        members["step"] = functools.wraps(torch_step)(step)
    return type(optimizer_class.__name__, (optimizer_class,), members)


SGD = with_grad_clip(torch.optim.SGD)
"""`torch.optim.SGD` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
Adam = with_grad_clip(torch.optim.Adam)
"""`torch.optim.Adam` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
AdamW = with_grad_clip(torch.optim.AdamW)
"""`torch.optim.AdamW` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
RMSprop = with_grad_clip(torch.optim.RMSprop)
"""`torch.optim.RMSprop` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
Adagrad = with_grad_clip(torch.optim.Adagrad)
"""`torch.optim.Adagrad` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
Adamax = with_grad_clip(torch.optim.Adamax)
"""`torch.optim.Adamax` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
NAdam = with_grad_clip(torch.optim.NAdam)
"""`torch.optim.NAdam` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
RAdam = with_grad_clip(torch.optim.RAdam)
"""`torch.optim.RAdam` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
Adadelta = with_grad_clip(torch.optim.Adadelta)
"""`torch.optim.Adadelta` taking `grad_clip=` (or Keras' `clipnorm=`, `clipvalue=`, `global_clipnorm=`)."""
