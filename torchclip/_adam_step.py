"""The one place torchclip runs torch.optim.Adam / AdamW's step itself: the fused CPU step of a clip
folded into it (torchclip.optim), by torchclip.adam_step_, which reads each gradient once and never
writes it, where torch's fused kernel writes every gradient back divided by grad_scale. That write is
~1.5 reads of the gradients on a 24 x 1M AdamW step (2 cores), more than the clip's own norm pass.

The step is torch's Adam.step with one call swapped: it leans on two of torch's optimizer internals,
Adam._init_group (the lazy state) and the functional torch.optim.adam.adam (what Adam.step runs for a
group, run here for any group the kernels decline), and checks their signatures once (`AVAILABLE`).
On a torch whose internals differ, or with TORCHCLIP_READ_ONLY_ADAM=0, torch's own step runs.
"""

from __future__ import annotations

import inspect
import os

import torch
from torch.optim import adam as _adam_module

from torchclip import _ops

_INIT_GROUP_PARAMETERS = [
    "self",
    "group",
    "params_with_grad",
    "grads",
    "exp_avgs",
    "exp_avg_sqs",
    "max_exp_avg_sqs",
    "state_steps",
]
_FUNCTIONAL_KEYWORDS = {
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "grad_scale",
    "found_inf",
    "has_complex",
    "decoupled_weight_decay",
    "amsgrad",
    "beta1",
    "beta2",
    "lr",
    "weight_decay",
    "eps",
    "maximize",
}


def _internals_match() -> bool:
    try:
        init_group = list(inspect.signature(torch.optim.Adam._init_group).parameters)
        functional = set(inspect.signature(_adam_module.adam).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return init_group == _INIT_GROUP_PARAMETERS and _FUNCTIONAL_KEYWORDS <= functional


AVAILABLE = os.environ.get("TORCHCLIP_READ_ONLY_ADAM", "1") != "0" and _internals_match()


def unhooked_step(optimizer_class):
    """optimizer_class.step without the step-hook wrapper torch puts on it (Optimizer._patch_step_function
    marks it `hooked`): the subclass's own step is wrapped too, and the hooks must run once."""
    step = optimizer_class.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def step(optimizer: torch.optim.Adam, closure=None):
    """Adam.step (AdamW's too: decoupled_weight_decay is in the group), with grad_scale / found_inf
    read from the optimizer as torch's does, where each fused group on the CPU is stepped by
    torchclip.adam_step_: the gradients after the step are as they were before it."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
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
            ours = group["fused"] and not group["differentiable"] and not has_complex and params[0].device.type == "cpu"
            if ours and _ops.adam_step_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                steps,
                beta1=beta1,
                beta2=beta2,
                decoupled_weight_decay=group["decoupled_weight_decay"],
                grad_scale=grad_scale,
                found_inf=found_inf,
                **hyperparameters,
            ):
                continue
            _adam_module.adam(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                steps,
                beta1=beta1,
                beta2=beta2,
                has_complex=has_complex,
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=grad_scale,
                found_inf=found_inf,
                decoupled_weight_decay=group["decoupled_weight_decay"],
                **hyperparameters,
            )
    return loss
