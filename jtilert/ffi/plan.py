"""Task tables of the persistent GEMV + all-reduce kernel (host side, numpy only).

The kernel (cuda/src/gemv.cu) runs one CTA per task list. Every rank runs the same table on its
own weight shard: a task is one tile of ``tile_rows`` output rows with the whole local K, so each
rank produces, sends and reduces every tile once (one-shot: equal work per rank). The tiles are
split over the fewest CTAs that reach the minimal tiles per CTA, no CTA more than one tile ahead.

Table layout (int32), read by the kernel::

    [0]            num_ctas C
    [1]            tile_rows T
    [2 : 3 + C]    offsets into the task list (C + 1 values, first 0, last #tasks)
    [3 + C : ]     first output row of every task, CTA after CTA
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

HEADER = 2
# 16-byte chunks per lane and row that the kernel keeps in flight: RPW * U = 8
_INFLIGHT = 8
ELEMS_PER_CHUNK = {"bf16": 8, "fp8": 16}
MAX_NWC = 16


@dataclasses.dataclass(frozen=True)
class GemvPlan:
    table: np.ndarray  # int32, layout above
    n: int
    k: int
    wdtype: str  # "bf16" | "fp8"
    nwc: int  # compute warps per CTA
    rpw: int  # rows per compute warp and tile
    tile_rows: int
    num_ctas: int
    max_tasks: int

    @property
    def num_tiles(self) -> int:
        return math.ceil(self.n / self.tile_rows)

    def cta_tasks(self, c: int) -> np.ndarray:
        """First rows of the tiles of CTA ``c``."""
        off = self.table[HEADER:HEADER + self.num_ctas + 1]
        base = HEADER + self.num_ctas + 1
        return self.table[base + off[c]:base + off[c + 1]]


def rows_per_warp(k: int, wdtype: str) -> int:
    """Rows per warp so that about 8 16-byte loads per lane are in flight."""
    chunks = k // ELEMS_PER_CHUNK[wdtype]
    per_lane = max(1, math.ceil(chunks / 32))
    rpw = 1
    while rpw * min(per_lane, _INFLIGHT) < _INFLIGHT and rpw < 8:
        rpw *= 2
    return rpw


def _split(num_tiles: int, num_sms: int) -> tuple[int, list[int]]:
    per_cta = math.ceil(num_tiles / num_sms)
    ctas = math.ceil(num_tiles / per_cta)
    base, extra = divmod(num_tiles, ctas)
    counts = [base + (1 if c < extra else 0) for c in range(ctas)]
    return ctas, counts


def build_gemv_plan(n: int, k: int, *, wdtype: str = "bf16", num_sms: int = 132,
                    nwc: int | None = None, rpw: int | None = None) -> GemvPlan:
    """Builds the task table for y[n] = W[n, k] @ x[k] on a GPU with ``num_sms``.

    ``nwc`` (compute warps per CTA) defaults to 16 (the most loads in flight per
    multiprocessor), or to 8 or 4 when 16 would leave more than a quarter of the
    multiprocessors without a tile (small N*K, e.g. one expert's down projection);
    ``jtilert_selftest --bench`` times nwc 8 against 16.
    """
    if wdtype not in ELEMS_PER_CHUNK:
        raise ValueError(f"wdtype must be bf16 or fp8, got {wdtype!r}")
    if n < 1 or k < 1:
        raise ValueError(f"bad shape n={n} k={k}")
    if k % ELEMS_PER_CHUNK[wdtype]:
        raise ValueError(f"k={k} must be a multiple of {ELEMS_PER_CHUNK[wdtype]} for {wdtype}")
    if rpw is None:
        rpw = rows_per_warp(k, wdtype)
    if rpw not in (1, 2, 4, 8):
        raise ValueError(f"rpw must be 1, 2, 4 or 8, got {rpw}")
    if nwc is None:
        for cand in (16, 8, 4):
            nwc = cand
            if math.ceil(n / (cand * rpw)) >= 0.75 * num_sms:
                break
    if not 1 <= nwc <= MAX_NWC:
        raise ValueError(f"nwc must be in [1, {MAX_NWC}], got {nwc}")
    tile = nwc * rpw
    if tile % 2:
        raise ValueError(f"tile rows nwc*rpw={tile} must be even")
    num_tiles = math.ceil(n / tile)
    ctas, counts = _split(num_tiles, num_sms)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rows = np.arange(num_tiles, dtype=np.int64) * tile
    table = np.concatenate([[ctas, tile], offsets, rows]).astype(np.int32)
    return GemvPlan(table=table, n=n, k=k, wdtype=wdtype, nwc=nwc, rpw=rpw,
                    tile_rows=tile, num_ctas=ctas, max_tasks=max(counts))


def check_gemv_plan(plan: GemvPlan, num_sms: int | None = None, world: int = 1) -> None:
    """Raises AssertionError unless the plan covers every output row exactly once
    (per rank), within the CTA budget, with CTA loads differing by at most one
    tile, and with identical work on every one of ``world`` ranks."""
    t = plan.table
    assert t.dtype == np.int32
    c = int(t[0])
    assert c == plan.num_ctas and int(t[1]) == plan.tile_rows
    if num_sms is not None:
        assert 1 <= c <= num_sms, (c, num_sms)
    off = t[HEADER:HEADER + c + 1].astype(np.int64)
    assert off[0] == 0 and np.all(np.diff(off) >= 1), "every CTA needs >= 1 task"
    tasks = t[HEADER + c + 1:].astype(np.int64)
    assert off[-1] == len(tasks), (off[-1], len(tasks))
    counts = np.diff(off)
    assert counts.max() - counts.min() <= 1, f"unbalanced CTAs: {counts.min()}..{counts.max()}"
    assert counts.max() == plan.max_tasks
    assert np.all(tasks % plan.tile_rows == 0), "tiles must start on tile boundaries"
    assert np.all(tasks >= 0) and np.all(tasks < plan.n), "tile outside the output"
    cover = np.zeros(plan.n, dtype=np.int64)
    for r0 in tasks:
        cover[r0:min(plan.n, r0 + plan.tile_rows)] += 1
    assert np.all(cover == 1), f"rows covered {cover.min()}..{cover.max()} times"
    # one-shot schedule: every rank runs this same table on its own K shard, so
    # each rank streams N*K_local weights, sends every tile once to each peer and
    # reduces every tile once: per-rank work is identical.
    per_rank_rows = np.full(world, cover.sum())
    assert np.all(per_rank_rows == plan.n)
