"""Damaged checkpoints, a tp or a model that does not fit, unwritable destinations: each is one clear
error naming the file, field or bytes, raised before the work where it can be, with nothing left
behind and none of the pages of orbax or XLA output they used to produce."""

import errno
import gc
import json
import re
import shutil
from collections import namedtuple

import numpy as np
import pytest

import jtilert
from jtilert.parallel import sharding
from jtilert.store import checkpoint

Usage = namedtuple("Usage", "total used free")


@pytest.fixture(scope="module")
def saved(tiny_random, tmp_path_factory):
    path = tmp_path_factory.mktemp("saved") / "tiny"
    jtilert.save(tiny_random, path)
    return path


@pytest.fixture
def copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "copy")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The tiny architecture (bf16) converted for tp=2."""
    d = tmp_path_factory.mktemp("converted")
    src = jtilert.random_checkpoint("tiny", d / "src", fmt="bf16")
    return jtilert.convert(src, d / "tp2", tp=2)


def biggest(folder):
    return max((p for p in (folder / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip(path):
    """Invert one byte in the middle of a file (what a bad disk or a broken copy does)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- checksums ----------------------------------------------------------------------------------

def test_save_records_every_file_and_check_files_reads_them(saved):
    meta = checkpoint.read_meta(saved)
    files = meta["checksums"]["files"]
    on_disk = sorted(p.relative_to(saved).as_posix() for p in (saved / "params").rglob("*") if p.is_file())
    assert meta["checksums"]["algorithm"] == "crc32" and sorted(files) == on_disk
    assert checkpoint.check_files(saved, meta) == sum(size for size, _ in files.values())


def test_flipped_byte_in_a_saved_checkpoint_is_refused(copy):
    f = biggest(copy)
    flip(f)
    for _ in range(3):   # the reads a failure leaves are finished before it is raised: the process goes on
        with pytest.raises(ValueError) as e:   # the chunk's own checksum, as TensorStore reads it
            jtilert.load(copy)
        assert re.search(rf"{re.escape(str(f))}: checksum mismatch \(CRC-32C\)", str(e.value)), e.value
        gc.collect()
    assert jtilert.load("tiny").cfg.num_hidden_layers == 4


def test_truncated_saved_file_is_named_checked_or_not(copy, capfd):
    f = biggest(copy)
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(ValueError, match=rf"{re.escape(str(f))} has {size // 2:,} bytes, {size:,} were saved "
                                         r"\(truncated or replaced\)"):
        jtilert.load(copy)
    # unchecked, TensorStore meets it as it reads: its error in one line, nothing printed on the way
    capfd.readouterr()
    with pytest.raises(ValueError) as e:
        jtilert.load(copy, check=False)
    assert re.search(rf"^{re.escape(str(f))}: ", str(e.value)), e.value
    gc.collect()
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err and not re.search(r"^E\d{4} ", err, flags=re.M), err


