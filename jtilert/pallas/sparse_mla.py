"""Absorbed sparse MLA decode on Hopper (Pallas Mosaic-GPU): the new tokens' latent queries attend
over the `index_topk` cache rows the indexer selected, flash-decoding style. Contract of
`jtilert.ops.reference.sparse_mla` (rows with idx < 0 masked; fp32 latent output [T, H, L]).
The caches may be one layer ([S, L] + [S, R], or FlashMLA's packed fp8 rows [S, W]) or a layer
group's stack ([L', S, ...]) with a traced `layer`, addressed in the row copies' TMA coordinates.

Grid (tokens, head groups of 64, K / block_k), 4 warpgroups per CTA. Each warpgroup issues one TMA
per selected row for a quarter of the CTA's `block_k` rows (latent and rope; fp8: the packed row as
two copies) into a row-major staging buffer; warpgroup 0 re-lays them into wgmma's swizzled tiles
(fp8: splits the words into byte planes, decodes e4m3, applies the group scale), computes
S = Q_lat·KVᵀ + Q_pe·PEᵀ (heads on wgmma's M), masks, m and P = exp(S − m) (P in bf16, as FlashMLA),
l, and O = P·KV in 128-column chunks to the fp32 partials. `combine_kernel` (or `combine` in XLA)
merges the splits, or W_uv's heads GEMV does as it reads them (`sparse_mla_heads_linear`). Masked
rows load row 0; a token with no valid row gets zeros. Any S (rows are gathered one by one); fp8
queries and output are permuted to the byte-plane order (`_plane_order`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.ops import reference
from jtilert.pallas import _hopper as hw
from jtilert.pallas import gemv, gemv_pair

F32, BF16 = jnp.float32, jnp.bfloat16
HP = 64            # wgmma M: query rows (heads) per CTA
LCHUNK = 128       # output columns per P·V wgmma (accumulator [64, 128] fp32 = 64 registers)
TMA_MAX = 256      # widest TMA box dimension
GATHER_WARPGROUPS = 4   # warpgroups issuing the row-gather TMAs
MAX_TOKENS = 4          # decode / MTP verify; longer chunks (prefill) use the reference


@dataclasses.dataclass(frozen=True)
class SparseMLAConfig:
    # selected rows per CTA, 32 or 64: K / block_k CTAs per token (None: 32 for bf16 caches, so twice the
    # CTAs each gather half the rows; the fp8 cache's dequantisation needs 64)
    block_k: int | None = None
    combine: str = "kernel"     # "kernel": the Mosaic combine kernel where it applies; "xla": one XLA fusion chain

    def __post_init__(self):
        # 16 rows: no bank-conflict-free relayout of the staged rows; 128: over the SMEM budget
        if self.block_k not in (None, 32, 64):
            raise ValueError(f"block_k={self.block_k} must be 32 or 64")
        if self.combine not in ("kernel", "xla"):
            raise ValueError(f"combine={self.combine!r}: expected 'kernel' or 'xla'")


def _swizzle(width: int, itemsize: int) -> int:
    """Largest TMA/wgmma swizzle (bytes) that a row of `width` elements fills."""
    for s in (128, 64, 32):
        if (width * itemsize) % s == 0:
            return s
    raise ValueError(f"rows of {width} × {itemsize} B are not a multiple of 32 bytes")


def _tiled(width: int, itemsize: int):
    s = _swizzle(width, itemsize)
    return (plgpu.TilingTransform((8, s // itemsize)), plgpu.SwizzleTransform(s)), s


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# fp8 cache: a packed row is uint32 words; word i of a 128-value group holds values 4i..4i+3 (byte k =
# value 4i+k) and a rope word holds values 2i (low half) and 2i+1. The kernel splits the words into
# byte "planes" with shifts, so its latent tile holds group g's values in the order (k, i): value
# 128g + 4i + k at column 128g + 32k + i; rope value 2i+h at column 32h + i. The wrapper permutes the
# queries to match (scores are order-free) and un-permutes the output columns.
PLANE = 32     # words per 128-value group = columns per byte plane


def _plane_order(x, group: int, per_word: int):
    """Columns of x [..., n] from value order to plane order (groups of `group` values)."""
    *lead, n = x.shape
    return x.reshape(*lead, n // group, group // per_word, per_word).swapaxes(-1, -2).reshape(*lead, n)


def _value_order(x, group: int, per_word: int):
    *lead, n = x.shape
    return x.reshape(*lead, n // group, per_word, group // per_word).swapaxes(-1, -2).reshape(*lead, n)


def _e4m3_to_f32(b):
    """fp8 e4m3 bit patterns (uint32 0..255) → fp32, with integer ops: normals get the exponent rebiased
    (7 → 127), subnormals are m · 2^-9. (No NaN occurs: the quantiser clips to ±448.)"""
    e = (b >> 3) & 0xF
    m = b & 7
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), F32)
    mag = jnp.where(e == 0, m.astype(F32) * (2.0 ** -9), normal)
    return jnp.where((b & 0x80) != 0, -mag, mag)


def _tile_transforms(R: int, bk: int, fp8: bool):
    """(latent / query / P tiles, rope tiles) SMEM transforms. P·V needs P's swizzle (set by block_k)
    on the latent tiles, QKᵀ the latent tiles' on the queries; an fp8 cache fills the latent tiles
    one 32-column byte plane at a time (64-byte swizzle)."""
    sw = 64 if fp8 else _swizzle(bk, 2)
    q_tf = (plgpu.TilingTransform((8, sw // 2)), plgpu.SwizzleTransform(sw))
    return q_tf, (q_tf if fp8 else _tiled(R, 2)[0])


def _fp8_tail_words(L: int, W: int) -> int:
    """Words of an fp8 row's second copy: scales + rope, a 128-byte multiple overlapping the latent."""
    return _round_up(W - L // 4, 32)


def partials_buffers(L: int, R: int, bk: int, fp8: bool, W: int | None = None):
    """The kernel's SMEM: (scratch, row-gather staging buffers, output double buffer). Scratch: the
    queries, the latent and rope tiles, P, m / l, the row ids and the barriers; the staging buffers
    and the output buffer are scoped one after the other."""
    lc, lw = min(L, LCHUNK), min(L, TMA_MAX)
    nlc, nlw = L // lc, L // lw
    q_tf, qp_tf = _tile_transforms(R, bk, fp8)
    rows_per_wg = bk // GATHER_WARPGROUPS
    scratch = [
        plgpu.SMEM((nlc, HP, lc), BF16, transforms=q_tf),
        plgpu.SMEM((HP, R), BF16, transforms=qp_tf),
        plgpu.SMEM((nlc, bk, lc), BF16, transforms=q_tf),
        plgpu.SMEM((bk, R), BF16, transforms=qp_tf),
        plgpu.SMEM((HP, bk), BF16, transforms=q_tf),
        plgpu.SMEM((2, HP), F32),
        plgpu.SMEM((bk,), jnp.int32),
        plgpu.Barrier(num_arrivals=nlc + 1),
        plgpu.Barrier(num_arrivals=2 * rows_per_wg, num_barriers=GATHER_WARPGROUPS),
        plgpu.Barrier(num_arrivals=GATHER_WARPGROUPS),
    ]
    if fp8:
        stage = (plgpu.SMEM((bk, L // 4), jnp.uint32), plgpu.SMEM((bk, _fp8_tail_words(L, W)), jnp.uint32))
    else:
        stage = (plgpu.SMEM((bk, nlw, lw), BF16), plgpu.SMEM((bk, R), BF16))
    out = (plgpu.SMEM((2, HP, lc), F32, transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),)
    return scratch, stage, out


def partials_smem(L: int, R: int, bk: int, fp8: bool, W: int | None = None) -> hw.Scope:
    """The kernel's shared memory (the softmax reduces in the output buffer's scope)."""
    scratch, stage, out = partials_buffers(L, R, bk, fp8, W)
    return hw.Scope(tuple(scratch), (hw.Scope(stage), hw.Scope(out, reduces=True)))


def resolve(config: SparseMLAConfig, L: int, R: int, fp8: bool, W: int | None = None) -> SparseMLAConfig | None:
    """`config` with its block_k (None: the cache's default), or with block_k 32 (bf16 cache) when its
    SMEM does not fit: None if neither fits (the latent tiles grow with kv_lora_rank)."""
    want = config.block_k or _default_block_k(fp8)
    for bk in (want, 32):
        if (bk <= want and not (fp8 and bk % 64)
                and hw.smem_bytes(partials_smem(L, R, bk, fp8, W)) <= hw.SMEM_BYTES):
            return dataclasses.replace(config, block_k=bk)
    return None


def _default_block_k(fp8: bool) -> int:
    return 64 if fp8 else 32


def unsupported(heads: int, L: int, R: int, W: int | None = None,
                config: SparseMLAConfig | None = None) -> str | None:
    """Why `sparse_mla` cannot run the kernel on these queries and caches (None: it can). W: the
    words of a packed fp8 cache row (None: bf16 latent + rope caches of width L and R)."""
    fp8 = W is not None
    if fp8 and not fp8_kernel_applies(L, R, W):
        return f"fp8 cache rows of {W} words"
    if not fp8 and R % 8:
        return f"rope dim {R} is not a multiple of 8"
    if L % 64 or (L > TMA_MAX and L % TMA_MAX):
        return f"kv_lora_rank={L} is not a multiple of 64 (of {TMA_MAX} above {TMA_MAX})"
    hq = _round_up(heads, 8)
    if hq > HP and hq % HP:
        return f"{heads} heads: above {HP}, a multiple of {HP}"
    rp = R if fp8 else _round_up(R, 64)
    if resolve(config or SparseMLAConfig(), L, rp, fp8, W) is None:
        return f"kv_lora_rank={L}: no block_k fits the shared memory"
    return None


def sparse_mla_partials(q_lat, q_pe, kv_cache, pe_cache, idx, scale: float,
                        config: SparseMLAConfig = SparseMLAConfig(), layer=None):
    """The kernel: per-split partial results (o [T, G, n_split, Hc, L] fp32, m [T, G, n_split, Hc],
    l [T, G, n_split, Hc]) for `combine`. q_lat [T, Hq, L] with Hq a multiple of 8 (the caller pads),
    idx [T, K] int32 with K a multiple of block_k; rows with idx < 0 are masked. pe_cache None: kv_cache is the packed fp8 cache [S, W] uint32 and q_lat /
    q_pe / o are in plane order (see `_plane_order`). With `layer` (a `Layer` or an int32
    scalar, may be traced) the caches are stacks [L', S, ...] and the layer's rows are read."""
    T, Hq, L = q_lat.shape
    R = q_pe.shape[-1]
    K = idx.shape[1]
    fp8 = pe_cache is None
    bk = config.block_k or _default_block_k(fp8)
    W = kv_cache.shape[-1] if fp8 else None
    stacked = layer is not None
    if kv_cache.ndim != 2 + stacked or (not fp8 and pe_cache.ndim != 2 + stacked):
        raise ValueError(f"caches {kv_cache.shape}: [S, ...] without layer, [L, S, ...] with one")
    if K % bk:
        raise ValueError(f"K={K} must be a multiple of block_k={bk}")
    if L % 64 or (L > TMA_MAX and L % TMA_MAX):
        raise ValueError(f"kv_lora_rank={L} must be a multiple of 64 (of {TMA_MAX} above {TMA_MAX})")
    if (R * 2) % 128:
        raise ValueError(f"rope dim {R}: a query row must be a multiple of 128 bytes (pad it)")
    rc = R if fp8 else pe_cache.shape[-1]   # rope width of the cache, ≤ R (a narrower row is read
    if rc > R or (rc * 2) % 16:             # as an R-wide box: TMA fills the columns past rc with zeros)
        raise ValueError(f"rope cache width {rc}: at most {R}, a multiple of 16 bytes")
    if Hq % 8 or (Hq > HP and Hq % HP):
        raise ValueError(f"heads={Hq} must be a multiple of 8, and of {HP} when above {HP}")
    if fp8:
        if (W != reference.kv_fp8_words(L, R) or W > TMA_MAX or W % 4 or L % 128 or R != 2 * PLANE
                or bk % 64):
            raise ValueError(f"fp8 cache: unsupported L={L}, R={R}, {W} words per row, block_k={bk}")
        # a row travels as two TMA copies of whole 128-byte multiples (Mosaic's limit): the latent
        # words, and the last TW words (scales + rope, overlapping the latent's end: those bytes come
        # from L2, DRAM traffic stays one row)
        TW = _fp8_tail_words(L, W)
    n_split = K // bk
    groups = max(1, Hq // HP)
    hc = min(Hq, HP)                  # real query rows per CTA
    lc = min(L, LCHUNK)
    nlc = L // lc
    lw = min(L, TMA_MAX)              # a bf16 latent row travels as one [L / lw, lw] TMA box
    nlw = L // lw
    if not fp8:
        kv_layout = plgpu.Layout.SMEM_GMEM_COPY((bk, lc), BF16, _swizzle(bk, 2))
        pe_layout = plgpu.Layout.SMEM_GMEM_COPY((bk, R), BF16, _swizzle(R, 2))
    nwg = GATHER_WARPGROUPS
    rows_per_wg = bk // nwg

    def body(*refs):
        it = iter(refs)
        ql_ref, qp_ref, kv_ref = next(it), next(it), next(it)
        pe_ref = None if fp8 else next(it)
        idx_ref = next(it)
        if stacked:   # the layer's rows: one more TMA coordinate, no copy of the layer
            lay = hw.read_layer(next(it), next(it))
            kv_ref = kv_ref.at[lay]
            pe_ref = None if fp8 else pe_ref.at[lay]
        o_ref, m_ref, l_ref, ql_s, qp_s, kv_s, pe_s, p_s, ml_s, midx_s, qbar, gbar, done = it
        t, g, s = lax.axis_index("t"), lax.axis_index("g"), lax.axis_index("s")
        wg = lax.axis_index("wg")
        zero = t * 0   # a traced 0: a box that overhangs the cache's rope columns is then allowed
        row0 = t * Hq + g * HP
        base = s * bk

        @pl.when(wg == 0)
        def _():
            for c in range(nlc):
                plgpu.copy_gmem_to_smem(ql_ref.at[pl.ds(row0, hc), pl.ds(c * lc, lc)],
                                        ql_s.at[c, pl.ds(0, hc)], qbar)
            plgpu.copy_gmem_to_smem(qp_ref.at[pl.ds(row0, hc)], qp_s.at[pl.ds(0, hc)], qbar)

        def gather(*stage):
            # every warpgroup issues the row copies of its share of the block (TMA issue is the
            # bottleneck of a one-thread gather); all scalar loads first (independent, so they
            # overlap), then the copies (each copy ends in a warpgroup barrier)
            js = [wg * rows_per_wg + jj for jj in range(rows_per_wg)]
            rs = [idx_ref[t, base + j] for j in js]
            for j, r in zip(js, rs):
                midx_s[j] = r
            for j, r in zip(js, rs):
                r = jnp.maximum(r, 0)
                if fp8:
                    plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(r, 1), pl.ds(0, L // 4)],
                                            stage[0].at[pl.ds(j, 1)], gbar.at[wg])
                    plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(r, 1), pl.ds(W - TW, TW)],
                                            stage[1].at[pl.ds(j, 1)], gbar.at[wg])
                else:
                    plgpu.copy_gmem_to_smem(kv_ref.at[pl.ds(r, 1)], stage[0].at[pl.ds(j, 1)], gbar.at[wg])
                    pe_row = pe_ref.at[pl.ds(r, 1)] if rc == R else pe_ref.at[pl.ds(r, 1), pl.ds(zero, R)]
                    plgpu.copy_gmem_to_smem(pe_row, stage[1].at[pl.ds(j, 1)], gbar.at[wg])
            plgpu.barrier_arrive(done)

            @pl.when(wg == 0)
            def _():   # re-lay the staged rows into wgmma's tiles
                plgpu.barrier_wait(done)
                for w in range(nwg):
                    plgpu.barrier_wait(gbar.at[w])
                for c in range(nlc):
                    if fp8:
                        dequantize_chunk(stage[0], stage[1], c)
                    else:
                        a, b = divmod(c * lc, lw)
                        kv_s[c] = plgpu.load(stage[0].at[:, a, pl.ds(b, lc)], layout=kv_layout)
                if fp8:
                    dequantize_rope(stage[1])
                else:
                    pe_s[...] = plgpu.load(stage[1], layout=pe_layout)
                plgpu.commit_smem()

        def dequantize_chunk(lat_words, tail_words, c):
            # packed rows → bf16 tiles, one byte plane (32 columns) per store; values × power-of-two
            # scales are exact in bf16
            wl = plgpu.Layout.WGMMA
            sc = plgpu.load(tail_words.at[:, L // 4 + c - (W - TW)], layout=wl.reduce(1), optimized=False)
            sc = lax.bitcast_convert_type(sc, F32)
            sc = plgpu.layout_cast(lax.broadcast_in_dim(sc, (bk, PLANE), [0]), wl)
            w = plgpu.load(lat_words.at[:, pl.ds(c * PLANE, PLANE)], layout=wl, optimized=False)
            for k in range(4):
                v = _e4m3_to_f32((w >> (8 * k)) & 0xFF) * sc
                kv_s[c, :, pl.ds(k * PLANE, PLANE)] = v.astype(BF16)

        def dequantize_rope(tail_words):
            w = plgpu.load(tail_words.at[:, pl.ds(TW - PLANE, PLANE)], layout=plgpu.Layout.WGMMA, optimized=False)
            pe_s[:, pl.ds(0, PLANE)] = lax.bitcast_convert_type(w << 16, F32).astype(BF16)
            pe_s[:, pl.ds(PLANE, PLANE)] = lax.bitcast_convert_type((w >> 16) << 16, F32).astype(BF16)

        pl.run_scoped(gather, *stage_types, collective_axes="wg")

        def attend(o_s):
            @pl.when(wg == 0)
            def _():
                plgpu.barrier_wait(qbar)

                def qk(acc):
                    for c in range(nlc):
                        plgpu.wgmma(acc, ql_s.at[c], kv_s.at[c].T)
                    plgpu.wgmma(acc, qp_s, pe_s.T)
                    return acc[...]

                sc = pl.run_scoped(qk, plgpu.ACC((HP, bk), F32))
                rows = plgpu.load(midx_s, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
                ok = lax.broadcast_in_dim(rows, (HP, bk), [1]) >= 0
                sc = jnp.where(ok, sc * scale, -jnp.inf)
                m = sc.max(axis=1)
                ml_s[0] = m
                m_safe = jnp.where(m == -jnp.inf, 0.0, m)
                p = jnp.exp(sc - lax.broadcast_in_dim(m_safe, sc.shape, [0]))
                ml_s[1] = p.sum(axis=1)
                p_s[...] = p.astype(BF16)
                plgpu.commit_smem()
                for c in range(nlc):
                    def pv(acc):
                        plgpu.wgmma(acc, p_s, kv_s.at[c])
                        return acc[...]
                    o = pl.run_scoped(pv, plgpu.ACC((HP, lc), F32))
                    if c >= 2:
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    o_s[c % 2] = o
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_s.at[c % 2, pl.ds(0, hc)], o_ref.at[t, g, s, :, pl.ds(c * lc, lc)])
                plgpu.copy_smem_to_gmem(ml_s.at[0, pl.ds(0, hc)], m_ref.at[t, g, s])
                plgpu.copy_smem_to_gmem(ml_s.at[1, pl.ds(0, hc)], l_ref.at[t, g, s])
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(attend, *attend_types, collective_axes="wg")

    scratch, stage_types, attend_types = partials_buffers(L, R, bk, fp8, W)
    hw.check_smem("sparse MLA kernel", partials_smem(L, R, bk, fp8, W), config)
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((T, groups, n_split, hc, L), F32),
                  jax.ShapeDtypeStruct((T, groups, n_split, hc), F32),
                  jax.ShapeDtypeStruct((T, groups, n_split, hc), F32)),
        scratch_types=scratch,
        grid=(T, groups, n_split), grid_names=("t", "g", "s"),
        num_threads=nwg, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interp.params(), kernel_name="jtilert_sparse_mla",
    )
    args = [q_lat.reshape(T * Hq, L), q_pe.reshape(T * Hq, R)]
    if fp8:
        args.append(kv_cache)
    else:   # [.., S, L] → [.., S, L / lw, lw]: a bitcast, not a copy
        args += [kv_cache.reshape(*kv_cache.shape[:-1], nlw, lw), pe_cache]
    args.append(idx)
    args += hw.layer_operands(layer)
    return kernel(*args)


def combine(o, m, l):
    """Merge the splits: o [T, G, n, Hc, L], m/l [T, G, n, Hc] → [T, G·Hc, L] fp32."""
    mx = m.max(axis=2, keepdims=True)
    w = jnp.exp(m - jnp.where(mx == -jnp.inf, 0.0, mx))
    den = (w * l).sum(2)
    num = (w[..., None] * o).sum(2)
    res = num / jnp.where(den == 0, 1.0, den)[..., None]
    t, g, hc, L = res.shape
    return res.reshape(t, g * hc, L)


def _combine_cols(n: int, hc: int, L: int) -> int | None:
    """Columns per combine CTA: the [n, Hc, cols] fp32 partials fit in 128 KiB of SMEM and cols is a
    multiple of the MMA accumulator tile's width; None if no kernel configuration applies."""
    if hc not in (16, 32, 64) or n > HP or (n * hc * 4) % 128:   # m/l copies: 128-byte multiples
        return None
    step = (4 // (hc // 16)) * 8
    for cols in (8, 16, 32, 64):           # narrowest first: more CTAs share the partials' bytes
        if cols % step == 0 and L % cols == 0 and n * hc * cols * 4 <= 128 * 1024:
            return cols
    return None


def combine_kernel(o, m, l, *, cols: int | None = None, out_dtype=F32):
    """`combine` as one Mosaic-GPU kernel (XLA needs three fusions for it). o [T, G, n, Hc, L],
    m/l [T, G, n, Hc] → [T, G·Hc, L] in `out_dtype` (the sums in fp32), for Hc in (16, 32, 64) and
    n ≤ 64. Grid (T, G, L / cols).
    Per CTA: the split weights w[s,h] = e^{m[s,h]−M[h]} / Σ_s e^{m[s,h]−M[h]} l[s,h] on one [64, Hc]
    tile (splits on the rows, padded with −inf), then Σ_s w[s,h] · o[s,h,cols] on [Hc, cols] tiles."""
    T, G, n, hc, L = o.shape
    cols = cols or _combine_cols(n, hc, L)
    if cols is None or hc not in (16, 32, 64) or n > HP or L % cols:
        raise ValueError(f"combine_kernel: unsupported shape {o.shape}")
    acc_layout = plgpu.Layout.MMA_ACC(F32, m_warps=hc // 16)

    def body(o_ref, m_ref, l_ref, out_ref, m_s, l_s, w_s, o_s, mlbar, obar):
        t, g, c = lax.axis_index("t"), lax.axis_index("g"), lax.axis_index("c")
        plgpu.copy_gmem_to_smem(o_ref.at[t, g, :, :, pl.ds(c * cols, cols)], o_s, obar)
        if n < HP:
            m_s[...] = jnp.full((HP, hc), -jnp.inf, F32)
            l_s[...] = jnp.zeros((HP, hc), F32)
            plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(m_ref.at[t, g], m_s.at[pl.ds(0, n)], mlbar)
        plgpu.copy_gmem_to_smem(l_ref.at[t, g], l_s.at[pl.ds(0, n)], mlbar)
        plgpu.barrier_wait(mlbar)
        wl = plgpu.Layout.WGMMA
        mv = plgpu.load(m_s, layout=wl, optimized=False)
        lv = plgpu.load(l_s, layout=wl, optimized=False)
        mx = mv.max(axis=0)
        mx = jnp.where(mx == -jnp.inf, 0.0, mx)
        wv = jnp.exp(mv - lax.broadcast_in_dim(mx, (HP, hc), [1]))
        den = (wv * lv).sum(axis=0)
        den = jnp.where(den == 0, 1.0, den)
        w_s[...] = wv / lax.broadcast_in_dim(den, (HP, hc), [1])
        plgpu.barrier_wait(obar)

        def weighted(sp):
            x = plgpu.load(o_s.at[sp], layout=acc_layout, optimized=False)
            wr = plgpu.load(w_s.at[sp], layout=acc_layout.reduce(1), optimized=False)
            return x * plgpu.layout_cast(lax.broadcast_in_dim(wr, (hc, cols), [0]), acc_layout)
        # the splits in order, in a loop (one copy of its code in the module)
        acc = lax.fori_loop(1, n, lambda sp, acc: acc + weighted(sp), weighted(0))
        out_ref.at[t, pl.ds(g * hc, hc), pl.ds(c * cols, cols)][...] = acc.astype(out_dtype)

    scratch = [
        plgpu.SMEM((HP, hc), F32), plgpu.SMEM((HP, hc), F32), plgpu.SMEM((HP, hc), F32),
        plgpu.SMEM((n, hc, cols), F32),
        plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=1),
    ]
    hw.check_smem("sparse MLA combine kernel", hw.Scope(tuple(scratch), reduces=True), f"{cols} columns per CTA")
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((T, G * hc, L), out_dtype),
        scratch_types=scratch,
        grid=(T, G, L // cols), grid_names=("t", "g", "c"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interp.params(), kernel_name="jtilert_sparse_mla_combine",
    )
    return kernel(o, m, l)


def fp8_kernel_applies(L: int, R: int, W: int) -> bool:
    """Whether the kernel reads a packed fp8 cache of W words per row (latent L, rope R)."""
    return W == reference.kv_fp8_words(L, R) and R == 2 * PLANE and W % 4 == 0 and W <= TMA_MAX


def sparse_mla(q_lat, q_pe, kv_cache, pe_cache, idx, scale: float, out_dtype=F32, *,
               config: SparseMLAConfig | None = None, layer=None):
    """Drop-in for `jtilert.ops.reference.sparse_mla`: q_lat [T, H, L], q_pe [T, H, R], kv_cache [S, L] with
    pe_cache [S, R], or the packed fp8 cache [S, W] uint32 with pe_cache None; idx [T, K] (rows with
    idx < 0 masked) → o_lat [T, H, L] in `out_dtype` (the combine kernel writes it: no cast after it).
    With `layer` (a `jtilert.ops.layer.Layer` or an int32 scalar, may be traced) the caches are a layer
    group's stacks [L', S, ...] and the layer's rows are read. More than MAX_TOKENS tokens, or shapes
    `unsupported` names, raise ValueError (the op table then runs the reference, with a warning)."""
    config = config or SparseMLAConfig()
    o, m, l, fp8 = _partials(q_lat, q_pe, kv_cache, pe_cache, idx, scale, config, layer)
    H = q_lat.shape[1]
    if config.combine == "kernel" and _combine_cols(*o.shape[2:]) is not None:
        out = combine_kernel(o, m, l, out_dtype=out_dtype)[:, :H]
    else:
        out = combine(o, m, l)[:, :H].astype(out_dtype)
    return _value_order(out, 128, 4) if fp8 else out


def sparse_mla_heads_linear(q_lat, q_pe, kv_cache, pe_cache, idx, scale: float, out_dtype, w, w_scale=None,
                            block: int = 128, *, config: SparseMLAConfig | None = None, layer=None):
    """`jtilert.ops.reference.sparse_mla_heads_linear`: sparse MLA (bf16 caches), then every head's
    latent output in bf16 through its W_uv (w [H, N, L] fp8 with `block`-blocks of scales, or bf16;
    stacks [L', ...] with `layer`, the caches' layer too) → [T, H, N] bf16. Two launches: the
    attention's split partials, then the heads GEMV, whose CTAs merge their head's splits in place of
    the combine kernel (`gemv.heads_linear_of_splits`). ValueError where `heads_linear_unsupported`
    names a reason."""
    o, m, l = _merged_partials("sparse_mla_heads_linear", q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype,
                               block, config, layer)
    return gemv.heads_linear_of_splits(o, m, l, w, w_scale, block, layer=layer)


def attention_out(q_lat, q_pe, kv_cache, pe_cache, idx, scale: float, out_dtype, w, w_scale, block: int, wo, wo_scale,
                  residual, *, config: SparseMLAConfig | None = None, layer=None):
    """`jtilert.ops.reference.attention_out`: `sparse_mla_heads_linear`, then o_proj of its heads as one row
    with the residual added, as two launches: the attention's split partials, then W_uv (merging the
    splits) and o_proj as two phases of one kernel (`gemv_pair.heads_splits_linear`). ValueError where
    `heads_linear_unsupported` names a reason."""
    o, m, l = _merged_partials("attention_out", q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, block, config,
                               layer)
    return gemv_pair.heads_splits_linear(o, m, l, w, w_scale, block, wo, wo_scale, residual, layer=layer)


def attention_out_unsupported(q_lat, q_pe, kv_cache, pe_cache, idx, scale: float, out_dtype, w, w_scale, block: int,
                              wo, wo_scale, residual, *, config: SparseMLAConfig | None = None) -> str | None:
    """Why `attention_out` does not run W_uv and o_proj as one kernel of two phases at these shapes (one
    layer's weights and caches; None: it does): `heads_linear_unsupported`'s reasons, a W_uv GEMV that does
    not finish its heads in the kernel (its split-K partials summed after it: many heads, as at tp 1), or
    the phases' units past the SMs (`gemv_pair.chain_unsupported`). Shapes only: nothing is computed."""
    why = []

    def plans(q_lat, q_pe, kv_cache, pe_cache, idx, w, w_scale, wo, wo_scale, residual):
        o, m, l = _merged_partials("attention_out", q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, block,
                                   config, None)
        try:
            why.append(gemv_pair.chain_unsupported(*gemv_pair.heads_splits_linear_plans(
                o, m, l, w, w_scale, block, wo, wo_scale, residual)))
        except ValueError as e:   # the W_uv plan cannot write its heads as one row a token
            why.append(str(e))

    try:
        jax.eval_shape(plans, q_lat, q_pe, kv_cache, pe_cache, idx, w, w_scale, wo, wo_scale, residual)
    except ValueError as e:   # `_merged_partials`' refusals
        return str(e)
    return why[0]


def _merged_partials(op: str, q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, block, config, layer):
    """The attention's split partials (o, m, l) for a heads GEMV that merges them (op `op`'s first launch),
    or a ValueError naming `op` where `heads_linear_unsupported` names a reason."""
    config = config or SparseMLAConfig()
    why = heads_linear_unsupported(q_lat.shape[1], q_lat.shape[2], q_pe.shape[-1], idx.shape[-1], pe_cache is None,
                                   block, out_dtype, config)
    if why:   # (`_partials` refuses more than MAX_TOKENS tokens)
        raise ValueError(f"{op} kernel: {why}")
    o, m, l, _ = _partials(q_lat, q_pe, kv_cache, pe_cache, idx, scale, config, layer)
    return o, m, l


def heads_linear_unsupported(heads: int, L: int, R: int, K: int, fp8: bool, block: int, out_dtype,
                             config: SparseMLAConfig | None = None) -> str | None:
    """Why `sparse_mla_heads_linear` cannot run its kernels (None: it can); K: the selected rows a token,
    fp8: the packed fp8 cache."""
    if fp8:
        return "the fp8 latent cache (its partials are in byte-plane order)"
    if jnp.dtype(out_dtype) != BF16:
        return f"the attention's output in {jnp.dtype(out_dtype).name} (the kernel rounds it to bf16)"
    if block not in (64, 128):
        return f"W_uv's {block}-blocks of scales (the heads GEMV takes 64- or 128-blocks)"
    if not gemv.splits_slice_fits(L):
        return f"kv_lora_rank={L}: a multiple of 128 (of 256 above 256)"
    why = unsupported(heads, L, R, None, config)
    if why is None:
        n_split = -(-K // resolve(config or SparseMLAConfig(), L, _round_up(R, 64), False).block_k)
        if n_split > gemv.SPLIT_ROWS:
            why = f"{K} selected rows: {n_split} splits to merge (at most {gemv.SPLIT_ROWS})"
    return why


def _partials(q_lat, q_pe, kv_cache, pe_cache, idx, scale: float, config: SparseMLAConfig, layer):
    """The checks and operand preparation of `sparse_mla`, then `sparse_mla_partials`: (o, m, l, fp8)."""
    T, H, L = q_lat.shape
    R = q_pe.shape[-1]
    fp8 = pe_cache is None
    if kv_cache.ndim != 2 + (layer is not None):
        raise ValueError(f"kv_cache {kv_cache.shape}: [S, ...] without layer, [L, S, ...] with one")
    W = kv_cache.shape[-1] if fp8 else None
    why = (f"{T} tokens (at most {MAX_TOKENS}: the kernel is for decode and MTP verification)"
           if T > MAX_TOKENS else unsupported(H, L, R, W, config))
    if why:
        raise ValueError(f"sparse_mla kernel: {why}")
    config = resolve(config, L, R if fp8 else _round_up(R, 64), fp8, W)
    idx = idx.astype(jnp.int32)
    K = idx.shape[1]
    kp = _round_up(max(K, 1), config.block_k)
    if kp != K:
        idx = jnp.pad(idx, ((0, 0), (0, kp - K)), constant_values=-1)
    hq = _round_up(H, 8)
    q_lat, q_pe = q_lat.astype(BF16), q_pe.astype(BF16)
    if fp8:
        q_lat, q_pe = _plane_order(q_lat, 128, 4), _plane_order(q_pe, R, 2)
    else:   # (no-ops for the model's bf16 caches)
        kv_cache, pe_cache = kv_cache.astype(BF16), pe_cache.astype(BF16)
        rp = _round_up(R, 64)   # rope rows of 128-byte multiples: the queries are zero-padded, the
        if rp != R:             # kernel reads the cache's narrower rows with zero fill (tiny models)
            q_pe = jnp.pad(q_pe, ((0, 0), (0, 0), (0, rp - R)))
    if hq != H:
        q_lat = jnp.pad(q_lat, ((0, 0), (0, hq - H), (0, 0)))
        q_pe = jnp.pad(q_pe, ((0, 0), (0, hq - H), (0, 0)))
    return *sparse_mla_partials(q_lat, q_pe, kv_cache, pe_cache, idx, float(scale), config, layer), fp8


def byte_floor(heads: int, k: int, lat: int, rope: int) -> int:
    """Bytes sparse MLA must move for one token: the selected latent + rope rows (bf16), the
    queries and the fp32 output."""
    return k * (lat + rope) * 2 + heads * (lat + rope) * 2 + heads * lat * 4


if __name__ == "__main__":
    # python -m jtilert.pallas.sparse_mla : check against the reference and time one shape.
    reference = reference.sparse_mla
    T, H, L, R, S, K = 1, 16, 512, 64, 32768, 2048
    keys = jax.random.split(jax.random.key(0), 5)
    ql = jax.random.normal(keys[0], (T, H, L), BF16)
    qp = jax.random.normal(keys[1], (T, H, R), BF16)
    kv = jax.random.normal(keys[2], (S, L), BF16)
    pe = jax.random.normal(keys[3], (S, R), BF16)
    idx = jax.random.permutation(keys[4], S)[:K].astype(jnp.int32)[None]
    f = jax.jit(functools.partial(sparse_mla, scale=0.0417))
    out = f(ql, qp, kv, pe, idx)
    ref = reference(ql, qp, kv, pe, idx, 0.0417)
    print("rel err", float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref)))
    if _interp.on_gpu():
        from jax.experimental.mosaic.gpu import profiler
        _, ms = profiler.measure(f, iterations=50)(ql, qp, kv, pe, idx)
        t_ms = float(np.median(ms)) if isinstance(ms, (list, tuple)) else ms
        print(f"sparse_mla {t_ms * 1e3:.1f} us, floor {byte_floor(H, K, L, R) / 4.2e6:.2f} us at 4.2 TB/s")
