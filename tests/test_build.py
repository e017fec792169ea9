"""Import-time behaviour: a clear error when the extension is missing, and the CPU-path override."""

import os
import subprocess
import sys

import pytest

import torchclip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=120)


def test_missing_extension_says_how_to_rebuild():
    result = run_python("import sys; sys.modules['torchclip._C'] = None; import torchclip")
    assert result.returncode != 0
    assert "native extension could not be loaded" in result.stderr
    assert "pip install --no-build-isolation -e ." in result.stderr


@pytest.mark.parametrize("capability", torchclip.cpu_capabilities())
def test_environment_override_selects_the_kernel_library(capability):
    result = run_python("import torchclip; print(torchclip.get_cpu_capability())", TORCHCLIP_CPU_CAPABILITY=capability)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == capability


def test_aten_cpu_capability_caps_torchclip():
    result = run_python("import torchclip; print(torchclip.get_cpu_capability())", ATEN_CPU_CAPABILITY="default")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "DEFAULT"
