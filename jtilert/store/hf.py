"""Reading HF model folders: safetensors files (memory-mapped, fp8 included) and the key layout.

The safetensors package's numpy reader cannot return float8 tensors, so the file format (an 8-byte
header length, a JSON header, raw little-endian data) is read here with np.memmap and ml_dtypes.
`SafetensorsFile.read_rows` reads row ranges with pread instead (no mapping, so a streaming reader's
resident memory stays bounded by what it holds, not by what it has touched).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}
DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_,
}


class SafetensorsFile:
    """Lazy, memory-mapped access to the tensors of one .safetensors file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"missing safetensors file {self.path}")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{self.path}: truncated (no header)")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ValueError(f"{self.path}: truncated (header of {n} bytes, file of {size})")
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.path}: corrupt header ({e})") from None
        header.pop("__metadata__", None)
        self.header, self.offset = header, 8 + n
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self.offset + end > size:
            raise ValueError(f"{self.path}: truncated (tensors end at byte {self.offset + end}, file has {size})")
        self._mm = None

    def keys(self):
        return self.header.keys()

    def meta(self, key: str) -> tuple[tuple[int, ...], np.dtype]:
        h = self.header[key]
        if h["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {key} has unsupported dtype {h['dtype']}")
        return tuple(h["shape"]), np.dtype(DTYPES[h["dtype"]])

    def get(self, key: str) -> np.ndarray:
        """The tensor as a read-only view of the mapped file."""
        shape, dtype = self.meta(key)
        begin, end = self.header[key]["data_offsets"]
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {key} holds {end - begin} bytes, shape {shape} needs "
                             f"{int(np.prod(shape)) * dtype.itemsize}")
        if self._mm is None:
            self._mm = np.memmap(self.path, np.uint8, mode="r")
        return self._mm[self.offset + begin:self.offset + end].view(dtype).reshape(shape)

    def nbytes(self, key: str) -> int:
        begin, end = self.header[key]["data_offsets"]
        return end - begin

    def data_offset(self, key: str) -> int:
        """Byte offset of the tensor's data in the file (for reading files in order)."""
        return self.offset + self.header[key]["data_offsets"][0]

    def read_rows(self, key: str, start: int, stop: int, fd: int | None = None) -> np.ndarray:
        """Rows start:stop of the tensor viewed as 2-D [prod(shape[:-1]), shape[-1]] (a 1-D tensor is one
        row), read with pread into a fresh array. `fd`: an open descriptor of this file to reuse."""
        shape, dtype = self.meta(key)
        cols = shape[-1] if shape else 1
        begin, end = self.header[key]["data_offsets"]
        row_bytes = cols * dtype.itemsize
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {key} holds {end - begin} bytes, shape {shape} needs "
                             f"{int(np.prod(shape)) * dtype.itemsize}")
        out = np.empty((stop - start, cols), dtype)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        own = fd is None
        if own:
            fd = os.open(self.path, os.O_RDONLY)
        try:
            pos, done = self.offset + begin + start * row_bytes, 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], pos + done)
                if n <= 0:
                    raise ValueError(f"{self.path}: tensor {key}: file ends at byte {pos + done} (truncated "
                                     f"while reading?)")
                done += n
        finally:
            if own:
                os.close(fd)
        return out


_NUMBERED = re.compile(r"(.*)-(\d+)-of-(\d+)\.safetensors")


