"""Lower each Mosaic-GPU kernel once per process, whatever the number of programs that call it.

JAX lowers a jitted kernel once per program (the program's own lowering cache), but every program
lowers it again, and Mosaic's lowering runs in Python (layout inference, dialect lowering): about a
second per kernel. A process that lowers several programs with the same kernels (a Generator's
`stream` and `generate` steps, a benchmark's device loop and single step) reuses the first lowering:
`install()` wraps jax's lowering of a kernel body with a cache keyed by the body's jaxpr (the one
object JAX's trace cache returns for a jitted kernel of one signature, kept alive by the key), its
operand and result types, its grid and compiler parameters and the target GPU. A hit parses the kept
module (MLIR bytecode) into the new program's context: what Mosaic's serialisation does with every
module anyway, so the kernel's code is the same. `lowerings` counts the kernels actually lowered.

`prelower(jaxpr)` fills the cache for a traced program before jax lowers it: the kernels are
independent, so forked worker processes lower them side by side (the parent's traced kernel bodies
are in their memory; each sends back its module's bytecode). A worker that fails or does not answer
leaves its kernel to the plain lowering that follows, which raises its error where it belongs.

On a GPU, `prelower` also starts each lowered kernel's compile (`precompile`): jaxlib compiles a Mosaic
module (MLIR → PTX → cubin) where XLA instantiates the program's custom call, one module at a time
under a process-wide lock, and keeps it for the process by the module's hash. Inside the program's
compile those seconds come after its lowering and XLA's passes; a background thread that compiles a
program of each kernel alone starts them as soon as the kernel is lowered, so they overlap the
program's lowering and XLA's own work, and the program's compile finds its kernels compiled.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import math
import multiprocessing
import os
import threading
import time
import warnings

import jax

from jax._src import config as _jax_config
from jax._src import core as _core
from jax._src import shard_map as _shard_map
from jax._src.interpreters import mlir
from jax._src.interpreters import pxla as _pxla
from jax._src.lib.mlir import ir
from jax._src.pallas import mpmd as _mpmd
from jax._src.pallas.mosaic_gpu import core as _gpu_core
from jax._src.pallas.mosaic_gpu import lowering as _pl_lowering
from jax.experimental.mosaic import gpu as _mgpu
from jax.experimental.mosaic.gpu import utils as _mgpu_utils

lowerings = 0   # kernels lowered by Mosaic in this process (cache misses)
prelowered = 0   # of those, lowered by `prelower`'s workers
_cache: dict = {}
_lock = threading.Lock()
_upstream = _pl_lowering.lower_unpipelined_jaxpr_to_module
KERNEL_TIMEOUT_S = 60   # a kernel lowers in 0.1-3 s; workers stuck far past that are abandoned


def _key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params):
    """The cache key of one kernel lowering, or None where a part cannot be hashed."""
    key = (jaxpr, tuple(in_shapes), tuple(out_shapes), gpu_mesh, jax_mesh, params, _mgpu_utils._infer_arch())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _serialise(result) -> tuple[bytes, dict]:
    """A lowering as what the cache keeps: the module's bytecode and the result's other fields."""
    buf = io.BytesIO()
    result.module.operation.write_bytecode(buf)
    return buf.getvalue(), {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name != "module"}


@functools.cache
def install() -> None:
    """Route jax's lowering of Mosaic-GPU kernel bodies through the cache (once per process)."""
    def lower(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kw):
        global lowerings
        key = _key(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params)
        with _lock:
            kept = _cache.get(key) if key is not None else None
        if kept is not None:
            code, fields = kept
            return _pl_lowering.LoweringResult(module=ir.Module.parse(code), **fields)
        result = _upstream(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kw)
        with _lock:
            lowerings += 1
            if key is not None and result.profiler_spec is None:   # a profiled kernel dumps per lowering
                _cache[key] = _serialise(result)
        return result

    _pl_lowering.lower_unpipelined_jaxpr_to_module = lower


def clear() -> None:
    """Forget the kept kernels and which were handed to the background compile (tests)."""
    with _lock:
        _cache.clear()
        _handed.clear()


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """One kernel call of a traced program, as jax's `mpmd_map` lowering rule will see it."""
    gpu_mesh: object
    meshes: tuple
    jaxpr: object
    in_shapes: tuple
    out_shapes: tuple
    params: object
    shard_map: tuple | None   # (mesh, newly manual axes) of an enclosing shard_map
    traceback: object         # the call's, which the kernel's source locations start from
    eqn: object = dataclasses.field(compare=False)   # the call itself (`kernel_program` binds it again)

    @property
    def jax_mesh(self):
        return None if self.shard_map is None else _shard_map._get_spmdaxis_ctx_mesh(self.shard_map[0])

    @property
    def key(self):
        return _key(self.gpu_mesh, self.jax_mesh, self.jaxpr, self.in_shapes, self.out_shapes, self.params)


