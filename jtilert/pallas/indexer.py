"""DSA lightning-indexer scoring on Hopper (Pallas Mosaic-GPU), with the key append fused in.

I(t, s) = Σ_h w[t,h] · ReLU(q[t,h] · k[s]) · k_scale[s] over cache rows [start, start + n), -inf
past each token's position; contract of `jtilert.ops.reference.indexer_scores` / `indexer_append_scores`.
The caches may be one layer ([S, D], [S]) or a layer group's stack ([L, S, D], [L, S]) with a traced
`layer`: the kernel addresses the layer in its TMA coordinates, so no slice of the cache is copied.
A grid of `num_ctas` CTAs deals the range's blocks of `block_s` rows round-robin. Blocks holding a
position ≤ max(positions) stream through a `stages`-deep TMA pipeline (keys [block_s, D] + scales);
per block and token: K · qᵀ on the tensor cores, ReLU, · w, Σ heads, · k_scale, causal mask, TMA
store; later blocks get -inf without reading keys. A partial last block is read past the range or
the cache (TMA zero-fills rows past S) and its store is clipped to the output: no padded copy.
Append: the CTA owning a new row's block quantises the key (as `jtilert.ops.quant.act_quant`), writes it
and patches the block's scales (read, patch, write back) before streaming, into the caches passed
as mutable refs (aliased, updated in place).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.ops import reference
from jtilert.ops.layer import Layer
from jtilert.ops.quant import act_quant, pow2_scale
from jtilert.pallas import _hopper as hw

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn

NUM_SMS = 132
MAX_TOKENS = 4      # decode, MTP verify (the op table runs the reference for prefill chunks)


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    block_s: int = 128          # cache rows per block (wgmma M; 128 or 256)
    stages: int = 4             # TMA pipeline depth
    num_ctas: int = 2 * NUM_SMS  # CTAs, two per SM (blocks are dealt to them round-robin)

    def __post_init__(self):
        if self.block_s not in (128, 256):   # 1-D register stores of 128-element multiples; TMA boxes ≤ 256
            raise ValueError(f"block_s={self.block_s} must be 128 or 256")
        if self.stages < 1:
            raise ValueError("stages must be >= 1")


def _tiled(width: int, itemsize: int):
    for s in (128, 64, 32):
        if (width * itemsize) % s == 0:
            return (plgpu.TilingTransform((8, s // itemsize)), plgpu.SwizzleTransform(s))
    raise ValueError(f"rows of {width} × {itemsize} B are not a multiple of 32 bytes")


def indexer_scores_kernel(q, w, k_cache, k_scale, positions, offsets, n: int,
                          config: IndexerConfig = IndexerConfig(), k_new=None):
    """q [T, H, D] (H a multiple of 32), w [T, H] fp32, k_cache [S, D] or a layer stack [L, S, D],
    k_scale [S] / [L, S] fp32 or None, positions [T] int32, offsets = (start, pos_offset, the layer's
    base, its offset; `jtilert.ops.layer.Layer`): each a Python int (baked into the kernel) or an
    int32 [1] array (an operand the kernel reads; the layer is base + offset, ignored for [S, D]) →
    scores [T, n rounded up to 4] fp32 for the layer's cache rows [start, start + n) (columns past
    n are junk: the caller slices them off). start + n must not exceed S.

    With k_new [T, D] (fp32 when the cache is fp8, else the cache dtype) the new tokens' keys are
    appended first: → (scores, k_cache, k_scale), the whole caches updated in place (aliased)."""
    T, H, D = q.shape
    stacked = k_cache.ndim == 3
    S = k_cache.shape[-2]
    if H % 32 or H > 256:
        raise ValueError(f"index heads={H} must be a multiple of 32, at most 256")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q {q.dtype} and k_cache {k_cache.dtype} must have the same dtype")
    new_dtype = None if k_new is None else k_new.dtype
    fitted = resolve(config, T, H, D, k_cache.dtype, k_scale is not None, new_dtype)
    if fitted is None:
        raise ValueError(f"indexer kernel: {T} tokens × {H} heads × {D} do not fit the shared memory at one stage")
    config = fitted
    bs, ns = config.block_s, config.stages
    nblk = pl.cdiv(n, bs)
    n_out = pl.cdiv(n, 4) * 4   # TMA: rows of 16-byte multiples
    grid = max(1, min(config.num_ctas, nblk))
    has_scale = k_scale is not None

    traced = [not isinstance(x, int) for x in offsets]   # the offsets passed as operands
    append = k_new is not None
    if append and has_scale and (D != 128 or k_new.dtype != F32):
        raise ValueError("fp8 append quantises one 128-wide block per key: k_new must be [T, 128] fp32")

    def body(*refs):
        refs = list(refs)
        q_ref, w_ref = refs[:2]
        kn_ref = refs.pop(2) if append else None
        k_ref = refs[2]
        ks_ref = refs[3] if has_scale else None
        refs = refs[3 + has_scale:]
        pos_ref = refs.pop(0)
        start, pos_off, layer_base, layer_offset = (refs.pop(0)[0] if t else x for x, t in zip(offsets, traced))
        o_ref = refs.pop(0)
        if append:
            kn_s = refs.pop(0)
            k8_s, sc_s = (refs.pop(0), refs.pop(0)) if has_scale else (None, None)
            abar = refs.pop(-1)
        q_s, w_s, k_s = refs[:3]
        ks_s = refs[3] if has_scale else None
        o_s, inf_s, qbar, kbar = refs[3 + has_scale:]
        c = lax.axis_index("c")
        if stacked:   # the layer's rows: one more TMA coordinate, no copy
            layer = layer_base + layer_offset
            k_ref = k_ref.at[layer]
            ks_ref = ks_ref.at[layer] if has_scale else None
        # the query, weight copies and the -inf block do not depend on the positions: start them first
        plgpu.copy_gmem_to_smem(q_ref, q_s, qbar)
        plgpu.copy_gmem_to_smem(w_ref, w_s, qbar)
        inf_s[...] = jnp.full((bs,), -jnp.inf, F32)
        pos = [pos_ref[t] for t in range(T)]
        row_iota = plgpu.broadcasted_iota(jnp.int32, (bs,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
        if append:
            _append(kn_ref, k_ref, ks_ref, kn_s, k8_s, sc_s, abar, pos, start, pos_off, c, row_iota)
        pmax = pos[0]
        for p in pos[1:]:
            pmax = jnp.maximum(pmax, p)
        # rows [0, limit) of the range hold a position <= max(positions); the rest are -inf
        limit = jnp.clip(pmax + 1 - pos_off - start, 0, n)
        nvalid = (limit + bs - 1) // bs
        mine = (nblk - c + grid - 1) // grid                        # blocks b = c + i*grid
        my_valid = jnp.clip((nvalid - c + grid - 1) // grid, 0, mine)

        def issue(i, slot):
            # the last block may run past the cache (row is traced, so the box may overhang even a
            # cache shorter than one block): TMA fills those rows with zeros
            row = start + (c + i * grid) * bs
            plgpu.copy_gmem_to_smem(k_ref.at[pl.ds(row, bs)], k_s.at[slot], kbar.at[slot])
            if has_scale:
                plgpu.copy_gmem_to_smem(ks_ref.at[pl.ds(row, bs)], ks_s.at[slot], kbar.at[slot])

        for st in range(ns):
            @pl.when(st < my_valid)
            def _():
                issue(st, st)

        plgpu.barrier_wait(qbar)
        wv = [plgpu.load(w_s.at[t], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
              for t in range(T)]

        @pl.loop(0, my_valid)
        def _(i):
            slot = lax.rem(i, ns)
            b = c + i * grid
            plgpu.barrier_wait(kbar.at[slot])
            if has_scale:
                ksv = plgpu.load(ks_s.at[slot], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
            # the previous block's score stores must have read o_s before it is overwritten
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            gpos = pos_off + start + b * bs + row_iota
            for t in range(T):
                def mm(acc):
                    plgpu.wgmma(acc, k_s.at[slot], q_s.at[t].T)
                    return acc[...]
                logits = pl.run_scoped(mm, plgpu.ACC((bs, H), F32))
                x = jnp.maximum(logits, 0.0) * lax.broadcast_in_dim(wv[t], (bs, H), [1])
                sc = x.sum(axis=1)
                if has_scale:
                    sc = sc * ksv
                o_s[t] = jnp.where(gpos <= pos[t], sc, -jnp.inf)
            plgpu.commit_smem()
            for t in range(T):   # (b is traced: a box past the output's end is clipped by the TMA)
                plgpu.copy_smem_to_gmem(o_s.at[t], o_ref.at[t, pl.ds(b * bs, bs)])

            @pl.when(i + ns < my_valid)
            def _():
                issue(i + ns, slot)

        plgpu.commit_smem()

        @pl.loop(my_valid, mine)
        def _(i):
            b = c + i * grid
            for t in range(T):
                plgpu.copy_smem_to_gmem(inf_s, o_ref.at[t, pl.ds(b * bs, bs)])

        plgpu.wait_smem_to_gmem(0)

    def _append(kn_ref, k_ref, ks_ref, kn_s, k8_s, sc_s, abar, pos, start, pos_off, c, row_iota):
        """The CTA whose blocks hold a new token's cache row writes that row (and in fp8 the row's
        scale) before its pipeline starts, so its own TMA reads of the block see the fresh key; no
        other CTA reads that block (blocks are dealt out whole), hence no race."""
        for t in range(T):
            row = pos[t] - pos_off
            b = (row - start) // bs
            mine = (row >= start) & (row < start + n) & (lax.rem(b, grid) == c)

            @pl.when(mine)   # the other CTAs start streaming at once
            def _():
                plgpu.copy_gmem_to_smem(kn_ref.at[pl.ds(t, 1)], kn_s.at[pl.ds(t, 1)], abar)
                plgpu.barrier_wait(abar)
                if not has_scale:   # unquantised mode: the key is already in the cache dtype
                    plgpu.copy_smem_to_gmem(kn_s.at[pl.ds(t, 1)], k_ref.at[pl.ds(row, 1)])
                    plgpu.wait_smem_to_gmem(0)
                    return
                # jtilert.ops.quant.act_quant: one 128-wide block, a power-of-two scale
                v = plgpu.load(kn_s.at[t], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                scale = pow2_scale(jnp.max(jnp.abs(v)))
                k8_s[t] = (v / scale).astype(FP8)
                # the block's scales are read, patched and written whole (a 4-byte TMA is too
                # small); past the cache's end the read gets zeros and the write is clipped
                blk = start + b * bs
                plgpu.copy_gmem_to_smem(ks_ref.at[pl.ds(blk, bs)], sc_s, abar)
                plgpu.barrier_wait(abar)
                old = plgpu.load(sc_s, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
                sc_s[...] = jnp.where(row_iota == row - blk, scale, old)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(sc_s, ks_ref.at[pl.ds(blk, bs)])
                plgpu.copy_smem_to_gmem(k8_s.at[pl.ds(t, 1)], k_ref.at[pl.ds(row, 1)])
                plgpu.wait_smem_to_gmem(0)

    scratch = indexer_scratch(T, H, D, k_cache.dtype, config, has_scale, new_dtype)
    hw.check_smem("indexer kernel", hw.Scope(tuple(scratch), reduces=True), config)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((T, n_out), F32),
        scratch_types=scratch,
        grid=(grid,), grid_names=("c",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interp.params(), kernel_name="jtilert_indexer",
    )
    caches = [k_cache] + ([k_scale.astype(F32)] if has_scale else [])
    if append:   # mutable refs: the kernel writes the caches in place (aliased, no copy)
        caches = [jax.new_ref(x) for x in caches]
    args = [q, w.astype(F32)] + ([k_new] if append else []) + caches + [positions.astype(jnp.int32)]
    scores = kernel(*args, *(x for x, t in zip(offsets, traced) if t))
    if not append:
        return scores
    return (scores, caches[0][...]) + ((caches[1][...],) if has_scale else (None,))


def indexer_scratch(T: int, H: int, D: int, dtype, config: IndexerConfig, has_scale: bool, new_dtype=None) -> list:
    """The kernel's scratch (its shared memory; scores reduce in it): with an append (`new_dtype`
    given) the new keys (and their fp8 form and a block of scales), the queries and weights,
    `stages` key blocks (and scales), the score rows, the -inf block and the barriers."""
    bs, ns = config.block_s, config.stages
    k_tf = _tiled(D, jnp.dtype(dtype).itemsize)
    scratch = [
        plgpu.SMEM((T, H, D), dtype, transforms=k_tf),
        plgpu.SMEM((T, H), F32),
        plgpu.SMEM((ns, bs, D), dtype, transforms=k_tf),
    ]
    if has_scale:
        scratch.append(plgpu.SMEM((ns, bs), F32))
    scratch += [
        plgpu.SMEM((T, bs), F32),
        plgpu.SMEM((bs,), F32),
        plgpu.Barrier(num_arrivals=2),
        plgpu.Barrier(num_arrivals=2 if has_scale else 1, num_barriers=ns),
    ]
    if new_dtype is not None:
        scratch = [plgpu.SMEM((T, D), new_dtype)] + (
            [plgpu.SMEM((T, D), FP8), plgpu.SMEM((bs,), F32)] if has_scale else []) + scratch
        scratch.append(plgpu.Barrier(num_arrivals=1))
    return scratch


def resolve(config: IndexerConfig, T: int, H: int, D: int, dtype, has_scale: bool,
            new_dtype=None) -> IndexerConfig | None:
    """`config` with the deepest pipeline (≤ its stages) whose shared memory fits (the queries and
    key blocks grow with tokens, heads and key width); None if one stage does not fit."""
    for stages in range(config.stages, 0, -1):
        cfg = dataclasses.replace(config, stages=stages)
        scratch = indexer_scratch(T, H, D, dtype, cfg, has_scale, new_dtype)
        if hw.smem_bytes(hw.Scope(tuple(scratch), reduces=True)) <= hw.SMEM_BYTES:
            return cfg
    return None


def unsupported(tokens: int, heads: int, k_cache, k_scale) -> str | None:
    """Why `indexer_append_scores` cannot run its kernels for queries of `heads` heads on this
    layer's key cache [S, D] (None: it can)."""
    rows, width = k_cache.shape[-2:]
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens (at most {MAX_TOKENS})"
    if not _kernel_applies(k_cache):
        return (f"{rows} cache rows (a multiple of 8 reads as TMA tiles) of {width} × {k_cache.dtype} "
                "(32-byte multiples)")
    hp = pl.cdiv(heads, 32) * 32
    if hp > 256:
        return f"{heads} index heads (at most 256)"
    new_dtype = (F32 if k_scale is not None else k_cache.dtype) if _appends_in_kernel(k_cache, k_scale) else None
    if resolve(IndexerConfig(), tokens, hp, width, k_cache.dtype, k_scale is not None,
               new_dtype) is None:
        return f"{heads} heads × {width}: no pipeline depth fits the shared memory"
    return None


