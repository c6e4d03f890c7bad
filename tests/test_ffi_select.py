"""CPU tests of the engine's one-launch top-k (cuda/src/select.cu, jtilert/ffi/select.py).

The kernel itself runs in cuda/tests/selftest.cu and tests/gpu/engine_gpu_checks.py on a GPU.
Here: the sources are in the CMake build (tests/test_ffi.py compiles cuda/ with -Werror), the
fallback equals lax.top_k, the CUDA lowering emits the custom call, numpy models that follow
the grid kernel (grid plan, digit passes, per-CTA counts, tie take, ranks) and the cluster
kernel (cluster plan, per-CTA histograms, coarse/fine merge, digit search, counts of the CTAs
before, compaction) step by step give exactly lax.top_k's result on inputs with many ties,
-inf, +-0.0 and N < k, and a thread model of the row barrier's protocol holds across calls.
"""

from __future__ import annotations

import pathlib
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jtilert.ffi as jf
from jtilert.ops import reference
from jtilert.ffi import ops as ffi_ops
from jtilert.ffi import select as sel

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_select_is_built_and_exported():
    cm = (ROOT / "cuda" / "CMakeLists.txt").read_text()
    assert "src/select.cu" in cm
    assert "JtTopkSelect" in (ROOT / "cuda" / "src" / "ffi.cc").read_text()
    from jtilert.ffi import _lib
    assert _lib.TARGETS["jtilert_topk_select"] == "JtTopkSelect"


# ------------------------------------------------------------------ numpy model of the kernel

NT, BINS, MAX_CHUNK, MAX_CTAS = 512, 2048, 16384, 1024
LEVEL_SHIFTS = (21, 10, 0)


