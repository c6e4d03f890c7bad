"""Exact top-k of the indexer scores on the device: the XLA fallback of `backend="pallas"`.

On a GPU with the CUDA engine loaded, `jtilert.pallas.dispatch` runs the engine's one-launch select
(`jtilert.ffi.select`, cuda/src/select.cu) instead; elsewhere `topk_positions` is `lax.top_k`
(XLA's radix sort), which beat radix selects built from XLA ops on the H200 (bench/RESULTS.md).
Ties go to the lower position (`lax.top_k` is stable), the rule of `jtilert.layers.topk_positions`.
`merge_topk` merges per-GPU candidate lists (each GPU scoring its own range of positions) into the
global top-k with the same tie rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32, I32 = jnp.float32, jnp.int32


def topk(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Exact top-k per row of scores [T, N]: (indices [T, k'] int32, scores [T, k'] fp32),
    k' = min(k, N), ties toward the lower position."""
    vals, idx = jax.lax.top_k(scores.astype(F32), min(k, scores.shape[-1]))
    return idx.astype(I32), vals


def topk_positions(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Drop-in for `jtilert.layers.topk_positions`: (indices [T, k'], valid [T, k'])."""
    idx, vals = topk(scores, k)
    return idx, vals > -jnp.inf


def merge_topk(indices: jax.Array, values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Merge candidate lists [T, C] (global positions, their scores; e.g. every GPU's local top-k of
    its own range, concatenated) into the global top-k with ties toward the lower position."""
    order = jnp.argsort(indices, axis=-1, stable=True)   # position order makes ties go low
    idx = jnp.take_along_axis(indices, order, -1)
    val = jnp.take_along_axis(values, order, -1)
    sel, v = topk(val, k)
    return jnp.take_along_axis(idx, sel, -1), v