def indexer_scores(q, w, k_cache, k_scale, positions, *, start=0, rows=None, pos_offset=0,
                   config: IndexerConfig | None = None, layer=None):
    """Drop-in for `jtilert.ops.reference.indexer_scores` (scores [T, S] fp32, -inf past each token's
    position), plus a range: with `start`/`rows` only cache rows [start, start + rows) are scored
    and the result is [T, rows] (positions are split across GPUs this way). `rows` is static (None:
    to the end of the cache, for a static start); `start` and `pos_offset` (global position of
    cache row 0) may be traced. With `layer` (a `jtilert.ops.layer.Layer` or an int32 scalar, may be
    traced) the caches are a layer group's stack [L, S, D] / [L, S] and the layer's rows are scored.
    Caches the kernel does not read (`unsupported`) raise ValueError."""
    _check_layer(k_cache, layer)
    _check_cache(k_cache)
    return _call(q, w, k_cache, k_scale, positions, start, rows, pos_offset, layer, config or IndexerConfig())


def append_and_score(q, w, k_new, k_cache, k_scale, positions, *, start=0, rows=None, pos_offset=0,
                     config: IndexerConfig | None = None, layer=None):
    """`indexer_scores` after writing the new tokens' keys into the cache rows `positions -
    pos_offset` (of `layer`) that fall in the range, in the same kernel: k_new [T, D] is the key
    before quantisation (fp32, Hadamard-rotated as `index_prep` returns it, when the cache is fp8:
    quantised in the kernel exactly as `jtilert.ops.quant.act_quant`; else already in the cache
    dtype). → (scores, k_cache, k_scale), the whole caches updated in place."""
    _check_layer(k_cache, layer)
    return _call(q, w, k_cache, k_scale, positions, start, rows, pos_offset, layer,
                 config or IndexerConfig(), k_new)


