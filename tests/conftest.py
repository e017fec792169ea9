import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# The kernels' threads on every call (csrc/cpu/multi_tensor.h's ThreadsLosing): the item pool, unless the command
# chose torch's (./dev test-torch does), so that each path is covered however busy the machine is.
os.environ.setdefault("TORCHCLIP_THREADS", "pool")

from hypothesis import settings
from testing import KernelSpy, requires_cuda

import torchclip
from torchclip import _ops

# CI runs the same hypothesis examples every time (a red CI then means a change broke something, not
# that the draw was unlucky); the long fuzz campaign, tests/fuzz.py, draws new cases on every run.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def _run_on_capability(capability):
    """Selects one compiled CPU kernel library for a test, and the one before it afterwards."""
    if not _ops._C.cpu_runs(capability):
        pytest.skip(f"this CPU cannot run {capability} code")
    before = torchclip.get_cpu_capability()
    torchclip.set_cpu_capability(capability)
    yield capability
    torchclip.set_cpu_capability(before)


@pytest.fixture(params=_ops._C.cpu_capabilities_built())
def cpu_capability(request):
    """Runs the test once per compiled CPU kernel library; one this CPU cannot execute is skipped."""
    yield from _run_on_capability(request.param)


def _kernel_targets():
    targets = [pytest.param(("cpu", c), id=f"cpu-{c}") for c in _ops._C.cpu_capabilities_built()]
    return targets + [pytest.param(("cuda", None), id="cuda", marks=[requires_cuda, pytest.mark.cuda])]


@pytest.fixture(params=_kernel_targets())
def device(request):
    """The device a test's tensors live on: the CPU once per compiled kernel library (as cpu_capability),
    and CUDA where there is a GPU and torchclip's CUDA kernels. `pytest -m cuda` runs the CUDA cases alone."""
    kind, capability = request.param
    if kind == "cpu":
        for _ in _run_on_capability(capability):
            yield kind
    else:
        yield kind


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def kernel_spy(monkeypatch):
    """Counts the calls into torchclip's kernels (testing.KernelSpy): proof that torchclip ran."""
    return KernelSpy(monkeypatch)
