"""The public surface: what torchclip.__all__ exports is what the API reference (docs/reference.md) documents,
and no more."""

import importlib
import pathlib
import re

import torchclip

REFERENCE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "reference.md"
_SUBMODULES_IMPORTED_ON_USE = {"distributed", "bench", "clip", "per_sample"}  # named there as torchclip.<module>.x


def _documented_names() -> set[str]:
    return set(re.findall(r"\btorchclip\.([A-Za-z_][A-Za-z0-9_]*)", REFERENCE.read_text()))


def test_every_export_is_documented():
    undocumented = sorted(set(torchclip.__all__) - _documented_names())
    assert not undocumented, f"exported but not in docs/reference.md: {undocumented}"


def test_every_export_exists():
    missing = [name for name in torchclip.__all__ if not hasattr(torchclip, name)]
    assert not missing


def test_every_documented_name_is_exported_or_a_module():
    stray = []
    for name in sorted(_documented_names()):
        if name.startswith("_") or name in torchclip.__all__:  # (private modules, in the layout table)
            continue
        if name in _SUBMODULES_IMPORTED_ON_USE:
            importlib.import_module(f"torchclip.{name}")  # (raises if the page names a module that is gone)
            continue
        stray.append(name)
    assert not stray, f"docs/reference.md names torchclip.{stray} but torchclip.__all__ does not export them"


def test_not_a_tensor_error_is_what_the_drop_ins_raise():
    try:
        torchclip.clip_grad_norm_([1], 1.0)
    except torchclip.NotATensorError as error:
        assert isinstance(error, TypeError) and isinstance(error, AttributeError)
    else:
        raise AssertionError("clip_grad_norm_([1], 1.0) did not raise")
