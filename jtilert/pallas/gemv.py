"""Block-scaled GEMV for batch-1 decode on Hopper (Pallas Mosaic-GPU).

y[t] = x[t] · Wᵀ for T ≤ 8 tokens (more are chunked), W [N, K] bf16 or fp8 e4m3 with 128×128 fp32
block scales, fp32 accumulation; fused `rmsnorm_linear`, `linear_residual`, `swiglu_pair`. Each CTA
owns 64 output rows and a 1/split_k share of K, streams its weights by TMA in the checkpoint layout
and prepares x while the first tiles arrive; split-K partials are summed by XLA or by the row
block's CTAs as one cluster (`split_sum`). Engines (`GemvConfig`): "fp8x2", the default for fp8
weights in 128-blocks: x as two e4m3 halves (exact for bf16) in one wgmma B, each block's sums scaled
by its weight and x scales; "wgmma": the block scales folded into an f16 B; "fma": CUDA-core FMAs,
for fp32 weights (the router). `layer=`: stacked weights [L, N, K] addressed on the device by the
layer (`jtilert.ops.layer.Layer`); expert mode (`ids`: `moe`, `heads_linear`) reads the selected
experts' or heads' rows the same way; `prefix`: the kernel reads its window of a wider x (a slice
outside would be a DynamicSliceFusion, which keeps the layer loop out of one CUDA graph). K a
multiple of 64, any N.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import _hopper as hw
from jtilert.pallas._hopper import (BF16, F16, F32, FP8, KGRAIN, MAX_TOKENS, QBLOCK,  # noqa: F401
                                    X_LAYOUT, X_TRANSFORMS)

CLUSTER_MAX = 8   # CTAs in a portable cluster: the most split-K CTAs that can sum in one
SPLIT_ROWS = 64   # the split weights' tile rows (wgmma's M): at most this many splits merged in a kernel


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64        # output rows per CTA (one warpgroup)
    block_k: int = 256       # K per pipeline step, at most (multiple of 128 for fp8, 64 for bf16)
    split_k: int = 0         # CTAs sharing one row block; 0 = pick from the shape
    stages: int = 4          # TMA pipeline depth (steps in flight), at most
    engine: str = "auto"     # "fma": CUDA-core FMAs; "wgmma": tensor cores; "fp8x2": tensor cores on e4m3
                             # weights and x as two e4m3 halves; "auto": fma for fp32 weights, fp8x2 for
                             # fp8 weights (K in whole 128-blocks, whole-block K slices), else wgmma
    a_in_registers: bool | None = None   # wgmma engine, fp8: A from registers (None: GPU yes, interpret no)
    in_flight: int = 0       # wgmma engine, fp8 A from registers: wgmma groups left running into the next step
    split_sum: str = "auto"  # split-K partials summed by "cluster": the split CTAs of a row block as one
                             # cluster, through its distributed shared memory, the epilogue in the kernel
                             # (GPU only, 2..8 splits: one launch fewer); "xla": after the kernel, with
                             # the epilogue; "auto": "cluster" on the GPU where the shape's own split is
                             # 2..8 and the caller prefers it (`cluster_auto`), else "xla"

    def resolved(self, n: int, k: int, t: int, n_weights: int, w_itemsize: int, sms: int, *,
                 layout=None, slice_unit: int | None = None, divides: int | None = None,
                 occupancy: bool = True, cluster_sum: bool = False,
                 cluster_auto: bool = False) -> "GemvConfig":
        """The configuration a kernel runs for N output rows (for the grid), K, T tokens and P
        weights of `w_itemsize` bytes on `sms` SMs, its shared memory within hw.SMEM_BYTES.
        `layout(cfg)`: the kernel's SMEM (`hw.Scope`) under a candidate configuration (default:
        `_projection`'s, linear epilogue); `slice_unit`: the K slices must be multiples of it
        (default: whole 128-column scale blocks for fp8 with split-K, else 64); `divides`: block_k
        must divide it too; `occupancy`: with split_k = 0, grow split-K until the grid about fills
        the machine (else only as far as shared memory needs); `cluster_sum`: the kernel can sum its
        split-K partials in a cluster (else split_sum="cluster" is refused); `cluster_auto`: "auto"
        sums in the cluster where the split chosen for the shape is 2..CLUSTER_MAX and the SMEM fits
        (not the FMA engine, whose few clustered CTAs ran longer in the step than its split summed by
        XLA; the split is never narrowed for it).

        split_k = 0: the occupancy rule's split, or the next larger split that cuts K into valid
        slices, the first whose SMEM fits at the full pipeline depth (the token slice [8, K / split]
        is held whole, so large K needs a larger split); only if none does, fewer stages, then a
        narrower block_k. An explicit split_k is kept (stages, then block_k shrink to fit).
        ValueError if nothing fits."""
        if k % KGRAIN:
            raise ValueError(f"GEMV kernel: K={k} must be a multiple of {KGRAIN}")
        if self.block_n != 64:
            raise ValueError("GEMV kernel: block_n must be 64 (one warpgroup)")
        engine = self.engine
        if engine == "auto":
            engine = ("fma" if w_itemsize == 4 else
                      "fp8x2" if w_itemsize == 1 and k % QBLOCK == 0 and slice_unit is None else "wgmma")
        if engine not in ("fma", "wgmma", "fp8x2"):
            raise ValueError(f"GEMV kernel: unknown engine {engine!r}")
        if engine == "fp8x2" and (w_itemsize != 1 or k % QBLOCK):
            raise ValueError(f"GEMV kernel: engine fp8x2 takes fp8 weights and K a multiple of {QBLOCK}, "
                             f"got {w_itemsize}-byte weights, K={k}")
        layout = layout or functools.partial(projection_smem, k=k, p=n_weights, itemsize=w_itemsize, tb=t)
        kgrains = k // KGRAIN

        def unit(split):
            if slice_unit is not None:
                return slice_unit
            return QBLOCK if (w_itemsize == 1 and split > 1) else KGRAIN

        def valid(split):
            return kgrains % split == 0 and (k // split) % unit(split) == 0

        if self.split_sum not in ("auto", "cluster", "xla"):
            raise ValueError(f"GEMV kernel: unknown split_sum {self.split_sum!r}")
        if self.split_sum == "cluster" and (not cluster_sum or _interp.active()):
            raise ValueError("GEMV kernel: split_sum='cluster' needs the GPU (interpret mode runs no remote "
                             "refs) and a kernel that sums in the cluster (not the partials or MoE down forms)")
        a_regs = _interp.a_in_registers() if self.a_in_registers is None else self.a_in_registers
        base = dataclasses.replace(self, engine=engine, a_in_registers=a_regs)
        if self.split_k > 0:
            if kgrains % self.split_k:
                raise ValueError(f"GEMV kernel: split_k={self.split_k} must divide K/{KGRAIN}={kgrains}")
            if not valid(self.split_k):
                raise ValueError(f"GEMV kernel: K slices must be multiples of {unit(self.split_k)} "
                                 f"(whole 128-column scale blocks for fp8; K={k}, split_k={self.split_k})")
            splits = [self.split_k]
        else:
            row_blocks = -(-n // self.block_n)
            split = 1
            # Grow split-K until the grid about fills the machine, keeping K slices ≥ 512.
            while (occupancy and row_blocks * split < 0.7 * sms and split < 16 and valid(2 * split)
                   and k // (2 * split) >= 512):
                split *= 2
            splits = [s for s in range(split, kgrains + 1) if valid(s)]
        if self.split_sum == "cluster":
            splits = [s for s in splits if s <= CLUSTER_MAX]
            if not splits:
                raise ValueError(f"GEMV kernel: split_sum='cluster' takes at most {CLUSTER_MAX} splits (a portable "
                                 f"cluster); K={k} needs more (split_k={self.split_k})")
        cands = [base._shaped(s, k, w_itemsize, divides) for s in splits]
        cands = [c for c in cands if c is not None]
        if not cands:
            raise ValueError(f"GEMV kernel: no block_k divides the K slices of {self} (K={k}, divides={divides})")
        # the full pipeline depth with the smallest split that fits, then shallower pipelines and
        # narrower blocks (an explicit split, or K that no split brings into SMEM)
        for cfg in cands + [c for c0 in cands for c in c0._smaller(k, w_itemsize, divides)]:
            if hw.smem_bytes(layout(cfg)) <= hw.SMEM_BYTES:
                if (self.split_sum == "auto" and cluster_sum and cluster_auto and engine != "fma"
                        and 1 < cfg.split_k <= CLUSTER_MAX and not _interp.active()):
                    clustered = dataclasses.replace(cfg, split_sum="cluster")
                    if hw.smem_bytes(layout(clustered)) <= hw.SMEM_BYTES:
                        cfg = clustered
                return cfg._two_per_sm(-(-n // self.block_n) * cfg.split_k, sms, layout)
        need = hw.smem_bytes(layout(cands[0]))
        raise ValueError(f"GEMV kernel: config {cands[0]} needs {need} B of shared memory (> {hw.SMEM_BYTES}) "
                         "and no smaller configuration fits")

    def _two_per_sm(self, ctas: int, sms: int, layout) -> "GemvConfig":
        """A grid of more CTAs than SMs (but not more than two per SM) with the pipeline only as deep as
        lets two CTAs share an SM (at least two stages): one wave instead of a second, partial one that
        streams on a few SMs after the rest are done."""
        if not sms < ctas <= 2 * sms or hw.smem_bytes(layout(self)) <= hw.SMEM_HALF_SM:
            return self
        for stages in range(self.stages - 1, 1, -1):
            cfg = dataclasses.replace(self, stages=stages)
            if hw.smem_bytes(layout(cfg)) <= hw.SMEM_HALF_SM:
                return cfg
        return self

    def _shaped(self, split: int, k: int, w_itemsize: int, divides: int | None) -> "GemvConfig | None":
        """This config at split-K `split`: the widest block_k ≤ block_k (≤ 16 KB of weights per step
        and weight) that divides the K slice (and `divides`) and is whole swizzle rows (fp8: 64 or
        a multiple of 128), stages ≤ the slice's steps."""
        kc = k // split
        grain = QBLOCK if (w_itemsize == 1 and kc % QBLOCK == 0) else KGRAIN
        cap = 16384 // (self.block_n * w_itemsize)
        bk = min(self.block_k, kc, cap) // grain * grain
        while bk >= grain and (kc % bk or (divides is not None and divides % bk)
                               or bk % hw.weight_transforms(bk, w_itemsize)[1]):
            bk -= grain
        if bk < grain:
            return None
        sum_by = "cluster" if self.split_sum == "cluster" and 1 < split <= CLUSTER_MAX else "xla"
        return dataclasses.replace(self, block_k=bk, split_k=split, stages=max(1, min(self.stages, kc // bk)),
                                   split_sum=sum_by)

    def _smaller(self, k: int, w_itemsize: int, divides: int | None):
        """Configurations with less SMEM than this one, most preferred first: fewer stages, then
        half the block_k (at two stages)."""
        for stages in range(self.stages - 1, 0, -1):
            yield dataclasses.replace(self, stages=stages)
        if self.block_k // 2 >= KGRAIN:
            half = dataclasses.replace(self, block_k=self.block_k // 2, stages=2)._shaped(
                self.split_k, k, w_itemsize, divides)
            if half is not None and half.block_k < self.block_k:
                yield half
                yield from half._smaller(k, w_itemsize, divides)


def projection_scratch(cfg: GemvConfig, *, k: int, p: int, itemsize: int, tb: int, out_dtype=BF16,
                       residual_dtype=None, splits: tuple[int, int] | None = None) -> list:
    """The scratch buffers of `_projection` (in the kernel's order) under a resolved config: the
    token slice (FMA: fp32 rows; wgmma: the B operand(s) and the bf16 staging tile, [8, K / split]
    each), the fp8 range factors, the output tile, two barriers, the A double buffer (fp8 with A
    from SMEM), the residual tile (epilogue in the kernel) and, where the split-K partials are
    summed in a cluster, one [block_n] fp32 buffer per weight and token (the partials the first CTA
    reads; whole buffers, which Mosaic maps into the cluster) and two cluster barriers, and with
    `splits` (n, Hc: the input merged from sparse MLA's split partials) a head's partials [K / chunk,
    n, chunk] fp32, the m and l blocks of its group and the split weights ([SPLIT_ROWS, Hc] each), the
    merged row [K / split] fp32 and the partials' barrier."""
    kc = k // cfg.split_k
    fp8 = itemsize == 1
    cluster = cfg.split_k > 1 and cfg.split_sum == "cluster"
    in_kernel = cfg.split_k == 1 or cluster
    if cfg.engine == "fma":
        scratch = [plgpu.SMEM((tb, kc), F32)]
    elif cfg.engine == "fp8x2":   # x's two e4m3 halves, the staging tile, x's scale
        scratch = [hw.pair_operand(kc),
                   plgpu.SMEM((MAX_TOKENS, kc), BF16, transforms=X_TRANSFORMS),
                   plgpu.SMEM((1,), F32)]
    else:
        scratch = [plgpu.SMEM((p if fp8 else 1, MAX_TOKENS, kc), F16 if fp8 else BF16, transforms=X_TRANSFORMS),
                   plgpu.SMEM((MAX_TOKENS, kc), BF16, transforms=X_TRANSFORMS),
                   plgpu.SMEM((p,), F32)]
    scratch += [plgpu.SMEM((1 if in_kernel else p, MAX_TOKENS, cfg.block_n), out_dtype if in_kernel else F32),
                plgpu.Barrier(num_barriers=2)]
    if fp8 and cfg.engine == "wgmma" and not cfg.a_in_registers:
        _, sub = hw.weight_transforms(cfg.block_k, itemsize)
        scratch.append(plgpu.SMEM((p, 2, cfg.block_n, sub), F16, transforms=X_TRANSFORMS))
    if residual_dtype is not None and in_kernel:
        scratch.append(plgpu.SMEM((MAX_TOKENS, cfg.block_n), residual_dtype))
    if cluster:
        scratch += [[plgpu.SMEM((cfg.block_n,), F32) for _ in range(p * tb)],
                    plgpu.ClusterBarrier(collective_axes=("s",), num_barriers=2)]
    if splits is not None:
        n, hc = splits
        chunk = _split_chunk(kc)
        scratch += [plgpu.SMEM((kc // chunk, n, chunk), F32)] + [plgpu.SMEM((SPLIT_ROWS, hc), F32) for _ in range(3)]
        scratch += [plgpu.SMEM((kc,), F32), plgpu.Barrier(num_arrivals=kc // chunk + 2)]
    return scratch


def splits_slice_fits(kc: int) -> bool:
    """Whether a K slice of kc columns can be built from sparse MLA's split partials (`splits=`): whole
    128-column blocks of x, the partials copied in boxes of at most 256 columns (`_split_chunk`)."""
    return kc % QBLOCK == 0 and (kc <= 256 or kc % 256 == 0)


def _split_chunk(kc: int) -> int:
    """Columns per TMA copy of a head's split partials: at most 256 (TMA's widest box dimension)."""
    return 256 if kc % 256 == 0 else kc


def _weight_dtype(itemsize: int):
    return {1: FP8, 2: BF16, 4: F32}[itemsize]


def projection_smem(cfg: GemvConfig, *, k: int, p: int, itemsize: int, tb: int, out_dtype=BF16,
                    residual_dtype=None, norm: bool = False, splits: tuple[int, int] | None = None) -> hw.Scope:
    """`_projection`'s shared memory: its scratch, and inside, the weight pipeline's `stages` tiles
    per weight (the fp8 B build and a norm's sum of squares, before step 0, reduce in there); the
    epilogue reduces outside."""
    pipe = hw.Scope(tuple(plgpu.SMEM((cfg.stages, cfg.block_n, cfg.block_k), _weight_dtype(itemsize))
                          for _ in range(p)) + (plgpu.Barrier(num_barriers=cfg.stages),),
                    reduces=norm or (itemsize == 1 and cfg.engine in ("wgmma", "fp8x2")))
    scratch = projection_scratch(cfg, k=k, p=p, itemsize=itemsize, tb=tb, out_dtype=out_dtype,
                                 residual_dtype=residual_dtype, splits=splits)
    return hw.Scope(tuple(scratch), (pipe,), reduces=True)


# ---- the epilogue, shared by the kernel (split_k = 1) and the XLA finish (split_k > 1) ----------

def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def swiglu_f32(g, u, out_dtype):
    """silu(g) · u on fp32 g and u (moe_experts' reference keeps them in fp32), in `out_dtype`."""
    return (g * _sigmoid(g) * u).astype(out_dtype)


def swiglu_of_sums(g, u, kind: str, out_dtype):
    """The SwiGLU of the gate and up sums (fp32) as `kind` rounds them: "swiglu" rounds both to bf16
    first, as the reference's dense and shared experts do; "swiglu_f32" keeps them, as its routed
    experts do."""
    if kind == "swiglu":
        g, u = g.astype(BF16).astype(F32), u.astype(BF16).astype(F32)
    elif kind != "swiglu_f32":
        raise ValueError(f"swiglu_of_sums: kind swiglu or swiglu_f32, got {kind!r}")
    return swiglu_f32(g, u, out_dtype)


def add_residual(y, residual, out_dtype):
    """residual + y as `jtilert.ops.reference.linear_residual` rounds it: y to bf16, the sum in fp32."""
    return (y.astype(BF16).astype(F32) + residual.astype(F32)).astype(out_dtype)


def _finish(ys, *, kind, residual, out_dtype):
    """ys: P fp32 arrays (one token's rows, or [.., T, N]), already scaled by a norm's 1/rms."""
    if kind in ("swiglu", "swiglu_f32"):
        return swiglu_of_sums(ys[0], ys[1], kind, out_dtype)
    if residual is not None:
        return add_residual(ys[0], residual, out_dtype)
    return ys[0].astype(out_dtype)


# ---- the kernel ---------------------------------------------------------------------------------

def row_pieces(k: int):
    """(start, size, layout) pieces in which to load k (a multiple of 64) consecutive bf16 of a row as
    1-D values. Mosaic's default 1-D layout spreads a load over the warpgroup's 128 threads, so k that
    is no multiple of 128 is read in 64-wide pieces, one 16-byte vector per lane (`x_col_layout`,
    replicated over the warps)."""
    if k % 128 == 0:
        return [(0, k, None)]
    return [(c, KGRAIN, hw.x_col_layout(KGRAIN, 2)) for c in range(0, k, KGRAIN)]


def load_piece(ref, layout):
    return ref[...] if layout is None else plgpu.load(ref, layout=layout, optimized=False)


def row_values(row, k: int) -> list:
    """row[:k] (a bf16 GMEM row) as the `row_pieces` values: the loads are issued here, and waited
    for where the values are first used (`sum_squares`)."""
    return [load_piece(row.at[pl.ds(c, size)], layout) for c, size, layout in row_pieces(k)]


def sum_squares(values: list):
    """Σ v² in fp32 over a row's `row_values`."""
    total = jnp.float32(0.0)
    for v in values:
        v = v.astype(F32)
        total = total + jnp.sum(v * v)
    return total


# Row values (bf16) per thread of the warpgroup up to which a norm's rows are held in registers
# while B is built (above it, 1/rms is reduced first): 32 registers.
HELD_ROW_VALUES = 64


@dataclasses.dataclass(frozen=True)
class ProjectionPlan:
    """`_projection`'s kernel under a resolved configuration, for `_projection` and for a kernel that
    runs it as a phase (`gemv_pair`). body(refs, n_idx, s_idx, e_idx=None, wait=None) is the kernel
    body of the CTA of row block n_idx, K slice s_idx and (expert or heads mode) selection e_idx; refs
    are `args`' refs, the output(s), then `scratch`. `wait()` (wgmma engines, x read by TMA): run
    before x is read, after the CTA has asked for its first weight tiles (a phase before it writes
    x). `grid`, `names`, `clusters`: the launch's; `finish(out)`: the result from the output."""
    body: Callable
    args: list
    out_type: object
    scratch: list
    grid: tuple
    names: tuple
    clusters: dict
    kernel_name: str
    cfg: GemvConfig
    finish: Callable

    @property
    def units(self) -> int:
        """The CTAs of the launch: one a work unit."""
        return math.prod(self.grid) * (self.clusters["cluster"][0] if self.clusters else 1)

    def unit(self, u):
        """(n_idx, s_idx, e_idx) of work unit u (grid order: row block fastest), for a phase of one CTA
        a unit (no cluster)."""
        sizes = dict(zip(self.names, self.grid))
        rb, split = sizes["n"], sizes.get("s", 1)
        return u % rb, (u // rb) % split, (u // (rb * split) if "e" in sizes else None)


def _projection(x, ws, scales, **kw):
    """`projection_plan`'s kernel launched, and its result (see there)."""
    plan = projection_plan(x, ws, scales, **kw)
    return plan.finish(launch(plan))


def launch(plan: ProjectionPlan, args=None):
    """The plan's kernel on `args` (default: the plan's own), its output as the kernel writes it."""
    def kernel(*refs):
        plan.body(refs, lax.axis_index("n"), lax.axis_index("s"), lax.axis_index("e") if "e" in plan.names else None)
    call = plgpu.kernel(kernel, out_type=plan.out_type, grid=plan.grid, grid_names=plan.names, **plan.clusters,
                        scratch_types=plan.scratch, interpret=_interp.params(), kernel_name=plan.kernel_name)
    return call(*(plan.args if args is None else args))


def projection_plan(x, ws, scales, *, norm=None, eps=1e-6, residual=None, kind="linear",
                    out_dtype=BF16, config: GemvConfig | None = None, ids=None, heads: int = 0, layer=None,
                    scale_block: int = QBLOCK, prefix: bool = False, stride: int = 0, partials: bool = False,
                    normed_out: bool = False, padded: bool = False, splits: tuple | None = None,
                    heads_flat: bool = False) -> ProjectionPlan:
    """Core: x [T, K] (T ≤ 8) against P = len(ws) weights [N, K] with shared x; see module doc.
    `partials` (one weight, kind "linear", fp32, no residual): the split-K partial sums
    [split, T, N] unsummed, for a consumer that adds them itself ([1, T, N] without split-K); with
    the two weights of kind "swiglu_f32": both weights' partials [split, 2, T, N] for a consumer
    that sums them and applies the SwiGLU itself, or, where the kernel finished them (no split-K),
    the SwiGLU's result [T, N].
    `norm` (weight [K]) and `eps`: the product is with rms_norm(x). The wgmma engines build B = x ·
    weight and multiply the sums by each token's 1/rms over its K columns (the reference rounds x /
    rms, then its product with the weight, to bf16: bf16-level differences); the FMA engine computes
    1/rms first and rounds x as the reference does. `normed_out` (FMA engine with a norm, not in
    expert mode): the result is (y, rms_norm(x) [T, K] bf16), each K slice written by the CTAs of
    the first row block, so that the norm's other readers need no norm of their own. `padded`: the
    result's rows as the kernel stores them, N rounded up to whole `block_n` blocks (the columns past
    N are not the product), for a consumer that reads the first N in place (no slice after the kernel).
    fp8 weights carry one fp32 scale per `scale_block`² block (128: the checkpoint's; 64: copies
    whose blocks are finer than the checkpoint's, see `transformer.head_weights`). `prefix`: x is
    [T, W ≥ K] (W a multiple of 8: TMA's row stride) and each row's first K columns are the input
    (the rest of the row is not read; a norm's rms covers those K columns only).

    Layer mode (`layer` a `jtilert.ops.layer.Layer` or an int32 scalar, may be traced): the weights
    are stacks [L, N, K] (scales [L, nb, kb], norm weight [L, K]) and layer `layer` is used; every
    CTA reads the index on the device (base + offset) and the weight TMA (and the scale / norm
    loads) address that layer, so nothing is sliced outside.

    Expert mode (`ids` int32 [S] given, S a multiple of T): the weights are stacked [E, N, K]
    (scales [E, nb, kb]) and selection i multiplies token i // (S / T) with expert ids[i]; only
    the selected experts' rows are read (the expert id is read on the device and steers the TMA).
    The result is [S, N]. With `layer` too, the stacks are [L, E, N, K], taken as [L·E, N, K] (a
    free reshape) and the kernel reads expert ids[i] + layer·E. T is then any number of rows: each
    CTA stages the 8-row block that holds its token. `stride` (with `prefix`): selection i reads
    columns j·stride .. j·stride + K of its token's row, j = i mod S/T. `heads` (instead of ids): expert
    mode whose selection i uses stack entry i mod heads, no ids operand (`heads_linear`: the heads of a
    token are experts 0..H-1, head j's input at columns j·D of the token's row).

    `splits` = (o, m, l) (heads mode, wgmma engines, K slices of whole 128-column blocks): the input
    is not x (None) but sparse MLA's split partials, o [T, G, n, Hc, K] fp32 and m, l [T, G, n, Hc]
    (head j = g·Hc + h: `sparse_mla.sparse_mla_partials`), which each CTA merges for its head as
    `sparse_mla.combine` does and rounds to bf16 (the attention's output, as the reference rounds it)
    in place of x's TMA.

    `heads_flat` (heads mode, the epilogue in the kernel, N a multiple of block_n): the result is
    [T, H·N], head j's rows at columns j·N.. of its token's row (the input of a projection of all
    heads, which a `gemv_pair` phase reads in place)."""
    if splits is not None:
        o_parts, m_parts, l_parts = splits
        if x is not None or not heads or o_parts.ndim != 5 or m_parts.shape != o_parts.shape[:4] or (
                l_parts.shape != m_parts.shape) or o_parts.shape[1] * o_parts.shape[3] < heads:
            raise ValueError(f"GEMV splits input: heads mode, no x, o [T, G, n, Hc, K] and m, l [T, G, n, Hc] "
                             f"for {heads} heads; got {[a.shape for a in splits]}")
        x = o_parts.astype(F32)
        t, kx = o_parts.shape[0], o_parts.shape[-1]
        n_split, hc = o_parts.shape[2:4]
        if n_split > SPLIT_ROWS or hc % 8:
            raise ValueError(f"GEMV splits input: at most {SPLIT_ROWS} splits and heads per group in multiples "
                             f"of 8, got {n_split} splits of {hc} heads")
    else:
        t, kx = x.shape
    p = len(ws)
    if partials and ((p, kind) not in ((1, "linear"), (2, "swiglu_f32"), (2, "swiglu")) or out_dtype != F32
                     or residual is not None):
        raise ValueError("GEMV partials: one weight of kind linear or two of a SwiGLU kind, fp32 out, no residual")
    if heads and ids is not None:
        raise ValueError("GEMV expert mode: ids or heads, not both")
    experts = ids is not None or heads > 0
    stacked = experts or layer is not None
    per_layer = 1                                 # stack entries per layer (E in expert mode)
    if experts and layer is not None:
        if ws[0].ndim != 4:
            raise ValueError(f"GEMV expert mode with layer: weights must be [L, E, N, K], got {ws[0].shape}")
        per_layer = ws[0].shape[1]
        ws = tuple(w.reshape(-1, *w.shape[2:]) for w in ws)
        scales = tuple(None if s is None else s.reshape(-1, *s.shape[2:]) for s in scales)
    if experts:
        if ws[0].ndim != 3 or (ids is not None and (ids.ndim != 1 or ids.shape[0] % t)):
            raise ValueError(f"GEMV expert mode: weights {ws[0].shape}, ids {None if ids is None else ids.shape}, "
                             f"tokens {t}")
        if norm is not None or residual is not None:
            raise ValueError("GEMV expert mode has no norm prologue / residual epilogue")
    elif layer is not None and ws[0].ndim != 3:
        raise ValueError(f"GEMV layer mode: weights must be stacked [L, N, K], got {ws[0].shape}")
    elif layer is None and ws[0].ndim != 2:
        raise ValueError(f"GEMV kernel: weights must be [N, K], got {ws[0].shape} (stacks need layer=)")
    n, k = ws[0].shape[-2:]
    if norm is not None and norm.shape != ((ws[0].shape[0], k) if layer is not None else (k,)):
        raise ValueError(f"GEMV kernel: norm weight {norm.shape} does not match weights {ws[0].shape}")
    nsel = ids.shape[0] if ids is not None else t * heads if heads else t
    kper = nsel // t
    tb = 1 if experts else t                      # token rows of B that this CTA uses
    if (kx != k and not (prefix and kx > k and kx % 8 == 0)) or any(
            w.shape != ws[0].shape or w.dtype != ws[0].dtype for w in ws):
        raise ValueError(f"GEMV kernel: x {x.shape} and weights {[w.shape for w in ws]} do not match")
    if stride and (not experts or not prefix or (kper - 1) * stride + k > kx):
        raise ValueError(f"GEMV kernel: stride {stride} needs expert mode and x rows of ≥ {(kper - 1) * stride + k}"
                         f" columns ({kper} selections per token), got x {x.shape}")
    if t < 1 or (t > MAX_TOKENS and not experts):
        raise ValueError(f"GEMV kernel: 1..{MAX_TOKENS} tokens per call, got {t}")
    if scale_block not in (KGRAIN, QBLOCK):
        raise ValueError(f"GEMV kernel: scale blocks of {KGRAIN} or {QBLOCK}, got {scale_block}")
    if x.dtype != BF16 and splits is None:
        raise ValueError(f"GEMV kernel: x must be bf16, got {x.dtype}")
    if kx % KGRAIN:   # the token TMA tiles x's rows by 64 columns: a wider (prefix) row is padded to them
        x = jnp.pad(x, ((0, 0), (0, -kx % KGRAIN)))
    fp8 = ws[0].dtype == FP8
    if ws[0].dtype not in (FP8, BF16, F32):
        raise ValueError(f"GEMV kernel: weights must be bf16, fp8 e4m3 (or fp32, FMA engine), got {ws[0].dtype}")
    if fp8:
        for s, w in zip(scales, ws):
            want = (*w.shape[:-2], -(-w.shape[-2] // scale_block), -(-w.shape[-1] // scale_block))
            if s is None or s.shape != want:
                raise ValueError(f"GEMV kernel: fp8 weight {w.shape} needs scales {want}, got "
                                 f"{None if s is None else s.shape}")
    itemsize = ws[0].dtype.itemsize
    res_dtype = residual.dtype if residual is not None else None
    split_shape = None if splits is None else (n_split, hc)
    layout = functools.partial(projection_smem, k=k, p=p, itemsize=itemsize, tb=tb, out_dtype=out_dtype,
                               residual_dtype=res_dtype, norm=norm is not None, splits=split_shape)
    # K slices of whole scale blocks under split-K (64-blocks: any slice of the 64 grain)
    cfg = (config or GemvConfig()).resolved(n * (nsel if experts else 1), k, t, p, itemsize, hw.num_sms(),
                                            layout=layout, slice_unit=KGRAIN if scale_block == KGRAIN else None,
                                            # by default a cluster sums one weight's partials only: the
                                            # gate/up pair's and the experts' clustered grids ran slower,
                                            # and slowed the kernels beside them, than XLA's sum after them
                                            cluster_sum=not partials, cluster_auto=not experts and p == 1)
    hw.check_smem("GEMV kernel", layout(cfg), cfg)
    if itemsize == 4 and cfg.engine != "fma":
        raise ValueError("GEMV kernel: fp32 weights need the FMA engine")
    if normed_out and (norm is None or cfg.engine != "fma"):
        raise ValueError(f"GEMV kernel: the normed x comes out of the FMA engine with a norm, not engine "
                         f"{cfg.engine}{' without a norm' if norm is None else ''}")
    if fp8 and cfg.engine in ("fma", "fp8x2") and scale_block != QBLOCK:
        raise ValueError(f"GEMV kernel: the {cfg.engine} engine takes 128-blocks of scales only")
    bn, bk, split, stages = cfg.block_n, cfg.block_k, cfg.split_k, cfg.stages
    if splits is not None and (cfg.engine == "fma" or not splits_slice_fits(k // split)):
        raise ValueError(f"GEMV splits input: the wgmma engines and K slices of whole 128-column blocks (at "
                         f"most 256 or a multiple of it); got engine {cfg.engine}, K={k}, split_k={split}")
    fma = cfg.engine == "fma"
    x8 = cfg.engine == "fp8x2"
    kc = k // split
    steps = kc // bk
    w_tr, sub = hw.weight_transforms(bk, itemsize)    # sub: one swizzle row, ≤ one scale block
    nsub = bk // sub
    a_regs = cfg.a_in_registers
    cluster = split > 1 and cfg.split_sum == "cluster"
    in_kernel_epilogue = split == 1 or cluster
    out_rows = 1 if in_kernel_epilogue else p
    o_dtype = out_dtype if in_kernel_epilogue else F32
    row_blocks = -(-n // bn)
    kb_total = -(-k // scale_block)
    w_layout = hw.w_layout(sub, itemsize) if fma else None
    x_col_layout = hw.x_col_layout(sub, itemsize) if fma else None

    def body(refs, n_idx, s_idx, e_idx=None, wait=None):
        if wait is not None and (fma or splits is not None):
            raise ValueError("GEMV phase: a wait before x needs x read by TMA (the wgmma engines, no splits)")
        it = iter(refs)
        x_gmem = next(it)          # with `splits`: the partials o
        m_gmem, l_gmem = (next(it), next(it)) if splits is not None else (None, None)
        ids_gmem = next(it) if ids is not None else None
        layer_gmems = (next(it), next(it)) if layer is not None else None
        w_gmems = [next(it) for _ in range(p)]
        s_gmems = [next(it) for _ in range(p)] if fp8 else [None] * p
        nw_gmem = next(it) if norm is not None else None
        res_gmem = next(it) if residual is not None and in_kernel_epilogue else None
        out_gmem = next(it)
        nx_gmem = next(it) if normed_out else None
        xb = next(it) if not fma else None
        xstage = next(it) if not fma else None
        invf = next(it) if not fma else None
        xf = next(it) if fma else None
        o_smem, bar = next(it), next(it)
        a_bufs = next(it) if (fp8 and cfg.engine == "wgmma" and not a_regs) else None
        res_smem = next(it) if res_gmem is not None else None
        parts, cbar = (next(it), next(it)) if cluster else (None, None)
        o_s, m_s, l_s, w_s, xm_s, sbar = (next(it) for _ in range(6)) if splits is not None else (None,) * 6

        zero = n_idx * 0                    # a traced 0: TMA boxes may then overhang T
        # wid: the stack entry of the weights (layer, expert, or layer·E + expert), read on the
        # device; it steers the weight TMA and indexes the scales and the norm weight.
        lid = hw.read_layer(*layer_gmems) if layer is not None else None
        if experts:
            entry = ids_gmem[e_idx] if ids is not None else e_idx % heads
            wid = entry if lid is None else entry + lid * per_layer
            tok0 = e_idx // kper            # the token of this selection
            c0 = (e_idx % kper) * stride    # its window's first column in the token's row
        else:
            wid = lid
            tok0 = c0 = zero
        col0 = tok0 % MAX_TOKENS            # its row in the staged 8-row block (B's column)
        row8 = pl.multiple_of(tok0 - col0, MAX_TOKENS)   # the block's first row of x

        def scale_at(j, kb):
            return s_gmems[j][wid, srow, kb] if stacked else s_gmems[j][srow, kb]

        def norm_at(start, size):
            return nw_gmem.at[lid, pl.ds(start, size)] if lid is not None else nw_gmem.at[pl.ds(start, size)]
        k0 = s_idx * kc
        row0 = n_idx * bn
        srow = row0 // scale_block

        # B built in column blocks of one scale each: 128 (or 64 where the K slice or the scale
        # blocks are narrower)
        bw = QBLOCK if kc % QBLOCK == 0 and scale_block == QBLOCK else KGRAIN
        nblk = kc // bw

        @hw.phase("x_prep")
        def build_b(xstage, svals, nws):
            """B operand(s) for wgmma: the tokens' K slice, [8, kc] (rows ≥ T are TMA's zero fill).
            bf16 weights: B = x (· norm weight) in bf16. fp8 weights: B_j = f16(x · w_norm · s_j[row
            block, k block] · f_j), the block scales of the CTA's row block folded into x (exact
            for the checkpoint's power-of-two scales) and f_j = `hw.f16_range_factor`; the
            epilogue multiplies by 1/f_j (kept in `invf`). The weights then only need e4m3 → f16.
            fp8x2: B is x's two e4m3 halves, [16, kc] (`hw.pair_operand`), and `invf` x's scale.
            nws: the norm weight's values of each column block (loaded in `first`), or None."""
            with jax.named_scope("x_wait"):
                plgpu.barrier_wait(bar.at[0] if splits is None else sbar)
            merged = merged_blocks() if splits is not None else None

            def block(b):
                if merged is not None:
                    return merged[b]
                v = plgpu.load(xstage.at[:, pl.ds(b * bw, bw)], layout=X_LAYOUT).astype(F32)
                if nw_gmem is not None:
                    v = v * plgpu.layout_cast(lax.broadcast_in_dim(nws[b], (MAX_TOKENS, bw), (1,)), X_LAYOUT)
                return v

            if x8:   # x's two e4m3 halves, one scale for the slice
                invf[0] = hw.store_fp8_pair(hw.pair_rows(xb, bw), block, nblk)
                plgpu.commit_smem()
                return
            for j in range(p if fp8 else 1):
                if not fp8:
                    for b in range(nblk):
                        xb.at[0, :, pl.ds(b * bw, bw)][...] = block(b).astype(BF16)
                    continue
                f = hw.f16_range_factor(jnp.abs(block(b) * svals[j][b]) for b in range(nblk))
                for b in range(nblk):
                    xb.at[j, :, pl.ds(b * bw, bw)][...] = (block(b) * (svals[j][b] * f)).astype(F16)
                invf[j] = 1.0 / f
            plgpu.commit_smem()

        @hw.phase("merge")
        def merged_blocks():
            """`splits`: this head's input merged from its split partials as `sparse_mla.combine`
            merges them (weights e^{m_s − M}, M the largest m_s; x = Σ_s w_s o_s / Σ_s w_s l_s, the
            splits in order), rounded to bf16: X_LAYOUT column blocks [8, bw], x in the token's row
            col0 and zeros in the others. The weights of every head of the group at once, as one
            [SPLIT_ROWS, Hc] tile (splits on the rows, padded with −inf), into `w_s`; then the sums on
            whole chunk rows (one weight and a few vector loads a split); the merged row goes through
            shared memory (`xm_s`) into the blocks' layout."""
            wl = plgpu.Layout.WGMMA
            mv = plgpu.load(m_s, layout=wl, optimized=False)
            mx = mv.max(axis=0)
            mx = jnp.where(mx == -jnp.inf, 0.0, mx)
            wv = jnp.exp(mv - lax.broadcast_in_dim(mx, (SPLIT_ROWS, hc), [1]))
            den = (wv * plgpu.load(l_s, layout=wl, optimized=False)).sum(axis=0)
            den = jnp.where(den == 0, 1.0, den)
            w_s[...] = wv / lax.broadcast_in_dim(den, (SPLIT_ROWS, hc), [1])
            plgpu.commit_smem()

            def weighted(s):
                return tuple(w_s[s, h_in] * o_s[c, s] for c in range(kc // chunk))
            accs = lax.fori_loop(1, n_split, lambda s, accs: tuple(a + v for a, v in zip(accs, weighted(s))),
                                 weighted(0))
            for c, a in enumerate(accs):
                xm_s[pl.ds(c * chunk, chunk)] = a
            plgpu.commit_smem()
            rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (MAX_TOKENS, bw), 0), X_LAYOUT)
            out = []
            for b in range(nblk):
                v = plgpu.load(xm_s.at[pl.ds(b * bw, bw)], optimized=False).astype(BF16).astype(F32)
                v = plgpu.layout_cast(lax.broadcast_in_dim(v, (MAX_TOKENS, bw), (1,)), X_LAYOUT)
                out.append(jnp.where(rows == col0, v, 0.0))
            return out

        @hw.phase("x_prep")
        def fill_xf(rms):
            """FMA engine: this CTA's slice of the tokens as fp32 rows [T, kc]: x, or with a norm
            rms_norm(x) rounded as the reference rounds it (bf16(x / rms), then its bf16 product
            with the weight), also written to the normed output by the first row block's CTAs."""
            for tok in range(tb):
                for c, size, layout in row_pieces(kc):
                    xr = load_piece(x_gmem.at[tok0 + tok, pl.ds(c0 + k0 + c, size)], layout).astype(F32)
                    if nw_gmem is not None:
                        nwv = load_piece(norm_at(k0 + c, size), layout).astype(F32)
                        xr = (xr * rms[tok]).astype(BF16).astype(F32) * nwv
                    xr = xr.astype(BF16)
                    xf.at[tok, pl.ds(c, size)][...] = xr.astype(F32)
                    if nx_gmem is not None:
                        @pl.when(n_idx == 0)
                        def _():
                            nx_gmem.at[tok, pl.ds(k0 + c, size)][...] = xr

        # Prologue: the token TMA now (wgmma engines); x is prepared once the weight stream has asked
        # for its first tiles (`first` below), while they arrive.
        if splits is not None:   # this head's partials and its group's m and l, in place of x
            g_idx, h_in = (e_idx % heads) // hc, (e_idx % heads) % hc
            chunk = _split_chunk(kc)
            for c in range(kc // chunk):
                plgpu.copy_gmem_to_smem(x_gmem.at[tok0, g_idx, :, h_in, pl.ds(k0 + c * chunk, chunk)], o_s.at[c], sbar)
            if n_split < SPLIT_ROWS:   # the rows past the splits weigh nothing (written before the copies)
                m_s[...] = jnp.full((SPLIT_ROWS, hc), -jnp.inf, F32)
                l_s[...] = jnp.zeros((SPLIT_ROWS, hc), F32)
                plgpu.commit_smem()
            plgpu.copy_gmem_to_smem(m_gmem.at[tok0, g_idx], m_s.at[pl.ds(0, n_split)], sbar)
            plgpu.copy_gmem_to_smem(l_gmem.at[tok0, g_idx], l_s.at[pl.ds(0, n_split)], sbar)
        if not fma:
            if splits is None and wait is None:
                plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row8, MAX_TOKENS), pl.ds(c0 + k0, kc)], xstage, bar.at[0])
            svals = ([[scale_at(j, (k0 + b * bw) // scale_block) for b in range(nblk)] for j in range(p)]
                     if fp8 and not x8 else None)
        if res_smem is not None:
            plgpu.copy_gmem_to_smem(res_gmem.at[pl.ds(zero, MAX_TOKENS), pl.ds(row0, bn)], res_smem, bar.at[1])

        def scales_at(step):
            """Block scales of one pipeline step: [weight][sub-chunk] scalars (loaded a step ahead)."""
            if not fp8:
                return ()
            out = []
            for j in range(p):
                out.append(tuple(scale_at(j, jnp.minimum((k0 + step * bk + h * sub) // QBLOCK, kb_total - 1))
                                 for h in range(nsub)))
            return tuple(out)

        @hw.phase("step")
        def body_fma(step, *args):
            w_smems, (accs, scs) = args[:p], args[p]
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
                        xbc = plgpu.layout_cast(lax.broadcast_in_dim(xc, (bn, sub), (1,)), w_layout)
                        accs[j][tok] = accs[j][tok] + w * xbc
            # every warp done reading the slot before one thread's TMA refills it
            plgpu.commit_smem()
            return tuple(tuple(a) for a in accs), nxt

        @hw.phase("step")
        def body_wgmma(step, *args):
            w_smems, acc_refs = args[:p], args[p]
            kk = step * bk
            for j in range(p):
                if not fp8:
                    plgpu.wgmma(acc_refs[j], w_smems[j], xb.at[0, :, pl.ds(kk, bk)].T)
                    continue
                hw.wgmma_fp8_step(acc_refs[j], w_smems[j], lambda h, j=j: xb.at[j, :, pl.ds(kk + h * sub, sub)].T,
                                  nsub=nsub, sub=sub,
                                  a_buf_of=None if a_regs else (lambda i, j=j: a_bufs.at[j, i]))
            # A from registers: the weight slot is read once the tile is in registers, so the step's
            # wgmmas may run on while the next step converts (`in_flight`); from SMEM they must end
            plgpu.wgmma_wait(cfg.in_flight if fp8 and a_regs else 0)
            return acc_refs

        @hw.phase("step")
        def body_x8(step, *args):
            """Both operands e4m3 from SMEM: per 128-column block, hi and lo (one B) into a scratch
            accumulator, then added to the sums scaled by the weights' block scale and x's (the promotion)."""
            w_smems, (accs, scs) = args[:p], args[p]
            kk = step * bk
            nxt = scales_at(step + 1)
            sx = invf[0]
            return tuple(hw.wgmma_fp8_pair_step(accs[j], w_smems[j], xb, kk, [f * sx for f in scs[j]],
                                                nsub=nsub, sub=sub) for j in range(p)), nxt

        def tile_of(w_gmem):
            def tile(step):
                rows, cols = pl.ds(row0, bn), pl.ds(k0 + step * bk, bk)
                return w_gmem.at[wid, rows, cols] if stacked else w_gmem.at[rows, cols]
            return tile

        def pipeline(body, carry, first=None):
            """The weight stream; `first` (x's preparation) runs while its first tiles are on the way."""
            return hw.stream_tiles(body, steps=steps, stages=stages, tiles=[tile_of(w) for w in w_gmems],
                                   shape=(bn, bk), dtype=w_gmems[0].dtype, transforms=w_tr, carry=carry,
                                   first=first)

        @hw.phase("rms")
        def inv_rms(rows):
            """Each token's 1/rms over its K columns, from its row's `row_values`."""
            return tuple(lax.rsqrt(sum_squares(r) / k + eps) for r in rows)

        def first():
            """What needs no weight tile, done while the first ones arrive: the norm's 1/rms of each
            token over its K columns (its whole row read from GMEM; with split-K every CTA reduces
            it) and x's slice prepared (B for the wgmma engines, fp32 rows for FMA, which norm them
            with it). In the wgmma engines only the epilogue uses 1/rms: they issue the rows' loads
            first and, where the rows fit in registers (`HELD_ROW_VALUES`), reduce them after B's
            build, so that the loads land while x's TMA is awaited and B is built. With `wait`, x's TMA
            is issued here, once the phase before has written x."""
            if wait is not None:
                wait()
                plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row8, MAX_TOKENS), pl.ds(c0 + k0, kc)], xstage, bar.at[0])
            # the norm weight's slice and the rows first: their loads are in flight together
            nws = ([plgpu.load(norm_at(k0 + b * bw, bw), optimized=False).astype(F32) for b in range(nblk)]
                   if nw_gmem is not None and not fma else None)
            rows = [row_values(x_gmem.at[tok], k) for tok in range(tb)] if norm is not None else []
            held = not fma and tb * k <= HELD_ROW_VALUES * 128
            rms = inv_rms(rows) if rows and not held else None
            if fma:
                fill_xf(rms)
            else:
                build_b(xstage, svals, nws)
            if rms is None:
                rms = inv_rms(rows) if rows else ()
            return rms

        if x8:
            col_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bn, hw.PAIR_COLS), 1), plgpu.Layout.WGMMA)
            zeros = jnp.where(col_id < 0, 1.0, 0.0).astype(F32)
            rms, (ys, _) = pipeline(body_x8, (tuple(zeros for _ in range(p)), scales_at(0)), first)
            cols_of = lambda tok: [hw.pair_column(y, col_id, col0 + tok) for y in ys]
        elif fma:
            zeros = plgpu.layout_cast(jnp.zeros((bn, sub), F32), w_layout)
            rms, (accs, _) = pipeline(body_fma, (tuple(tuple(zeros for _ in range(tb)) for _ in range(p)),
                                                 scales_at(0)), first)
            cols_of = lambda tok: [jnp.sum(accs[j][tok], axis=1) for j in range(p)]
        else:
            def run(*acc_refs):
                head, _ = pipeline(body_wgmma, acc_refs, first)
                plgpu.wgmma_wait(0)
                return head, tuple(a[...] for a in acc_refs)
            rms, ys = pl.run_scoped(run, *[plgpu.ACC((bn, MAX_TOKENS), F32) for _ in range(p)])
            col_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bn, MAX_TOKENS), 1), plgpu.Layout.WGMMA)

            def cols_of(tok):
                # B holds the staged block (row r = x row row8 + r), so accumulator column
                # col0 + tok is ours.
                cols = [jnp.sum(jnp.where(col_id == col0 + tok, y, 0.0), axis=1) for y in ys]
                return [c * invf[j] if fp8 else c for j, c in enumerate(cols)]
        if res_smem is not None:
            plgpu.barrier_wait(bar.at[1])

        def store(sums):
            """The output rows of this block: sums[tok][j] is weight j's row vector for token tok
            (the epilogue applied here, or the partials left for XLA's finish)."""
            for tok, cols in enumerate(sums):
                if in_kernel_epilogue:
                    res = res_smem.at[tok][...] if res_smem is not None else None
                    o_smem.at[0, tok][...] = _finish(cols, kind=kind, residual=res, out_dtype=o_dtype)
                else:
                    for j in range(p):
                        o_smem.at[j, tok][...] = cols[j]
            plgpu.commit_smem()
            orow = pl.ds(e_idx, 1) if experts else slice(None)
            for j in range(out_rows):
                dst = (out_gmem.at[pl.ds(tok0, 1), pl.ds((e_idx % heads) * n + row0, bn)] if heads_flat else
                       out_gmem.at[orow, pl.ds(row0, bn)] if in_kernel_epilogue
                       else out_gmem.at[s_idx, j, orow, pl.ds(row0, bn)])
                plgpu.copy_smem_to_gmem(o_smem.at[j, pl.ds(0, tb)], dst)
            plgpu.wait_smem_to_gmem(0)

        # Epilogue: one row vector per token and weight.
        with jax.named_scope("epilogue"):
            sums = []
            for tok in range(tb):
                cols = cols_of(tok)
                sums.append([c * rms[tok] for c in cols] if norm is not None and not fma else cols)
            if not cluster:
                store(sums)
            else:
                # The split-K sum in the cluster (the `split` CTAs of this row block): each CTA leaves
                # its partials in its own shared memory and arrives on cluster barrier 0; once all
                # have, CTA 0 reads the others' through the cluster's distributed shared memory, adds
                # them in split order and stores the block with the epilogue.
                # commit_smem's warpgroup barrier orders every thread's stores before its CTA's
                # arrive (a release); barrier 1 keeps the others' shared memory alive until CTA 0
                # has read it.
                for tok, cols in enumerate(sums):
                    for j, c in enumerate(cols):
                        parts[j * tb + tok][...] = c
                plgpu.commit_smem()
                plgpu.barrier_arrive(cbar.at[0])
                plgpu.barrier_wait(cbar.at[0])

                def added(c, buf):
                    for r in range(1, split):
                        c = c + plgpu.cluster_ref(buf, {"s": r})[...]
                    return c

                @pl.when(s_idx == 0)
                def _():
                    store([[added(c, parts[j * tb + tok]) for j, c in enumerate(cols)]
                           for tok, cols in enumerate(sums)])

                plgpu.barrier_arrive(cbar.at[1])
                plgpu.barrier_wait(cbar.at[1])

    scratch = projection_scratch(cfg, k=k, p=p, itemsize=itemsize, tb=tb, out_dtype=out_dtype,
                                 residual_dtype=res_dtype, splits=split_shape)
    # Each CTA stores whole 64-column rows. On the GPU, a TMA store of a row that overhangs the
    # output's N columns runs on into the next row (the next token's or head's), so the output rows
    # are padded to whole blocks and cut back to N after the kernel (no padding when N % 64 == 0).
    n_out = row_blocks * bn
    if heads_flat and (not heads or not in_kernel_epilogue or n_out != n or normed_out):
        raise ValueError(f"GEMV heads_flat: heads mode, the epilogue in the kernel and N a multiple of {bn} "
                         f"(got heads={heads}, split={split}, N={n})")
    out_type = (jax.ShapeDtypeStruct((t, heads * n), o_dtype) if heads_flat else
                jax.ShapeDtypeStruct((nsel, n_out), o_dtype) if in_kernel_epilogue
                else jax.ShapeDtypeStruct((split, p, nsel, n_out), F32))
    if normed_out:
        out_type = (out_type, jax.ShapeDtypeStruct((t, k), BF16))
    grid, names = ((row_blocks,), ("n",)) if cluster else ((row_blocks, split), ("n", "s"))
    if experts:
        grid, names = grid + (nsel,), names + ("e",)
    clusters = dict(cluster=(split,), cluster_names=("s",)) if cluster else {}
    kernel_name = _kernel_name(cfg.engine, kind, n, k, heads=heads > 0, splits=splits is not None,
                               experts=ids is not None, norm=norm is not None, residual=residual is not None)
    args = [x] + ([m_parts.astype(F32), l_parts.astype(F32)] if splits is not None else [])
    args += [ids.astype(jnp.int32)] if ids is not None else []
    args += hw.layer_operands(layer) + list(ws)
    if fp8:
        args += [s.astype(F32) for s in scales]
    if norm is not None:
        args.append(norm)
    if residual is not None and in_kernel_epilogue:
        args.append(residual)

    def finish(out):
        out, x_normed = out if normed_out else (out, None)
        y = _projection_result(out if padded or heads_flat else out[..., :n], in_kernel_epilogue, partials, p, kind,
                               residual, out_dtype)
        return (y, x_normed) if normed_out else y
    return ProjectionPlan(body=body, args=args, out_type=out_type, scratch=scratch, grid=grid, names=names,
                          clusters=clusters, kernel_name=kernel_name, cfg=cfg, finish=finish)


def _projection_result(out, in_kernel_epilogue, partials, p, kind, residual, out_dtype):
    """`_projection`'s result from its kernel's output (N columns): the partials as asked, the rows
    as stored, or the split-K partials summed by XLA with the epilogue."""
    if partials and p == 2:
        return out
    if partials:
        return out[None] if in_kernel_epilogue else out[:, 0]
    if in_kernel_epilogue:
        return out
    return finish_partials(out, kind=kind, residual=residual, out_dtype=out_dtype)


def finish_partials(parts, *, kind: str, residual=None, out_dtype=BF16):
    """The split-K partials [S, P, T, N] fp32 summed in split order, then the epilogue of `kind` (one XLA
    fusion): e.g. the routed experts' h from their gate/up partials (kind "swiglu_f32")."""
    part = parts.sum(0)                                # [P, T, N]
    return _finish([part[j] for j in range(parts.shape[1])], kind=kind, residual=residual, out_dtype=out_dtype)


def _kernel_name(engine: str, kind: str, n: int, k: int, **forms: bool) -> str:
    """The kernel's name, which profiles (CUPTI, bench.decode's kernel groups) show: the engine, the
    forms it runs (heads, experts, norm, the SwiGLU epilogues, residual) and its N × K, so that each
    projection of a layer is told apart, e.g. jtilert_gemv_fp8x2_norm_2240x7168."""
    parts = ["jtilert_gemv", engine] + [f for f, on in forms.items() if on]
    if kind != "linear":
        parts.append(kind)
    return "_".join(parts + [f"{n}x{k}"])


def _prep_weight(w, scale, layer=None):
    """bf16 and fp8(+scales) stream as stored; other float weights are rounded to bf16 once
    (what the reference's dequantize(w, None, bf16) does), except layer stacks: an fp32 stack
    streams as stored (FMA engine) instead of a cast of the whole stack in every call."""
    if w.dtype == FP8:
        return w, scale
    if scale is not None:
        raise ValueError("block scales only go with fp8 weights")
    if w.dtype == BF16 or (layer is not None and w.dtype == F32):
        return w, None
    if layer is not None:
        raise ValueError(f"stacked weights must be bf16, fp8 or fp32, got {w.dtype} (convert once at load time)")
    return w.astype(BF16), None


# ---- public wrappers (same signatures as jtilert.ops.reference, plus layer=) ---------------------------
#
# layer=None: W [N, K] (scales [N/128, K/128]). layer = a `jtilert.ops.layer.Layer` or an int32
# scalar (may be traced): every weight, scale and norm-weight argument is a stack with a leading
# layer axis, and the result is the unstacked op on layer `layer`, read in place by the kernel.

def linear(x, w, scale=None, *, layer=None, config: GemvConfig | None = None):
    """jtilert.ops.reference.linear: y = x · Wᵀ, x [..., K] bf16, W [N, K] bf16 or fp8 (+ scale)."""
    w, scale = _prep_weight(w, scale, layer)
    return hw.token_chunks(x, lambda xc, _: _projection(xc, (w,), (scale,), layer=layer, config=config))


def linear_residual(x, w, scale, residual, *, layer=None, config: GemvConfig | None = None):
    """residual + linear(x, w, scale), the add in the epilogue (rounded like the reference)."""
    w, scale = _prep_weight(w, scale, layer)
    res2 = residual.reshape(-1, residual.shape[-1])
    return hw.token_chunks(x, lambda xc, sl: _projection(xc, (w,), (scale,), residual=res2[sl], layer=layer,
                                                 out_dtype=residual.dtype, config=config))


def norm_operand(norm_weight, x, layer, k=None):
    """A norm weight as the kernels take it ([K], [L, K] with layer=; bf16: the reference multiplies
    in x's dtype), or None."""
    if norm_weight is None:
        return None
    k = x.shape[-1] if k is None else k
    if norm_weight.ndim != (1 if layer is None else 2) or norm_weight.shape[-1] != k or x.shape[-1] < k:
        raise ValueError(f"norm weight {norm_weight.shape} does not match x {x.shape}")
    return norm_weight.astype(BF16)


def rmsnorm_linear(x, norm_weight, eps, w, scale=None, *, layer=None, config: GemvConfig | None = None):
    """linear(rms_norm(x[..., :K], norm_weight, eps), w, scale) in one kernel (norm_weight [K], [L, K]
    with layer=): x may be wider than K (another projection's output, its first K columns the input)."""
    w, scale = _prep_weight(w, scale, layer)
    k = norm_weight.shape[-1]
    nw = norm_operand(norm_weight, x, layer, k)
    return hw.token_chunks(x, lambda xc, _: _projection(xc, (w,), (scale,), norm=nw, eps=eps, layer=layer,
                                                config=config, prefix=x.shape[-1] > k))


INDEX_WEIGHTS_MAX_SPLIT = 32   # the head weights' CTAs per row block, at most (DeepSeek-V3.2: 28)


def index_weights(x, norm_weight, eps, w, *, layer=None, config: GemvConfig | None = None):
    """jtilert.ops.reference.index_weights: rms_norm(x, norm_weight, eps) times fp32 weights W [H, K]
    ([L, H, K] with layer=) on the FMA engine, which rounds the normed x as the reference does; fp32
    sums, the split-K partials summed by XLA after the kernel. The result is [T, H'] fp32, H' = H
    rounded up to whole 64-column blocks (the columns past H are not the product): its consumer
    (`index_prep`) reads the first H columns of each row in place, so no slice runs between the two.
    By default K is split into the most slices of whole 64-column grains, up to INDEX_WEIGHTS_MAX_SPLIT:
    the few row blocks need many CTAs, and the shape's own split (8 CTAs, in a cluster or not) made the
    kernel long enough to delay the layer's indexer."""
    if w.dtype != F32:
        raise ValueError(f"index_weights: fp32 weights, got {w.dtype}{list(w.shape)}")
    grains = w.shape[-1] // KGRAIN
    if config is None:
        split = max(s for s in range(1, INDEX_WEIGHTS_MAX_SPLIT + 1) if grains % s == 0) if grains else 0
        config = GemvConfig(split_k=split, split_sum="xla")
    nw = norm_operand(norm_weight, x, layer)
    return hw.token_chunks(x, lambda xc, _: _projection(xc, (w,), (None,), norm=nw, eps=eps, layer=layer,
                                                out_dtype=F32, config=config, padded=True))


def swiglu_pair(x, gate, gate_scale, up, up_scale, norm_weight=None, eps=0.0, *, layer=None,
                config: GemvConfig | None = None, unsummed: bool = False):
    """silu(linear(x, gate)) · linear(x, up) (fp32 math, bf16 result) in one pass over both weights;
    x normed in the kernel where a norm weight is given (`jtilert.ops.reference.swiglu_hidden`).
    `unsummed` (T ≤ MAX_TOKENS): where the kernel splits K, its gate and up partials [split, 2, T, I]
    fp32 as they are, for a down kernel to finish (`moe.expert_down(kind="swiglu")`); else h in fp32."""
    gate, gate_scale = _prep_weight(gate, gate_scale, layer)
    up, up_scale = _prep_weight(up, up_scale, layer)
    if gate.dtype != up.dtype:
        raise ValueError("gate and up must have the same format")
    nw = norm_operand(norm_weight, x, layer)
    if unsummed:
        if x.shape[0] > MAX_TOKENS:
            raise ValueError(f"swiglu_pair unsummed: at most {MAX_TOKENS} tokens, got {x.shape[0]}")
        return _projection(x, (gate, up), (gate_scale, up_scale), kind="swiglu", norm=nw, eps=eps, layer=layer,
                           config=config, partials=True, out_dtype=F32)
    return hw.token_chunks(x, lambda xc, _: _projection(xc, (gate, up), (gate_scale, up_scale), kind="swiglu",
                                                norm=nw, eps=eps, layer=layer, config=config))


def swiglu(x, gate, gate_scale, up, up_scale, down, down_scale, *, layer=None,
           config: GemvConfig | None = None, down_config: GemvConfig | None = None):
    """jtilert.ops.reference.swiglu: down(silu(gate(x)) · up(x)) as two kernels (pair, then down)."""
    h = swiglu_pair(x, gate, gate_scale, up, up_scale, layer=layer, config=config)
    return linear(h, down, down_scale, layer=layer, config=down_config)


def heads_linear(x, w, scale=None, block: int = QBLOCK, head_dim: int | None = None, *, layer=None,
                 config: GemvConfig | None = None):
    """jtilert.ops.reference.heads_linear, one launch for all heads: y[t, h] = x[t, h, :K] · W[h]ᵀ.
    x [T, H, D ≥ K] bf16, or [T, W ≥ H·D] with head_dim=D (head h's row at columns h·D.. of row t:
    another projection's output, read in place); W [H, N, K] ([L, H, N, K] with layer=) bf16, or
    fp8 with scales [H, N/block, K/block]. Expert mode with the heads as the experts: token t's
    selection h reads columns h·D.. of x's row t and multiplies them with stack entry h (+ layer·H)."""
    h = w.shape[-3]
    if x.ndim == 3:
        if x.shape[1] != h or head_dim not in (None, x.shape[2]):
            raise ValueError(f"heads_linear: x {x.shape} (head_dim {head_dim}) for {h} heads of weights {w.shape}")
        head_dim = x.shape[2]
        x = x.reshape(x.shape[0], -1)              # a free reshape of the whole array
    elif head_dim is None or x.ndim != 2 or x.shape[1] < h * head_dim:
        raise ValueError(f"heads_linear: x {x.shape} (head_dim {head_dim}) for {h} heads of weights {w.shape}")
    t = x.shape[0]
    w, scale = _prep_weight(w, scale, layer)
    # the heads as experts 0..h-1 of every token, computed in the kernel (an ids operand would be an
    # iota, which XLA materialises with a kernel of its own in every layer)
    y = _projection(x, (w,), (scale,), heads=h, layer=layer, scale_block=block, prefix=True, stride=head_dim,
                    out_dtype=x.dtype, config=config)
    return y.reshape(t, h, -1)


def heads_linear_of_splits(o, m, l, w, scale=None, block: int = QBLOCK, *, layer=None,
                           config: GemvConfig | None = None):
    """heads_linear(combine(o, m, l) rounded to bf16, W) in one launch: each CTA merges its head's
    split partials of sparse MLA (o [T, G, n, Hc, K] fp32, m, l [T, G, n, Hc]; head j = g·Hc + h) in
    place of reading x, so no combine kernel runs before it. W [H, N, K] ([L, H, N, K] with layer=)
    fp8 with `block`-blocks of scales (128, or 64: the wgmma engine), or bf16; K a multiple of 128 →
    [T, H, N] bf16."""
    h = w.shape[-3]
    w, scale = _prep_weight(w, scale, layer)
    y = _projection(None, (w,), (scale,), heads=h, layer=layer, scale_block=block, out_dtype=BF16, config=config,
                    splits=(o, m, l))
    return y.reshape(o.shape[0], h, -1)


# ---- benchmark entry ----------------------------------------------------------------------------

def _bench():  # pragma: no cover - GPU only
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
