"""The routed experts' gate/up and down as two phases of one Mosaic-GPU kernel (decode, fp8 experts): the op
table's `moe_experts` kernel.

`moe.moe_experts` runs them as two kernels: the gate/up kernel writes its split-K partials, the down
kernel copies them into shared memory and streams the down weights. Each launch pays its own ramp (its
first weight tiles' latency, x's preparation) and its tail (the last CTAs finishing). Here one kernel of
C CTAs (at most one per SM, so that all are resident at once) runs both phases:

1. gate/up: CTA c < units runs unit c of the gate/up GEMV (`gate_up_plan`: a row block of one selected
   expert's gate and up rows over one K slice, x as two e4m3 halves, the fp8x2 engine) and writes its
   fp32 partial sums to the kernel's second output, [split, 2, T·k, I], with TMA;
2. the handoff: each CTA arrives at a grid-wide GMEM semaphore (`pl.get_global`, zeroed by JAX before
   each call) once its partial sums are written;
3. down: CTA c < row blocks · split runs `moe.down_plan`'s kernel body for its block: it asks for its first
   down weight tiles (the experts' ids are known before the kernel starts), then waits until all C CTAs
   have arrived, copies the partials in and finishes h = silu(Σ gate) · Σ up while those tiles land.

So the down weights' first tiles are in flight while the last gate/up units finish, and the second
launch's ramp is gone. The result is `moe.moe_experts`'s to the bit: the same sums in the same order.

In GPU interpret mode (no GPU) the interpreter cannot run a grid-wide wait: there the phases run as two
kernels, phase 1 alone (`jtilert_moe_gate_up`), then `moe.expert_down` on its partials, so the CPU tests
check each phase's code and lower the one kernel for the GPU; tests/gpu/moe_pair_check.py checks the
one kernel on the GPU.
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
from jtilert.pallas import _hopper as hw
from jtilert.pallas import moe
from jtilert.pallas._hopper import BF16, F32, FP8, MAX_TOKENS, QBLOCK, X_LAYOUT, X_TRANSFORMS
from jtilert.pallas.gemv import GemvConfig


@dataclasses.dataclass(frozen=True)
class GateUpPlan:
    """Phase 1 under a resolved configuration: `cfg` (fp8x2 engine; block_n rows, split K slices),
    `row_blocks` of one expert (I / block_n), `units` = row_blocks · split · T·k (one a CTA), and the
    partial sums' shape [split, 2, T·k, I]."""
    cfg: GemvConfig
    row_blocks: int
    units: int
    parts_shape: tuple


def gate_up_scratch(cfg: GemvConfig, *, k: int) -> list:
    """Phase 1's shared memory outside its weight pipeline: x's two e4m3 halves over the K slice, x's
    bf16 slice as TMA brings it, x's scale, the unit's two output rows, x's barrier."""
    kc = k // cfg.split_k
    return [hw.pair_operand(kc), plgpu.SMEM((MAX_TOKENS, kc), BF16, transforms=X_TRANSFORMS), plgpu.SMEM((1,), F32),
            plgpu.SMEM((2, 1, cfg.block_n), F32), plgpu.Barrier(num_barriers=1)]


def gate_up_smem(cfg: GemvConfig, *, k: int) -> hw.Scope:
    """Phase 1's shared memory: `gate_up_scratch`, and inside, the gate and up tiles in flight."""
    pipe = hw.Scope((plgpu.SMEM((cfg.stages, cfg.block_n, cfg.block_k), FP8),) * 2
                    + (plgpu.Barrier(num_barriers=cfg.stages),), reduces=True)
    return hw.Scope(tuple(gate_up_scratch(cfg, k=k)), (pipe,), reduces=True)