def _kernels(jaxpr, shard_map=None):
    """The compiled (not interpreted) Mosaic-GPU kernel calls of a jaxpr and the jaxprs inside it."""
    for e in jaxpr.eqns:
        p = e.params
        if e.primitive.name == "mpmd_map" and not p.get("interpret") and len(p["jaxprs"]) == 1 \
                and isinstance(p["meshes"][0], _gpu_core.Mesh) and not p.get("external_meshes"):
            params = p["compiler_params"] if p["compiler_params"] is not None else _gpu_core.CompilerParams()
            if not params.profile_space:   # a profiled kernel is lowered (and dumps) in every program
                yield _Kernel(p["meshes"][0], tuple(p["meshes"]), p["jaxprs"][0], tuple(v.aval for v in e.invars),
                              tuple(v.aval for v in e.outvars), params, shard_map, e.source_info.traceback, e)
            continue
        inner = (p["mesh"], p["newly_manual_axes"]) if e.primitive.name == "shard_map" else shard_map
        for v in p.values():
            for x in v if isinstance(v, (list, tuple)) else [v]:
                if hasattr(x, "jaxpr") and hasattr(x, "consts"):
                    yield from _kernels(x.jaxpr, inner)
                elif hasattr(x, "eqns"):
                    yield from _kernels(x, inner)


_pending: list[_Kernel] = []   # what the forked workers lower (they inherit it)


def _lower_pending(i: int):
    """In a worker: lower `_pending[i]` as jax's `mpmd_map` rule would, in a fresh MLIR context."""
    k = _pending[i]
    axes = contextlib.nullcontext() if k.shard_map is None else _shard_map._extend_axis_env(*k.shard_map)
    # A context of its own, single-threaded: jax's contexts share one MLIR thread pool, whose threads
    # were not forked with this process (the verifier would wait for them forever).
    ctx = mlir._create_ir_context()
    ctx.enable_multithreading(False)
    _mgpu.dialect.register_dialect(ctx)
    with ctx, ir.Location.unknown(), axes, _mpmd.mpmd_map_tracing_context(k.gpu_mesh, k.meshes):
        result = _upstream(k.gpu_mesh, k.jax_mesh, k.jaxpr, k.in_shapes, k.out_shapes, k.params,
                           outer_traceback=k.traceback)
        return i, _serialise(result)


def default_workers() -> int:
    """Worker processes for `prelower`: JTILERT_LOWERING_WORKERS, else the CPUs this process may use
    (0 or 1: lower in this process, one kernel after another)."""
    if "JTILERT_LOWERING_WORKERS" in os.environ:
        return int(os.environ["JTILERT_LOWERING_WORKERS"])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---- the kernels' Mosaic compile, started early (module docstring) -------------------------------

precompiled = 0      # kernel programs compiled in the background in this process
precompile_s = 0.0   # their seconds, summed
_handed: set = set()   # keys of the kernels handed to the background
_submitted: list = []   # their futures, until `background_idle` has waited for them
_background = None


def precompile_enabled() -> bool:
    """Whether `prelower` starts the kernels' compile: on a GPU backend, unless JTILERT_KERNEL_PRECOMPILE
    is 0 / off (a debugging override: the kernels then compile inside the program's compile)."""
    if os.environ.get("JTILERT_KERNEL_PRECOMPILE", "1").strip().lower() in ("0", "off", "no", "false"):
        return False
    return jax.default_backend() == "gpu"


def kernel_program(k: _Kernel):
    """(a function that calls kernel `k` alone, the shapes of its arguments): jitted and lowered, its
    program holds `k`'s Mosaic module as the program that called `k` does (the same lowering, from
    this cache), so compiling it compiles `k`. A kernel inside shard_map is called inside one on the
    same mesh and axes, its operands replicated (each device's shapes are the kernel's)."""
    e = k.eqn
    arrays = [v for v in e.invars if not isinstance(v, _core.Literal)]

    def call(*args):
        it = iter(args)
        ins = [v.val if isinstance(v, _core.Literal) else next(it) for v in e.invars]
        out = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
        return tuple(out) if e.primitive.multiple_results else (out,)

    if k.shard_map is None:
        return call, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in arrays]
    mesh, axes = k.shard_map
    rep = jax.sharding.PartitionSpec()
    mapped = jax.shard_map(call, mesh=mesh, in_specs=(rep,) * len(arrays), out_specs=(rep,) * len(e.outvars),
                           axis_names=set(axes), check_vma=False)
    sharding = jax.sharding.NamedSharding(mesh, rep)
    return mapped, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, sharding=sharding) for v in arrays]


