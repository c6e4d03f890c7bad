"""A MoE layer's experts for one decode token in one launch: the engine's ``moe_decode``
(cuda/src/moe.cu).

``moe_decode(f, weights, ids, experts, shared, residual, layer)`` is, for one token (f [1, H] bf16,
the normed input; weights / ids [1, k], the router's), ``residual + moe_experts(f, ..) +
linear(swiglu_hidden(f, shared gate/up), shared down)`` at layer ``layer`` of the stacked fp8 weights
(`reference`): the routed and the shared experts' gate/up, SwiGLU, down, the weighted sum and the
residual in one persistent kernel, where the pallas path runs four kernels and XLA's adds. Elsewhere
(no GPU, no library) XLA runs the reference, with one warning per reason; `unsupported` says which
shapes the kernel takes.

`Ops.moe` calls it with `DecodeConfig(backend="pallas", engine_moe=True)`; bench/RESULTS.md compares
it with the pallas path's kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jtilert.ffi import _lib
from jtilert.ffi import ops as _ops
from jtilert.ops import reference
from jtilert.ops.layer import Layer

CTAS = 128          # JT_MOE_CTAS: the SMs the kernel needs free at once
MAX_VEC = 8192      # JT_MOE_MAX_VEC
MAX_SEGMENTS = 12   # JT_MOE_MAX_SEGMENTS: k + 1
# cuda/src/moe.cu's own limits, which shape_unsupported repeats
_MAX_PAIRS = 24     # kMaxPairs: gate/up pairs of a CTA
_MAX_I = 1024       # kMaxIBlocks x 128
_SLOTS = 24         # kSlots: the ring's slots
_SLOT_BYTES = 8192  # kSlotBytes
_ROWS2 = 64         # kRows2: phase 2's output rows of a CTA
_TILE = 8           # kTile: the fewest rows of a phase-2 chunk

moe_decode_p = Primitive("jtilert_moe_decode")


def _abstract(f, weights, ids, *rest):  # noqa: ARG001
    return rest[-3]   # out: like the residual (the last operand before the layer's two)


moe_decode_p.def_abstract_eval(_abstract)


def reference_moe(f, weights, ids, experts, shared, residual, layer):
    """residual + the routed experts' weighted sum + the shared expert, as `Ops.moe` composes the
    reference ops without tp (the shared down's result added to the residual first, then the
    routed sum), on layer `layer` (a `Layer` or an int32 scalar) of the stacks."""
    index = Layer.of(layer).index()
    take = lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False)  # noqa: E731
    g, gs, u, us, d, ds = (take(a) for a in experts)
    sg, sgs, su, sus, sd, sds = (take(a) for a in shared)
    base = reference.linear_residual(reference.swiglu_hidden(f, sg, sgs, su, sus), sd, sds, residual)
    return reference.moe_experts(f, weights, ids, g, gs, u, us, d, ds, base)


def _lower_xla(ctx, f, weights, ids, *rest):
    def fn(f, weights, ids, *arrays):
        *stacks, residual, layer, layer_offset = arrays
        return reference_moe(f, weights, ids, tuple(stacks[:6]), tuple(stacks[6:]), residual,
                             Layer(layer[0], layer_offset[0]))
    return mlir.lower_fun(fn, multiple_results=False)(ctx, f, weights, ids, *rest)


def _warn(why):
    _lib.warn_once("moe_decode:" + why, f"jtilert.ffi: the engine's MoE not used ({why}); running the "
                   "reference experts in XLA")


_ops.register_engine_lowerings(moe_decode_p, "jtilert_moe_decode", _lower_xla, _warn,
                               lambda: {"timeout_ms": np.int64(_lib.timeout_ms())})


def unsupported(f, weights, ids, experts, shared, residual) -> str | None:
    """Why the kernel does not take these arrays (None: it does): one token, bf16 activations, fp8
    weights with 128 x 128 block scales, the shared expert as wide as a routed one, and shapes that
    split evenly over the kernel's CTAs (cuda/src/moe.cu's jt_moe_unsupported)."""
    g, gs, u, us, d, ds = experts
    sg, sgs, su, sus, sd, sds = shared
    if g.ndim != 4 or sg.ndim != 3:
        return f"expert stacks {list(g.shape)}, shared {list(sg.shape)} (stacked [L, E, I, H] and [L, I, H])"
    _, _, i, h = g.shape
    k = ids.shape[-1]
    if f.shape != (1, h) or residual is None or residual.shape != (1, h) or weights.shape != (1, k):
        return f"input {list(f.shape)} (one token of {h}), residual, weights {list(weights.shape)}"
    if f.dtype != jnp.bfloat16 or residual.dtype != jnp.bfloat16:
        return f"activations {f.dtype} (bf16)"
    if any(a.dtype != jnp.float8_e4m3fn for a in (g, u, d, sg, su, sd)) or any(s is None for s in (gs, us, ds, sgs, sus, sds)):
        return "weights not fp8 e4m3 with block scales"
    if sg.shape[1] != i or sd.shape[1:] != (h, i):
        return f"shared expert of width {sg.shape[1]}, routed {i}"
    return shape_unsupported(h, i, k)


def shape_unsupported(h: int, i: int, k: int) -> str | None:
    """Why the kernel does not take H = h, I = i, k routed experts (None: it does), as
    cuda/src/moe.cu's jt_moe_unsupported decides."""
    if k < 1 or k + 1 > MAX_SEGMENTS or h % 128 or h > MAX_VEC or i % 128 or i > _MAX_I or (k + 1) * i > MAX_VEC:
        return f"H={h}, I={i}, k={k}"
    if ((k + 1) * i) % CTAS or (k + 1) * i // CTAS > _MAX_PAIRS:
        return f"(k+1)·I={(k + 1) * i} not split over {CTAS} CTAs"
    rows = _ROWS2   # phase 2: a CTA's output rows of each expert's down, in chunks of `rows` rows of a slot
    while rows > _TILE and rows * i > _SLOT_BYTES:
        rows //= 2
    if _ROWS2 // rows * (k + 1) > _SLOTS:
        return f"phase 2's weights of a CTA ((k+1)·{_ROWS2} rows of I={i}) above the kernel's ring"
    return None


def moe_decode(f, weights, ids, experts: tuple, shared: tuple, residual, layer):
    """residual + Σ_j weights[0,j] · Expert_{ids[0,j]}(f) + Shared(f) for one token [1, H] bf16 at
    layer `layer` (a `jtilert.ops.layer.Layer` or an int32 scalar, may be traced; the kernel adds its
    base and offset) of the stacked experts (gate, gate_scale, up, up_scale, down, down_scale) and
    shared expert (the same, without the expert axis); [1, H] bf16."""
    return _ops.engine_op(
        "moe_decode", unsupported(f, weights, ids, experts, shared, residual), _warn,
        lambda: reference_moe(f, weights, ids, experts, shared, residual, layer),
        lambda: moe_decode_p.bind(f, weights.astype(jnp.float32), ids.astype(jnp.int32), *experts, *shared, residual,
                                  *Layer.of(layer).operands()))


__all__ = ["CTAS", "moe_decode", "reference_moe", "shape_unsupported", "unsupported"]
