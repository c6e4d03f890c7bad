"""The conversion: HF safetensors → a jtilert checkpoint (layout 4, `jtilert.store.arrays`), with bounded memory,
progress and resumption.

Threads: a reader thread reads the source in pieces of whole rows (`source`), a converter thread casts /
dequantises / quantises them and cuts the tp shards (views, no copy, for a plain fp8 → fp8 conversion), the
caller's thread copies each piece into the chunks it covers (`arrays.chunk_shape`: one layer, whole rows of one
shard), and a writer thread writes each full chunk's file (`arrays.write_chunk`, with the CRC-32C that
TensorStore computes) while the next chunk fills. Row-split parameters are read shard by shard (each expert's
rows of shard 0, then of shard 1, ...), so one chunk fills at a time; a column-split one fills its tp chunks
together, which is why those chunks get 1/tp of the chunk budget.

Memory bound: with `chunk_bytes` = C (32 MiB by default) a read is at most C bytes counted as fp32 (the one in
flight and the one being converted), at most C bytes of converted pieces wait for the caller's thread, the
chunks being filled hold at most C, and one chunk (at most C) is being written, TensorStore holding a copy of it
while it computes the CRC-32C. Peak RSS ≤ RSS after import + 6·C + O(metadata), whatever the size of the
checkpoint; `tests/test_convert_memory.py` measures it.

Interruption: everything is written to the hidden sibling `.DST.partial/`, with the request (`request.json`: the
arguments and source files) and a log of the parameters whose chunks are all written (`done.jsonl`). Rerunning
the same command reads each logged parameter's chunks back (TensorStore checks their CRC-32C) and skips it;
anything else is rewritten. `jtilert.json` is written last and the folder is renamed to DST only when complete,
so nothing at DST ever looks complete before it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import mmap
import os
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from jtilert.model.transformer import compute_dtype
from jtilert.ops.quant import BLOCK, FP8_MAX
from jtilert.store import arrays
from jtilert.store.arrays import ALIGN
from jtilert.store.convert.plan import F32, FP8, ConvertError, Item, Plan, plan
from jtilert.store.convert.source import Files, Lease, Pool, read_rows
from jtilert.store.folder import DONE_LOG, LAYOUT_VERSION, META, REQUEST, move_into_place, replaceable

CHUNK_BYTES = arrays.CHUNK_BYTES
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


# ---- one parameter's pieces ---------------------------------------------------------------------

def _row_step(cols: int, chunk_bytes: int, blocks: bool) -> int:
    step = max(1, chunk_bytes // (max(cols, 1) * 4))
    if blocks:
        step = max(BLOCK, step // BLOCK * BLOCK)
    return step


def dequant(x: np.ndarray, s: np.ndarray, a: int, dtype) -> np.ndarray:
    """Rows a.. of an fp8 matrix times their 128×128 block scales, as jtilert.ops.quant.dequantize does
    (an fp32 product, then a cast), one block column at a time (temporaries of 128 columns, not the rows'
    fp32 copy)."""
    out = np.empty(x.shape, dtype)
    srows = s[(a + np.arange(x.shape[0])) // BLOCK].astype(F32)  # [rows, kb]
    for j in range(srows.shape[1]):
        cols = slice(j * BLOCK, (j + 1) * BLOCK)
        out[:, cols] = x[:, cols].astype(F32) * srows[:, j:j + 1]
    return out


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


def _reads(item: Item, chunk_bytes: int):
    """The reads of an item, in order: (matrix index, first row, end row, shard or None when the read spans the
    column shards). Rows split: shard by shard, each matrix's rows of that shard in turn."""
    ms, n = item.msplit, item.shards
    blocks = item.mode in ("quant", "scale", "dequant")
    steps = [_row_step(m.cols, chunk_bytes, blocks) for m in item.mats]
    if ms == 0:
        for d in range(n):
            for e, m in enumerate(item.mats):
                per = m.rows // n
                for a in range(d * per, (d + 1) * per, steps[e]):
                    yield e, a, min(a + steps[e], (d + 1) * per), d
    else:
        for e, m in enumerate(item.mats):
            for a in range(0, m.rows, steps[e]):
                yield e, a, min(a + steps[e], m.rows), None


