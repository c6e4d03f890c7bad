"""The user-facing entry points: the CLI and the notebook. The CLI runs in a subprocess, as a user runs
it, where what is checked is the process (its start-up's stderr, text streamed while decoding); its
other commands run through `jtilert.cli.main` in this process (conftest's `cli_here`), with the
stderr a user would see."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ENV = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")


def cli(*args):
    return subprocess.run([sys.executable, "-m", "jtilert.cli", *args], capture_output=True, text=True, env=ENV,
                          timeout=600)


def test_generate_streams_text_and_reports_speed():
    # The notebook's Generator (tiny, MTP, max_seq_len 512): its steps compiled here are read back
    # from the compilation cache when test_notebook_runs decodes
    r = cli("generate", "--model", "tiny", "--prompt", "The ", "--max-new-tokens", "40", "--mtp",
            "--max-seq-len", "512")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The ")
    last = r.stdout.strip().splitlines()[-1]
    assert "tokens/s" in last and "MTP acceptance" in last


def test_generate_turns_the_dispatch_thread_on_before_jax_starts():
    """The CLI turns PjRt's dispatch thread on (nothing may use JAX before that, or
    `use_dispatch_thread` refuses and the command fails) unless told not to; the same text either way."""
    args = ("generate", "--model", "tiny", "--prompt", "The ", "--max-new-tokens", "6")
    on, off = cli(*args), cli(*args, "--no-dispatch-thread")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    assert on.stdout.startswith("The ") and on.stdout.splitlines()[0] == off.stdout.splitlines()[0]


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "no-such-model", "--prompt", "x"], "no checkpoint at 'no-such-model'"),
    (["generate", "--model", "glm-5", "--prompt", "x"], "no embedded weights"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "x", "--top-p", "0"], "top_p"),
    (["generate", "--prompt", "", "--max-new-tokens", "4"], "non-empty"),
    (["info", "/nonexistent/ckpt"], "no checkpoint"),
    (["generate", "--prompt", "x", "--tp", "3"], "tp=3 does not divide the model's num_attention_heads=8"),
    (["generate", "--prompt", "x", "--tp", "0"], "--tp must be >= 1, got 0"),
    (["generate", "--prompt", "x", "--seed", "99999999999999999999999"], "seed must be an integer in [0, 2**32)"),
    (["generate", "--prompt", "x", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 0, got -1"),
    (["generate", "--prompt", "x", "--prefill-chunk", "64,0"], "prefill_chunk must be an integer >= 1"),
    (["generate", "--prompt", "a" * 5000, "--max-new-tokens", "5"],
     "the prompt (5000 tokens) and --max-new-tokens 5 need 5005 positions, more than the model's "
     "max_position_embeddings (4096)"),
    (["generate", "--prompt", "abc", "--max-new-tokens", "8", "--max-seq-len", "6"],
     "the prompt (3 tokens) and --max-new-tokens 8 need 11 positions, more than --max-seq-len (6)"),
])
def test_bad_input_is_one_line_without_traceback(args, message, cli_here):
    r = cli_here(*args)
    assert r.returncode == 2
    assert message in one_line(r.stderr) and not r.stdout


def test_bad_input_in_a_fresh_process_is_one_line():
    """As a user runs it: nothing else on stderr (no warning or log line at start-up), exit status 2,
    for an input refused after the model is loaded and the Generator built."""
    r = cli("generate", "--prompt", "x", "--prefill-chunk", "64,0")
    assert r.returncode == 2
    assert "prefill_chunk must be an integer >= 1" in one_line(r.stderr)


def one_line(stderr: str) -> str:
    """The error, checked to be all of stderr (the README promises one line, no traceback)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jtilert: error: "), stderr[-3000:]
    return lines[0]


def biggest(folder):
    return max((p for p in (folder / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_damaged_checkpoints_are_one_line(tmp_path, cli_here):
    """A flipped byte is refused by generate and verify (naming the file); a truncated file with
    --no-check is orbax's error, in one line."""
    ckpt = shutil.copytree("jtilert/assets/tiny", tmp_path / "tiny")
    f = biggest(ckpt)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    for args in (["generate", "--model", str(ckpt), "--prompt", "x", "--max-new-tokens", "2"], ["verify", str(ckpt)]):
        r = cli_here(*args)
        assert r.returncode == 2 and f"{f}: checksum mismatch" in one_line(r.stderr)
    f.write_bytes(bytes(data[:len(data) // 2]))
    r = cli_here("generate", "--model", str(ckpt), "--prompt", "x", "--max-new-tokens", "2", "--no-check")
    assert r.returncode == 2 and str(ckpt) in one_line(r.stderr) and "is not valid for value of size" in r.stderr


def test_verify_of_a_saved_checkpoint_uses_its_checksums(cli_here):
    r = cli_here("verify", "tiny")
    assert r.returncode == 0, r.stderr
    assert '"files": 16' in r.stdout


def test_convert_into_a_read_only_folder_is_one_line(read_only_dir, cli_here):
    r = cli_here("convert", "tests/golden/dsv32", str(read_only_dir / "dst"), "--quiet")
    assert r.returncode == 2
    assert re.search(r"(Read-only file system|Permission denied)$", one_line(r.stderr))


def test_verify_against_another_model_is_one_line(tmp_path, cli_here):
    dst = tmp_path / "dsv32"
    assert cli_here("convert", "tests/golden/dsv32", str(dst), "--quiet").returncode == 0
    r = cli_here("verify", str(dst), "--against", "tests/golden/glm5", "--quiet")
    assert r.returncode == 2
    assert one_line(r.stderr) == (f"jtilert: error: tests/golden/glm5 is another model than {dst}: "
                                  f"model_type glm_moe_dsa there, deepseek_v32 here")


def test_info_describes_the_tiny_checkpoint(cli_here):
    r = cli_here("info", "tiny")
    assert r.returncode == 0 and '"model_type": "deepseek_v32"' in r.stdout


def test_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient
    nb = nbformat.read("notebooks/decode.ipynb", as_version=4)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": os.getcwd()}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "MTP acceptance" in outputs and "training text:" in outputs and "other text:" in outputs
