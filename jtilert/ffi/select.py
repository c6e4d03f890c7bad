"""Exact top-k on one GPU in one kernel launch: the engine's radix select (cuda/src/select.cu).

- ``top_k(scores, k)``: (values, indices) [T, min(k, N)] exactly as ``lax.top_k`` returns them (total
  order of the bits, ties toward the lower position); ``sorted=False``: the same pairs in position
  order; ``canonical_zero=True``: -0.0 counts as (and is returned as) +0.0, ``merge_topk``'s order.
- ``topk(scores, k)``: drop-in for ``jtilert.ops.reference.topk_positions`` (indices, -1 where the score is
  -inf), position order.
- ``split_topk(scores, k, axis_name)``: in ``shard_map``, rank r holds positions [r * n, (r + 1) * n);
  local top-k, then ``merge_topk``: the global top-k, bit-identical on every rank (-0.0 = +0.0).

scores: fp32 [N] or [T, N], T <= 8, k <= 8192, all CTAs co-resident. Short rows run on one
thread-block cluster each, long rows on the grid kernel (cuda/README.md; timings in
bench/RESULTS.md). Elsewhere (no GPU, no library, other shapes) ``lax.top_k`` runs instead, with
one warning per reason. ``backend="pallas"`` calls ``topk`` for ``topk_positions``
(jtilert/ops.py; ``DecodeConfig(engine_topk=False)`` turns that off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jtilert.ffi import _lib
from jtilert.ffi import ops as _ops
from jtilert.ops import reference

SORTED, CANONICAL_ZERO, EMPTY_AS_MINUS_ONE = 1, 2, 4   # mode bits, cuda/include/jtilert/engine.h (JT_TOPK_*)
MAX_ROWS = 8


def _canonical_zero(s):
    return jnp.where(s == 0, jnp.zeros_like(s), s)


def top_k_reference(scores, k, mode=SORTED):
    """What the kernel computes, in XLA ops: lax.top_k of scores [T, N], position order unless
    mode has SORTED; with EMPTY_AS_MINUS_ONE, position -1 where the score is not above -inf."""
    if mode & CANONICAL_ZERO:
        scores = _canonical_zero(scores)
    vals, idx = lax.top_k(scores, k)
    idx = idx.astype(jnp.int32)
    if not mode & SORTED:
        order = jnp.argsort(idx, axis=-1)
        vals, idx = jnp.take_along_axis(vals, order, -1), jnp.take_along_axis(idx, order, -1)
    if mode & EMPTY_AS_MINUS_ONE:
        idx = reference.empty_as_minus_one(vals, idx)
    return vals, idx


topk_select_p = Primitive("jtilert_topk_select")
topk_select_p.multiple_results = True


def _abstract(scores, *, k, mode, ctas):  # noqa: ARG001 - ctas: a launch detail
    shape = (scores.shape[0], k)
    return (scores.update(shape=shape, dtype=np.dtype(np.int32)),
            scores.update(shape=shape, dtype=np.dtype(np.float32)))


topk_select_p.def_abstract_eval(_abstract)


def _lower_xla(ctx, scores, *, k, mode, ctas):  # noqa: ARG001 - ctas: a launch detail
    def ref(s):
        vals, idx = top_k_reference(s, k, mode)
        return [idx, vals]
    return mlir.lower_fun(ref, multiple_results=True)(ctx, scores)


def _lower_cuda(ctx, scores, *, k, mode, ctas):
    # the scratch of every local GPU is allocated here, in the main thread, before XLA runs
    # anything (XLA may capture the call into a CUDA graph, where no allocation may happen)
    if not _ops.EMIT_WITHOUT_GPU:  # noqa: SLF001
        lib, why = _lib.load()
        try:
            if lib is None:
                raise RuntimeError(why)
            for d in jax.local_devices(backend="gpu"):
                lib.prepare_select(int(d.local_hardware_id))
        except Exception as e:  # noqa: BLE001 - any failure means: fall back
            _warn(f"{type(e).__name__}: {e}")
            return _lower_xla(ctx, scores, k=k, mode=mode, ctas=ctas)
    return jax.ffi.ffi_lowering("jtilert_topk_select")(ctx, scores, mode=np.int32(mode),
                                                        ctas=np.int32(ctas))


mlir.register_lowering(topk_select_p, _lower_xla)
mlir.register_lowering(topk_select_p, _lower_cuda, platform="cuda")


def _warn(why):
    _lib.warn_once("topk:" + why, f"jtilert.ffi: CUDA top-k not used ({why}); falling back to lax.top_k")


def _engine_ok(t, n, k, mode, ctas) -> tuple[bool, str]:
    ok, why = _ops.engine_status()
    if not ok or _ops.EMIT_WITHOUT_GPU:  # noqa: SLF001
        return ok, why
    lib, _ = _lib.load()
    try:
        dev = int(jax.local_devices(backend="gpu")[0].local_hardware_id)
        lib.prepare_select(dev)
    except Exception as e:  # noqa: BLE001
        return False, f"{type(e).__name__}: {e}"
    if lib.topk_ctas(dev, t, n, k, mode, ctas) < 1:
        return False, "shape not supported by the engine's top-k (T > 8, k > 8192 or N too large)"
    return True, ""


def top_k(scores, k, *, sorted=True, canonical_zero=False, empty_as_minus_one=False,  # noqa: A002 - lax.top_k's word
          ctas=0):
    """(values, indices) of the k' = min(k, N) largest scores per row, exactly lax.top_k's;
    ``empty_as_minus_one``: index -1 where the score is not above -inf. ``ctas`` (for tuning): > 0,
    the grid kernel with that many CTAs per row; < 0, one cluster of -ctas CTAs per row; 0, the
    default (see the module docstring)."""
    scores = jnp.asarray(scores, jnp.float32)
    if scores.ndim == 1:
        vals, idx = top_k(scores[None], k, sorted=sorted, canonical_zero=canonical_zero,
                          empty_as_minus_one=empty_as_minus_one, ctas=ctas)
        return vals[0], idx[0]
    if scores.ndim != 2:
        raise ValueError(f"scores must be [N] or [T, N], got {scores.shape}")
    t, n = scores.shape
    k = min(int(k), n)
    if k < 1:
        raise ValueError(f"k={k} must be >= 1")
    mode = ((SORTED if sorted else 0) | (CANONICAL_ZERO if canonical_zero else 0)
            | (EMPTY_AS_MINUS_ONE if empty_as_minus_one else 0))
    ok, why = _engine_ok(t, n, k, mode, ctas)
    if not ok:
        _warn(why)
        return top_k_reference(scores, k, mode)
    idx, vals = topk_select_p.bind(scores, k=k, mode=mode, ctas=int(ctas))
    return vals, idx


def topk(scores, k):
    """Drop-in for `jtilert.ops.reference.topk_positions`: indices [T, k'] int32 in position order, -1
    where the score is -inf (the kernel writes them: no XLA op after it)."""
    return top_k(scores, k, sorted=False, empty_as_minus_one=True)[1]


def split_topk(scores, k, axis_name):
    """Global top-k of scores split by position over the ranks of ``axis_name`` (inside shard_map):
    scores [n] on every rank, rank r holding positions [r * n, (r + 1) * n). Returns (values [k],
    indices [k]) sorted by (score desc, index asc), -0.0 as +0.0, identical on every rank."""
    n = scores.shape[-1]
    vals, idx = top_k(scores, min(k, n), canonical_zero=True)
    idx = idx + lax.axis_index(axis_name).astype(jnp.int32) * n
    return _ops.merge_topk(vals, idx, axis_name, k)
