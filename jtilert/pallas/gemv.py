"""Block-scaled GEMV for batch-1 decode on Hopper (Pallas Mosaic-GPU).

y[t] = x[t] · Wᵀ for a handful of tokens (T ≤ 8) and W [N, K] in bf16, or in fp8 e4m3 with the
DeepSeek-V3.2 checkpoint's 128×128 fp32 block scales (`jtilert.quant`), with fp32 accumulation.
Fused variants:

* `rmsnorm_linear`: RMSNorm of x inside the GEMV (TileRT's RMSNormProjxWqkvia: norm + the
  concatenated q_a / kv_a projections in one kernel);
* `linear_residual`: residual add in the epilogue;
* `swiglu_pair`: gate and up projections in one pass, `silu(g)·u` in the epilogue (dense MLP and
  shared expert); `swiglu` chains it with the down projection.

How it works. At batch 1 the time is the weight bytes, so the kernel is a weight stream: each CTA
owns `block_n` (64) output rows and a 1/`split_k` share of K. The weights go through a multi-stage
TMA pipeline (`plgpu.emit_pipeline`) in their checkpoint layout ([N, K], rows of K; no repacking,
the HF scale tensor is read as is). Two engines:

* "wgmma" (default): the output rows are wgmma's M side, the tokens its N side (wgmma's minimum N
  is 8, so up to 8 tokens cost the same as one). The B operand is the CTA's K slice of the tokens
  [8, kc] in SMEM (rows ≥ T are TMA's out-of-bounds zeros), built once at pipeline step 0 while
  the first weight tiles are in flight. For fp8 weights the CTA's 128×128 block scales and the
  RMSNorm weight are folded into B, which is stored in f16 after a power-of-two rescale (max|B|
  in 2^13..2^15): B = f16(x·w_norm·s[row block, k block]·2^e). The fp8 tile is then only
  converted e4m3 → f16 in registers (one cvt per pair) and fed to wgmma as A; the epilogue
  multiplies by 2^-e. With the checkpoint's power-of-two scales every product is exact, as in
  the reference's bf16 dequantisation. bf16 weights feed wgmma straight from SMEM.
* "fma": CUDA-core FMAs in fp32 on a [64, 128] register tile (fp8 → f16 → f32 conversions), the
  x slice in SMEM as fp32; used for fp32 weights (the router, at the reference's precision).

The per-token RMS factor rsqrt(mean(x²) + eps) commutes with the projection and is applied to the
accumulator in the epilogue (the reference rounds x·r to bf16 before the weight multiply; here
x·w_norm is rounded instead: both are bf16-rounding-level differences).

With split_k > 1 each CTA writes fp32 partial sums [split_k, P, T, N] and the epilogue (sum,
norm factor, residual, SiLU) runs as one XLA fusion after the kernel. With split_k = 1 the whole
epilogue runs in the kernel and only the bf16 result is written.

Shapes: K must be a multiple of 64 (TMA/swizzle granularity; fp8 K slices whole 128-wide scale
blocks); any N (the last row block reads TMA's zero fill and its stores are clipped); T ≤ 8 per
kernel call (larger T is chunked).

Measured (H200, 2026-11-30, bench/RESULTS.md): correct at every dsv32-tp8-shard shape on the GPU,
but streaming at 38–54 % of the copy bandwidth for the ≥ 4 MB projections. The same grids and
BlockSpecs with an empty body (`bench/kernels.py --only stream`) stream at 91–113 % of the copy rate
(4.7–5.0 µs where this kernel takes 8.4–11.7 µs), so the bytes in flight are not the bound: the
3.5–6.7 µs extra per call is the work around the stream (the token TMA and B build before step 0's
compute, the wgmma wait in every step before the slot is refilled, the epilogue, and for split-K the
separate finishing fusion). `bench/kernels.py --sweep` times split 1 with 8 stages (no finishing
kernel) against the default.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

import jtilert.pallas.interpret as _interp

F32, BF16, F16, FP8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn
QBLOCK = 128          # fp8 block-scale granularity (both dims)
KGRAIN = 64           # K granularity: one 128-byte swizzle row of bf16
MAX_TOKENS = 8        # wgmma N: tokens per kernel call
SMEM_BYTES = 227 * 1024

# Register layout for the [8, 64·m] token tile in SMEM (tiling (8, 64), 128-byte swizzle): each
# warp owns two rows, each lane four consecutive bf16 of a row, so one wavefront covers one
# 128-byte row and the transfer is free of bank conflicts.
X_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((8, 64), (2, 64), (4,))),
                              warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)
X_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64        # output rows per CTA (one warpgroup)
    block_k: int = 256       # K per pipeline step (multiple of 128 for fp8, 64 for bf16)
    split_k: int = 0         # CTAs sharing one row block; 0 = pick from the shape
    stages: int = 4          # TMA pipeline depth (steps in flight)
    engine: str = "auto"     # "fma": CUDA-core FMAs (T ≤ 2); "wgmma": tensor cores; "auto": by T
    a_in_registers: bool | None = None   # wgmma engine, fp8: A from registers (None: GPU yes, interpret no)
    pdl: bool = False        # wgmma engine on a GPU: programmatic dependent launch (see _projection)

    def resolved(self, n: int, k: int, t: int, n_weights: int, w_itemsize: int, sms: int) -> "GemvConfig":
        if k % KGRAIN:
            raise ValueError(f"GEMV kernel: K={k} must be a multiple of {KGRAIN}")
        if self.block_n != 64:
            raise ValueError("GEMV kernel: block_n must be 64 (one warpgroup)")
        engine = self.engine
        if engine == "auto":
            engine = "fma" if w_itemsize == 4 else "wgmma"
        if engine not in ("fma", "wgmma"):
            raise ValueError(f"GEMV kernel: unknown engine {engine!r}")
        kgrains = k // KGRAIN
        row_blocks = -(-n // self.block_n)
        split = self.split_k
        if split <= 0:
            split = 1
            # Grow split-K until the grid about fills the machine, keeping K slices ≥ 512.
            while (row_blocks * split < 0.7 * sms and split < 16 and kgrains % (2 * split) == 0
                   and k // (2 * split) >= 512 and (w_itemsize != 1 or (k // (2 * split)) % QBLOCK == 0)):
                split *= 2
        if kgrains % split:
            raise ValueError(f"GEMV kernel: split_k={split} must divide K/{KGRAIN}={kgrains}")
        kc = k // split
        if w_itemsize == 1 and kc % QBLOCK and split > 1:
            raise ValueError(f"GEMV kernel: fp8 K slices must be whole 128-column scale blocks "
                             f"(K={k}, split_k={split})")
        grain = QBLOCK if (w_itemsize == 1 and kc % QBLOCK == 0) else KGRAIN
        cap = 16384 // (self.block_n * w_itemsize)     # ≤ 16 KB of weights per step and weight
        bk = max(grain, min(self.block_k, kc, cap) // grain * grain)
        while kc % bk:
            bk -= grain
        stages = max(1, min(self.stages, kc // bk))
        a_regs = _interp.a_in_registers() if self.a_in_registers is None else self.a_in_registers
        cfg = dataclasses.replace(self, block_k=bk, split_k=split, stages=stages, engine=engine,
                                  a_in_registers=a_regs)
        smem = cfg.smem_bytes(n_weights, w_itemsize, k)
        if (smem > SMEM_BYTES and self.split_k <= 0 and kgrains % (2 * split) == 0
                and (w_itemsize != 1 or (k // (2 * split)) % QBLOCK == 0)):
            return dataclasses.replace(self, split_k=2 * split).resolved(n, k, t, n_weights, w_itemsize, sms)
        while smem > SMEM_BYTES and cfg.stages > 2:
            cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
            smem = cfg.smem_bytes(n_weights, w_itemsize, k)
        if smem > SMEM_BYTES:
            raise ValueError(f"GEMV kernel: config {cfg} needs {smem} B of shared memory (> {SMEM_BYTES})")
        return cfg

    def smem_bytes(self, n_weights: int, w_itemsize: int, k: int) -> int:
        kc = k // self.split_k
        if self.engine == "fma":
            x = 2 * kc * 4
        else:  # B operand(s) + the bf16 staging buffer (scoped to the prologue, counted in full)
            x = (n_weights if w_itemsize == 1 else 1) * MAX_TOKENS * kc * 2 + MAX_TOKENS * kc * 2
        pipe = self.stages * n_weights * self.block_n * self.block_k * w_itemsize
        abuf = (0 if self.engine == "fma" or self.a_in_registers or w_itemsize == 2
                else n_weights * 2 * self.block_n * min(self.block_k, QBLOCK) * 2)
        out = 2 * n_weights * MAX_TOKENS * self.block_n * 4
        return x + pipe + abuf + out


def _x_col_layout(cols: int, itemsize: int):
    """`_w_layout(cols, itemsize)` with the rows reduced away: the x values each lane multiplies."""
    vec = 16 // itemsize
    chunks = cols // vec
    return plgpu.Layout.TILED(plgpu.Tiling(((cols,), (vec,))), warp_dims=(plgpu.Replicated(4),),
                              lane_dims=(plgpu.Replicated(32 // chunks), -2), vector_dim=-1)


def _w_layout(cols: int, itemsize: int):
    """Register layout of a [64, cols] weight tile (one 16-byte vector per lane, 128-byte rows)
    for the FMA engine: warp w holds rows 16w..16w+15; within a warp the lanes cover
    32·16/(cols·itemsize) rows × (cols·itemsize/16) 16-byte chunks, repeated down the slab."""
    vec = 16 // itemsize
    chunks = cols // vec
    rows = 32 // chunks
    return plgpu.Layout.TILED(plgpu.Tiling(((64, cols), (16, cols), (rows, cols), (vec,))),
                              warp_dims=(-7,), lane_dims=(-3, -2), vector_dim=-1)


def _num_sms() -> int:
    if _interp.active():
        return 8
    try:
        return jax.devices()[0].core_count
    except Exception:  # noqa: BLE001
        return 132


# ---- the epilogue, shared by the kernel (split_k = 1) and the XLA finish (split_k > 1) ----------

def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _finish(cols, *, kind, rms, residual, out_dtype):
    """cols: P fp32 arrays (row sums of one token, or [.., T, N]); rms: per-token factor or None."""
    ys = [c * rms if rms is not None else c for c in cols]
    if kind == "swiglu":
        # The reference rounds both projections to bf16, then computes silu(g)·u in fp32.
        g = ys[0].astype(BF16).astype(F32)
        u = ys[1].astype(BF16).astype(F32)
        return (g * _sigmoid(g) * u).astype(out_dtype)
    if kind == "swiglu_f32":
        # moe_experts' reference keeps g and u in fp32.
        return (ys[0] * _sigmoid(ys[0]) * ys[1]).astype(out_dtype)
    if residual is not None:
        return (ys[0].astype(BF16).astype(F32) + residual.astype(F32)).astype(out_dtype)
    return ys[0].astype(out_dtype)


# ---- the kernel ---------------------------------------------------------------------------------

def _projection(x, ws, scales, *, norm=None, eps=1e-6, residual=None, kind="linear",
                out_dtype=BF16, config: GemvConfig | None = None, ids=None):
    """Core: x [T, K] (T ≤ 8) against P = len(ws) weights [N, K] with shared x; see module doc.

    Expert mode (`ids` int32 [S] given, S a multiple of T): the weights are stacked [E, N, K]
    (scales [E, nb, kb]) and selection i multiplies token i // (S / T) with expert ids[i]; only
    the selected experts' rows are read (the expert id is read on the device and steers the TMA).
    The result is [S, N]."""
    t, k = x.shape
    p = len(ws)
    if ids is not None:
        if ws[0].ndim != 3 or ids.ndim != 1 or ids.shape[0] % t:
            raise ValueError(f"GEMV expert mode: weights {ws[0].shape}, ids {ids.shape}, tokens {t}")
        if norm is not None or residual is not None:
            raise ValueError("GEMV expert mode has no norm prologue / residual epilogue")
        _, n, k2 = ws[0].shape
    else:
        n, k2 = ws[0].shape
    nsel = ids.shape[0] if ids is not None else t
    kper = nsel // t
    tb = 1 if ids is not None else t              # token rows of B that this CTA uses
    if k != k2 or any(w.shape != ws[0].shape or w.dtype != ws[0].dtype for w in ws):
        raise ValueError(f"GEMV kernel: x {x.shape} and weights {[w.shape for w in ws]} do not match")
    if t > MAX_TOKENS or t < 1:
        raise ValueError(f"GEMV kernel: 1..{MAX_TOKENS} tokens per call, got {t}")
    if x.dtype != BF16:
        raise ValueError(f"GEMV kernel: x must be bf16, got {x.dtype}")
    fp8 = ws[0].dtype == FP8
    if ws[0].dtype not in (FP8, BF16, F32):
        raise ValueError(f"GEMV kernel: weights must be bf16, fp8 e4m3 (or fp32, FMA engine), got {ws[0].dtype}")
    if fp8:
        for s, w in zip(scales, ws):
            want = (*w.shape[:-2], -(-w.shape[-2] // QBLOCK), -(-w.shape[-1] // QBLOCK))
            if s is None or s.shape != want:
                raise ValueError(f"GEMV kernel: fp8 weight {w.shape} needs scales {want}, got "
                                 f"{None if s is None else s.shape}")
    itemsize = ws[0].dtype.itemsize
    cfg = (config or GemvConfig()).resolved(n * (nsel if ids is not None else 1), k, t, p, itemsize, _num_sms())
    if itemsize == 4 and cfg.engine != "fma":
        raise ValueError("GEMV kernel: fp32 weights need the FMA engine")
    bn, bk, split, stages = cfg.block_n, cfg.block_k, cfg.split_k, cfg.stages
    fma = cfg.engine == "fma"
    kc = k // split
    steps = kc // bk
    w_swizzle = min(128, bk * itemsize)
    sub = w_swizzle // itemsize          # one swizzle row: ≤ one 128-wide scale block
    nsub = bk // sub
    a_regs = cfg.a_in_registers
    # Programmatic dependent launch: this kernel may start while the previous one finishes; the
    # weight pipeline's first TMAs (weights never depend on earlier kernels) are issued before
    # `griddepcontrol.wait`, the token loads after it. Not in expert mode (the expert ids, made by the
    # router just before, steer the weight loads). GPU only (the interpreter has no grids).
    pdl = cfg.pdl and not fma and ids is None and not _interp.active()
    in_kernel_epilogue = split == 1
    out_rows = 1 if in_kernel_epilogue else p
    o_dtype = out_dtype if in_kernel_epilogue else F32
    row_blocks = -(-n // bn)
    kb_total = -(-k // QBLOCK)
    w_tr = (plgpu.TilingTransform((8, sub)), plgpu.SwizzleTransform(w_swizzle))
    w_layout = _w_layout(sub, itemsize) if fma else None
    x_col_layout = _x_col_layout(sub, itemsize) if fma else None

    def kernel(*refs):
        it = iter(refs)
        x_gmem = next(it)
        ids_gmem = next(it) if ids is not None else None
        w_gmems = [next(it) for _ in range(p)]
        s_gmems = [next(it) for _ in range(p)] if fp8 else [None] * p
        nw_gmem = next(it) if norm is not None else None
        res_gmem = next(it) if residual is not None and in_kernel_epilogue else None
        out_gmem = next(it)
        xb = next(it) if not fma else None
        xstage = next(it) if not fma else None
        invf = next(it) if not fma else None
        xf = next(it) if fma else None
        o_smem, bar = next(it), next(it)
        a_bufs = next(it) if (fp8 and not fma and not a_regs) else None
        res_smem = next(it) if res_gmem is not None else None

        n_idx = lax.axis_index("n")
        s_idx = lax.axis_index("s")
        zero = n_idx * 0                    # a traced 0: TMA boxes may then overhang T
        if ids is not None:
            e_idx = lax.axis_index("e")
            eid = ids_gmem[e_idx]           # the expert: read on the device, steers the weight TMA
            tok0 = e_idx // kper            # the token of this selection
        else:
            e_idx = eid = None
            tok0 = zero

        def scale_at(j, kb):
            return s_gmems[j][eid, srow, kb] if ids is not None else s_gmems[j][srow, kb]
        k0 = s_idx * kc
        row0 = n_idx * bn
        srow = row0 // QBLOCK

        bw = QBLOCK if kc % QBLOCK == 0 else KGRAIN    # B built in 128- (or 64-) column blocks
        nblk = kc // bw

        def load_tokens():
            plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(zero, MAX_TOKENS), pl.ds(k0, kc)], xstage, bar.at[0])
            if res_smem is not None:
                plgpu.copy_gmem_to_smem(res_gmem.at[pl.ds(zero, MAX_TOKENS), pl.ds(row0, bn)], res_smem, bar.at[1])

        def build_b(xstage, svals):
            """B operand(s) for wgmma: the tokens' K slice, [8, kc] (rows ≥ T are TMA's zero fill).
            bf16 weights: B = x (· norm weight) in bf16. fp8 weights: B_j = f16(x · w_norm · s_j[row
            block, k block] · 2^e_j), the block scales of the CTA's row block folded into x (exact
            for the checkpoint's power-of-two scales) and a power of two 2^e_j that puts max|B_j|
            at 2^13..2^15, so f16 keeps x's 8 mantissa bits for every element that matters; the
            epilogue multiplies by 2^-e_j (kept in `invf`). The weights then only need e4m3 → f16
            (one cvt per pair of weights, no fp32 conversions)."""
            plgpu.barrier_wait(bar.at[0])

            def block(b):
                v = plgpu.load(xstage.at[:, pl.ds(b * bw, bw)], layout=X_LAYOUT).astype(F32)
                if nw_gmem is not None:
                    nwv = plgpu.load(nw_gmem.at[pl.ds(k0 + b * bw, bw)], optimized=False).astype(F32)
                    v = v * plgpu.layout_cast(lax.broadcast_in_dim(nwv, (MAX_TOKENS, bw), (1,)), X_LAYOUT)
                return v

            for j in range(p if fp8 else 1):
                if not fp8:
                    for b in range(nblk):
                        xb.at[0, :, pl.ds(b * bw, bw)][...] = block(b).astype(BF16)
                    continue
                m = None
                for b in range(nblk):
                    a = jnp.abs(block(b) * svals[j][b])
                    m = a if m is None else jnp.maximum(m, a)
                amax = jnp.maximum(jnp.max(jnp.max(m, axis=1), axis=0), 1e-30)
                # f ≈ 2^(13 - floor(log2 amax)): max|B| ≤ 2^15 even if the approximate log2 is off by one.
                f = jnp.exp2(13.0 - lax.round(jnp.log2(amax) - 0.5))
                for b in range(nblk):
                    xb.at[j, :, pl.ds(b * bw, bw)][...] = (block(b) * (svals[j][b] * f)).astype(F16)
                invf[j] = 1.0 / f
            plgpu.commit_smem()

        # Prologue: this CTA's slice of the tokens into SMEM.
        if fma:
            # FMA engine: fp32 rows [T, kc] (x · norm weight, rounded to bf16 like the wgmma path).
            for tok in range(tb):
                xr = x_gmem.at[tok0 + tok, pl.ds(k0, kc)][...].astype(F32)
                if nw_gmem is not None:
                    xr = xr * nw_gmem.at[pl.ds(k0, kc)][...].astype(F32)
                xf.at[tok][...] = xr.astype(BF16).astype(F32)
            if res_smem is not None:
                plgpu.copy_gmem_to_smem(res_gmem.at[pl.ds(zero, MAX_TOKENS), pl.ds(row0, bn)], res_smem, bar.at[1])
        else:
            # Issue the token TMA now (with PDL: at step 0, once the kernel that writes x is done); B
            # is built at step 0 of the weight pipeline, whose first `stages` weight tiles are
            # already in flight by then.
            if not pdl:
                load_tokens()
            svals = ([[scale_at(j, (k0 + b * bw) // QBLOCK) for b in range(nblk)] for j in range(p)]
                     if fp8 else None)

        def scales_at(step):
            """Block scales of one pipeline step: [weight][sub-chunk] scalars (loaded a step ahead)."""
            if not fp8:
                return ()
            out = []
            for j in range(p):
                out.append(tuple(scale_at(j, jnp.minimum((k0 + step * bk + h * sub) // QBLOCK, kb_total - 1))
                                 for h in range(nsub)))
            return tuple(out)

        def body_fma(idx, *args):
            w_smems, (accs, scs) = args[:p], args[p]
            (step,) = idx
            nxt = scales_at(step + 1)
            kk = step * bk
            accs = [list(a) for a in accs]
            for h in range(nsub):
                xcols = [plgpu.load(xf.at[tok, pl.ds(kk + h * sub, sub)], layout=x_col_layout, optimized=False)
                         for tok in range(tb)]
                for j in range(p):
                    w = plgpu.load(w_smems[j].at[:, pl.ds(h * sub, sub)], layout=w_layout).astype(F32)
                    for tok in range(tb):
                        xc = xcols[tok] * scs[j][h] if fp8 else xcols[tok]
                        xb = plgpu.layout_cast(lax.broadcast_in_dim(xc, (bn, sub), (1,)), w_layout)
                        accs[j][tok] = accs[j][tok] + w * xb
            return tuple(tuple(a) for a in accs), nxt

        def body_wgmma(idx, *args):
            w_smems, acc_refs = args[:p], args[p]
            (step,) = idx
            kk = step * bk

            @pl.when(step == 0)
            def _():
                if pdl:
                    plgpu.griddepcontrol_wait()   # x (and the residual) come from the previous kernel
                    load_tokens()
                build_b(xstage, svals)

            for j in range(p):
                if not fp8:
                    plgpu.wgmma(acc_refs[j], w_smems[j], xb.at[0, :, pl.ds(kk, bk)].T)
                    continue
                for h in range(nsub):
                    a = w_smems[j].at[:, pl.ds(h * sub, sub)][...].astype(F16)
                    if not a_regs:
                        buf = a_bufs.at[j, h % 2]
                        buf[...] = a
                        plgpu.commit_smem()
                        a = buf
                    plgpu.wgmma(acc_refs[j], a, xb.at[j, :, pl.ds(kk + h * sub, sub)].T)
                    if not a_regs:
                        plgpu.wgmma_wait(0)
            plgpu.wgmma_wait(0)
            return acc_refs

        def pipeline(body, carry):
            return plgpu.emit_pipeline(
                body, grid=(steps,),
                in_specs=[plgpu.BlockSpec((bn, bk), lambda s: (n_idx, s_idx * steps + s), transforms=w_tr)
                          if ids is None else
                          plgpu.BlockSpec((None, bn, bk), lambda s: (eid, n_idx, s_idx * steps + s), transforms=w_tr)
                          for _ in range(p)],
                max_concurrent_steps=stages, init_carry=carry)(*w_gmems)

        if fma:
            zeros = plgpu.layout_cast(jnp.zeros((bn, sub), F32), w_layout)
            accs, _ = pipeline(body_fma, (tuple(tuple(zeros for _ in range(tb)) for _ in range(p)), scales_at(0)))
            cols_of = lambda tok: [jnp.sum(accs[j][tok], axis=1) for j in range(p)]
        else:
            def run(*acc_refs):
                pipeline(body_wgmma, acc_refs)
                if pdl:
                    plgpu.griddepcontrol_launch_dependents()   # the next kernel may start its weight loads
                return tuple(a[...] for a in acc_refs)
            ys = pl.run_scoped(run, *[plgpu.ACC((bn, MAX_TOKENS), F32) for _ in range(p)])
            col_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bn, MAX_TOKENS), 1), plgpu.Layout.WGMMA)

            def cols_of(tok):
                # B holds every token (row r = token r), so accumulator column tok0 + tok is ours.
                cols = [jnp.sum(jnp.where(col_id == tok0 + tok, y, 0.0), axis=1) for y in ys]
                return [c * invf[j] if fp8 else c for j, c in enumerate(cols)]
        if res_smem is not None:
            plgpu.barrier_wait(bar.at[1])

        # Epilogue: one row vector per token.
        for tok in range(tb):
            cols = cols_of(tok)
            if in_kernel_epilogue:
                rms = None
                if norm is not None:
                    xr = x_gmem.at[tok][...].astype(F32)
                    rms = lax.rsqrt(jnp.sum(xr * xr) / k + eps)
                res = res_smem.at[tok][...] if res_smem is not None else None
                o_smem.at[0, tok][...] = _finish(cols, kind=kind, rms=rms, residual=res, out_dtype=o_dtype)
            else:
                for j in range(p):
                    o_smem.at[j, tok][...] = cols[j]
        plgpu.commit_smem()
        orow = pl.ds(e_idx, 1) if ids is not None else slice(None)
        for j in range(out_rows):
            dst = (out_gmem.at[orow, pl.ds(row0, bn)] if in_kernel_epilogue
                   else out_gmem.at[s_idx, j, orow, pl.ds(row0, bn)])
            plgpu.copy_smem_to_gmem(o_smem.at[j, pl.ds(0, tb)], dst)
        plgpu.wait_smem_to_gmem(0)

    if fma:
        scratch = [plgpu.SMEM((tb, kc), F32)]
    else:
        scratch = [plgpu.SMEM((p if fp8 else 1, MAX_TOKENS, kc), F16 if fp8 else BF16, transforms=X_TRANSFORMS),
                   plgpu.SMEM((MAX_TOKENS, kc), BF16, transforms=X_TRANSFORMS),
                   plgpu.SMEM((p,), F32)]
    scratch += [plgpu.SMEM((out_rows, MAX_TOKENS, bn), o_dtype), plgpu.Barrier(num_barriers=2)]
    if fp8 and not fma and not a_regs:
        scratch.append(plgpu.SMEM((p, 2, bn, sub), F16, transforms=X_TRANSFORMS))
    if residual is not None and in_kernel_epilogue:
        scratch.append(plgpu.SMEM((MAX_TOKENS, bn), residual.dtype))
    out_type = (jax.ShapeDtypeStruct((nsel, n), o_dtype) if in_kernel_epilogue
                else jax.ShapeDtypeStruct((split, p, nsel, n), F32))
    grid, names = (row_blocks, split), ("n", "s")
    if ids is not None:
        grid, names = grid + (nsel,), names + ("e",)
    call = plgpu.kernel(kernel, out_type=out_type, grid=grid, grid_names=names,
                        scratch_types=scratch, interpret=_interp.params(),
                        kernel_name=f"jtilert_gemv_{cfg.engine}")
    args = [x] + ([ids.astype(jnp.int32)] if ids is not None else []) + list(ws)
    if fp8:
        args += [s.astype(F32) for s in scales]
    if norm is not None:
        args.append(norm)
    if residual is not None and in_kernel_epilogue:
        args.append(residual)
    out = call(*args)
    if in_kernel_epilogue:
        return out
    part = out.sum(0)                                  # [P, T, N]: one XLA fusion with the epilogue
    rms = None
    if norm is not None:
        x32 = x.astype(F32)
        rms = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return _finish([part[j] for j in range(p)], kind=kind, rms=rms, residual=residual, out_dtype=out_dtype)


def _tokens(x, fn):
    """Apply fn to x [..., K] in chunks of ≤ 8 tokens."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    outs = [fn(x2[i:i + MAX_TOKENS], slice(i, i + MAX_TOKENS)) for i in range(0, x2.shape[0], MAX_TOKENS)]
    y = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return y.reshape(*lead, y.shape[-1])


