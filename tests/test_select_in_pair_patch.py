"""bench/experiments/select_in_pair.patch: one decode token's routed experts select their experts in their
own kernel (the router's selection as a prologue of every CTA of the routed pair; no selection launch),
the A/B partner of main for part `trees`. It applies, and in the patched copy its selection matches the
reference at DeepSeek-V3.2's and GLM-5's routers and the decode step calls the routed kernel."""

from __future__ import annotations

import shutil

import pytest


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_select_in_pair_patch(tmp_path):
    from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)
    r = run_patched(tmp_path, "select_in_pair.patch",
                    ["tests/test_pallas_route_select.py", "-k", "not ties and not routed_experts_select"])
    assert r.returncode == 0 and "failed" not in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