def gate_up_plan(nsel: int, gate, sms: int) -> GateUpPlan:
    """The gate/up phase of `nsel` selections over gate [E, I, H] (fp8): the split-K and pipeline that
    `gemv`'s occupancy rule picks for the gate/up kernel on `sms` SMs."""
    _, n, k = gate.shape
    cfg = GemvConfig(engine="fp8x2").resolved(n * nsel, k, 1, 2, 1, sms, layout=functools.partial(gate_up_smem, k=k))
    row_blocks = -(-n // cfg.block_n)
    return GateUpPlan(cfg=cfg, row_blocks=row_blocks, units=row_blocks * cfg.split_k * nsel,
                      parts_shape=(cfg.split_k, 2, nsel, n))


def gate_up_unit(u, plan: GateUpPlan, *, kper: int, per_layer: int, x_gmem, ids_gmem, layer_gmems, g_gmem,
                 up_gmem, gs_gmem, us_gmem, parts_gmem):
    """Unit u of phase 1: row block u mod R of selection u // (R · split) (expert ids[sel], + layer·E),
    K slice (u // R) mod split, for token sel // kper. Its gate and up partial sums go to
    parts[slice, 0 / 1, sel, rows] (GMEM, TMA), written through when it returns."""
    cfg = plan.cfg
    bn, bk, split = cfg.block_n, cfg.block_k, cfg.split_k
    k = g_gmem.shape[-1]
    kc = k // split
    steps, nblk = kc // bk, kc // QBLOCK
    w_tr, sub = hw.weight_transforms(bk, 1)   # sub: one 128-column scale block
    nsub = bk // sub
    kb_total = k // QBLOCK
    n_idx = u % plan.row_blocks
    s_idx = (u // plan.row_blocks) % split
    sel = u // (plan.row_blocks * split)
    base = hw.read_layer(*layer_gmems) * per_layer if layer_gmems is not None else 0
    wid = ids_gmem[sel] + base
    tok = sel // kper
    col = tok % MAX_TOKENS                          # its row in the staged 8-row block (B's column)
    row8 = pl.multiple_of(tok - col, MAX_TOKENS)    # the block's first row of x
    k0, row0 = s_idx * kc, n_idx * bn
    srow = row0 // QBLOCK

    def scoped(xb, xstage, sx, o_smem, bar):
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(row8, MAX_TOKENS), pl.ds(k0, kc)], xstage, bar.at[0])

        def scales_at(step):
            """The block scales of a step's sub-blocks, gate's and up's (read a step ahead)."""
            kb = [jnp.minimum((k0 + step * bk + h * sub) // QBLOCK, kb_total - 1) for h in range(nsub)]
            return tuple(tuple(s[wid, srow, b] for b in kb) for s in (gs_gmem, us_gmem))

        def first():
            """While the first tiles arrive: x's K slice as two e4m3 halves (rows past T: TMA's zeros)."""
            plgpu.barrier_wait(bar.at[0])
            sx[0] = hw.store_fp8_pair(hw.pair_rows(xb, QBLOCK), lambda b: plgpu.load(
                xstage.at[:, pl.ds(b * QBLOCK, QBLOCK)], layout=X_LAYOUT).astype(F32), nblk)
            plgpu.commit_smem()

        def body(step, g_smem, u_smem, carry):
            accs, scs = carry
            nxt = scales_at(step + 1)
            accs = tuple(hw.wgmma_fp8_pair_step(acc, w_smem, xb, step * bk, [f * sx[0] for f in sc], nsub=nsub,
                                                sub=sub) for acc, w_smem, sc in zip(accs, (g_smem, u_smem), scs))
            return accs, nxt

        def tile_of(w_gmem):
            return lambda step: w_gmem.at[wid, pl.ds(row0, bn), pl.ds(k0 + step * bk, bk)]
        col_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bn, hw.PAIR_COLS), 1), plgpu.Layout.WGMMA)
        zeros = jnp.where(col_id < 0, 1.0, 0.0).astype(F32)
        _, (ys, _) = hw.stream_tiles(body, steps=steps, stages=cfg.stages, tiles=[tile_of(g_gmem), tile_of(up_gmem)],
                                     shape=(bn, bk), dtype=FP8, transforms=w_tr,
                                     carry=((zeros, zeros), scales_at(0)), first=first)
        for j, y in enumerate(ys):
            o_smem.at[j, 0][...] = hw.pair_column(y, col_id, col)
        plgpu.commit_smem()
        for j in range(2):
            plgpu.copy_smem_to_gmem(o_smem.at[j], parts_gmem.at[s_idx, j, pl.ds(sel, 1), pl.ds(row0, bn)])
        plgpu.wait_smem_to_gmem(0)   # written, not only read out of SMEM: other CTAs read them next

    pl.run_scoped(scoped, *gate_up_scratch(cfg, k=k))


def unsupported(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual=None, *,
                layer=None) -> str | None:
    """Why `moe_experts` cannot run these experts as one kernel (None: it can)."""
    return _plans(x, weights, ids, gate, gate_scale, up, down, down_scale, residual, layer)[2]


