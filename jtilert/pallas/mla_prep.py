"""MLA's glue between the projections and the attention kernels, one launch per layer (Pallas
Mosaic-GPU): rope on each head's q_pe (the last rope columns of its qk_head_dim columns of q_x), the
kv_a latent's RMSNorm, rope on k_pe, and both rows written in place into the stacked bf16 caches
at [layer, start + t]. Contract of `jtilert.ops.reference.mla_prep`.

One CTA of one warpgroup. The rope rows (T·H query heads, then T key rows, R values each) are
gathered by TMA into 64-row tiles; the interleaved pairs (2i, 2i+1) are split into [evens | odds]
by a wgmma with a 0/1 permutation matrix (each output one input times 1 plus zeros: exact), rotated
in fp32 as the reference does, rounded to bf16 and interleaved back by a second permutation wgmma;
query rows go to q_pe by TMA, key rows into the pe cache. The latent is read from its window of the
projection's output, normed in registers and stored into the kv cache row directly. q_x and kv_x
are the merged GEMVs' whole outputs (read in place), the caches whole stacks (aliased).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.pallas import _hopper as hw
from jtilert.pallas._hopper import BF16, F32

TILE = 64          # wgmma M: rope rows per tile
MAX_TOKENS = 4     # decode / MTP verify (the op table runs the reference for prefill chunks)
# rope tiles: 32 columns of 64 bytes per swizzle row, so the [evens | odds] halves are whole tiles
ROPE_TF = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))


def unsupported(tokens: int, heads: int, qk_head_dim: int, rope: int, lat: int, q_width: int, kv_width: int,
                kv_cache, pe_cache, dtype=BF16) -> str | None:
    """Why `mla_prep` cannot run the kernel (None: it can): bf16 activations and caches, rope rows of
    128-byte multiples (the TMA row copies), a latent of 128-value multiples (one register row per token)."""
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens (at most {MAX_TOKENS})"
    if dtype != BF16:
        return f"activations {jnp.dtype(dtype).name}, the kernel takes bfloat16"
    if pe_cache is None:
        return "the fp8 packed latent cache (its reference writes it)"
    if kv_cache.dtype != BF16 or pe_cache.dtype != BF16:
        return f"caches {kv_cache.dtype} / {pe_cache.dtype}, the kernel writes bfloat16"
    if rope % 64:
        return f"rope dim {rope}: rows of 128-byte multiples (a multiple of 64) are needed"
    if lat % 128:
        return f"kv_lora_rank={lat} is not a multiple of 128"
    if q_width % 8 or kv_width % 8:
        return f"projection outputs of width {q_width} / {kv_width} (TMA rows: multiples of 8)"
    if qk_head_dim < rope:
        return f"qk_head_dim={qk_head_dim} < rope dim {rope}"
    return None


def mla_prep(q_x, kv_x, kv_col: int, heads: int, qk_head_dim: int, norm_weight, eps: float, cos, sin,
             kv_cache, pe_cache, start, *, layer):
    """Drop-in for `jtilert.ops.reference.mla_prep` with stacked caches [L, S, ...] and norm weight
    [L, lat], `layer` a `jtilert.ops.layer.Layer` or an int32 scalar (may be traced): q_x [T, Wq]
    (head h's q at columns h·qk_head_dim.., its rope part last), kv_x [T, Wx] (kv_a at columns
    kv_col.., latent then rope), cos / sin [T, R/2] fp32, start (int32 scalar: the cache row of token
    0) → (q_pe [T, H, R] bf16, kv_cache, pe_cache), the caches updated in place. Shapes `unsupported`
    names raise ValueError."""
    T = q_x.shape[0]
    half = cos.shape[-1]
    R, lat = 2 * half, norm_weight.shape[-1]
    why = unsupported(T, heads, qk_head_dim, R, lat, q_x.shape[-1], kv_x.shape[-1], kv_cache, pe_cache,
                      q_x.dtype if q_x.dtype == kv_x.dtype else kv_x.dtype)
    if why is None and (kv_cache.ndim != 3 or pe_cache.ndim != 3 or norm_weight.ndim != 2):
        why = f"caches {kv_cache.shape} / {pe_cache.shape}: layer stacks [L, S, ...] are needed"
    if why is None and (heads * qk_head_dim > q_x.shape[-1] or kv_col + lat + R > kv_x.shape[-1]):
        why = f"q_x {q_x.shape} / kv_x {kv_x.shape} too narrow for {heads} heads / kv_a at column {kv_col}"
    if why:
        raise ValueError(f"mla_prep kernel: {why}")
    nope = qk_head_dim - R
    S = kv_cache.shape[1]
    n_q = T * heads
    rows = n_q + T
    ntile = pl.cdiv(rows, TILE)

    def body(q_ref, kv_ref, nw_ref, cos_ref, sin_ref, p_ref, pt_ref, start_ref, layer_ref, offset_ref, kvc_ref,
             pec_ref, out_ref, stage, a1, a2, res, cs, sn, p_s, pt_s, bar):
        lay = hw.read_layer(layer_ref, offset_ref)
        first = jnp.clip(start_ref[0], 0, S - T)   # dynamic_update_slice clamps the same way
        if rows % TILE:   # the last tile's rows past the data: zeros (never stored), before the gather
            stage.at[ntile - 1][...] = jnp.zeros((TILE, R), BF16)
            plgpu.commit_smem()
        # the rope rows, the rotation tables and the permutations
        for r in range(rows):
            if r < n_q:
                t, h = divmod(r, heads)
                src = q_ref.at[pl.ds(t, 1), pl.ds(h * qk_head_dim + nope, R)]
            else:
                src = kv_ref.at[pl.ds(r - n_q, 1), pl.ds(kv_col + lat, R)]
            plgpu.copy_gmem_to_smem(src, stage.at[r // TILE, pl.ds(r % TILE, 1)], bar)
        plgpu.copy_gmem_to_smem(cos_ref, cs, bar)
        plgpu.copy_gmem_to_smem(sin_ref, sn, bar)
        plgpu.copy_gmem_to_smem(p_ref, p_s, bar)
        plgpu.copy_gmem_to_smem(pt_ref, pt_s, bar)

        # the latent: RMSNorm of its window of kv_x (as reference.rms_norm), into the kv cache row
        w = nw_ref.at[lay, pl.ds(0, lat)][...].astype(BF16).astype(F32)   # the reference's weight in bf16
        for t in range(T):
            x = kv_ref.at[t, pl.ds(kv_col, lat)][...].astype(F32)
            y = x * lax.rsqrt(jnp.sum(x * x) / lat + eps)
            kvc_ref.at[lay, first + t][...] = (w * y.astype(BF16).astype(F32)).astype(BF16)

        plgpu.barrier_wait(bar)
        wl = plgpu.Layout.WGMMA
        row_in_tile = plgpu.broadcasted_iota(jnp.int32, (TILE,), 0, layout=wl.reduce(1))
        tables = hw.rope_tables(cs, sn, T, TILE, half)
        copy_layout = plgpu.Layout.SMEM_GMEM_COPY((TILE, R), BF16, 64)
        for g in range(ntile):
            a1[...] = plgpu.load(stage.at[g], layout=copy_layout)
            plgpu.commit_smem()

            xs = hw.wgmma_product(a1, p_s, (TILE, R))   # [evens | odds]
            # each row's token: query rows t·H.., then the key rows
            row = row_in_tile + g * TILE
            tok = jnp.where(row < n_q, row // heads, row - n_q)
            # reference.apply_rope (interleaved), in fp32, rounded to bf16
            a2[:, pl.ds(0, half)], a2[:, pl.ds(half, half)] = hw.rotate(xs[:, :half], xs[:, half:], tables, tok)
            plgpu.commit_smem()
            ys = hw.wgmma_product(a2, pt_s, (TILE, R))   # the pairs interleaved again
            if g:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last tile's stores read res
            res[...] = ys.astype(BF16)
            plgpu.commit_smem()
            lo, hi = g * TILE, min(rows, (g + 1) * TILE)
            if lo < n_q:
                n = min(hi, n_q) - lo
                plgpu.copy_smem_to_gmem(res.at[pl.ds(0, n)], out_ref.at[pl.ds(lo, n)])
            for r in range(max(lo, n_q), hi):
                plgpu.copy_smem_to_gmem(res.at[pl.ds(r - lo, 1)],
                                        pec_ref.at[lay, pl.ds(first + r - n_q, 1)])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((ntile, TILE, R), BF16),
        plgpu.SMEM((TILE, R), BF16, transforms=ROPE_TF),
        plgpu.SMEM((TILE, R), BF16, transforms=ROPE_TF),
        plgpu.SMEM((TILE, R), BF16),
        *hw.rope_smem(T, half, R, ROPE_TF),
        plgpu.Barrier(num_arrivals=rows + 4),
    ]
    hw.check_smem("mla_prep kernel", hw.Scope(tuple(scratch), reduces=True), f"{T} tokens × {heads} heads")
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_q, R), BF16),
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interp.params(), kernel_name="jtilert_mla_prep",
    )
    p = hw.pair_split(R, R)   # x · P = [evens | odds]; Pᵀ interleaves them back
    caches = [jax.new_ref(kv_cache), jax.new_ref(pe_cache)]   # written in place (aliased, no copy)
    start = jnp.asarray(start, jnp.int32).reshape(1)
    q_pe = kernel(q_x, kv_x, norm_weight, cos.astype(F32), sin.astype(F32), jnp.asarray(p, BF16),
                  jnp.asarray(p.T, BF16), start, *hw.layer_operands(layer), *caches)
    return q_pe.reshape(T, heads, R), caches[0][...], caches[1][...]
