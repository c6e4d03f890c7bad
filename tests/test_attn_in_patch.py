"""bench/experiments/attn_in.patch: the attention's input projections (x_proj, then q_b | wq_b of its normed
q_a) as one Pallas kernel of four phases handed off through a grid-wide semaphore (`jtilert.pallas.attn_in`),
the op `attn_in` taking one token's two rmsnorm_linear kernels' place. On an H100 it is correct and, alone,
faster than the step's two kernels, but the 36-layer step is slower with it (bench/RESULTS.md, session
36), so it stays a patch. It still applies to a copy of the checkout, and there its phases equal the
reference in interpret mode, the one kernel lowers at the real shapes, and the op table chooses it at
decode shapes."""

from __future__ import annotations

import shutil

import pytest


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_attn_in_patch_applies_and_its_tests_pass(tmp_path):
    from experiment_patch import assert_patched_tests_pass   # tests/experiment_patch.py (tests/ is on sys.path)
    assert_patched_tests_pass(tmp_path, "attn_in.patch",
                              ["tests/test_pallas_attn_in.py", "tests/test_ops_table.py", "-k",
                               "phases or plan or lowers or decode_shapes"],
                              "jtilert/pallas/attn_in.py", "def attn_in")
