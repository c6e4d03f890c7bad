"""bench/experiments/swiglu_residual.patch: a dense FFN and the shared expert plus the residual as two kernels,
the down kernel (`expert_down`, the FFN as one expert of weight 1) finishing the gate/up GEMV's split-K
partials with the reference's rounding, so no XLA kernel runs between the two (1,221 → 1,160 kernels a
61-layer step, 212 → 203 graph nodes, counted on the CPU). On an H100 (36 layers, two rounds of part
`trees`) the step was unchanged (bench/RESULTS.md, session 35), so it stays a patch. It still applies to
a copy of the checkout, and there the op table's tests (every kernel chosen at decode shapes, the layer
bodies' glue budget 12 ops lower, the merged op falling back to its parts) and the kernel's own tests
pass."""

from __future__ import annotations

import shutil

import pytest


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_swiglu_residual_patch_applies_and_its_tests_pass(tmp_path):
    from experiment_patch import assert_patched_tests_pass   # tests/experiment_patch.py (tests/ is on sys.path)
    assert_patched_tests_pass(tmp_path, "swiglu_residual.patch",
                              ["tests/test_ops_table.py", "tests/test_pallas_moe.py", "-k",
                               "swiglu_residual or dense_ffn or partials or glue or decode_shapes or its_parts"],
                              "jtilert/pallas/moe.py", "def swiglu_residual")
