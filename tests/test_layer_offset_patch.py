"""bench/experiments/layer_offset.patch: each kernel reads its layer as the loop's counter plus its place in
the trip (`jtilert.ops.layer.Layer`), so XLA computes no layer index between the loop and the kernels
(1,305 → 1,221 kernels a 61-layer step). Measured on an H200 in session 32 without the trip's `first + 1`
(+0.04 ms: the counter's in-place increment waited for every kernel of the trip), so it stays a patch
until part `trees` measures this form. It still applies to a copy of the checkout, and there the layer
loop bodies compute one index each, the CUDA engine builds with its layer offsets, and the op table's
tests pass."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_layer_offset_patch_applies_and_its_tests_pass(tmp_path):
    ignore = shutil.ignore_patterns("__pycache__", "golden", "build")
    for d in ("jtilert", "tests", "cuda", "bench/experiments", "bench/targets"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=ignore)
    for f in (ROOT / "bench").glob("*.py"):
        shutil.copy(f, tmp_path / "bench" / f.name)
    r = subprocess.run(["patch", "-s", "-p1", "-i", str(ROOT / "bench" / "experiments" / "layer_offset.patch")],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "jtilert" / "ops" / "layer.py").exists()
    tests = ["tests/test_ops_table.py", "tests/test_ffi.py::test_cuda_sources_compile_warnings_as_errors"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=tmp_path,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0 and " failed" not in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
