"""Hopper (Mosaic-GPU) building blocks shared by the projection kernels (`gemv`, `moe`, `lm_head`):
dtypes and granularities, the token tile's SMEM transforms and register layouts, the weight tiles'
swizzle, the SM count, token chunking, the layer operands of stacked weights, the
power-of-two rescale that puts the f16 B operand in range, the weight stream (`stream_tiles`) and the
fp8 wgmma step; and the shared memory accounting every kernel checks its configuration with (`Scope`,
`smem_bytes`, `check_smem`)."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.ops.layer import Layer

F32, BF16, F16, FP8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn
QBLOCK = 128          # fp8 block-scale granularity (both dims)
KGRAIN = 64           # K granularity: one 128-byte swizzle row of bf16
MAX_TOKENS = 8        # wgmma N: tokens per kernel call
SMEM_BYTES = 227 * 1024   # shared memory per block on the H200 (and Mosaic's bound without a GPU)
# the most a block may take for two blocks to share an SM (228 KB per SM, 1 KB of it reserved per block)
SMEM_HALF_SM = 113 * 1024

# Register layout for the [8, 64·m] token tile in SMEM (tiling (8, 64), 128-byte swizzle): each
# warp owns two rows, each lane four consecutive bf16 of a row, so one wavefront covers one
# 128-byte row and the transfer is free of bank conflicts.
X_LAYOUT = plgpu.Layout.TILED(plgpu.Tiling(((8, 64), (2, 64), (4,))),
                              warp_dims=(-5,), lane_dims=(-3, -2), vector_dim=-1)
X_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# The e4m3 token tile [8, 128·m] (wgmma's B with e4m3 weights), written from X_LAYOUT registers
X8_TRANSFORMS = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))


def token_chunks(x, fn):
    """fn(chunk, rows) over x [..., K] in chunks of ≤ MAX_TOKENS tokens, the results (an array, or a
    pytree of arrays of one row per token) concatenated."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    outs = [fn(x2[i:i + MAX_TOKENS], slice(i, i + MAX_TOKENS)) for i in range(0, x2.shape[0], MAX_TOKENS)]
    y = outs[0] if len(outs) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *outs)
    return jax.tree.map(lambda a: a.reshape(*lead, a.shape[-1]), y)


