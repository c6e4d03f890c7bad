"""Streaming HF → jtilert conversion, laid out for tensor parallelism, with progress, resumption and verification.

`convert(SRC, DST, tp=N)` reads an HF folder (index json + safetensors; fp8 with `weight_scale_inv`, bf16 or
fp32; the MTP layer; GLM-5.2 shared-indexer layers) and writes a jtilert checkpoint whose tp-split parameters
are stored as N separate per-device files, so that `jtilert.load(DST, mesh=...)` reads each device's shard
straight onto that device.

Layout (`layout_version` 2):

    DST/jtilert.json                  config, weight format, tp, pack layout, every parameter's shape, dtype,
                                      split axis, stored shard shape and per-shard CRC-32
    DST/params/replicated/<name>.bin  a replicated parameter: raw C-order bytes
    DST/params/tp<d>/<name>.bin       shard d of a tp-split parameter: slice d of its split axis, raw C-order
                                      (stacked experts [E, out, in] keep the expert axis: shard d is [E, out/N, in])

Weights are rearranged once, here, by a per-kind `Packer` (the place for kernel-specific swizzles; identity
today). The packers' names are recorded in the metadata; loading refuses a checkpoint packed otherwise than
this process would pack it, and (for now) unpacks to the logical layout the model modules expect.

I/O: a reader thread reads the source in pieces of whole rows (pread with O_DIRECT into pooled aligned
buffers where the filesystem allows it, else through the page cache; never a memory map, so resident memory
is only what is held), a converter thread casts / dequantises / quantises and cuts the tp shards (views, no
copy, for a plain fp8 → fp8 conversion), and the writer copies each shard's bytes into an aligned staging
buffer, checksums them (CRC-32) and writes full buffers with O_DIRECT, the unaligned tail of a file
normally. Stacked experts are streamed one expert at a time into their per-shard files.

Memory bound: with `chunk_bytes` = C (32 MiB by default) a read is at most C bytes counted as fp32, at most
C bytes of read buffers are lent to pieces waiting for the writer, and the staging buffers hold C in all
(tp buffers of C/tp). Peak RSS ≤ RSS after import + 5·C + O(metadata) (a few MB; ~30 MB for the full
61-layer plan), whatever the size of the checkpoint. `tests/test_convert_memory.py` measures it (C = 4 MiB:
+20 MB converting a 480 MB checkpoint); a full-width 2-layer DeepSeek-V3.2 (15.8 GB) at C = 32 MiB: +92 MB.

Interruption: everything is written to the hidden sibling `.DST.partial/`, with a log of finished tensors
(their files' sizes and CRC-32). Rerunning the same command verifies each logged tensor's files (size and
checksum) and skips it; anything else is rewritten. `jtilert.json` is written last and the folder is renamed
to DST only when complete, so nothing at DST ever looks complete before it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import mmap
import os
import queue
import re
import shutil
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from jtilert.store import hf
from jtilert.parallel import sharding
from jtilert.store.folder import META, move_into_place, np_dtype, read_meta
from jtilert.model.transformer import abstract_model, layer_params
from jtilert.model.config import ModelConfig
from jtilert.ops.quant import BLOCK, FP8_MAX, scale_shape
from jtilert.model.transformer import compute_dtype

LAYOUT_VERSION = 2  # per-shard raw files (layout 1 is jtilert.save's orbax checkpoint)
CHUNK_BYTES = 32 << 20
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
F32 = np.dtype(np.float32)
FLOATS = {np.dtype(np.float64), F32, np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), FP8}
FORMATS = ("fp8", "bf16", "fp32")
DONE_LOG = "done.jsonl"
REQUEST = "request.json"
ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers aligned to this
_direct = {"ok": hasattr(os, "O_DIRECT") and os.environ.get("JTILERT_NO_DIRECT_IO") != "1"}
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


class ConvertError(ValueError):
    """A conversion failed (bad input, full disk, ...); the message names the file or tensor."""


# ---- weight layouts for the kernels -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Packer:
    """How one kind of parameter is stored. `pack` is applied to every piece written: whole rows (a multiple
    of 128 rows, except a matrix's last piece) of one tp shard of one matrix (one expert of a stacked
    parameter), so it must act on 128-row tiles independently. `unpack` inverts it (for spot checks and
    resharding); `stored_shape` maps a shard's logical shape to its stored one."""
    name: str
    pack: Callable[[np.ndarray], np.ndarray]
    unpack: Callable[[np.ndarray], np.ndarray] | None = None
    stored_shape: Callable[[tuple], tuple] = tuple


IDENTITY = Packer("identity", lambda x: x, lambda x: x)
KINDS = ("embedding", "lm_head", "vector", "router", "linear_weight", "linear_scale", "expert_weight", "expert_scale")
PACKERS: dict[str, Packer] = {k: IDENTITY for k in KINDS}


def register_pack(kind: str, packer: Packer) -> None:
    """Store parameters of `kind` through `packer` from now on (a checkpoint records which packers wrote it,
    and loading refuses one written with others)."""
    if kind not in KINDS:
        raise ValueError(f"unknown parameter kind {kind!r}; kinds: {KINDS}")
    PACKERS[kind] = packer


def pack_layout() -> dict[str, str]:
    return {k: PACKERS[k].name for k in KINDS}


def param_kind(name: str, ndim: int) -> str:
    if name == "embed_tokens":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if ndim <= 1:
        return "vector"
    if name.endswith("mlp.gate.weight"):
        return "router"
    base = "expert" if ".experts." in name else "linear"
    return f"{base}_{'scale' if name.endswith('.scale') else 'weight'}"


def shard_files(name: str, shards: int) -> list[str]:
    """Paths (relative to the checkpoint) of a parameter's files."""
    if shards == 1:
        return [f"params/replicated/{name}.bin"]
    return [f"params/tp{d}/{name}.bin" for d in range(shards)]


# ---- the conversion plan ----------------------------------------------------------------------

@dataclasses.dataclass
class Mat:
    """One source matrix: rows row0:row0+rows of HF tensor `key` viewed as 2-D [rows, cols]."""
    file: hf.SafetensorsFile
    key: str
    row0: int
    rows: int
    cols: int
    dtype: np.dtype
    scale: "Mat | None" = None  # its fp8 block scales

    def read(self, fds: "_Files", a: int, b: int, pool: "_Pool | None" = None):
        """Rows a:b as an array; with a pool, (array, lease of the buffer holding it or None)."""
        row = self.cols * self.dtype.itemsize
        x, lease = _read_bytes(fds, self.file.path, self.file.data_offset(self.key) + (self.row0 + a) * row,
                               (b - a) * row, pool)
        x = x.view(self.dtype).reshape(b - a, self.cols)
        return x if pool is None else (x, lease)

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.dtype.itemsize + (self.scale.nbytes if self.scale else 0)


