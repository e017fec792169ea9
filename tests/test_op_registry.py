"""Every torchclip op has every piece csrc/README.md's "Adding an op" names.

The ops are read from the dispatcher (each schema in csrc/ops.cpp); what the dispatcher knows is asked of it,
the rest is read from the sources, which the tests run beside.
"""

import re
from pathlib import Path

import pytest
import torch
from test_ops import NEG_CONJ_CASES, OPCHECK_CASES

from torchclip import _ops

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# The tests that read the sources skip where csrc/ is not beside them (./dev test-wheel runs the tests against
# an installed wheel, from outside the tree).
NEEDS_SOURCES = pytest.mark.skipif(not CSRC.is_dir(), reason="csrc/ is not beside the tests")
OPS = sorted(name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("torchclip::"))


def has_kernel(name, key):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"torchclip::{name}", key)


def falls_through(name, key):
    return torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(f"torchclip::{name}", key)


def writes(name):
    schema = getattr(torch.ops.torchclip, name).default._schema
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


@NEEDS_SOURCES
def test_the_ops_are_the_schemas_of_ops_cpp():
    assert OPS and OPS == sorted(re.findall(r'm\.def\(\s*"(\w+)\(', (CSRC / "ops.cpp").read_text()))


@pytest.mark.parametrize("name", OPS)
def test_op_is_registered_for_every_key(name):
    assert has_kernel(name, "CPU"), "no CPU kernel (TORCH_LIBRARY_IMPL(torchclip, CPU) in cpu/ops_cpu.cpp)"
    for key in ("Negative", "Conjugate"):
        assert has_kernel(name, key) and falls_through(name, key), f"no {key} fallthrough (ops.cpp)"
    assert has_kernel(name, "Meta"), "no fake (register_fake in torchclip/_ops.py)"
    assert has_kernel(name, "Autograd"), "no Autograd kernel (ops_autograd.cpp)"
    if writes(name):
        assert not falls_through(name, "Autograd"), "a writing op needs ops_autograd.cpp's checks and bumps"
        assert has_kernel(name, "ADInplaceOrView"), (
            "a writing op bumps versions under inference mode too (ops_autograd.cpp, for_each_writing_op)"
        )
    else:
        assert falls_through(name, "Autograd"), "a read-only op falls through Autograd"


@NEEDS_SOURCES
@pytest.mark.parametrize("name", OPS)
def test_op_has_its_handle(name):
    assert f'"torchclip::{name}"' in (CSRC / "op_handles.h").read_text(), "no op_handles.h accessor"


@pytest.mark.parametrize("name", OPS)
def test_op_has_its_wrapper_and_tests(name):
    assert callable(getattr(_ops, name, None)), "no wrapper in torchclip/_ops.py"
    assert name in OPCHECK_CASES, "no OPCHECK_CASES entry (tests/test_ops.py)"
    assert name in NEG_CONJ_CASES, "no NEG_CONJ_CASES entry (tests/test_ops.py)"
