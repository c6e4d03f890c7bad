"""How the kernel tests run a Mosaic-GPU kernel on the CPU and compare it: in GPU interpret mode with race
detection (the interpreter starts every buffer as NaN, so an unwritten output element shows), after
cross-lowering it for CUDA where the test asks (Mosaic's lowering errors show without a GPU). Their
inputs come from `new_key()`, which draws from numpy's global generator: conftest.py seeds it from each
test's id, so a failing case runs again with the same inputs."""

from __future__ import annotations

import jax
import numpy as np

from jtilert.pallas import interpret as interp


def new_key() -> jax.Array:
    """A new random key, reproducible per test (see the module docstring)."""
    return jax.random.key(np.random.randint(1 << 30))


def interpreted(f, *args):
    """f(*args) in GPU interpret mode with race detection, as NumPy arrays (a pytree of them)."""
    with interp.interpret(detect_races=True):
        out = jax.tree.map(np.asarray, f(*args))
        assert not interp.races_found()
    return out


def lowered_and_interpreted(f, *args):
    """interpreted(f, *args) after cross-lowering f for CUDA."""
    with interp.compile_for_gpu():
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    return interpreted(f, *args)


def run_one_kernel(f, *args):
    """f(*args) as NumPy arrays (a pytree of them), after checking that f lowers to one kernel launch
    and that the interpreted kernel has no races."""
    with interp.compile_for_gpu():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("custom_call @mosaic_gpu") == 1
    return interpreted(f, *args)


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in fp64; a must hold no NaN (an output element the kernel did not write)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert not np.isnan(a).any(), "unwritten (NaN) output elements"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
