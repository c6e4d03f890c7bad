"""Reading the source safetensors files: row ranges of a matrix with pread, O_DIRECT into pooled page-aligned
buffers where the filesystem allows it (else through the page cache); never a memory map, so resident memory
is what is held, not what has been touched."""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from jtilert.store.arrays import ALIGN, DIRECT
from jtilert.store.convert.plan import ConvertError, Mat
DIRECT_READ_MIN = 1 << 20  # reads at least this large bypass the page cache (O_DIRECT), where allowed
POOLED_MIN = 64 << 10      # reads at least this large land in pool buffers (malloc'ed ones, freed by another
                           # thread, would linger in the allocator's arenas)


class Pool:
    """Reusable page-aligned read buffers (anonymous maps of one size). Reusing them keeps page faults
    and unmaps out of the stream, and freed pieces never linger in the allocator's arenas."""

    def __init__(self, size: int):
        self.size = -(-size // ALIGN) * ALIGN
        self.free: list = []
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> "Lease":
        with self.lock:
            mm = self.free.pop() if self.free and nbytes <= self.size else None
        if mm is None:
            mm = mmap.mmap(-1, max(self.size, nbytes))
        return Lease(self, mm)

    def close(self) -> None:
        with self.lock:
            self.free.clear()  # (the maps go when the last array over them does)


class Lease:
    """Memory on loan until every piece using it has been written: `hold(k)` adds k users, `release()` drops
    one; the last release returns a pool buffer to its pool and calls `on_free` (the writer's budget)."""

    def __init__(self, pool: Pool | None, mm, nbytes: int = 0):
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


def read_bytes(files: "Files", path: Path, pos: int, size: int,
                pool: Pool | None = None) -> tuple[np.ndarray, "Lease | None"]:
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
    if lease is None and size >= POOLED_MIN and pool is not None:
        lease = pool.take(size)
    buf = lease.array(size) if lease is not None else np.empty(size, np.uint8)
    if _pread(files.get(path), buf, pos) < size:
        raise ConvertError(f"{path}: file ends before byte {pos + size} (truncated while reading?)")
    return buf, lease




class Files:
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
                if DIRECT["ok"]:
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




def read_rows(m: Mat, files: Files, a: int, b: int, pool: Pool | None = None):
    """Rows a:b of a source matrix as an array; with a pool, (array, lease of the buffer holding it or None)."""
    row = m.cols * m.dtype.itemsize
    x, lease = read_bytes(files, m.file.path, m.offset + a * row, (b - a) * row, pool)
    x = x.view(m.dtype).reshape(b - a, m.cols)
    return x if pool is None else (x, lease)
