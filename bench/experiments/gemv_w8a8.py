"""An fp8-activation GEMV for batch-1 decode (W8A8, as DeepSeek's own inference and transformers'
fine-grained fp8 layers compute): does wgmma with both operands e4m3 in shared memory stream the
weights faster than the shipped GEMV, which converts each weight tile to f16 in registers?

x [T ≤ 8, K] is quantised outside the kernel (`quant.act_quant`: one power-of-two scale per token and
128 columns; 2-3 % from bf16 activations), or, for T ≤ 4, as two fp8 halves per token
(`act_quant_hilo`): a bf16 value's 8 significant bits are two 4-bit e4m3 halves, so the halves hold x
exactly (but for elements ~2^-15 below their block's largest), fill wgmma's 8 columns at no extra cost,
and the product is the bf16-activation GEMV's up to the order of the fp32 sums. Each CTA owns 64 output rows and the whole K: the tokens' fp8 rows [8, K] go to shared
memory once, the weights stream through a TMA pipeline in the checkpoint layout, and every 128-column
block is one chain of four m64n8k32 wgmmas into a scratch accumulator whose sums are then scaled by
x's block scale (per token) times the weights' block scale and added to the running sums (the
promotion DeepGEMM does). A short N (x_proj's 2240 rows: 35 row blocks) splits K over more CTAs,
whose partial sums XLA adds. Not wired into the model: this measures the kernel alone.

The shipped GEMV's default engine for fp8 weights, "fp8x2", is the two-halves form with x split inside
the kernel (per CTA slice, after the first weight tile arrives); it is timed here as "shipped", its f16
engine as "shipped_wgmma". The difference between w8a8_hilo and "shipped" is x's preparation in the kernel.

    python -m bench.experiments.gemv_w8a8 --out gemv_w8a8.json      (GPU)
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.ops.quant import BLOCK, act_quant
from jtilert.pallas import _hopper as hw

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
ROWS, STEP, TOKENS = 64, 256, 8   # output rows per CTA, K per pipeline step, B's rows


def reference(x, w, w_scale):
    """y = Σ_blocks (x_q · w_q) · x_scale · w_scale in fp32, x quantised by `act_quant` ([T, N] bf16)."""
    xq, xs = act_quant(x)
    t, k = x.shape
    n = w.shape[0]
    nb = k // BLOCK
    xb = xq.astype(F32).reshape(t, nb, BLOCK)
    wb = w.astype(F32).reshape(n, nb, BLOCK)
    part = jnp.einsum("tbk,nbk->tnb", xb, wb, precision=lax.Precision.HIGHEST)
    ws = jnp.repeat(w_scale, BLOCK, axis=0)[:n]                     # [N, nb]
    return jnp.einsum("tnb,tb,nb->tn", part, xs, ws, precision=lax.Precision.HIGHEST).astype(BF16)


def linear_w8a8(xq, xs, w, w_scale, *, halves: int = 1, stages: int = 4, split: int | None = None,
                cluster_sum: bool = False):
    """xq [H·T, K] fp8 and its scales xs [H·T, K / 128] (`act_quant`, or `act_quant_hilo` with H = 2
    halves: row h·T + t is token t's half h, and the result sums a token's halves), w [N, K] fp8 with
    128-block scales → [T, N] bf16. K a multiple of 256, N of 64. `split` CTAs share a row block's K
    (None: double it while the grid stays within two CTAs per SM and each K slice keeps 1024 columns);
    their fp32 partial sums are added by XLA, or with `cluster_sum` inside the kernel: the split CTAs of
    a row block are one cluster, each leaves its partial sums in its shared memory, and after a cluster
    barrier the first reads the others' through distributed shared memory, adds them and stores the
    row block (a second barrier keeps the others' shared memory alive until it has)."""
    rows, k = xq.shape
    t = rows // halves
    n = w.shape[0]
    if rows % halves or rows > TOKENS or k % STEP or n % ROWS:
        raise ValueError(f"gemv_w8a8: T ≤ {TOKENS}, K % {STEP}, N % {ROWS}; got x {xq.shape}, w {w.shape}")
    if split is None:
        split = 1
        while n // ROWS * split * 2 <= 2 * hw.num_sms() and k % (2 * split * STEP) == 0 and k // (2 * split) >= 1024:
            split *= 2
    if cluster_sum and not 1 < split <= 8:
        raise ValueError(f"gemv_w8a8: cluster_sum needs a split of 2..8 CTAs (a portable cluster), got {split}")
    if k % (split * STEP):
        raise ValueError(f"gemv_w8a8: K={k} does not split into {split} slices of whole {STEP}-column steps")
    kc = k // split
    steps = kc // STEP
    stages = min(stages, steps)
    out_dtype = BF16 if split == 1 or cluster_sum else F32
    tiles = (plgpu.TilingTransform((8, BLOCK)), plgpu.SwizzleTransform(128))   # 128 fp8 = one swizzle row

    def kernel(xq_gmem, xs_gmem, w_gmem, ws_gmem, out_gmem, xq_smem, o_smem, bar, *cluster):
        n_idx, s_idx = lax.axis_index("n"), lax.axis_index("s")
        row0 = n_idx * ROWS
        rb = row0 // BLOCK
        blk0 = s_idx * (kc // BLOCK)          # the slice's first 128-column block
        plgpu.copy_gmem_to_smem(xq_gmem.at[:, pl.ds(s_idx * kc, kc)], xq_smem, bar.at[0])
        col_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (ROWS, TOKENS), 1), plgpu.Layout.WGMMA)
        zeros = jnp.where(col_id < 0, 1.0, 0.0).astype(F32)
        with jax.named_scope("x_wait"):
            plgpu.barrier_wait(bar.at[0])

        def factor(blk):
            """[64, 8] in the accumulator's layout: column c holds x's scale of token c times the
            weights' scale, for 128-column block `blk`."""
            ws = ws_gmem[rb, blk]
            f = zeros
            for row in range(rows):
                f = jnp.where(col_id == row, xs_gmem[row, blk] * ws, f)
            return f

        @hw.phase("step")
        def body(idx, w_smem, acc):
            (step,) = idx

            def blocks(tmp0, tmp1):
                for h, tmp in enumerate((tmp0, tmp1)):
                    col = pl.multiple_of((step * 2 + h) * BLOCK, BLOCK)
                    plgpu.wgmma(tmp, w_smem.at[:, pl.ds(h * BLOCK, BLOCK)], xq_smem.at[:, pl.ds(col, BLOCK)].T)
                plgpu.wgmma_wait(0)
                return tmp0[...], tmp1[...]
            p0, p1 = pl.run_scoped(blocks, plgpu.ACC((ROWS, TOKENS), F32), plgpu.ACC((ROWS, TOKENS), F32))
            return acc + p0 * factor(blk0 + step * 2) + p1 * factor(blk0 + step * 2 + 1)

        spec = plgpu.BlockSpec((ROWS, STEP), lambda s: (n_idx, s_idx * steps + s), transforms=tiles)
        acc = plgpu.emit_pipeline(body, grid=(steps,), in_specs=[spec], max_concurrent_steps=stages,
                                  init_carry=zeros)(w_gmem)
        def sums(tok):   # a token's columns: its halves
            mine = functools.reduce(jnp.logical_or, [col_id == h * t + tok for h in range(halves)])
            return jnp.sum(jnp.where(mine, acc, 0.0), axis=1)

        with jax.named_scope("epilogue"):
            if not cluster_sum:
                for tok in range(t):
                    o_smem.at[tok][...] = sums(tok).astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, t)], out_gmem.at[s_idx, :, pl.ds(row0, ROWS)])
                plgpu.wait_smem_to_gmem(0)
                return
            parts, cbar = cluster   # one [64] buffer per token: Mosaic maps whole buffers into the cluster
            for tok in range(t):
                parts[tok][...] = sums(tok)
            # commit_smem's warpgroup barrier orders every thread's stores before the arrive; Mosaic's
            # remote arrive is mbarrier.arrive at its default (release, CTA scope), so whether the
            # first CTA then reads the others' partials is what the GPU run's error tells
            plgpu.commit_smem()
            plgpu.barrier_arrive(cbar.at[0])      # this CTA's partials are in place
            plgpu.barrier_wait(cbar.at[0])        # and so are the others'

            @pl.when(s_idx == 0)
            def _():
                for tok in range(t):
                    total = sums(tok)
                    for j in range(1, split):
                        total = total + plgpu.cluster_ref(parts[tok], {"s": j})[...]
                    o_smem.at[tok][...] = total.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, t)], out_gmem.at[:, pl.ds(row0, ROWS)])
                plgpu.wait_smem_to_gmem(0)

            plgpu.barrier_arrive(cbar.at[1])      # the first CTA has read every partial
            plgpu.barrier_wait(cbar.at[1])

    xq8 = jnp.pad(xq, ((0, TOKENS - rows), (0, 0)))
    scratch = [plgpu.SMEM((TOKENS, kc), FP8, transforms=tiles), plgpu.SMEM((TOKENS, ROWS), out_dtype),
               plgpu.Barrier(num_barriers=1)]
    if cluster_sum:
        call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((t, n), BF16), grid=(n // ROWS,), grid_names=("n",),
                            cluster=(split,), cluster_names=("s",),
                            scratch_types=scratch + [[plgpu.SMEM((ROWS,), F32) for _ in range(t)],
                                                     plgpu.ClusterBarrier(collective_axes=("s",), num_barriers=2)],
                            interpret=_interp.params(), kernel_name="jtilert_gemv_w8a8_cluster")
        return call(xq8, xs.astype(F32), w, w_scale.astype(F32))
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((split, t, n), out_dtype), grid=(n // ROWS, split),
                        grid_names=("n", "s"), scratch_types=scratch, interpret=_interp.params(),
                        kernel_name="jtilert_gemv_w8a8")
    out = call(xq8, xs.astype(F32), w, w_scale.astype(F32))
    return out[0] if split == 1 else out.sum(0).astype(BF16)