def indexer_append_scores(cfg, q, w, k, k_cache, k_scale, positions, start, first_row=None, num_rows=None,
                          *, layer=None):
    """Drop-in for `jtilert.ops.reference.indexer_append_scores` (the model's op; k as `index_prep`
    returns it, rotated in fp8 mode), plus `layer`: the caches are then a layer group's stack
    [L, S, D] / [L, S], the key goes to [layer, start] and the layer's rows are scored; → (scores,
    k_cache, k_scale) with the whole stacks returned. Decode steps run `append_and_score`. With
    num_rows (the indexer split over GPUs) the kernel scores rows [first_row, first_row + num_rows)
    and XLA appends the key (in place), so every rank's cache stays whole for the steps that score
    all rows (MTP's two tokens); so do caches whose rows are too short for the kernel's row copy
    (tiny test models). More than MAX_TOKENS tokens (prefill chunks: the op table runs the reference
    for them) and caches the kernel does not read raise ValueError."""
    _check_layer(k_cache, layer)
    _check_cache(k_cache)
    if q.shape[0] > MAX_TOKENS:
        raise ValueError(f"indexer kernel: {q.shape[0]} tokens (at most {MAX_TOKENS}: the kernel is for decode "
                         "and MTP verification)")
    if num_rows is None and _appends_in_kernel(k_cache, k_scale):
        k_new = k.astype(F32 if k_scale is not None else k_cache.dtype)
        return append_and_score(q, w, k_new, k_cache, k_scale, positions, layer=layer)
    k_cache, k_scale = _xla_append(cfg, k, k_cache, k_scale, start, layer)
    first = 0 if num_rows is None else first_row
    scores = _call(q, w, k_cache, k_scale, positions, first, num_rows, 0, layer, IndexerConfig())
    return scores, k_cache, k_scale