def _plans(x, weights, ids, gate, gate_scale, up, down, down_scale, residual, layer):
    """(phase 1's plan, phase 2's `moe.DownPlan`, None), or (None, None, why the phases do not make one
    kernel here)."""
    if any(w.dtype != FP8 for w in (gate, up, down)) or gate_scale is None or down_scale is None:
        return None, None, "bf16 experts (the phases take fp8 weights with scales)"
    t = x.shape[0]
    if t > MAX_TOKENS or ids.shape[0] != t:
        return None, None, f"{t} tokens (at most {MAX_TOKENS})"
    if gate.shape[-1] % QBLOCK or gate.shape[-2] % 64:
        return None, None, f"experts {gate.shape[-2:]} (H a multiple of {QBLOCK}, I of 64)"
    sms = hw.num_sms()
    up_plan = gate_up_plan(ids.size, gate.reshape(-1, *gate.shape[-2:]), sms)
    why = f"the gate/up partials {up_plan.parts_shape} do not fit in the down phase's SMEM"
    if 4 * int(np.prod(up_plan.parts_shape)) > moe.STAGE_MAX_BYTES:
        return None, None, why
    dplan = moe.down_plan(up_plan.parts_shape, weights, ids, down, down_scale, layer=layer, out_dtype=x.dtype,
                          residual=residual)
    if dplan.staged is None:
        return None, None, why
    ctas = max(up_plan.units, dplan.grid[0] * dplan.grid[1])
    if ctas > sms and not _interp.active():   # (the interpreter runs the phases as two kernels)
        return None, None, f"{ctas} CTAs (the phases' units) for {sms} SMs"
    return up_plan, dplan, None


def moe_experts(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual=None, *, layer=None):
    """`moe.moe_experts` (Σ_j weights[t, j] · Expert_{ids[t, j]}(x[t]), + residual) as one kernel of two
    phases (see the module doc); where that does not apply (`unsupported`), `moe.moe_experts`' two
    kernels. x [T, H] bf16, weights [T, k] fp32, ids [T, k] int32, the experts fp8 with scales, stacked
    [E, ...] or, with `layer`, [L, E, ...]."""
    up_plan, dplan, why = _plans(x, weights, ids, gate, gate_scale, up, down, down_scale, residual, layer)
    if why is not None:
        return moe.moe_experts(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual,
                               layer=layer)
    t, kper = ids.shape
    per_layer = gate.shape[1] if layer is not None else 0
    flat = (lambda a: a.reshape(-1, *a.shape[2:])) if layer is not None else (lambda a: a)
    g, gs, u, us = flat(gate), flat(gate_scale), flat(up), flat(up_scale)
    ids_flat = ids.reshape(-1).astype(jnp.int32)
    layer_ops = hw.layer_operands(layer)
    phase1 = functools.partial(gate_up_unit, plan=up_plan, kper=kper, per_layer=per_layer)
    parts_type = jax.ShapeDtypeStruct(up_plan.parts_shape, F32)
    up_args = [x, ids_flat, *layer_ops, g, u, gs.astype(F32), us.astype(F32)]
    n_up = len(up_args)

    def up_refs(refs):
        x_r, ids_r, *rest = refs[:n_up]
        lay = (rest[0], rest[1]) if layer is not None else None
        g_r, u_r, gs_r, us_r = rest[-4:]
        return dict(x_gmem=x_r, ids_gmem=ids_r, layer_gmems=lay, g_gmem=g_r, up_gmem=u_r, gs_gmem=gs_r, us_gmem=us_r)

    if _interp.params() is not None:   # interpret mode: the phases as two kernels (no grid-wide wait there)
        def kernel1(*refs):
            phase1(lax.axis_index("u"), parts_gmem=refs[n_up], **up_refs(refs))
        parts = plgpu.kernel(kernel1, out_type=parts_type, grid=(up_plan.units,), grid_names=("u",),
                             interpret=_interp.params(), kernel_name="jtilert_moe_gate_up")(*up_args)
        return moe.expert_down(parts, weights, ids, down, down_scale, layer=layer, out_dtype=x.dtype,
                               residual=residual)
    rb, split = dplan.grid
    ctas = max(up_plan.units, rb * split)
    n_down = len(dplan.operands)

    def kernel(*refs):
        cta = lax.axis_index("c")
        down_refs = refs[n_up:n_up + n_down]
        y_gmem, parts_gmem = refs[n_up + n_down:]
        arrivals = pl.get_global(plgpu.SemaphoreType.REGULAR)
        pl.when(cta < up_plan.units)(lambda: phase1(cta, parts_gmem=parts_gmem, **up_refs(refs)))
        plgpu.semaphore_signal(arrivals, 1, memory_scope="gpu")   # after its partials are written

        def wait():   # every CTA's partials written
            plgpu.semaphore_wait(arrivals, ctas, decrement=False, memory_scope="gpu")

        @pl.when(cta < rb * split)
        def _():
            pl.run_scoped(lambda *scratch: dplan.body((parts_gmem, *down_refs, y_gmem, *scratch), cta % rb, cta // rb,
                                                      wait), *dplan.scratch)

    y, _ = plgpu.kernel(kernel, out_type=(dplan.out_type, parts_type), grid=(ctas,), grid_names=("c",),
                        interpret=None, kernel_name="jtilert_moe_pair")(*up_args, *dplan.operands)
    return dplan.finish(y)
