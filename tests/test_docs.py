"""The README's numbers are the suite's: the test counts it states are what pytest
collects (its map of the packages is checked in tests/fast/cli/test_choices.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT


def _collected(*paths: str) -> int:
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "no:cacheprovider", *paths], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    found = re.search(r"^(\d+) tests? collected", result.stdout, re.MULTILINE)
    assert found, result.stdout[-2000:] + result.stderr[-2000:]
    return int(found[1])


def test_readme_counts_match_the_suite():
    readme = (ROOT / "README.md").read_text()
    stated = re.search(r"The suite has ([\d,]+) tests, ([\d,]+) of them in the fast tier",
                       readme)
    assert stated, "the README no longer says how many tests the suite has"
    total, fast = (int(number.replace(",", "")) for number in stated.groups())
    assert (total, fast) == (_collected(), _collected("tests/fast"))
