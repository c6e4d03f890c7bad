"""The user-facing entry points: the CLI (in a subprocess, as a user runs it) and the notebook."""

import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "jtilert.cli", *args], capture_output=True, text=True, env=ENV,
                          timeout=600)


def test_generate_streams_text_and_reports_speed():
    r = cli("generate", "--model", "tiny", "--prompt", "The ", "--max-new-tokens", "40", "--mtp")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The ")
    last = r.stdout.strip().splitlines()[-1]
    assert "tokens/s" in last and "MTP acceptance" in last


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "no-such-model", "--prompt", "x"], "no checkpoint at 'no-such-model'"),
    (["generate", "--model", "glm-5", "--prompt", "x"], "no embedded weights"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "x", "--top-p", "0"], "top_p"),
    (["generate", "--prompt", "", "--max-new-tokens", "4"], "non-empty"),
    (["info", "/nonexistent/ckpt"], "no checkpoint"),
])
def test_bad_input_is_one_line_without_traceback(args, message):
    r = cli(*args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_info_describes_the_tiny_checkpoint():
    r = cli("info", "tiny")
    assert r.returncode == 0 and '"model_type": "deepseek_v32"' in r.stdout


def test_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient
    nb = nbformat.read("notebooks/decode.ipynb", as_version=4)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": os.getcwd()}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "MTP acceptance" in outputs and "mean NLL" in outputs