def act_quant_hilo(x):
    """x [T, K] as two fp8 halves per token, rows [hi; lo] ([2T, K], scales [2T, K / 128]): hi is
    `act_quant(x)` (4 significant bits, rounded), lo the rest quantised with a 16× finer power-of-two
    scale; hi·s + lo·s/16 = x for bf16 x (8 significant bits), but for elements about 2^-15 below
    their block's largest (hi subnormal: x/s < 2^-6). For T ≤ 4 both halves fit wgmma's 8 columns."""
    hi, s = act_quant(x)
    t, k = x.shape
    # The barrier keeps XLA from folding f32 → e4m3 → f32 into the identity (on the GPU the lo half
    # came out zero without it, suspected: XLA's excess-precision simplification of convert pairs)
    hi_f = lax.optimization_barrier(hi).astype(F32)
    rest = x.astype(F32).reshape(t, -1, BLOCK) - hi_f.reshape(t, -1, BLOCK) * s[..., None]
    s_lo = s / 16
    lo = (rest / s_lo[..., None]).astype(FP8).reshape(t, k)
    return jnp.concatenate([hi, lo]), jnp.concatenate([s, s_lo])


def w8a8(x, w, w_scale):
    """act_quant (one XLA fusion) then the kernel: x's error is fp8's (≈ 2^-4 per element)."""
    return linear_w8a8(*act_quant(x), w, w_scale)


