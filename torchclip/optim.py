"""Clipping as an optimizer hook: configure it once, on the optimizer, as Paddle users do.

    opt = torchclip.optim.SGD(model.parameters(), lr=0.1, grad_clip=ClipGradByGlobalNorm(1.0))
    opt = torchclip.optim.with_grad_clip(MyOptimizer)(params, ..., grad_clip=clip)   # any class
    handle = torchclip.optim.attach(existing_optimizer, clip)                        # any instance

The clip runs when optimizer.step() is called, before the update, so it sees what the update will
use: with step(closure) it runs after the closure has made the gradients (LBFGS: after every
evaluation), and with torch.amp.GradScaler the gradients are already unscaled there (GradScaler.step
unscales first) and a step GradScaler skips for inf/NaN is not clipped either. A clip built with
nonfinite="skip" that meets a NaN/inf norm leaves the gradients alone and the step is skipped
(counted in the handle's skipped_steps; with a closure, its first evaluation decides, and the step
returns its loss). (Fused optimizers that unscale inside their own kernel, fused=True, need
scaler.unscale_(optimizer) before scaler.step for the clip to see unscaled values.)

Which clip a parameter gets: its param group's 'grad_clip' (Paddle's per-group setting), else the
optimizer's grad_clip, else what set_gradient_clip gave it. Parameters sharing one clip object are
clipped together (one global norm over all of them, as Paddle's documentation describes the
optimizer's clip: "the gradients of all parameters set in optimizer"); different clip objects clip
separately, except ClipGradByGlobalNorm clips from set_gradient_clip, which are grouped by
group_name. Clips are not saved in state_dict() (a checkpoint holds tensors, and torch.load's
weights_only mode refuses arbitrary objects); load_state_dict() keeps the optimizer's clips.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch

from torchclip.clip import ClipGradBase, ClipGradByGlobalNorm, gradient_clip_of

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

_GROUP_KEY = "grad_clip"


def _check_clip(clip, where: str):
    if clip is not None and not isinstance(clip, ClipGradBase):
        raise TypeError(f"{where} must be a torchclip clip (ClipGradByValue, ClipGradByNorm, ClipGradByGlobalNorm, "
                        f"or a legacy GradientClipBy*), got {clip!r}")


def _warn_both_set():
    warnings.warn(
        "set_gradient_clip is ignored for parameters whose optimizer has its own grad_clip: the "
        "optimizer's grad_clip takes precedence (as in Paddle)",
        UserWarning,
        stacklevel=4,
    )


def _clip_plan(optimizer: torch.optim.Optimizer, default: ClipGradBase | None):
    """[(clip, params)] for this step: each clip once, with every parameter it serves."""
    by_clip: dict[int, tuple[ClipGradBase, list]] = {}
    by_group_name: dict[str, tuple[ClipGradByGlobalNorm, list]] = {}
    warned = False
    for group in optimizer.param_groups:
        own = group.get(_GROUP_KEY) or default
        for p in group["params"]:
            if p.grad is None:
                continue
            clip = own
            fallback = gradient_clip_of(p)
            if clip is None:
                clip = fallback
                if isinstance(clip, ClipGradByGlobalNorm):
                    entry = by_group_name.setdefault(clip.group_name, (clip, []))
                    if entry[0].clip_norm != clip.clip_norm:
                        raise ValueError("All parameters' 'clip_norm' of a same group should be the same: group "
                                         f"{clip.group_name!r} has {entry[0].clip_norm} and {clip.clip_norm}")
                    entry[1].append(p)
                    continue
            elif fallback is not None and not warned:
                _warn_both_set()
                warned = True
            if clip is not None:
                by_clip.setdefault(id(clip), (clip, []))[1].append(p)
    return list(by_clip.values()) + list(by_group_name.values())


def _clip_before_step(optimizer, default) -> bool:
    """Clip every gradient the plan covers; False when a clip with nonfinite="skip" met a NaN/inf
    norm, so the step must not run."""
    proceed = True
    for clip, params in _clip_plan(optimizer, default):
        clip(params)
        if clip.nonfinite == "skip" and clip.found_nonfinite is not None:
            proceed &= not bool(clip.found_nonfinite)  # one flag read: a sync on accelerators
    return proceed


class _Attachment:
    """What attach() installs: a wrapper around the instance's step (clip first; skip the step when a
    "skip" clip met a non-finite norm) and the state_dict hooks. remove() makes the wrapper pass
    through (it is not unwrapped: an LR scheduler or GradScaler may have wrapped it since)."""

    def __init__(self, optimizer, clip):
        self.clip = clip
        self.skipped_steps = 0  # steps not taken because of a non-finite norm
        self._active = True
        original_step = optimizer.step
        attachment = self

        @functools.wraps(original_step)
        def step(optimizer, *args, **kwargs):
            if not attachment._active:
                return original_step(*args, **kwargs)
            closure = args[0] if args else kwargs.get("closure")
            if closure is None:
                if not _clip_before_step(optimizer, attachment.clip):
                    attachment.skipped_steps += 1
                    return None
                return original_step(*args, **kwargs)
            # step(closure): the closure makes the gradients, so the clip must come after it and before
            # the update (Lightning always steps this way). Its first evaluation runs here, so that a
            # "skip" clip can still refuse the step; the step then gets that evaluation back, and any
            # later one (LBFGS re-evaluates) is clipped as it comes.
            with torch.enable_grad():  # as torch's optimizers call a closure
                loss = closure()
            if not _clip_before_step(optimizer, attachment.clip):
                attachment.skipped_steps += 1
                return loss
            evaluations = 0

            def clipped_closure():
                nonlocal evaluations
                evaluations += 1
                if evaluations == 1:
                    return loss
                again = closure()
                _clip_before_step(optimizer, attachment.clip)  # (too late to skip: the step is under way)
                return again

            if args:
                return original_step(clipped_closure, *args[1:], **kwargs)
            return original_step(**{**kwargs, "closure": clipped_closure})

        # A bound method, as torch's LR schedulers expect (they re-wrap optimizer.step.__func__).
        optimizer.step = types.MethodType(step, optimizer)
        self._handles = [
            optimizer.register_state_dict_post_hook(_drop_clips_from_state),
            optimizer.register_load_state_dict_pre_hook(_remember_clips),
            optimizer.register_load_state_dict_post_hook(_restore_clips),
        ]

    def remove(self):
        self._active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []


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


def attach(optimizer: torch.optim.Optimizer, grad_clip: ClipGradBase | None = None) -> _Attachment:
    """Clip gradients before every optimizer.step(); returns a handle whose remove() detaches it.

    grad_clip is the optimizer-wide clip; param groups may carry their own under 'grad_clip'; with
    neither, set_gradient_clip's defaults apply.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_clip(grad_clip, "grad_clip")
    for i, group in enumerate(optimizer.param_groups):
        _check_clip(group.get(_GROUP_KEY), f"param_groups[{i}]['grad_clip']")
    return _Attachment(optimizer, grad_clip)


