"""bench/vs_transformers.py on the CPU: jtilert's side and the combiner on a tiny HF checkpoint, and
transformers' side where torch and transformers are importable (not in jtilert's own environment:
run it by hand with a torch environment, see the script's docstring)."""

import json
import os
import subprocess
import sys

import pytest

import jtilert
from bench import vs_transformers

ARGS = ["--context", "40", "--new", "6", "--samples", "2", "--warmup", "1", "--steps", "2"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(jtilert.random_checkpoint("tiny", tmp_path_factory.mktemp("vs") / "ck", fmt="bf16", num_layers=2))


@pytest.fixture(scope="module")
def jt_json(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("vs_out") / "jt.json"
    vs_transformers.main(["--side", "jtilert", folder, *ARGS, "--backend", "reference", "--out", str(out)])
    return out


def test_jtilert_side_writes_every_field(jt_json, folder):
    r = json.loads(jt_json.read_text())
    for k in ("card", "date", "commit", "command", "versions", "context", "new", "seed"):
        assert r[k] is not None, k
    assert r["folder"] == folder and r["versions"]["jax"] and "--side jtilert" in r["command"]
    run, = r["runs"]
    assert len(run["tokens"]) == 6
    for loop in ("generate", "stream"):
        t = run[loop]["ms_per_token"]
        assert len(t["samples"]) == 2 and t["p90"] >= t["median"] > 0
    assert run["device"]["step_ms"] > 0 and run["device"]["position"] == 40 + 6 - 2
    assert run["device"]["kernel_sum_ms"] == "not available on cpu"


def fake_transformers(jt: dict, **extra) -> dict:
    """transformers' JSON as its side writes it on a GPU, with round numbers."""
    return {"side": "transformers", "card": "GPU", "folder": jt["folder"], "context": jt["context"], "new": jt["new"],
            "seed": jt["seed"], "compile": "off", "tokens": jt["runs"][0]["tokens"][:3] + [-1] * 3,
            "generate": {"ms_per_token": {"median": 4.0}},
            "device": {"kernel_sum": {"median": 3.0}, "graph_replay": {"error": "capture failed: ..."}}, **extra}


def test_combine_ratios(jt_json, tmp_path):
    jt = json.loads(jt_json.read_text())
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps(fake_transformers(jt)))
    r = vs_transformers.main(["--combine", str(jt_json), str(hf), "--out", str(tmp_path / "vs.json")])
    assert json.loads((tmp_path / "vs.json").read_text()) == r
    row, = r["rows"]
    run = jt["runs"][0]
    assert row["wall_ratio_vs_generate"] == 4.0 / run["generate"]["ms_per_token"]["median"]
    assert row["wall_ratio_vs_stream"] == 4.0 / run["stream"]["ms_per_token"]["median"]
    # no graph replay on that side, no kernel sum on this one (CPU): no device ratio, and why
    assert row["device_ratio_graph_vs_loop"] is None and row["device_ratio_kernel_sums"] is None
    assert row["device_note"] == "capture failed: ..."
    assert row["same_leading_tokens"] == 3


def test_combine_refuses_another_measurement(jt_json, tmp_path):
    jt = json.loads(jt_json.read_text())
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps(fake_transformers(jt, context=41)))
    with pytest.raises(SystemExit, match="not what"):
        vs_transformers.main(["--combine", str(jt_json), str(hf)])


def _torch_python():
    """A Python with torch and transformers: this one, or $TORCH_PYTHON."""
    for py in (sys.executable, os.environ.get("TORCH_PYTHON")):
        if py and subprocess.run([py, "-c", "import torch, transformers"], capture_output=True).returncode == 0:
            return py
    pytest.skip("no Python with torch and transformers (set TORCH_PYTHON)")


def test_transformers_side_on_cpu(folder, jt_json, tmp_path):
    py = _torch_python()
    out = tmp_path / "hf.json"
    root = os.path.dirname(os.path.dirname(os.path.abspath(vs_transformers.__file__)))
    subprocess.run([py, "-m", "bench.vs_transformers", "--side", "transformers", folder, *ARGS, "--device", "cpu",
                    "--out", str(out)], cwd=root, check=True, timeout=600, env={**os.environ, "PYTHONPATH": root})
    r = json.loads(out.read_text())
    assert r["versions"]["torch"] and r["versions"]["transformers"] and "error" not in r
    t = r["generate"]["ms_per_token"]
    assert len(t["samples"]) == 2 and t["median"] > 0 and len(r["tokens"]) == 6
    # the replayed step is generate's last, at the row jtilert's device loop times
    assert r["device"] == "not available on cpu" and r["replay_chose_last_token"]
    assert r["replay_position"] == json.loads(jt_json.read_text())["runs"][0]["device"]["position"]
    row, = vs_transformers.main(["--combine", str(jt_json), str(out)])["rows"]
    assert row["wall_ratio_vs_generate"] > 0


class _Counter:
    """A tensor-like length counter (in-place sub_, as torch's)."""

    def __init__(self, v):
        self.v = v

    def sub_(self, n):
        self.v -= n


def test_rewind_steps_back_static_layers_that_cannot_crop():
    """transformers' static DSA layers (5.17) have no crop: the rewind moves their counters back one row,
    the tensor ones in place (a captured graph replays that) and the int get_seq_length reports."""
    layer = type("StaticIndexedLayer", (), {})()
    layer.cumulative_length, layer.indexer_cumulative_length = _Counter(7), _Counter(7)
    layer.cumulative_length_int = 7
    vs_transformers.rewind_one(type("StaticCache", (), {"layers": [layer, layer]})())()
    assert (layer.cumulative_length.v, layer.indexer_cumulative_length.v, layer.cumulative_length_int) == (5, 5, 5)

    cropped = []
    croppable = type("StaticCache", (), {"layers": [type("L", (), {"crop": None})()],
                                         "crop": lambda self, n: cropped.append(n)})()
    vs_transformers.rewind_one(croppable)()
    assert cropped == [-1]
    with pytest.raises(RuntimeError, match="no way to rewind"):
        vs_transformers.rewind_one(type("Other", (), {"layers": [object()]})())
