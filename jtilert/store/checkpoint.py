"""Checkpoints: jtilert's formats (save / load onto a mesh) and HF model folders (load).

A jtilert checkpoint is a folder with `jtilert.json` (config, weight format, layout version, every
parameter's shape and dtype) and `params/`, an orbax checkpoint of the model's parameter tree in one of these
layouts:
  4. written by `save` and by `jtilert.convert`: the layers stacked ([L, ...] per weight kind, as the runtime
     holds them: `jtilert.model.transformer`), zarr3 arrays whose chunks carry a CRC-32C
     (`jtilert.store.arrays`); a converted one is chunked so that each device of its tp degree reads only
     its own chunks;
  3. written by `save` before layout 4: the same tree in orbax's own storage (no chunk checksums);
  1. written by `save` before the layer stacks: one entry per layer (`layers.3.self_attn.q_b_proj.weight`),
     stacked at load.
Layout 2 (`jtilert.convert`'s raw per-device shard files) is no longer read: loading one says how to convert
its source again. Writes go to a temporary sibling folder that is renamed into place only when complete.

Integrity: a layout-4 chunk's CRC-32C is checked by TensorStore on every read (a damaged chunk is a
ValueError naming its file). `save` also records the size and CRC-32 of every file under params/ in
jtilert.json (`checksums`): `verify` checks them, and `load` checks them before reading a layout-3
checkpoint that has them (the embedded tiny model); `load(..., check=False)` skips that. Older
checkpoints without checksums load with a warning; HF folders (safetensors) carry none.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import re
import shutil
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jtilert.store import arrays, convert, hf
from jtilert.parallel import sharding
from jtilert.model.config import ModelConfig
from jtilert.model.presets import PRESETS
from jtilert.store.folder import LAYOUT_VERSION, META, move_into_place, np_dtype, read_meta, replaceable  # noqa: F401
from jtilert.model.transformer import Transformer, abstract_model, check_fits, flat_params, layer_arrays, layer_names, layer_params  # noqa: F401

ASSETS = Path(__file__).parent.parent / "assets"
EMBEDDED = {"tiny": ASSETS / "tiny"}


# ---- parameters as a flat {dotted name: array} dict ------------------------------------------

def _stacked(model: Transformer, get_layer) -> Transformer:
    """A concrete model from an abstract one, `get_layer(per_layer_name, shape)` giving each per-layer
    parameter (a numpy or jax array); stacks are built on the device(s) by `_fill`'s caller."""
    cfg = model.cfg

    def get(name, like):
        names = layer_names(cfg, name)
        if not names:
            return get_layer(name, like)
        parts = [get_layer(n, jax.ShapeDtypeStruct(like.shape[1:], like.dtype)) for n in names]
        return jnp.stack([jnp.asarray(p) for p in parts]) if not isinstance(parts[0], np.ndarray) else np.stack(parts)

    return _fill(model, get)


def weight_format(params: dict) -> str:
    if any(x.dtype == jnp.float8_e4m3fn for x in params.values()):
        return "fp8"
    return "fp32" if params["embed_tokens"].dtype == jnp.float32 else "bf16"


def _fill(model: Transformer, get) -> Transformer:
    """A concrete model from an abstract one, `get(name, abstract_leaf)` giving each parameter."""
    graphdef, state = nnx.split(model)
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: get(".".join(map(str, sharding.path_names(p))), x), state)
    return nnx.merge(graphdef, state)


def _sharding_of(name: str, ndim: int, mesh: Mesh | None):
    if mesh is None:  # the default device, whatever machine wrote the checkpoint
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, sharding.spec_for(tuple(name.split(".")), ndim))


# ---- save ----------------------------------------------------------------------------------

