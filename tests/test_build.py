"""Import-time behaviour: a clear error when the extension is missing, and the CPU-path override."""

import os
import subprocess
import sys

import pytest
import torch

import torchclip
from torchclip import _ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, **env):
    """`code` in a fresh interpreter with `env` added; a variable given as None is removed."""
    environment = {**os.environ, **env}
    environment = {name: value for name, value in environment.items() if value is not None}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=environment, timeout=120
    )


def test_missing_extension_says_how_to_rebuild():
    result = run_python("import sys; sys.modules['torchclip._C'] = None; import torchclip")
    assert result.returncode != 0
    assert "native extension could not be loaded" in result.stderr
    assert "pip install --no-build-isolation -e ." in result.stderr


@pytest.mark.parametrize("capability", _ops._C.cpu_capabilities_built())
def test_environment_override_selects_the_kernel_library(capability):
    if not _ops._C.cpu_runs(capability):
        pytest.skip(f"this CPU cannot run {capability} code")
    result = run_python("import torchclip; print(torchclip.get_cpu_capability())", TORCHCLIP_CPU_CAPABILITY=capability)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == capability


def test_aten_cpu_capability_caps_torchclip():
    # (without the suite's own TORCHCLIP_CPU_CAPABILITY, which would win)
    result = run_python(
        "import torchclip; print(torchclip.get_cpu_capability())",
        ATEN_CPU_CAPABILITY="default",
        TORCHCLIP_CPU_CAPABILITY=None,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "DEFAULT"


@pytest.mark.parametrize("capability", _ops._C.cpu_capabilities_built())
def test_a_kernel_library_this_cpu_cannot_run_is_refused_not_executed(capability):
    if _ops._C.cpu_runs(capability):
        pytest.skip(f"this CPU runs {capability} code")
    before = torchclip.get_cpu_capability()
    with pytest.raises(ValueError, match=f"this CPU cannot run {capability} code"):
        torchclip.set_cpu_capability(capability)
    with pytest.raises(RuntimeError, match=f"this CPU cannot run the {capability} kernel library"):
        _ops._C.load_cpu_kernels(_ops._kernel_library_path(capability))  # the C++ loader's own guard
    assert torchclip.get_cpu_capability() == before
    assert capability not in torchclip.cpu_capabilities()


def test_cpu_runs_knows_each_library_and_nothing_else():
    features = torch.cpu.get_capabilities()
    assert _ops._C.cpu_runs("DEFAULT") and not _ops._C.cpu_runs("SSE9")
    assert _ops._C.cpu_runs("AVX2") == all(features.get(f, False) for f in ("avx2", "fma3", "f16c"))
    avx512 = ("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")
    assert _ops._C.cpu_runs("AVX512") == (_ops._C.cpu_runs("AVX2") and all(features.get(f, False) for f in avx512))
