"""JAX side of the engine: primitives, their CUDA lowerings and XLA fallbacks.

Each op is a JAX primitive whose CUDA lowering emits the engine's FFI custom
call. The lowering is where the mesh is known concretely (the shard_map's
devices), so it creates the peer-memory group of every device list along the
axis there (once per process), in the main thread, before XLA runs anything.
If anything is missing (library, GPU, peer access, a size the engine does not
take) the op lowers to the plain XLA computation instead, with one warning.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jtilert.ffi import _lib
from jtilert.ffi import plan as _plan
from jtilert.ops import reference
from jtilert.ops.layer import Layer

# Emit the engine's custom calls (with CPU device ids) on a machine without a GPU: set by the tests
# that check the lowering itself and by bench/xla_kernels.py, which compiles for a GPU it does not
# have; never set it for running.
EMIT_WITHOUT_GPU = False


# ----------------------------------------------------------------- helpers

def _check_vma_on() -> bool:
    try:
        from jax._src import config as _cfg  # noqa: PLC0415

        return bool(_cfg._check_vma.value)  # noqa: SLF001
    except Exception:  # noqa: BLE001
        return False


def _ensure_varying(x, axis_name):
    if _check_vma_on() and axis_name not in jax.typeof(x).mat.varying:
        x = lax.pcast(x, axis_name, to="varying")
    return x


def _out_aval(aval, axis_name, shape=None, dtype=None, extra_vma=frozenset()):
    kw = {}
    if shape is not None:
        kw["shape"] = tuple(shape)
    if dtype is not None:
        kw["dtype"] = np.dtype(dtype)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        vma = (frozenset(mat.varying) | frozenset(extra_vma)) - {axis_name}
        kw["manual_axis_type"] = mat.update(varying=vma)
    return aval.update(**kw)


def _vma(aval):
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def engine_status() -> tuple[bool, str]:
    """(usable, reason if not)."""
    if EMIT_WITHOUT_GPU:
        return True, ""
    lib, why = _lib.load()
    return lib is not None, why


def engine_op(name: str, why: str | None, warn, reference, bind):
    """An engine op's result: ValueError naming `name` where `why` names shapes the kernel does not take;
    `reference()` (XLA) after `warn(reason)` where the engine is not loaded; else `bind()`."""
    if why is not None:
        raise ValueError(f"{name}: {why}")
    ok, no_engine = engine_status()
    if not ok:
        warn(no_engine)
        return reference()
    return bind()


def register_engine_lowerings(prim, target: str, xla_lowering, warn, attrs) -> None:
    """Registers `prim`'s lowerings: `xla_lowering` everywhere, and on CUDA the engine's FFI call `target`
    with the attributes `attrs(**params)` where the library loads with every local GPU prepared (or
    under EMIT_WITHOUT_GPU); on CUDA without it, `warn(reason)` and the XLA lowering."""
    def lower_cuda(ctx, *args, **params):
        if not EMIT_WITHOUT_GPU:
            lib, why = _lib.load_prepared()
            if lib is None:
                warn(why)
                return xla_lowering(ctx, *args, **params)
        return jax.ffi.ffi_lowering(target)(ctx, *args, **attrs(**params))
    mlir.register_lowering(prim, xla_lowering)
    mlir.register_lowering(prim, lower_cuda, platform="cuda")


def _fallback_warning(why: str) -> None:
    _lib.warn_once("fallback:" + why,
                   f"jtilert.ffi: CUDA engine not used ({why}); falling back to the XLA path "
                   "(lax.psum / jnp.dot / all_gather + sort)")


def _groups_for_lowering(ctx, axis_name):
    """([G, W] int32 device ids, None) or (None, reason); creates the groups."""
    ac = ctx.module_context.axis_context
    mesh = getattr(ac, "mesh", None)
    if EMIT_WITHOUT_GPU:
        if not isinstance(mesh, jax.sharding.Mesh):
            return None, "no concrete mesh in the lowering context"
        ax = list(mesh.axis_names).index(axis_name)
        devs = np.moveaxis(np.asarray(mesh.devices), ax, -1)
        devs = devs.reshape(-1, devs.shape[-1])
        return np.vectorize(lambda d: int(d.id), otypes=[np.int32])(devs), None
    lib, why = _lib.load()
    if lib is None:
        return None, why
    groups = _lib.groups_of(mesh, axis_name)
    if groups is None:
        return None, (f"axis {axis_name!r} is not an axis of a concrete single-process GPU mesh "
                      "in this lowering")
    if groups.shape[1] > _lib.MAX_WORLD:
        return None, f"axis size {groups.shape[1]} > {_lib.MAX_WORLD}"
    try:
        for row in groups:
            lib.group(tuple(int(v) for v in row))
    except RuntimeError as e:
        return None, f"peer-memory set-up failed: {e}"
    return groups, None


# ----------------------------------------------------------------- all-reduce

def _psum(x, axis_name):
    return lax.psum(x, axis_name)


all_reduce_p = Primitive("jtilert_all_reduce")


def _ar_abstract(x, *, axis_name, algo, blocks, threads):
    del algo, blocks, threads
    return _out_aval(x, axis_name)


all_reduce_p.def_abstract_eval(_ar_abstract)


def _ar_lower_xla(ctx, x, *, axis_name, **_):
    return mlir.lower_fun(lambda v: [_psum(v, axis_name)], multiple_results=True)(ctx, x)


def _ar_lower_cuda(ctx, x, *, axis_name, algo, blocks, threads):
    groups, why = _groups_for_lowering(ctx, axis_name)
    if groups is None:
        _fallback_warning(why)
        return _ar_lower_xla(ctx, x, axis_name=axis_name)
    return jax.ffi.ffi_lowering("jtilert_all_reduce")(
        ctx, x, groups=groups.ravel().astype(np.int32), world=np.int32(groups.shape[1]),
        algo=np.int32(algo), blocks=np.int32(blocks), threads=np.int32(threads))


mlir.register_lowering(all_reduce_p, _ar_lower_xla)
mlir.register_lowering(all_reduce_p, _ar_lower_cuda, platform="cuda")

_AR_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def all_reduce_config(nbytes: int, world: int, num_sms: int = 132) -> tuple[int, int, int]:
    """Default (algo, blocks, threads) for a message of ``nbytes`` per rank.

    One 8-byte line per thread (the fastest shape in the grid sweep of
    ``jtilert_selftest --bench``), the grid capped at one block per
    multiprocessor. One-shot on 2 GPUs (it beat two-shot at every size there)
    and up to 64 KiB; two-shot (half the bytes per link) above that.
    """
    lines = max(1, math.ceil(nbytes / 8))
    algo = _lib.AR_ONESHOT if (world <= 2 or nbytes <= 64 * 1024) else _lib.AR_TWOSHOT
    if algo == _lib.AR_TWOSHOT:
        lines = math.ceil(lines / world)
    threads = 256 if lines <= 256 * num_sms else 512
    blocks = min(max(1, math.ceil(lines / threads)), num_sms)
    return algo, int(blocks), threads


def all_reduce(x, axis_name, *, algo=None, blocks=None, threads=None):
    """Sum of ``x`` over the mesh axis ``axis_name`` (inside ``shard_map``).

    On GPU with the engine: one NVLink kernel (fp32 sums in rank order, every
    rank bit-identical). Otherwise ``lax.psum`` (one warning).
    """
    ok, why = engine_status()
    if not ok:
        _fallback_warning(why)
        return _psum(x, axis_name)
    if not isinstance(axis_name, str):
        _fallback_warning("only a single named axis is supported")
        return _psum(x, axis_name)
    x = jnp.asarray(x)
    if x.dtype not in _AR_DTYPES:
        _fallback_warning(f"dtype {x.dtype} not supported by the engine all-reduce")
        return _psum(x, axis_name)
    world = lax.axis_size(axis_name)
    nbytes = x.size * x.dtype.itemsize
    if world == 1 or x.size == 0:
        return _psum(x, axis_name)
    if nbytes > _lib.payload_cap():
        _fallback_warning(f"message of {nbytes} bytes over JTILERT_FFI_MAX_BYTES={_lib.payload_cap()}")
        return _psum(x, axis_name)
    d_algo, d_blocks, d_threads = all_reduce_config(nbytes, world, _num_sms())
    x = _ensure_varying(x, axis_name)
    return all_reduce_p.bind(x, axis_name=axis_name,
                             algo=int(d_algo if algo is None else algo),
                             blocks=int(d_blocks if blocks is None else blocks),
                             threads=int(d_threads if threads is None else threads))


# ----------------------------------------------------------------- GEMV + all-reduce

def dequantize(w, scale):
    """fp32 W from bf16 W, or from fp8 W and its [ceil(N/128), ceil(K/128)] scales."""
    wf = w.astype(jnp.float32)
    if scale is None:
        return wf
    n, k = w.shape
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), 128, axis=0)[:n], 128, axis=1)[:, :k]
    return wf * s


def _stacked_layer(layer, **stacked):
    """``layer`` of the stacked-weight ops as a `Layer` (a traced base stays a device value: the
    kernel reads base and offset and adds them, the host never does). ``stacked``: name=(array or
    None, its rank with the layer axis); raises unless they all share one leading layer axis."""
    layer = Layer.of(layer)
    shapes = {k: tuple(a.shape) for k, (a, _) in stacked.items() if a is not None}
    if (any(len(shapes[k]) != nd for k, (a, nd) in stacked.items() if a is not None)
            or len({sh[0] for sh in shapes.values()}) != 1):
        raise ValueError(f"with layer=, the weights and scales are stacked [L, ...] arrays of one "
                         f"L and ranks {({k: nd for k, (_, nd) in stacked.items()})}; got {shapes}")
    return layer


def _at_layer(a, layer):
    """``a[layer]`` of a stacked [L, ...] weight or scale (``a`` itself when ``layer`` or ``a`` is
    None): the XLA path's slice, with jnp's index semantics (negative from the end, clamped)."""
    return a if a is None or layer is None else jnp.asarray(a)[Layer.of(layer).index()]


def _operand_layer(operands):
    """The `Layer` that `_stacked_bind` passed as a primitive's last two operands (base, offset:
    int32 [1] each), or None where there are none."""
    return Layer(operands[0][0], operands[1][0]) if operands else None


def _one_layer(a):
    """Shape and dtype of one layer of a stacked [L, ...] array, for the engine's shape checks."""
    return None if a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)