@dataclasses.dataclass
class Item:
    """One jtilert parameter to write."""
    name: str
    shape: tuple          # the model's shape
    dtype: np.dtype       # stored dtype
    split: int | None     # the tp-split axis of `shape`
    shards: int           # files: tp for split parameters, else 1
    mats: list[Mat]       # one per expert of a stacked parameter, else one
    mode: str             # "cast", "dequant" (fp8 → float), "quant" (float → fp8), "scale" (the block scales of "quant")

    @property
    def kind(self) -> str:
        return param_kind(self.name, len(self.shape))

    @property
    def local_shape(self) -> tuple:
        s = list(self.shape)
        if self.split is not None:
            s[self.split] //= self.shards
        return tuple(s)

    @property
    def stored_shape(self) -> tuple:
        return tuple(PACKERS[self.kind].stored_shape(self.local_shape))

    @property
    def shard_bytes(self) -> int:
        return int(np.prod(self.stored_shape)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shard_bytes * self.shards

    @property
    def msplit(self) -> int | None:
        """The split axis within one matrix (stacked experts: the axis after the expert axis)."""
        if self.split is None:
            return None
        return self.split - (len(self.shape) - 2)

    @property
    def files(self) -> list[str]:
        return shard_files(self.name, self.shards)

    def meta(self) -> dict:
        return {"split": self.split, "shards": self.shards, "stored": list(self.stored_shape), "kind": self.kind,
                "pack": PACKERS[self.kind].name}


@dataclasses.dataclass
class Plan:
    src: Path
    cfg: ModelConfig
    fmt: str              # the written weight format
    source_format: str
    tp: int
    layers: tuple[int, int]
    items: list[Item]
    files: list[hf.SafetensorsFile]

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def request(self) -> dict:
        """What the output depends on (a partial conversion resumes only for the same request)."""
        return {"layout_version": LAYOUT_VERSION, "source": str(self.src.absolute()),
                "files": {str(f.path.name): [f.path.stat().st_size, f.path.stat().st_mtime_ns] for f in self.files},
                "tp": self.tp, "weight_format": self.fmt, "layers": list(self.layers),
                "mtp": self.cfg.num_nextn_predict_layers, "pack": pack_layout()}


def _source_format(tensors: dict, src: Path) -> str:
    if any(k.endswith("weight_scale_inv") for k in tensors):
        return "fp8"
    key = "model.embed_tokens.weight"
    if key not in tensors:
        raise ConvertError(f"{src}: no {key} tensor")
    return "fp32" if tensors[key].meta(key)[1] == F32 else "bf16"


def parse_layers(layers, n: int) -> tuple[int, int]:
    """`a:b` (either end optional) or (a, b): decoder layers a..b-1 of n."""
    if layers is None:
        return 0, n
    if isinstance(layers, str):
        m = re.fullmatch(r"\s*(\d*)\s*:\s*(\d*)\s*", layers)
        if not m:
            raise ConvertError(f"layers {layers!r}: expected a:b (e.g. 0:4)")
        a, b = int(m.group(1) or 0), int(m.group(2) or n)
    else:
        a, b = layers
    if not 0 <= a < b <= n:
        raise ConvertError(f"layers {a}:{b}: need 0 <= a < b <= {n} (the model has {n} decoder layers)")
    return a, b


def subset_config(cfg: ModelConfig, a: int, b: int) -> ModelConfig:
    """The config of decoder layers a..b-1 renumbered from 0 (dense/MoE and indexer kinds kept)."""
    if (a, b) == (0, cfg.num_hidden_layers):
        return cfg
    types = cfg.indexer_types[a:b]
    if types[0] != "full":
        raise ConvertError(f"layers {a}:{b}: layer {a} reuses an earlier layer's indexer (a GLM-5.2 'shared' "
                           f"layer); start the range at a layer with its own indexer")
    fkd = min(max(cfg.first_k_dense_replace - a, 0), b - a)
    return cfg.replace(num_hidden_layers=b - a, first_k_dense_replace=fkd, indexer_types=types)


def _renumber(name: str, a: int, b: int) -> str | None:
    m = re.match(r"layers\.(\d+)\.", name)
    if not m:
        return name
    i = int(m.group(1))
    if not a <= i < b:
        return None
    return f"layers.{i - a}." + name[m.end():]


def plan(src: str | os.PathLike, tp: int = 1, dtype: str | None = None, layers=None, mtp: bool = True) -> Plan:
    """Check an HF folder against its config and work out every parameter to write (reads only headers).
    Every bad input is a ValueError/FileNotFoundError naming the file and tensor."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"no HF model folder at {src}")
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src}: no config.json (not an HF model folder)")
    if not isinstance(tp, int) or tp < 1:
        raise ConvertError(f"tp={tp!r}: must be a positive integer")
    if dtype is not None and dtype not in FORMATS:
        raise ConvertError(f"dtype {dtype!r}: expected one of {FORMATS}")
    raw = ModelConfig.from_hf(src).to_hf()  # validates model_type etc. before touching the tensors
    n = raw["num_hidden_layers"]
    tensors = hf.open_folder(src)
    has_mtp = any(k.startswith(f"model.layers.{n}.") for k in tensors)
    cfg = ModelConfig.from_hf(src, num_nextn_predict_layers=int(has_mtp and mtp))
    a, b = parse_layers(layers, n)
    cfg = subset_config(cfg, a, b)
    source_format = _source_format(tensors, src)
    fmt = dtype or source_format
    expected = {k: (tuple(v.shape), np.dtype(v.dtype))
                for k, v in layer_params(abstract_model(cfg, fmt)).items()}

    # every source tensor, by the parameter it feeds
    single: dict[str, tuple] = {}
    experts: dict[str, dict[int, tuple]] = {}
    fused: dict[str, tuple] = {}   # transformers' [E, 2I, H] gate_up / [E, H, I] down: name -> (file, key, part)
    origin: dict[str, str] = {}    # parameter -> a source key (for messages)
    for key, f in tensors.items():
        try:
            t = hf.target_name(key, n)
        except ValueError as e:
            raise ConvertError(f"{f.path}: {e}") from None
        if t is None:
            continue
        name, e = t
        name = _renumber(name, a, b)
        if name is None or (name.startswith("mtp.") and not cfg.num_nextn_predict_layers):
            continue
        if name.endswith("experts.gate_up.weight"):
            for part, leaf in enumerate(("gate", "up")):
                fused[name.replace("gate_up", leaf)] = (f, key, part)
                origin[name.replace("gate_up", leaf)] = key
        elif name.endswith("experts.down.weight") and e is None:
            fused[name], origin[name] = (f, key, None), key
        elif e is not None:
            experts.setdefault(name, {})[e] = (f, key)
            origin[name] = key
        else:
            single[name], origin[name] = (f, key), key

    def where(f, key):
        return f"{f.path}: tensor {key}"

    def check_float(f, key, name):
        dt = f.meta(key)[1]
        if dt not in FLOATS:
            raise ConvertError(f"{where(f, key)} has dtype {dt.name}; parameter {name} needs a float type")
        return dt

    def scale_mat(f, key, wshape, skey_src):
        """The Mat of the block scales of fp8 weight (f, key) of shape wshape, checked."""
        if skey_src is None:
            hint = ""
            if key + "_scale" in tensors or key.removesuffix(".weight") + ".weight_scale" in tensors:
                hint = "; it has a weight_scale (compressed-tensors per-channel scales), which jtilert does not read"
            raise ConvertError(f"{where(f, key)} is float8_e4m3fn but has no {key}_scale_inv (128×128 block "
                               f"scales){hint}")
        sf, skey = skey_src
        sshape, sdt = sf.meta(skey)
        if sdt not in (F32, np.dtype(ml_dtypes.bfloat16)):
            raise ConvertError(f"{where(sf, skey)} has dtype {sdt.name}; block scales must be float32 (or bfloat16)")
        if tuple(sshape) != scale_shape(wshape):
            raise ConvertError(f"{where(sf, skey)} has shape {tuple(sshape)}, but its weight {key} of shape "
                               f"{tuple(wshape)} needs block scales of shape {scale_shape(wshape)}")
        return Mat(sf, skey, 0, sshape[0], sshape[1], sdt)

    items: list[Item] = []
    used: set[str] = set()
    for name, (shape, dt) in expected.items():
        if name.endswith(".scale"):
            continue  # made with its weight
        sname = name.removesuffix("weight") + "scale" if name.endswith(".weight") else None
        to_fp8 = sname in expected
        stacked = name in experts or name in fused or ".experts." in name
        mats: list[Mat] = []
        if stacked:
            n_exp, rows, cols = shape
            if name in fused:
                f, key, part = fused[name]
                fshape = tuple(f.meta(key)[0])
                want = (n_exp, 2 * rows, cols) if part is not None else shape
                if fshape != want:
                    raise ConvertError(f"{where(f, key)} has shape {fshape}, the config needs {want} "
                                       f"(parameter {name})")
                dt_src = check_float(f, key, name)
                if dt_src == FP8:
                    raise ConvertError(f"{where(f, key)}: fused fp8 expert tensors are not supported")
                per = want[1]
                mats = [Mat(f, key, e * per + (part or 0) * rows, rows, cols, dt_src) for e in range(n_exp)]
                used.add(name)
            elif name in experts:
                per = experts[name]
                missing = sorted(set(range(n_exp)) - set(per))
                if missing:
                    raise ConvertError(f"{src}: parameter {name} is missing experts {missing[:8]} "
                                       f"(no {_hf_key(name, a, n).format(e=missing[0])})")
                extra = sorted(set(per) - set(range(n_exp)))
                if extra:
                    f, key = per[extra[0]]
                    raise ConvertError(f"{where(f, key)}: expert {extra[0]} beyond the config's {n_exp} experts")
                sc_all = experts.get(name.removesuffix("weight") + "scale", {})
                for e in range(n_exp):
                    f, key = per[e]
                    fshape = tuple(f.meta(key)[0])
                    if fshape != (rows, cols):
                        raise ConvertError(f"{where(f, key)} has shape {fshape}, the config needs {(rows, cols)} "
                                           f"(expert {e} of parameter {name})")
                    dt_src = check_float(f, key, name)
                    m = Mat(f, key, 0, rows, cols, dt_src)
                    if dt_src == FP8:
                        m.scale = scale_mat(f, key, fshape, sc_all.get(e))
                    elif e in sc_all:
                        sf, skey = sc_all[e]
                        raise ConvertError(f"{where(sf, skey)}: block scales for {key}, which is {dt_src.name}, not fp8")
                    mats.append(m)
                used.update({name, name.removesuffix("weight") + "scale"})
            else:
                raise ConvertError(f"{src}: no tensors for parameter {name} (expected "
                                   f"{_hf_key(name, a, n).format(e=0)} and the other experts)")
        else:
            if name not in single:
                raise ConvertError(f"{src}: no tensor for parameter {name} of shape {shape} "
                                   f"(expected HF key {_hf_key(name, a, n)})")
            f, key = single[name]
            fshape = tuple(f.meta(key)[0])
            if fshape != shape:
                raise ConvertError(f"{where(f, key)} has shape {fshape}, the config needs {shape} (parameter {name})")
            dt_src = check_float(f, key, name)
            rows, cols = (int(np.prod(shape[:-1])), shape[-1]) if len(shape) else (1, 1)
            m = Mat(f, key, 0, rows, cols, dt_src)
            scale_name = name.removesuffix("weight") + "scale" if name.endswith(".weight") else None
            if dt_src == FP8:
                if len(shape) != 2:
                    raise ConvertError(f"{where(f, key)} is float8_e4m3fn, but fp8 is only supported for matrices")
                m.scale = scale_mat(f, key, fshape, single.get(scale_name))
            elif scale_name in single:
                sf, skey = single[scale_name]
                raise ConvertError(f"{where(sf, skey)}: block scales for {key}, which is {dt_src.name}, not fp8")
            mats = [m]
            used.update({name, scale_name} if scale_name else {name})
        src_fp8 = mats[0].dtype == FP8
        if to_fp8:
            mode = "cast" if src_fp8 else "quant"
        else:
            mode = "dequant" if src_fp8 else "cast"
        split = sharding.split_axis(tuple(name.split(".")))
        shards = tp if split is not None else 1
        if split is not None and shape[split] % tp:
            raise ConvertError(f"parameter {name} of shape {shape}: axis {split} ({shape[split]}) does not divide "
                               f"by tp={tp}")
        if to_fp8 and split is not None and tp > 1 and (shape[split] // tp) % BLOCK:
            raise ConvertError(f"parameter {name} of shape {shape}: fp8 block scales need each of the tp={tp} "
                               f"slices of axis {split} ({shape[split]} / {tp}) to be a multiple of {BLOCK}")
        items.append(Item(name, shape, dt, split, shards, mats, mode))
        if to_fp8:
            sshape, sdt = expected[sname]
            if src_fp8:
                smats = [m.scale for m in mats]
                items.append(Item(sname, sshape, sdt, split, shards, smats, "cast"))
            else:
                items.append(Item(sname, sshape, sdt, split, shards, mats, "scale"))
    unexpected = sorted((set(single) | set(experts) | set(fused)) - used)
    if unexpected:
        raise ConvertError(f"{src}: tensors with no place in a {cfg.model_type} model ({fmt}): "
                           + ", ".join(f"{origin[k]} (→ {k})" for k in unexpected[:5]))
    # read the files in order
    items.sort(key=lambda it: (str(it.mats[0].file.path), it.mats[0].file.data_offset(it.mats[0].key)
                               + it.mats[0].row0, it.mode == "scale"))
    files = sorted({id(f): f for f in tensors.values()}.values(), key=lambda f: f.path)
    return Plan(src, cfg, fmt, source_format, tp, (a, b), items, files)


def _hf_key(name: str, a: int, n: int) -> str:
    m = re.match(r"layers\.(\d+)\.", name)
    if m:
        name = f"layers.{int(m.group(1)) + a}." + name[m.end():]
    return hf.source_name(name, n)


# ---- streaming one parameter ------------------------------------------------------------------

DIRECT_READ_MIN = 1 << 20  # reads at least this large bypass the page cache (O_DIRECT), where allowed


class _Pool:
    """Reusable page-aligned read buffers (anonymous maps of one size). Reusing them keeps page faults
    and unmaps out of the stream, and freed pieces never linger in the allocator's arenas."""

    def __init__(self, size: int):
        self.size = -(-size // ALIGN) * ALIGN
        self.free: list = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> "_Lease":
        with self.lock:
            mm = self.free.pop() if self.free and nbytes <= self.size else None
        if mm is None:
            mm = mmap.mmap(-1, max(self.size, nbytes))
        return _Lease(self, mm)

    def close(self) -> None:
        with self.lock:
            self.free.clear()  # (the maps go when the last array over them does)


class _Lease:
    """Memory on loan until every piece using it has been written: `hold(k)` adds k users, `release()` drops
    one; the last release returns a pool buffer to its pool and calls `on_free` (the writer's budget)."""

    def __init__(self, pool: _Pool | None, mm, nbytes: int = 0):
        self.pool, self.mm, self.count = pool, mm, 1
        self.nbytes = len(mm) if mm is not None else nbytes
        self.lock = pool.lock if pool is not None else threading.Lock()
        self.on_free = None

    def array(self, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.mm, np.uint8, nbytes)

    def hold(self, k: int) -> None:
        with self.lock:
            self.count += k

    def release(self) -> None:
        with self.lock:
            self.count -= 1
            last = self.count == 0
            if last and self.pool is not None and len(self.mm) == self.pool.size:
                self.pool.free.append(self.mm)
        if last and self.on_free is not None:
            self.on_free()


def _pread(fd: int, buf: np.ndarray, pos: int) -> int:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [memoryview(buf[done:])], pos + done)
        if n <= 0:
            break
        done += n
    return done


def _read_bytes(files: "_Files", path: Path, pos: int, size: int,
                pool: _Pool | None = None) -> tuple[np.ndarray, "_Lease | None"]:
    """size bytes at pos of a source file, with O_DIRECT (an aligned superset into an aligned buffer) where
    the filesystem allows it, else through the page cache; large reads land in a pool buffer (returned
    with its lease)."""
    lease = None
    fd = files.direct(path) if size >= DIRECT_READ_MIN and pool is not None else None
    if fd is not None:
        start, end = pos // ALIGN * ALIGN, -(-(pos + size) // ALIGN) * ALIGN
        lease = pool.take(end - start)
        buf = lease.array(end - start)
        try:
            done = _pread(fd, buf, start)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            files.no_direct(path)  # this filesystem wants other alignment: page cache from now on
        else:
            if done < pos + size - start:
                raise ConvertError(f"{path}: file ends at byte {start + done}, reading {size} bytes at {pos} "
                                   f"(truncated while reading?)")
            return buf[pos - start:pos - start + size], lease
    if lease is None and size >= DIRECT_READ_MIN and pool is not None:
        lease = pool.take(size)
    buf = lease.array(size) if lease is not None else np.empty(size, np.uint8)
    if _pread(files.get(path), buf, pos) < size:
        raise ConvertError(f"{path}: file ends before byte {pos + size} (truncated while reading?)")
    return buf, lease


def read_file(path: Path, dtype, shape) -> np.ndarray:
    """A whole raw file as an array (O_DIRECT into an aligned buffer where allowed: loading shards)."""
    size = os.path.getsize(path)
    raw = np.empty(-(-size // ALIGN) * ALIGN + ALIGN, np.uint8)
    buf = raw[-raw.ctypes.data % ALIGN:][:-(-size // ALIGN) * ALIGN]
    done = -1
    if _direct["ok"] and size >= DIRECT_READ_MIN:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = None
        if fd is not None:
            try:
                done = _pread(fd, buf, 0)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            finally:
                os.close(fd)
    if done < 0:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = _pread(fd, buf[:size], 0)
        finally:
            os.close(fd)
    if done < size:
        raise ValueError(f"{path}: read {done} of {size} bytes")
    return buf[:size].view(dtype).reshape(shape)


class _Files:
    """Open read descriptors of the source files, reused across pieces (plain and O_DIRECT)."""

    def __init__(self):
        self.fds: dict[Path, int] = {}
        self.direct_fds: dict[Path, int | None] = {}
        self.stale: list[int] = []
        self.lock = threading.Lock()

    def get(self, path: Path) -> int:
        with self.lock:
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_RDONLY)
            return self.fds[path]

    def direct(self, path: Path) -> int | None:
        with self.lock:
            if path not in self.direct_fds:
                fd = None
                if _direct["ok"]:
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                    except OSError:
                        pass
                self.direct_fds[path] = fd
            return self.direct_fds[path]

    def no_direct(self, path: Path) -> None:
        with self.lock:
            fd = self.direct_fds.get(path)
            self.direct_fds[path] = None
        # (left open: a read in flight may still use it; closed with the others)
        if fd is not None:
            self.stale.append(fd)

    def close(self):
        for fd in list(self.fds.values()) + [fd for fd in self.direct_fds.values() if fd is not None] + self.stale:
            os.close(fd)
        self.fds.clear()
        self.direct_fds.clear()
        self.stale.clear()


def _row_step(cols: int, chunk_bytes: int, blocks: bool) -> int:
    step = max(1, chunk_bytes // (max(cols, 1) * 4))
    if blocks:
        step = max(BLOCK, step // BLOCK * BLOCK)
    return step


def _dequant(x: np.ndarray, s: np.ndarray, a: int, dtype) -> np.ndarray:
    """Rows a.. of an fp8 matrix times their 128×128 block scales, as jtilert.ops.quant.dequantize does
    (an fp32 product, then a cast)."""
    y = x.astype(F32)
    srows = s[(a + np.arange(x.shape[0])) // BLOCK].astype(F32)  # [rows, kb]
    for j in range(srows.shape[1]):
        y[:, j * BLOCK:(j + 1) * BLOCK] *= srows[:, j:j + 1]
    return y if np.dtype(dtype) == F32 else y.astype(dtype)


def _pow2_scale(amax: np.ndarray) -> np.ndarray:
    """The smallest power of two s with amax / s <= 448 (jtilert.ops.quant.pow2_scale), computed exactly."""
    v = np.maximum(amax.astype(F32), np.float32(1e-4)) / np.float32(FP8_MAX)
    m, e = np.frexp(v)  # v = m·2^e, m in [0.5, 1)
    return np.ldexp(np.float32(1), np.where(m == 0.5, e - 1, e)).astype(F32)


def _quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantise rows (a whole number of 128-row blocks, or a matrix's last rows) to fp8 + scales."""
    x = x.astype(F32)
    n, k = x.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    pad = np.zeros((nb * BLOCK, kb * BLOCK), F32)
    pad[:n, :k] = x
    blocks = pad.reshape(nb, BLOCK, kb, BLOCK)
    scale = _pow2_scale(np.abs(blocks).max(axis=(1, 3)))
    q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:n, :k].astype(FP8)
    return q, scale


def _chunks(item: Item, chunk_bytes: int):
    """The reads of an item, in order: (mat, first row, end row, shard or None when the read spans shards)."""
    ms, n = item.msplit, item.shards
    blocks = item.mode in ("quant", "scale", "dequant")
    for m in item.mats:
        step = _row_step(m.cols, chunk_bytes, blocks)
        if ms == 0:  # rows split: each shard's rows are a contiguous run of the source
            per = m.rows // n
            for d in range(n):
                for a in range(d * per, (d + 1) * per, step):
                    yield m, a, min(a + step, (d + 1) * per), d
        else:
            for a in range(0, m.rows, step):
                yield m, a, min(a + step, m.rows), None


def _pieces(item: Item, files: _Files, chunk_bytes: int, reader: ThreadPoolExecutor, pool: _Pool):
    """(shard, rows of that shard of one matrix, lease or None) in each shard's C order. The `reader` thread
    has the next read in flight while this one is converted; large reads land in `pool` buffers, lent to
    the pieces cut from them (views, for a plain copy) until each has been written."""
    n = item.shards
    chunks = list(_chunks(item, chunk_bytes))
    scales, scales_of = None, None

    def read(k):
        m, a, b, _ = chunks[k]
        return m.read(files, a, b, pool)

    ahead = reader.submit(read, 0)
    for k, (m, a, b, d) in enumerate(chunks):
        raw, lease = ahead.result()
        if k + 1 < len(chunks):
            ahead = reader.submit(read, k + 1)
        if item.mode == "dequant" and scales_of is not m:
            scales, scales_of = m.scale.read(files, 0, m.scale.rows), m
        if item.mode == "cast":
            x = raw if raw.dtype == item.dtype else raw.astype(item.dtype)
        elif item.mode == "dequant":
            x = _dequant(raw, scales, a, item.dtype)
        else:
            q, s = _quantize(raw)
            x = q if item.mode == "quant" else s
        if d is not None:
            out = [(d, x)]
        elif item.msplit is None:
            out = [(0, x)]
        else:
            w = x.shape[1] // n
            out = [(j, x[:, j * w:(j + 1) * w]) for j in range(n)]
        if lease is not None:
            if np.may_share_memory(x, raw):
                lease.hold(len(out) - 1)  # one use per piece
            else:
                lease.release()
                lease = None
        del raw, x
        for j, piece in out:
            yield j, piece, lease
        del out


def _disk_error(e: OSError, path: Path, name: str, tmp: Path) -> ConvertError:
    what = "disk full" if e.errno == 28 else f"cannot write ({e.strerror or e})"
    return ConvertError(f"{what} writing parameter {name} to {path}; the partial conversion is kept in {tmp} "
                        f"(not a usable checkpoint): free space and rerun the same command to resume")


class _Prefetch:
    """Reads, converts, packs and checksums the pieces of `items` in a background thread, up to `budget` bytes
    ahead of the writer (pread, the numpy copies, crc32 and write all release the GIL, so reading and writing
    overlap)."""
    _END = object()

    def __init__(self, items: list[Item], files: _Files, chunk_bytes: int, budget: int | None = None):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.budget, self.inflight = budget or chunk_bytes, 0
        self.stop = threading.Event()
        self.pool = _Pool(max((c[0].cols * c[0].dtype.itemsize * (c[2] - c[1]) for i in items
                               for c in _chunks(i, chunk_bytes)), default=0) + 2 * ALIGN)
        self.thread = threading.Thread(target=self._run, args=(items, files, chunk_bytes), daemon=True)

    def _reserve(self, nbytes: int) -> bool:
        """Wait until nbytes more may be in flight to the writer (False: stopped)."""
        with self.cond:
            while self.inflight and self.inflight + nbytes > self.budget and not self.stop.is_set():
                self.cond.wait(0.1)
            if self.stop.is_set():
                return False
            self.inflight += nbytes
        return True

    def _free(self, nbytes: int) -> None:
        with self.cond:
            self.inflight -= nbytes
            self.cond.notify()

    def _put(self, x) -> bool:
        if self.stop.is_set():
            return False
        self.q.put(x)
        return True

    def _run(self, items, files, chunk_bytes):
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="jtilert-read") as reader:
                self._produce(items, files, chunk_bytes, reader)
        except BaseException as e:  # handed to the writer
            self._put(e)
        finally:
            self.pool.close()

    def _produce(self, items, files, chunk_bytes, reader):
        for item in items:
            packer = PACKERS[item.kind]
            for d, piece, lease in _pieces(item, files, chunk_bytes, reader, self.pool):
                out = packer.pack(piece)  # (a view for column slices: copied once, into the staging buffer)
                if out.dtype != item.dtype:
                    raise ConvertError(f"packer {packer.name!r} turned {item.name} from {item.dtype} "
                                       f"into {out.dtype}")
                if lease is None:
                    lease = _Lease(None, None, out.nbytes)
                if lease.on_free is None:  # the first piece of this memory: count all of it
                    if not self._reserve(lease.nbytes):
                        return
                    lease.on_free = functools.partial(self._free, lease.nbytes)
                if not self._put((d, out, lease)):
                    return
                del out, piece, lease
            if not self._put((self._END,)):
                return

    def pieces(self):
        """The next item's pieces: (shard, array, lease or None: release it once the array is written)."""
        while True:
            x = self.q.get()
            if isinstance(x, BaseException):
                raise x
            if x[0] is self._END:
                return
            yield x

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        self.thread.join()




class _Staging:
    """Page-aligned buffers (anonymous maps), reused across tensors, that pieces are gathered in before
    being written."""

    def __init__(self, size: int):
        self.size = -(-size // ALIGN) * ALIGN
        self.free: list = []

    def take(self):
        return self.free.pop() if self.free else mmap.mmap(-1, self.size)

    def give(self, buf) -> None:
        self.free.append(buf)

    def close(self) -> None:
        for b in self.free:
            b.close()
        self.free.clear()


class _Out:
    """Appends to one shard file through a staging buffer: full buffers go out with O_DIRECT (large writes
    that skip the page cache cost far less CPU than buffered ones), the unaligned tail with an ordinary
    write. Where O_DIRECT is refused (tmpfs, some network filesystems) every write is an ordinary one."""

    def __init__(self, path: Path, buf, name: str, tmp: Path):
        self.path, self.buf, self.view, self.name, self.tmp = path, buf, memoryview(buf), name, tmp
        self.fill, self.crc = 0, 0
        self.direct = _direct["ok"]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.fd = None
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:
                self.direct = False
        if self.fd is None:
            self.fd = os.open(path, flags, 0o644)

    def add(self, x: np.ndarray) -> None:
        """Append x's bytes in C order (x may be a strided view: it is copied straight into the staging
        buffer), updating the CRC-32."""
        if x.flags.c_contiguous:
            self._add_bytes(memoryview(x.reshape(-1).view(np.uint8)))
            return
        rows = x.reshape(-1, x.shape[-1])
        row = rows.shape[1] * x.itemsize
        r = 0
        while r < len(rows):
            fit = (len(self.view) - self.fill) // row
            if fit == 0:  # not even one row fits: that row goes the slow way
                self._add_bytes(memoryview(np.ascontiguousarray(rows[r]).view(np.uint8)))
                r += 1
                continue
            k = min(fit, len(rows) - r)
            dst = np.frombuffer(self.buf, x.dtype, k * rows.shape[1], self.fill).reshape(k, rows.shape[1])
            np.copyto(dst, rows[r:r + k])
            self.crc = zlib.crc32(self.view[self.fill:self.fill + k * row], self.crc)
            self.fill += k * row
            r += k
            del dst
            if self.fill == len(self.view):
                self._write(self.fill)

    def _add_bytes(self, mv: memoryview) -> None:
        self.crc = zlib.crc32(mv, self.crc)
        pos, size = 0, len(self.view)
        while pos < len(mv):
            n = min(size - self.fill, len(mv) - pos)
            self.view[self.fill:self.fill + n] = mv[pos:pos + n]
            self.fill += n
            pos += n
            if self.fill == size:
                self._write(size)

    def _buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False

    def _write(self, n: int) -> None:
        """Write the first n staged bytes (a multiple of ALIGN unless it is the file's tail)."""
        done = 0
        while done < n:
            try:
                done += os.write(self.fd, self.view[done:n])
            except OSError as e:
                if e.errno == 22 and self.direct:  # EINVAL: this filesystem wants other alignment
                    _direct["ok"] = False
                    self._buffered()
                    continue
                raise _disk_error(e, self.path, self.name, self.tmp) from None
        self.view[:self.fill - n] = self.view[n:self.fill]
        self.fill -= n

    def close(self, ok: bool) -> None:
        try:
            if ok:
                aligned = self.fill // ALIGN * ALIGN
                if aligned:
                    self._write(aligned)
                if self.fill:
                    self._buffered()
                    self._write(self.fill)
        finally:
            os.close(self.fd)
            self.view.release()


def _write_item(root: Path, item: Item, pieces, advance, staging: _Staging) -> dict:
    """Write an item's pieces to its shard files (each through a staging buffer)."""
    paths = [root / p for p in item.files]
    n = item.shards
    sizes, outs, ok = [0] * n, [], False
    try:
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            outs.append(_Out(p, staging.take(), item.name, root))
        for d, x, lease in pieces():
            outs[d].add(x)
            sizes[d] += x.nbytes
            advance(x.nbytes)
            del x
            lease.release()
        ok = True
        crc = [o.crc for o in outs]
    except OSError as e:
        raise _disk_error(e, paths[len(outs) - 1 if outs else 0], item.name, root) from None
    finally:
        for o in outs:
            try:
                o.close(ok)
            except OSError as e:
                if ok:
                    raise _disk_error(e, o.path, item.name, root) from None
            finally:
                staging.give(o.buf)
    if any(s != item.shard_bytes for s in sizes):
        raise ConvertError(f"internal error: wrote {sizes} bytes for {item.name}, expected {item.shard_bytes} per shard")
    return {"name": item.name, "crc32": crc, "nbytes": sizes}


def file_crc(path: Path, chunk_bytes: int = CHUNK_BYTES, advance=None) -> int:
    """CRC-32 of a file, read in blocks with O_DIRECT where allowed, the next block read while this one is
    checksummed."""
    size = os.path.getsize(path)
    if size < DIRECT_READ_MIN:  # small: one buffered read
        with open(path, "rb", buffering=0) as f:
            data = f.read()
        if advance and data:
            advance(len(data))
        return zlib.crc32(data)
    try:
        return _file_crc(path, chunk_bytes, advance, _direct["ok"])
    except _NoDirect:
        return _file_crc(path, chunk_bytes, advance, False)


class _NoDirect(Exception):
    pass


def _file_crc(path: Path, chunk_bytes: int, advance, direct: bool) -> int:
    block = max(ALIGN, min(chunk_bytes, 16 << 20) // ALIGN * ALIGN)
    fd = None
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pass
    if fd is None:
        direct, fd = False, os.open(path, os.O_RDONLY)
    bufs = [mmap.mmap(-1, block), mmap.mmap(-1, block)]
    views = [memoryview(b) for b in bufs]

    def read(i, pos):
        done = 0
        while done < block:
            try:
                n = os.preadv(fd, [views[i][done:]], pos + done)
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    raise _NoDirect from None
                raise
            if n <= 0:
                break
            done += n
        return done

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="jtilert-crc") as ex:
            crc, pos, i = 0, 0, 0
            ahead = ex.submit(read, 0, 0)
            while True:
                n = ahead.result()
                if n == block:
                    ahead = ex.submit(read, 1 - i, pos + n)
                crc = zlib.crc32(views[i][:n], crc)
                if advance and n:
                    advance(n)
                if n < block:
                    return crc
                pos, i = pos + n, 1 - i
    finally:
        os.close(fd)
        for v in views:
            v.release()
        for b in bufs:
            b.close()


# ---- progress --------------------------------------------------------------------------------

class _Progress:
    def __init__(self, total: int, enabled: bool, desc: str, callback=None):
        self.done, self.total, self.callback = 0, total, callback
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.5, smoothing=0.05)
        self.name = ""

    def tensor(self, name: str):
        self.name = name
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)

    def advance(self, n: int):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        if self.callback is not None:
            self.callback(self.name, self.done, self.total)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ---- convert ---------------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(tmp: Path):
    tmp.mkdir(parents=True, exist_ok=True)
    fd = os.open(tmp / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConvertError(f"another conversion is writing {tmp}") from None
        yield
    finally:
        os.close(fd)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def partial_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.partial"


def _resumable(tmp: Path, request: dict, items: list[Item], chunk_bytes: int, progress: _Progress) -> dict:
    """Finished tensors of an earlier run of the same request whose files still match (size and CRC-32)."""
    log = tmp / DONE_LOG
    if not log.exists():
        return {}
    records = {}
    for line in log.read_text().splitlines():
        try:
            r = json.loads(line)
            records[r["name"]] = r
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by the interruption
    good = {}
    for item in items:
        r = records.get(item.name)
        if r is None or len(r["crc32"]) != item.shards:
            continue
        progress.tensor(f"checking {item.name}")
        ok = True
        for p, crc in zip(item.files, r["crc32"]):
            path = tmp / p
            if not path.exists() or path.stat().st_size != item.shard_bytes or file_crc(path, chunk_bytes) != crc:
                ok = False
                break
        if ok:
            good[item.name] = r
            progress.advance(item.nbytes)
    return good


def convert(src: str | os.PathLike, dst: str | os.PathLike, tp: int = 1, dtype: str | None = None, layers=None, *,
            mtp: bool = True, overwrite: bool = False, progress: bool = False, chunk_bytes: int = CHUNK_BYTES,
            callback: Callable[[str, int, int], None] | None = None) -> Path:
    """Convert an HF folder `src` into a jtilert checkpoint at `dst` laid out for `tp`-way tensor parallelism.

    dtype: "fp8" (fp8 weights with their block scales; quantises a bf16/fp32 source), "bf16" or "fp32"
    (dequantises an fp8 source); default: the source's format. layers: "a:b" keeps decoder layers a..b-1
    (renumbered from 0); mtp=False drops the MTP block. An interrupted conversion resumes when rerun with the
    same arguments; `overwrite` replaces an existing `dst` (and discards a partial conversion made with
    different arguments). progress: a bar on stderr with bytes and ETA; callback(tensor, bytes_done, bytes_total)
    is called as bytes are written (or re-verified).
    """
    t0 = time.perf_counter()
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists (pass --overwrite / overwrite=True to replace it)")
    p = plan(src, tp, dtype, layers, mtp)
    tmp = partial_path(dst)
    request = p.request()
    req_file = tmp / REQUEST
    if req_file.exists():
        try:
            old = json.loads(req_file.read_text())
        except json.JSONDecodeError:
            old = None
        if old != request:
            if not overwrite:
                raise ConvertError(f"{tmp} holds a partial conversion with other arguments or source files; "
                                   f"rerun with those, delete it, or pass --overwrite to start over")
            shutil.rmtree(tmp)
    fresh = not tmp.exists()
    written = 0
    with _locked(tmp):
        prog = _Progress(p.nbytes, progress, dst.name, callback)
        try:
            done = _resumable(tmp, request, p.items, chunk_bytes, prog)
            need = p.nbytes - sum(i.nbytes for i in p.items if i.name in done)
            free = shutil.disk_usage(tmp).free
            if need > free:
                raise ConvertError(f"not enough disk space for {dst}: the conversion needs {_size(need)} more "
                                   f"in {tmp.parent}, which has {_size(free)} free")
            req_file.write_text(json.dumps(request, indent=1))
            with open(tmp / DONE_LOG, "w") as log:  # rewritten with the verified records only
                for r in done.values():
                    log.write(json.dumps(r) + "\n")
            files = _Files()
            staging = _Staging(max(16 * ALIGN, chunk_bytes // tp))  # tp buffers: about chunk_bytes in all
            todo = [item for item in p.items if item.name not in done]
            try:
                with open(tmp / DONE_LOG, "a") as log, _Prefetch(todo, files, chunk_bytes) as stream:
                    for item in todo:
                        prog.tensor(item.name)
                        rec = _write_item(tmp, item, stream.pieces, prog.advance, staging)
                        done[item.name] = rec
                        log.write(json.dumps(rec) + "\n")
                        log.flush()
                        written += 1
            finally:
                files.close()
                staging.close()
            prog.tensor("syncing")
            _finish(p, tmp, dst, done, overwrite)
        except BaseException:
            if fresh and not written:  # nothing worth resuming
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            prog.close()
    if progress:
        dt = time.perf_counter() - t0
        print(f"wrote {dst}: {p.nbytes / 1e9:.2f} GB in {dt:.1f} s ({p.nbytes / 1e9 / dt:.2f} GB/s), tp={tp}, "
              f"{p.fmt}", file=sys.stderr)
    return dst


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _meta(p: Plan, done: dict) -> dict:
    tensors = {}
    for item in sorted(p.items, key=lambda i: i.name):
        tensors[item.name] = dict(item.meta(), crc32=done[item.name]["crc32"])
    return {"layout_version": LAYOUT_VERSION, "weight_format": p.fmt, "dtype": np.dtype(compute_dtype(p.fmt)).name,
            "config": p.cfg.to_hf(), "tp": p.tp, "pack": pack_layout(), "layers": list(p.layers),
            "source": {"path": str(p.src.absolute()), "format": p.source_format},
            "params": {i.name: [list(i.shape), i.dtype.name] for i in sorted(p.items, key=lambda i: i.name)},
            "tensors": tensors}


def _sync_all(tmp: Path, paths) -> None:
    """Flush the written files to disk: one syncfs(2) of their filesystem, else an fsync per file."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            if libc.syncfs(fd) == 0:
                return
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    for f in paths:
        _fsync(f)


def _finish(p: Plan, tmp: Path, dst: Path, done: dict, overwrite: bool) -> None:
    _sync_all(tmp, [tmp / f for item in p.items for f in item.files])
    for name in COPIED:
        if (p.src / name).exists():
            shutil.copy(p.src / name, tmp / name)
    meta = _meta(p, done)
    try:
        (tmp / META).write_text(json.dumps(meta, indent=1))
        _fsync(tmp / META)
    except OSError as e:
        raise _disk_error(e, tmp / META, "metadata", tmp) from None
    for f in (DONE_LOG, REQUEST, ".lock"):
        (tmp / f).unlink(missing_ok=True)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} appeared during the conversion; the result is in {tmp}")
    move_into_place(tmp, dst)
    _fsync(dst.parent)


# ---- verify ----------------------------------------------------------------------------------

def verify(dst: str | os.PathLike, against: str | os.PathLike | None = None, samples: int = 2, progress: bool = False,
           chunk_bytes: int = CHUNK_BYTES, seed: int = 0) -> dict:
    """Check a converted checkpoint: every parameter present with the shape and dtype its config needs, every
    shard file present with the right size and CRC-32; with `against` (the HF source), compare `samples`
    rows of every matrix (of two experts per stacked parameter), dequantised, with the source's.
    Raises ValueError listing the problems; returns a summary."""
    path = Path(dst)
    if not (path / META).exists():
        raise FileNotFoundError(f"{path}: no {META} (not a jtilert checkpoint, or an unfinished conversion)")
    meta = read_meta(path)
    if meta["layout_version"] != LAYOUT_VERSION:
        raise ConvertError(f"{path}: layout version {meta['layout_version']} (written by jtilert.save) has no "
                           f"checksums; verify checks converted checkpoints (layout {LAYOUT_VERSION})")
    cfg = ModelConfig.from_json_dict(meta["config"])
    problems: list[str] = []
    expected = {k: (list(v.shape), np.dtype(v.dtype).name) for k, v in
                layer_params(abstract_model(cfg, meta["weight_format"])).items()}
    params, tensors = meta["params"], meta.get("tensors", {})
    for name in sorted(set(expected) - set(params)):
        problems.append(f"parameter {name} missing")
    for name in sorted(set(params) - set(expected)):
        problems.append(f"parameter {name} is not part of the model")
    for name in sorted(set(expected) & set(params)):
        if [list(params[name][0]), params[name][1]] != list(expected[name]):
            problems.append(f"parameter {name}: {params[name]} in the metadata, the config needs {expected[name]}")
        if name not in tensors:
            problems.append(f"parameter {name}: no storage record")
    total = sum(int(np.prod(tensors[k]["stored"])) * np.dtype(np_dtype(params[k][1])).itemsize
                * tensors[k]["shards"] for k in tensors if k in params)
    prog = _Progress(total, progress, f"verify {path.name}")
    checked = 0
    try:
        for name in sorted(tensors):
            t = tensors[name]
            if name not in params:
                continue
            prog.tensor(name)
            size = int(np.prod(t["stored"])) * np.dtype(np_dtype(params[name][1])).itemsize
            for rel, crc in zip(shard_files(name, t["shards"]), t["crc32"]):
                f = path / rel
                if not f.exists():
                    problems.append(f"{f}: missing (parameter {name})")
                elif f.stat().st_size != size:
                    problems.append(f"{f}: {f.stat().st_size} bytes, parameter {name} needs {size}")
                elif file_crc(f, chunk_bytes, prog.advance) != crc:
                    problems.append(f"{f}: checksum mismatch (parameter {name})")
                else:
                    checked += 1
    finally:
        prog.close()
    spot = 0
    if against is not None and not problems:
        spot = _spot_check(path, meta, against, samples, seed, problems)
    if problems:
        raise ConvertError(f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:20])
                           + ("\n  ..." if len(problems) > 20 else ""))
    return {"path": str(path), "tensors": len(tensors), "files": checked, "bytes": total, "tp": meta["tp"],
            "spot_checked": spot}


def _spot_check(path: Path, meta: dict, against, samples: int, seed: int, problems: list) -> int:
    """Compare sampled rows, dequantised, of every parameter with the source."""
    cfg = ModelConfig.from_json_dict(meta["config"])
    p = plan(against, meta["tp"], meta["weight_format"], tuple(meta["layers"]), bool(cfg.num_nextn_predict_layers))
    rng = np.random.default_rng(seed)
    files = _Files()
    n = 0
    try:
        for item in p.items:
            if item.name.endswith(".scale"):
                continue  # checked through the dequantised weights
            if item.name not in meta["tensors"] or PACKERS[item.kind].unpack is None:
                continue
            w = StoredTensor(path, item.name, meta)
            s = StoredTensor(path, item.name.removesuffix("weight") + "scale", meta) \
                if item.name.removesuffix("weight") + "scale" in meta["tensors"] else None
            stacked = len(item.shape) == 3
            experts = sorted({0, int(rng.integers(len(item.mats)))}) if stacked else [0]
            for e in experts:
                m = item.mats[e]
                for r in sorted(set(rng.integers(m.rows, size=samples).tolist())):
                    src = m.read(files, r, r + 1)
                    if m.scale is not None:
                        src = _dequant(src, m.scale.read(files, 0, m.scale.rows), r, F32)
                    src = src.astype(F32)[0]
                    idx = ((e,) if stacked else ()) + ((r,) if len(item.shape) >= 2 else ())
                    got = w.read(idx)
                    if len(item.shape) < 2:
                        got = got.reshape(-1)
                    got = got.reshape(-1)
                    if s is not None:
                        sc = s.read(((e,) if stacked else ()) + (r // BLOCK,)).reshape(-1)
                        got = _dequant(got[None], sc[None], 0, F32)[0]
                        if item.mode == "quant":
                            ok = np.all(np.abs(got - src) <= np.abs(src) * 2**-3 + np.repeat(sc, BLOCK)[:src.size] * 2**-8)
                        else:
                            ok = np.array_equal(got, src, equal_nan=True)
                    else:
                        want = src.astype(item.dtype).astype(F32)
                        ok = np.array_equal(got.astype(F32), want, equal_nan=True)
                    if not ok:
                        where = f"expert {e} " if stacked else ""
                        problems.append(f"parameter {item.name}: {where}row {r} differs from {m.key} in {m.file.path}")
                    n += 1
    finally:
        files.close()
    return n


class StoredTensor:
    """One parameter of a converted (layout 2) checkpoint: reads any index of the parameter's logical shape
    from its shard files (a split parameter's shards are slices of its split axis)."""

    def __init__(self, path: Path, name: str, meta: dict):
        t = meta["tensors"][name]
        shape, dt = meta["params"][name]
        self.name, self.shape, self.dtype = name, tuple(shape), np_dtype(dt)
        self.split, self.shards, self.stored = t["split"], t["shards"], tuple(t["stored"])
        self.paths = [path / f for f in shard_files(name, self.shards)]
        self.packer = PACKERS[t["kind"]]
        if self.packer.name != t.get("pack", "identity"):
            raise ValueError(f"{path}: parameter {name} is stored with layout {t.get('pack')!r}, this jtilert "
                             f"packs {t['kind']} parameters as {self.packer.name!r}; convert the checkpoint again")
        for p in self.paths:
            if not p.exists():
                raise FileNotFoundError(f"{path}: missing shard file {p} of parameter {name}")
            size = p.stat().st_size
            if size != int(np.prod(self.stored)) * self.dtype.itemsize:
                raise ValueError(f"{p}: {size} bytes, parameter {name} needs "
                                 f"{int(np.prod(self.stored)) * self.dtype.itemsize}")

    @property
    def identity(self) -> bool:
        return self.packer.name == "identity"

    def shard(self, d: int) -> np.ndarray:
        """Shard d as stored (packed)."""
        return read_file(self.paths[d], self.dtype, self.stored)

    def _local(self, d: int, idx: tuple) -> np.ndarray:
        if self.identity:
            mm = np.memmap(self.paths[d], self.dtype, "r", shape=self.stored)
            out = np.array(mm[idx])
            del mm
            return out
        if self.packer.unpack is None:
            raise ValueError(f"parameter {self.name}: layout {self.packer.name!r} cannot be unpacked")
        return np.asarray(self.packer.unpack(self.shard(d)))[idx]

    def read(self, idx: tuple = ()) -> np.ndarray:
        """The parameter at `idx` (ints and slices over its logical shape)."""
        idx = tuple(idx) + (slice(None),) * (len(self.shape) - len(idx))
        drop = tuple(i for i, x in enumerate(idx) if not isinstance(x, slice))
        idx = tuple(x if isinstance(x, slice) else slice(int(x), int(x) + 1) for x in idx)
        if self.split is None or self.shards == 1:
            out = self._local(0, idx)
        else:
            ax, local = self.split, self.shape[self.split] // self.shards
            a, b, step = idx[ax].indices(self.shape[ax])
            if step != 1:
                raise ValueError("strided reads are not supported")
            parts = []
            for d in range(a // local, (b - 1) // local + 1) if b > a else []:
                sub = list(idx)
                sub[ax] = slice(max(a, d * local) - d * local, min(b, (d + 1) * local) - d * local)
                parts.append(self._local(d, tuple(sub)))
            out = np.concatenate(parts, axis=ax) if parts else np.zeros(
                tuple(len(range(*s.indices(n))) for s, n in zip(idx, self.shape)), self.dtype)
        return out.reshape(tuple(n for i, n in enumerate(out.shape) if i not in drop)) if drop else out
