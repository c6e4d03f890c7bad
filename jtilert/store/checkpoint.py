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
"""

from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jtilert.store import arrays, hf
from jtilert.parallel import sharding
from jtilert.model.config import ModelConfig
from jtilert.model.presets import PRESETS
from jtilert.store.folder import LAYOUT_VERSION, META, move_into_place, np_dtype, read_meta, replaceable  # noqa: F401
from jtilert.model.transformer import Transformer, abstract_model, flat_params, layer_arrays, layer_names, layer_params  # noqa: F401

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
    if mesh is None:  # the default device; never the sharding saved with the checkpoint (the
        # embedded one was written on a CPU, and orbax refuses another machine's topology)
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, sharding.spec_for(tuple(name.split(".")), ndim))


def _nest(flat: dict) -> dict:
    out: dict = {}
    for name, x in flat.items():
        *parents, leaf = name.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = x
    return out


def _flatten(nested: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in nested.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# ---- save ----------------------------------------------------------------------------------

def save(model: Transformer, path: str | os.PathLike, overwrite: bool = False,
         tokenizer: str | os.PathLike | None = None, chunk_bytes: int = arrays.CHUNK_BYTES) -> Path:
    """Write `model` to `path` atomically (temporary folder, then rename) in layout 4, each chunk of at most
    about `chunk_bytes` with its CRC-32C; `overwrite` replaces a jtilert checkpoint (nothing else).
    `tokenizer` is "bytes" (UTF-8 byte ids) or the path of an HF tokenizer.json to store beside the weights."""
    path = Path(path).absolute()
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
        replaceable(path)
    params = flat_params(model)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        chunked = {}
        for name, x in params.items():
            split = sharding.split_axis(tuple(name.split(".")))
            tp = 1 if split is None else x.shape[split] // x.sharding.shard_shape(x.shape)[split]
            lead = 1 if layer_names(model.cfg, name) else 0
            chunked[name] = (x, arrays.chunk_shape(x.shape, jnp.dtype(x.dtype).itemsize, split, tp, chunk_bytes, lead))
        arrays.write_arrays(tmp / "params", chunked)
        meta = {"layout_version": LAYOUT_VERSION, "weight_format": weight_format(params),
                "dtype": jnp.dtype(model.dtype).name, "config": model.cfg.to_hf(),
                "params": {k: [list(v.shape), jnp.dtype(v.dtype).name] for k, v in params.items()}}
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


def load(source: str | os.PathLike, mesh: Mesh | None = None, dtype=None) -> Transformer:
    """Load a jtilert checkpoint, an HF model folder (config.json + safetensors) or an embedded
    preset ("tiny"). With a mesh, every parameter lands directly in its tensor-parallel sharding, each
    device reading its own part (a checkpoint converted for another tp degree too, reading whole chunks
    around its part). `dtype` sets the compute dtype (default: the checkpoint's); fp8 weights stay fp8."""
    path = resolve(source)
    if (path / META).exists():
        meta = read_meta(path)
        if meta["layout_version"] == 2:
            src = meta.get("source", {}).get("path", "SRC")
            raise ValueError(f"{path} is a layout-2 converted checkpoint (raw per-device shard files), which this "
                             f"jtilert no longer reads; convert its source again: jtilert convert {src} {path} "
                             f"--tp {meta.get('tp', 1)} --overwrite")
        return _load_jtilert(path, meta, mesh, dtype)
    if (path / "config.json").exists():
        return load_hf(path, mesh, dtype)
    raise FileNotFoundError(f"{path} is neither a jtilert checkpoint ({META}) nor an HF folder (config.json)")


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


def _load_jtilert(path: Path, meta: dict, mesh, dtype) -> Transformer:
    cfg = ModelConfig.from_json_dict(meta["config"])
    model = abstract_model(cfg, meta["weight_format"], dtype or meta["dtype"])
    expected = _check_params(path, meta, model)
    if mesh is not None:
        for k, x in sorted(expected.items(), key=lambda kv: kv[0].endswith(".scale")):  # weights first
            sharding.check_split(k, x.shape, x.dtype, mesh.shape[sharding.AXIS])
    target = _nest({k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_sharding_of(k, x.ndim, mesh))
                    for k, x in expected.items()})
    restored = _flatten(arrays.restore(path / "params", target))
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
    if any(k.endswith("weight_scale_inv") for k in tensors):
        fmt = "fp8"
    elif "model.embed_tokens.weight" in tensors:
        fmt = "fp32" if tensors["model.embed_tokens.weight"].meta("model.embed_tokens.weight")[1] == np.float32 else "bf16"
    else:
        raise ValueError(f"{path}: no model.embed_tokens.weight tensor")

    flat: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = collections.defaultdict(dict)
    for key, f in tensors.items():
        try:
            t = hf.target_name(key, n)
        except ValueError as e:
            raise ValueError(f"{f.path}: {e}") from None
        if t is None:
            continue
        name, e = t
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