def test_checkpoint_without_checksums_loads_with_a_warning(tmp_path):
    """An orbax-storage checkpoint (layouts 1 and 3: no chunk checksums) without file checksums."""
    old = shutil.copytree("jtilert/assets/tiny", tmp_path / "old")
    meta = json.loads((old / "jtilert.json").read_text())
    assert meta["layout_version"] < 4
    del meta["checksums"]
    (old / "jtilert.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="written without checksums: its files are not checked"):
        m = jtilert.load(old)
    a, b = checkpoint.flat_params(m), checkpoint.flat_params(jtilert.load("tiny"))
    assert all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def test_verify_checks_saved_and_converted_checkpoints(copy, converted):
    jtilert.verify(copy)   # every chunk's size and CRC-32C
    with pytest.raises(ValueError, match="was written by jtilert.save: `against` compares a converted"):
        jtilert.verify("tiny", against="tests/golden/dsv32")   # orbax storage: its recorded file checksums
    # a source of other shapes is named before the spot check (it failed on a reshape of an empty array)
    with pytest.raises(ValueError, match=rf"tests/golden/dsv32 is another model than {re.escape(str(converted))}: "
                                         r"vocab_size \d+ there, 256 here; hidden_size"):
        jtilert.verify(converted, against="tests/golden/dsv32")
    assert jtilert.verify(converted)["tp"] == 2
    flip(biggest(copy))
    with pytest.raises(ValueError, match="checksum mismatch"):
        jtilert.verify(copy)


def test_embedded_checkpoint_has_checksums():
    path = checkpoint.resolve("tiny")
    assert checkpoint.check_files(path, checkpoint.read_meta(path)) > 3_000_000


def test_tp_that_does_not_divide_the_model_fails_before_reading(saved, capfd):
    match = r"tp=3 does not divide the model's num_attention_heads=8, .* \(.*; tp can be 1, 2, 4, 8\)$"
    with pytest.raises(ValueError, match=match):
        jtilert.load(saved, mesh=jtilert.make_mesh(3))
    with pytest.raises(ValueError, match=match):
        jtilert.random_model("tiny", mesh=jtilert.make_mesh(3))
    assert "Exception ignored" not in capfd.readouterr().err
    with pytest.raises(ValueError, match="tp must be an integer >= 1, got 0"):
        jtilert.make_mesh(0)


def test_weights_and_cache_that_do_not_fit_name_the_bytes(saved, tiny_random, monkeypatch):
    """Where the device says what is free (GPUs), a model or cache larger than that is a MemoryError
    naming both, before anything is allocated (CPUs say nothing: the check is skipped there)."""
    params = checkpoint.flat_params(tiny_random)
    need = sum(x.nbytes for x in params.values())
    mesh = jtilert.make_mesh(8)
    per = sharding.bytes_per_device(params, mesh)
    split = sum(x.nbytes for k, x in params.items() if sharding.split_axis(tuple(k.split("."))) is not None)
    assert per == need - split + split // 8
    monkeypatch.setattr(sharding, "free_bytes", lambda device: (1000, 2000))
    free = r"more than the 0\.00 GiB \(1,000 bytes\) free on cpu:0 \(of 0\.00 GiB \(2,000 bytes\)\)"
    with pytest.raises(MemoryError, match=rf"the weights of random_model\('tiny', fmt='fp32'\): \d+\.\d\d GiB "
                                          rf"\({need:,} bytes\) per device, {free}"):
        jtilert.random_model("tiny", fmt="fp32")
    with pytest.raises(MemoryError, match=rf"the weights of {re.escape(str(saved))}: .*\({per:,} bytes\) per device"):
        jtilert.load(saved, mesh=mesh)
    with pytest.raises(MemoryError, match=r"the cache of Generator\(max_seq_len=2048\) \(2304 positions\): "):
        jtilert.Generator(tiny_random)


def test_the_engines_decode_copies_that_do_not_fit_name_the_bytes(monkeypatch):
    """The Engine's own copies (kv_b per head, the merged projections, the router in bf16) are checked
    like the weights: a MemoryError naming what and how many bytes per device, before they are
    allocated."""
    from flax import nnx
    from jtilert.model.transformer import decode_weights
    fp8 = jtilert.random_model("tiny", fmt="fp8", seed=1)
    fp32 = decode_weights(jtilert.random_model("tiny", fmt="fp32", seed=1), merge=False)   # kv_b per head only
    router = decode_weights(fp8)   # every copy made but the router's: its fp32 weight back
    router.moe.gate.weight = nnx.Param(fp8.moe.gate.weight.get_value())
    monkeypatch.setattr(sharding, "free_bytes", lambda device: (1000, 2000))
    with pytest.raises(MemoryError, match=r"kv_b per head in bfloat16 for the compiled steps: \d+\.\d\d GiB "
                                          r"\([\d,]+ bytes\) per device, more than the 0\.00 GiB \(1,000 bytes\) free"):
        decode_weights(fp8)
    with pytest.raises(MemoryError, match=r"the merged projections \[\d+, \d+, \d+\] for the compiled steps: "):
        decode_weights(fp32)
    need = fp8.moe.gate.weight.get_value().size * 2   # every layer's router [E, hidden] in bf16
    with pytest.raises(MemoryError, match=rf"the router in bfloat16 for the compiled steps: \d+\.\d\d GiB "
                                          rf"\({need:,} bytes\) per device"):
        decode_weights(router)
    assert fp8.layers.self_attn.absorb_q is None and fp32.layers.self_attn.x_proj is None


# ---- save --------------------------------------------------------------------------------------

def test_save_refuses_a_disk_without_room(tiny_random, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**6, 10**6 - 5000, 5000))
    need = sum(x.nbytes for x in checkpoint.flat_params(tiny_random).values())
    with pytest.raises(OSError, match=rf"cannot save to {re.escape(str(tmp_path / 'x'))}: the parameters need "
                                      rf"{need:,} bytes, {re.escape(str(tmp_path))} has 5,000 free") as e:
        jtilert.save(tiny_random, tmp_path / "x")
    assert e.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_save_onto_a_disk_that_fills_up(tiny_random, small_disk, monkeypatch, capfd, caplog):
    """The disk fills while orbax writes (the free-space check passed: here it is told of room that is not
    there): one OSError with TensorStore's reason, no orbax pages, nothing left on the disk."""
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**12, 0, 10**12))
    with pytest.raises(OSError, match=r"cannot save to .*/x: RESOURCE_EXHAUSTED: .*No space left on device") as e:
        jtilert.save(tiny_random, small_disk / "x")
    assert e.value.errno == errno.ENOSPC
    assert list(small_disk.iterdir()) == []
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_an_array_that_cannot_be_made_waits_for_the_writes_begun(tmp_path, monkeypatch):
    """When a later array cannot be made (its metadata write finds the disk full), the writes already
    begun end before the error is raised: the caller's cleanup then removes everything (none writes on
    behind it)."""
    from jtilert.store import arrays
    awaited = []

    class Write:
        def result(self):
            awaited.append(True)

    class Array:
        def __getitem__(self, index):
            return self

        def write(self, data):
            return Write()
    made = []

    def create(*a):
        made.append(a[1])
        if len(made) == 2:
            raise ValueError("RESOURCE_EXHAUSTED: No space left on device [os_error_code='28']")
        return Array()
    monkeypatch.setattr(arrays, "create", create)
    with pytest.raises(ValueError, match="No space left"):
        arrays.write_arrays(tmp_path, {"a": (np.ones(4, np.float32), (4,)), "b": (np.ones(4, np.float32), (4,))})
    assert made == ["a", "b"] and awaited == [True]


