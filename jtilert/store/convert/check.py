"""Checking a layout-4 checkpoint: every array present with the shape and dtype its config needs and CRC-32C in
its codecs, every chunk file present and intact (read back through TensorStore, which checks the CRC-32C); with
the HF source, sampled rows of every matrix compared with it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jtilert.model.config import ModelConfig
from jtilert.model.transformer import abstract_model, flat_params, layer_names, stacked_name
from jtilert.ops.quant import BLOCK
from jtilert.store import arrays
from jtilert.store.convert.pipeline import CHUNK_BYTES, Progress, dequant
from jtilert.store.convert.plan import F32, ConvertError, plan
from jtilert.store.convert.source import Files, read_rows
from jtilert.store.folder import LAYOUT_VERSION, META, read_meta


def verify(dst: str | os.PathLike, against: str | os.PathLike | None = None, samples: int = 2, progress: bool = False,
           chunk_bytes: int = CHUNK_BYTES, seed: int = 0) -> dict:
    """Check a checkpoint written by `convert` or `jtilert.save`: every parameter present with the shape and
    dtype its config needs, every chunk present with its CRC-32C intact; with `against` (the HF source of a
    converted checkpoint), compare `samples` rows of every matrix (of two experts per stacked parameter),
    dequantised, with the source's. Raises ValueError listing the problems; returns a summary."""
    path = Path(dst)
    if not (path / META).exists():
        raise FileNotFoundError(f"{path}: no {META} (not a jtilert checkpoint, or an unfinished conversion)")
    meta = read_meta(path)
    if meta["layout_version"] != LAYOUT_VERSION:
        raise ConvertError(f"{path}: layout version {meta['layout_version']} stores no chunk checksums; verify "
                           f"checks layout {LAYOUT_VERSION} (convert the HF folder again, or load and jtilert.save it)")
    cfg = ModelConfig.from_json_dict(meta["config"])
    root = path / "params"
    problems: list[str] = []
    expected = {k: (list(v.shape), np.dtype(v.dtype).name) for k, v in
                flat_params(abstract_model(cfg, meta["weight_format"])).items()}
    params = meta["params"]
    for name in sorted(set(expected) - set(params)):
        problems.append(f"parameter {name} missing")
    for name in sorted(set(params) - set(expected)):
        problems.append(f"parameter {name} is not part of the model")
    if not (root / arrays.TREE_METADATA).exists():
        problems.append(f"{root / arrays.TREE_METADATA}: missing (orbax's tree metadata)")
    opened = {}
    for name in sorted(set(expected) & set(params)):
        if [list(params[name][0]), params[name][1]] != list(expected[name]):
            problems.append(f"parameter {name}: {params[name]} in the metadata, the config needs {expected[name]}")
            continue
        try:
            arr = arrays.open_array(root, name)
        except ValueError as e:
            problems.append(f"{root / name}: cannot be opened ({str(e).splitlines()[0]})")
            continue
        shape, dt = tuple(arr.shape), arr.dtype.numpy_dtype.name
        if [list(shape), dt] != list(expected[name]):
            problems.append(f"{root / name}: {list(shape)} {dt}, parameter {name} needs {expected[name]}")
            continue
        codecs = [c["name"] for c in arr.spec().to_json()["metadata"]["codecs"]]
        if "crc32c" not in codecs:
            problems.append(f"{root / name}: its chunks carry no CRC-32C (codecs {codecs})")
            continue
        opened[name] = arr
    total = sum(int(np.prod(a.shape)) * a.dtype.numpy_dtype.itemsize for a in opened.values())
    prog = Progress(total, progress, f"verify {path.name}")
    checker = arrays.Checker(chunk_bytes)
    checked = 0
    try:
        for name, arr in opened.items():
            prog.tensor(name)
            chunk = tuple(arr.chunk_layout.read_chunk.shape)
            boxes = arrays.chunk_boxes(tuple(arr.shape), chunk)
            for idx, problem in checker.check(arr, root / name, boxes, prog.advance):
                if problem is None:
                    checked += 1
                else:
                    problems.append(f"{root / name / arrays.chunk_key(idx)}: {problem} (parameter {name})")
    finally:
        prog.close()
    spot = 0
    if against is not None and not problems:
        if "source" not in meta:
            raise ConvertError(f"{path} was not converted from an HF folder (jtilert.save wrote it); --against "
                               f"compares a converted checkpoint with its source")
        spot = _spot_check(path, meta, against, samples, seed, problems)
    if problems:
        raise ConvertError(f"{path}: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:20])
                           + ("\n  ..." if len(problems) > 20 else ""))
    return {"path": str(path), "arrays": len(opened), "chunks": checked, "bytes": total, "tp": meta.get("tp"),
            "spot_checked": spot}


def _spot_check(path: Path, meta: dict, against, samples: int, seed: int, problems: list) -> int:
    """Compare sampled rows, dequantised, of every parameter with the source."""
    cfg = ModelConfig.from_json_dict(meta["config"])
    p = plan(against, meta["tp"], meta["weight_format"], tuple(meta["layers"]), bool(cfg.num_nextn_predict_layers))
    rng = np.random.default_rng(seed)
    files = Files()
    opened: dict[str, object] = {}

    def row(name: str, idx: tuple) -> np.ndarray:
        """Per-layer parameter `name` at idx (a row, or the whole vector) as stored."""
        array, layer = stacked_name(cfg, name)
        if array not in opened:
            opened[array] = arrays.open_array(path / "params", array)
        lead = () if layer is None else (layer,)
        return np.asarray(opened[array][lead + idx].read().result()).reshape(-1)

    stored = {n for name in meta["params"] for n in (layer_names(cfg, name) or [name])}  # per-layer names
    n = 0
    try:
        for item in p.items:
            if item.name.endswith(".scale"):
                continue  # checked through the dequantised weights
            sname = item.name.removesuffix("weight") + "scale"
            scaled = sname in stored
            stacked = len(item.shape) == 3
            experts = sorted({0, int(rng.integers(len(item.mats)))}) if stacked else [0]
            for e in experts:
                m = item.mats[e]
                for r in sorted(set(rng.integers(m.rows, size=samples).tolist())):
                    src = read_rows(m, files, r, r + 1)
                    if m.scale is not None:
                        src = dequant(src, read_rows(m.scale, files, 0, m.scale.rows), r, F32)
                    src = src.astype(F32)[0]
                    idx = ((e,) if stacked else ()) + ((r,) if len(item.shape) >= 2 else ())
                    got = row(item.name, idx)
                    if scaled:
                        sc = row(sname, ((e,) if stacked else ()) + (r // BLOCK,))
                        got = dequant(got[None], sc[None], 0, F32)[0]
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