def _pieces(item: Item, files: Files, chunk_bytes: int, reader: ThreadPoolExecutor, pool: Pool):
    """(shard, matrix index, first row written, rows of that shard of that matrix, lease or None). The `reader`
    thread has the next read in flight while this one is converted; large reads land in `pool` buffers, lent
    to the pieces cut from them (views, for a plain copy) until each has been copied into its chunk."""
    n = item.shards
    reads = list(_reads(item, chunk_bytes))
    scales: dict[int, np.ndarray] = {}

    def read(k):
        e, a, b, _ = reads[k]
        return read_rows(item.mats[e], files, a, b, pool)

    ahead = reader.submit(read, 0)
    for k, (e, a, b, d) in enumerate(reads):
        raw, lease = ahead.result()
        if k + 1 < len(reads):
            ahead = reader.submit(read, k + 1)
        m = item.mats[e]
        if item.mode == "cast":
            x = raw if raw.dtype == item.dtype else raw.astype(item.dtype)
        elif item.mode == "dequant":
            if e not in scales:
                scales[e] = read_rows(m.scale, files, 0, m.scale.rows)
            x = dequant(raw, scales[e], a, item.dtype)
        else:
            q, s = _quantize(raw)
            x = q if item.mode == "quant" else s
        row = a // BLOCK if item.mode == "scale" else a
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
            yield j, e, row, piece, lease
        del out


class _Prefetch:
    """Reads and converts the pieces of `items` in a background thread, up to `budget` bytes ahead of the writer
    (pread, the numpy conversions and copies and TensorStore's writes release the GIL, so they overlap)."""
    _END = object()

    def __init__(self, items: list[Item], files: Files, chunk_bytes: int, budget: int | None = None):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.budget, self.inflight = budget or chunk_bytes, 0
        self.stop = threading.Event()
        self.pool = Pool(max((i.mats[e].cols * i.mats[e].dtype.itemsize * (b - a) for i in items
                              for e, a, b, _ in _reads(i, chunk_bytes)), default=0) + 2 * ALIGN)
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
            for d, e, row, piece, lease in _pieces(item, files, chunk_bytes, reader, self.pool):
                if lease is None:
                    lease = Lease(None, None, piece.nbytes)
                if lease.on_free is None:  # the first piece of this memory: count all of it
                    if not self._reserve(lease.nbytes):
                        return
                    lease.on_free = functools.partial(self._free, lease.nbytes)
                if not self._put((d, e, row, piece, lease)):
                    return
                del piece, lease
            if not self._put((self._END,)):
                return

    def pieces(self):
        """The next item's pieces: (shard, matrix, first row, array, lease: release it once the array is copied)."""
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


# ---- chunks ----------------------------------------------------------------------------------

def _write_error(e: Exception, where: Path, name: str, tmp: Path) -> ConvertError:
    msg = str(e)
    what = "disk full" if "No space left" in msg or "[OS error 28]" in msg else f"cannot write ({msg.splitlines()[0]})"
    return ConvertError(f"{what} writing parameter {name} to {where}; the partial conversion is kept in {tmp} "
                        f"(not a usable checkpoint): free space and rerun the same command to resume")


