"""The fp8 GEMV with the operands swapped: the weights as wgmma's B (N up to 128 output rows per
instruction) and x as A, for batch-1 decode.

The shipped GEMV puts 64 weight rows in wgmma's A and the ≤ 8 tokens in B's 8 columns, so one
instruction covers 64 × 32 weights (fp8) or 64 × 16 (f16 after the conversion in registers), and
a 256-column step is 8 or 16 instructions whose chain, not the HBM stream, sets the step's time
(gemv_bound, gemv_w8a8: the time follows the instruction count). Here a CTA owns `block_n` output
rows as B ([K, block_n], the checkpoint's K-major layout as it is), and A is x: 64 rows of which
the tokens' two e4m3 halves fill 16 (hi in rows 0..7, lo in rows 8..15, `hw.store_fp8_pair`: the
numerics of bf16 activations); a 128-column scale block is 4 instructions for all block_n rows,
into a scratch accumulator whose sums are scaled by the weights' block scale and added (the
promotion).

A's other 48 rows are not used: the rows each instruction reads past a block's 16 are the next
blocks' (x's halves are stored as [16 · blocks + 48, 128], block b at rows 16b..16b+15, and the
instruction for block b reads rows 16b..16b+63), so A costs 2 KB per block instead of 8, and the
accumulator rows ≥ 16 are never read. Output row t is accumulator row t plus row 8 + t over 16,
times x's scale. Split-K CTAs write fp32 partial sums that XLA adds.

    python -m bench.experiments.gemv_swap --out gemv_swap.json      (GPU: against the shipped GEMV)
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.pallas import _hopper as hw
from jtilert.pallas._hopper import BF16, F32, FP8, MAX_TOKENS, QBLOCK, X_LAYOUT, X_TRANSFORMS, X8_TRANSFORMS

A_ROWS = 64          # wgmma's M: x's rows as A
HALF_ROWS = 2 * MAX_TOKENS   # rows of one block's halves in A


@dataclasses.dataclass(frozen=True)
class SwapConfig:
    block_n: int = 128   # output rows per CTA (wgmma's N; ≤ 128: one weight scale row per CTA)
    block_k: int = 128   # K per pipeline step (a multiple of 128)
    stages: int = 4      # TMA pipeline depth
    split_k: int = 0     # CTAs sharing a row block's K; 0: grow while the grid is < 0.7 of the SMs


def _split(cfg: SwapConfig, n: int, k: int, sms: int) -> int:
    if cfg.split_k:
        return cfg.split_k
    blocks, split = -(-n // cfg.block_n), 1
    while (blocks * split < 0.7 * sms and k % (2 * split * cfg.block_k) == 0
           and k // (2 * split) >= 512):
        split *= 2
    return split


def linear(x, w, w_scale, config: SwapConfig = SwapConfig()):
    """x [T ≤ 8, K] bf16, w [N, K] e4m3 with 128×128 block scales w_scale [⌈N/128⌉, K/128] →
    [T, N] bf16 (x · wᵀ with bf16 activations' numerics)."""
    t, k = x.shape
    n = w.shape[0]
    cfg = config
    bn, bk = cfg.block_n, cfg.block_k
    split = _split(cfg, n, k, hw.num_sms())
    if (t > MAX_TOKENS or w.dtype != FP8 or bn not in (64, 128) or bk % QBLOCK
            or k % (split * bk)):
        raise ValueError(f"gemv_swap: T ≤ {MAX_TOKENS}, e4m3 weights, block_n 64 or 128, K slices of "
                         f"whole {bk}-column steps; got x {x.shape}, w {w.dtype}{w.shape}, {cfg}, split {split}")
    kc = k // split
    steps, nsub, nblk = kc // bk, bk // QBLOCK, kc // QBLOCK
    stages = min(cfg.stages, steps)
    out_dtype = BF16 if split == 1 else F32
    w_tr = (plgpu.TilingTransform((8, QBLOCK)), plgpu.SwizzleTransform(128))

    def kernel(x_gmem, w_gmem, ws_gmem, out_gmem, xstage, a_smem, sx_smem, o_smem, bar):
        n_idx, s_idx = lax.axis_index("n"), lax.axis_index("s")
        zero = n_idx * 0                      # a traced 0: the token TMA box may overhang T
        row0 = n_idx * bn
        rb = row0 // QBLOCK
        kb0 = s_idx * nblk                    # the slice's first scale block
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(zero, MAX_TOKENS), pl.ds(s_idx * kc, kc)], xstage, bar.at[0])
        for r in range(HALF_ROWS * nblk, HALF_ROWS * nblk + A_ROWS - HALF_ROWS, MAX_TOKENS):
            # the rows the last blocks' instructions read past the halves: any finite values
            a_smem.at[pl.ds(r, MAX_TOKENS)][...] = plgpu.layout_cast(
                jnp.zeros((MAX_TOKENS, QBLOCK), FP8), X_LAYOUT)

        def body(idx, w_smem, carry):
            (step,) = idx
            acc, scs = carry

            @pl.when(step == 0)
            def _():
                plgpu.barrier_wait(bar.at[0])
                tile = lambda b: plgpu.load(xstage.at[:, pl.ds(b * QBLOCK, QBLOCK)], layout=X_LAYOUT).astype(F32)
                sx_smem[0] = hw.store_fp8_pair(
                    lambda h, b: a_smem.at[pl.ds(b * HALF_ROWS + h * MAX_TOKENS, MAX_TOKENS)], tile, nblk)
                plgpu.commit_smem()

            nxt = tuple(ws_gmem[rb, kb0 + jnp.minimum(step + 1, steps - 1) * nsub + h] for h in range(nsub))

            def blocks(*tmps):
                for h, tmp in enumerate(tmps):
                    a_row = pl.multiple_of((step * nsub + h) * HALF_ROWS, HALF_ROWS)
                    plgpu.wgmma(tmp, a_smem.at[pl.ds(a_row, A_ROWS)], w_smem.at[:, pl.ds(h * QBLOCK, QBLOCK)].T)
                plgpu.wgmma_wait(0)
                return tuple(tmp[...] for tmp in tmps)

            parts = pl.run_scoped(blocks, *[plgpu.ACC((A_ROWS, bn), F32) for _ in range(nsub)])
            for part, sc in zip(parts, scs):
                acc = acc + part * sc
            return acc, nxt

        row_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (A_ROWS, bn), 0), plgpu.Layout.WGMMA)
        zeros = jnp.where(row_id < 0, 1.0, 0.0).astype(F32)
        first = tuple(ws_gmem[rb, kb0 + h] for h in range(nsub))
        spec = plgpu.BlockSpec((bn, bk), lambda s: (n_idx, s_idx * steps + s), transforms=w_tr)
        acc, _ = plgpu.emit_pipeline(body, grid=(steps,), in_specs=[spec], max_concurrent_steps=stages,
                                     init_carry=(zeros, first))(w_gmem)
        sx = sx_smem[0]
        for tok in range(t):   # token t: its hi row plus its lo row / 16
            y = jnp.where(row_id == tok, acc, jnp.where(row_id == tok + MAX_TOKENS, acc * (1.0 / 16.0), 0.0))
            o_smem.at[tok][...] = (jnp.sum(y, axis=0) * sx).astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, t)], out_gmem.at[s_idx, :, pl.ds(row0, bn)])
        plgpu.wait_smem_to_gmem(0)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((split, t, n), out_dtype), grid=(-(-n // bn), split),
        grid_names=("n", "s"),
        scratch_types=[plgpu.SMEM((MAX_TOKENS, kc), BF16, transforms=X_TRANSFORMS),
                       plgpu.SMEM((HALF_ROWS * nblk + A_ROWS - HALF_ROWS, QBLOCK), FP8, transforms=X8_TRANSFORMS),
                       plgpu.SMEM((1,), F32), plgpu.SMEM((MAX_TOKENS, bn), out_dtype),
                       plgpu.Barrier(num_barriers=1)],
        interpret=_interp.params(), kernel_name="jtilert_gemv_swap")
    out = call(x, w, w_scale.astype(F32))
    return out[0] if split == 1 else out.sum(0).astype(BF16)


CONFIGS = {"n128k128": SwapConfig(), "n128k256": SwapConfig(block_k=256),
           "n64k256": SwapConfig(block_n=64, block_k=256)}


def main(argv=None) -> int:  # pragma: no cover - GPU only
    from bench.kernels import time_gemv_forms
    from jtilert.pallas import gemv
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_swap.json")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    a = ap.parse_args(argv)
    forms = {"shipped": gemv.linear}
    for c in a.configs.split(","):
        forms["swap_" + c] = lambda x, w, s, cfg=CONFIGS[c]: linear(x, w, s, cfg)
    time_gemv_forms(forms, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