def test_a_failed_chunk_write_waits_for_the_arrays_other_chunks(tmp_path, monkeypatch):
    """TensorStore ends a write of many chunks at the first chunk that fails while the others go on; each
    chunk is therefore its own write, and every one of them ends before the error is raised."""
    from jtilert.store import arrays
    boxes, awaited = [], []

    class Write:
        def __init__(self, box):
            self.box = box

        def result(self):
            awaited.append(self.box)
            if self.box == (4, 8):
                raise ValueError("RESOURCE_EXHAUSTED: No space left on device [os_error_code='28']")

    class Array:
        def __getitem__(self, box):
            return Piece((box[0].start, box[0].stop))

    class Piece:
        def __init__(self, box):
            self.box = box

        def write(self, data):
            boxes.append((self.box, data.tolist()))
            return Write(self.box)
    monkeypatch.setattr(arrays, "create", lambda *a: Array())
    with pytest.raises(ValueError, match="No space left"):
        arrays.write_arrays(tmp_path, {"a": (np.arange(10, dtype=np.float32), (4,))})
    assert boxes == [((0, 4), [0, 1, 2, 3]), ((4, 8), [4, 5, 6, 7]), ((8, 10), [8, 9])]
    assert awaited == [(0, 4), (4, 8), (8, 10)]


def test_save_into_a_read_only_folder(tiny_random, read_only_dir):
    dst = read_only_dir / "x"
    with pytest.raises(OSError, match=rf"cannot save to {re.escape(str(dst))}: (Read-only file system|Permission "
                                      r"denied) \("):
        jtilert.save(tiny_random, dst)
    assert list(read_only_dir.iterdir()) == []