def w8a8_hilo(x, w, w_scale):
    """act_quant_hilo (one XLA fusion) then the kernel with two halves per token: bf16 activations'
    numerics."""
    return linear_w8a8(*act_quant_hilo(x), w, w_scale, halves=2)


def w8a8_split2(x, w, w_scale):
    """w8a8 with two CTAs per row block, XLA adding their partial sums."""
    return linear_w8a8(*act_quant(x), w, w_scale, split=2)


def w8a8_cluster2(x, w, w_scale):
    """The same two CTAs as one cluster, adding their partial sums in the kernel."""
    return linear_w8a8(*act_quant(x), w, w_scale, split=2, cluster_sum=True)


def main(argv=None) -> int:  # pragma: no cover - GPU only
    from bench.kernels import time_gemv_forms
    from jtilert.pallas import gemv
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_w8a8.json")
    ap.add_argument("--only", default="w8a8,w8a8_hilo,w8a8_split2,w8a8_cluster2,shipped,shipped_wgmma",
                    help="the forms timed")
    a = ap.parse_args(argv)
    wgmma = gemv.GemvConfig(engine="wgmma")
    forms = {"w8a8": w8a8, "w8a8_hilo": w8a8_hilo, "w8a8_split2": w8a8_split2, "w8a8_cluster2": w8a8_cluster2,
             "shipped": gemv.linear,
             "shipped_wgmma": lambda x, w, s: gemv.linear(x, w, s, config=wgmma)}

    def own_error(x, w, s, exact):
        """w8a8 against its own reference (x quantised the same way) as well."""
        want = np.asarray(reference(x, w, s), np.float64)
        got = np.asarray(jax.jit(w8a8)(x, w, s), np.float64)
        return dict(rel_err_w8a8_reference=float(np.linalg.norm(got - want) / np.linalg.norm(want)))

    time_gemv_forms({k: v for k, v in forms.items() if k in a.only.split(",")}, a.out, extra=own_error)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