def save(model: Transformer, path: str | os.PathLike, overwrite: bool = False,
         tokenizer: str | os.PathLike | None = None, chunk_bytes: int = arrays.CHUNK_BYTES) -> Path:
    """Write `model` to `path` atomically (temporary folder, then rename) in layout 4, each chunk of at most
    about `chunk_bytes` with its CRC-32C, and the size and CRC-32 of every file in jtilert.json;
    `overwrite` replaces a jtilert checkpoint (nothing else). `tokenizer` is "bytes" (UTF-8 byte ids) or
    the path of an HF tokenizer.json to store beside the weights; by default, that of the checkpoint the
    model was loaded from. A destination that cannot be written,
    or a disk without room for the parameters, is an OSError before anything is written; nothing is
    left on failure."""
    path = Path(path).absolute()
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
        replaceable(path)
    params = flat_params(model)
    jax.block_until_ready(list(params.values()))  # a failure computing them is theirs, not the save's
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot save to {path}: {e.strerror} ({e.filename})") from None
    try:
        need = sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize for v in params.values())
        free = shutil.disk_usage(tmp).free
        if need > free:  # the old checkpoint stays until the new one is complete: the whole size must fit
            raise OSError(errno.ENOSPC, f"cannot save to {path}: the parameters need {need:,} bytes, "
                                        f"{path.parent} has {free:,} free")
        chunked = {}
        for name, x in params.items():
            split = sharding.split_axis(tuple(name.split(".")))
            tp = 1 if split is None else x.shape[split] // x.sharding.shard_shape(x.shape)[split]
            lead = 1 if layer_names(model.cfg, name) else 0
            chunked[name] = (x, arrays.chunk_shape(x.shape, jnp.dtype(x.dtype).itemsize, split, tp, chunk_bytes, lead))
        with _write_errors(f"cannot save to {path}"):
            arrays.write_arrays(tmp / "params", chunked)
        meta = {"layout_version": LAYOUT_VERSION, "weight_format": weight_format(params),
                "dtype": jnp.dtype(model.dtype).name, "config": model.cfg.to_hf(),
                "params": {k: [list(v.shape), jnp.dtype(v.dtype).name] for k, v in params.items()},
                "checksums": file_checksums(tmp)}
        if tokenizer is None:
            tokenizer = _tokenizer_of(getattr(model, "source", None))
        if tokenizer == "bytes":
            meta["tokenizer"] = "bytes"
        elif tokenizer is not None:
            shutil.copy(tokenizer, tmp / "tokenizer.json")
        (tmp / META).write_text(json.dumps(meta, indent=1))
        if path.exists():
            replaceable(path)
        move_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


@contextlib.contextmanager
def _write_errors(what: str):
    """TensorStore's write errors as one OSError, "what: <the error>", with its errno
    ("... No space left on device [os_error_code='28']")."""
    try:
        yield
    except Exception as e:  # TensorStore's errors are ValueError, or others for I/O failures
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        code = re.search(r"os_error_code='(\d+)'", msg)
        raise OSError(int(code.group(1)) if code else errno.EIO, f"{what}: {msg}") from None


# ---- checksums -------------------------------------------------------------------------------
# zlib's CRC-32 of whole files (`save`'s record, beside the chunks' CRC-32C): zlib is part of Python (no crc32c module is
# installed), checksums about 5 GB/s per core (a 2-core CPU machine: 5.0-6.5 GB/s, against 2.0-3.1 GB/s
# reading the same files from its disk with O_DIRECT), and releases the GIL, so reader threads check in
# parallel.

CHECK_THREADS = min(8, os.cpu_count() or 1)


def _file_crc(path: Path, block: int = 16 << 20) -> tuple[int, int]:
    """(size, CRC-32) of a file, read in blocks."""
    crc, size = 0, 0
    buf = memoryview(bytearray(block))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc, size = zlib.crc32(buf[:n], crc), size + n
    return size, crc


def file_checksums(folder: Path) -> dict:
    """{"algorithm": "crc32", "files": {relative path: [size, crc]}} of every file under folder/params."""
    files = sorted(p for p in (folder / "params").rglob("*") if p.is_file())
    with ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="jtilert-crc") as pool:
        sums = list(pool.map(_file_crc, files))
    return {"algorithm": "crc32", "files": {p.relative_to(folder).as_posix(): list(c) for p, c in zip(files, sums)}}