def _check_layer(k_cache, layer):
    if (layer is None) != (k_cache.ndim == 2):
        raise ValueError(f"k_cache {k_cache.shape}: [S, D] without layer, [L, S, D] with one")


def _check_cache(k_cache):
    if not _kernel_applies(k_cache):
        rows, width = k_cache.shape[-2:]
        raise ValueError(f"indexer kernel: {rows} cache rows (a multiple of 8 reads as TMA tiles) of {width} × "
                         f"{k_cache.dtype} (32-byte multiples)")


def _kernel_applies(k_cache) -> bool:
    """Caches the kernel reads: a multiple of 8 rows (the TMA's 8-row tiles; a cache shorter than a
    block is read with zero fill), rows of 32-byte multiples (swizzle)."""
    S, D = k_cache.shape[-2:]
    return S % 8 == 0 and (D * k_cache.dtype.itemsize) % 32 == 0


def _appends_in_kernel(k_cache, k_scale) -> bool:
    """Whether the kernel can append the new keys itself: whole-row copies, and in fp8 one
    128-wide quantisation block per key."""
    return _row_copyable(k_cache) and (k_scale is None or k_cache.shape[-1] == 128)


def _row_copyable(k_cache) -> bool:
    """Whether one cache row is a whole number of 128-byte TMA transfers (the append's row copy)."""
    return (k_cache.shape[-1] * k_cache.dtype.itemsize) % 128 == 0