def _compile_kernel(k: _Kernel) -> None:
    """In the background: compile `kernel_program(k)` (not stored in JAX's persistent cache: the
    program that calls `k` is). Nothing once the process is exiting; an error is left to the
    program's own compile, which raises it in context."""
    global precompiled, precompile_s
    if not threading.main_thread().is_alive():
        return
    t = time.perf_counter()
    try:
        fn, args = kernel_program(k)
        with _jax_config.persistent_cache_min_compile_time_secs(float("inf")):
            jax.jit(fn).lower(*args).compile()
    except Exception:  # noqa: BLE001 - see the docstring
        return
    with _lock:
        precompiled += 1
        precompile_s += time.perf_counter() - t


def precompile(kernels) -> int:
    """Hand the kernels (`_Kernel`s whose lowering this cache keeps) not handed yet to the background
    compile (two threads: one's XLA work overlaps the other's Mosaic compile, which jaxlib runs one
    at a time); the number handed."""
    global _background
    fresh = []
    with _lock:
        for k in kernels:
            if k.key is not None and k.key in _cache and k.key not in _handed:
                _handed.add(k.key)
                fresh.append(k)
        if fresh and _background is None:
            _background = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jtilert-precompile")
    for k in fresh:
        _submitted.append(_background.submit(_compile_kernel, k))
    return len(fresh)


def background_idle() -> None:
    """Wait for the background compiles handed so far."""
    concurrent.futures.wait(_submitted)
    _submitted.clear()


def prelower(jaxpr, workers: int | None = None, background: bool | None = None) -> int:
    """Lower the Mosaic-GPU kernels of a traced program (the closed jaxpr of `jax.jit(f).trace(...)`)
    that are not kept yet, in `workers` forked processes at once, into the cache that jax's lowering
    of the program then reads; returns the number lowered. A kernel that writes a `jax.new_ref` in
    place is taken from the program's discharged form, which is what jax lowers. Fork, not spawn: a
    worker needs the traced kernel bodies, which only this process holds; it runs Mosaic's Python
    lowering and nothing of XLA's runtime. `background` (default `precompile_enabled()`): hand each
    kernel whose lowering is kept to the background compile as soon as it is (`precompile`)."""
    global lowerings, prelowered
    workers = default_workers() if workers is None else workers
    background = precompile_enabled() if background is None else background
    install()
    if any(isinstance(e, _core.InternalMutableArrayEffect) for e in jaxpr.effects):
        jaxpr = _pxla._discharge_internal_refs(jaxpr)   # what jax lowers (a cached rewrite: the same objects)
    calls: dict = {}   # key → the first call of each kernel
    for k in _kernels(jaxpr.jaxpr):
        if k.key is not None:
            calls.setdefault(k.key, k)
    todo = {key: k for key, k in calls.items() if key not in _cache}
    hand = precompile if background else (lambda kernels: 0)
    if workers < 2 or len(todo) < 2 or not hasattr(os, "fork"):
        hand(calls.values())
        return 0
    background_idle()   # no fork while a background compile may hold a lock the workers would inherit
    keys, _pending[:] = list(todo), list(todo.values())
    procs = min(workers, len(todo))
    done = 0
    pool = None
    try:
        with warnings.catch_warnings():   # jax's and CPython's warnings about forking a threaded process
            warnings.simplefilter("ignore", RuntimeWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            pool = concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork"))
            futures = [pool.submit(_lower_pending, i) for i in range(len(keys))]   # a fork pool forks here
        hand(calls.values())   # those kept already
        rounds = math.ceil(len(keys) / procs)
        for f in concurrent.futures.as_completed(futures, timeout=KERNEL_TIMEOUT_S * rounds):
            try:
                i, kept = f.result()
            except Exception:  # noqa: BLE001 - the plain lowering after this raises it in context
                continue
            with _lock:
                _cache[keys[i]] = kept
                lowerings += 1
                prelowered += 1
            done += 1
            hand([_pending[i]])
    except (concurrent.futures.TimeoutError, concurrent.futures.process.BrokenProcessPool, OSError) as e:
        warnings.warn(f"jtilert: parallel kernel lowering stopped ({type(e).__name__}); the remaining "
                      f"{len(todo) - done} kernels are lowered one after another", RuntimeWarning, stacklevel=2)
    finally:
        if pool is not None:
            stuck = done < len(todo)
            if stuck:   # a stuck worker must not hold the caller
                for p in list((getattr(pool, "_processes", None) or {}).values()):
                    p.kill()
            pool.shutdown(wait=not stuck, cancel_futures=True)
        _pending.clear()
    return done
