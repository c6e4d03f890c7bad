"""Synthetic HF checkpoints: random weights in the real file layout, at any width, for tests and benchmarks.

`random_checkpoint(config, path)` writes what a model's HF repository holds (config.json, numbered
`model-0000i-of-0000n.safetensors` files with an index json): fp8 e4m3 linear weights with their fp32
`weight_scale_inv` block scales (power-of-two, as the official checkpoints), bf16 norms, embeddings and lm
head, an fp32 router bias, per-expert keys, and the MTP layer with its copies of the embedding and head.
Tensors are generated and written piece by piece (bounded memory), deterministically from `seed` and the key.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np

from jtilert.store import checkpoint
from jtilert.store import hf
from jtilert.model.config import ModelConfig
from jtilert.model.presets import preset
from jtilert.model.transformer import abstract_model, layer_params

HF_DTYPE = {"float8_e4m3fn": "F8_E4M3", "float32": "F32", "bfloat16": "BF16"}
CHUNK_BYTES = 64 << 20


def _config(config, num_layers: int | None) -> ModelConfig:
    cfg = preset(config) if isinstance(config, str) else config
    if num_layers is not None:
        fkd = min(cfg.first_k_dense_replace, max(num_layers - 1, 0))
        cfg = cfg.replace(num_hidden_layers=num_layers, first_k_dense_replace=fkd)
    return cfg


def hf_tensors(cfg: ModelConfig, fmt: str = "fp8", mtp_copies: bool = True) -> list[tuple[str, tuple, str]]:
    """(HF key, shape, dtype name) of every tensor of an HF checkpoint of `cfg`, in the official order
    (embedding, layer by layer with experts one by one, the MTP layer, final norm, head)."""
    params = {k: (tuple(v.shape), np.dtype(v.dtype).name) for k, v in layer_params(abstract_model(cfg, fmt)).items()}
    n = cfg.num_hidden_layers
    dense = "float32" if fmt == "fp32" else "bfloat16"

    def hf_dtype(name, dt):
        if dt in ("float8_e4m3fn",) or name.endswith(".scale") or name.endswith("e_score_correction_bias"):
            return dt
        return dense

    groups: dict[str, list] = {}
    for name, (shape, dt) in params.items():
        key = hf.source_name(name, n)
        if name.startswith("layers."):
            group = int(name.split(".")[1])
        elif name.startswith("mtp."):
            group = n
        else:
            group = {"embed_tokens": -1, "norm.weight": n + 1}.get(name, n + 2)
        entries = groups.setdefault(group, [])
        if "{e}" in key:
            for e in range(shape[0]):
                entries.append((key.format(e=e), shape[1:], hf_dtype(name, dt)))
        else:
            entries.append((key, shape, hf_dtype(name, dt)))
    if cfg.num_nextn_predict_layers and mtp_copies:
        groups[n] += [(f"model.layers.{n}.embed_tokens.weight", params["embed_tokens"][0], dense),
                      (f"model.layers.{n}.shared_head.head.weight", params["lm_head.weight"][0], dense)]
    out = []
    for g in sorted(groups):
        out += sorted(groups[g], key=lambda t: _natural(t[0]))
    return out


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in key.split(".")]


def _fill(key: str, shape: tuple, dtype: str, seed: int, rows_per_piece: int):
    """Pieces (whole rows) of a random tensor."""
    bits = np.random.SFC64([seed, zlib.crc32(key.encode())])
    rng = np.random.Generator(np.random.SFC64([seed, zlib.crc32(key.encode()), 1]))
    fan_in = shape[-1] if len(shape) == 2 else 1
    std = fan_in ** -0.5
    if len(shape) == 1:
        if key.endswith("weight"):  # norms
            x = 1.0 + 0.1 * rng.standard_normal(shape[0], np.float32)
        else:  # biases
            x = 0.1 * rng.standard_normal(shape[0], np.float32)
        yield x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
        return
    rows, cols = shape
    if key.endswith("weight_scale_inv"):
        # q is spread like a weight of std 0.58 (see below): powers of two near std/0.58, half of them halved
        weight_cols = cols * 128
        base = np.float32(2.0 ** np.round(np.log2(weight_cols ** -0.5 / 0.58)))
        yield (base * np.where(rng.random((rows, cols)) < 0.5, np.float32(1), np.float32(0.5))).astype(np.float32)
        return
    for a in range(0, rows, rows_per_piece):
        r = min(rows_per_piece, rows - a)
        n = r * cols
        if dtype == "float8_e4m3fn":
            # uniform bytes with the top exponent bit cleared: finite values in [-1.875, 1.875], rms ≈ 0.58
            raw = bits.random_raw(-(-n // 8)).view(np.uint8)[:n]
            raw &= 0xBF
            yield raw.view(ml_dtypes.float8_e4m3fn).reshape(r, cols)
        elif dtype == "bfloat16":
            # random sign and mantissa, exponent in [e-2, e+1] around std = 2^e
            e = int(np.floor(np.log2(std))) + 127 - 2
            raw = bits.random_raw(-(-n // 4)).view(np.uint16)[:n]
            x = (raw & np.uint16(0x807F)) | (((raw >> np.uint16(7)) & np.uint16(3)) + np.uint16(e)) << np.uint16(7)
            yield x.view(ml_dtypes.bfloat16).reshape(r, cols)
        else:
            yield (std * rng.standard_normal((r, cols), np.float32))


def _header(entries: list[tuple[str, tuple, str]]) -> bytes:
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for key, shape, dt in entries:
        n = int(np.prod(shape)) * np.dtype(getattr(ml_dtypes, dt, None) or dt).itemsize
        header[key] = {"dtype": HF_DTYPE[dt], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def random_checkpoint(config: ModelConfig | str, path: str | os.PathLike, fmt: str = "fp8", seed: int = 0, *,
                      num_layers: int | None = None, max_file_bytes: int = 4 << 30, mtp_copies: bool = True,
                      overwrite: bool = False, progress: bool = False, chunk_bytes: int = CHUNK_BYTES,
                      sparse: bool = False) -> Path:
    """Write an HF-layout folder of `config` (a ModelConfig or preset name) with random weights.

    fmt: "fp8" (e4m3 linear weights + block scales, bf16 elsewhere), "bf16" or "fp32". num_layers keeps the
    width and uses that many decoder layers (first_k_dense_replace capped so at least one MoE layer remains).
    Files hold at most `max_file_bytes` (one tensor may exceed it). sparse=True writes only the headers and
    leaves the data as holes (all zeros, no disk used): a full-size folder for checking conversion plans.
    Written to a temporary folder, renamed into place when complete. Returns the folder."""
    if fmt not in ("fp8", "bf16", "fp32"):
        raise ValueError(f"fmt {fmt!r}: expected fp8, bf16 or fp32")
    cfg = _config(config, num_layers)
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    entries = hf_tensors(cfg, fmt, mtp_copies)
    sizes = [int(np.prod(s)) * np.dtype(getattr(ml_dtypes, d, None) or d).itemsize for _, s, d in entries]
    files: list[list] = [[]]
    acc = 0
    for entry, size in zip(entries, sizes):
        if files[-1] and acc + size > max_file_bytes:
            files.append([])
            acc = 0
        files[-1].append(entry)
        acc += size
    total = sum(sizes)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=path.name, file=sys.stderr)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        weight_map = {}
        for i, group in enumerate(files):
            name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            with open(tmp / name, "wb") as f:
                f.write(_header(group))
                for key, shape, dt in group:
                    weight_map[key] = name
                    if sparse:
                        continue
                    cols = shape[-1] if shape else 1
                    for piece in _fill(key, shape, dt, seed, max(1, chunk_bytes // (cols * 4))):
                        f.write(memoryview(np.ascontiguousarray(piece).reshape(-1).view(np.uint8)))
                        if bar is not None:
                            bar.update(piece.nbytes)
                if sparse:
                    f.truncate(len(_header(group)) + sum(
                        int(np.prod(s)) * np.dtype(getattr(ml_dtypes, d, None) or d).itemsize for _, s, d in group))
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        conf = cfg.to_hf()
        conf.pop("jtilert", None)
        conf["num_nextn_predict_layers"] = cfg.num_nextn_predict_layers
        conf["torch_dtype"] = "float32" if fmt == "fp32" else "bfloat16"
        if fmt == "fp8" and cfg.index_quant == "fp8":  # what the official fp8 checkpoints say
            conf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                           "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
        (tmp / "config.json").write_text(json.dumps(conf, indent=1))
        checkpoint.move_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bar is not None:
            bar.close()
    return path
