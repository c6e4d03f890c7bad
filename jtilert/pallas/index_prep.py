"""The DSA indexer's glue between the projections and the indexer kernel, one launch per layer (Pallas
Mosaic-GPU): the key's LayerNorm, rope on the first R columns of every index-query head and of the
key, the Hadamard rotation of both, the queries' fp8 quantisation with each row's scale folded into its
head weight. Contract of `jtilert.ops.reference.index_prep`.

One warpgroup per CTA, one CTA per 64-row tile: the query tiles (T·H heads of D values, gathered by
one TMA per token from the projection's output read as rows of D) and, beside them, the keys' tile
(LayerNormed in registers from their window, the norm stacks read at the traced layer). Per tile a
wgmma with a 0/1 matrix P splits the rope pairs into [x1 | x2 | rest] (exact), they are rotated in fp32
as the reference does and rounded to bf16, and a second wgmma by Pᵀ·H (H the ±1 Hadamard matrix) takes
them back and rotates them, summed in fp32 in the tensor core's order, then times D^-0.5. Each query
row's amax gives its power-of-two scale (`quant.act_quant`); the fp8 queries, the scaled head weights
and the fp32 keys go out by TMA.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.ops import reference
from jtilert.ops.quant import hadamard, pow2_scale
from jtilert.pallas import _hopper as hw
from jtilert.pallas._hopper import BF16, F32, FP8

TILE = 64          # wgmma M: rows per tile
EXCLUSIVE_SLACK = 2048   # bytes short of the block's whole shared memory (alignment of the padding)
MAX_TOKENS = 4     # decode / MTP verify (the op table runs the reference for prefill chunks)
DIM = 128          # index_head_dim: one 128-wide fp8 quantisation block per head
# 32 columns of 64 bytes per swizzle row: the halves of a rope dim of 64 are whole tiles
TF = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))


def matrices(d: int, r: int, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """(P, Pᵀ·H) [d, d] bf16: x · P = [x[0:r:2] | x[1:r:2] | x[r:]] for interleaved rope pairs (else the
    identity: the halves are already apart), and the matrix that takes the split rows back and applies
    the ±1 Hadamard matrix H (hadamard(d) · d^0.5) in one product. Entries 0 / ±1: exact in bf16."""
    p = hw.pair_split(d, r) if interleaved else np.eye(d, dtype=np.float32)
    signs = np.sign(hadamard(d))
    return p.astype(jnp.bfloat16), (p.T @ signs).astype(jnp.bfloat16)


def unsupported(tokens: int, heads: int, dim: int, rope: int, quant: str, q_width: int, q_col: int,
                k_width: int, k_col: int, dtype=BF16) -> str | None:
    """Why `index_prep` cannot run the kernel (None: it can): bf16 activations, fp8 index queries of one
    128-wide block per head, rope halves of 64-byte multiples, TMA-aligned windows."""
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens (at most {MAX_TOKENS})"
    if quant != "fp8":
        return f"index_quant={quant!r}: the kernel quantises the queries to fp8"
    if dtype != BF16:
        return f"activations {jnp.dtype(dtype).name}, the kernel takes bfloat16"
    if dim != DIM:
        return f"index_head_dim={dim} (the kernel takes {DIM}: one quantisation block per head)"
    if rope % 64 or rope > dim:
        return f"rope dim {rope}: a multiple of 64 (whole 64-byte halves), at most index_head_dim, is needed"
    if heads % 4:
        return f"{heads} heads: each token's head weights move in 16-byte rows"
    if q_width % dim or q_col % dim:
        return f"the queries at column {q_col} of rows {q_width} wide: multiples of index_head_dim={dim} are needed"
    if k_width % 8 or k_col % 8:
        return f"the key at column {k_col} of rows {k_width} wide (TMA: multiples of 8)"
    if q_col + heads * dim > q_width or k_col + dim > k_width:
        return f"windows at columns {q_col} / {k_col} past widths {q_width} / {k_width}"
    return None


def index_prep(cfg, q_x, q_col: int, k_x, k_col: int, norm_weight, norm_bias, eps: float, cos, sin, w, *, layer):
    """Drop-in for `jtilert.ops.reference.index_prep` with the k_norm stacks [L, D] and `layer` a
    `jtilert.ops.layer.Layer` or an int32 scalar (may be traced): q_x [T, ·] holds the index queries
    (H heads of D) at columns q_col.., k_x [T, ·] the key [D] at column k_col, cos / sin [T, R/2]
    fp32, w [T, W ≥ H] fp32 (the head weights' projection in each row's first H columns, read in
    place) → (q [T, H, D] fp8, w · H^-0.5 · D^-0.5 · the queries' scales [T, H] fp32, k [T, D] fp32
    normed, roped (bf16) and Hadamard-rotated).
    Shapes `unsupported` names raise ValueError."""
    T = q_x.shape[0]
    H, D = cfg.index_n_heads, cfg.index_head_dim
    half = cos.shape[-1]
    R = 2 * half
    dtype = q_x.dtype if q_x.dtype == k_x.dtype else k_x.dtype
    why = unsupported(T, H, D, R, cfg.index_quant, q_x.shape[-1], q_col, k_x.shape[-1], k_col, dtype)
    if why is None and (norm_weight.ndim != 2 or norm_bias.ndim != 2 or norm_weight.shape[-1] != D):
        why = f"k_norm {norm_weight.shape} / {norm_bias.shape}: layer stacks [L, {D}] are needed"
    if why is None and (w.ndim != 2 or w.shape[0] != T or w.shape[1] < H or w.shape[1] % 4):
        why = f"head weights {list(w.shape)}: [{T}, W ≥ {H}] with W a multiple of 4 (16-byte rows) are needed"
    if why:
        raise ValueError(f"index_prep kernel: {why}")
    n_q = T * H
    w_width = w.shape[1]           # token t's head weights: its row's first H columns
    nq_tiles = pl.cdiv(n_q, TILE)
    kt = nq_tiles                  # the key's CTA, after the query tiles'
    per_row = q_x.shape[-1] // D   # q_x as rows of D: token t's heads are rows t·per_row + q_col/D ..
    scale_h = np.float32(hadamard(D)[0, 0])   # D^-0.5 as the reference's fp32 matrix holds it
    w_scale = reference.index_weight_scale(cfg)
    wl = plgpu.Layout.WGMMA

    def gathers(g):
        """Query tile g's row ranges: (token, first head, rows) per token with rows in the tile."""
        out = []
        for t in range(T):
            lo, hi = max(t * H, g * TILE), min((t + 1) * H, (g + 1) * TILE)
            if lo < hi:
                out.append((t, lo - t * H, hi - lo))
        return out
    arrivals = 4 + 2 * max(len(gathers(g)) for g in range(nq_tiles))   # a query CTA's copies (the most)

    def body(q_ref, k_ref, nw_ref, nb_ref, cos_ref, sin_ref, w_ref, p_ref, hp_ref, layer_ref, offset_ref,
             q_out, w_out, k_out, stage, a1, a2, q8_s, w_s, k_s, cs, sn, p_s, hp_s, _exclusive, bar):
        cta = lax.axis_index("g")
        row_in_tile = plgpu.broadcasted_iota(jnp.int32, (TILE,), 0, layout=wl.reduce(1))

        def rope(tok):
            """The rows in `stage`, roped as reference.apply_rope in fp32 (bf16 result), then times
            Pᵀ·H and D^-0.5: the rope pairs' split undone and the rows Hadamard-rotated (fp32)."""
            a1[...] = plgpu.load(stage, layout=plgpu.Layout.SMEM_GMEM_COPY((TILE, D), BF16, 64))
            plgpu.commit_smem()
            xs = hw.wgmma_product(a1, p_s, (TILE, D))   # [x1 | x2 | the columns past the rope]
            tables = hw.rope_tables(cs, sn, T, TILE, half)
            a2[:, pl.ds(0, half)], a2[:, pl.ds(half, half)] = hw.rotate(xs[:, :half], xs[:, half:R], tables, tok)
            if D > R:
                a2[:, pl.ds(R, D - R)] = xs[:, R:].astype(BF16)
            plgpu.commit_smem()
            return hw.wgmma_product(a2, hp_s, (TILE, D)) * scale_h

        def rope_loads():   # the rope tables and both matrices: 4 copies on `bar`
            for src, dst in ((cos_ref, cs), (sin_ref, sn), (p_ref, p_s), (hp_ref, hp_s)):
                plgpu.copy_gmem_to_smem(src, dst, bar)

        for g in range(nq_tiles):
            @pl.when(cta == g)
            def _query_tile(g=g):
                rows = gathers(g)
                if sum(n for _, _, n in rows) < TILE:   # rows past the data: zeros (never stored)
                    stage[...] = jnp.zeros((TILE, D), BF16)
                    plgpu.commit_smem()
                r = 0
                for t, h0, n in rows:    # two TMAs per token: its heads are consecutive rows of q_x, and
                    # consecutive columns of its row of w
                    plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(t * per_row + q_col // D + h0, n)],
                                            stage.at[pl.ds(r, n)], bar)
                    plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(t * w_width + h0, n)], w_s.at[pl.ds(r, n)], bar)
                    r += n
                first, n_rows = g * TILE, min(n_q - g * TILE, TILE)
                rope_loads()
                for _ in range(arrivals - 4 - 2 * len(rows)):   # the barrier counts the busiest tile's copies
                    plgpu.barrier_arrive(bar)
                plgpu.barrier_wait(bar)
                y = rope((row_in_tile + first) // H)   # each row's token: query rows are t·H + h
                # quant.act_quant of the rotated rows: a power-of-two scale per row, folded into w
                # after H^-0.5 · D^-0.5 (the reference's order of the two products)
                sc = pow2_scale(jnp.max(jnp.abs(y), axis=1))
                q8_s[...] = (y / lax.broadcast_in_dim(sc, (TILE, D), [0])).astype(FP8)
                w_s[...] = plgpu.load(w_s, layout=wl.reduce(1), optimized=False) * w_scale * sc
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q8_s.at[pl.ds(0, n_rows)], q_out.at[pl.ds(first, n_rows)])
                plgpu.copy_smem_to_gmem(w_s.at[pl.ds(0, n_rows)], w_out.at[pl.ds(first, n_rows)])
                plgpu.wait_smem_to_gmem(0)

        @pl.when(cta == kt)
        def _key_tile():
            rope_loads()
            # the keys: LayerNorm of their window (as reference.layer_norm) while the tables load
            lay = hw.read_layer(layer_ref, offset_ref)
            stage[...] = jnp.zeros((TILE, D), BF16)
            g_w = nw_ref.at[lay, pl.ds(0, D)][...].astype(F32)
            g_b = nb_ref.at[lay, pl.ds(0, D)][...].astype(F32)
            for t in range(T):
                x = k_ref.at[t, pl.ds(k_col, D)][...].astype(F32)
                xc = x - jnp.sum(x) / D
                y = xc * lax.rsqrt(jnp.sum(xc * xc) / D + eps)
                stage.at[t][...] = (y * g_w + g_b).astype(BF16)
            plgpu.commit_smem()
            for _ in range(arrivals - 4):
                plgpu.barrier_arrive(bar)
            plgpu.barrier_wait(bar)
            k_s[...] = rope(row_in_tile)   # key rows t, rotated as the queries (not quantised)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_s.at[pl.ds(0, T)], k_out)
            plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((TILE, D), BF16),
        plgpu.SMEM((TILE, D), BF16, transforms=TF),
        plgpu.SMEM((TILE, D), BF16, transforms=TF),
        plgpu.SMEM((TILE, D), FP8),
        plgpu.SMEM((TILE,), F32),
        plgpu.SMEM((TILE, D), F32),
        *hw.rope_smem(T, half, D, TF),
        plgpu.Barrier(num_arrivals=arrivals),
    ]
    # Each CTA takes (nearly) all of its SM's shared memory, so no CTA of the kernels running beside it
    # (mla_prep, W_uk's GEMV) shares its SM: the kernel sits on the layer's chain with two CTAs, and
    # one that shares its SM runs twice as long.
    need = hw.smem_bytes(hw.Scope(tuple(scratch), reduces=True))
    scratch.insert(-1, plgpu.SMEM((max(hw.SMEM_BYTES - need - EXCLUSIVE_SLACK, 0),), jnp.uint8))
    hw.check_smem("index_prep kernel", hw.Scope(tuple(scratch), reduces=True), f"{T} tokens × {H} heads")
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((n_q, D), FP8), jax.ShapeDtypeStruct((n_q,), F32),
                  jax.ShapeDtypeStruct((T, D), F32)),
        scratch_types=scratch, grid=(nq_tiles + 1,), grid_names=("g",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interp.params(), kernel_name="jtilert_index_prep",
    )
    p, hp = matrices(D, R, cfg.indexer_rope_interleaved)
    q_rows = q_x.reshape(T * per_row, D)   # a free reshape: the queries as rows of D
    q8, w8, k = kernel(q_rows, k_x, norm_weight, norm_bias, cos.astype(F32), sin.astype(F32),
                       w.astype(F32).reshape(-1), jnp.asarray(p), jnp.asarray(hp), *hw.layer_operands(layer))
    return q8.reshape(T, H, D), w8.reshape(T, H), k
