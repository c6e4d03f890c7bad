"""bench/experiments/route_half_sms.patch, measured on top of bench/experiments/moe_router.patch (part
`trees` with TREES entry "moe_router.patch+route_half_sms.patch"): the one-launch router on at most half
the SMs, so that the shared expert's kernels beside it find SMs free. The two patches apply in that order
and the patched route.cu compiles for sm_90a with warnings as errors."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from experiment_patch import ROOT   # tests/experiment_patch.py (tests/ is on sys.path)


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(shutil.which("patch") is None or _nvcc() is None, reason="patch or nvcc not found")
def test_the_half_sms_router_applies_over_the_router_patch_and_compiles(tmp_path):
    for d in ("jtilert", "tests", "cuda"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "golden"))
    for patch in ("moe_router.patch", "route_half_sms.patch"):
        r = subprocess.run(["patch", "-s", "-p1", "-i", str(ROOT / "bench" / "experiments" / patch)], cwd=tmp_path,
                           capture_output=True, text=True)
        assert r.returncode == 0, (patch, r.stdout + r.stderr)
    src = tmp_path / "cuda" / "src" / "route.cu"
    assert "n_sm / 2" in src.read_text()
    r = subprocess.run([_nvcc(), "-gencode=arch=compute_90a,code=sm_90a", "-Werror=all-warnings",
                        "-Xcompiler=-Wall,-Wextra,-Werror", "-I", str(tmp_path / "cuda" / "include"), "-c", str(src),
                        "-o", str(tmp_path / "route.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
