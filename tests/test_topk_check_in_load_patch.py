"""bench/experiments/topk_check_in_load.patch, measured before it lands (parts `selectpatch` and `trees`):
the cluster top-k's short form with each CTA's check made as it loads its chunk (`load_keys`, whose
closing barrier becomes an `__syncthreads_or`) instead of in a pass of its own. In a patched copy: the
numpy model of the cluster kernel with the short form equals `lax.top_k`, the form is taken exactly where
it should be, and select.cu and the self-test compile for sm_90a with warnings as errors."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_check_in_load_patch_applies_and_compiles(tmp_path):
    r = run_patched(tmp_path, "topk_check_in_load.patch",
                    ["tests/test_ffi_select.py", "-k", "short_form or cluster_kernel_equals or cluster_plan"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "passed" in r.stdout and "rules_out |=" in (tmp_path / "cuda" / "src" / "select.cu").read_text()
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the patched CUDA sources cannot be compiled here")
    for src in ("cuda/src/select.cu", "cuda/tests/selftest.cu"):
        r = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Werror=all-warnings",
                            "-Xcompiler=-Wall,-Wextra,-Werror", "-I", str(tmp_path / "cuda" / "include"), "-c",
                            str(tmp_path / src), "-o", str(tmp_path / (os.path.basename(src) + ".o"))],
                           capture_output=True, text=True)
        assert r.returncode == 0, (src, r.stderr[-3000:])