def _prep_weight(w, scale):
    """bf16 and fp8(+scales) stream as stored; other float weights are rounded to bf16 once
    (what the reference's dequantize(w, None, bf16) does)."""
    if w.dtype == FP8:
        return w, scale
    if scale is not None:
        raise ValueError("block scales only go with fp8 weights")
    return (w if w.dtype == BF16 else w.astype(BF16)), None


# ---- public wrappers (same signatures as jtilert.layers) ----------------------------------------

def linear(x, w, scale=None, *, config: GemvConfig | None = None):
    """jtilert.layers.linear: y = x · Wᵀ, x [..., K] bf16, W [N, K] bf16 or fp8 (+ scale)."""
    w, scale = _prep_weight(w, scale)
    return _tokens(x, lambda xc, _: _projection(xc, (w,), (scale,), config=config))


def linear_residual(x, w, scale, residual, *, config: GemvConfig | None = None):
    """residual + linear(x, w, scale), the add in the epilogue (rounded like the reference)."""
    w, scale = _prep_weight(w, scale)
    res2 = residual.reshape(-1, residual.shape[-1])
    return _tokens(x, lambda xc, sl: _projection(xc, (w,), (scale,), residual=res2[sl],
                                                 out_dtype=residual.dtype, config=config))


def rmsnorm_linear(x, norm_weight, eps, w, scale=None, *, config: GemvConfig | None = None):
    """linear(rms_norm(x, norm_weight, eps), w, scale) in one kernel."""
    w, scale = _prep_weight(w, scale)
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight {norm_weight.shape} does not match x {x.shape}")
    nw = norm_weight.astype(BF16)  # the reference multiplies in x.dtype
    return _tokens(x, lambda xc, _: _projection(xc, (w,), (scale,), norm=nw, eps=eps, config=config))


