"""The conversion plan: an HF folder checked against its config (headers only) and every parameter to write.

Each `Item` is one per-layer parameter (`layers.3.self_attn.q_b_proj.weight`, the HF naming) read from one
source matrix, or one per expert; it is stored as one layer (`layer`) of a stacked checkpoint array (`array`,
e.g. `layers.self_attn.q_b_proj.weight` [L, ...], as `jtilert.model.transformer` holds it), or as a whole
unstacked array (`embed_tokens`). Bad input is a ConvertError (a ValueError) or FileNotFoundError naming the
file and tensor.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np

from jtilert.model.config import ModelConfig
from jtilert.model.transformer import abstract_model, flat_params, layer_names, layer_params, stacked_name
from jtilert.ops.quant import BLOCK, scale_shape
from jtilert.parallel import sharding
from jtilert.store import arrays, hf
from jtilert.store.folder import LAYOUT_VERSION

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
F32 = np.dtype(np.float32)
FLOATS = {np.dtype(np.float64), F32, np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), FP8}
FORMATS = ("fp8", "bf16", "fp32")


class ConvertError(ValueError):
    """A conversion failed (bad input, full disk, ...); the message names the file or tensor."""


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

    @property
    def offset(self) -> int:
        """Where row 0 starts in the file."""
        return self.file.data_offset(self.key) + self.row0 * self.cols * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.dtype.itemsize + (self.scale.nbytes if self.scale else 0)


@dataclasses.dataclass
class Array:
    """One array of the checkpoint: a stack ([L, ...]) or an unstacked parameter."""
    name: str
    shape: tuple
    dtype: np.dtype
    chunk: tuple          # arrays.chunk_shape
    shard: tuple          # one device's part under the plan's tp


@dataclasses.dataclass
class Item:
    """One per-layer parameter to write: one layer of a stacked array, or a whole unstacked one."""
    name: str
    shape: tuple          # the model's per-layer shape
    dtype: np.dtype       # stored dtype
    split: int | None     # the tp-split axis of `shape`
    shards: int           # tp for split parameters, else 1
    mats: list[Mat]       # one per expert of a stacked parameter, else one
    mode: str             # "cast", "dequant" (fp8 → float), "quant" (float → fp8), "scale" (the block scales of "quant")
    array: str = ""       # the checkpoint array holding it
    layer: int | None = None  # its index in that array's stack (None: the whole array)
    chunk: tuple = ()     # the array's chunk shape without the layer axis

    @property
    def local_shape(self) -> tuple:
        s = list(self.shape)
        if self.split is not None:
            s[self.split] //= self.shards
        return tuple(s)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def msplit(self) -> int | None:
        """The split axis within one matrix (stacked experts: the axis after the expert axis)."""
        if self.split is None or self.shards == 1:
            return None
        return self.split - (len(self.shape) - 2)

    @property
    def lead(self) -> tuple:
        return () if self.layer is None else (self.layer,)


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
    arrays: dict[str, Array]
    chunk_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    def request(self) -> dict:
        """What the output depends on (a partial conversion resumes only for the same request)."""
        return {"layout_version": LAYOUT_VERSION, "source": str(self.src.absolute()),
                "files": {str(f.path.name): [f.path.stat().st_size, f.path.stat().st_mtime_ns] for f in self.files},
                "tp": self.tp, "weight_format": self.fmt, "layers": list(self.layers),
                "mtp": self.cfg.num_nextn_predict_layers, "chunk_bytes": self.chunk_bytes}


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


def plan(src: str | os.PathLike, tp: int = 1, dtype: str | None = None, layers=None, mtp: bool = True,
         chunk_bytes: int = arrays.CHUNK_BYTES) -> Plan:
    """Check an HF folder against its config and work out every parameter to write (reads only headers) and
    the checkpoint arrays holding them, chunked for `tp` devices within `chunk_bytes` (`arrays.chunk_shape`).
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
    source_format = hf.weight_format(tensors, src, ConvertError)
    fmt = dtype or source_format
    model = abstract_model(cfg, fmt)
    expected = {k: (tuple(v.shape), np.dtype(v.dtype)) for k, v in layer_params(model).items()}

    # every source tensor, by the parameter it feeds
    single: dict[str, tuple] = {}
    experts: dict[str, dict[int, tuple]] = {}
    fused: dict[str, tuple] = {}   # transformers' [E, 2I, H] gate_up / [E, H, I] down: name -> (file, key, part)
    origin: dict[str, str] = {}    # parameter -> a source key (for messages)
    for key, f, name, e in hf.targets(tensors, n, ConvertError):
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
    stores = _arrays(cfg, model, tp, chunk_bytes)
    for item in items:
        item.array, item.layer = stacked_name(cfg, item.name)
        item.chunk = stores[item.array].chunk[len(item.lead):]
    return Plan(src, cfg, fmt, source_format, tp, (a, b), items, files, stores, chunk_bytes)


def _arrays(cfg: ModelConfig, model, tp: int, chunk_bytes: int) -> dict[str, Array]:
    """The checkpoint's arrays (the model's stacked parameters), chunked for tp devices."""
    out = {}
    for name, x in flat_params(model).items():
        dt = np.dtype(x.dtype)
        split = sharding.split_axis(tuple(name.split(".")))
        lead = 1 if layer_names(cfg, name) else 0  # the stack's layer axis
        chunk = arrays.chunk_shape(x.shape, dt.itemsize, split, tp, chunk_bytes, lead)
        shard = tuple(n // tp if i == split else n for i, n in enumerate(x.shape))
        out[name] = Array(name, tuple(x.shape), dt, chunk, shard)
    return out


def _hf_key(name: str, a: int, n: int) -> str:
    m = re.match(r"layers\.(\d+)\.", name)
    if m:
        name = f"layers.{int(m.group(1)) + a}." + name[m.end():]
    return hf.source_name(name, n)


