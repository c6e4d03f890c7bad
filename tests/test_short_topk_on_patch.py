"""bench/experiments/short_topk_on.patch: main with `DecodeConfig.short_context_topk` on by default, for
part `trees` on a GPU (at context 4096, where every layer runs its top-k behind the conditional, and
at 1024, where none does). It still applies, and in the patched copy the option is on and its checks
pass (tests/test_short_context_topk.py)."""

from __future__ import annotations

import shutil

import pytest


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_short_topk_patch_applies_and_turns_the_option_on(tmp_path):
    from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)
    r = run_patched(tmp_path, "short_topk_on.patch", ["tests/test_short_context_topk.py", "-k", "op_selects"])
    assert r.returncode == 0 and "5 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "short_context_topk: bool = True" in (tmp_path / "jtilert" / "ops" / "table.py").read_text()
