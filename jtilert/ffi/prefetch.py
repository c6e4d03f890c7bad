"""L2 prefetch of one layer of stacked weights: the engine's ``prefetch_l2`` (cuda/src/prefetch.cu).

At batch 1 a layer's GEMVs stream their weights from HBM while the attention chain before them
(indexer, top-k, sparse MLA) is latency bound and leaves HBM mostly idle. ``prefetch_l2(layer,
after, *stacks)`` issues, in one launch, L2 prefetches of layer ``layer`` of each stack ([L, ...], up
to MAX_ARRAYS, e.g. o_proj's fp8 weights and scales) and returns a token (int32[1]). ``after`` is
not read: the call runs after the op that produces it. The call is side-effecting, so XLA keeps it
with its token unused; in a captured graph it runs beside the chain after ``after``. ``ordered(x,
token)`` is ``x`` with a data dependency on the token.

A cache hint: no result changes. Pass the stacks themselves (read on the device as base + offset,
`jtilert.ops.layer.Layer`), not a slice or reshape XLA would materialise. Where the engine does not
run (a CPU; a GPU without the library, one warning per reason) the call is a zero token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ffi import _FfiEffect
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jtilert.ffi import _lib
from jtilert.ffi import ops as _ops
from jtilert.ops.layer import Layer

MAX_ARRAYS = 8   # JT_PREFETCH_MAX_ARRAYS
# element types XLA packs several to a byte: a layer's byte range is not whole bytes
_PACKED = {"int2", "uint2", "int4", "uint4", "float4_e2m1fn"}

prefetch_l2_p = Primitive("jtilert_prefetch_l2")


def _abstract(layer, layer_offset, after, *arrays):
    # int32 [1]; inside shard_map varying along every axis an operand varies along
    vma = frozenset().union(*(_ops._vma(a) for a in (layer_offset, after, *arrays)))  # noqa: SLF001
    return _ops._out_aval(layer, None, shape=(1,), dtype=np.int32, extra_vma=vma)  # noqa: SLF001


# JAX's effect of a side-effecting FFI call (what jax.ffi.ffi_call(has_side_effect=True) carries):
# without it JAX drops an equation whose token nobody reads before XLA sees it
prefetch_l2_p.def_effectful_abstract_eval(lambda *avals: (_abstract(*avals), {_FfiEffect}))
# outside jit: the primitive compiled on its own (the lowering below decides what runs)
_eager = jax.jit(lambda *args: prefetch_l2_p.bind(*args))
prefetch_l2_p.def_impl(_eager)


def _no_op(ctx, *operands):
    """The token where no kernel runs: a zero int32[1], nothing prefetched."""
    return mlir.lower_fun(lambda *_: jnp.zeros((1,), jnp.int32), multiple_results=False)(ctx, *operands)


def _lower_cuda(ctx, layer, layer_offset, after, *arrays):
    if not _ops.EMIT_WITHOUT_GPU:  # noqa: SLF001
        lib, why = _lib.load()
        if lib is None:
            _lib.warn_once("prefetch:" + why, f"jtilert.ffi: L2 prefetch not issued ({why}); "
                           "prefetch_l2 is a no-op")
            return _no_op(ctx, layer, layer_offset, after, *arrays)
    return jax.ffi.ffi_lowering("jtilert_prefetch_l2", has_side_effect=True)(ctx, layer, layer_offset, after,
                                                                              *arrays)


mlir.register_lowering(prefetch_l2_p, _no_op)
mlir.register_lowering(prefetch_l2_p, _lower_cuda, platform="cuda")


def check_stacks(arrays) -> None:
    """ValueError unless ``arrays`` are 1..MAX_ARRAYS layer stacks [L ≥ 1, ...] of at least two
    dimensions (a per-layer array under the layer axis) and of a whole-byte element type."""
    if not 1 <= len(arrays) <= MAX_ARRAYS:
        raise ValueError(f"prefetch_l2: 1 to {MAX_ARRAYS} stacks, got {len(arrays)} "
                         f"({[tuple(jnp.shape(a)) for a in arrays]})")
    for i, a in enumerate(arrays):
        shape, dtype = tuple(jnp.shape(a)), jnp.result_type(a)
        if len(shape) < 2 or shape[0] < 1 or dtype.name in _PACKED:
            raise ValueError(f"prefetch_l2: array {i} {dtype}{list(shape)} is not a layer stack [L, ...] "
                             "(at least 2-D with a leading layer axis L ≥ 1, a whole-byte dtype)")


def prefetch_l2(layer, after, *arrays):
    """Issues L2 prefetches of ``arrays[j][layer]`` for every stack ``arrays[j]`` ([L, ...]; the
    layer a `jtilert.ops.layer.Layer` or an integer scalar, may be traced: negative from the end,
    then clamped, like ``w[layer]``),
    after ``after`` is computed (any array, not read; None: no constraint). Returns the token, an
    int32[1] (zero); order the consumer after it with ``ordered``."""
    check_stacks(arrays)
    base, offset = Layer.of(layer).operands()
    return prefetch_l2_p.bind(base, offset, base if after is None else after, *arrays)


# bits no float arithmetic produces (hardware NaNs are canonical) and no token is: ``ordered``'s select
_NEVER = np.int32(0x7FBADBAD)


def ordered(x, token):
    """``x`` unchanged, with a data dependency on ``token`` (any array or pytree) that XLA cannot
    remove: each leaf of ``x`` is a select on the token's first word, which is never ``_NEVER``. (An
    optimization barrier does not order anything: XLA drops its unused outputs and what fed them.)
    It costs an elementwise pass over ``x``, fused into its consumer where XLA can."""
    words = [_first_word(t) for t in jax.tree.leaves(token)]
    if not words:
        return x
    keep = jnp.all(jnp.stack(words) != _NEVER)
    return jax.tree.map(lambda a: jnp.where(keep, a, jnp.zeros_like(a)), x)


def _first_word(t):
    """The first element of ``t`` as int32 bits (widened or bit-cast)."""
    v = jnp.ravel(jnp.asarray(t))[0]
    if v.dtype.itemsize == 4:
        return jax.lax.bitcast_convert_type(v, jnp.int32)
    if jnp.issubdtype(v.dtype, jnp.floating):
        v = v.astype(jnp.float32)
        return jax.lax.bitcast_convert_type(v, jnp.int32)
    return v.astype(jnp.int32)
