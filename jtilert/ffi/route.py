"""The MoE router's selection in one launch: the engine's ``route_select`` (cuda/src/route.cu).

``select_experts(cfg, partials, bias, layer)`` is ``jtilert.ops.reference.select_experts(cfg, logits,
bias[layer])`` (sigmoid scores, the group-limited choice of the top experts, ties to the lower index,
the normalised weights) for the logits ``partials[0] + partials[1] + ..`` (the router GEMV's split-K
partial sums [S, T, E] fp32, added in that order) and the bias stack [L, E] fp32 read at ``layer`` on
the device (its base and offset, two operands the kernel adds: `jtilert.ops.layer.Layer`): one
kernel where XLA runs the sum and the selection as a chain of small fusions.

``norm_route(cfg, x, norm_weight, eps, gate, bias, layer)`` is ``jtilert.ops.reference.norm_route`` at
layer ``layer`` of the stacks in one launch (``norm_route_kernel``): the RMSNorm of x (written out for
the experts), the logits (bf16 gate rows, fp32 sums) and the same selection, where the Pallas path runs
the router's GEMV kernel and then ``route_select``.

Elsewhere (no GPU, no library, shapes the kernel does not take) XLA runs the reference, with one
warning per reason.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jtilert.ffi import _lib
from jtilert.ffi import ops as _ops
from jtilert.ops import reference
from jtilert.ops.layer import Layer

MAX_EXPERTS = 1024   # JT_ROUTE_MAX_EXPERTS: one thread per expert
ROUTER_MAX_EXPERTS = 256   # JT_ROUTE_MAX_ROUTER_EXPERTS: norm_route's CTA of 256 threads
ROUTER_MAX_HIDDEN = 8192   # JT_ROUTE_MAX_HIDDEN: a thread's gate row chunks in registers
ROUTER_MAX_TOKENS = 8      # JT_ROUTE_MAX_TOKENS

route_select_p = Primitive("jtilert_route_select")
route_select_p.multiple_results = True


class _Routing:
    """The config fields `reference.select_experts` reads, from the primitive's parameters."""

    def __init__(self, n_group, topk_group, k, norm, scaling):
        self.n_group, self.topk_group, self.num_experts_per_tok = n_group, topk_group, k
        self.norm_topk_prob, self.routed_scaling_factor = bool(norm), scaling


def _abstract(partials, bias, layer, layer_offset, *, n_group, topk_group, k, norm, scaling):  # noqa: ARG001
    shape = (partials.shape[1], k)
    return (partials.update(shape=shape, dtype=np.dtype(np.float32)),
            partials.update(shape=shape, dtype=np.dtype(np.int32)))


route_select_p.def_abstract_eval(_abstract)


def logits_of(partials):
    """The logits [T, E]: the partial sums [S, T, E] added in order (as the kernel adds them)."""
    return functools.reduce(jnp.add, list(partials))


def _reference(cfg, partials, bias, layer):
    """reference.select_experts of the summed partials with the bias row of `layer` (a `Layer` or an
    int32 scalar)."""
    index = Layer.of(layer).index()
    return reference.select_experts(cfg, logits_of(partials),
                                    jax.lax.dynamic_index_in_dim(bias, index, 0, keepdims=False))


def _lower_xla(ctx, partials, bias, layer, layer_offset, *, n_group, topk_group, k, norm, scaling):
    cfg = _Routing(n_group, topk_group, k, norm, scaling)
    return mlir.lower_fun(lambda p, b, i, o: list(_reference(cfg, p, b, Layer(i[0], o[0]))),
                          multiple_results=True)(ctx, partials, bias, layer, layer_offset)


def _attributes(*, n_group, topk_group, k, norm, scaling):   # noqa: ARG001 (k: the results' shape)
    return dict(n_group=np.int32(n_group), topk_group=np.int32(topk_group), norm=np.int32(norm),
                scaling=np.float32(scaling))


def _warn(why):
    _lib.warn_once("route:" + why, f"jtilert.ffi: CUDA route selection not used ({why}); "
                   "running the reference selection in XLA")


_ops.register_engine_lowerings(route_select_p, "jtilert_route_select", _lower_xla, _warn, _attributes)


def unsupported(cfg, partials, bias) -> str | None:
    """Why the kernel does not take these arrays (None: it does)."""
    e = partials.shape[-1]
    if (partials.ndim != 3 or partials.dtype != jnp.float32 or bias.dtype != jnp.float32 or bias.ndim != 2
            or bias.shape[1] != e):
        return (f"partial logits {partials.dtype}{list(partials.shape)}, bias {bias.dtype}{list(bias.shape)} "
                "(fp32, partials [S, T, E], bias [L, E])")
    if e > MAX_EXPERTS or e % cfg.n_group or not 1 <= cfg.topk_group <= cfg.n_group:
        return f"{e} experts in {cfg.n_group} groups (at most {MAX_EXPERTS}, whole groups)"
    if not 1 <= cfg.num_experts_per_tok <= e:
        return f"k={cfg.num_experts_per_tok} of {e} experts"
    return None


