"""What each clip row of torchclip-bench times: torch's call (foreach and not), torchclip's, and the
memory bound, over one workload's gradients (`candidates_for`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import torchclip
from torchclip.bench.timing import Grads

OPS = [
    "clip_grad_norm_ (no clip)",
    "clip_grad_norm_ (clip)",
    "get_total_norm",
    "clip_grad_value_",
    "ClipGradByGlobalNorm (clip)",
    "ClipGradByNorm",
    "ClipGradByValue",
]
NORM_OPS = [op for op in OPS if "Value" not in op and "value" not in op]  # the rows that take a norm


@dataclass
class Candidates:
    """What one row times: torch (default foreach), torch with foreach=False where torch has the
    switch, torchclip, and the bound; `passes` is how many times the op moves the bytes; prepare()
    runs untimed before every call."""

    torch: object
    torch_no_foreach: object
    torchclip: object
    bound: object
    passes: int
    prepare: object = None


class ClipTarget:
    """max_norm for "clip" rows: 0.9 x the gradients' current norm, measured untimed before every
    call, so every call of every candidate scales (by ~0.9: a change float16 and bfloat16 keep),
    whatever the previous candidate left, and 100 calls shrink the values by only 1e-5."""

    def __init__(self, grads):
        self.grads = grads
        self.max_norm = 1.0

    def prepare(self):
        self.max_norm = 0.9 * float(torchclip.get_total_norm(self.grads).double())

    def __call__(self):
        return self.max_norm


def candidates_for(op, g: Grads, as_generators=False) -> Candidates:
    bound_buffer = g.bound_buffer
    if as_generators:  # a new one per call: a generator is spent once read

        def params():
            return (p for p in g.params)

        def grads():
            return (t for t in g.grads)
    else:

        def params():
            return g.params

        def grads():
            return g.grads

    norm_bound = lambda: bound_buffer.sum()
    norm_scale_bound = lambda: (bound_buffer.sum(), bound_buffer.mul_(1.0))
    if op == "clip_grad_norm_ (no clip)":
        return Candidates(
            lambda: torch.nn.utils.clip_grad_norm_(params(), 1e30),
            lambda: torch.nn.utils.clip_grad_norm_(params(), 1e30, foreach=False),
            lambda: torchclip.clip_grad_norm_(params(), 1e30),
            norm_bound,
            1,
        )
    if op == "clip_grad_norm_ (clip)":
        max_norm = ClipTarget(g.grads)
        return Candidates(
            lambda: torch.nn.utils.clip_grad_norm_(params(), max_norm()),
            lambda: torch.nn.utils.clip_grad_norm_(params(), max_norm(), foreach=False),
            lambda: torchclip.clip_grad_norm_(params(), max_norm()),
            norm_scale_bound,
            3,
            max_norm.prepare,
        )
    if op == "get_total_norm":
        return Candidates(
            lambda: torch.nn.utils.get_total_norm(grads()),
            lambda: torch.nn.utils.get_total_norm(grads(), foreach=False),
            lambda: torchclip.get_total_norm(grads()),
            norm_bound,
            1,
        )
    if op == "clip_grad_value_":
        return Candidates(
            lambda: torch.nn.utils.clip_grad_value_(params(), 0.5),
            lambda: torch.nn.utils.clip_grad_value_(params(), 0.5, foreach=False),
            lambda: torchclip.clip_grad_value_(params(), 0.5),
            lambda: bound_buffer.clamp_(-0.5, 0.5),
            2,
        )
    if op == "ClipGradByGlobalNorm (clip)":
        # torch has no class: its equivalent is clip_grad_norm_ (the formulas differ only by eps).
        max_norm = ClipTarget(g.grads)
        clip = torchclip.ClipGradByGlobalNorm(1.0)

        def paddle_style():
            clip.clip_norm = max_norm()
            clip(params())

        return Candidates(
            lambda: torch.nn.utils.clip_grad_norm_(params(), max_norm()),
            lambda: torch.nn.utils.clip_grad_norm_(params(), max_norm(), foreach=False),
            paddle_style,
            norm_scale_bound,
            3,
            max_norm.prepare,
        )
    if op == "ClipGradByNorm":
        # In torch, per-tensor norm clipping is clip_grad_norm_ called once per tensor. The clip norm
        # is the median tensor norm: about half the tensors are clipped on the first call.
        norms = sorted(torchclip.get_total_norm(t).item() for t in g.grads)
        clip_norm = norms[len(norms) // 2] or 1.0
        clip = torchclip.ClipGradByNorm(clip_norm)
        return Candidates(
            lambda: [torch.nn.utils.clip_grad_norm_(p, clip_norm) for p in params()],
            lambda: [torch.nn.utils.clip_grad_norm_(p, clip_norm, foreach=False) for p in params()],
            lambda: clip(params()),
            norm_bound,
            1,
        )
    if op == "ClipGradByValue":
        clip = torchclip.ClipGradByValue(0.5, -0.25)
        # What a torch user writes for it works on the list of gradients, however the parameters came.
        return Candidates(
            lambda: (torch._foreach_clamp_min_(g.grads, -0.25), torch._foreach_clamp_max_(g.grads, 0.5)),
            lambda: [t.clamp_(-0.25, 0.5) for t in g.grads],
            lambda: clip(params()),
            lambda: bound_buffer.clamp_(-0.25, 0.5),
            2,
        )
    raise ValueError(op)
