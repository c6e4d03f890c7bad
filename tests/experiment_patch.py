"""A bench/experiments patch checked on the CPU before it is measured: applied to a copy of the package
and the tests, its own checks run there (tests/ is on sys.path)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_patched(tmp_path, patch: str, pytest_args: list[str]) -> subprocess.CompletedProcess:
    """Copy the sources a patch may touch (jtilert/, tests/, cuda/, bench/ without its results) under
    tmp_path, apply bench/experiments/`patch` there (AssertionError with patch's output if it does not
    apply), then run pytest with `pytest_args` in the copy."""
    for d, skip in (("jtilert", ()), ("tests", ("golden",)), ("cuda", ()), ("bench", ("results",))):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", *skip))
    r = subprocess.run(["patch", "-s", "-p1", "-i", str(ROOT / "bench" / "experiments" / patch)],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                          cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})