def select_experts(cfg, partials, bias, layer):
    """(weights [T, k] fp32, expert ids [T, k] int32) of `reference.select_experts(cfg, logits,
    bias[layer])` for logits = partials[0] + partials[1] + .. (partials [S, T, E]), bias [L, E] and
    `layer` a `jtilert.ops.layer.Layer` or an int32 scalar (may be traced)."""
    why = unsupported(cfg, partials, bias)
    ok, no_engine = _ops.engine_status()
    if why is not None or not ok:
        _warn(why or no_engine)
        return _reference(cfg, partials, bias, layer)
    return tuple(route_select_p.bind(
        partials, bias, *Layer.of(layer).operands(), n_group=int(cfg.n_group),
        topk_group=int(cfg.topk_group), k=int(cfg.num_experts_per_tok), norm=int(bool(cfg.norm_topk_prob)),
        scaling=float(cfg.routed_scaling_factor)))


# ---- the whole router: norm, logits and selection (norm_route_kernel) ----

norm_route_p = Primitive("jtilert_norm_route")
norm_route_p.multiple_results = True


def _norm_route_abstract(x, norm_weight, gate, bias, layer, layer_offset, *,  # noqa: ARG001
                         eps, n_group, topk_group, k, norm, scaling):
    shape = (x.shape[0], k)
    return (x, x.update(shape=shape, dtype=np.dtype(np.float32)), x.update(shape=shape, dtype=np.dtype(np.int32)))


norm_route_p.def_abstract_eval(_norm_route_abstract)


def _norm_route_reference(cfg, x, norm_weight, eps, gate, bias, layer):
    """reference.norm_route with the stacks read at `layer` (a `Layer` or an int32 scalar)."""
    index = Layer.of(layer).index()
    at = lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False)   # noqa: E731
    return reference.norm_route(cfg, x, at(norm_weight), eps, at(gate), at(bias))


def _norm_route_lower_xla(ctx, x, norm_weight, gate, bias, layer, layer_offset, *, eps, n_group, topk_group, k,
                          norm, scaling):
    cfg = _Routing(n_group, topk_group, k, norm, scaling)
    return mlir.lower_fun(lambda *a: list(_norm_route_reference(cfg, *a[:2], eps, *a[2:4], Layer(a[4][0], a[5][0]))),
                          multiple_results=True)(ctx, x, norm_weight, gate, bias, layer, layer_offset)


def _norm_route_attributes(*, eps, n_group, topk_group, k, norm, scaling):   # noqa: ARG001 (k: the results' shape)
    return dict(eps=np.float32(eps), **_attributes(n_group=n_group, topk_group=topk_group, k=k, norm=norm,
                                                  scaling=scaling))


def _norm_route_warn(why):
    _lib.warn_once("norm_route:" + why, f"jtilert.ffi: CUDA router (norm, logits, selection) not used ({why}); "
                   "running the reference router in XLA")


_ops.register_engine_lowerings(norm_route_p, "jtilert_norm_route", _norm_route_lower_xla, _norm_route_warn,
                               _norm_route_attributes)


def norm_route_unsupported(cfg, x, norm_weight, gate, bias) -> str | None:
    """Why `norm_route_kernel` does not take these arrays (None: it does): x [T, H] bf16 (T ≤ 8, H ≤
    8192 a multiple of 8), the stacks [L, H] bf16 (norm), [L, E, H] bf16 (gate), [L, E] fp32 (bias),
    E ≤ 256 in whole groups."""
    t, h = x.shape if x.ndim == 2 else (0, 0)
    if (x.ndim != 2 or x.dtype != jnp.bfloat16 or not 1 <= t <= ROUTER_MAX_TOKENS or h % 8 or h > ROUTER_MAX_HIDDEN):
        return (f"x {x.dtype}{list(x.shape)} (bf16 [T, H], T ≤ {ROUTER_MAX_TOKENS}, "
                f"H ≤ {ROUTER_MAX_HIDDEN} a multiple of 8)")
    if (norm_weight.dtype != jnp.bfloat16 or gate.dtype != jnp.bfloat16 or norm_weight.ndim != 2 or gate.ndim != 3
            or norm_weight.shape[1] != h or gate.shape[2] != h or gate.shape[0] != norm_weight.shape[0]):
        return (f"norm weight {norm_weight.dtype}{list(norm_weight.shape)}, gate {gate.dtype}{list(gate.shape)} "
                f"(bf16 stacks [L, {h}], [L, E, {h}])")
    e = gate.shape[1]
    if e > ROUTER_MAX_EXPERTS:
        return f"{e} experts (at most {ROUTER_MAX_EXPERTS})"
    return unsupported(cfg, jax.ShapeDtypeStruct((1, t, e), jnp.float32), bias)


def norm_route(cfg, x, norm_weight, eps, gate, bias, layer):
    """reference.norm_route(cfg, x, norm_weight[layer], eps, gate[layer], bias[layer]) — (f [T, H] bf16,
    weights [T, k] fp32, ids [T, k] int32) — in one launch of the engine; `layer` a
    `jtilert.ops.layer.Layer` or an int32 scalar (may be traced). ValueError where
    `norm_route_unsupported` names a reason; the reference (XLA) with one warning where the engine is not
    loaded."""
    return _ops.engine_op(
        "jtilert.ffi.route.norm_route", norm_route_unsupported(cfg, x, norm_weight, gate, bias), _norm_route_warn,
        lambda: _norm_route_reference(cfg, x, norm_weight, eps, gate, bias, layer),
        lambda: tuple(norm_route_p.bind(
            x, norm_weight, gate, bias, *Layer.of(layer).operands(), eps=float(eps), n_group=int(cfg.n_group),
            topk_group=int(cfg.topk_group), k=int(cfg.num_experts_per_tok), norm=int(bool(cfg.norm_topk_prob)),
            scaling=float(cfg.routed_scaling_factor))))