def phase(name: str):
    """Decorator: the function's kernel code in `jax.named_scope(name)`, a range of Mosaic's on-device
    profile where one is collected (CompilerParams.profile_space; bench/cta_profile.py) and nothing
    otherwise."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with jax.named_scope(name):
                return fn(*args, **kwargs)
        return run
    return wrap


def stream_tiles(body, *, steps: int, stages: int, tiles, shape, dtype, transforms, carry, first=None):
    """An input pipeline over `steps` steps, `stages` tiles in flight (Pallas' emit_pipeline, one
    barrier per slot), that runs `first()` after it has asked for its first tiles and before it waits
    for them: work that needs no weight tile (the token tile's preparation, the norm's sum of squares)
    then overlaps their arrival. tiles[j](step) is the GMEM view of input j's tile at `step` (every
    tile `shape`, `dtype`, stored with `transforms`); body(step, *tile_refs, carry) -> carry runs once the
    step's tiles have landed and must be done reading them when it returns (a step's slot is
    refilled with step + stages right after). Returns (first()'s result, the last carry)."""
    stages = min(stages, steps)
    bufs = [plgpu.SMEM((stages, *shape), dtype, transforms=transforms) for _ in tiles]

    def scoped(*refs):
        smems, bar = refs[:-1], refs[-1]

        def fetch(step, slot):
            for tile, smem in zip(tiles, smems):
                plgpu.copy_gmem_to_smem(tile(step), smem.at[slot], bar.at[slot])

        for s in range(stages):
            fetch(s, s)
        head = first() if first is not None else None

        def loop(step, c):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(bar.at[slot])
            c = body(step, *[smem.at[slot] for smem in smems], c)

            @pl.when(step + stages < steps)
            def _():
                fetch(step + stages, slot)
            return c
        return head, lax.fori_loop(0, steps, loop, carry)

    return pl.run_scoped(scoped, *bufs, plgpu.Barrier(num_arrivals=len(tiles), num_barriers=stages))


def layer_operands(layer) -> list:
    """A layer (`jtilert.ops.layer.Layer`, or an integer scalar; may be traced) as a kernel's two int32
    [1] inputs, base and offset, which the kernel adds on the device (`read_layer`) and steers its
    weight TMA with, so a stack [L, ...] is never sliced outside; [] for None (no stack)."""
    return [] if layer is None else list(Layer.of(layer).operands())


def read_layer(base_ref, offset_ref):
    """The layer index a kernel reads from its two `layer_operands` refs: base + offset."""
    return base_ref[0] + offset_ref[0]


def weight_transforms(block_k: int, itemsize: int):
    """SMEM transforms of a [rows, block_k] weight tile (the widest swizzle ≤ 128 bytes) and the
    columns of one swizzle row (`sub`, ≤ one 128-wide scale block for fp8)."""
    swizzle = min(128, block_k * itemsize)
    sub = swizzle // itemsize
    return (plgpu.TilingTransform((8, sub)), plgpu.SwizzleTransform(swizzle)), sub


def x_col_layout(cols: int, itemsize: int):
    """`w_layout(cols, itemsize)` with the rows reduced away: the x values each lane multiplies."""
    vec = 16 // itemsize
    chunks = cols // vec
    return plgpu.Layout.TILED(plgpu.Tiling(((cols,), (vec,))), warp_dims=(plgpu.Replicated(4),),
                              lane_dims=(plgpu.Replicated(32 // chunks), -2), vector_dim=-1)


def w_layout(cols: int, itemsize: int):
    """Register layout of a [64, cols] weight tile (one 16-byte vector per lane, 128-byte rows)
    for CUDA-core FMAs: warp w holds rows 16w..16w+15; within a warp the lanes cover
    32·16/(cols·itemsize) rows × (cols·itemsize/16) 16-byte chunks, repeated down the slab."""
    vec = 16 // itemsize
    chunks = cols // vec
    rows = 32 // chunks
    return plgpu.Layout.TILED(plgpu.Tiling(((64, cols), (16, cols), (rows, cols), (vec,))),
                              warp_dims=(-7,), lane_dims=(-3, -2), vector_dim=-1)


# ---- shared memory, counted as Mosaic-GPU counts it ---------------------------------------------
#
# Mosaic (jax 0.11.2) places every SMEM buffer on a 1 KiB boundary; buffers of one allocation
# (the kernel's scratch_types, one `pl.run_scoped`, one `emit_pipeline`'s stage buffers) add up,
# allocations opened one after another inside it take the largest's room, a scope with a
# cross-lane reduction (jnp.sum / jnp.max of a register array) reserves
# `CompilerParams.reduction_scratch_bytes` for it, and every barrier takes 8 bytes after the
# buffers. A kernel whose total exceeds SMEM_BYTES fails to lower ("exceeds available shared
# memory"), so the kernels check their configuration with this count before they are built.

SMEM_ALIGN = 1024
REDUCTION_SMEM = 128 * 4 * 4    # plgpu.CompilerParams().reduction_scratch_bytes
BARRIER_BYTES = 8


@dataclasses.dataclass(frozen=True)
class Scope:
    """One SMEM allocation of a kernel: `buffers` (plgpu.SMEM / plgpu.Barrier types, or lists of them,
    as passed to plgpu.kernel or pl.run_scoped), `inner`: the allocations opened one after another inside it,
    `reduces`: whether a cross-lane reduction runs in it (outside the inner ones)."""

    buffers: tuple = ()
    inner: tuple = ()
    reduces: bool = False


def _count(scope: Scope) -> tuple[int, int]:
    data = barriers = 0
    for b in jax.tree.leaves(list(scope.buffers), is_leaf=lambda b: not isinstance(b, (list, tuple))):
        if isinstance(b, (plgpu.Barrier, plgpu.ClusterBarrier)):
            n = b.num_barriers
            barriers += n if isinstance(n, int) else math.prod(n)
        else:
            data += -(-math.prod(b.shape) * jnp.dtype(b.dtype).itemsize // SMEM_ALIGN) * SMEM_ALIGN
    inner = [_count(s) for s in scope.inner]
    data += max([REDUCTION_SMEM if scope.reduces else 0] + [d for d, _ in inner])
    # sibling scopes may share a barrier of the same kind in Mosaic: counting them all is an upper bound
    return data, barriers + sum(b for _, b in inner)


def smem_bytes(scope: Scope) -> int:
    """Shared memory (bytes) a kernel allocating `scope` needs."""
    data, barriers = _count(scope)
    return -(-data // SMEM_ALIGN) * SMEM_ALIGN + BARRIER_BYTES * barriers


def check_smem(kernel: str, scope: Scope, what) -> int:
    """smem_bytes(scope), or a ValueError naming `kernel` and `what` (its configuration) if it does
    not fit: the kernel would fail to lower."""
    need = smem_bytes(scope)
    if need > SMEM_BYTES:
        raise ValueError(f"{kernel}: {what} needs {need} B of shared memory (> {SMEM_BYTES})")
    return need


def num_sms() -> int:
    if _interp.active():
        return 8
    try:
        return jax.devices()[0].core_count
    except Exception:  # noqa: BLE001
        return 132


def _log2_amax(abs_tiles):
    """floor(log2 max) over elementwise |x| tiles, approximately (the log2 may be off by one)."""
    m = None
    for a in abs_tiles:
        m = a if m is None else jnp.maximum(m, a)
    amax = jnp.maximum(jnp.max(jnp.max(m, axis=1), axis=0), 1e-30)
    return lax.round(jnp.log2(amax) - 0.5)


def f16_range_factor(abs_tiles):
    """Power of two f with max|B|·f in 2^13..2^15 (f16 keeps bf16's 8 mantissa bits for every
    element that matters), from elementwise |B| tiles; the epilogue multiplies by 1/f."""
    # max|B| ≤ 2^15 even if the approximate log2 is off by one.
    return jnp.exp2(13.0 - _log2_amax(abs_tiles))


def store_fp8_pair(dest, tile, n: int):
    """x as two e4m3 halves: hi = x/s into dest(0, b) and the rest at s/16 into dest(1, b), for the
    f32 X_LAYOUT tiles tile(0..n-1) of x's columns (tile(b) is called twice: once for the scale, once
    to store) and dest(half, b) an e4m3 SMEM view of the tile's shape (X8_TRANSFORMS). One power of
    two s with max|x|/s in 2^5..2^8 (≤ 448, e4m3's largest, even if the approximate log2 is off by
    one); hi·s + lo·s/16 = x for bf16 x (8 significant bits), but for elements more than about 2^-11
    below the largest (hi subnormal), whose error stays below s·2^-14. Returns s."""
    s = jnp.exp2(_log2_amax(jnp.abs(tile(b)) for b in range(n)) - 6.0)
    for b in range(n):
        v = tile(b)
        hi = (v * (1.0 / s)).astype(FP8)
        dest(0, b)[...] = hi
        dest(1, b)[...] = ((v - hi.astype(F32) * s) * (16.0 / s)).astype(FP8)
    return s


PAIR_COLS = 2 * MAX_TOKENS   # wgmma N of the fp8x2 engines: x's hi rows 0..7, lo rows 8..15


def pair_operand(kc: int):
    """SMEM type of x's two e4m3 halves over a K slice of kc columns: [16, kc], hi of token t in row t,
    lo in row 8 + t (`store_fp8_pair` with `pair_rows`), one wgmma B operand of N = 16."""
    return plgpu.SMEM((PAIR_COLS, kc), FP8, transforms=X8_TRANSFORMS)


def pair_rows(xb, width: int):
    """`store_fp8_pair`'s destination in a `pair_operand` buffer: half h of column tile b."""
    return lambda h, b: xb.at[pl.ds(h * MAX_TOKENS, MAX_TOKENS), pl.ds(b * width, width)]


def wgmma_fp8_pair_step(acc, w_smem, xb, col, factors, *, nsub: int, sub: int):
    """acc + Σ_h (w_h · [hi; lo]_h) · factors[h] for one pipeline step of e4m3 weights and x's halves
    in xb (`pair_operand`): w_h the step's sub-block h (`sub` columns, one scale block), one N = 16
    wgmma per sub-block with both operands from SMEM into a scratch accumulator, then scaled and
    added (the promotion). acc [rows, 16]: column t is token t's hi sum, 8 + t its lo sum
    (`pair_column` combines them)."""
    def blocks(*tmps):
        for h, tmp in enumerate(tmps):
            plgpu.wgmma(tmp, w_smem.at[:, pl.ds(h * sub, sub)], xb.at[:, pl.ds(col + h * sub, sub)].T)
        plgpu.wgmma_wait(0)
        return tuple(t[...] for t in tmps)
    parts = pl.run_scoped(blocks, *[plgpu.ACC(acc.shape, F32) for _ in range(nsub)])
    for part, f in zip(parts, factors):
        acc = acc + part * f
    return acc


def pair_column(acc, col_id, tok):
    """Token `tok`'s sums from a `wgmma_fp8_pair_step` accumulator: its hi column plus its lo column / 16."""
    both = jnp.where(col_id == tok, acc, jnp.where(col_id == tok + MAX_TOKENS, acc * (1.0 / 16.0), 0.0))
    return jnp.sum(both, axis=1)


def wgmma_fp8_step(acc, w_smem, b_of, *, nsub: int, sub: int, a_buf_of=None):
    """acc += Σ_h f16(w_smem[:, h·sub : (h+1)·sub]) · b_of(h) for one pipeline step of fp8 weights.
    The e4m3 tile is converted in registers (one cvt per pair) and fed as wgmma's A from registers
    (GPU: `a_buf_of` None) or through the SMEM double buffer `a_buf_of(h % 2)` (interpret mode,
    whose wgmma reads A only from SMEM)."""
    a_regs = a_buf_of is None
    for h in range(nsub):
        a = w_smem.at[:, pl.ds(h * sub, sub)][...].astype(F16)
        if not a_regs:
            buf = a_buf_of(h % 2)
            buf[...] = a
            plgpu.commit_smem()
            a = buf
        plgpu.wgmma(acc, a, b_of(h))
        if not a_regs:
            plgpu.wgmma_wait(0)


# ---- rope on rows of a tile (the prep kernels) ------------------------------------------------------
# Rope pairs are taken apart and put back by wgmmas with 0/1 matrices (each output one input times 1
# plus zeros: exact), so the rotation runs on whole [rows, half] register tiles in fp32.

def pair_split(d: int, r: int) -> np.ndarray:
    """[d, d] 0/1 matrix P (fp32) with x · P = [x[0:r:2] | x[1:r:2] | x[r:]]: the interleaved rope pairs
    of the first r columns taken apart, the rest as it is; x · Pᵀ puts them back."""
    p = np.eye(d, dtype=np.float32)
    p[:r] = 0
    p[np.arange(0, r, 2), np.arange(r // 2)] = 1
    p[np.arange(1, r, 2), r // 2 + np.arange(r // 2)] = 1
    return p


def rope_smem(tokens: int, half: int, d: int, transforms) -> list:
    """The rope's SMEM in the prep kernels: the cos and sin tables [T, half] fp32 (`rope_tables`), then
    two [d, d] bf16 matrices for wgmma (`pair_split`, and the one that takes the pairs back)."""
    return [plgpu.SMEM((tokens, half), F32), plgpu.SMEM((tokens, half), F32),
            plgpu.SMEM((d, d), BF16, transforms=transforms), plgpu.SMEM((d, d), BF16, transforms=transforms)]


def wgmma_product(a_smem, b_smem, shape) -> jax.Array:
    """a · b (SMEM operands) as fp32 registers of `shape` (one wgmma, waited for)."""
    def run(acc):
        plgpu.wgmma(acc, a_smem, b_smem)
        plgpu.wgmma_wait(0)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, F32))


def rope_tables(cos_smem, sin_smem, tokens: int, rows: int, half: int) -> list[list[jax.Array]]:
    """[[cos rows], [sin rows]]: per token its cos / sin [half] (SMEM [T, half] fp32), broadcast to
    [rows, half] in the wgmma layout."""
    wl = plgpu.Layout.WGMMA
    return [[lax.broadcast_in_dim(plgpu.load(ref.at[t], layout=wl.reduce(0), optimized=False), (rows, half), [1])
             for t in range(tokens)] for ref in (cos_smem, sin_smem)]


def rotate(x1, x2, tables, tok) -> tuple[jax.Array, jax.Array]:
    """`reference.apply_rope` on rows split into pair halves x1, x2 [rows, half] fp32, each row with the
    cos / sin of its token `tok` [rows] (int32, wgmma row layout): (x1·c − x2·s, x2·c + x1·s) in bf16."""
    c, s = tables[0][0], tables[1][0]
    for t in range(1, len(tables[0])):
        pick = lax.broadcast_in_dim(tok == t, x1.shape, [0])
        c, s = jnp.where(pick, tables[0][t], c), jnp.where(pick, tables[1][t], s)
    return (x1 * c - x2 * s).astype(BF16), (x2 * c + x1 * s).astype(BF16)
