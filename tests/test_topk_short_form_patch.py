"""bench/experiments/topk_short_form.patch, measured before it lands (parts `selectpatch` and `trees`): the
engine's cluster top-k ends after level 0 with the row's first k positions where no score from position k
on is above -inf and none is below it (a short context's masked row), exact without the positions. In a
patched copy: the numpy model of the cluster kernel with the short form equals `lax.top_k`, the form is
taken exactly where it should be, and select.cu and the self-test compile for sm_90a with warnings as
errors."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_short_form_patch_applies_and_its_model_equals_lax_top_k(tmp_path):
    r = run_patched(tmp_path, "topk_short_form.patch",
                    ["tests/test_ffi_select.py", "-k", "short_form or cluster_kernel_equals or cluster_plan"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "passed" in r.stdout and "short_form" in (tmp_path / "tests" / "test_ffi_select.py").read_text()
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the patched CUDA sources cannot be compiled here")
    for src in ("cuda/src/select.cu", "cuda/tests/selftest.cu"):
        r = subprocess.run([nvcc, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Werror=all-warnings",
                            "-Xcompiler=-Wall,-Wextra,-Werror", "-I", str(tmp_path / "cuda" / "include"), "-c",
                            str(tmp_path / src), "-o", str(tmp_path / (os.path.basename(src) + ".o"))],
                           capture_output=True, text=True)
        assert r.returncode == 0, (src, r.stderr[-3000:])