def check_files(path: Path, meta: dict, contents: bool = True) -> int:
    """Check the files of a saved checkpoint against the sizes and CRC-32s `save` recorded (only the
    sizes with contents=False: no read): a ValueError naming the first damaged file (and how many
    are), else the number of bytes checked."""
    sums = meta.get("checksums")
    if sums is None:
        raise ValueError(f"{path}: written without checksums (by a jtilert before they existed); "
                         f"`jtilert.save` it again to add them")
    if sums.get("algorithm") != "crc32":
        raise ValueError(f"{path}: checksums of algorithm {sums.get('algorithm')!r}; this jtilert checks crc32")

    def one(item):
        rel, (size, crc) = item
        f = path / rel
        if not f.is_file():
            return f"{f} is missing"
        got_size, got = _file_crc(f) if contents else (f.stat().st_size, crc)
        if got_size != size:
            return f"{f} has {got_size:,} bytes, {size:,} were saved (truncated or replaced)"
        if got != crc:
            return f"{f}: checksum mismatch (CRC-32 {got:08x}, {crc:08x} was saved)"
        return None

    with ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="jtilert-crc") as pool:
        problems = [p for p in pool.map(one, sums["files"].items()) if p]
    if problems:
        more = f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
        raise ValueError(f"{path} is damaged: {problems[0]}{more}")
    return sum(size for size, _ in sums["files"].values())


# ---- load ----------------------------------------------------------------------------------

def resolve(source: str | os.PathLike) -> Path:
    """A checkpoint folder from a path or the name of an embedded preset, with a clear error."""
    path = Path(source)
    if path.exists():
        return path
    name = str(source)
    if name in EMBEDDED:
        if not (EMBEDDED[name] / META).exists():
            raise FileNotFoundError(f"the embedded checkpoint {name!r} is missing from {EMBEDDED[name]}")
        return EMBEDDED[name]
    if name in PRESETS:
        raise FileNotFoundError(f"preset {name!r} has no embedded weights (only {sorted(EMBEDDED)} do); "
                                f"use jtilert.random_model({name!r}) or a checkpoint path")
    raise FileNotFoundError(f"no checkpoint at {name!r} and no preset of that name "
                            f"(presets: {', '.join(PRESETS)})")


def load(source: str | os.PathLike, mesh: Mesh | None = None, dtype=None, check: bool = True) -> Transformer:
    """Load a jtilert checkpoint, an HF model folder (config.json + safetensors) or an embedded
    preset ("tiny"). With a mesh, every parameter lands directly in its tensor-parallel sharding, each
    device reading its own part (a checkpoint converted for another tp degree too, reading whole chunks
    around its part). `dtype` sets the compute dtype (default: the checkpoint's); fp8 weights stay fp8.
    Every chunk of a layout-4 checkpoint is checked against its CRC-32C as it is read; `check` (default)
    also checks a layout-3 checkpoint's files against the CRC-32s recorded when it was saved. A tp that
    does not divide the model, or weights that do not fit in the devices' free memory, fail before
    anything is read."""
    path = resolve(source)
    if (path / META).exists():
        meta = read_meta(path)
        if meta["layout_version"] == 2:
            src = meta.get("source", {}).get("path", "SRC")
            raise ValueError(f"{path} is a layout-2 converted checkpoint (raw per-device shard files), which this "
                             f"jtilert no longer reads; convert its source again: jtilert convert {src} {path} "
                             f"--tp {meta.get('tp', 1)} --overwrite")
        model = _load_jtilert(path, meta, mesh, dtype, check)
    elif (path / "config.json").exists():
        model = load_hf(path, mesh, dtype)
    else:
        raise FileNotFoundError(f"{path} is neither a jtilert checkpoint ({META}) nor an HF folder (config.json)")
    model.source = str(path.absolute())   # where `save` finds the tokenizer to keep with the weights
    return model


def _tokenizer_of(source: str | None) -> str | Path | None:
    """The tokenizer stored with the checkpoint a model was loaded from ("bytes", a tokenizer.json, or None)."""
    if source is None:
        return None
    folder = Path(source)
    if (folder / "tokenizer.json").exists():
        return folder / "tokenizer.json"
    if (folder / META).exists() and read_meta(folder).get("tokenizer") == "bytes":
        return "bytes"
    return None


