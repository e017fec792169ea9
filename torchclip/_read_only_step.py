"""The one place torchclip runs torch.optim's fused steps itself: Adam, AdamW, SGD and Adagrad with a clip
folded into them (torchclip.optim) step through torchclip's ops (adam_step_, sgd_step_, adagrad_step_; on
CUDA adam_step_ and sgd_step_), which read each gradient once and never write it, where torch's fused kernels
write every gradient back divided by grad_scale. That write is ~1.5 reads of the gradients on a 24 x 1M AdamW
step (2 cores), more than the clip's own norm pass.

Each step is torch's <Optimizer>.step with one call swapped: it leans on two of torch's optimizer internals
per class, <Optimizer>._init_group (the lazy state) and the functional torch.optim.<module>.<name> (what the
step runs for a group, run here for any group the kernels decline), and checks their signatures once
(`STEPS` holds the classes whose internals match). On a torch whose internals differ, or with
TORCHCLIP_READ_ONLY_STEP=0 (TORCHCLIP_READ_ONLY_ADAM=0: Adam and AdamW only), torch's own step runs.
"""

from __future__ import annotations

import inspect
import os

import torch
from torch.optim import adagrad as _adagrad_module
from torch.optim import adam as _adam_module
from torch.optim import sgd as _sgd_module

from torchclip import _ops


