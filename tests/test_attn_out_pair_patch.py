"""bench/experiments/attn_out_pair.patch: main's decode step with the attention's output path as op
`attention_out` (sparse MLA's partials, then W_uv and o_proj with the residual as two phases of one kernel:
`jtilert.pallas.gemv_pair`), for part `trees` on a GPU. It still applies, and in the patched copy every
decode-shaped step chooses the op's kernels for one token and the two ops for more (test_ops_table.py's
kernel-choice test, which the patch makes ask for it)."""

from __future__ import annotations

import shutil

import pytest


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_attn_out_pair_patch_applies_and_the_step_chooses_the_op(tmp_path):
    from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)
    r = run_patched(tmp_path, "attn_out_pair.patch", ["tests/test_ops_table.py", "-k", "every_kernel_runs"])
    assert r.returncode == 0 and "4 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ops.attention_out(" in (tmp_path / "jtilert" / "model" / "transformer.py").read_text()
