"""Bad input to jtilert.convert: each is a clear error naming the file or tensor, and nothing at the
destination (a partial conversion, if any, is a hidden folder without jtilert.json); --overwrite replaces
only a jtilert checkpoint."""

import errno
import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import jtilert
from jtilert.store import arrays, hf
from jtilert.store.folder import DONE_LOG
from jtilert.store.synthetic import HF_DTYPE

NAMES = {np.dtype(v): k for k, v in hf.DTYPES.items()}
QB = "model.layers.1.self_attn.q_b_proj"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A tiny fp8 HF folder in several files with an index."""
    return jtilert.random_checkpoint("tiny", tmp_path_factory.mktemp("good") / "src", max_file_bytes=300_000)


@pytest.fixture
def src(good, tmp_path):
    d = tmp_path / "src"
    shutil.copytree(good, d)
    return d


def file_of(folder: Path, key: str) -> Path:
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]


def rewrite(folder: Path, key: str, value: np.ndarray | None = None, drop: bool = False, add: str | None = None):
    """Rewrite the safetensors file holding `key` with that tensor replaced (or dropped, or `add` added)."""
    path = file_of(folder, key)
    f = hf.SafetensorsFile(path)
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    if drop:
        del tensors[key]
    elif value is not None:
        tensors[key] = value
    if add:
        tensors[add] = np.zeros((4, 4), ml_dtypes.bfloat16)
    header, off, blobs = {}, 0, []
    for k, x in tensors.items():
        b = np.ascontiguousarray(x).view(np.uint8).tobytes()
        header[k] = {"dtype": NAMES[x.dtype], "shape": list(x.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))
    index = folder / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    if drop:
        del meta["weight_map"][key]
    if add:
        meta["weight_map"][add] = path.name
    index.write_text(json.dumps(meta))


def fails(src, tmp_path, exc, match, **kw):
    dst = tmp_path / "dst"
    with pytest.raises(exc, match=match):
        jtilert.convert(src, dst, **kw)
    assert not dst.exists()
    for p in tmp_path.glob(".dst*"):
        assert not (p / "jtilert.json").exists()


def test_missing_shard_file_named_by_the_index(src, tmp_path):
    name = file_of(src, QB + ".weight").name
    (src / name).unlink()
    fails(src, tmp_path, FileNotFoundError, rf"index.json names {name}, which is not in")


def test_missing_numbered_shard_without_index(src, tmp_path):
    (src / "model.safetensors.index.json").unlink()
    victim = sorted(src.glob("model-*.safetensors"))[2]
    victim.unlink()
    fails(src, tmp_path, FileNotFoundError, rf"missing shard file .*{victim.name} \(.* says there are \d+\)")


def test_truncated_safetensors(src, tmp_path):
    path = file_of(src, QB + ".weight")
    path.write_bytes(path.read_bytes()[:-1000])
    fails(src, tmp_path, ValueError, rf"{path.name}: truncated \(tensors end at byte \d+, file has \d+\)")


def test_wrong_shape(src, tmp_path):
    rewrite(src, QB + ".weight", np.zeros((255, 64), ml_dtypes.float8_e4m3fn))
    fails(src, tmp_path, ValueError, rf"model-\d+-of-\d+.safetensors: tensor {QB}.weight has shape \(255, 64\), "
                                     r"the config needs \(256, 64\)")


def test_wrong_expert_shape(src, tmp_path):
    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite(src, key, np.zeros((64, 127), ml_dtypes.float8_e4m3fn))
    fails(src, tmp_path, ValueError, rf"tensor {key} has shape \(64, 127\), the config needs \(64, 128\) \(expert 5")


def test_wrong_dtype(src, tmp_path):
    key = "model.layers.0.input_layernorm.weight"
    rewrite(src, key, np.zeros(128, np.int32))
    fails(src, tmp_path, ValueError, rf"tensor {key} has dtype int32; parameter layers.0.input_layernorm.weight "
                                     "needs a float type")


def test_scale_that_does_not_match_its_weight(src, tmp_path):
    rewrite(src, QB + ".weight_scale_inv", np.ones((3, 1), np.float32))
    fails(src, tmp_path, ValueError, rf"tensor {QB}.weight_scale_inv has shape \(3, 1\), but its weight "
                                     rf"{QB}.weight of shape \(256, 64\) needs block scales of shape \(2, 1\)")


def test_fp8_weight_without_scale(src, tmp_path):
    rewrite(src, QB + ".weight_scale_inv", drop=True)
    fails(src, tmp_path, ValueError, rf"tensor {QB}.weight is float8_e4m3fn but has no {QB}.weight_scale_inv")


def test_scale_of_wrong_dtype(src, tmp_path):
    rewrite(src, QB + ".weight_scale_inv", np.ones((2, 1), np.int8))
    fails(src, tmp_path, ValueError, rf"{QB}.weight_scale_inv has dtype int8; block scales must be float32")


def test_missing_expert(src, tmp_path):
    rewrite(src, "model.layers.3.mlp.experts.11.down_proj.weight", drop=True)
    fails(src, tmp_path, ValueError, r"parameter layers.3.mlp.experts.down.weight is missing experts \[11\] "
                                     r"\(no model.layers.3.mlp.experts.11.down_proj.weight\)")


def test_missing_tensor(src, tmp_path):
    rewrite(src, "model.norm.weight", drop=True)
    fails(src, tmp_path, ValueError, r"no tensor for parameter norm.weight of shape \(128,\) \(expected HF key "
                                     r"model.norm.weight\)")


def test_tensor_with_no_place(src, tmp_path):
    rewrite(src, QB + ".weight", add="model.layers.1.self_attn.extra_proj.weight")
    fails(src, tmp_path, ValueError, r"tensors with no place in a deepseek_v32 model \(fp8\): "
                                     r"model.layers.1.self_attn.extra_proj.weight")


def test_index_placing_a_tensor_in_the_wrong_file(src, tmp_path):
    index = src / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    other = next(n for n in sorted(set(meta["weight_map"].values())) if n != meta["weight_map"][QB + ".weight"])
    meta["weight_map"][QB + ".weight"] = other
    index.write_text(json.dumps(meta))
    fails(src, tmp_path, ValueError, rf"places {QB}.weight in {other}, which does not contain it")


def test_unknown_model_type(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (src / "config.json").write_text(json.dumps(cfg))
    fails(src, tmp_path, ValueError, r"config.json: unknown model_type 'mistral'")


def test_not_an_hf_folder(tmp_path):
    fails(tmp_path / "nowhere", tmp_path, FileNotFoundError, "no HF model folder at")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", tmp_path, FileNotFoundError, "no config.json")


def test_existing_destination_needs_overwrite(good, tmp_path):
    dst = jtilert.convert(good, tmp_path / "dst")
    with pytest.raises(FileExistsError, match="exists"):
        jtilert.convert(good, dst, dtype="bf16")
    jtilert.convert(good, dst, dtype="bf16", overwrite=True)  # a jtilert checkpoint: replaced
    assert json.loads((dst / "jtilert.json").read_text())["weight_format"] == "bf16"
    assert not list(tmp_path.glob(".dst*"))


def test_overwrite_refuses_what_is_not_a_checkpoint(good, tmp_path, capsys):
    """--overwrite never deletes a folder that is not a jtilert checkpoint: the error says what is there."""
    dst = tmp_path / "dst"
    (dst / "notes").mkdir(parents=True)
    (dst / "important.txt").write_text("x")
    (dst / "notes" / "a.md").write_text("y")
    with pytest.raises(FileExistsError, match=r"dst holds 2 files that are not a jtilert checkpoint "
                                              r"\(important.txt, notes\); remove them or choose another folder"):
        jtilert.convert(good, dst, overwrite=True)
    assert (dst / "important.txt").read_text() == "x" and (dst / "notes" / "a.md").exists()
    assert not list(tmp_path.glob(".dst*"))
    from jtilert.cli import main
    assert main(["convert", str(good), str(dst), "--overwrite", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds 2 files that are not a jtilert checkpoint" in err
    with pytest.raises(FileExistsError, match=r"holds 2 files that are not a jtilert checkpoint"):
        jtilert.save(jtilert.load(jtilert.convert(good, tmp_path / "ok")), dst, overwrite=True)
    assert (dst / "important.txt").exists()
    (tmp_path / "file").write_text("z")
    with pytest.raises(FileExistsError, match=r"file is a file, not a jtilert checkpoint"):
        jtilert.convert(good, tmp_path / "file", overwrite=True)
    (tmp_path / "empty").mkdir()
    jtilert.convert(good, tmp_path / "empty", overwrite=True)


def test_not_enough_disk_space_is_refused_up_front(good, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1000))
    fails(good, tmp_path, ValueError, r"not enough disk space for .*dst: the conversion needs 2.\d\d MB more in "
                                      r".*, which has 1.00 kB free")
    assert not list(tmp_path.glob(".dst*"))  # nothing was written: nothing kept


def test_disk_full_midway_keeps_a_resumable_partial(good, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = arrays.write_chunk

    def write_chunk(path, x, digest):
        calls["n"] += 1
        if calls["n"] == 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, x, digest)

    monkeypatch.setattr(arrays, "write_chunk", write_chunk)
    fails(good, tmp_path, ValueError, r"disk full writing parameter \S+ to .*/params/\S+/c/[0-9/]+; the partial "
                                      r"conversion is kept in .*\.dst\.partial \(not a usable checkpoint\): free "
                                      r"space and rerun")
    monkeypatch.undo()
    assert (tmp_path / ".dst.partial" / DONE_LOG).read_text().count("\n") > 5
    jtilert.convert(good, tmp_path / "dst")
    jtilert.verify(tmp_path / "dst", against=good)


def test_real_full_disk(good, tmp_path):
    """On a small tmpfs (root only): the disk fills while writing, the error names the tensor, and the
    conversion completes once space is freed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        filler = mnt / "filler"

        def fill(name, done, total):
            if done > 500_000 and not filler.exists():
                free = shutil.disk_usage(mnt).free
                with open(filler, "wb") as f:
                    f.write(b"\0" * max(free - 64 * 1024, 0))

        dst = mnt / "dst"
        with pytest.raises(ValueError, match=r"disk full writing parameter \S+ to .*/mnt/\.dst\.partial/params/"):
            jtilert.convert(good, dst, callback=fill)
        assert not dst.exists() and not (mnt / ".dst.partial" / "jtilert.json").exists()
        filler.unlink()
        jtilert.convert(good, dst)
        jtilert.verify(dst, against=good)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_concurrent_conversion_is_refused(good, tmp_path):
    tmp = tmp_path / ".dst.partial"
    tmp.mkdir()
    fd = os.open(tmp / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        fails(good, tmp_path, ValueError, r"another conversion is writing .*\.dst\.partial")
    finally:
        os.close(fd)


def test_partial_from_other_arguments(good, tmp_path):
    def stop(name, done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        jtilert.convert(good, tmp_path / "dst", tp=1, callback=stop)
    fails(good, tmp_path, ValueError, r"holds a partial conversion with other arguments or source files", dtype="bf16")
    jtilert.convert(good, tmp_path / "dst", dtype="bf16", overwrite=True)
    assert jtilert.load(tmp_path / "dst").layers.self_attn.q_b_proj.scale is None


def test_header_dtypes_match_hf_names():
    assert HF_DTYPE == {"float8_e4m3fn": "F8_E4M3", "float32": "F32", "bfloat16": "BF16"}
    assert all(hf.DTYPE_NAMES[v] == k for k, v in HF_DTYPE.items())
