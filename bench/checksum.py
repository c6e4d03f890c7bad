"""What checking a checkpoint costs against reading it: the read rate of a converted checkpoint's files
(O_DIRECT, past the page cache), the CRC-32 (`save`'s file record, zlib) and CRC-32C (layout 4's chunk
codec, TensorStore's) rates over the same bytes in memory, and `jtilert.load` of it (every chunk's
CRC-32C checked as it is read; `check` adds only a size check of each file in layout 4).

    PYTHONPATH=. python3 bench/checksum.py [--preset dsv32-tp8-shard --layers 2] [--out checksum.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import tempfile
import time
import zlib
from pathlib import Path

import jax
import numpy as np

import jtilert
from jtilert.store import arrays


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in (ckpt / "params").rglob("*") if p.is_file())


def read_direct(files: list[Path], block: int = 8 << 20) -> float:
    """GB/s reading the files with O_DIRECT (the page cache bypassed where the filesystem allows it)."""
    buf = mmap.mmap(-1, block)
    total, t0 = 0, time.perf_counter()
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            fd = os.open(f, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9


def checksum_rate(data: np.ndarray, fn) -> float:
    t0 = time.perf_counter()
    fn(data)
    return data.nbytes / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv32-tp8-shard")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        ckpt = Path(tmp) / "ckpt"   # converted from a synthetic HF folder: bounded memory at any size
        src = jtilert.random_checkpoint(a.preset, Path(tmp) / "src", fmt="fp8", num_layers=a.layers)
        jtilert.convert(src, ckpt, progress=False)
        files = _files(ckpt)
        nbytes = sum(f.stat().st_size for f in files)
        data = np.fromfile(max(files, key=lambda f: f.stat().st_size), np.uint8)
        result = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "cpus": os.cpu_count(),
                  "preset": a.preset, "layers": a.layers, "checkpoint_bytes": nbytes, "files": len(files),
                  "read_direct_GBs": read_direct(files),
                  "crc32_zlib_GBs": checksum_rate(data, zlib.crc32),
                  "crc32c_tensorstore_GBs": checksum_rate(data, arrays.crc32c)}
        for i, check in enumerate((True, False, True, False)):   # alternating: the first meets a colder cache
            t0 = time.perf_counter()
            jax.block_until_ready(jtilert.load(ckpt, check=check))
            result[f"load_{i}_check_{check}_GBs"] = nbytes / (time.perf_counter() - t0) / 1e9
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