def gemv_reference(x, w, scale, axis_name, *, layer=None):
    """The XLA path: all_reduce(x @ dequant(w).T) in fp32, result in x.dtype (with ``layer``:
    of ``w[layer]``, ``scale[layer]``)."""
    w, scale = _at_layer(w, layer), _at_layer(scale, layer)
    y = jnp.dot(dequantize(w, scale), x.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    if axis_name is not None:
        y = lax.psum(y, axis_name)
    return y.astype(x.dtype)


gemv_p = Primitive("jtilert_gemv_all_reduce")


def _gemv_abstract(x, w, scale, table, *layer, axis_name, **_):
    return _out_aval(x, axis_name, shape=(w.shape[-2],), dtype=x.dtype,
                     extra_vma=frozenset().union(*(_vma(a) for a in (w, scale, table, *layer))))


gemv_p.def_abstract_eval(_gemv_abstract)


def _gemv_lower_xla(ctx, x, w, scale, table, *layer, axis_name, has_scale, **_):
    def f(x, w, s, t, *layer):
        del t
        return [gemv_reference(x, w, s if has_scale else None, axis_name, layer=_operand_layer(layer))]
    return mlir.lower_fun(f, multiple_results=True)(ctx, x, w, scale, table, *layer)


def _task_table_lowering(target, lower_xla):
    """CUDA lowering of an op that runs the GEMV kernel on a task table: the FFI custom call with
    the axis' device groups (world 1 without an axis), or ``lower_xla`` when they cannot be set up.
    ``stacked``: the weights carry a leading layer axis and the last two operands are the layer's
    base and offset (target ``<target>_stacked``; the kernel offsets the weight pointers by their
    sum on the device)."""
    def lower(ctx, *args, axis_name, nwc, rpw, num_ctas, max_tasks, has_scale, stacked=False):
        if axis_name is None:
            groups, world = np.zeros((1,), np.int32), 1
        else:
            g, why = _groups_for_lowering(ctx, axis_name)
            if g is None:
                _fallback_warning(why)
                return lower_xla(ctx, *args, axis_name=axis_name, has_scale=has_scale)
            groups, world = g.ravel().astype(np.int32), g.shape[1]
        return jax.ffi.ffi_lowering(target + STACKED_SUFFIX if stacked else target)(
            ctx, *args, groups=groups, world=np.int32(world), nwc=np.int32(nwc), rpw=np.int32(rpw),
            num_ctas=np.int32(num_ctas), max_tasks=np.int32(max_tasks),
            has_scale=np.int32(1 if has_scale else 0))
    return lower


# FFI target suffix of the stacked-weight form of a task-table op (extra layer operands)
STACKED_SUFFIX = "_stacked"

mlir.register_lowering(gemv_p, _gemv_lower_xla)
mlir.register_lowering(gemv_p, _task_table_lowering("jtilert_gemv_all_reduce", _gemv_lower_xla),
                       platform="cuda")


def _num_sms() -> int:
    lib, _ = _lib.load()
    if lib is None:
        return 132
    n = lib.sm_count(0)
    return n if n > 0 else 132


def _weight_unsupported(w, scale, scale_shape, k) -> str | None:
    """Why the engine cannot stream ``w`` (bf16, or fp8 with scales of ``scale_shape``) with a K
    segment of ``k`` elements; None if it can."""
    if w.dtype == jnp.bfloat16:
        if scale is not None:
            return "scales with bf16 weights"
        wd = "bf16"
    elif w.dtype == jnp.float8_e4m3fn:
        if scale is None:
            return "fp8 weights without scales"
        wd = "fp8"
    else:
        return f"weight dtype {w.dtype}"
    if scale is not None and tuple(scale.shape) != tuple(scale_shape):
        return f"scale shape {scale.shape} != {tuple(scale_shape)}"
    if k % _plan.ELEMS_PER_CHUNK[wd]:
        return f"K={k} not a multiple of {_plan.ELEMS_PER_CHUNK[wd]}"
    return None


def _output_unsupported(n) -> str | None:
    return f"N={n} over the engine's payload cap" if 4 * n > _lib.payload_cap() else None


def _gemv_unsupported(x, w, scale, layer=None) -> str | None:
    if layer is not None:
        w, scale = _one_layer(w), _one_layer(scale)
    if x.ndim != 1 or w.ndim != 2 or w.shape[1] != x.shape[0]:
        return f"shapes x{x.shape} w{w.shape} are not x[K], w[N, K]"
    if x.dtype != jnp.bfloat16:
        return f"x dtype {x.dtype} (engine GEMV takes bf16)"
    n, k = w.shape
    return (_weight_unsupported(w, scale, (math.ceil(n / 128), math.ceil(k / 128)), k)
            or _output_unsupported(n))


def _scales(*scales):
    """fp32 scales, or one placeholder per scale for bf16 weights (the kernel ignores them)."""
    if scales[0] is None:
        return (jnp.zeros((1,), jnp.float32),) * len(scales)
    return tuple(s.astype(jnp.float32) for s in scales)


def _table_attrs(n, k, w, nwc, rpw):
    """(device task table, primitive attributes) of the GEMV plan for N x K weights like ``w``."""
    wd = "fp8" if w.dtype == jnp.float8_e4m3fn else "bf16"
    p = _plan.build_gemv_plan(n, k, wdtype=wd, num_sms=_num_sms(), nwc=nwc, rpw=rpw)
    return jnp.asarray(p.table), dict(nwc=p.nwc, rpw=p.rpw, num_ctas=p.num_ctas,
                                      max_tasks=p.max_tasks, has_scale=wd == "fp8")


def _stacked_bind(prim, operands, layer, **params):
    """Binds ``prim``; with ``layer`` (stacked weights), the layer's base and offset are the last two
    operands (`Layer.operands`)."""
    if layer is None:
        return prim.bind(*operands, **params)
    return prim.bind(*operands, *layer.operands(), stacked=True, **params)


def _gemv_bind(x, w, scale, axis_name, nwc, rpw, layer=None):
    table, attrs = _table_attrs(w.shape[-2], w.shape[-1], w, nwc, rpw)
    return _stacked_bind(gemv_p, (x, w, *_scales(scale), table), layer, axis_name=axis_name,
                         **attrs)


def _gemv_refused(x, w, scale, layer, one_axis: bool = True) -> str | None:
    """Why the engine's GEMV cannot run this call (the engine is not loaded, more than one mesh axis,
    the shapes), or None."""
    ok, why = engine_status()
    if not ok:
        return why
    if not one_axis:
        return "only a single named axis is supported"
    return _gemv_unsupported(x, w, scale, layer)


def gemv_all_reduce(x, w, scale, axis_name, *, layer=None, nwc=None, rpw=None):
    """y[N] = all_reduce(x @ dequant(w).T) over ``axis_name``, in ``x.dtype``.

    x: [K_local] bf16; w: [N, K_local] bf16 (scale None) or float8_e4m3fn with
    ``scale`` [ceil(N/128), ceil(K_local/128)] fp32 block scales (W = q * scale).
    On GPU with the engine: one persistent kernel that streams the weights and
    overlaps the exchange of each output tile with the next tile's weights.

    ``layer`` (a `jtilert.ops.layer.Layer` or an int32 scalar, may be traced):
    w [L, N, K_local] and scale [L, ...] hold every layer's weights and the
    result is the op on ``w[layer]``, ``scale[layer]``. The engine takes the
    whole stacked arrays and the kernel offsets its weight pointers by the
    layer it reads on the device (base + offset), so a layer loop copies no
    weight slice and computes no index (the XLA path slices).
    """
    x, w = jnp.asarray(x), jnp.asarray(w)
    if layer is not None:
        layer = _stacked_layer(layer, w=(w, 3), scale=(scale, 3))
    why = _gemv_refused(x, w, scale, layer, one_axis=isinstance(axis_name, str))
    if why:
        _fallback_warning(why)
        return gemv_reference(x, w, scale, axis_name, layer=layer)
    if lax.axis_size(axis_name) == 1:
        return gemv(x, w, scale, layer=layer, nwc=nwc, rpw=rpw)
    x = _ensure_varying(x, axis_name)
    return _gemv_bind(x, w, scale, axis_name, nwc, rpw, layer)


def gemv(x, w, scale=None, *, layer=None, nwc=None, rpw=None):
    """Local y[N] = x @ dequant(w).T with the engine's GEMV kernel (no all-reduce); ``layer`` as
    in ``gemv_all_reduce``."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    if layer is not None:
        layer = _stacked_layer(layer, w=(w, 3), scale=(scale, 3))
    why = _gemv_refused(x, w, scale, layer)
    if why:
        _fallback_warning(why)
        return gemv_reference(x, w, scale, None, layer=layer)
    return _gemv_bind(x, w, scale, None, nwc, rpw, layer)


# ----------------------------------------------------------------- MoE down + shared + all-reduce

def expert_down_reference(h, weights, ids, down, down_scale, shared_h, shared_down, shared_scale,
                          axis_name, *, layer=None):
    """The XLA path, which is the model's unfused one: psum over ``axis_name`` of the routed
    experts' weighted down projections (``jtilert.ops.reference.expert_down``: fp32, rounded to h.dtype)
    plus the shared expert's (``reference.linear``: rounded to h.dtype), added in h.dtype. With
    ``layer``: of the weights and scales at ``[layer]``."""

    down, down_scale, shared_down, shared_scale = (
        _at_layer(a, layer) for a in (down, down_scale, shared_down, shared_scale))
    routed = reference.expert_down(h, weights[None], ids[None], down, down_scale)[0]
    y = routed + reference.linear(shared_h, shared_down, shared_scale)
    return y if axis_name is None else lax.psum(y, axis_name)


expert_down_p = Primitive("jtilert_expert_down_all_reduce")


def _ed_abstract(h, *rest, axis_name, **_):
    vma = frozenset().union(*(_vma(a) for a in rest))
    return _out_aval(h, axis_name, shape=(rest[2].shape[-2],), dtype=h.dtype, extra_vma=vma)


expert_down_p.def_abstract_eval(_ed_abstract)


def _ed_lower_xla(ctx, h, weights, ids, down, down_scale, shared_h, shared_down, shared_scale,
                  table, *layer, axis_name, has_scale, **_):
    def f(h, weights, ids, down, ds, shared_h, shared_down, ss, table, *layer):
        del table
        return [expert_down_reference(h, weights, ids, down, ds if has_scale else None, shared_h,
                                      shared_down, ss if has_scale else None, axis_name,
                                      layer=_operand_layer(layer))]
    return mlir.lower_fun(f, multiple_results=True)(ctx, h, weights, ids, down, down_scale, shared_h,
                                                    shared_down, shared_scale, table, *layer)


mlir.register_lowering(expert_down_p, _ed_lower_xla)
mlir.register_lowering(expert_down_p,
                       _task_table_lowering("jtilert_expert_down_all_reduce", _ed_lower_xla),
                       platform="cuda")


def _expert_down_unsupported(h, weights, ids, down, down_scale, shared_h, shared_down,
                             shared_scale, layer=None) -> str | None:
    if layer is not None:
        down, down_scale, shared_down, shared_scale = (
            _one_layer(a) for a in (down, down_scale, shared_down, shared_scale))
    if (h.ndim != 2 or down.ndim != 3 or shared_h.ndim != 1 or shared_down.ndim != 2
        or down.shape[2] != h.shape[1] or weights.shape != (h.shape[0],) or ids.shape != weights.shape
        or shared_down.shape != (down.shape[1], shared_h.shape[0])):
        return (f"shapes h{h.shape} weights{weights.shape} ids{ids.shape} down{down.shape} "
                f"shared_h{shared_h.shape} shared_down{shared_down.shape} are not h[k, I], weights[k], "
                "ids[k], down[E, N, I], shared_h[Is], shared_down[N, Is]")
    if h.dtype != jnp.bfloat16 or shared_h.dtype != jnp.bfloat16:
        return f"hidden dtypes {h.dtype}/{shared_h.dtype} (engine GEMV takes bf16)"
    if shared_down.dtype != down.dtype:
        return f"routed {down.dtype} and shared {shared_down.dtype} weights differ"
    e, n, i = down.shape
    i_s = shared_h.shape[0]
    nb = math.ceil(n / 128)
    return (_weight_unsupported(down, down_scale, (e, nb, math.ceil(i / 128)), i)
            or _weight_unsupported(shared_down, shared_scale, (nb, math.ceil(i_s / 128)), i_s)
            or _output_unsupported(n))


def expert_down_all_reduce(h, weights, ids, down, down_scale, shared_h, shared_down, shared_scale,
                           axis_name, *, layer=None, nwc=None, rpw=None):
    """y[N] = all_reduce(Σ_j weights[j] · Down[ids[j]] · h[j] + SharedDown · shared_h) over
    ``axis_name``, in ``h.dtype``: one decode token's MoE down projections, the routing-weighted sum
    and the shared expert (TileRT's ExpertDownAllReduce).

    h [k, I] bf16 (the chosen experts' SwiGLU outputs), weights [k] fp32, ids [k] int32 (device
    values: the kernel reads the expert ids itself), down [E, N, I] stacked experts, shared_h [Is]
    bf16, shared_down [N, Is]; weights bf16, or fp8 with ``down_scale`` [E, ceil(N/128),
    ceil(I/128)] and ``shared_scale`` [ceil(N/128), ceil(Is/128)]. On GPU with the engine: the GEMV
    kernel over K = k·I + Is, x = (w_j · h_j in fp32, then shared_h), fp32 until the single bf16
    rounding of the reduced result. Otherwise ``expert_down_reference`` (one warning).

    ``layer`` (a `jtilert.ops.layer.Layer` or an int32 scalar, may be traced): down [L, E, N, I],
    shared_down [L, N, Is] and their scales [L, ...] hold every layer's weights; the result is the
    op on layer ``layer``'s, read by the kernel at a device-side offset (as in ``gemv_all_reduce``).
    """
    h, shared_h = jnp.asarray(h), jnp.asarray(shared_h)
    weights, ids = jnp.asarray(weights, jnp.float32), jnp.asarray(ids, jnp.int32)
    if layer is not None:
        layer = _stacked_layer(layer, down=(down, 4), down_scale=(down_scale, 4),
                             shared_down=(shared_down, 3), shared_scale=(shared_scale, 3))
    ok, why = engine_status()
    if ok and not isinstance(axis_name, str):
        ok, why = False, "only a single named axis is supported"
    if ok:
        bad = _expert_down_unsupported(h, weights, ids, down, down_scale, shared_h, shared_down,
                                       shared_scale, layer)
        if bad:
            ok, why = False, bad
    if not ok:
        _fallback_warning(why)
        return expert_down_reference(h, weights, ids, down, down_scale, shared_h, shared_down,
                                     shared_scale, axis_name, layer=layer)
    if lax.axis_size(axis_name) == 1:
        axis_name = None
    else:
        h = _ensure_varying(h, axis_name)
    n = down.shape[-2]
    table, attrs = _table_attrs(n, h.size + shared_h.size, down, nwc, rpw)
    ds, ss = _scales(down_scale, shared_scale)
    return _stacked_bind(expert_down_p, (h, weights, ids, down, ds, shared_h, shared_down, ss, table),
                         layer, axis_name=axis_name, **attrs)


# ----------------------------------------------------------------- merge top-k

def _gather_invariant(x, axis_name):
    if _check_vma_on():
        return lax.all_gather(_ensure_varying(x, axis_name), axis_name, tiled=True, to="invarying")
    return lax.all_gather(x, axis_name, tiled=True)


def merge_topk_reference(scores, indices, axis_name, k):
    """all_gather + sort by (score desc, index asc), first k; -0.0 counts (and comes back) as +0.0."""
    s = _gather_invariant(_canonical_zero(scores), axis_name)
    i = _gather_invariant(indices, axis_name)
    neg, idx = lax.sort((-s, i), num_keys=2)
    return -neg[:k], idx[:k]


def _canonical_zero(s):
    return jnp.where(s == 0, jnp.zeros_like(s), s)


def sort_candidates(scores, indices):
    """Sorts one rank's candidates by (score desc, index asc), -0.0 as +0.0."""
    neg, idx = lax.sort((-_canonical_zero(scores), indices), num_keys=2)
    return -neg, idx


merge_topk_p = Primitive("jtilert_merge_topk")
merge_topk_p.multiple_results = True


def _topk_abstract(scores, indices, *, axis_name, k, **_):
    vma = _vma(indices)
    return (_out_aval(scores, axis_name, shape=(k,), extra_vma=vma),
            _out_aval(indices, axis_name, shape=(k,), extra_vma=_vma(scores)))


merge_topk_p.def_abstract_eval(_topk_abstract)


def _topk_lower_xla(ctx, scores, indices, *, axis_name, k, **_):
    return mlir.lower_fun(lambda s, i: list(merge_topk_reference(s, i, axis_name, k)),
                          multiple_results=True)(ctx, scores, indices)


def _topk_lower_cuda(ctx, scores, indices, *, axis_name, k, blocks, threads):
    groups, why = _groups_for_lowering(ctx, axis_name)
    if groups is None:
        _fallback_warning(why)
        return _topk_lower_xla(ctx, scores, indices, axis_name=axis_name, k=k)
    return jax.ffi.ffi_lowering("jtilert_merge_topk")(
        ctx, scores, indices, groups=groups.ravel().astype(np.int32),
        world=np.int32(groups.shape[1]), blocks=np.int32(blocks), threads=np.int32(threads))


mlir.register_lowering(merge_topk_p, _topk_lower_xla)
mlir.register_lowering(merge_topk_p, _topk_lower_cuda, platform="cuda")


def merge_topk(scores, indices, axis_name, k, *, sorted_inputs=True, blocks=None,
               threads=None):
    """Global top-``k`` of every rank's candidates, identical on every rank.

    scores [m] float32 and indices [m] int32 (global positions) are one rank's
    candidates; k <= axis_size * m. The result (scores [k], indices [k]) is ordered
    by score desc, ties by the lower index first. The engine path needs each
    rank's list already in that order (``lax.top_k`` over a rank's own positions
    gives it once the local positions are offset to global ones); pass
    ``sorted_inputs=False`` to sort first. Scores must not be NaN; -0.0 is
    treated as (and returned as) +0.0.
    """
    scores = jnp.asarray(scores, jnp.float32)
    indices = jnp.asarray(indices, jnp.int32)
    ok, why = engine_status()
    if ok and not isinstance(axis_name, str):
        ok, why = False, "only a single named axis is supported"
    if ok:
        world = lax.axis_size(axis_name)
        m = scores.shape[0]
        if scores.ndim != 1 or indices.shape != scores.shape:
            ok, why = False, f"scores {scores.shape} / indices {indices.shape} must be equal 1-D"
        elif not 1 <= k <= world * m:
            raise ValueError(f"k={k} must be in [1, {world * m}]")
        elif m > _lib.payload_cap() // 8:
            ok, why = False, f"m={m} over the engine's payload cap"
        elif not EMIT_WITHOUT_GPU:
            lib, _ = _lib.load()
            if m > lib.merge_topk_max_m(0, world):
                ok, why = False, f"m={m} does not fit in shared memory for {world} ranks"
    if not ok:
        _fallback_warning(why)
        return merge_topk_reference(scores, indices, axis_name, k)
    if not sorted_inputs:
        scores, indices = sort_candidates(scores, indices)
    scores = _ensure_varying(scores, axis_name)
    indices = _ensure_varying(indices, axis_name)
    total = world * m
    # about one block per 256 candidates, at most 32 (``jtilert_selftest --bench`` sweeps the grid)
    threads = int(threads or 512)
    blocks = int(blocks or min(32, max(1, math.ceil(total / 256))))
    out_s, out_i = merge_topk_p.bind(scores, indices, axis_name=axis_name, k=int(k),
                                     blocks=blocks, threads=threads)
    return out_s, out_i
