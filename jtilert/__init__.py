"""jtilert: lowest-latency batch-1 decoding of MLA + sparse-attention + MoE models in JAX."""

import os as _os


def _cpu_pool_threads(devices: int = 1) -> int:
    """The threads of XLA:CPU's pool, as the CPU backend sizes it when it starts: PJRT_NPROC, else
    NPROC, else the CPUs this process may run on, and at least one per host device."""
    for name in ("PJRT_NPROC", "NPROC"):
        try:
            return max(int(_os.environ[name]), devices)
        except (KeyError, ValueError):
            pass
    cpus = len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity") else _os.cpu_count() or 1
    return max(cpus, devices)


def _reserve_interpreter_threads() -> None:
    """Before jax starts its CPU backend, give XLA:CPU's pool room for GPU interpret mode, which blocks
    pool threads in host callbacks (see `jtilert.pallas.interpret`): one per host device and 16 more.
    An explicit PJRT_NPROC wins; once the backend has started it is too late (the kernels check)."""
    import re
    import jax
    from jax._src import xla_bridge
    if "PJRT_NPROC" in _os.environ or xla_bridge.backends_are_initialized():
        return
    flag = re.search(r"--xla_force_host_platform_device_count=(\d+)", _os.environ.get("XLA_FLAGS", ""))
    devices = max(int(flag.group(1)) if flag else 1, jax.config.jax_num_cpu_devices)
    if _cpu_pool_threads(devices) < devices + 16:
        _os.environ["PJRT_NPROC"] = str(devices + 16)


_reserve_interpreter_threads()

from jtilert import compile_cache
from jtilert.checkpoint import load, save
from jtilert.config import PRESETS, ModelConfig, preset
from jtilert.converter import convert, verify
from jtilert.generate import Generator, score
from jtilert.model import Transformer, init_cache, random_model
from jtilert.ops import DecodeConfig
from jtilert.sampling import Sampling
from jtilert.sharding import make_mesh
from jtilert.synthetic import random_checkpoint

compile_cache.enable()

__all__ = ["DecodeConfig", "ModelConfig", "PRESETS", "preset", "Generator", "score", "Transformer", "init_cache", "random_model",
           "Sampling", "make_mesh", "load", "save", "convert", "verify", "random_checkpoint"]
