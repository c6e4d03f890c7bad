"""Two projections as two phases of one Mosaic-GPU kernel, the second reading the first's output
(decode): a MoE layer's routed experts (`moe.moe_experts`: the gate/up GEMV's split-K partials, then the
down GEMV that finishes them), and the attention's output path (`heads_splits_linear`: W_uv, each
head's GEMV merging sparse MLA's split partials, then o_proj with the layer's residual).

As two kernels each pays its own ramp (its first weight tiles' latency, x's preparation) and tail. Here
one kernel of C CTAs (at most one an SM, all resident at once) runs both `gemv.ProjectionPlan`s:

1. CTA c < first.units runs work unit c of the first projection (its body as its own kernel runs it),
   which writes its rows of the output by TMA;
2. each CTA arrives at a grid-wide GMEM semaphore (`pl.get_global`, zeroed by JAX before each call);
3. CTA c < second.units runs unit c of the second: it asks for its first weight tiles, then waits until
   all C CTAs have arrived (`ProjectionPlan.body`'s `wait`), and only then reads x, the first's output,
   by TMA while those tiles land.

At DeepSeek-V3.2's share the experts' gate/up has 128 units and their down 112; W_uv has 32 (16 heads ×
2 row blocks) and o_proj 112, so most of o_proj's CTAs ask for their weights at the kernel's start and
its ramp overlaps W_uv. The result is that of the two kernels to the bit (the same bodies, the same
sums).

In GPU interpret mode (no GPU) the interpreter cannot run a grid-wide wait: the phases run as two
kernels there (`gemv.launch` of each plan), so the CPU tests check the phases' code and lower the one
kernel for the GPU.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

import jtilert.pallas.interpret as _interp
from jtilert.pallas import _hopper as hw
from jtilert.pallas import gemv
from jtilert.pallas._hopper import BF16, MAX_TOKENS


def chain_unsupported(first: gemv.ProjectionPlan, second: gemv.ProjectionPlan) -> str | None:
    """Why `chain` cannot run the two plans as one kernel (None: it can)."""
    if first.clusters or second.clusters:
        return "a phase sums its split-K partials in a cluster"
    if not isinstance(first.out_type, jax.ShapeDtypeStruct) or first.out_type.shape != second.args[0].shape or (
            first.out_type.dtype != second.args[0].dtype):
        return f"the first's output {first.out_type} is not the second's x {second.args[0]}"
    ctas = max(first.units, second.units)
    if ctas > hw.num_sms() and not _interp.active():   # (the interpreter runs the phases as two kernels)
        return f"{ctas} CTAs (the phases' units) for {hw.num_sms()} SMs"
    return None


def chain(first: gemv.ProjectionPlan, second: gemv.ProjectionPlan, *, name: str):
    """second(first(...)): the two plans as one kernel of two phases (see the module doc); the second's
    x (its first argument) is the first's output. Returns the second's result (its `finish`). ValueError
    where `chain_unsupported` names a reason."""
    why = chain_unsupported(first, second)
    if why is not None:
        raise ValueError(f"gemv_pair.chain: {why}")
    if _interp.params() is not None:   # interpret mode: the phases as two kernels (no grid-wide wait there)
        return in_turn(first, second)
    n1, n2 = len(first.args), len(second.args) - 1
    ctas = max(first.units, second.units)

    def kernel(*refs):
        inputs1, inputs2 = refs[:n1], refs[n1:n1 + n2]
        y2, y1 = refs[n1 + n2:]
        cta = lax.axis_index("c")
        arrivals = pl.get_global(plgpu.SemaphoreType.REGULAR)

        @pl.when(cta < first.units)
        def _():
            pl.run_scoped(lambda *scratch: first.body((*inputs1, y1, *scratch), *first.unit(cta)), *first.scratch)

        plgpu.semaphore_signal(arrivals, 1, memory_scope="gpu")   # after its rows are written

        def wait():   # every CTA's rows of the first output written
            plgpu.semaphore_wait(arrivals, ctas, decrement=False, memory_scope="gpu")

        @pl.when(cta < second.units)
        def _():
            pl.run_scoped(lambda *scratch: second.body((y1, *inputs2, y2, *scratch), *second.unit(cta), wait=wait),
                          *second.scratch)

    y2, _ = plgpu.kernel(kernel, out_type=(second.out_type, first.out_type), grid=(ctas,), grid_names=("c",),
                         interpret=None, kernel_name=name)(*first.args, *second.args[1:])
    return second.finish(y2)


def in_turn(first: gemv.ProjectionPlan, second: gemv.ProjectionPlan):
    """second(first(...)) as two kernels, one after the other; the second's result (its `finish`)."""
    return second.finish(gemv.launch(second, [gemv.launch(first), *second.args[1:]]))


def heads_splits_linear_plans(o, m, l, w, w_scale, block: int, wo, wo_scale, residual=None, *, layer=None):
    """The two plans of `heads_splits_linear`: W_uv of sparse MLA's split partials (`gemv.heads_linear_of_
    splits`, its output [T, H·N]), then o_proj of it (+ residual)."""
    t, h = o.shape[0], w.shape[-3]
    w, w_scale = gemv._prep_weight(w, w_scale, layer)
    wo, wo_scale = gemv._prep_weight(wo, wo_scale, layer)
    first = gemv.projection_plan(None, (w,), (w_scale,), heads=h, layer=layer, scale_block=block, out_dtype=BF16,
                                 splits=(o, m, l), heads_flat=True)
    x = jax.ShapeDtypeStruct((t, first.out_type.shape[-1]), BF16)
    res = {} if residual is None else dict(residual=residual, out_dtype=residual.dtype)
    second = gemv.projection_plan(x, (wo,), (wo_scale,), layer=layer, **res)
    return first, second


def heads_splits_linear(o, m, l, w, w_scale, block: int, wo, wo_scale, residual=None, *, layer=None):
    """linear(heads_linear_of_splits(o, m, l, w).reshape(T, H·N), wo) (+ residual, added as
    `gemv.linear_residual` adds it) as one kernel of two phases (`chain`); where that does not apply
    (`chain_unsupported`), the two kernels. o [T, G, n, Hc, K] fp32, m, l [T, G, n, Hc]
    (`sparse_mla.sparse_mla_partials`); w [H, N, K] (W_uv), wo [D, H·N] (fp8 + scales or bf16); stacks
    [L, ...] with `layer`."""
    if o.shape[0] > MAX_TOKENS:
        raise ValueError(f"heads_splits_linear: at most {MAX_TOKENS} tokens, got {o.shape[0]}")
    first, second = heads_splits_linear_plans(o, m, l, w, w_scale, block, wo, wo_scale, residual, layer=layer)
    if chain_unsupported(first, second) is None:
        return chain(first, second, name="jtilert_gemv_pair_heads_splits_linear")
    return in_turn(first, second)