def swiglu_pair(x, gate, gate_scale, up, up_scale, *, config: GemvConfig | None = None):
    """silu(linear(x, gate)) · linear(x, up) (fp32 math, bf16 result) in one pass over both weights."""
    gate, gate_scale = _prep_weight(gate, gate_scale)
    up, up_scale = _prep_weight(up, up_scale)
    if gate.dtype != up.dtype:
        raise ValueError("gate and up must have the same format")
    return _tokens(x, lambda xc, _: _projection(xc, (gate, up), (gate_scale, up_scale), kind="swiglu",
                                                config=config))


def swiglu(x, gate, gate_scale, up, up_scale, down, down_scale, *, config: GemvConfig | None = None,
           down_config: GemvConfig | None = None):
    """jtilert.layers.swiglu: down(silu(gate(x)) · up(x)) as two kernels (pair, then down)."""
    h = swiglu_pair(x, gate, gate_scale, up, up_scale, config=config)
    return linear(h, down, down_scale, config=down_config)


def reference_rmsnorm_linear(x, norm_weight, eps, w, scale=None):
    from jtilert import layers
    return layers.linear(layers.rms_norm(x, norm_weight, eps), w, scale)


# ---- benchmark entry ----------------------------------------------------------------------------

def _bench():  # pragma: no cover - GPU only
    from jtilert.quant import quantize_weight
    import numpy as np
    from jax.experimental.mosaic.gpu import profiler
    key = jax.random.key(0)
    for (n, k) in [(2112, 7168), (3072, 1536), (7168, 2048), (4608, 7168)]:
        w = jax.random.normal(key, (n, k), F32) * 0.02
        q, s = quantize_weight(w)
        x = jax.random.normal(key, (1, k), F32).astype(BF16)
        f = jax.jit(linear)
        _, times = profiler.measure(f, iterations=50)(x, q, s)
        us = float(np.median(times)) * 1e3
        print(f"fp8 {n}x{k}: {us:.1f} us, {(n * k + n * 4 * k / 16384) / us / 1e3:.2f} TB/s")


if __name__ == "__main__":  # pragma: no cover
    _bench()
