"""bench/experiments/moe_pair.patch: main's decode step with the routed experts as one kernel of two phases
(`jtilert.pallas.moe_pair`) instead of two kernels, for part `trees` on a GPU. It still applies, and in the
patched copy the op table's MoE (the residual added, at a traced layer, one and two tokens) runs the pair's
code and gives the reference within fp8 rounding (tests/test_pallas_moe.py's op-table test)."""

from __future__ import annotations

import shutil

import pytest


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_moe_pair_patch_applies_and_the_op_runs_the_pair(tmp_path):
    from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)
    r = run_patched(tmp_path, "moe_pair.patch",
                    ["tests/test_pallas_moe.py", "-k", "test_moe_experts_with_the_residual_through_the_op_table"])
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert '"pallas.moe_pair:moe_experts"' in (tmp_path / "jtilert" / "ops" / "table.py").read_text()
