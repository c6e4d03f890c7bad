"""Where the Mosaic-GPU kernels run: on the GPU, or in GPU interpret mode on a machine without one.

`params()`, what every kernel passes as `plgpu.kernel(..., interpret=...)`, returns the parameters of
an enclosing `plgpu.force_gpu_interpret_mode(...)` (the tests, with `detect_races=True`), default
`InterpretGPUParams` where the default backend is not a GPU (`backend="pallas"` on a CPU box runs
the real kernel code, slowly), and None on a GPU (Mosaic compiles the kernels). Interpret mode's
`wgmma` reads A only from SMEM, so there `a_in_registers()` is False.

Threads. The interpreter runs a kernel of K > 1 CPU threads (warpgroups) as K nested XLA
executions started from a host callback, and its barriers wait in host callbacks. XLA:CPU runs
callbacks on its one pool of max(PJRT_NPROC or the CPUs, host devices) threads, sized when the CPU
backend starts, and a waiting callback holds its thread: with fewer than K + 1 (2 on a 2-core box
with one device) the nested executions not yet started never get a thread and the step hangs at
0 % CPU. `import jtilert` therefore sets PJRT_NPROC to host devices + 16 where the default is
smaller and the backend has not started; `_check_threads` raises where the pool is still too small.

Kernels inside `shard_map` (tp > 1). jax's interpreter treats a kernel traced under named axes as
ONE multi-device kernel over one process-wide simulated memory; ours are per-device and XLA:CPU runs
the devices' programs concurrently, so a device that finishes first trips the interpreter's global
"no barrier left allocated" check. Such a kernel is interpreted as a one-device kernel (axes hidden)
between two ordered callbacks that take and give back a process-wide semaphore: one interpreted
kernel at a time, the other devices' programs waiting in the take callback, a pool thread each (so
a kernel needs devices + K threads). Checked: the tiny model decodes the reference's tokens with
backend="pallas" on one CPU device and at tp=2, 4, 8.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import threading

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax.experimental import io_callback
from jax._src import config as _jax_config
from jax._src import core as _jax_core
from jax._src import xla_bridge

from jtilert.pallas import lowering_cache

InterpretGPUParams = plgpu.InterpretGPUParams
# A JAX config state in its trace context: JAX's trace caches (jit, and the bodies of loops over a
# long-lived function) then keep what was traced for the GPU apart from what was traced for the
# interpreter.
_compile_for_gpu = _jax_config.bool_state(
    "jtilert_compile_for_gpu", False, "jtilert: trace the Mosaic-GPU kernels for the GPU on any machine",
    include_in_jit_key=True, include_in_trace_context=True)


def cpu_pool_threads(devices: int = 1) -> int:
    """The threads of XLA:CPU's pool, as the CPU backend sizes it when it starts: PJRT_NPROC, else
    NPROC, else the CPUs this process may run on, and at least one per host device."""
    for name in ("PJRT_NPROC", "NPROC"):
        try:
            return max(int(os.environ[name]), devices)
        except (KeyError, ValueError):
            pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(cpus, devices)


def reserve_interpreter_threads() -> None:
    """Before jax starts its CPU backend, give XLA:CPU's pool room for GPU interpret mode, which blocks
    pool threads in host callbacks (see `jtilert.pallas.interpret`): one per host device and 16 more.
    An explicit PJRT_NPROC wins; once the backend has started it is too late (the kernels check)."""
    if "PJRT_NPROC" in os.environ or xla_bridge.backends_are_initialized():
        return
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    devices = max(int(flag.group(1)) if flag else 1, jax.config.jax_num_cpu_devices)
    if cpu_pool_threads(devices) < devices + 16:
        os.environ["PJRT_NPROC"] = str(devices + 16)


def _forced():
    p = _jax_config.pallas_tpu_interpret_mode_context_manager.value
    return p if isinstance(p, InterpretGPUParams) else None


def on_gpu() -> bool:
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def params() -> InterpretGPUParams | None:
    """Interpret parameters for the kernel about to be traced, or None to compile for the GPU (then
    Mosaic lowers each kernel once per process: `lowering_cache`)."""
    forced = _forced()
    if forced is None and (_compile_for_gpu.value or on_gpu()):
        lowering_cache.install()   # each kernel lowered once per process
        return None
    _wrap_interpreter()
    return forced if forced is not None else InterpretGPUParams()


# One interpreted kernel at a time across the devices' programs. A semaphore, not a lock: it is
# taken and given back in different callbacks, which XLA may run on different threads.
_ONE_KERNEL_AT_A_TIME = threading.Semaphore(1)
_WAIT_S = 900   # a kernel that failed on another device never gives it back: fail, do not hang


@functools.cache
def _wrap_interpreter():
    """Check the CPU threads of every interpreted kernel, and make kernels traced under named axes
    (shard_map) one-device kernels, one at a time (see the docstring)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    upstream = ipc.interpret_pallas_call

    def interpret_pallas_call(*args, **params):
        devices = math.prod(_jax_core.get_axis_env().axis_sizes.values())
        _check_threads(devices, params["grid_mapping"], params["mesh"])
        if devices == 1:
            return upstream(*args, **params)
        # ordered callbacks: XLA keeps them in program order with the interpreter's own
        # (ordered) first and last callbacks, so the whole kernel runs between take and give
        args = io_callback(_take, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args], *args, ordered=True)
        prev = _jax_core.trace_ctx.axis_env
        _jax_core.trace_ctx.set_axis_env(_jax_core.top_axis_env)   # the interpreter sees one device
        try:
            outs = upstream(*args, **params)
        finally:
            _jax_core.trace_ctx.set_axis_env(prev)
        return io_callback(_give, [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs], *outs, ordered=True)

    ipc.interpret_pallas_call = interpret_pallas_call


def _check_threads(devices: int, grid_mapping, mesh):
    """Fail, instead of hanging, where XLA:CPU's pool is too small for this kernel: the devices'
    programs (all but one waiting for their turn) and the kernel's CPU threads each hold a pool thread."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    _, cluster, threads = ipc._get_grid_and_cluster_dims_and_num_threads(grid_mapping, mesh)
    threads *= math.prod(cluster)
    if threads == 1 or jax.default_backend() != "cpu":
        return
    pool = cpu_pool_threads(jax.device_count())
    if pool < devices + threads:
        raise RuntimeError(
            f"GPU interpret mode: a kernel of {threads} CPU threads on {devices} device(s) needs XLA:CPU's "
            f"thread pool to have {devices + threads} threads, it has {pool}, and would hang. Set "
            f"PJRT_NPROC={jax.device_count() + 16} before jax starts its backend (importing jtilert before that does it).")


def _take(*xs):
    if not _ONE_KERNEL_AT_A_TIME.acquire(timeout=_WAIT_S):
        raise RuntimeError("an interpreted kernel on another device did not finish (it failed?)")
    return list(xs)


def _give(*xs):
    _ONE_KERNEL_AT_A_TIME.release()
    return list(xs)


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
    with _compile_for_gpu(True):
        yield


def races_found() -> bool:
    """After running under `interpret(detect_races=True)`: whether the simulator saw a data race."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    return bool(ipc.get_races().races_found)