def order_key(x, canonical_zero=False):
    u = np.asarray(x, np.float32).view(np.uint32).copy()
    if canonical_zero:
        u[u == 0x80000000] = 0
    return np.where(u >> 31 == 1, ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def key_value(key):
    key = np.asarray(key, np.uint32)
    return np.where(key >> 31 == 1, key & np.uint32(0x7FFFFFFF), ~key).astype(np.uint32).view(np.float32)


def plan(t, n, k, sms=132, ctas=0):
    g = ctas if ctas > 0 else max(1, sms // t)
    g = min(g, (n + 31) // 32)
    chunk = min(MAX_CHUNK, ((n + g - 1) // g + 31) // 32 * 32)
    return (n + chunk - 1) // chunk, chunk


def find_digit(hist, need, threads=NT):
    """find_digit of select.cu (threads=32: warp_find_digit): per-thread groups of bins, suffix
    counts, the one bin that crosses `need`; returns (bin, keys in the bins above it, keys in it)."""
    nb = len(hist)
    per = (nb + threads - 1) // threads
    found = []
    for th in range(min(threads, (nb + per - 1) // per)):   # threads past the bins have none
        b_lo, b_hi = th * per, min(nb, th * per + per)
        cum = int(hist[b_hi:].sum())
        for b in range(b_hi - 1, b_lo - 1, -1):
            if cum < need <= cum + hist[b]:
                found.append((b, cum, int(hist[b])))
            cum += int(hist[b])
    assert len(found) == 1
    return found[0]


class Bucket:
    """The keys whose bits above `lo` equal `pre` (lo = 32: all keys)."""

    def __init__(self):
        self.pre, self.lo = 0, 32

    def inside(self, kk):
        return np.ones(kk.shape, bool) if self.lo >= 32 else (kk >> np.uint32(self.lo)) == self.pre

    def above(self, kk):
        return np.zeros(kk.shape, bool) if self.lo >= 32 else (kk >> np.uint32(self.lo)) > self.pre

    def digits(self, kk, shift, nb):
        """count_digits: the histogram of digit (key >> shift) & (nb - 1) over the keys inside."""
        m = self.inside(kk)
        return np.bincount(((kk[m] >> np.uint32(shift)) & np.uint32(nb - 1)).astype(np.int64),
                           minlength=nb)

    def narrow(self, shift, digit):
        self.pre = (self.pre << (self.lo - shift)) | digit
        self.lo = shift


def stage_entries(chunks, chunk, k, need, bkt, gt_eq_before):
    """write_selected of every CTA: the entry at chunk position i goes to slot offset + (keys above
    the bucket before i) + min(bucket keys before i, take) (the kernel counts those by warp
    segments and ballots); returns the staged entries, key << 32 | position."""
    stage = np.zeros(k, np.uint64)
    written = np.zeros(k, bool)
    for g, c in enumerate(chunks):
        gt_before, eq_before = gt_eq_before(g)
        inside = bkt.inside(c)
        offset = gt_before + min(eq_before, need)
        take = min(need - eq_before, int(inside.sum())) if need > eq_before else 0
        above = bkt.above(c)
        gt_in, eq_in = np.cumsum(above) - above, np.cumsum(inside) - inside   # before each position
        pos = np.flatnonzero(above | (inside & (eq_in < take)))
        slot = offset + gt_in[pos] + np.minimum(eq_in[pos], take)
        assert not written[slot].any()
        written[slot] = True
        stage[slot] = (c[pos].astype(np.uint64) << np.uint64(32)) | (pos + g * chunk).astype(np.uint64)
    assert written.all()
    return stage


def unstage(stage):
    """(keys, values, positions) of staged entries."""
    sk = (stage >> np.uint64(32)).astype(np.uint32)
    return sk, key_value(sk), (stage & np.uint64(0xFFFFFFFF)).astype(np.int32)


def place(ranks, vals, pos):
    """The outputs written at their ranks; every rank exactly once."""
    k = len(vals)
    assert sorted(ranks) == list(range(k))
    out_v, out_i = np.zeros(k, np.float32), np.full(k, -1, np.int32)
    out_v[ranks], out_i[ranks] = vals, pos
    return out_v, out_i


def grid_ranks(stage, k, g_n):
    """rank_store: CTA g ranks slots [g*per, ...) against the k staged keys split into `parts`
    ranges."""
    sk, vals, pos = unstage(stage)
    ranks = np.zeros(k, np.int64)
    per = (k + g_n - 1) // g_n
    for g in range(g_n):
        s0 = min(k, g * per)
        ne = min(k, s0 + per) - s0
        if ne == 0:
            continue
        parts = max(1, NT // ne)
        rank = np.zeros(ne, np.int64)
        for part in range(parts):
            y0, y1 = k * part // parts, k * (part + 1) // parts
            for el in range(ne):
                sx = s0 + el
                a = min(max(sx, y0), y1)
                b = max(a, min(sx + 1, y1))
                rank[el] += int((sk[y0:a] >= sk[sx]).sum()) + int((sk[b:y1] > sk[sx]).sum())
        ranks[s0:s0 + ne] = rank
    return place(ranks, vals, pos)


def cluster_ranks(stage, k, c_n):
    """cluster_rank_store: CTA g sorts its share of slots [g*per, ...) (rank in the share by
    comparisons in `parts` ranges), publishes the sorted keys; after a cluster barrier every entry
    adds, for each other share, the binary-search count of its keys that go first."""
    sk, vals, pos = unstage(stage)
    per = (k + c_n - 1) // c_n
    shares = [sk[min(k, g * per):min(k, (g + 1) * per)] for g in range(c_n)]
    local = []
    for sh in shares:
        ne = len(sh)
        rank = np.zeros(ne, np.int64)
        parts = max(1, NT // max(ne, 1))
        for part in range(parts):
            y0, y1 = ne * part // parts, ne * (part + 1) // parts
            for el in range(ne):
                a = min(max(el, y0), y1)
                b = max(a, min(el + 1, y1))
                rank[el] += int((sh[y0:a] >= sh[el]).sum()) + int((sh[b:y1] > sh[el]).sum())
        local.append(rank)
    sorted_keys = []
    for sh, rank in zip(shares, local):
        sk_sorted = np.zeros(len(sh), np.uint32)
        sk_sorted[rank] = sh
        assert (np.diff(sk_sorted.astype(np.int64)) <= 0).all()
        sorted_keys.append(sk_sorted)
    ranks = np.zeros(k, np.int64)
    for g, (sh, rank) in enumerate(zip(shares, local)):
        for el in range(len(sh)):
            r = int(rank[el])
            for o, y in enumerate(sorted_keys):
                if o == g:
                    continue
                lo, hi = 0, len(y)     # the kernel's binary search: a prefix goes before sh[el]
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if (y[mid] >= sh[el]) if o < g else (y[mid] > sh[el]):
                        lo = mid + 1
                    else:
                        hi = mid
                r += lo
            ranks[g * per + el] = r
    return place(ranks, vals, pos)


def model_row(x, k, sorted_out=True, canonical_zero=False, sms=132, t=1, ctas=0):
    """One row through the grid kernel's steps; returns (values, indices)."""
    n = x.shape[0]
    g_n, chunk = plan(t, n, k, sms, ctas)
    keys = order_key(x, canonical_zero)
    chunks = [keys[g * chunk:min(n, (g + 1) * chunk)] for g in range(g_n)]
    bkt, need = Bucket(), k
    for shift in LEVEL_SHIFTS:
        nb = 1 << (bkt.lo - shift)
        hist = np.zeros(nb, np.int64)
        for c in chunks:           # every CTA adds its shared-memory histogram to the global one
            hist += bkt.digits(c, shift, nb)
        d, above, in_d = find_digit(hist, need)
        bkt.narrow(shift, d)
        need -= above
        if in_d == need:
            break
    gt = [int(bkt.above(c).sum()) for c in chunks]
    eq = [int(bkt.inside(c).sum()) for c in chunks]
    stage = stage_entries(chunks, chunk, k, need, bkt, lambda g: (sum(gt[:g]), sum(eq[:g])))
    return grid_ranks(stage, k, g_n) if sorted_out else unstage(stage)[1:]


# ------------------------------------------------------------------ numpy model of the cluster kernel

MAX_CLUSTER, CLUSTER_CAP, GROUP, HALF_CLUSTER_MAX_N = 16, 12288, 16, 6144


def cluster_plan(n, k, ctas=0, max_cluster=MAX_CLUSTER):
    """make_cluster_plan: (C, chunk), or None where the grid kernel runs."""
    c = -ctas if ctas < 0 else min(8, max_cluster) if n <= HALF_CLUSTER_MAX_N else max_cluster
    if c < 1 or c > max(1, max_cluster) or (k + c - 1) // c > BINS or c * CLUSTER_CAP < n:
        return None
    return c, (n + c - 1) // c


NEG_INF_KEY = 0x007FFFFF   # order_key(-inf)


def rules_out_leading(chunk_keys, base, k):
    """load_keys of select.cu, its answer: a key above -inf's at a position >= k, or one below it."""
    pos = base + np.arange(chunk_keys.shape[0])
    return bool(np.any((chunk_keys < NEG_INF_KEY) | ((chunk_keys > NEG_INF_KEY) & (pos >= k))))


def cluster_short_form(x, k, sorted_out, canonical_zero=False, ctas=0):
    """Whether topk_cluster_kernel ends after level 0 with the row's first k positions: by position,
    and no CTA's chunk rules it out."""
    n = x.shape[0]
    c_n, chunk = cluster_plan(n, k, ctas)
    keys = order_key(x, canonical_zero)
    return not sorted_out and not any(rules_out_leading(keys[min(n, g * chunk):min(n, (g + 1) * chunk)],
                                                        g * chunk, k) for g in range(c_n))


def model_cluster_row(x, k, sorted_out=True, canonical_zero=False, ctas=0):
    """One row through topk_cluster_kernel's steps; returns (values, indices)."""
    n = x.shape[0]
    c_n, chunk = cluster_plan(n, k, ctas)
    keys = order_key(x, canonical_zero)
    if cluster_short_form(x, k, sorted_out, canonical_zero, ctas):   # write_leading of every CTA
        return key_value(keys[:k]), np.arange(k, dtype=np.int32)
    # the last CTAs may have no keys (chunk = ceil(n / C))
    chunks = [keys[min(n, g * chunk):min(n, (g + 1) * chunk)] for g in range(c_n)]
    bkt, need = Bucket(), k
    for shift in LEVEL_SHIFTS:
        nb = 1 << (bkt.lo - shift)
        hist = [bkt.digits(c, shift, nb) for c in chunks]           # hist[lvl] of every CTA
        coarse = [h.reshape(-1, GROUP).sum(1) for h in hist]         # coarse[lvl]
        # once every CTA's coarse histogram has been pushed, every CTA does the same: their sum
        sum_coarse = np.sum(coarse, axis=0)
        grp, above_grp, _ = find_digit(sum_coarse, need, threads=32)
        sum_fine = np.sum([h[grp * GROUP:(grp + 1) * GROUP] for h in hist], axis=0)  # the pushed fine bins
        d, above, in_d = find_digit(sum_fine, need - above_grp, threads=32)
        assert in_d == sum(int(h[grp * GROUP + d]) for h in hist)
        bkt.narrow(shift, grp * GROUP + d)
        need -= above_grp + above
        if in_d == need:
            break
    # every CTA's counts, pushed; warp 0 sums those of the CTAs before it
    counts = [(int(bkt.above(c).sum()), int(bkt.inside(c).sum())) for c in chunks]
    stage = stage_entries(chunks, chunk, k, need, bkt,
                          lambda g: tuple(int(v) for v in np.sum(counts[:g] or [(0, 0)], axis=0)))
    return cluster_ranks(stage, k, c_n) if sorted_out else unstage(stage)[1:]


class _RowSync:
    """The row's barrier words: arrival counter and generation, with atomic read-modify-writes."""

    def __init__(self):
        self.count, self.gen = 0, 0
        self.lock = threading.Lock()

    def atomic_add(self, field, v):
        with self.lock:
            old = getattr(self, field)
            setattr(self, field, (old + v) & 0xFFFFFFFF)
            return old


def _row_barrier(sync, g_n, gen_seen, last):
    """row_barrier of select.cu, thread 0's part: returns the generation after the barrier."""
    g0 = gen_seen
    if (sync.atomic_add("count", 1) + 1) % g_n == 0:
        if last:
            with sync.lock:
                sync.count = 0
        sync.atomic_add("gen", 1)
    else:
        while sync.gen == g0:
            time.sleep(0)
    return g0 + 1


def test_row_barrier_protocol_model():
    """CTAs as threads, calls with different CTA counts and barrier counts back to back (the
    sorted / by-index paths and the early exit change how many barriers a call has): no CTA
    leaves a barrier before every CTA of the call has reached it, and the counter is back at 0
    after each call."""
    sync = _RowSync()
    rng = np.random.default_rng(0)
    for call in range(12):
        g_n, nbar = int(rng.integers(1, 9)), int(rng.integers(2, 6))
        reached = np.zeros((nbar, g_n), bool)
        errors = []

        def cta(g, g_n=g_n, nbar=nbar, reached=reached, errors=errors, seed=call):
            r = np.random.default_rng(seed * 100 + g)
            gen = sync.gen                      # read at kernel start
            for b in range(nbar):
                time.sleep(float(r.random()) * 1e-3)
                reached[b, g] = True
                gen = _row_barrier(sync, g_n, gen, last=b == nbar - 1)
                if not reached[b].all():
                    errors.append((b, g))

        threads = [threading.Thread(target=cta, args=(g,)) for g in range(g_n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=20)
        assert not errors and all(not th.is_alive() for th in threads)
        assert sync.count == 0


def _scores(rng, t, n, kind):
    if kind == "normal":
        x = rng.standard_normal((t, n))
    elif kind == "ties":          # few distinct values: long runs of equal scores
        x = np.round(rng.standard_normal((t, n)) * 2) / 2
    elif kind == "zeros":         # +0.0 and -0.0 around the threshold, -inf past a causal limit
        x = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, np.inf]), size=(t, n), p=[.4, .4, .05, .1, .05])
        x[:, n // 3:] = -np.inf
    elif kind == "masked":        # decode with a short context: most rows -inf
        x = rng.standard_normal((t, n))
        x[:, 100:] = -np.inf
    elif kind == "narrow":        # all scores inside one quarter-octave (one level-0 bucket)
        x = 1.0 + rng.random((t, n)) * 0.2
    elif kind == "masked_late":   # a short context but one score past the mask, at the row's end
        x = rng.standard_normal((t, n))
        x[:, 100:-1] = -np.inf
    elif kind == "masked_nan":    # a short context with a NaN with the sign bit (below -inf) in it
        x = rng.standard_normal((t, n))
        x[:, 100:] = -np.inf
        x[:, 5] = -np.nan
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


CASES = [  # (T, N, k, kind[, CTAs per row])
    (1, 4096, 2048, "normal"), (2, 32768, 2048, "ties"), (1, 5000, 2048, "zeros"),
    (3, 3001, 1000, "masked"), (1, 777, 777, "ties"), (1, 100, 100, "zeros"), (4, 20000, 64, "narrow"),
    (1, 131072, 2048, "masked"), (8, 1000, 7, "ties"), (8, 9000, 8192, "normal"),
    (1, 32768, 2048, "ties", 8), (2, 163840, 2048, "normal", 11),
    (1, 4096, 2048, "masked"), (2, 4096, 2048, "masked_late"), (2, 4096, 2048, "masked_nan"),
]


def _check_model(x, k, t, model):
    rv, ri = (np.asarray(a) for a in lax.top_k(jnp.asarray(x), k))
    for r in range(min(t, 2)):
        v, i = model(x[r], sorted_out=True)
        np.testing.assert_array_equal(i, ri[r])
        np.testing.assert_array_equal(v.view(np.uint32), rv[r].view(np.uint32))
        vu, iu = model(x[r], sorted_out=False)
        order = np.argsort(ri[r])
        np.testing.assert_array_equal(iu, ri[r][order])
        np.testing.assert_array_equal(vu.view(np.uint32), rv[r][order].view(np.uint32))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_numpy_model_of_the_kernel_equals_lax_top_k(case):
    t, n, k, kind, *ctas = case
    ctas = ctas[0] if ctas else 0
    x = _scores(np.random.default_rng(n + k), t, n, kind)
    _check_model(x, k, t, lambda row, sorted_out: model_row(row, k, sorted_out, t=t, ctas=ctas))


@pytest.mark.parametrize("case", CASES + [(1, 196608, 2048, "ties")], ids=str)
def test_numpy_model_of_the_cluster_kernel_equals_lax_top_k(case):
    """Clusters of 16, 8 and 1 CTAs (where the row fits) on the same cases."""
    t, n, k, kind, *_ = case
    x = _scores(np.random.default_rng(n + k), t, n, kind)
    sizes = [c for c in (-16, -8, -1) if cluster_plan(n, k, c) is not None]
    assert sizes
    for c in sizes:
        _check_model(x, k, t, lambda row, sorted_out, c=c: model_cluster_row(row, k, sorted_out, ctas=c))


@pytest.mark.parametrize("kind, n, k, short", [
    ("masked", 4096, 2048, True), ("zeros", 5000, 2048, True), ("normal", 2048, 2048, True),
    ("masked", 3001, 50, False), ("masked_late", 4096, 2048, False), ("masked_nan", 4096, 2048, False),
    ("normal", 4096, 2048, False)])
def test_the_cluster_kernels_short_form_is_taken_where_the_first_k_positions_are_the_top_k(kind, n, k, short):
    """By position the cluster kernel ends after level 0 where no score from position k on is above -inf and
    none is below it (a short context's masked row); never for sorted output. Where it is taken, its output
    (the first k positions) is lax.top_k's selection (the model test above checks the rows)."""
    x = _scores(np.random.default_rng(7), 1, n, kind)[0]
    for c in (-16, -8, -1):
        assert cluster_short_form(x, k, sorted_out=False, ctas=c) == short, c
        assert not cluster_short_form(x, k, sorted_out=True, ctas=c)
    if short:
        i = np.sort(np.asarray(lax.top_k(jnp.asarray(x), k)[1]))
        np.testing.assert_array_equal(i, np.arange(k))
    src = (ROOT / "cuda" / "src" / "select.cu").read_text()
    assert f"kNegInfKey = 0x{NEG_INF_KEY:08x}u" in src
    assert int(order_key(np.float32(-np.inf))) == NEG_INF_KEY


def test_cluster_plan_picks_the_variant_by_n():
    assert cluster_plan(4096, 2048) == (8, 512)                         # rows up to 6144: 8 CTAs
    assert cluster_plan(4096, 2048, max_cluster=8) == (8, 512)
    assert cluster_plan(6144, 2048) == (8, 768)
    assert cluster_plan(6145, 2048) == (16, 385)
    assert cluster_plan(32769, 2048) == (16, 2049)
    assert cluster_plan(131072, 2048) == (16, 8192)
    assert cluster_plan(163840, 2048) == (16, 10240)
    assert cluster_plan(16 * CLUSTER_CAP, 2048) == (16, CLUSTER_CAP)
    assert cluster_plan(16 * CLUSTER_CAP + 1, 2048) is None            # the grid kernel
    assert cluster_plan(131072, 2048, max_cluster=8) is None           # no 16-CTA clusters
    assert cluster_plan(131072, 2048, ctas=-8) is None
    assert cluster_plan(8192, 8192, ctas=-2) is None                   # ranks > hist[0]
    assert cluster_plan(100, 100, ctas=-16) == (16, 7)                  # CTAs 15: no keys
    assert cluster_plan(4096, 2048, ctas=-1) == (1, 4096)               # one CTA: the self-test's C = 1
    assert cluster_plan(4096, 2048, ctas=-1, max_cluster=0) == (1, 4096)  # a cluster of 1 needs no clusters
    assert cluster_plan(4096, 2048, ctas=-2, max_cluster=0) is None
    src = (ROOT / "cuda" / "src" / "select.cu").read_text()
    for name, v in [("kMaxCluster", MAX_CLUSTER), ("kClusterCap", CLUSTER_CAP), ("kGroup", GROUP),
                    ("kHalfClusterMaxN", HALF_CLUSTER_MAX_N)]:
        assert f"constexpr int {name} = {v};" in src


def test_lax_top_k_orders_by_the_bits():
    """The order the kernel reproduces: -0.0 < +0.0, ties toward the lower position."""
    x = jnp.asarray([[-0.0, 0.0, -0.0, 0.0, -np.inf, 1.0, -np.inf]], jnp.float32)
    v, i = lax.top_k(x, 6)
    np.testing.assert_array_equal(np.asarray(i)[0], [5, 1, 3, 0, 2, 4])
    np.testing.assert_array_equal(np.asarray(v)[0].view(np.uint32), order_key_inverse([5, 1, 3, 0, 2, 4], x))


def order_key_inverse(idx, x):
    return np.asarray(x)[0][idx].view(np.uint32)


# ------------------------------------------------------------------ fallback and lowering

@pytest.mark.parametrize("t,n,k", [(1, 4096, 2048), (3, 1000, 1500), (2, 700, 64)])
def test_fallback_equals_reference(t, n, k):
    x = jnp.asarray(_scores(np.random.default_rng(1), t, n, "zeros"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx = jax.jit(jf.topk, static_argnums=1)(x, k)
        vals, idx2 = jf.top_k(x, k)
        vu, iu = jf.top_k(x, k, sorted=False)
        one_v, one_i = jf.top_k(x[0], k)
    _, ridx = jax.lax.top_k(x, min(k, n))
    # topk: top_k's positions in position order, -1 where the score is -inf; as a set, the reference's
    np.testing.assert_array_equal(np.asarray(idx), np.where(np.asarray(vu) > -np.inf, np.asarray(iu), -1))
    np.testing.assert_array_equal(np.sort(np.asarray(idx), -1),
                                  np.sort(np.asarray(reference.topk_positions(x, k)), -1))
    if k >= n:   # every position comes back, the "zeros" rows' -inf scores too: some are -1
        assert (np.asarray(idx) < 0).any()
    np.testing.assert_array_equal(np.asarray(idx2), np.asarray(ridx))
    np.testing.assert_array_equal(np.asarray(one_i), np.asarray(ridx)[0])
    np.testing.assert_array_equal(np.sort(np.asarray(iu), -1), np.sort(np.asarray(ridx), -1))
    assert (np.diff(np.asarray(iu), axis=-1) > 0).all()
    assert vals.shape == idx.shape == (t, min(k, n))


def test_fallback_warns_once():
    from jtilert.ffi import _lib
    _lib._warned.clear()  # noqa: SLF001
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for n in (64, 65, 66):
            jf.topk(jnp.ones((1, n)), 8)
    assert len([w for w in rec if "top-k" in str(w.message)]) == 1


def test_cuda_lowering_emits_the_custom_call(monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    x = jnp.zeros((2, 4096), jnp.float32)
    f = jax.jit(lambda s: jf.top_k(s, 2048, sorted=False))
    txt = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @jtilert_topk_select" in txt and "mode = 0 : i32" in txt and "ctas = 0" in txt
    txt = jax.jit(lambda s: jf.top_k(s, 2048)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @jtilert_topk_select" in txt and "mode = 1 : i32" in txt
    txt = jax.jit(lambda s: jf.topk(s, 2048)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    # positions: unsorted, -1 for -inf scores written by the kernel (no compare / select after it)
    assert "custom_call @jtilert_topk_select" in txt and "mode = 4 : i32" in txt
    assert "stablehlo.compare" not in txt and "stablehlo.select" not in txt
    assert "jtilert" not in jax.jit(lambda s: jf.topk(s, 2048)).trace(x).lower(
        lowering_platforms=("cpu",)).as_text().split("custom_call @")[-1].split("(")[0]


def test_pallas_ops_use_the_engine_topk_when_asked_and_loadable(monkeypatch):
    from jtilert.ffi import _lib
    from jtilert.ops.table import DecodeConfig, Ops
    x = jnp.zeros((2, 4096), jnp.float32)

    def lowered(**config):
        ops = Ops(DecodeConfig(backend="pallas", **config))
        f = jax.jit(lambda s: ops("topk_positions", s, 2048))
        return f.trace(x).lower(lowering_platforms=("cuda",)).as_text()

    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    assert "jtilert_topk_select" not in lowered()        # no engine here (no GPU): the fallback
    monkeypatch.setattr(_lib, "load", lambda: (object(), ""))
    assert "custom_call @jtilert_topk_select" in lowered()   # on by default where the engine loads
    assert "jtilert_topk_select" not in lowered(engine_topk=False)


def test_split_topk_fallback_is_the_global_topk():
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices")
    mesh = Mesh(np.array(jax.devices()[:8]), ("tp",))
    x = _scores(np.random.default_rng(2), 1, 8 * 512, "ties")[0]
    x[::5] = -np.inf
    k = 1000
    f = jax.jit(jax.shard_map(lambda s: jf.split_topk(s, k, "tp"), mesh=mesh, in_specs=P("tp"),
                              out_specs=(P(), P())))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v, i = f(jnp.asarray(x))
    rv, ri = lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(ri))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(rv))
