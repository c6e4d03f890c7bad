"""bench/experiments/layer_offset.patch: each kernel reads its layer as the loop's counter plus its place in
the trip (`jtilert.ops.layer.Layer`), so XLA computes no layer index between the loop and the kernels
(1,305 → 1,221 kernels a 61-layer step). Measured on an H200 in session 32 without the trip's `first + 1`
(+0.04 ms: the counter's in-place increment waited for every kernel of the trip), so it stays a patch
until part `trees` measures this form. It still applies to a copy of the checkout, and there the layer
loop bodies compute one index each, the CUDA engine builds with its layer offsets, and the op table's
tests pass."""

from __future__ import annotations

import shutil

import pytest


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_layer_offset_patch_applies_and_its_tests_pass(tmp_path):
    from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)
    r = run_patched(tmp_path, "layer_offset.patch",
                    ["tests/test_ops_table.py", "tests/test_ffi.py::test_cuda_sources_compile_warnings_as_errors"])
    assert (tmp_path / "jtilert" / "ops" / "layer.py").exists()
    assert r.returncode == 0 and " failed" not in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
