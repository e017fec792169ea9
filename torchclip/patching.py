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


class patch:
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
        self._saved = [(module, name, getattr(module, name)) for module, names in _PATCHES.items() for name in names]
        for module, names in _PATCHES.items():
            for name, function in names.items():
                setattr(module, name, function)

    def undo(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []

    def __enter__(self) -> patch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.undo()
