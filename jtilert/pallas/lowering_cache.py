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
"""

from __future__ import annotations

import dataclasses
import functools
import io
import threading

from jax._src.lib.mlir import ir
from jax._src.pallas.mosaic_gpu import lowering as _pl_lowering
from jax.experimental.mosaic.gpu import utils as _mgpu_utils

lowerings = 0   # kernels lowered by Mosaic in this process (cache misses)
_cache: dict = {}
_lock = threading.Lock()


@functools.cache
def install() -> None:
    """Route jax's lowering of Mosaic-GPU kernel bodies through the cache (once per process)."""
    upstream = _pl_lowering.lower_unpipelined_jaxpr_to_module

    def lower(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kw):
        global lowerings
        try:
            key = (jaxpr, tuple(in_shapes), tuple(out_shapes), gpu_mesh, jax_mesh, params,
                   _mgpu_utils._infer_arch())
            hash(key)
        except TypeError:   # an unhashable part: lower it as jax does
            key = None
        with _lock:
            kept = _cache.get(key) if key is not None else None
        if kept is not None:
            code, fields = kept
            return _pl_lowering.LoweringResult(module=ir.Module.parse(code), **fields)
        result = upstream(gpu_mesh, jax_mesh, jaxpr, in_shapes, out_shapes, params, **kw)
        with _lock:
            lowerings += 1
            if key is not None and result.profiler_spec is None:   # a profiled kernel dumps per lowering
                buf = io.BytesIO()
                result.module.operation.write_bytecode(buf)
                fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name != "module"}
                _cache[key] = (buf.getvalue(), fields)
        return result

    _pl_lowering.lower_unpipelined_jaxpr_to_module = lower


def clear() -> None:
    """Forget the kept kernels (tests)."""
    with _lock:
        _cache.clear()