def _xla_append(cfg, k, k_cache, k_scale, start, layer):
    """The reference's key write, into row `start` (of `layer`): a dynamic_update_slice, in place."""
    k, ks = reference.indexer_key(cfg, k)
    k = k.astype(k_cache.dtype)
    if layer is None:
        k_cache = lax.dynamic_update_slice(k_cache, k, (start, 0))
        if ks is not None:
            k_scale = lax.dynamic_update_slice(k_scale, ks, (start,))
    else:
        layer = Layer.of(layer).index()
        k_cache = lax.dynamic_update_slice(k_cache, k[None], (layer, start, 0))
        if ks is not None:
            k_scale = lax.dynamic_update_slice(k_scale, ks[None], (layer, start))
    return k_cache, k_scale


def _call(q, w, k_cache, k_scale, positions, start, rows, pos_offset, layer, config, k_new=None):
    T, H, D = q.shape
    S = k_cache.shape[-2]
    if k_new is not None and not _row_copyable(k_cache):
        raise ValueError(f"the append copies whole rows: {D} × {k_cache.dtype} is not a multiple of 128 bytes")
    if T > MAX_TOKENS:
        raise ValueError(f"at most {MAX_TOKENS} tokens per call with a range (got {T})")
    if rows is None:
        if not isinstance(start, int):
            raise ValueError("a traced start needs a static row count (rows=)")
        rows = S - start
    if not isinstance(rows, int):
        raise ValueError(f"the row count must be a static int, got {rows!r}")
    if isinstance(start, int) and not 0 <= start <= S - rows:
        raise ValueError(f"rows [{start}, {start + rows}) are not in the cache ({S} rows)")
    q = q.astype(FP8 if k_cache.dtype == FP8 else k_cache.dtype)
    if H % 32:   # the weights' TMA moves a multiple of 128 bytes: pad the heads (zero weight)
        hp = pl.cdiv(H, 32) * 32
        q = jnp.pad(q, ((0, 0), (0, hp - H), (0, 0)))
        w = jnp.pad(w, ((0, 0), (0, hp - H)))
    layer = Layer.of(0 if layer is None else layer)
    # Python ints are baked into the kernel; each traced offset is its own int32 [1] operand (a scalar's
    # reshape: a bitcast, where stacking them would be an XLA kernel of its own per call)
    offsets = tuple(x if isinstance(x, int) else jnp.asarray(x, jnp.int32).reshape(1)
                    for x in (start, pos_offset, layer.base, layer.offset))
    out = indexer_scores_kernel(q, w, k_cache, k_scale, positions, offsets, rows, config, k_new)
    if k_new is None:
        return out[:, :rows] if out.shape[1] != rows else out
    scores, k_cache, k_scale = out
    return (scores[:, :rows] if scores.shape[1] != rows else scores), k_cache, k_scale