def open_folder(folder: str | Path) -> dict[str, SafetensorsFile]:
    """Map every tensor key of an HF folder to the file holding it (via the index json if present)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (no valid weight_map: {e!r})") from None
        files = {}
        for name in sorted(set(weight_map.values())):
            if not (folder / name).exists():
                raise FileNotFoundError(f"{index} names {name}, which is not in {folder}")
            files[name] = SafetensorsFile(folder / name)
        out = {}
        for key, name in weight_map.items():
            if key not in files[name].header:
                raise ValueError(f"{index} places {key} in {name}, which does not contain it")
            out[key] = files[name]
        return out
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    # Numbered shards (model-00001-of-00163.safetensors) without an index: a gap is a missing file.
    for p in paths:
        m = _NUMBERED.fullmatch(p.name)
        if m:
            width, total = len(m.group(2)), int(m.group(3))
            for i in range(1, total + 1):
                want = folder / f"{m.group(1)}-{i:0{width}d}-of-{m.group(3)}.safetensors"
                if not want.exists():
                    raise FileNotFoundError(f"missing shard file {want} ({p.name} says there are {total})")
    out = {}
    for p in paths:
        f = SafetensorsFile(p)
        out.update({k: f for k in f.keys()})
    return out


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)")
_MTP_ONLY = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
             "eh_proj.weight_scale_inv": "eh_proj.scale", "shared_head.norm.weight": "norm.weight"}
# Copies of the main model's tensors that the MTP layer ships; jtilert shares the originals.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def target_name(key: str, num_layers: int) -> tuple[str, int | None] | None:
    """jtilert parameter name for an HF key: (name, expert index or None); None for keys we skip.
    Expert tensors map to their stacked parameter with the expert index."""
    if key == "model.embed_tokens.weight":
        return "embed_tokens", None
    if key in ("model.norm.weight", "lm_head.weight"):
        return key.removeprefix("model."), None
    m = _LAYER.fullmatch(key)
    if not m:
        raise ValueError(f"unexpected tensor {key}")
    layer, rest = int(m.group(1)), m.group(2)
    if layer > num_layers:
        raise ValueError(f"tensor {key}: layer {layer} beyond the {num_layers} layers + MTP")
    is_mtp = layer == num_layers
    prefix = "mtp.layer." if is_mtp else f"layers.{layer}."
    if is_mtp:
        if rest in _MTP_SHARED:
            return None
        if rest in _MTP_ONLY:
            return "mtp." + _MTP_ONLY[rest], None
    e = _EXPERT.fullmatch(rest)
    if e:
        leaf = "weight" if e.group(3) == "weight" else "scale"
        return f"{prefix}mlp.experts.{e.group(2)}.{leaf}", int(e.group(1))
    if rest.endswith(".weight_scale_inv"):
        rest = rest.removesuffix("weight_scale_inv") + "scale"
    # transformers' fused expert tensors: gate_up_proj [E, 2*I, H] (split by the loader), down_proj [E, H, I]
    rest = {"mlp.experts.down_proj": "mlp.experts.down.weight",
            "mlp.experts.gate_up_proj": "mlp.experts.gate_up.weight"}.get(rest, rest)
    return prefix + rest, None


def weight_format(tensors: dict, folder: Path, error=ValueError) -> str:
    """The HF folder's weight format: "fp8" (with `weight_scale_inv` block scales), else the embedding's
    "fp32" or "bf16"; `error` (naming the folder) without an embedding."""
    if any(k.endswith("weight_scale_inv") for k in tensors):
        return "fp8"
    key = "model.embed_tokens.weight"
    if key not in tensors:
        raise error(f"{folder}: no {key} tensor")
    return "fp32" if tensors[key].meta(key)[1] == np.float32 else "bf16"


def targets(tensors: dict, num_layers: int, error=ValueError):
    """(key, file, parameter name, expert index or None) of every tensor `target_name` maps; an unexpected
    key is `error` naming its file."""
    for key, f in tensors.items():
        try:
            t = target_name(key, num_layers)
        except ValueError as e:
            raise error(f"{f.path}: {e}") from None
        if t is not None:
            yield key, f, *t


_MTP_ONLY_INV = {v: k for k, v in _MTP_ONLY.items()}


def source_name(name: str, num_layers: int) -> str:
    """The HF key of a jtilert parameter (inverse of `target_name`); stacked expert parameters give a
    pattern with `{e}` for the expert index."""
    if name == "embed_tokens":
        return "model.embed_tokens.weight"
    if name == "norm.weight":
        return "model.norm.weight"
    if name == "lm_head.weight":
        return "lm_head.weight"
    if name.startswith("mtp.") and not name.startswith("mtp.layer."):
        return f"model.layers.{num_layers}." + _MTP_ONLY_INV[name.removeprefix("mtp.")]
    if name.startswith("mtp.layer."):
        prefix, rest = f"model.layers.{num_layers}.", name.removeprefix("mtp.layer.")
    else:
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", name)
        if not m:
            raise ValueError(f"no HF key for parameter {name}")
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    e = re.fullmatch(r"mlp\.experts\.(gate|up|down)\.(weight|scale)", rest)
    if e:
        return prefix + f"mlp.experts.{{e}}.{e.group(1)}_proj." + ("weight" if e.group(2) == "weight" else "weight_scale_inv")
    if rest.endswith(".scale"):
        rest = rest.removesuffix("scale") + "weight_scale_inv"
    return prefix + rest
