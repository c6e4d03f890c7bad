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


def assert_patched_tests_pass(tmp_path, patch: str, pytest_args: list[str], changed: str, text: str) -> None:
    """`run_patched`, then assert that the patch put `text` into file `changed` (a path under the copy)
    and that the tests it ran passed (their output's tail in the message where not)."""
    r = run_patched(tmp_path, patch, pytest_args)
    assert text in (tmp_path / changed).read_text(), f"{patch} did not put {text!r} into {changed}"
    assert r.returncode == 0 and " passed" in r.stdout and " failed" not in r.stdout, (
        r.stdout[-3000:] + r.stderr[-2000:])
