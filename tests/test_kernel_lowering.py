"""Each Mosaic kernel is lowered once: once per program (a kernel called from several places with one
signature, as the layer loops and the MTP block call it, is one traced callee, which JAX lowers once)
and once per process (`jtilert.pallas.lowering_cache`: a later program reuses the lowering). Mosaic
lowers a kernel in about a second of Python, so a regression here costs a step's first compile
seconds per kernel. Traced / lowered for the GPU on the CPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from jtilert.pallas import gemv, lowering_cache
from jtilert.pallas import interpret as interp


def test_a_later_program_reuses_the_kernels_lowering():
    S = jax.ShapeDtypeStruct
    args = (S((1, 256), jnp.bfloat16), S((64, 256), jnp.bfloat16))
    kernel = jax.jit(gemv.linear)   # as the op table calls kernels: one jitted callee

    def lower(f):
        before = lowering_cache.lowerings
        with interp.compile_for_gpu():
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return lowering_cache.lowerings - before, re.findall(r'module = "((?:[^"\\]|\\.)*)"', text)

    n1, first = lower(lambda x, w: kernel(x, w))
    n2, second = lower(lambda x, w: kernel(x, w) * 2)   # another program, the same kernel
    assert (n1, n2) == (1, 0) and len(first) == 1 and second == first
