"""lm head for decode (Pallas Mosaic-GPU): vocab-sharded GEMV with top-k candidates in the epilogue.

logits[t, v] = x[t] · W[v] for this rank's vocab shard W [V, H] (bf16, or fp8 + block scales via
the `gemv` B-folding trick is not needed: the checkpoint's lm head is bf16). Each CTA streams 64
vocab rows through a TMA pipeline into wgmma (rows on M, tokens on N, the token tile streamed next
to the weight tile with TMA's zero fill past T), then keeps only the `k` largest logits of its rows
per token: (value, vocab index) pairs [T, V/64, k]. The full logits row is never written; the last
step (top-k over V/64·k candidates, or argmax) is a small XLA op, and under tensor parallelism the
candidates (not the logits) are what the ranks exchange.

Ties go to the lower vocab index (as `lax.top_k` / `argmax`).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.pallas import _hopper as hw
from jtilert.pallas._hopper import BF16, F32, KGRAIN, MAX_TOKENS, X_TRANSFORMS

NEG = float("-inf")


def lm_head_candidates(x, w, *, k: int = 8, block_k: int = 128, stages: int = 4):
    """x [T, H] bf16 (T ≤ 8), w [V, H] bf16 → (values [T, ceil(V/64), k] fp32, ids [T, ceil(V/64), k]
    int32): the k largest logits of every 64-row vocab block, in descending order."""
    t, hdim = x.shape
    v, h2 = w.shape
    if h2 != hdim or hdim % KGRAIN:
        raise ValueError(f"lm_head: x {x.shape} / w {w.shape}: hidden must match and be a multiple of {KGRAIN}")
    if t > MAX_TOKENS:
        raise ValueError(f"lm_head: at most {MAX_TOKENS} tokens per call, got {t}")
    if not 1 <= k <= 64:
        raise ValueError(f"lm_head: k must be in [1, 64], got {k}")
    if w.dtype != BF16:
        w = w.astype(BF16)
    if x.dtype != BF16:
        x = x.astype(BF16)
    bn = 64
    bk = min(block_k, hdim)
    while hdim % bk:
        bk -= KGRAIN
    steps = hdim // bk
    stages = max(1, min(stages, steps))
    nblk = -(-v // bn)
    w_tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(x_gmem, w_gmem, val_gmem, idx_gmem, val_smem, idx_smem):
        n_idx = lax.axis_index("n")
        row0 = n_idx * bn

        def body(idx, w_smem, x_smem, acc):
            plgpu.wgmma(acc, w_smem, x_smem.T)
            plgpu.wgmma_wait(0)
            return acc

        def run(acc):
            plgpu.emit_pipeline(
                body, grid=(steps,),
                in_specs=[plgpu.BlockSpec((bn, bk), lambda s: (n_idx, s), transforms=w_tr),
                          # rows ≥ T of the token tile are TMA's out-of-bounds zeros
                          plgpu.BlockSpec((MAX_TOKENS, bk), lambda s: (0, s), transforms=X_TRANSFORMS)],
                max_concurrent_steps=stages, init_carry=acc)(w_gmem, x_gmem)
            return acc[...]

        y = pl.run_scoped(run, plgpu.ACC((bn, MAX_TOKENS), F32))
        col_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bn, MAX_TOKENS), 1), plgpu.Layout.WGMMA)
        row_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bn, MAX_TOKENS), 0), plgpu.Layout.WGMMA)
        vocab = row_id + row0
        y = jnp.where(vocab < v, y, NEG)            # rows past V (TMA zero fill) never win
        for tok in range(t):
            cur = jnp.where(col_id == tok, y, NEG)
            for r in range(k):
                m = jnp.max(jnp.max(cur, axis=1), axis=0)
                hit = jnp.where(cur == m, vocab, v + bn)
                i = jnp.min(jnp.min(hit, axis=1), axis=0)   # lowest vocab index among the maxima
                val_smem[tok, r] = m
                idx_smem[tok, r] = i
                cur = jnp.where(vocab == i, NEG, cur)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(val_smem.at[pl.ds(0, t)], val_gmem.at[:, n_idx])
        plgpu.copy_smem_to_gmem(idx_smem.at[pl.ds(0, t)], idx_gmem.at[:, n_idx])
        plgpu.wait_smem_to_gmem(0)

    kp = -(-k // 4) * 4   # TMA rows of ≥ 16 bytes
    scratch = lm_head_scratch(kp)
    hw.check_smem("lm_head kernel", lm_head_smem(kp, bk, stages), f"block_k={bk}, stages={stages}")
    call = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((t, nblk, kp), F32), jax.ShapeDtypeStruct((t, nblk, kp), jnp.int32)),
        grid=(nblk,), grid_names=("n",),
        scratch_types=scratch,
        interpret=_interp.params(), kernel_name="jtilert_lm_head_topk")
    vals, ids = call(x, w)
    return vals[..., :k], ids[..., :k]


def lm_head_scratch(kp: int) -> list:
    """The kernel's scratch: the candidates' values and ids, [8, kp] each."""
    return [plgpu.SMEM((MAX_TOKENS, kp), F32), plgpu.SMEM((MAX_TOKENS, kp), jnp.int32)]


def lm_head_smem(kp: int, block_k: int, stages: int) -> hw.Scope:
    """The kernel's shared memory: its scratch, and inside, the pipeline's weight [64, block_k] and
    token [8, block_k] tiles per stage; the top-k selection reduces outside."""
    pipe = hw.Scope((plgpu.SMEM((stages, 64, block_k), BF16), plgpu.SMEM((stages, MAX_TOKENS, block_k), BF16),
                     plgpu.Barrier(num_barriers=stages)))
    return hw.Scope(tuple(lm_head_scratch(kp)), (pipe,), reduces=True)


def lm_head_topk(x, w, k: int = 8):
    """Top-k logits and vocab ids [T, k] of x · Wᵀ (this shard), without writing the logits."""
    vals, ids = lm_head_candidates(x, w, k=k)
    t = vals.shape[0]
    vals, ids = vals.reshape(t, -1), ids.reshape(t, -1)
    # Candidates are in vocab-block order and sorted within a block, so top_k's lower-position
    # tie-break is the lower vocab index.
    top, pos = lax.top_k(vals, k)
    return top, jnp.take_along_axis(ids, pos, axis=1)


def lm_head_argmax(x, w):
    """Greedy token of this shard: (max logit [T], vocab id [T])."""
    top, ids = lm_head_topk(x, w, k=1)
    return top[:, 0], ids[:, 0]


def reference_topk(x, w, k: int = 8):
    logits = jnp.einsum("th,vh->tv", x.astype(F32), w.astype(BF16).astype(F32))
    return lax.top_k(logits, k)
