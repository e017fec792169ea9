import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from hypothesis import settings
from testing import KernelSpy

import torchclip
from torchclip import _ops

# CI runs the same hypothesis examples every time (a red CI then means a change broke something, not
# that the draw was unlucky); the long fuzz campaign, tests/fuzz.py, draws new cases on every run.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(params=_ops._C.cpu_capabilities_built())
def cpu_capability(request):
    """Runs the test once per compiled CPU kernel library; one this CPU cannot execute is skipped."""
    if not _ops._C.cpu_runs(request.param):
        pytest.skip(f"this CPU cannot run {request.param} code")
    before = torchclip.get_cpu_capability()
    torchclip.set_cpu_capability(request.param)
    yield request.param
    torchclip.set_cpu_capability(before)


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernel_spy(monkeypatch):
    """Counts the calls into torchclip's kernels (testing.KernelSpy): proof that torchclip ran."""
    return KernelSpy(monkeypatch)
