"""The arrays of a jtilert checkpoint (layout 4): an orbax PyTree checkpoint of zarr3 arrays in plain files,
every chunk followed by its CRC-32C.

    params/_METADATA          orbax's tree metadata (zarr3, no OCDBT)
    params/<name>/zarr.json   the array's zarr3 metadata: shape, dtype, chunk grid, codecs `bytes` + `crc32c`
    params/<name>/c/<i>/...   one file per chunk: its bytes in C order, little-endian, then their CRC-32C

`<name>` is a parameter's dotted path in the model (`moe.experts.gate.weight`, stacked [L, ...] as the runtime
holds it). A chunk is one layer of a stack, whole rows of one tensor-parallel shard (`chunk_shape`), so a device
restoring its shard reads its own chunk files and no others. Plain orbax restores it:

    ocp.StandardCheckpointer().restore(DST / "params", target)

with `target` the nested dict of `jax.ShapeDtypeStruct`s (with their shardings) that `jtilert.json` describes;
TensorStore checks each chunk's CRC-32C as it reads it. This is orbax's own non-OCDBT zarr3 layout with another
codec list (orbax writes `sharding_indexed` zarr3 shards whose chunks carry no checksum), which TensorStore reads
from `zarr.json` whatever it is.

Writing: TensorStore creates each array (`create`); whole arrays are written through it (`write_arrays`), and a
writer holding one chunk at a time (the converter) writes each chunk file with `write_chunk`: the chunk's bytes
with O_DIRECT where the filesystem allows it (buffered writes cost several times the CPU), then the CRC-32C that
TensorStore's codec computes for them (`crc32c`), so the file is the one TensorStore would write.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import re
from pathlib import Path

import jax
import numpy as np
import tensorstore as ts

CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
CHUNK_BYTES = 32 << 20
TREE_METADATA = "_METADATA"
ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers aligned to this
DIRECT = {"ok": hasattr(os, "O_DIRECT") and os.environ.get("JTILERT_NO_DIRECT_IO") != "1"}


def context() -> ts.Context:
    """TensorStore resources for writing: no fsync per chunk file (writers sync the filesystem once, at the
    end)."""
    return ts.Context({"file_io_sync": False})


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def chunk_shape(shape: tuple, itemsize: int, split: int | None = None, tp: int = 1, budget: int = CHUNK_BYTES,
                lead: int = 0) -> tuple:
    """The chunk shape of an array: 1 on the first `lead` axes (the layer axis of a stack), the last axis whole
    (its tp shard's part when it is the split axis), then, from the back, whole axes while the chunk stays
    within `budget` bytes, the largest divisor of the next axis that fits, and 1 before it. Along the split
    axis a chunk divides the shard, so a device's shard is whole chunks. Where the last axis is split, a row
    of the array spans tp chunks that fill together, so each gets budget / tp."""
    if not shape:
        return ()
    local = list(shape)
    if split is not None:
        local[split] //= tp
    if split == len(shape) - 1 and tp > 1:
        budget //= tp
    chunk = [1] * len(shape)
    chunk[-1] = local[-1]
    size = local[-1] * itemsize
    for ax in range(len(shape) - 2, lead - 1, -1):
        fit = [d for d in _divisors(local[ax]) if size * d <= budget]
        chunk[ax] = fit[-1] if fit else 1
        if chunk[ax] < local[ax]:
            break
        size *= local[ax]
    return tuple(chunk)


def spec(root: Path, name: str) -> dict:
    """The TensorStore spec of array `name` of the checkpoint arrays folder `root` (what orbax opens)."""
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(Path(root).absolute() / name) + "/"}}


def create(root: Path, name: str, shape: tuple, dtype, chunk: tuple, ctx: ts.Context) -> ts.TensorStore:
    """Open array `name` for writing, creating its zarr.json, or opening an existing one (a resumed write),
    which must have the same metadata. Every chunk is stored, zeros too (by default TensorStore skips a chunk
    equal to the fill value, and readers that want every chunk, orbax's among them, would find it missing)."""
    metadata = {"shape": list(shape), "data_type": np.dtype(dtype).name, "fill_value": 0, "codecs": CODECS,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
                "chunk_key_encoding": {"name": "default"}}
    s = dict(spec(root, name), metadata=metadata, store_data_equal_to_fill_value=True)
    return ts.open(s, create=True, open=True, context=ctx).result()


def open_array(root: Path, name: str, ctx: ts.Context | None = None) -> ts.TensorStore:
    """An array for reading: missing chunks are errors, not zeros."""
    return ts.open(dict(spec(root, name), fill_missing_data_reads=False), read=True,
                   context=ctx or ts.Context()).result()


def write_tree_metadata(root: Path, arrays: dict[str, tuple]) -> None:
    """orbax's `_METADATA` for arrays {dotted name: (shape of one device's shard)}: the nested-dict tree with
    each array a jax.Array stored as zarr3 without OCDBT."""
    tree = {}
    for name, write_shape in sorted(arrays.items()):
        keys = name.split(".")
        tree[str(tuple(keys))] = {
            "key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2: a dict key
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False,
                               "write_shape": list(write_shape)}}
    meta = {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": True,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}
    (Path(root) / TREE_METADATA).write_text(json.dumps(meta, indent=1))


def chunk_boxes(shape: tuple, chunk: tuple, lead: tuple = ()):
    """(chunk grid index, box as slices) of every chunk, in C order; with `lead`, only the chunks whose first
    indices are `lead` (one layer of a stack)."""
    grid = [-(-n // c) for n, c in zip(shape, chunk)]
    for idx in np.ndindex(*grid[len(lead):]):
        idx = tuple(lead) + tuple(int(i) for i in idx)
        yield idx, tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunk, shape))


def chunk_key(idx: tuple) -> str:
    """A chunk's file, relative to its array's folder."""
    return "/".join(["c", *map(str, idx)])


def read_error(e: Exception) -> str:
    """TensorStore's error for a bad chunk, as a short phrase (the file named by the caller)."""
    msg = str(e)
    if "Digest mismatch" in msg:
        return "checksum mismatch (CRC-32C)"
    if "is missing" in msg or "NOT_FOUND" in msg:
        return "missing"
    return re.sub(r'^[A-Z_]+: (Error reading local file "[^"]*": )?', "", msg.splitlines()[0])


class Checker:
    """Reads chunks back through TensorStore (which checks their CRC-32C) a few at a time, holding at most
    about `budget` bytes, after checking each chunk file's size (bytes past the checksum go unnoticed by a
    read): `check(arr, folder, boxes)` yields (chunk index, problem or None)."""

    def __init__(self, budget: int = CHUNK_BYTES, ahead: int = 4):
        self.budget, self.ahead = budget, ahead

    def check(self, arr: ts.TensorStore, folder: Path, boxes, advance=None):
        pending, held = [], 0
        itemsize = arr.dtype.numpy_dtype.itemsize

        def settle(p):
            idx, fut, nbytes = p
            if advance:
                advance(nbytes)
            if isinstance(fut, str):
                return idx, fut, nbytes
            try:
                fut.result()
            except Exception as e:  # TensorStore's errors are ValueError, or others for I/O failures
                return idx, read_error(e), nbytes
            return idx, None, nbytes

        for idx, box in boxes:
            nbytes = int(np.prod([s.stop - s.start for s in box])) * itemsize
            while pending and (len(pending) >= self.ahead or held + nbytes > self.budget):
                i, problem, n = settle(pending.pop(0))
                held -= n
                yield i, problem
            f = Path(folder) / chunk_key(idx)
            size = f.stat().st_size if f.exists() else None
            if size is None:
                pending.append((idx, "missing", nbytes))
            elif size != nbytes + 4:
                pending.append((idx, f"{size} bytes, the chunk needs {nbytes + 4}", nbytes))
            else:
                pending.append((idx, arr[box].read(), nbytes))
            held += nbytes
        for p in pending:
            i, problem, n = settle(p)
            yield i, problem


def write_arrays(root: Path, arrays: dict[str, tuple]) -> None:
    """Write whole arrays {name: (jax or numpy array, chunk shape)} and the tree metadata: one replica of each
    device's shard, in one TensorStore write per chunk. A write of many chunks ends with the first chunk that
    fails while the others go on writing; a write of one chunk ends only when its file is written or has
    failed, so once every write has ended, none runs on behind an error (and the caller's cleanup)."""
    root.mkdir(parents=True, exist_ok=True)
    ctx = context()
    writes, shards, errors = [], {}, []
    try:
        for name, (x, chunk) in arrays.items():
            arr = create(root, name, x.shape, x.dtype, chunk, ctx)
            if isinstance(x, jax.Array):
                parts = [(s.index, s.data) for s in x.addressable_shards if s.replica_id == 0]
                shards[name] = x.sharding.shard_shape(x.shape)
            else:
                parts = [((slice(None),) * x.ndim, x)]
                shards[name] = x.shape
            for index, data in parts:
                writes += [arr[box].write(piece) for box, piece in _chunk_pieces(x.shape, chunk, index, data)]
    except Exception as e:  # an array that cannot be made (a full disk): the writes begun still end first
        errors.append(e)
    for w in writes:   # every write finishes before an error is raised: none runs on behind it
        try:
            w.result()
        except Exception as e:  # TensorStore's errors are ValueError, or others for I/O failures
            errors.append(e)
    if errors:
        raise errors[0]
    write_tree_metadata(root, shards)


def _chunk_pieces(shape: tuple, chunk: tuple, index: tuple, data):
    """(box in the array, numpy data) of each chunk's part in the shard `data` at `index` (slices): the
    chunks of the grid that the shard's box overlaps, each cut to the shard."""
    data = np.asarray(data)
    lo = [sl.indices(n)[0] for sl, n in zip(index, shape)]
    hi = [a + m for a, m in zip(lo, data.shape)]
    for idx in itertools.product(*(range(a // c, -(-b // c)) for a, b, c in zip(lo, hi, chunk))):
        cut = tuple(slice(max(i * c, a), min((i + 1) * c, b)) for i, c, a, b in zip(idx, chunk, lo, hi))
        yield cut, data[tuple(slice(c.start - a, c.stop - a) for c, a in zip(cut, lo))]


_encoders: dict = {}


def crc32c(x: np.ndarray) -> bytes:
    """The 4 bytes the `crc32c` codec appends to the bytes of chunk `x` (C order, little-endian), as TensorStore
    computes them: x is encoded as the one chunk of an in-memory zarr3 array with this module's codecs."""
    key = (x.shape, x.dtype.str)
    if key not in _encoders:
        metadata = {"shape": list(x.shape) or [1], "data_type": x.dtype.name, "fill_value": 0, "codecs": CODECS,
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(x.shape) or [1]}}}
        _encoders[key] = ts.open({"driver": "zarr3", "kvstore": {"driver": "memory"}, "metadata": metadata,
                                  "store_data_equal_to_fill_value": True}, create=True).result()
    arr = _encoders[key]
    arr.write(x.reshape(arr.shape), can_reference_source_data_indefinitely=True).result()
    name = chunk_key((0,) * max(x.ndim, 1))
    digest = arr.kvstore.read(name, byte_range=slice(x.nbytes, x.nbytes + 4)).result().value
    arr.kvstore.delete_range(ts.KvStore.KeyRange(name, name + "\0")).result()
    return digest


def write_chunk(path: Path, x: np.ndarray, digest: bytes) -> None:
    """Write chunk file `path`: the bytes of `x` (C-contiguous), then `digest` (their CRC-32C). Whole pages go out
    with O_DIRECT when x starts on a page (large writes that skip the page cache cost far less CPU than
    buffered ones), the rest with an ordinary write; where O_DIRECT is refused (tmpfs, some network
    filesystems) everything is an ordinary write."""
    data = memoryview(x.reshape(-1).view(np.uint8))
    direct = DIRECT["ok"] and x.ctypes.data % ALIGN == 0 and len(data) >= ALIGN
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = None
    if direct:
        try:
            fd = os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError:
            direct = False
    if fd is None:
        fd = os.open(path, flags, 0o644)
    try:
        done = 0
        if direct:
            aligned = len(data) // ALIGN * ALIGN
            try:
                while done < aligned:
                    done += os.write(fd, data[done:aligned])
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: this filesystem wants other alignment
                    raise
                DIRECT["ok"] = False
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
        os.pwrite(fd, digest, len(data))
    finally:
        os.close(fd)
        data.release()


class DamagedChunk(ValueError):
    """A chunk file that cannot be read back (checksum mismatch, missing, short): its message names it."""


READ_BYTES = 1 << 30   # bytes of reads in flight at once while restoring (the host memory they hold)


def _read_spec(root: Path, name: str, tree: dict) -> dict:
    """The TensorStore spec orbax reads array `name` with, from the tree metadata `tree` (`_METADATA`):
    zarr3 in plain files (layout 4), or zarr / zarr3 inside an OCDBT database (orbax's default, layouts 1, 3)."""
    if tree.get("use_ocdbt"):
        kv = {"driver": "ocdbt", "base": f"file://{root}/", "path": f"{name}/"}
    else:
        kv = spec(root, name)["kvstore"]
    # a writer that skipped chunks equal to the fill value (orbax's default before layout 4) left them out
    missing_is_zero = not tree.get("store_array_data_equal_to_fill_value", False)
    return {"driver": "zarr3" if tree.get("use_zarr3") else "zarr", "kvstore": kv,
            "fill_missing_data_reads": missing_is_zero}


def _damaged(root: Path, name: str, e: Exception) -> DamagedChunk:
    """TensorStore's error reading array `name` as one line naming the file (the chunk's, where it says)."""
    m = re.search(r'local file "([^"]+)"', str(e))
    where = Path(m.group(1)) if m else root / name
    return DamagedChunk(f"{where}: {read_error(e)} (run `jtilert verify` on the checkpoint to list every "
                        f"damaged chunk)")


def restore(root: Path, target: dict, budget: int = READ_BYTES) -> dict:
    """Read the arrays {dotted name: jax.ShapeDtypeStruct with its sharding} of an orbax checkpoint folder
    into jax.Arrays, as orbax's restore would, with each device's shard read once per distinct index and
    at most about `budget` bytes of reads in flight (a shard larger than that is read alone). TensorStore checks each zarr3 chunk's CRC-32C as it
    reads it. A damaged chunk is a DamagedChunk naming its file, raised only after every read already
    started has finished: no read is left running behind the error."""
    root = Path(root).absolute()
    try:
        tree = json.loads((root / TREE_METADATA).read_text())
    except (OSError, ValueError) as e:
        raise DamagedChunk(f"{root / TREE_METADATA}: {e.strerror if isinstance(e, OSError) else e}") from None
    ctx = ts.Context()
    opening = {name: ts.open(_read_spec(root, name, tree), read=True, context=ctx) for name in target}
    stores, errors = {}, []
    for name, f in opening.items():
        try:
            stores[name] = f.result()
        except Exception as e:  # TensorStore's errors are ValueError, or others for I/O failures
            errors.append(_damaged(root, name, e))
    if errors:
        raise errors[0]
    for name, t in target.items():
        if tuple(stores[name].shape) != tuple(t.shape):
            raise DamagedChunk(f"{root / name}: shape {tuple(stores[name].shape)}, the checkpoint's "
                               f"metadata says {tuple(t.shape)}")

    reads = []   # (name, index, devices that hold that index)
    for name, t in target.items():
        groups: dict = {}
        for device, index in t.sharding.addressable_devices_indices_map(t.shape).items():
            key = tuple((s.start, s.stop, s.step) for s in index)
            groups.setdefault(key, (index, []))[1].append(device)
        reads += [(name, index, devices) for index, devices in groups.values()]

    shards: dict = {name: [] for name in target}
    pending, held = [], 0

    def settle():
        nonlocal held
        name, devices, fut, nbytes = pending.pop(0)
        held -= nbytes
        try:
            data = fut.result()
        except Exception as e:
            errors.append(_damaged(root, name, e))
            return
        data = data.astype(target[name].dtype, copy=False)
        shards[name] += [jax.device_put(data, d) for d in devices]

    for name, index, devices in reads:
        if errors:
            break   # no new reads; those in flight finish below
        box = stores[name][index]
        nbytes = int(np.prod(box.shape)) * box.dtype.numpy_dtype.itemsize
        while pending and held + nbytes > budget:
            settle()
        pending.append((name, devices, box.read(), nbytes))
        held += nbytes
    while pending:
        settle()
    if errors:
        raise errors[0]
    return {name: jax.make_array_from_single_device_arrays(t.shape, t.sharding, shards[name])
            for name, t in target.items()}