def _check_params(path: Path, meta: dict, model: Transformer) -> dict:
    """The model's parameters as the checkpoint names them (stacked from layout 3 on, per layer before),
    checked against the shapes and dtypes the checkpoint records."""
    stored = meta["params"]
    expected = dict(flat_params(model)) if meta["layout_version"] >= 3 else layer_params(model)
    for name, x in expected.items():
        if name not in stored:
            raise ValueError(f"{path}: parameter {name} missing from the checkpoint")
        shape, dt = stored[name]
        if tuple(shape) != tuple(x.shape) or dt != jnp.dtype(x.dtype).name:
            raise ValueError(f"{path}: parameter {name} has shape {tuple(shape)} {dt} in the checkpoint, "
                             f"the config needs {tuple(x.shape)} {jnp.dtype(x.dtype).name}")
    extra = set(stored) - set(expected)
    if extra:
        raise ValueError(f"{path}: checkpoint has parameters the config does not: {sorted(extra)[:5]}")
    return expected


def _load_jtilert(path: Path, meta: dict, mesh, dtype, check: bool) -> Transformer:
    cfg = ModelConfig.from_json_dict(meta["config"])
    model = abstract_model(cfg, meta["weight_format"], dtype or meta["dtype"])
    expected = _check_params(path, meta, model)
    check_fits(model, mesh, str(path))   # a tp that does not divide the model, weights that do not fit
    if mesh is not None:   # then a split that would cut fp8 blocks
        for k, x in sorted(expected.items(), key=lambda kv: kv[0].endswith(".scale")):  # weights first
            sharding.check_split(k, x.shape, x.dtype, mesh.shape[sharding.AXIS])
    if check:   # layout 4: TensorStore checks every chunk's CRC-32C as it reads it; here only the sizes
        if "checksums" in meta:
            check_files(path, meta, contents=meta["layout_version"] < 4)
        elif meta["layout_version"] < 4:
            warnings.warn(f"{path} was written without checksums: its files are not checked (`jtilert.save` it "
                          f"again to add them)", stacklevel=3)
    restored = arrays.restore(path / "params", {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_sharding_of(k, x.ndim, mesh))
                                                for k, x in expected.items()})
    if meta["layout_version"] >= 3:
        return _fill(model, lambda name, _: restored[name])
    return _place(_stacked(model, lambda name, _: restored.pop(name)), mesh)


def _place(model: Transformer, mesh) -> Transformer:
    """Every parameter in its sharding (stacks built from per-layer parts land where jnp.stack put them)."""
    return _fill(model, lambda name, x: jax.device_put(x, _sharding_of(name, x.ndim, mesh)))


def load_hf(path: str | os.PathLike, mesh: Mesh | None = None, dtype=None, **config_overrides) -> Transformer:
    """Load an HF folder: fp32, bf16, or fp8 with `weight_scale_inv` block scales."""
    path = Path(path)
    tensors = hf.open_folder(path)
    raw = json.loads((path / "config.json").read_text())
    n = raw.get("num_hidden_layers", 61)
    has_mtp = any(k.startswith(f"model.layers.{n}.") for k in tensors)
    cfg = ModelConfig.from_hf(path, num_nextn_predict_layers=int(has_mtp), **config_overrides)
    fmt = hf.weight_format(tensors, path)

    flat: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = collections.defaultdict(dict)
    for key, f, name, e in hf.targets(tensors, n):
        if e is None:
            flat[name] = f.get(key)
        else:
            experts[name][e] = f.get(key)
    for name, per in experts.items():
        missing = sorted(set(range(cfg.n_routed_experts)) - set(per))
        if missing:
            raise ValueError(f"{path}: {name} is missing experts {missing[:5]}")
        flat[name] = np.stack([per[i] for i in range(cfg.n_routed_experts)])
    for name in [k for k in flat if k.endswith("experts.gate_up.weight")]:
        w = flat.pop(name)
        half = w.shape[1] // 2
        flat[name.replace("gate_up", "gate")], flat[name.replace("gate_up", "up")] = w[:, :half], w[:, half:]

    model = abstract_model(cfg, fmt, dtype)
    check_fits(model, mesh, str(path))
    unexpected = set(flat) - set(layer_params(model))
    if unexpected:
        raise ValueError(f"{path}: tensors with no place in a {cfg.model_type} model: {sorted(unexpected)[:5]}")

    def get(name, like):
        if name not in flat:
            raise ValueError(f"{path}: no tensor for parameter {name} (shape {tuple(like.shape)})")
        x = flat[name]
        if tuple(x.shape) != tuple(like.shape):
            raise ValueError(f"{path}: parameter {name} has shape {tuple(x.shape)}, the config needs {tuple(like.shape)}")
        if (x.dtype == np.dtype(jnp.float8_e4m3fn)) != (like.dtype == jnp.float8_e4m3fn):
            raise ValueError(f"{path}: parameter {name} is {x.dtype}, the {fmt} model needs {jnp.dtype(like.dtype).name}")
        return np.asarray(x).astype(like.dtype)

    return _place(_stacked(model, get), mesh)


