"""MoE decode path (Pallas Mosaic-GPU); only the chosen experts' weights are read, steered by expert
ids that stay on the device:

* `expert_gate_up`: the `gemv` kernel in expert mode (grid: row block, split, selection); each CTA
  streams the selected expert's gate and up rows (SwiGLU epilogue, fp32).
* `expert_down`: y[t] = Σ_i w_i · down[ids_i] · h_i as one GEMV over the gathered (selection, I) axis:
  w_i, the fp8 block scale and h_i are folded into the B operand, so the weighted sum is the tensor
  core's accumulation; the layer's residual is added in its epilogue. A shared expert packed as one
  more expert (`pack_shared_expert`) rides along with weight 1.
* `moe_experts`: the two as two phases of one kernel (`gemv_pair.chain`) where they fit (one decode
  token), else as two kernels.
* `shared_expert`: the shared expert's gate/up kernel, then `expert_down` with it as its one expert.
* `route` / `norm_route`: fp32 logits on `gemv`'s FMA engine (the reference's precision, so near-ties
  select the same experts; `norm_route` applies the FFN's RMSNorm and writes the normed x out), then
  the selection: with a layer index one launch of the CUDA engine (`jtilert.ffi.route`), else the
  reference's in plain JAX.
`layer=`: the stacks [L, E, ...] are taken as [L·E, ...] (a free reshape); the kernels read the layer
on the device and add layer·E to the expert ids.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.ffi import route as ffi_route
from jtilert.ops import reference
from jtilert.pallas import _hopper as hw
from jtilert.pallas import gemv, gemv_pair
from jtilert.pallas._hopper import BF16, F16, F32, FP8, MAX_TOKENS, QBLOCK, X_LAYOUT, X_TRANSFORMS
from jtilert.pallas.gemv import GemvConfig

STAGE_MAX_BYTES = 96 * 1024   # gate/up partials `expert_down` copies into shared memory (T = 1: 64 KiB)

MOE_LAYOUT_VERSION = "jtilert-moe-v1: experts stacked [E(+1 shared), out, in] in the HF [out, in] layout"


# ---- gate/up ------------------------------------------------------------------------------------

def expert_gate_up(x, ids, gate, gate_scale, up, up_scale, *, layer=None, config: GemvConfig | None = None,
                   unsummed: bool = False):
    """h[i] = silu(x[tok_i] · gate[ids_i]ᵀ) · (x[tok_i] · up[ids_i]ᵀ), fp32 math, bf16 result.
    x [T, H] bf16, ids [T, k] int32, gate/up [E, I, H] (fp8 + scales [E, ., .], or bf16); with
    `layer`, [L, E, I, H] (scales [L, E, ., .]) and layer `layer`'s experts. `unsummed`: where the
    kernel splits K, its gate and up partials [split, 2, T·k, I] fp32 as they are, for `expert_down`
    to finish (no XLA kernel between the two); else h in fp32."""
    return gemv._projection(x, (gate, up), (gate_scale, up_scale), kind="swiglu_f32",
                            ids=ids.reshape(-1), layer=layer, config=config, partials=unsummed,
                            out_dtype=F32 if unsummed else BF16)


# ---- down + weighted sum ------------------------------------------------------------------------

def expert_down(h, weights, ids, down, down_scale, *, layer=None, out_dtype=BF16, residual=None,
                config: GemvConfig | None = None, kind: str = "swiglu_f32"):
    """y[t] = Σ_j weights[t, j] · h[t·k + j] · down[ids[t, j]]ᵀ  (fp32 accumulation), + residual [T, H]
    where given (y rounded to bf16 first, the add in fp32: `gemv.linear_residual`'s rounding).
    h [T·k, I] (bf16, or fp32 rounded to bf16 here) or the gate/up kernel's partials [S, 2, T·k, I]
    fp32 (`expert_gate_up(unsummed=True)`): the kernel copies them into shared memory at its start
    and finishes h = silu(Σ gate) · Σ up itself while its first weight tiles arrive (beyond
    STAGE_MAX_BYTES, or where they do not fit beside the pipeline, XLA finishes them first), as
    `kind` rounds them (`gemv.swiglu_of_sums`: the routed experts' "swiglu_f32", or "swiglu").
    weights [T, k] fp32, ids [T, k] int32, down [E, H, I] (fp8 + scales or bf16); with `layer`,
    down [L, E, H, I] (scales [L, E, ., .]) and layer `layer`'s experts."""
    h = h if h.dtype == F32 else h.astype(BF16)
    plan, staged = down_plan(h, weights, ids, down, down_scale, layer=layer, out_dtype=out_dtype,
                             residual=residual, config=config, kind=kind)
    if staged is None and h.ndim == 4:   # partials the kernel does not stage: XLA finishes them first
        h = gemv.finish_partials(h, kind=kind)
    return plan.finish(gemv.launch(plan, [h, *plan.args[1:]]))


def down_plan(h, weights, ids, down, down_scale, *, layer=None, out_dtype=BF16, residual=None,
              config: GemvConfig | None = None, kind: str = "swiglu_f32") -> tuple[gemv.ProjectionPlan, tuple | None]:
    """(`expert_down`'s kernel as a `gemv.ProjectionPlan`, the partials' shape where it stages them or
    None) for h (an array, or its shape and dtype: [T·k, I] fp32 / bf16, or the partials [S, 2, T·k, I],
    staged where they are at most STAGE_MAX_BYTES and fit beside the pipeline: else the plan is for h
    finished first, bf16, and the caller finishes it); the other arguments as `expert_down`'s. The
    plan's `wait` (a phase before it writes h) runs before h is read."""
    h_shape = h.shape
    t, kper = ids.shape
    nsel = t * kper
    if len(h_shape) == 4 and tuple(h_shape[1:3]) != (2, nsel):
        raise ValueError(f"expert_down: partials {tuple(h_shape)} do not match ids {ids.shape}")
    per_layer = 0
    if layer is not None:
        if down.ndim != 4:
            raise ValueError(f"expert_down with layer: down must be [L, E, H, I], got {down.shape}")
        per_layer = down.shape[1]
        down = down.reshape(-1, *down.shape[2:])                  # [L·E, H, I]: free
        if down_scale is not None:
            down_scale = down_scale.reshape(-1, *down_scale.shape[2:])
    e, n, i_dim = down.shape
    if tuple(h_shape[-2:]) != (nsel, i_dim):
        raise ValueError(f"expert_down: h {tuple(h_shape)} does not match ids {ids.shape} and down {down.shape}")
    if t > MAX_TOKENS:
        raise ValueError(f"expert_down: at most {MAX_TOKENS} tokens per call, got {t}")
    fp8 = down.dtype == FP8
    if down.dtype not in (FP8, BF16):
        raise ValueError(f"expert_down: weights must be fp8 or bf16, got {down.dtype}")
    if i_dim % QBLOCK:
        raise ValueError(f"expert_down: expert width {i_dim} must be a multiple of {QBLOCK}")
    if fp8 and down_scale.shape != (e, -(-n // QBLOCK), i_dim // QBLOCK):
        raise ValueError(f"expert_down: scales {down_scale.shape} do not match {down.shape}")
    ktot = nsel * i_dim
    base = config or GemvConfig(engine="wgmma")
    engine = "wgmma" if base.engine == "auto" else base.engine
    if engine not in ("wgmma", "fp8x2") or (engine == "fp8x2" and not fp8):
        raise ValueError(f"expert_down runs on the wgmma engine, or fp8x2 with fp8 weights; got {base.engine!r} "
                         f"with {down.dtype} weights")
    x8 = engine == "fp8x2"
    bk_cap = min(base.block_k, i_dim, 16384 // (base.block_n * down.dtype.itemsize))
    bk = QBLOCK
    while bk * 2 <= bk_cap and i_dim % (bk * 2) == 0:
        bk *= 2
    want = GemvConfig(block_n=base.block_n, block_k=bk, split_k=base.split_k, stages=base.stages,
                      engine=engine, a_in_registers=base.a_in_registers)
    # K slices of whole 128-column blocks (B is built per block); a pipeline step inside one
    # expert (block_k divides the expert width). One slice per row block unless the token slice
    # [8, K / split] does not fit in SMEM (K = T·k·I grows with the tokens and experts).
    if residual is not None and residual.shape != (t, n):
        raise ValueError(f"expert_down: residual {residual.shape}, want {(t, n)}")
    res_dtype = None if residual is None else residual.dtype

    def resolved(staged):
        layout = functools.partial(expert_down_smem, k=ktot, itemsize=down.dtype.itemsize, out_dtype=out_dtype,
                                   residual_dtype=res_dtype, staged=staged)
        return layout, want.resolved(n, ktot, t, 1, down.dtype.itemsize, hw.num_sms(), slice_unit=QBLOCK,
                                    divides=i_dim, occupancy=False, layout=layout)
    staged = (tuple(h_shape) if len(h_shape) == 4 and math.prod(h_shape) * jnp.dtype(h.dtype).itemsize
              <= STAGE_MAX_BYTES else None)
    layout, cfg = resolved(staged)
    if staged and hw.smem_bytes(layout(cfg)) > hw.SMEM_BYTES:   # the partials do not fit beside the pipeline
        staged = None
        layout, cfg = resolved(None)
    hw.check_smem("MoE down kernel", layout(cfg), cfg)
    bn, split, stages, a_regs = cfg.block_n, cfg.split_k, cfg.stages, cfg.a_in_registers
    bk = cfg.block_k
    if i_dim % bk:
        raise ValueError(f"expert_down: block_k {bk} must divide the expert width {i_dim}")
    kc = ktot // split
    steps = kc // bk
    nblk = kc // QBLOCK
    row_blocks = -(-n // bn)
    w_tr, sub = hw.weight_transforms(bk, down.dtype.itemsize)
    nsub = bk // sub
    in_kernel = split == 1
    o_dtype = out_dtype if in_kernel else F32
    res_in_kernel = residual is not None and in_kernel

    def body(refs, n_idx, s_idx, e_idx=None, wait=None):
        h_gmem, w_gmem, ids_gmem, *rest = refs
        it = iter(rest)
        layer_gmems = (next(it), next(it)) if layer is not None else None
        d_gmem = next(it)
        s_gmem = next(it) if fp8 else None
        res_gmem = next(it) if res_in_kernel else None
        out_gmem, xb, invf, o_smem = next(it), next(it), next(it), next(it)
        a_bufs = next(it) if (fp8 and not x8 and not a_regs) else None
        res_smem, res_bar = (next(it), next(it)) if res_in_kernel else (None, None)
        h_smem, h_bar, h_tile = (next(it), next(it), next(it)) if staged else (None, None, None)
        if staged and wait is None:   # the gate/up partials, one copy, while the weights stream
            plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_bar.at[0])
        k0 = s_idx * kc if split > 1 else 0   # a Python 0: B's blocks then know their selection statically
        row0 = n_idx * bn
        if res_in_kernel:   # the residual's rows of this block, while the weights stream
            zero = n_idx * 0   # a traced 0: the TMA box may then overhang T (zero fill)
            plgpu.copy_gmem_to_smem(res_gmem.at[pl.ds(zero, MAX_TOKENS), pl.ds(row0, bn)], res_smem,
                                    res_bar.at[0])
        srow = row0 // QBLOCK
        # stack entries (expert ids, + layer·E), scalars read once
        base_id = hw.read_layer(*layer_gmems) * per_layer if layer is not None else 0
        ids_v = [ids_gmem[i] + base_id for i in range(nsel)]
        w_v = [w_gmem[i // kper, i % kper] for i in range(nsel)]

        def pick(vals, i):
            if isinstance(i, int):
                return vals[i]
            out = vals[0]
            for ii in range(1, nsel):
                out = jnp.where(i == ii, vals[ii], out)
            return out

        def block_factor(kpos):
            """The routing weight times the weights' block scale of the 128 columns at kpos."""
            sel = kpos // i_dim
            c = pick(w_v, sel)
            return c * s_gmem[pick(ids_v, sel), srow, (kpos % i_dim) // QBLOCK] if fp8 else c

        def build_b():
            """B[tok, kpos] = h[sel, ·] · w_sel · s[ids_sel, row block, k block] · f, where sel owns
            kpos and tok is sel's token (other rows 0); f is a power of two for f16 range. fp8x2: B is
            h alone in two e4m3 halves (hi, lo) and the factors are applied to the block sums."""
            row_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (MAX_TOKENS, QBLOCK), 0), X_LAYOUT)

            def h_block(sel, cols):
                """h[sel, cols] in fp32, rounded to bf16 as the gate/up kernel's output is."""
                src = h_tile if staged else h_gmem
                return plgpu.load(src.at[sel, cols], optimized=False).astype(BF16).astype(F32)

            def block(b):
                kpos = k0 + b * QBLOCK
                sel = kpos // i_dim
                part = (kpos % i_dim) // QBLOCK
                hv = h_block(sel, pl.ds(part * QBLOCK, QBLOCK))
                if not x8:
                    hv = hv * block_factor(kpos)
                v = plgpu.layout_cast(lax.broadcast_in_dim(hv, (MAX_TOKENS, QBLOCK), (1,)), X_LAYOUT)
                return jnp.where(row_id == sel // kper, v, 0.0)

            if wait is not None:   # h (or its partials) once the phase that writes it is done
                wait()
                if staged:
                    plgpu.copy_gmem_to_smem(h_gmem, h_smem, h_bar.at[0])
            if staged:   # h once for all selections: the split-K sums in split order, the SwiGLU, bf16
                plgpu.barrier_wait(h_bar.at[0])
                g, u = h_smem[0, 0], h_smem[0, 1]
                for s in range(1, staged[0]):
                    g, u = g + h_smem[s, 0], u + h_smem[s, 1]
                h_tile[...] = gemv.swiglu_of_sums(g, u, kind, BF16)
                plgpu.commit_smem()
            vals = [block(b) for b in range(nblk)]
            if x8:
                invf[0] = hw.store_fp8_pair(hw.pair_rows(xb, QBLOCK), vals.__getitem__, nblk)
            elif fp8:
                f = hw.f16_range_factor(jnp.abs(v) for v in vals)
                for b, v in enumerate(vals):
                    xb.at[:, pl.ds(b * QBLOCK, QBLOCK)][...] = (v * f).astype(F16)
                invf[0] = 1.0 / f
            else:
                for b, v in enumerate(vals):
                    xb.at[:, pl.ds(b * QBLOCK, QBLOCK)][...] = v.astype(BF16)
            plgpu.commit_smem()

        def tile(s):
            """The down weights' tile of step s: the expert that owns columns k0 + s·bk, its rows of
            this block."""
            kpos = k0 + s * bk
            return d_gmem.at[pick(ids_v, kpos // i_dim), pl.ds(row0, bn), pl.ds(kpos % i_dim, bk)]

        def body(step, w_smem, acc):
            kk = step * bk
            if not fp8:
                plgpu.wgmma(acc, w_smem, xb.at[:, pl.ds(kk, bk)].T)
            else:
                hw.wgmma_fp8_step(acc, w_smem, lambda hh: xb.at[:, pl.ds(kk + hh * sub, sub)].T, nsub=nsub,
                                  sub=sub, a_buf_of=None if a_regs else (lambda i: a_bufs.at[i]))
            plgpu.wgmma_wait(0)
            return acc

        def factors(step):
            """The block factors of a pipeline step's sub-blocks (read a step ahead)."""
            return tuple(block_factor(k0 + jnp.minimum(step, steps - 1) * bk + hh * sub) for hh in range(nsub))

        def body_x8(step, w_smem, carry):
            """Both operands e4m3 from SMEM: each sub-block's hi and lo sums, scaled by its factor and
            x's scale, added to the running sums."""
            acc, fs = carry
            nxt = factors(step + 1)
            sx = invf[0]
            acc = hw.wgmma_fp8_pair_step(acc, w_smem, xb, step * bk, [f * sx for f in fs], nsub=nsub, sub=sub)
            return acc, nxt

        def pipeline(fn, carry):
            """The down weights' stream; B is built from h while its first tiles arrive."""
            _, out = hw.stream_tiles(fn, steps=steps, stages=stages, tiles=[tile], shape=(bn, bk),
                                     dtype=down.dtype, transforms=w_tr, carry=carry, first=build_b)
            return out

        def run(acc):
            pipeline(body, acc)
            return acc[...]

        cols = hw.PAIR_COLS if x8 else MAX_TOKENS
        col_id = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bn, cols), 1), plgpu.Layout.WGMMA)
        if x8:
            y, _ = pipeline(body_x8, (jnp.where(col_id < 0, 1.0, 0.0).astype(F32), factors(0)))
        else:
            y = pl.run_scoped(run, plgpu.ACC((bn, MAX_TOKENS), F32))
        if res_in_kernel:
            plgpu.barrier_wait(res_bar.at[0])
        for tok in range(t):
            col = hw.pair_column(y, col_id, tok) if x8 else jnp.sum(jnp.where(col_id == tok, y, 0.0), axis=1)
            if fp8 and not x8:
                col = col * invf[0]
            if res_in_kernel:
                o_smem.at[tok][...] = gemv.add_residual(col, res_smem.at[tok][...], o_dtype)
            else:
                o_smem.at[tok][...] = col.astype(o_dtype)
        plgpu.commit_smem()
        dst = out_gmem.at[:, pl.ds(row0, bn)] if in_kernel else out_gmem.at[s_idx, :, pl.ds(row0, bn)]
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, t)], dst)
        plgpu.wait_smem_to_gmem(0)

    scratch = expert_down_scratch(cfg, k=ktot, itemsize=down.dtype.itemsize, out_dtype=out_dtype,
                                  residual_dtype=res_dtype, staged=staged)
    out_type = (jax.ShapeDtypeStruct((t, n), o_dtype) if in_kernel
                else jax.ShapeDtypeStruct((split, t, n), F32))
    h_arg = h if len(h_shape) == 2 or staged else jax.ShapeDtypeStruct((nsel, i_dim), BF16)   # finished first
    args = [h_arg, weights.astype(F32), ids.reshape(-1).astype(jnp.int32)] + hw.layer_operands(layer) + [down]
    if fp8:
        args.append(down_scale.astype(F32))
    if res_in_kernel:
        args.append(residual)

    def finish(out):
        if in_kernel:
            return out
        y = out.sum(0)
        return y.astype(out_dtype) if residual is None else gemv.add_residual(y, residual, out_dtype)
    return gemv.ProjectionPlan(body=body, args=args, out_type=out_type, scratch=scratch, grid=(row_blocks, split),
                               names=("n", "s"), clusters={}, kernel_name="jtilert_moe_down", cfg=cfg,
                               finish=finish), staged


def expert_down_scratch(cfg: GemvConfig, *, k: int, itemsize: int, out_dtype=BF16, residual_dtype=None,
                        staged: tuple | None = None) -> list:
    """`expert_down`'s scratch buffers under a resolved config: the B operand [8, K / split] (fp8x2:
    its two e4m3 halves), the fp8 range factor (fp8x2: x's scale), the output tile, the A double
    buffer (fp8 with A from SMEM), the residual tile with its barrier (a residual without split-K),
    and the gate/up partials of shape `staged` with their barrier and the h they make."""
    fp8 = itemsize == 1
    kc = k // cfg.split_k
    b_operand = (hw.pair_operand(kc) if cfg.engine == "fp8x2" else
                 plgpu.SMEM((MAX_TOKENS, kc), F16 if fp8 else BF16, transforms=X_TRANSFORMS))
    scratch = [b_operand, plgpu.SMEM((1,), F32),
               plgpu.SMEM((MAX_TOKENS, cfg.block_n), out_dtype if cfg.split_k == 1 else F32)]
    if fp8 and cfg.engine == "wgmma" and not cfg.a_in_registers:
        _, sub = hw.weight_transforms(cfg.block_k, itemsize)
        scratch.append(plgpu.SMEM((2, cfg.block_n, sub), F16, transforms=X_TRANSFORMS))
    if residual_dtype is not None and cfg.split_k == 1:
        scratch += [plgpu.SMEM((MAX_TOKENS, cfg.block_n), residual_dtype), plgpu.Barrier(num_barriers=1)]
    if staged is not None:   # the partials, their barrier, and h finished from them
        scratch += [plgpu.SMEM(staged, F32), plgpu.Barrier(num_barriers=1), plgpu.SMEM(staged[2:], BF16)]
    return scratch


def expert_down_smem(cfg: GemvConfig, *, k: int, itemsize: int, out_dtype=BF16, residual_dtype=None,
                     staged: tuple | None = None) -> hw.Scope:
    """`expert_down`'s shared memory: its scratch, and inside, the weight pipeline (B is built,
    and for fp8 range-scaled, at step 0 in there); the epilogue reduces outside."""
    pipe = hw.Scope((plgpu.SMEM((cfg.stages, cfg.block_n, cfg.block_k), FP8 if itemsize == 1 else BF16),
                     plgpu.Barrier(num_barriers=cfg.stages)), reduces=itemsize == 1)
    return hw.Scope(tuple(expert_down_scratch(cfg, k=k, itemsize=itemsize, out_dtype=out_dtype,
                                              residual_dtype=residual_dtype, staged=staged)), (pipe,), reduces=True)


# ---- public wrappers ----------------------------------------------------------------------------

def moe_experts(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual=None, *, layer=None):
    """jtilert.ops.reference.moe_experts for decode (T ≤ 8), only the selected experts read, the residual
    (where given) added in the down projection's epilogue: the gate/up kernel (`expert_gate_up`, its
    split-K partials unsummed) and the down kernel (`expert_down`, which finishes them) as two phases of
    one kernel (`gemv_pair.chain`: down's first weight tiles asked for while the gate/up units finish)
    where `pair_unsupported` says they make one, else as two kernels."""
    t = x.shape[0]
    if t > MAX_TOKENS:
        raise ValueError(f"moe_experts kernel: at most {MAX_TOKENS} tokens, got {t}")
    first, second, why = _pair(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual, layer)
    if why is None:
        return gemv_pair.chain(first, second, name="jtilert_moe_pair")
    h = expert_gate_up(x, ids, gate, gate_scale, up, up_scale, layer=layer, unsummed=True)
    return expert_down(h, weights, ids, down, down_scale, layer=layer, out_dtype=x.dtype, residual=residual)


def pair_unsupported(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual=None, *,
                     layer=None) -> str | None:
    """Why `moe_experts` runs its two kernels instead of one of two phases (None: it runs one)."""
    return _pair(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual, layer)[2]


def _pair(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual, layer):
    """(gate/up's plan, down's plan, None), or (None, None, why they do not make one kernel)."""
    if any(w.dtype != FP8 for w in (gate, up, down)) or gate_scale is None or down_scale is None:
        return None, None, "bf16 experts (the pair takes fp8 weights with scales)"
    first = gemv.projection_plan(x, (gate, up), (gate_scale, up_scale), kind="swiglu_f32", ids=ids.reshape(-1),
                                 layer=layer, partials=True, out_dtype=F32)
    parts = first.out_type
    second, staged = down_plan(parts, weights, ids, down, down_scale, layer=layer, out_dtype=x.dtype,
                               residual=residual)
    if len(parts.shape) == 4 and staged is None:
        return None, None, f"the gate/up partials {parts.shape}: more than the down kernel stages"
    why = gemv_pair.chain_unsupported(first, second)
    return (first, second, None) if why is None else (None, None, why)


def pack_shared_expert(gate, gate_scale, up, up_scale, down, down_scale,
                       sh_gate, sh_gate_scale, sh_up, sh_up_scale, sh_down, sh_down_scale):
    """Append the shared expert (same width as a routed expert under tp) as expert E of the stacks,
    once at load time (layout `MOE_LAYOUT_VERSION`). Returns the six stacked arrays."""
    cat = lambda a, b: None if a is None else jnp.concatenate([a, b[None]], axis=0)
    return (cat(gate, sh_gate), cat(gate_scale, sh_gate_scale), cat(up, sh_up), cat(up_scale, sh_up_scale),
            cat(down, sh_down), cat(down_scale, sh_down_scale))


def moe_with_shared(x, weights, ids, packed, *, layer=None):
    """Σ_j w_j · Expert_{ids_j}(x) + Shared(x) with the shared expert packed as the last expert:
    the shared expert's gate/up and down ride in the same two kernels (weight 1.0)."""
    gate, gs, up, us, down, ds = packed
    t, k = ids.shape
    shared = jnp.full((t, 1), gate.shape[-3] - 1, jnp.int32)
    ids2 = jnp.concatenate([ids.astype(jnp.int32), shared], axis=1)
    w2 = jnp.concatenate([weights.astype(F32), jnp.ones((t, 1), F32)], axis=1)
    return moe_experts(x, w2, ids2, gate, gs, up, us, down, ds, layer=layer)


def reference_moe_with_shared(x, weights, ids, packed, shared_raw):
    g, gs, u, us, d, ds = packed
    routed = reference.moe_experts(x, weights, ids, g[:-1], None if gs is None else gs[:-1], u[:-1],
                                None if us is None else us[:-1], d[:-1], None if ds is None else ds[:-1])
    return routed + reference.swiglu(x, *shared_raw)


def shared_expert(x, gate, gate_scale, up, up_scale, norm_weight, eps, down, down_scale, residual, *, layer=None):
    """jtilert.ops.reference.shared_expert (residual + down(swiglu_hidden(x normed))) for decode (T ≤ 8) as
    two kernels: the gate/up kernel (the norm in) leaves its split-K partials, and the down kernel, the
    MoE down with the shared expert as its one expert of weight 1 (its [L, 1, H, I] view: free), finishes
    them in shared memory with the reference's rounding (kind "swiglu") while its first weight tiles
    arrive, and adds the residual in its epilogue: no XLA kernel between the two. gate/up [I, H], down
    [H, I] (fp8 + scales, or bf16); with `layer`, stacks [L, ...] and norm_weight [L, H]. An expert
    width that is not whole 128-column blocks, or more tokens, runs `gemv.swiglu_pair` then
    `gemv.linear_residual` instead (the finish between them in XLA)."""
    t = x.shape[0]
    if t > MAX_TOKENS or down.shape[-1] % QBLOCK or down.dtype not in (FP8, BF16):
        # the down kernel takes whole 128-column blocks of h: the GEMV kernels' pair and residual form
        h = gemv.swiglu_pair(x, gate, gate_scale, up, up_scale, norm_weight, eps, layer=layer)
        return gemv.linear_residual(h, down, down_scale, residual, layer=layer)
    h = gemv.swiglu_pair(x, gate, gate_scale, up, up_scale, norm_weight, eps, layer=layer, unsummed=True)
    return expert_down(h, *_one_expert(t, down, down_scale, layer), layer=layer, out_dtype=residual.dtype,
                       residual=residual, kind="swiglu")


def _one_expert(t, down, down_scale, layer):
    """The shared expert as `expert_down`'s one expert of weight 1: (weights, ids, down, down_scale)."""
    one = (lambda a: None if a is None else a[:, None]) if layer is not None else (
        lambda a: None if a is None else a[None])
    return jnp.ones((t, 1), F32), jnp.zeros((t, 1), jnp.int32), one(down), one(down_scale)


# ---- router -------------------------------------------------------------------------------------

def router_partials(x, gate, *, layer=None):
    """x · Wgᵀ in fp32 (the reference's precision) with the FMA engine, as its split-K partial sums
    [S, T, E] (the logits are their sum in order: `jtilert.ffi.route.logits_of`), Wg [E, H] fp32 (or
    bf16); with `layer`, Wg [L, E, H] fp32 or bf16 (a stack is never cast per call). More than
    MAX_TOKENS tokens run in chunks, each chunk's partials summed: [1, T, E]."""
    return _router(x, gate, None, 0.0, layer)[0]


def norm_router_partials(x, norm_weight, eps, gate, *, layer=None):
    """(router_partials(f, gate), f) for f = rms_norm(x, norm_weight, eps) (norm_weight [H], [L, H]
    with `layer`): the router's kernel norms x as the reference rounds it and writes f out, so the
    FFN's other kernels read f and no norm kernel runs before the router."""
    return _router(x, gate, gemv.norm_operand(norm_weight, x, layer), eps, layer)


def _router(x, gate, norm, eps, layer):
    """(partials, f or None): `router_partials`, of x normed by `norm` (a kernel norm operand) if given."""
    if gate.dtype in (F32, BF16):
        w = gate
    elif layer is None:
        w = gate.astype(F32)
    else:
        raise ValueError(f"router_partials: a stacked gate must be fp32 or bf16, got {gate.dtype}")
    cfg = GemvConfig(engine="fma")
    x = x.astype(BF16) if x.dtype != BF16 else x

    def run(xc):
        out = gemv._projection(xc, (w,), (None,), norm=norm, eps=eps, out_dtype=F32, layer=layer, config=cfg,
                               partials=True, normed_out=norm is not None)
        return out if norm is not None else (out, None)
    if x.shape[0] <= hw.MAX_TOKENS:
        return run(x)

    def logits(xc, _):
        partials, f = run(xc)
        return ffi_route.logits_of(partials), f
    summed, f = hw.token_chunks(x, logits)
    return summed[None], f


def route(cfg, x, gate, bias, *, layer=None):
    """jtilert.ops.reference.route with the logits GEMV in Pallas (gate [L, E, H], bias [L, E] with layer=)
    and, with layer=, the selection in one launch of the CUDA engine (`jtilert.ffi.route`; the
    reference's XLA ops where the engine is not loaded, with a warning)."""
    return _select(cfg, router_partials(_bf16_activations(x), gate, layer=layer), bias, layer)


def norm_route(cfg, x, norm_weight, eps, gate, bias, *, layer=None):
    """jtilert.ops.reference.norm_route: (f, weights, ids) with f = rms_norm(x) computed and written by
    the router's kernel (`norm_router_partials`), then the selection as in `route`."""
    partials, f = norm_router_partials(_bf16_activations(x), norm_weight, eps, gate, layer=layer)
    return (f, *_select(cfg, partials, bias, layer))


def _bf16_activations(x):
    if x.dtype != BF16:
        raise ValueError(f"route kernel: activations {x.dtype} {list(x.shape)} (bf16 only)")
    return x


def _select(cfg, partials, bias, layer):
    if layer is None:
        return reference.select_experts(cfg, ffi_route.logits_of(partials), bias)
    return ffi_route.select_experts(cfg, partials, bias, layer)
