"""Every Python code block of the README and of the documentation pages runs, so a renamed argument breaks CI
and not a user.

A page's blocks run in order in one fresh interpreter (a later block may use what an earlier one made), in a
scratch directory. A block that cannot run here (it needs a GPU, several processes or a package the tests do
not install) is preceded by an HTML comment `<!-- not run: why -->`, which the rendered page does not show. A
page whose blocks import a package of requirements-integration.txt (Opacus) is skipped where that package is not
installed (the release checks' venvs, ./dev test-torch and test-wheel); ./dev test installs it and runs them.
"""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^(?P<before>[^\n]*)\n)?^```python\n(?P<code>.*?)^```\n", re.MULTILINE | re.DOTALL)
NOT_RUN = re.compile(r"^<!-- not run: (?P<why>\S.*) -->$")
INTEGRATION_PACKAGES = ("opacus",)  # what a page may import beyond torch and torchclip (requirements-integration.txt)


def blocks(page: pathlib.Path) -> list[tuple[str, str | None]]:
    """(code, why it is not run or None) for each Python block of the page, in order."""
    found = []
    for match in BLOCK.finditer(page.read_text()):
        before = (match.group("before") or "").strip()
        not_run = NOT_RUN.match(before)
        found.append((match.group("code"), not_run.group("why") if not_run else None))
    return found


def test_the_pages_are_found_and_hold_blocks():
    assert (ROOT / "docs" / "index.md") in PAGES
    assert sum(why is None for page in PAGES for _, why in blocks(page)) >= 8


def test_a_skip_marker_says_why_and_stands_right_before_a_block():
    for page in PAGES:
        text = page.read_text()
        for marker in re.finditer(r"<!-- not run:.*-->", text):
            assert NOT_RUN.match(marker.group(0)), f"{page.name}: {marker.group(0)} gives no reason"
            after = text[marker.end() :]
            assert after.startswith("\n```python\n"), f"{page.name}: {marker.group(0)} is not right before a block"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_the_pages_code_runs(page, tmp_path):
    code = "\n".join(code for code, why in blocks(page) if why is None)
    for package in INTEGRATION_PACKAGES:
        if re.search(rf"^(from|import) {package}\b", code, re.MULTILINE) and importlib.util.find_spec(package) is None:
            pytest.skip(f"{page.name}'s blocks import {package}, which is not installed here")
    script = tmp_path / f"{page.stem}_blocks.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{page.name}'s code blocks failed:\n{result.stdout}\n{result.stderr[-3000:]}"