def byte_floor(n: int, dim: int = 128, fp8: bool = True) -> int:
    """Bytes the indexer must read per token for n cached rows: keys (+ fp32 scales) and scores out."""
    return n * (dim * (1 if fp8 else 2) + (4 if fp8 else 0)) + n * 4


if __name__ == "__main__":
    # python -m jtilert.pallas.indexer : check against the reference and time one shape.
    T, H, D, S = 1, 64, 128, 32768
    keys = jax.random.split(jax.random.key(0), 4)
    q8, qs = act_quant(jax.random.normal(keys[0], (T, H, D)))
    w = jax.random.normal(keys[1], (T, H)) * qs[..., 0]
    k8, ks = act_quant(jax.random.normal(keys[2], (S, D)))
    ks = ks[:, 0]
    pos = jnp.array([S - 1], jnp.int32)
    f = jax.jit(indexer_scores)
    out = f(q8, w, k8, ks, pos)
    ref = reference.indexer_scores(q8, w, k8, ks, pos)
    print("max abs err", float(jnp.max(jnp.abs(out - ref))))
    if _interp.on_gpu():
        from jax.experimental.mosaic.gpu import profiler
        _, ms = profiler.measure(f, iterations=50)(q8, w, k8, ks, pos)
        t_ms = float(np.median(ms)) if isinstance(ms, (list, tuple)) else ms
        print(f"indexer {t_ms * 1e3:.1f} us, floor {byte_floor(S) / 4.2e6:.2f} us at 4.2 TB/s")
