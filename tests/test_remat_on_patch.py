"""bench/experiments/remat_on.patch: main's decode steps with XLA's rematerialization back on (the
A/B partner of STEP_XLA_OPTIONS' `xla_disable_hlo_passes`, for part `trees` at 128K context on a GPU).
It still applies, and in the patched copy the default options lack the pass's name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

CHECK = """from jtilert.ops.table import DecodeConfig


def test_the_pass_runs():
    options = dict(DecodeConfig().xla_options)
    assert "xla_disable_hlo_passes" not in options and "xla_gpu_enable_command_buffer" in options
"""


@pytest.mark.skipif(shutil.which("patch") is None, reason="patch not found")
def test_the_remat_on_patch_applies(tmp_path):
    from experiment_patch import run_patched   # tests/experiment_patch.py (tests/ is on sys.path)
    run_patched(tmp_path, "remat_on.patch", ["--version"])   # applies it (asserts that it does)
    check = tmp_path / "tests" / "test_remat_on_check.py"
    check.write_text(CHECK)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(check)], cwd=tmp_path,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
