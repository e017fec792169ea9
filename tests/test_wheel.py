"""What ./dev test-wheel checks of the installed wheel (it sets TORCHCLIP_WHEEL_CHECK to the build's
TORCHCLIP_CUDA): the suite runs against the installed package, not a source tree, and the package holds
every kernel library the build was asked for. Skipped in other runs."""

import os
import platform
import sysconfig

import pytest

import torchclip
from torchclip import _ops

WHEEL_CHECK = os.environ.get("TORCHCLIP_WHEEL_CHECK")

pytestmark = pytest.mark.skipif(WHEEL_CHECK is None, reason="./dev test-wheel runs these against the installed wheel")


def test_torchclip_is_the_installed_package():
    site = os.path.realpath(sysconfig.get_paths()["platlib"])
    assert os.path.realpath(torchclip.__file__).startswith(site + os.sep), torchclip.__file__


def test_the_wheel_holds_every_kernel_library_asked_for():
    default = "DEFAULT,AVX2,AVX512" if platform.machine() in ("x86_64", "AMD64") else "DEFAULT"
    asked = os.environ.get("TORCHCLIP_CPU_ISAS") or default
    assert set(asked.upper().split(",")) <= set(_ops._C.cpu_capabilities_built())
    if WHEEL_CHECK == "1":
        assert _ops._C.cuda_built(), "TORCHCLIP_CUDA=1, but the wheel has no CUDA kernels"
