"""Issue 14's question for Pallas: dependent fp8 GEMVs as the phases of one Mosaic-GPU kernel, handed
off through a grid-wide GMEM semaphore, against one launch per GEMV (bench/experiments/gemv_chain.cu
asked it of a CUDA kernel with CUDA-core arithmetic; this asks it of the fp8x2 wgmma arithmetic the
step's GEMVs run).

The chain: x_{p+1} = bf16(W_p x_p) for P GEMVs, W_p alternately [N_a, K_a] and [N_b, K_b] e4m3 with
128-block scales, each reading the first K columns of the output before (`pair_dims`; by default
[7168, 2048] and [2048, 7168]: 14.7 MB each, every W distinct, 470 MB a chain; the attention's input
pair, x_proj then q_b | wq_b, is [2304, 7168] and [11264, 1536]). One phase body (`gemv_phase`) does a
CTA's share of a GEMV: one work unit, up to four consecutive row blocks of 64 rows and one K slice
(`plan`), so x is prepared once and the unit's tiles stream as one pipeline (`_hopper.stream_tiles`),
x as two e4m3 halves in one wgmma B (`_hopper.wgmma_fp8_pair_step`, the shipped fp8x2 engine's step),
its fp32 partial row blocks written by TMA; the next GEMV's CTAs copy in the partials of their K slice,
sum them and round them to bf16. `--attn`: the attention's input pairs as the step runs them instead
of a chain: each even GEMV (x_proj-like) of x0, each odd one (q_b | wq_b-like) of the output before,
every input RMS-normed in the phase (each CTA sums the squares of the whole row); the phases still wait
for each other, and form `shipped` is the step's own `rmsnorm_linear` pair.
Forms:
  shipped    the step's own GEMV kernels, one a GEMV, for scale (`gemv.linear`; the attention pair as the
             step runs it, `gemv.rmsnorm_linear`, its norms included)
  launches   one kernel per GEMV (the step's form: each kernel waits for the one before)
  barrier    one kernel of `ctas` CTAs; before a GEMV each CTA waits until every CTA has arrived
             after the GEMV before (one GMEM semaphore counting arrivals), then asks for its weights
  prefetch   the same, each CTA asking for its first `stages` weight tiles before it waits
  ring       prefetch without arithmetic: each phase's weights streamed and dropped, the semaphore kept
  stream     the weight stream alone: no arithmetic, no semaphore (the floor of this kernel's structure)
Every arithmetic form's every GEMV is checked against XLA's product from the form's own input to it.
Times:
CUPTI kernel µs per GEMV (a form's kernels over P: the figure to compare) and the wall clock per GEMV
of `calls` calls enqueued back to back (gaps between kernels included, and the host's launches where
they are slower than the kernels); the copy rate of the same run (`bench.decode.copy_bandwidth`).

    python -m bench.experiments.pallas_chain --out pallas_chain.json [--gemvs 32] [--dims 7168,2048] [--ctas 128]
        [--forms launches,prefetch] [--attn]
    (GPU; the one-kernel forms need every CTA resident: --ctas at most the SMs)
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

from jtilert.ops import reference
from jtilert.ops.quant import dequantize, quantize_weight
from jtilert.pallas import _hopper as hw
from jtilert.pallas import gemv
from jtilert.pallas import interpret as interp
from jtilert.pallas._hopper import BF16, F32, FP8, MAX_TOKENS, QBLOCK, X_LAYOUT

BN = 64        # rows of a CTA's block (wgmma's M)
BK = 256       # K columns of a pipeline step
STAGES = 4     # weight steps in flight, at most
STAGE_BYTES = 128 * 1024   # SMEM for the weight tiles in flight
GROUP_MAX = 4  # row blocks of one CTA's unit, at most (a wgmma accumulator each)
FORMS = ("shipped", "launches", "barrier", "prefetch", "ring", "stream")
FLOORS = ("ring", "stream")   # no arithmetic: what the weight stream (and the handoffs) take alone
EPS = 1e-6     # the shipped attention pair's norms


def plan(n: int, k: int, ctas: int) -> tuple[int, int, int]:
    """(row blocks, K slices, row blocks a unit) of an [n, k] GEMV over `ctas` CTAs, one work unit a
    CTA at most: a unit is `group` consecutive row blocks' K slice of whole steps, so its CTA prepares x
    once and streams its tiles as one pipeline. The split whose units fit the CTAs with the fewest weight
    columns a CTA (group · K / split, group ≤ GROUP_MAX); the fewest slices among equals (the GEMV
    after reads one partial a slice)."""
    if n % QBLOCK or k % BK:
        raise ValueError(f"chain GEMV [{n}, {k}]: rows a multiple of {QBLOCK}, K of {BK}")
    blocks = n // BN
    fits = []
    for split in range(1, min(ctas, k // BK) + 1):
        if k % (split * BK) == 0:
            group = -(-blocks // (ctas // split))
            if group <= GROUP_MAX:
                fits.append((group * k // split, split, group))
    if not fits:
        raise ValueError(f"chain GEMV [{n}, {k}]: more than {GROUP_MAX} row blocks a CTA over {ctas} CTAs")
    _, split, group = min(fits)
    return blocks, split, group


def stages_for(group: int) -> int:
    """Weight steps in flight for a unit of `group` row blocks: STAGES, fewer where their tiles would
    pass STAGE_BYTES (at least 2)."""
    return max(2, min(STAGES, STAGE_BYTES // (group * BN * BK)))


def pair_dims(dims: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(N_a, K_a, N_b, K_b) of the chain's two GEMV shapes from `--dims`: big,small (the pair [big, small],
    [small, big]) or all four. Each reads the first K columns of the other's output (K_b ≤ N_a, K_a ≤ N_b:
    the attention's input pair, x_proj then q_b | wq_b reading q_a, is [2304, 7168], [11264, 1536])."""
    na, ka, nb, kb = (dims[0], dims[1], dims[1], dims[0]) if len(dims) == 2 else dims
    if kb > na or ka > nb:
        raise ValueError(f"chain shapes [{na}, {ka}], [{nb}, {kb}]: each K at most the other's N")
    return na, ka, nb, kb


