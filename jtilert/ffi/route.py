"""The MoE router's selection in one launch: the engine's ``route_select`` (cuda/src/route.cu), and
the whole router of a MoE layer in one launch: its ``norm_route``.

``select_experts(cfg, partials, bias, layer)`` is ``jtilert.ops.reference.select_experts(cfg, logits,
bias[layer])`` (sigmoid scores, the group-limited choice of the top experts, ties to the lower index,
the normalised weights) for the logits ``partials[0] + partials[1] + ..`` (the router GEMV's split-K
partial sums [S, T, E] fp32, added in that order) and the bias stack [L, E] fp32 read at ``layer`` on
the device (its base and offset, two operands the kernel adds: `jtilert.ops.layer.Layer`): one
kernel where XLA runs the sum and the selection as a chain of small fusions.

``norm_route(cfg, x, norm_weight, eps, gate, bias, layer)`` is ``jtilert.ops.reference.norm_route``
on layer ``layer`` of the stacks: the norm of x, the router GEMV and the selection in one launch
(`DecodeConfig.engine_router`), where the pallas path runs the router's Pallas GEMV, then
``select_experts``.

``index_weights(x, norm_weight, eps, w, layer)`` is ``jtilert.ops.reference.index_weights`` (the
indexer's head weights) with the same kernel, without the selection (`DecodeConfig.engine_index_weights`).

Elsewhere (no GPU, no library, shapes a kernel does not take) XLA runs the reference, with one
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
NORM_ROUTE_MAX_EXPERTS = 512   # JT_NORM_ROUTE_MAX_EXPERTS
MAX_TOKENS = 8       # JT_ROUTE_MAX_TOKENS: norm_route's tokens
NORM_GEMV_MAX_SMEM = 200 * 1024   # JT_NORM_GEMV_MAX_SMEM: f [T, H] bf16 and the selection's floats
NORM_GEMV_MAX_ROWS = 1024          # JT_NORM_GEMV_MAX_ROWS

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


def _attributes(*, n_group, topk_group, k, norm, scaling, eps=None):   # noqa: ARG001 (k: the results' shape)
    attrs = dict(n_group=np.int32(n_group), topk_group=np.int32(topk_group), norm=np.int32(norm),
                 scaling=np.float32(scaling))
    return attrs if eps is None else dict(attrs, eps=np.float32(eps))


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


# ---- the whole router in one launch --------------------------------------------------------------

norm_route_p = Primitive("jtilert_norm_route")
norm_route_p.multiple_results = True


def _norm_route_abstract(x, norm_weight, gate, bias, layer, layer_offset, *, k, **_):  # noqa: ARG001
    t, e = x.shape[0], gate.shape[1]
    return (x.update(shape=x.shape, dtype=np.dtype(jnp.bfloat16)), x.update(shape=(t, e), dtype=np.dtype(np.float32)),
            x.update(shape=(t, k), dtype=np.dtype(np.float32)), x.update(shape=(t, k), dtype=np.dtype(np.int32)))


norm_route_p.def_abstract_eval(_norm_route_abstract)


def _norm_route_reference(cfg, x, norm_weight, eps, gate, bias, layer):
    """(f, logits, weights, ids): reference.norm_route on layer `layer` of the stacks, its logits too."""
    index = Layer.of(layer).index()
    norm_weight, gate, bias = (jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False)
                               for a in (norm_weight, gate, bias))
    f = reference.rms_norm(x, norm_weight, eps)
    logits = reference.router_logits(f, gate)
    return (f, logits, *reference.select_experts(cfg, logits, bias))


def _norm_route_lower_xla(ctx, x, norm_weight, gate, bias, layer, layer_offset, *, eps, n_group, topk_group, k,
                          norm, scaling):
    cfg = _Routing(n_group, topk_group, k, norm, scaling)
    def run(x, nw, g, b, i, o):
        return list(_norm_route_reference(cfg, x, nw, eps, g, b, Layer(i[0], o[0])))
    return mlir.lower_fun(run, multiple_results=True)(ctx, x, norm_weight, gate, bias, layer, layer_offset)


def _warn_norm_route(why):
    _lib.warn_once("norm_route:" + why, f"jtilert.ffi: CUDA norm_route not used ({why}); running the reference "
                   "norm, router and selection in XLA")


_ops.register_engine_lowerings(norm_route_p, "jtilert_norm_route", _norm_route_lower_xla,
                               _warn_norm_route, _attributes)


def _norm_gemv_unsupported(x, norm_weight, w) -> str | None:
    """Why the norm GEMV kernel does not take x, the norm weight stack [L, H] and the weight stack [L, N, H]."""
    t, h = x.shape if x.ndim == 2 else (0, 0)
    if x.ndim != 2 or x.dtype != jnp.bfloat16 or not 1 <= t <= MAX_TOKENS or h % 8:
        return f"x {x.dtype}{list(x.shape)} (bfloat16 [T, H], T <= {MAX_TOKENS}, H a multiple of 8)"
    if (norm_weight.ndim != 2 or norm_weight.shape[1] != h or w.ndim != 3 or w.shape[2] != h
            or norm_weight.shape[0] != w.shape[0]
            or not {norm_weight.dtype, w.dtype} <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}):
        return (f"norm weight {norm_weight.dtype}{list(norm_weight.shape)}, weights {w.dtype}{list(w.shape)} "
                "(stacks [L, H] and [L, N, H], bfloat16 or float32)")
    if 2 * t * h + 8192 > NORM_GEMV_MAX_SMEM:
        return f"f [{t}, {h}] in shared memory: over {NORM_GEMV_MAX_SMEM // 1024} KiB"
    return None


def norm_route_unsupported(cfg, x, norm_weight, gate, bias) -> str | None:
    """Why the one-launch router does not take these arrays (None: it does): the stacks [L, ...]."""
    why = _norm_gemv_unsupported(x, norm_weight, gate)
    if why is not None:
        return why
    e = gate.shape[1]
    if bias.dtype != jnp.float32 or bias.shape != (gate.shape[0], e):
        return f"bias {bias.dtype}{list(bias.shape)} (float32 [L, E])"
    if e > NORM_ROUTE_MAX_EXPERTS or e % cfg.n_group or not 1 <= cfg.topk_group <= cfg.n_group:
        return f"{e} experts in {cfg.n_group} groups (at most {NORM_ROUTE_MAX_EXPERTS}, whole groups)"
    if not 1 <= cfg.num_experts_per_tok <= e:
        return f"k={cfg.num_experts_per_tok} of {e} experts"
    return None


def norm_route_logits(cfg, x, norm_weight, eps, gate, bias, layer):
    """(f [T, H] bf16, logits [T, E] fp32, weights [T, k] fp32, ids [T, k] int32): the norm of x with layer
    `layer` of the norm weight stack [L, H], the router's logits with the gate stack [L, E, H], the
    selection with the bias stack [L, E] (`layer` a `jtilert.ops.layer.Layer` or an int32 scalar, may
    be traced), in one launch."""
    why = norm_route_unsupported(cfg, x, norm_weight, gate, bias)
    ok, no_engine = _ops.engine_status()
    if why is not None or not ok:
        _warn_norm_route(why or no_engine)
        return _norm_route_reference(cfg, x, norm_weight, eps, gate, bias, layer)
    return tuple(norm_route_p.bind(
        x, norm_weight, gate, bias, *Layer.of(layer).operands(), eps=float(eps), n_group=int(cfg.n_group),
        topk_group=int(cfg.topk_group), k=int(cfg.num_experts_per_tok), norm=int(bool(cfg.norm_topk_prob)),
        scaling=float(cfg.routed_scaling_factor)))


def norm_route(cfg, x, norm_weight, eps, gate, bias, layer):
    """(f, weights, ids) of `norm_route_logits`: the contract of `jtilert.ops.reference.norm_route`."""
    f, _, w, ids = norm_route_logits(cfg, x, norm_weight, eps, gate, bias, layer)
    return f, w, ids


# ---- a small fp32 GEMV of the normed input in one launch: the indexer's head weights -------------------

norm_gemv_p = Primitive("jtilert_norm_gemv")


def _norm_gemv_abstract(x, norm_weight, w, layer, layer_offset, *, eps):  # noqa: ARG001
    return x.update(shape=(x.shape[0], w.shape[1]), dtype=np.dtype(np.float32))


norm_gemv_p.def_abstract_eval(_norm_gemv_abstract)


def _index_weights_reference(x, norm_weight, eps, w, layer):
    index = Layer.of(layer).index()
    norm_weight, w = (jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False) for a in (norm_weight, w))
    return reference.index_weights(x, norm_weight, eps, w)


def _norm_gemv_lower_xla(ctx, x, norm_weight, w, layer, layer_offset, *, eps):
    return mlir.lower_fun(lambda x, nw, w, i, o: _index_weights_reference(x, nw, eps, w, Layer(i[0], o[0])),
                          multiple_results=False)(ctx, x, norm_weight, w, layer, layer_offset)


def _warn_norm_gemv(why):
    _lib.warn_once("norm_gemv:" + why, f"jtilert.ffi: CUDA norm_gemv not used ({why}); running the reference "
                   "norm and projection in XLA")


_ops.register_engine_lowerings(norm_gemv_p, "jtilert_norm_gemv", _norm_gemv_lower_xla,
                               _warn_norm_gemv, lambda *, eps: {"eps": np.float32(eps)})


def index_weights_unsupported(x, norm_weight, w) -> str | None:
    """Why the one-launch norm GEMV does not take these arrays (None: it does): the stacks [L, ...]."""
    why = _norm_gemv_unsupported(x, norm_weight, w)
    if why is None and w.shape[1] > NORM_GEMV_MAX_ROWS:
        why = f"{w.shape[1]} rows (at most {NORM_GEMV_MAX_ROWS})"
    return why


def index_weights(x, norm_weight, eps, w, layer):
    """`jtilert.ops.reference.index_weights` on layer `layer` of the stacks (norm weight [L, H], weights
    [L, N, H] fp32 or bf16): rms_norm(x) · W[layer]ᵀ in fp32, [T, N], in one launch of the engine's norm
    GEMV (the router's kernel without its selection)."""
    why = index_weights_unsupported(x, norm_weight, w)
    ok, no_engine = _ops.engine_status()
    if why is not None or not ok:
        _warn_norm_gemv(why or no_engine)
        return _index_weights_reference(x, norm_weight, eps, w, layer)
    return norm_gemv_p.bind(x, norm_weight, w, *Layer.of(layer).operands(), eps=float(eps))
