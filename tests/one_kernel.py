"""Run a function that launches exactly one Mosaic-GPU kernel, the way the kernel tests do: cross-lowered
for CUDA (Mosaic's lowering errors show without a GPU), then in GPU interpret mode with race detection."""

from __future__ import annotations

import jax
import numpy as np

from jtilert.pallas import interpret as interp


def run_one_kernel(f, *args):
    """f(*args) as NumPy arrays (a pytree of them), after checking that f lowers to one kernel launch
    and that the interpreted kernel has no races."""
    with interp.compile_for_gpu():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("custom_call @mosaic_gpu") == 1
    with interp.interpret(detect_races=True):
        out = jax.tree.map(np.asarray, f(*args))
        assert not interp.races_found()
    return out