def shapes(dims: tuple[int, ...], gemvs: int) -> list[tuple[int, int]]:
    """[N, K] of each GEMV of the chain: [N_a, K_a], [N_b, K_b], ... (`pair_dims`)."""
    na, ka, nb, kb = pair_dims(dims)
    return [(na, ka) if p % 2 == 0 else (nb, kb) for p in range(gemvs)]


def gemv_phase(cta, *, n: int, k: int, ctas: int, w, s, wid, x_in, out_at, scratch, wait=None,
               prefetch: bool = True, math: bool = True, norm: bool = False):
    """CTA `cta`'s unit of one GEMV (`plan`): row blocks rg·group .. rg·group + group − 1 of w[wid] [n, k]
    (e4m3, scales s[wid] [n/128, k/128]) against x's K slice, x_in = ("bf16", x [K]) or ("partials",
    parts, S) with parts(i) the GEMV before's fp32 partials of K slice i as a GMEM [K/128, 128] (x their
    sum in split order, rounded to bf16, as XLA between two GEMVs). out_at(split, row0): the GMEM
    destination ([64] fp32) of a row block's partial sums. `wait()`: run before x is read, after the
    unit's first weight tiles are asked for (`prefetch`) or before them (the CTAs without a unit run it
    too). `scratch`: `_scratch`'s buffers (with `norm`, its staging holds all K columns' partials).
    `norm`: x is RMS-normed over its K columns first, as `reference.rms_norm` with a weight of ones
    (every CTA sums the squares of the whole row). Without `math` the weight tiles are streamed and
    dropped: no x, no arithmetic, no output."""
    blocks, split, group = plan(n, k, ctas)
    groups = -(-blocks // group)
    kc = k // split
    nblk = kc // QBLOCK
    w_tr, sub = hw.weight_transforms(BK, 1)   # sub: one 128-column scale block
    nsub = BK // sub
    xb, sx, o_smem, stage, xbar = scratch
    if wait is not None and not prefetch:
        wait()
    elif wait is not None:
        pl.when(cta >= groups * split)(wait)
    first_wait = wait if prefetch else None

    def unit():
        s_idx = cta // groups
        k0 = s_idx * kc
        rb0 = (cta % groups) * group   # the unit's first row block
        # the unit's row blocks; a last group short of `group` re-reads its last block (never written)
        rbs = [jnp.minimum(rb0 + j, blocks - 1) for j in range(group)]
        tiles = [lambda step, rb=rb: w.at[wid, pl.ds(rb * BN, BN), pl.ds(k0 + step * BK, BK)] for rb in rbs]
        stream = functools.partial(hw.stream_tiles, steps=kc // BK, stages=stages_for(group), tiles=tiles,
                                   shape=(BN, BK), dtype=FP8, transforms=w_tr)
        if not math:
            stream(lambda step, *refs: refs[-1], carry=k0 * 0, first=first_wait)
            return

        def scales_at(step):
            kb = jnp.minimum((k0 + step * BK) // QBLOCK, k // QBLOCK - nsub)
            return tuple(tuple(s[wid, rb * BN // QBLOCK, kb + h] for h in range(nsub)) for rb in rbs)

        def x_columns():
            """x's slice as fp32 rows of 128 columns (bf16 values; normed with `norm`). The partials
            come by TMA, as the async copies that wrote them (the semaphore orders the two)."""
            staged = k // QBLOCK if norm else nblk   # 128-column blocks of partials staged
            base = 0 if norm else k0 // QBLOCK       # the first staged block's place in x
            if x_in[0] == "bf16":
                block = lambda b: plgpu.load(x_in[1].at[pl.ds(b * QBLOCK, QBLOCK)], optimized=False).astype(F32)
            else:
                _, parts, splits = x_in
                for sp in range(splits):
                    plgpu.copy_gmem_to_smem(parts(sp).at[pl.ds(base, staged)], stage.at[sp, pl.ds(0, staged)],
                                            xbar.at[sp])
                for sp in range(splits):
                    plgpu.barrier_wait(xbar.at[sp])

                def block(b):   # summed in split order, rounded to bf16 (b: the block's place in x)
                    v = None
                    for sp in range(splits):
                        part = plgpu.load(stage.at[sp, b - base], optimized=False)
                        v = part if v is None else v + part
                    return v.astype(BF16).astype(F32)
            cols = [block(k0 // QBLOCK + b) for b in range(nblk)]
            if not norm:
                return cols
            squares = sum(jnp.sum(v * v) for v in (block(b) for b in range(k // QBLOCK)))
            rstd = lax.rsqrt(squares / k + EPS)
            return [(v * rstd).astype(BF16).astype(F32) for v in cols]

        def first():
            """While the first weight tiles arrive: x's slice split into its two e4m3 halves."""
            if first_wait is not None:
                first_wait()
            cols = x_columns()
            rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (MAX_TOKENS, QBLOCK), 0), X_LAYOUT)

            def tile(b):
                v = plgpu.layout_cast(lax.broadcast_in_dim(cols[b], (MAX_TOKENS, QBLOCK), (1,)), X_LAYOUT)
                return jnp.where(rows == 0, v, 0.0)
            sx[0] = hw.store_fp8_pair(hw.pair_rows(xb, QBLOCK), tile, nblk)
            plgpu.commit_smem()

        def body(step, *refs):
            w_smems, (accs, scs) = refs[:-1], refs[-1]
            nxt = scales_at(step + 1)
            accs = tuple(hw.wgmma_fp8_pair_step(acc, w_smem, xb, step * BK, [f * sx[0] for f in sc], nsub=nsub,
                                                sub=sub) for acc, w_smem, sc in zip(accs, w_smems, scs))
            return accs, nxt

        col_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (BN, hw.PAIR_COLS), 1), plgpu.Layout.WGMMA)
        zeros = jnp.where(col_id < 0, 1.0, 0.0).astype(F32)
        _, (accs, _) = stream(body, carry=((zeros,) * group, scales_at(0)), first=first)
        for j, acc in enumerate(accs):
            o_smem[j] = hw.pair_column(acc, col_id, 0)
        plgpu.commit_smem()
        for j in range(group):
            row0 = (rb0 + j) * BN
            pl.when(row0 < n)(lambda j=j, row0=row0: plgpu.copy_smem_to_gmem(o_smem.at[j], out_at(s_idx, row0)))
        plgpu.wait_smem_to_gmem(0)   # the writes done, not only read from SMEM: others read them next

    pl.when(cta < groups * split)(unit)


def _scratch(kc: int, splits: int, staged: int | None = None) -> list:
    """x's halves (`hw.pair_operand`), x's scale, the output blocks of a unit, the staged partials of
    `splits` K slices (`staged` columns of each; default kc) and their barriers."""
    staged = kc if staged is None else staged
    return [hw.pair_operand(kc), plgpu.SMEM((1,), F32), plgpu.SMEM((GROUP_MAX, BN), F32),
            plgpu.SMEM((max(splits, 1), staged // QBLOCK, QBLOCK), F32), plgpu.Barrier(num_barriers=max(splits, 1))]


def _rows(ref, row0):
    """A [.., N/128, 128] partials ref's rows row0..row0+63."""
    return ref.at[row0 // QBLOCK, pl.ds(row0 % QBLOCK, BN)]


@functools.partial(jax.jit, static_argnames=("n", "k", "ctas", "norm"))
def launch(x, w, s, wid, *, n: int, k: int, ctas: int, norm: bool = False):
    """One GEMV as a kernel of its own: x bf16 [K] or the GEMV before's fp32 partials [S, K/128, 128];
    w [L, n, k] e4m3, s [L, n/128, k/128], wid int32 [1]; `norm`: x RMS-normed first (`gemv_phase`).
    Returns its partials [split, n/128, 128]."""
    _, split, _ = plan(n, k, ctas)
    splits_in = 0 if x.ndim == 1 else x.shape[0]

    def kernel(x_ref, w_ref, s_ref, wid_ref, out_ref, *scratch):
        x_in = ("bf16", x_ref) if splits_in == 0 else ("partials", lambda i: x_ref.at[i], splits_in)
        gemv_phase(lax.axis_index("c"), n=n, k=k, ctas=ctas, w=w_ref, s=s_ref, wid=wid_ref[0], x_in=x_in,
                   out_at=lambda sp, row0: _rows(out_ref.at[sp], row0), scratch=scratch, norm=norm)

    scratch = _scratch(k // split, splits_in, k if norm else None)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((split, n // QBLOCK, QBLOCK), F32), grid=(ctas,),
                        grid_names=("c",), scratch_types=scratch, interpret=interp.params(),
                        kernel_name=f"chain_launch_{n}x{k}")(x, w, s, wid)


def _dims(wa, wb) -> tuple[int, int, int, int]:
    return (*wa.shape[1:], *wb.shape[1:])


def run_launches(x0, wa, sa, wb, sb, *, ctas: int, attn: bool = False) -> list:
    """The chain as one kernel per GEMV (`attn`: `persistent`'s attention pairs): every GEMV's partials."""
    outs, x = [], x0
    for p, (n, k) in enumerate(shapes(_dims(wa, wb), 2 * wa.shape[0])):
        w, s = (wa, sa) if p % 2 == 0 else (wb, sb)
        x = launch(x0 if attn and p % 2 == 0 else x, w, s, jnp.full((1,), p // 2, jnp.int32), n=n, k=k, ctas=ctas,
                   norm=attn)
        outs.append(x)
    return outs


@functools.partial(jax.jit, static_argnames=("ctas", "form", "attn"))
def persistent(x0, wa, sa, wb, sb, *, ctas: int, form: str, attn: bool = False):
    """The chain as one kernel of `ctas` CTAs (all resident at once: at most one per SM), the GEMVs
    its phases. Before phase p every CTA waits until the semaphore has counted p · ctas arrivals (each
    CTA arrives once a phase, after its partials are written), so phase p − 1 is complete; a CTA
    arrives only after its own wait, so the count cannot run ahead of a late CTA. `form`: one of FORMS
    but "launches". `attn`: the attention's input pairs as the step runs them, each even GEMV
    (x_proj-like) of x0 and each odd one (q_b | wq_b-like) of the output before, every input RMS-normed
    (`gemv_phase`'s `norm`); the even phases still wait for the phase before. Returns every GEMV's
    partials, [P, max split, max N/128, 128] (a GEMV of N rows and S slices in [p, :S, :N/128];
    unwritten in the FLOORS)."""
    (na, ka, nb, kb), gemvs = _dims(wa, wb), 2 * wa.shape[0]
    math, synced = form not in FLOORS, form != "stream"
    (_, split_a, _), (_, split_b, _) = plan(na, ka, ctas), plan(nb, kb, ctas)
    width = max(ka // split_a, kb // split_b)

    def kernel(x_ref, wa_ref, sa_ref, wb_ref, sb_ref, out_ref, *scratch):
        cta = lax.axis_index("c")
        arrivals = pl.get_global(plgpu.SemaphoreType.REGULAR) if synced else None

        def phase(p, w, s, wid, n, k, splits_in, of_x=False):
            """GEMV p: of x where `of_x`, else of the partials of GEMV p − 1 (`splits_in` K slices)."""
            first = isinstance(p, int) and p == 0
            x_in = ("bf16", x_ref) if of_x else ("partials", lambda i: out_ref.at[p - 1, i], splits_in)
            wait = None if first or not synced else (
                lambda: plgpu.semaphore_wait(arrivals, p * ctas, decrement=False, memory_scope="gpu"))
            gemv_phase(cta, n=n, k=k, ctas=ctas, w=w, s=s, wid=wid, x_in=x_in,
                       out_at=lambda sp, row0: _rows(out_ref.at[p, sp], row0), scratch=scratch,
                       wait=wait, prefetch=form != "barrier", math=math, norm=attn)
            if synced:
                plgpu.semaphore_signal(arrivals, 1, memory_scope="gpu")

        phase(0, wa_ref, sa_ref, 0, na, ka, 0, of_x=True)

        @pl.loop(0, gemvs // 2)
        def _(j):
            phase(2 * j + 1, wb_ref, sb_ref, j, nb, kb, split_a)

            @pl.when(j + 1 < gemvs // 2)
            def _():
                phase(2 * j + 2, wa_ref, sa_ref, j + 1, na, ka, split_b, of_x=attn)

    out_type = jax.ShapeDtypeStruct((gemvs, max(split_a, split_b), max(na, nb) // QBLOCK, QBLOCK), F32)
    return plgpu.kernel(kernel, out_type=out_type, grid=(ctas,), grid_names=("c",),
                        scratch_types=_scratch(width, max(split_a, split_b), kb if attn else None),
                        interpret=interp.params(),
                        kernel_name=f"chain_{form}")(x0, wa, sa, wb, sb)


@functools.partial(jax.jit, static_argnames=("normed",))
def _shipped_gemv(x, w, s, layer, *, normed: bool):
    """One GEMV of `run_shipped`, jitted so that every call of a shape traces (and lowers) its kernel
    once, as the step's layer loop does: `gemv.rmsnorm_linear` of x (a norm weight of ones, EPS) or
    `gemv.linear`."""
    if normed:
        return gemv.rmsnorm_linear(x, jnp.ones((w.shape[0], w.shape[-1]), BF16), EPS, w, s, layer=layer)
    return gemv.linear(x, w, s, layer=layer)


def run_shipped(x0, wa, sa, wb, sb, *, attn: bool = False) -> list:
    """The chain on the step's own GEMV kernels, for scale: its outputs [1, N] bf16. `attn`: the
    attention's input pairs as the step runs them (`persistent`), `gemv.rmsnorm_linear` of x0, then of
    the first K columns of its output. Else `gemv.linear` down the chain, which reads all of x: chains
    of two numbers (`pair_dims`)."""
    na, ka, nb, kb = _dims(wa, wb)
    if not attn and (ka, kb) != (nb, na):
        raise ValueError("the shipped GEMV reads all of x: a chain of two numbers (--dims big,small), or --attn")
    outs, x = [], x0[None]
    for p in range(2 * wa.shape[0]):
        w, s = (wa, sa) if p % 2 == 0 else (wb, sb)
        x = _shipped_gemv(x0[None] if attn and p % 2 == 0 else x, w, s, jnp.int32(p // 2), normed=attn)
        outs.append(x)
    return outs


def run_raw(form: str, x0, wa, sa, wb, sb, *, ctas: int, attn: bool = False):
    """The form's kernels and nothing else (what is timed): their outputs as they write them."""
    if form == "launches":
        return run_launches(x0, wa, sa, wb, sb, ctas=ctas, attn=attn)
    if form == "shipped":
        return run_shipped(x0, wa, sa, wb, sb, attn=attn)
    return persistent(x0, wa, sa, wb, sb, ctas=ctas, form=form, attn=attn)


def run_form(form: str, x0, wa, sa, wb, sb, *, ctas: int, attn: bool = False) -> list:
    """Every GEMV's partials [split, N] under `form`."""
    outs = run_raw(form, x0, wa, sa, wb, sb, ctas=ctas, attn=attn)
    if form == "shipped":
        return [o.astype(F32) for o in outs]
    if form != "launches":
        outs = [outs[p, :plan(n, k, ctas)[1], :n // QBLOCK]
                for p, (n, k) in enumerate(shapes(_dims(wa, wb), outs.shape[0]))]
    return [o.reshape(o.shape[0], -1) for o in outs]


def chain_weights(key, dims: tuple[int, ...], gemvs: int):
    """x0 bf16 [K_a] and the stacks wa [P/2, N_a, K_a], wb [P/2, N_b, K_b] (`pair_dims`; e4m3, rows of
    unit scale: the chain's values stay near 1) with their block scales."""
    if gemvs % 2:
        raise ValueError(f"the chain alternates two shapes: an even number of GEMVs, got {gemvs}")
    na, ka, nb, kb = pair_dims(dims)
    kx, k_a, k_b = jax.random.split(key, 3)

    def stack(k, n, kk):
        ws = [quantize_weight(jax.random.normal(jax.random.fold_in(k, i), (n, kk), F32) / np.sqrt(kk))
              for i in range(gemvs // 2)]
        return jnp.stack([w for w, _ in ws]), jnp.stack([s for _, s in ws])
    x0 = jax.random.normal(kx, (ka,), F32).astype(BF16)
    return (x0, *stack(k_a, na, ka), *stack(k_b, nb, kb))


def check(outs: list, x0, wa, sa, wb, sb, attn: bool = False) -> list[float]:
    """Each GEMV's relative L2 error against XLA's fp32 product of its dequantised weight and the
    form's own input to it: x0, then the first K of the partials before, summed and rounded to bf16;
    `attn`: x0 for every even GEMV, every input RMS-normed first (`reference.rms_norm`, a weight of
    ones)."""
    errs, x = [], x0.astype(F32)
    for p, parts in enumerate(outs):
        w, s = (wa, sa) if p % 2 == 0 else (wb, sb)
        xk = (x0.astype(F32) if attn and p % 2 == 0 else x)[:w.shape[-1]]
        if attn:
            xk = reference.rms_norm(xk.astype(BF16), jnp.ones(xk.shape, BF16), EPS).astype(F32)
        want = jnp.dot(dequantize(w[p // 2], s[p // 2], F32), xk, precision=lax.Precision.HIGHEST)
        got = parts.sum(axis=0)
        errs.append(float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)))
        x = got.astype(BF16).astype(F32)
    return errs


def main(argv=None) -> int:  # pragma: no cover - GPU only
    from bench import provenance
    from bench.decode import _cupti, copy_bandwidth
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="pallas_chain.json")
    ap.add_argument("--gemvs", type=int, default=32)
    ap.add_argument("--dims", default="7168,2048", help="big,small or N_a,K_a,N_b,K_b (pair_dims)")
    ap.add_argument("--ctas", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--forms", default=",".join(FORMS), help="the forms to run, in this order")
    ap.add_argument("--attn", action="store_true", help="the attention's input pairs, inputs normed (`persistent`)")
    a = ap.parse_args(argv)
    dims = tuple(int(d) for d in a.dims.split(","))
    args = chain_weights(jax.random.key(0), dims, a.gemvs)
    nbytes = sum(int(w.nbytes + s.nbytes) for w, s in (args[1:3], args[3:5]))
    copy = copy_bandwidth()
    result = dict(device=jax.devices()[0].device_kind, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  commit=provenance.commit(), command=provenance.command("bench.experiments.pallas_chain", argv),
                  dims=dims, gemvs=a.gemvs, ctas=a.ctas, attn=a.attn, mb_per_gemv=nbytes / a.gemvs / 1e6, copy_gbs=copy / 1e9,
                  bytes_us_per_gemv=nbytes / a.gemvs / copy * 1e6, forms={})
    for form in a.forms.split(","):
        run = jax.jit(functools.partial(run_raw, form, ctas=a.ctas, attn=a.attn))
        try:
            errs = [0.0] if form in FLOORS else check(
                jax.jit(functools.partial(run_form, form, ctas=a.ctas, attn=a.attn))(*args), *args, attn=a.attn)
            kernels, busy = _cupti(lambda: run(*args))
            jax.block_until_ready(run(*args))
            t0 = time.perf_counter()
            for _ in range(a.calls):   # enqueued back to back: the device, not the host, sets the pace
                outs = run(*args)
            jax.block_until_ready(outs)
            wall = (time.perf_counter() - t0) / a.calls
            tol = 1e-2 if form == "shipped" else 2e-3   # shipped: every output rounded to bf16
            row = dict(max_rel_err=None if form in FLOORS else max(errs), ok=max(errs) < tol, kernels=len(kernels),
                       kernel_us_per_gemv=busy * 1e6 / a.gemvs,
                       wall_us_per_gemv=wall * 1e6 / a.gemvs)
        except Exception as e:  # noqa: BLE001 - a form that fails is a result too
            row = dict(error=f"{type(e).__name__}: {e}"[:2000])
        result["forms"][form] = row
        print(form, json.dumps(row), flush=True)
        with open(a.out, "w") as f:   # after every form: a form that hangs leaves the others' figures
            json.dump(result, f, indent=1)
    return 0 if all(r.get("ok") for r in result["forms"].values()) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