def _internals_match(optimizer_class, init_group_parameters, functional, functional_keywords) -> bool:
    try:
        init_group = list(inspect.signature(optimizer_class._init_group).parameters)
        keywords = set(inspect.signature(functional).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return init_group == init_group_parameters and set(functional_keywords) <= keywords


def unhooked_step(optimizer_class):
    """optimizer_class.step without the step-hook wrapper torch puts on it (Optimizer._patch_step_function
    marks it `hooked`): the subclass's own step is wrapped too, and the hooks must run once."""
    step = optimizer_class.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _group_on_kernels(group, params, devices=("cpu", "cuda")) -> bool:
    """Whether torchclip's kernels may take a group's step: fused, plain tensors (an FSDP2 DTensor takes
    torch's step) on one of `devices` (the step's op has a kernel there), a float learning rate (a tensor lr
    takes torch's tensor_lr kernels)."""
    return (
        bool(params)
        and group["fused"]
        and not group.get("differentiable", False)
        and params[0].device.type in devices
        and all(type(p) in (torch.Tensor, torch.nn.Parameter) for p in params)
        and not isinstance(group["lr"], torch.Tensor)
    )


def _closure_loss(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def adam_step(optimizer: torch.optim.Adam, closure=None):
    """Adam.step (AdamW's too: decoupled_weight_decay is in the group), with grad_scale / found_inf
    read from the optimizer as torch's does, where each fused CPU or CUDA group is stepped by
    torchclip.adam_step_: the gradients after the step are as they were before it."""
    loss = _closure_loss(closure)
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    with torch.no_grad():
        for group in optimizer.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = optimizer._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if not params:
                continue
            beta1, beta2 = (float(beta) for beta in group["betas"])
            hyperparameters = {
                "lr": group["lr"],
                "weight_decay": group["weight_decay"],
                "eps": group["eps"],
                "amsgrad": group["amsgrad"],
                "maximize": group["maximize"],
            }
            lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            scaling = {"grad_scale": grad_scale, "found_inf": found_inf}
            decoupled = {"decoupled_weight_decay": group["decoupled_weight_decay"], "beta1": beta1, "beta2": beta2}
            on_kernels = _group_on_kernels(group, params) and not has_complex
            if on_kernels and _ops.adam_step_(*lists, **decoupled, **scaling, **hyperparameters):
                continue
            _adam_module.adam(
                *lists,
                has_complex=has_complex,
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                **decoupled,
                **scaling,
                **hyperparameters,
            )
    return loss


def sgd_step(optimizer: torch.optim.SGD, closure=None):
    """SGD.step, where each fused CPU or CUDA group is stepped by torchclip.sgd_step_ (as adam_step)."""
    loss = _closure_loss(closure)
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    with torch.no_grad():
        for group in optimizer.param_groups:
            params, grads, buffers = [], [], []
            has_sparse_grad = optimizer._init_group(group, params, grads, buffers)
            if not params:
                continue
            momentum = group["momentum"]
            hyperparameters = {
                "lr": group["lr"],
                "weight_decay": group["weight_decay"],
                "momentum": momentum,
                "dampening": group["dampening"],
                "nesterov": group["nesterov"],
                "maximize": group["maximize"],
            }
            scaling = {"grad_scale": grad_scale, "found_inf": found_inf}
            first_step = momentum != 0 and all(buffer is None for buffer in buffers)
            stepped = False
            buffers_ready = first_step or all(buffer is not None for buffer in buffers)  # (torch's first step: all)
            if _group_on_kernels(group, params) and not has_sparse_grad and buffers_ready:
                # Zeros, not torch's empty_like: a first step found_inf skips leaves defined buffers behind.
                ours = [torch.zeros_like(g) for g in grads] if first_step else buffers
                stepped = _ops.sgd_step_(params, grads, ours, is_first_step=first_step, **scaling, **hyperparameters)
                if stepped:
                    buffers = ours
            if not stepped:
                _sgd_module.sgd(
                    params,
                    grads,
                    buffers,
                    has_sparse_grad=has_sparse_grad,
                    foreach=group["foreach"],
                    fused=group["fused"],
                    **scaling,
                    **hyperparameters,
                )
            if momentum != 0:  # as SGD.step keeps the buffers the functional step made
                for p, buffer in zip(params, buffers):
                    optimizer.state[p]["momentum_buffer"] = buffer
    return loss


def adagrad_step(optimizer: torch.optim.Adagrad, closure=None):
    """Adagrad.step, where each fused group on the CPU is stepped by torchclip.adagrad_step_ (as adam_step)."""
    loss = _closure_loss(closure)
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    with torch.no_grad():
        for group in optimizer.param_groups:
            params, grads, state_sums, state_steps = [], [], [], []
            has_sparse_grad, has_complex = optimizer._init_group(group, params, grads, state_sums, state_steps)
            if not params:
                continue
            hyperparameters = {
                "lr": group["lr"],
                "weight_decay": group["weight_decay"],
                "lr_decay": group["lr_decay"],
                "eps": group["eps"],
                "maximize": group["maximize"],
            }
            lists = (params, grads, state_sums, state_steps)
            scaling = {"grad_scale": grad_scale, "found_inf": found_inf}
            # (adagrad_step_ is the CPU's alone: a CUDA group takes torch's step)
            on_kernels = _group_on_kernels(group, params, ("cpu",)) and not (has_sparse_grad or has_complex)
            if on_kernels and _ops.adagrad_step_(*lists, **scaling, **hyperparameters):
                continue
            _adagrad_module.adagrad(
                *lists,
                has_sparse_grad=has_sparse_grad,
                foreach=group["foreach"],
                differentiable=group["differentiable"],
                has_complex=has_complex,
                fused=group["fused"],
                **scaling,
                **hyperparameters,
            )
    return loss


_SCALING = ("grad_scale", "found_inf", "foreach", "fused")
_CANDIDATES = {
    torch.optim.Adam: (
        ["self", "group", "params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"],
        _adam_module.adam,
        (*_SCALING, "capturable", "differentiable", "has_complex", "decoupled_weight_decay", "amsgrad", "beta1"),
        adam_step,
    ),
    torch.optim.SGD: (
        ["self", "group", "params", "grads", "momentum_buffer_list"],
        _sgd_module.sgd,
        (*_SCALING, "has_sparse_grad", "weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize"),
        sgd_step,
    ),
    torch.optim.Adagrad: (
        ["self", "group", "params_with_grad", "grads", "state_sums", "state_steps"],
        _adagrad_module.adagrad,
        (*_SCALING, "has_sparse_grad", "differentiable", "has_complex", "lr_decay", "eps", "maximize"),
        adagrad_step,
    ),
}
_CANDIDATES[torch.optim.AdamW] = _CANDIDATES[torch.optim.Adam]  # AdamW's step is Adam's (decoupled_weight_decay)


def _switched_on(optimizer_class) -> bool:
    if os.environ.get("TORCHCLIP_READ_ONLY_STEP", "1") == "0":
        return False
    adam = optimizer_class in (torch.optim.Adam, torch.optim.AdamW)
    return not (adam and os.environ.get("TORCHCLIP_READ_ONLY_ADAM", "1") == "0")


# The classes whose fused step torchclip takes under a folded clip, and that step.
STEPS = {
    optimizer_class: step
    for optimizer_class, (init_group, functional, keywords, step) in _CANDIDATES.items()
    if _switched_on(optimizer_class) and _internals_match(optimizer_class, init_group, functional, keywords)
}