# What a converted checkpoint and its HF source must agree on (the layers kept may differ: --layers).
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "n_shared_experts", "index_n_heads", "index_head_dim")


def verify(dst: str | os.PathLike, against: str | os.PathLike | None = None, **kwargs) -> dict:
    """Check a checkpoint and return a summary. Layout 4 (saved or converted): every chunk file's size
    and CRC-32C, and with `against` its HF source, sampled rows compared once the source is known to
    have the same shapes (`kwargs` go to `jtilert.store.convert.verify`). Layout 3: its files against
    the sizes and CRC-32s `save` recorded. Raises ValueError."""
    path = resolve(dst)
    meta = read_meta(path)
    if meta["layout_version"] < 4:
        if against is not None:
            raise ValueError(f"{path} (layout {meta['layout_version']}) was written by jtilert.save: `against` "
                             f"compares a converted checkpoint with its HF source")
        n = check_files(path, meta)
        return {"path": str(path), "files": len(meta["checksums"]["files"]), "bytes": n}
    if against is not None and "source" in meta:   # a conversion: the spot check compares rows by position,
        ours, theirs = ModelConfig.from_json_dict(meta["config"]), ModelConfig.from_hf(against)
        differ = [f"{f} {getattr(theirs, f)} there, {getattr(ours, f)} here" for f in SHAPE_FIELDS
                  if getattr(theirs, f) != getattr(ours, f)]
        if differ:
            raise ValueError(f"{against} is another model than {path}: {'; '.join(differ)}")
    return convert.verify(path, against=against, **kwargs)


def config(source: str | os.PathLike) -> ModelConfig:
    """The model config of a checkpoint, HF folder or embedded preset, without reading weights."""
    path = resolve(source)
    if (path / META).exists():
        return ModelConfig.from_json_dict(read_meta(path)["config"])
    return ModelConfig.from_hf(path)


def info(source: str | os.PathLike) -> dict:
    """A summary of a checkpoint: config, weight format, parameter count and bytes."""
    path = resolve(source)
    extra = {}
    if (path / META).exists():
        meta = read_meta(path)
        cfg = ModelConfig.from_json_dict(meta["config"])
        shapes = {k: (tuple(s), d) for k, (s, d) in meta["params"].items()}
        fmt, kind = meta["weight_format"], "jtilert"
        extra = {"layout_version": meta["layout_version"], **({"tp": meta["tp"]} if "tp" in meta else {})}
    else:
        cfg = ModelConfig.from_hf(path)
        tensors = hf.open_folder(path)
        shapes = {k: (f.meta(k)[0], f.meta(k)[1].name) for k, f in tensors.items()}
        fmt = "fp8" if any(k.endswith("weight_scale_inv") for k in shapes) else "hf"
        kind = "hf"
    count = sum(int(np.prod(s)) for s, _ in shapes.values())
    nbytes = sum(int(np.prod(s)) * jnp.dtype(d).itemsize for s, d in shapes.values())
    return {"path": str(path), "kind": kind, "model_type": cfg.model_type, "weight_format": fmt,
            "layers": cfg.num_hidden_layers, "mtp": cfg.num_nextn_predict_layers, "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "parameters": count, "bytes": nbytes, "tensors": len(shapes), **extra}
