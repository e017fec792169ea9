"""Every script in examples/ runs to completion (they assert their own outcomes)."""

import glob
import os
import subprocess
import sys

import pytest

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "*.py")))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_runs(path):
    result = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
