"""A jtilert checkpoint folder's metadata file, its atomic placement and what may be replaced (shared by
`checkpoint`, which reads and writes checkpoints, and `convert`, which writes them from HF folders)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np

META = "jtilert.json"
LAYOUT_VERSION = 4  # what `save` and `convert` write; bump when the stored layout of any parameter changes
# 1: per-layer orbax; 2: jtilert.convert's per-shard raw files (no longer read); 3: stacked orbax (orbax's
# own arrays); 4: stacked orbax, zarr3 chunks with CRC-32C (jtilert.store.arrays)
LAYOUT_VERSIONS = (1, 2, 3, 4)
REQUEST = "request.json"  # a partial conversion's arguments and source files
DONE_LOG = "done.jsonl"   # a partial conversion's finished parameters


def move_into_place(tmp: Path, path: Path) -> None:
    """Rename a finished temporary folder to `path`, replacing what was there only once complete."""
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)


def replaceable(path: Path) -> None:
    """Refuse to replace `path` unless it is a jtilert checkpoint (it has META), a partial conversion (it has
    REQUEST) or an empty folder: nothing else is ever deleted by an overwrite."""
    if not path.is_dir():
        raise FileExistsError(f"{path} is a file, not a jtilert checkpoint; remove it or choose another path")
    if (path / META).exists() or (path / REQUEST).exists():
        return
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return
    count = sum(1 for p in path.rglob("*") if not p.is_dir())
    listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    raise FileExistsError(f"{path} holds {count} file{'s' if count != 1 else ''} that are not a jtilert checkpoint "
                          f"({listed}); remove them or choose another folder")


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / META}: not valid JSON ({e})") from None
    if meta.get("layout_version") not in LAYOUT_VERSIONS:
        raise ValueError(f"{path}: layout version {meta.get('layout_version')} is not one of the supported "
                         f"{LAYOUT_VERSIONS}")
    return meta


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name ("bfloat16" and "float8_e4m3fn" via ml_dtypes)."""
    return np.dtype(jnp.dtype(name))
