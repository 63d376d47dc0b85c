#!/usr/bin/env python3
"""Fuzz kvcalib's static readers longer than CI does.

Runs the property of tests/fast/checkpoint/test_fuzz_static.py (verify --static-only, inspect and
estimate on hostile checkpoints: no crash, no hang, no read outside the folder) with N
random examples instead of CI's fixed 60:

    python scripts/fuzz_static.py --examples 5000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples to try")
    args = parser.parse_args()
    if args.examples < 1:
        parser.error("--examples must be at least 1")
    env = {**os.environ, "KVCALIB_FUZZ_EXAMPLES": str(args.examples)}
    test = REPO / "tests" / "fast" / "checkpoint" / "test_fuzz_static.py"
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "--hypothesis-show-statistics", str(test)], env=env, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
