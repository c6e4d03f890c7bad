"""Exact top-k of the indexer scores on the device: the XLA-op fallback.

Status: `backend="pallas"` runs the CUDA engine's one-launch top-k (`jtilert.ffi.select`, hand-written
CUDA in cuda/src/select.cu: SMEM histograms, a barrier between the CTAs of a row, compaction) when
the engine library is loaded on a GPU (jtilert/pallas/dispatch.py); this module is what runs
otherwise. Measured on the H200 (bench/RESULTS.md): the radix selects below are exact but, built
from XLA ops (23-30 small kernels: scatter histograms with atomic contention, scans), they are
slower than XLA's own `lax.top_k` (33 µs at 4K scores, 45 µs at 128K), so `method="xla"` is the
default. Pallas Mosaic-GPU's array model cannot express the per-thread code (SMEM histograms,
compaction) a one-launch select needs, hence the CUDA kernel.

`topk_radix(scores, k)` returns the k cache rows with the largest scores per token, as (indices [T, k]
int32 in increasing position order, their scores [T, k] fp32). Ties are broken toward the lower
position, the rule of `jtilert.layers.topk_positions` (`lax.top_k` is stable), so the selected SET
equals the reference's on any input, -inf entries included: with fewer than k finite scores the
rest of the k are the lowest-position -inf rows, exactly as `lax.top_k` picks them (they come back
with valid=False). k is clipped to the number of scores, as in the reference.

Algorithm (no sort). Scores map to order-preserving uint32 keys. The k-th largest key θ is found
digit by digit, most significant first (12 + 12 + 8 bits): a histogram of the current digit over
the keys that match the prefix found so far, a suffix sum, and the digit where the count of larger
keys crosses the rank still needed. Then every key > θ is selected, plus the first `need` keys == θ
in position order (a prefix count), and the selected positions are compacted in position order.
Each histogram is one pass over the scores; the whole select is a handful of small fusions.

`merge_topk` merges per-GPU candidate lists (each GPU scoring its own range of positions) into
the global top-k with the same tie rule, so the indexer's positions can be split across GPUs
while every GPU ends with the same indices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

F32, I32, U32 = jnp.float32, jnp.int32, jnp.uint32
DIGITS = ((20, 12), (8, 12), (0, 8))   # (shift, bits), most significant first


def sortable_key(x: jax.Array) -> jax.Array:
    """fp32 → uint32 with the same order (−inf smallest; +0 and −0 distinct, −0 < +0)."""
    u = jax.lax.bitcast_convert_type(x.astype(F32), U32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def kth_largest_key(keys: jax.Array, k) -> tuple[jax.Array, jax.Array]:
    """Per row of keys [T, N] (uint32): the k-th largest key θ [T] and how many keys equal to θ
    belong to the top k (`need` [T], ≥ 1). k ≤ N (k may be a traced [T] array)."""
    T, N = keys.shape
    rows = jnp.arange(T)[:, None]
    prefix = jnp.zeros((T,), U32)
    pmask = jnp.zeros((), U32)
    remaining = jnp.broadcast_to(jnp.asarray(k, I32), (T,))
    for shift, bits in DIGITS:
        nb = 1 << bits
        digit = ((keys >> shift) & (nb - 1)).astype(I32)
        match = (keys & pmask) == prefix[:, None]
        hist = jnp.zeros((T, nb), I32).at[rows, digit].add(match.astype(I32))
        ge = jnp.flip(jnp.cumsum(jnp.flip(hist, -1), -1), -1)       # ge[b] = #(digit >= b)
        b = jnp.sum(ge >= remaining[:, None], axis=-1) - 1            # largest b with ge[b] >= remaining
        above = jnp.take_along_axis(jnp.pad(ge, ((0, 0), (0, 1))), (b + 1)[:, None], -1)[:, 0]
        remaining = remaining - above
        prefix = prefix | (b.astype(U32) << shift)
        pmask = pmask | jnp.uint32(((nb - 1) << shift) & 0xFFFFFFFF)
    return prefix, remaining


def select_mask(keys: jax.Array, theta: jax.Array, need: jax.Array) -> jax.Array:
    """keys > θ, plus the first `need` keys == θ in position order."""
    eq = keys == theta[:, None]
    rank = jnp.cumsum(eq.astype(I32), axis=-1)
    return (keys > theta[:, None]) | (eq & (rank <= need[:, None]))


def compact(mask: jax.Array, k: int, values: jax.Array | None = None):
    """Positions of the k True entries of each row of mask [T, N], in increasing order."""
    T, N = mask.shape
    slot = jnp.where(mask, jnp.cumsum(mask.astype(I32), axis=-1) - 1, k)
    rows = jnp.broadcast_to(jnp.arange(T)[:, None], (T, N))
    pos = jnp.broadcast_to(jnp.arange(N, dtype=I32)[None], (T, N))
    idx = jnp.zeros((T, k), I32).at[rows, slot].set(pos, mode="drop")
    if values is None:
        return idx
    return idx, jnp.take_along_axis(values, idx, axis=-1)


def _hist(digit, match, nb):
    """Histogram of digit [T, N] over the entries where match holds (others are dropped, not added)."""
    T = digit.shape[0]
    rows = jnp.broadcast_to(jnp.arange(T)[:, None], digit.shape)
    return jnp.zeros((T, nb), I32).at[rows, jnp.where(match, digit, nb)].add(1, mode="drop")


def _select_digit(hist, remaining):
    ge = jnp.flip(jnp.cumsum(jnp.flip(hist, -1), -1), -1)
    b = jnp.sum(ge >= remaining[:, None], axis=-1) - 1
    above = jnp.take_along_axis(jnp.pad(ge, ((0, 0), (0, 1))), (b + 1)[:, None], -1)[:, 0]
    return b, remaining - above


def topk_lex(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Same result as `topk`, with the tie rule folded into the key: the (score key, ~position) pair
    is unique, so its k-th largest value is found by radix select alone (score digits, then position
    digits among the ties) and no prefix count over the ties is needed; non-matching entries are
    dropped from the histograms instead of adding zeros (no atomic traffic)."""
    T, N = scores.shape
    k = min(k, N)
    keys = sortable_key(scores)
    pbits = max(1, int(np.ceil(np.log2(N))))
    inv_pos = (jnp.uint32((1 << pbits) - 1) - jnp.arange(N, dtype=U32))[None, :]
    prefix = jnp.zeros((T,), U32)
    pmask = jnp.zeros((), U32)
    remaining = jnp.full((T,), k, I32)
    for shift, bits in DIGITS:
        nb = 1 << bits
        digit = ((keys >> shift) & (nb - 1)).astype(I32)
        b, remaining = _select_digit(_hist(digit, (keys & pmask) == prefix[:, None], nb), remaining)
        prefix = prefix | (b.astype(U32) << shift)
        pmask = pmask | jnp.uint32(((nb - 1) << shift) & 0xFFFFFFFF)
    theta = prefix
    tie = keys == theta[:, None]
    pprefix = jnp.zeros((T,), U32)
    ppmask = jnp.zeros((), U32)
    for shift in range(((pbits - 1) // 9) * 9, -1, -9):
        bits = min(9, pbits - shift)
        nb = 1 << bits
        digit = ((inv_pos >> shift) & (nb - 1)).astype(I32)
        match = tie & ((inv_pos & ppmask) == pprefix[:, None])
        b, remaining = _select_digit(_hist(jnp.broadcast_to(digit, keys.shape), match, nb), remaining)
        pprefix = pprefix | (b.astype(U32) << shift)
        ppmask = ppmask | jnp.uint32((nb - 1) << shift)
    mask = (keys > theta[:, None]) | (tie & (inv_pos >= pprefix[:, None]))
    return compact(mask, k, scores.astype(F32))


def topk_radix(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact top-k per row of scores [T, N] by radix select: (positions [T, k'] int32 ascending,
    scores [T, k']) with k' = min(k, N); ties toward the lower position."""
    T, N = scores.shape
    k = min(k, N)
    keys = sortable_key(scores)
    theta, need = kth_largest_key(keys, k)
    return compact(select_mask(keys, theta, need), k, scores.astype(F32))


METHODS = ("xla", "radix", "radix-lex")


def topk(scores: jax.Array, k: int, method: str = "xla") -> tuple[jax.Array, jax.Array]:
    """Exact top-k per row: (indices [T, k'], scores [T, k']), k' = min(k, N), ties toward the lower
    position. "xla" is `lax.top_k` (XLA's CUB radix sort; the fastest measured on the H200, see
    bench/RESULTS.md), "radix" / "radix-lex" the radix selects above (position order)."""
    if method == "xla":
        vals, idx = jax.lax.top_k(scores.astype(F32), min(k, scores.shape[-1]))
        return idx.astype(I32), vals
    if method == "radix":
        return topk_radix(scores, k)
    if method == "radix-lex":
        return topk_lex(scores, k)
    raise ValueError(f"unknown top-k method {method!r}; expected one of {METHODS}")


def topk_positions(scores: jax.Array, k: int, method: str = "xla") -> tuple[jax.Array, jax.Array]:
    """Drop-in for `jtilert.layers.topk_positions`: (indices [T, k'], valid [T, k']) — the same set
    of rows as the reference."""
    idx, vals = topk(scores, k, method)
    return idx, vals > -jnp.inf


def merge_topk(indices: jax.Array, values: jax.Array, k: int, method: str = "xla") -> tuple[jax.Array, jax.Array]:
    """Merge candidate lists [T, C] (global positions, their scores; e.g. every GPU's local top-k of
    its own range, concatenated) into the global top-k with ties toward the lower position."""
    order = jnp.argsort(indices, axis=-1, stable=True)   # position order makes ties go low
    idx = jnp.take_along_axis(indices, order, -1)
    val = jnp.take_along_axis(values, order, -1)
    sel, v = topk(val, k, method)
    return jnp.take_along_axis(idx, sel, -1), v


if __name__ == "__main__":
    from jtilert.layers import topk_positions as reference
    s = jax.random.normal(jax.random.key(0), (1, 131072))
    idx, valid = jax.jit(topk_positions, static_argnums=(1, 2))(s, 2048, "radix")
    ridx, _ = reference(s, 2048)
    print("same set:", bool(np.array_equal(np.sort(np.asarray(idx)), np.sort(np.asarray(ridx)))))
