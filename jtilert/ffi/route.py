"""The MoE router's selection in one launch: the engine's ``route_select`` (cuda/src/route.cu).

``select_experts(cfg, partials, bias, layer)`` is ``jtilert.ops.reference.select_experts(cfg, logits,
bias[layer])`` (sigmoid scores, the group-limited choice of the top experts, ties to the lower index,
the normalised weights) for the logits ``partials[0] + partials[1] + ..`` (the router GEMV's split-K
partial sums [S, T, E] fp32, added in that order) and the bias stack [L, E] fp32 read at ``layer`` on
the device (its base and offset, two operands the kernel adds: `jtilert.ops.layer.Layer`): one
kernel where XLA runs the sum and the selection as a chain of small fusions.

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
