"""setup.py's refusals: where the build cannot work it stops with one paragraph saying why and what to run,
never a traceback (an isolated build without torch, a torch outside the supported range, no C++ compiler, a
CUDA toolkit of another major release than torch's)."""

import os
import pathlib
import subprocess
import sys

import pytest

SETUP = pathlib.Path(__file__).resolve().parent.parent / "setup.py"
pytestmark = pytest.mark.skipif(not SETUP.exists(), reason="./dev test-wheel runs the tests outside the source tree")


def run_setup(prelude: str = "", **env) -> subprocess.CompletedProcess:
    """`setup.py --version` (no compilation), after `prelude` ran in the same interpreter."""
    code = f"{prelude}\nimport runpy, sys\nsys.argv = ['setup.py', '--version']\nrunpy.run_path({str(SETUP)!r}, run_name='__main__')"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=SETUP.parent,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def assert_refused(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


def test_a_build_that_can_work_is_not_refused():
    result = run_setup()
    assert result.returncode == 0, result.stderr[-2000:]


def test_an_isolated_build_without_torch_says_to_pass_no_build_isolation():
    result = run_setup("import sys; sys.modules['torch'] = None  # import torch fails, as in pip's isolated build")
    assert_refused(result, "torch is not importable in the build environment", "pip install --no-build-isolation .")


@pytest.mark.parametrize("version", ["2.10.0", "2.16.0", "3.0.0+cpu"])
def test_a_torch_outside_the_supported_range_is_named_with_the_fix(version):
    result = run_setup(f"import torch; torch.__version__ = {version!r}")
    assert_refused(result, f"the installed torch is {version}", "torch 2.11 to 2.15", "--no-build-isolation")


def test_no_cpp_compiler_says_how_to_get_one():
    result = run_setup(CXX="/nonexistent/c++")
    assert_refused(result, "no C++ compiler was found (/nonexistent/c++", "apt install g++")


def with_toolkit(root: pathlib.Path, release: str) -> str:
    """A prelude for run_setup: a CUDA build of torch 13.0 (as torch sees itself) beside a toolkit at `root`
    whose nvcc reports `release` (a CPU torch finds no CUDA_HOME itself)."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return f"import torch, torch.utils.cpp_extension as c; torch.version.cuda = '13.0'; c.CUDA_HOME = {str(root)!r}"


def test_a_cuda_toolkit_of_another_major_release_than_torchs_is_named_with_the_fix(tmp_path):
    result = run_setup(with_toolkit(tmp_path / "cuda-12.4", "12.4"), TORCHCLIP_CUDA="auto")
    assert_refused(
        result, "is CUDA 12.4, but torch", "built with CUDA 13.0", "CUDA 13.x", "TORCHCLIP_CUDA=0 pip install"
    )


def test_a_cuda_toolkit_of_another_minor_release_builds(tmp_path):
    result = run_setup(with_toolkit(tmp_path / "cuda-13.2", "13.2"), TORCHCLIP_CUDA="auto")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "CUDA kernels on" in result.stdout
