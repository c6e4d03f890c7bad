"""Interrupted conversions resume to the same files, byte for byte (chunk files, zarr.json, orbax's and
jtilert's metadata): finished parameters are read back (chunk sizes, CRC-32C) and skipped, damaged or
unfinished ones rewritten; nothing at the destination until the end."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jtilert
from jtilert.store import arrays
from jtilert.store.convert.plan import plan
from jtilert.store.folder import DONE_LOG

CFG = jtilert.preset("tiny").replace(
    hidden_size=256, intermediate_size=1024, moe_intermediate_size=1024, num_attention_heads=16, q_lora_rank=128,
    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, vocab_size=512, num_hidden_layers=2, first_k_dense_replace=1,
    index_n_heads=4, index_head_dim=64, index_topk=16)
CHUNK = 64 << 10  # small pieces: interruptions land inside tensors


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return jtilert.random_checkpoint(CFG, tmp_path_factory.mktemp("src") / "hf", max_file_bytes=4 << 20)


@pytest.fixture(scope="module")
def reference(src, tmp_path_factory):
    return jtilert.convert(src, tmp_path_factory.mktemp("ref") / "dst", tp=2, chunk_bytes=CHUNK)


def chunk_files(partial: Path, src, name: str) -> list[Path]:
    """The chunk files of per-layer parameter `name` in a conversion at tp=2."""
    item = next(i for i in plan(src, tp=2, chunk_bytes=CHUNK).items if i.name == name)
    folder = partial / "params" / item.array / "c"
    files = sorted(f for f in (folder.joinpath(str(item.layer)) if item.layer is not None else folder).rglob("*")
                   if f.is_file())
    assert files
    return files


def same_bytes(a: Path, b: Path):
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert fa == fb
    ma, mb = json.loads((a / "jtilert.json").read_text()), json.loads((b / "jtilert.json").read_text())
    assert ma == mb
    for f in fa:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def test_interrupt_damage_resume(src, reference, tmp_path):
    dst = tmp_path / "dst"
    partial = tmp_path / ".dst.partial"

    def stop(name, done, total):
        if done > total * 0.6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        jtilert.convert(src, dst, tp=2, chunk_bytes=CHUNK, callback=stop)
    assert not dst.exists() and partial.is_dir() and not (partial / "jtilert.json").exists()
    finished = [json.loads(line)["name"] for line in (partial / DONE_LOG).read_text().splitlines()]
    assert 10 < len(finished) < 100
    # damage two finished parameters: a flipped byte in a chunk, a truncated chunk
    flipped, cut = finished[3], finished[-2]
    f = chunk_files(partial, src, flipped)[-1]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    g = chunk_files(partial, src, cut)[0]
    g.write_bytes(g.read_bytes()[:-1])

    events = []
    jtilert.convert(src, dst, tp=2, chunk_bytes=CHUNK, callback=lambda name, d, t: events.append(name))
    checked = {n.removeprefix("checking ") for n in events if n.startswith("checking ")}
    rewritten = {n for n in events if not n.startswith("checking ")}
    assert flipped in rewritten and cut in rewritten
    assert set(finished) - {flipped, cut} <= checked and not (set(finished) - {flipped, cut}) & rewritten
    assert not partial.exists()
    same_bytes(dst, reference)


KILLED = """
import sys, time
from jtilert.store import convert
def slow(name, done, total):
    time.sleep(0.002)
convert.convert(sys.argv[1], sys.argv[2], tp=2, chunk_bytes=int(sys.argv[3]), callback=slow)
"""


def test_killed_conversion_resumes_to_the_same_bytes(src, reference, tmp_path):
    dst = tmp_path / "dst"
    log = tmp_path / ".dst.partial" / DONE_LOG
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(src), str(dst), str(CHUNK)], env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if log.exists() and log.read_text().count("\n") >= 20:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the conversion finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not dst.exists() and not (tmp_path / ".dst.partial" / "jtilert.json").exists()
    jtilert.convert(src, dst, tp=2, chunk_bytes=CHUNK)
    same_bytes(dst, reference)
    jtilert.verify(dst, against=src)


def test_page_cache_path_writes_the_same_bytes(src, reference, tmp_path, monkeypatch):
    """Where O_DIRECT is refused (tmpfs, some network filesystems) the source is read through the page
    cache: same files."""
    monkeypatch.setitem(arrays.DIRECT, "ok", False)
    dst = jtilert.convert(src, tmp_path / "dst", tp=2, chunk_bytes=CHUNK)
    same_bytes(dst, reference)