@functools.cache
def with_grad_clip(optimizer_class: type) -> type:
    """A subclass of `optimizer_class` whose constructor takes Paddle's grad_clip= keyword."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}")

    def __init__(self, params, *args, grad_clip: ClipGradBase | None = None, **kwargs):
        optimizer_class.__init__(self, params, *args, **kwargs)
        self.grad_clip_attachment = attach(self, grad_clip)

    def add_param_group(self, param_group):
        _check_clip(param_group.get(_GROUP_KEY), "param_group['grad_clip']")
        optimizer_class.add_param_group(self, param_group)

    return type(optimizer_class.__name__, (optimizer_class,), {
        "__init__": __init__,
        "add_param_group": add_param_group,
        "__module__": __name__,
        "__doc__": f"{optimizer_class.__name__} with grad_clip= (see torchclip.optim).",
        "grad_clip": property(lambda self: self.grad_clip_attachment.clip),
    })


SGD = with_grad_clip(torch.optim.SGD)
Adam = with_grad_clip(torch.optim.Adam)
AdamW = with_grad_clip(torch.optim.AdamW)
RMSprop = with_grad_clip(torch.optim.RMSprop)
Adagrad = with_grad_clip(torch.optim.Adagrad)
Adamax = with_grad_clip(torch.optim.Adamax)
NAdam = with_grad_clip(torch.optim.NAdam)
RAdam = with_grad_clip(torch.optim.RAdam)
Adadelta = with_grad_clip(torch.optim.Adadelta)
