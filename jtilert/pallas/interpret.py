"""Where the Mosaic-GPU kernels run: on the GPU, or in GPU interpret mode on a machine without one.

`params()` is what every kernel passes as `plgpu.kernel(..., interpret=...)`:

* inside `plgpu.force_gpu_interpret_mode(...)` (what the tests use, with `detect_races=True`) it
  returns that context's parameters, so the kernels are simulated on the CPU;
* on a machine whose default JAX backend is not a GPU it returns default `InterpretGPUParams`
  (`backend="pallas"` on a CPU box runs the real kernel code, slowly);
* on a GPU it returns None and the kernels are compiled by Mosaic.

Interpret mode differs from the GPU in one place the kernels care about: its `wgmma` reads A only
from shared memory, so `a_in_registers()` is False there and the dequantised weight tile takes a
trip through SMEM instead of feeding the tensor core from registers.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src import config as _jax_config

InterpretGPUParams = plgpu.InterpretGPUParams
_compile_for_gpu: contextvars.ContextVar[bool] = contextvars.ContextVar("jtilert_compile_for_gpu", default=False)


def _forced():
    p = _jax_config.pallas_tpu_interpret_mode_context_manager.value
    return p if isinstance(p, InterpretGPUParams) else None


def on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def params() -> InterpretGPUParams | None:
    """Interpret parameters for the kernel about to be traced, or None to compile for the GPU."""
    forced = _forced()
    if forced is not None:
        return forced
    if _compile_for_gpu.get():
        return None
    return None if on_gpu() else InterpretGPUParams()


def active() -> bool:
    return params() is not None


def a_in_registers() -> bool:
    """Whether `wgmma` may take its A operand from registers (GPU) or needs SMEM (interpret mode)."""
    return not active()


@contextlib.contextmanager
def interpret(detect_races: bool = False):
    """Run the kernels traced inside in GPU interpret mode (a thin wrapper for scripts and tests)."""
    with plgpu.force_gpu_interpret_mode(InterpretGPUParams(detect_races=detect_races)):
        yield


@contextlib.contextmanager
def compile_for_gpu():
    """Trace the kernels for the GPU even on a machine without one: for cross-lowering checks,
    `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`, which catch Mosaic errors on the CPU."""
    token = _compile_for_gpu.set(True)
    try:
        yield
    finally:
        _compile_for_gpu.reset(token)


def races_found() -> bool:
    """After running under `interpret(detect_races=True)`: whether the simulator saw a data race."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    return bool(ipc.get_races().races_found)
