"""`patch()`: torchclip's drop-ins installed into torch.nn.utils, for code that calls torch's names."""

from __future__ import annotations

import torch
from torch.nn.utils import clip_grad as _torch_clip_grad

from torchclip.clip_grad import clip_grad_norm, clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_, get_total_norm

_PATCHES = {
    torch.nn.utils: {
        "clip_grad_norm_": clip_grad_norm_,
        "clip_grad_norm": clip_grad_norm,
        "clip_grad_value_": clip_grad_value_,
        "get_total_norm": get_total_norm,
        "clip_grads_with_norm_": clip_grads_with_norm_,
    },
    _torch_clip_grad: {
        "clip_grad_norm_": clip_grad_norm_,
        "clip_grad_norm": clip_grad_norm,
        "clip_grad_value_": clip_grad_value_,
    },
}


_ABSENT = object()


class AttributePatch:
    """Attributes set on modules or classes until `.undo()`, or for a `with` block, then what was there before put
    back (an attribute the owner did not hold itself, a class's inherited method, is removed again). The one
    mechanism of `patch()` and `torchclip.per_sample.patch_opacus()`."""

    def __init__(self, replacements) -> None:
        replacements = list(replacements)  # (owner, name, value)
        self._saved = [(owner, name, vars(owner).get(name, _ABSENT)) for owner, name, _ in replacements]
        for owner, name, value in replacements:
            setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, original in reversed(self._saved):
            if original is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._saved = []

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.undo()


class patch(AttributePatch):
    """Install torchclip's drop-ins into `torch.nn.utils` (and `torch.nn.utils.clip_grad`).

    For code that cannot change its imports (a framework's trainer): `torchclip.patch()` installs them
    until `.undo()`; `with torchclip.patch(): ...` installs them for the block and restores what was
    there before. Code that did `from torch.nn.utils import clip_grad_norm_` before patching keeps
    torch's function, and processes started with `spawn` must call it themselves.

    Example:
        >>> with torchclip.patch():
        ...     trainer.fit(model)  # torch.nn.utils.clip_grad_norm_ is torchclip's in here
    """

    def __init__(self) -> None:
        super().__init__(
            (module, name, function) for module, names in _PATCHES.items() for name, function in names.items()
        )