class _Writer:
    """Gathers each item's pieces into its chunks; a thread writes each full chunk's file while the next one
    fills (one chunk at a time). `on_done(name)` is called once all of an item's chunks are written."""

    def __init__(self, tmp: Path, on_done: Callable[[str], None], chunk_bytes: int):
        self.tmp, self.on_done = tmp, on_done
        self.buffers = _Buffers(chunk_bytes)
        self.folders: set[Path] = set()
        self.io = ThreadPoolExecutor(1, thread_name_prefix="jtilert-write")
        self.pending = None

    def item(self, item: Item, pieces, advance) -> None:
        ce, cr, cc = _view(item.chunk)
        full = ce * cr * cc
        filling: dict[tuple, list] = {}  # chunk (expert block, row block, column block) -> [buffer, elements]
        for d, e, row, x, lease in pieces():
            cb = d if item.msplit == 1 else 0  # a chunk is a shard's whole width
            r = row
            while r < row + len(x):
                rb = r // cr
                end = min(row + len(x), (rb + 1) * cr)
                key = (e // ce, rb, cb)
                if key not in filling:
                    filling[key] = [self.buffers.take((ce, cr, cc), item.dtype), 0]
                buf = filling[key]
                buf[0][e % ce, r - rb * cr:end - rb * cr] = x[r - row:end - row]
                buf[1] += (end - r) * cc
                if buf[1] == full:
                    self._write(item, key, filling.pop(key)[0])
                r = end
            advance(x.nbytes)
            del x
            lease.release()
        if filling:
            raise ConvertError(f"internal error: parameter {item.name} left chunks {sorted(filling)[:3]} unfilled")
        self._wait()
        self.on_done(item.name)

    def _write(self, item: Item, key: tuple, buf: np.ndarray) -> None:
        start = (key[0] * buf.shape[0], key[1] * buf.shape[1], key[2] * buf.shape[2])
        box = tuple(slice(s, s + n) for s, n in zip(start, buf.shape))[3 - len(item.shape):]
        idx = item.lead + tuple(b.start // c for b, c in zip(box, item.chunk))
        path = self.tmp / "params" / item.array / arrays.chunk_key(idx)
        if path.parent not in self.folders:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.folders.add(path.parent)
        self._wait()
        self.pending = (self.io.submit(self._store, path, buf, item), path, item.name)

    def _store(self, path: Path, buf: np.ndarray, item: Item) -> np.ndarray:
        arrays.write_chunk(path, buf, arrays.crc32c(buf.reshape(item.chunk)))
        return buf

    def _wait(self) -> None:
        if self.pending is None:
            return
        fut, path, name = self.pending
        self.pending = None
        try:
            self.buffers.give(fut.result())
        except OSError as e:
            raise _write_error(e, path, name, self.tmp) from None

    def close(self) -> None:
        """Let the chunk being written finish (its error, if any, is the caller's to raise first)."""
        if self.pending is not None:
            self.pending[0].exception()
            self.pending = None
        self.io.shutdown()


class _Buffers:
    """Chunk buffers in anonymous maps (unmapped once dropped: a malloc'ed one would be freed into an allocator
    arena, which keeps the memory), reused once written: a fresh map costs a page fault per 4 kB. Sizes are
    rounded up to a multiple of an eighth of the power of two below them (at most 12.5 % more), so that
    chunks of nearby sizes share buffers; at most `keep` bytes of buffers wait to be reused."""

    def __init__(self, keep: int):
        self.keep, self.free = keep, []  # flat uint8 arrays over their maps

    @staticmethod
    def _size(nbytes: int) -> int:
        step = max(ALIGN, 1 << max(nbytes - 1, 1).bit_length() >> 4)
        return -(-nbytes // step) * step

    def take(self, shape: tuple, dtype) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        size = self._size(nbytes)
        i = next((i for i, b in enumerate(self.free) if b.nbytes == size), None)
        flat = self.free.pop(i) if i is not None else np.frombuffer(mmap.mmap(-1, size), np.uint8)
        return flat[:nbytes].view(dtype).reshape(shape)

    def give(self, buf: np.ndarray) -> None:
        flat = buf.reshape(-1).view(np.uint8)
        while flat.base is not None and isinstance(flat.base, np.ndarray):
            flat = flat.base
        self.free.append(flat)
        while sum(b.nbytes for b in self.free) > self.keep:
            self.free.pop(0)


def _view(chunk: tuple) -> tuple[int, int, int]:
    """A per-layer chunk shape as [matrices, rows, columns] (experts [E, rows, cols]; a matrix; a vector)."""
    return (1,) * (3 - len(chunk)) + tuple(chunk)


# ---- progress --------------------------------------------------------------------------------

class Progress:
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


def _resumable(tmp: Path, p: Plan, chunk_bytes: int, progress: Progress) -> set[str]:
    """Items logged as finished by an earlier run of the same request whose chunks all read back intact."""
    log = tmp / DONE_LOG
    if not log.exists():
        return set()
    logged = set()
    for line in log.read_text().splitlines():
        try:
            logged.add(json.loads(line)["name"])
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by the interruption
    good, opened = set(), {}
    checker = arrays.Checker(chunk_bytes)
    for item in p.items:
        if item.name not in logged:
            continue
        progress.tensor(f"checking {item.name}")
        a = p.arrays[item.array]
        try:
            if a.name not in opened:
                opened[a.name] = arrays.open_array(tmp / "params", a.name)
        except ValueError:
            continue
        boxes = arrays.chunk_boxes(a.shape, a.chunk, item.lead)
        checks = checker.check(opened[a.name], tmp / "params" / a.name, boxes, progress.advance)
        if all(problem is None for _, problem in checks):
            good.add(item.name)
    return good


def convert(src: str | os.PathLike, dst: str | os.PathLike, tp: int = 1, dtype: str | None = None, layers=None, *,
            mtp: bool = True, overwrite: bool = False, progress: bool = False, chunk_bytes: int = CHUNK_BYTES,
            callback: Callable[[str, int, int], None] | None = None) -> Path:
    """Convert an HF folder `src` into a jtilert checkpoint at `dst`, chunked for `tp`-way tensor parallelism.

    dtype: "fp8" (fp8 weights with their block scales; quantises a bf16/fp32 source), "bf16" or "fp32"
    (dequantises an fp8 source); default: the source's format. layers: "a:b" keeps decoder layers a..b-1
    (renumbered from 0); mtp=False drops the MTP block. An interrupted conversion resumes when rerun with the
    same arguments; `overwrite` replaces an existing `dst` that is a jtilert checkpoint (anything else is
    refused) and discards a partial conversion made with different arguments. progress: a bar on stderr with
    bytes and ETA; callback(tensor, bytes_done, bytes_total) is called as bytes are written (or re-checked).
    chunk_bytes bounds memory (peak RSS ≤ RSS after import + 6·chunk_bytes) and sets the chunk size.
    """
    t0 = time.perf_counter()
    dst = Path(dst).absolute()
    if dst.exists():
        if not overwrite:
            raise FileExistsError(f"{dst} exists (pass --overwrite / overwrite=True to replace it)")
        replaceable(dst)
    p = plan(src, tp, dtype, layers, mtp, chunk_bytes)
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
        prog = Progress(p.nbytes, progress, dst.name, callback)
        try:
            done = _resumable(tmp, p, chunk_bytes, prog)
            need = p.nbytes - sum(i.nbytes for i in p.items if i.name in done)
            free = shutil.disk_usage(tmp).free
            if need > free:
                raise ConvertError(f"not enough disk space for {dst}: the conversion needs {_size(need)} more "
                                   f"in {tmp.parent}, which has {_size(free)} free")
            req_file.write_text(json.dumps(request, indent=1))
            with open(tmp / DONE_LOG, "w") as log:  # rewritten with the intact items only
                for name in sorted(done):
                    log.write(json.dumps({"name": name}) + "\n")
            ctx = arrays.context()
            try:
                for a in p.arrays.values():
                    arrays.create(tmp / "params", a.name, a.shape, a.dtype, a.chunk, ctx)
            except ValueError as e:
                raise ConvertError(f"{tmp}: cannot create the checkpoint arrays ({str(e).splitlines()[0]}); "
                                   f"delete it or pass --overwrite to start over") from None
            todo = [item for item in p.items if item.name not in done]
            files = Files()
            try:
                with open(tmp / DONE_LOG, "a") as log, _Prefetch(todo, files, chunk_bytes) as stream:
                    def logged(name):
                        log.write(json.dumps({"name": name}) + "\n")
                        log.flush()

                    writer = _Writer(tmp, logged, chunk_bytes)
                    try:
                        for item in todo:
                            prog.tensor(item.name)
                            writer.item(item, stream.pieces, prog.advance)
                            written += 1
                    finally:
                        writer.close()
            finally:
                files.close()
            prog.tensor("syncing")
            _finish(p, tmp, dst, overwrite)
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


def _meta(p: Plan) -> dict:
    return {"layout_version": LAYOUT_VERSION, "weight_format": p.fmt, "dtype": np.dtype(compute_dtype(p.fmt)).name,
            "config": p.cfg.to_hf(), "tp": p.tp, "layers": list(p.layers),
            "source": {"path": str(p.src.absolute()), "format": p.source_format},
            "params": {a.name: [list(a.shape), a.dtype.name] for a in sorted(p.arrays.values(), key=lambda a: a.name)}}


def _sync_all(tmp: Path) -> None:
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
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync(f)


def _finish(p: Plan, tmp: Path, dst: Path, overwrite: bool) -> None:
    for f in (tmp / "params").rglob("*.__lock"):  # a chunk's temporary file, left by a killed writer
        f.unlink()
    _sync_all(tmp)
    try:
        arrays.write_tree_metadata(tmp / "params", {a.name: a.shard for a in p.arrays.values()})
        for name in COPIED:
            if (p.src / name).exists():
                shutil.copy(p.src / name, tmp / name)
        (tmp / META).write_text(json.dumps(_meta(p), indent=1))
        _fsync(tmp / META)
    except OSError as e:
        raise _write_error(e, tmp / META, "metadata", tmp) from None
    for f in (DONE_LOG, REQUEST, ".lock"):
        (tmp / f).unlink(missing_ok=True)
    if dst.exists():
        if not overwrite:
            raise FileExistsError(f"{dst} appeared during the conversion; the result is in {tmp}")
        replaceable(dst)
    move_into_place(tmp, dst)
    _fsync(dst.parent)
