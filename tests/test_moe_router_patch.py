"""bench/experiments/moe_router.patch: main's decode step with a MoE layer's router in one launch of the
engine (op `norm_route` on `pallas.moe.engine_norm_route`: `jtilert.ffi.route.norm_route`), for part `trees`
on a GPU. It still applies, and in the patched copy the op lowers to the engine's one launch and a
pallas step over a mesh runs it in every MoE loop body (the tests the patch makes ask for it)."""

from __future__ import annotations

import shutil

import pytest


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_moe_router_patch_applies_and_the_step_runs_the_engines_router(tmp_path):
    from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)
    r = run_patched(tmp_path, "moe_router.patch", ["-p", "no:warnings", "tests/test_ffi_route.py", "tests/test_ffi.py",
                                                   "-k", "op_norm_route or mesh_runs_the_engines_router"])
    assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    table = (tmp_path / "jtilert" / "ops" / "table.py").read_text()
    assert "pallas.moe:engine_norm_route" in table
