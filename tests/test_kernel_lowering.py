"""Each Mosaic kernel is lowered once: once per program (a kernel called from several places with one
signature, as the layer loops and the MTP block call it, is one traced callee, which JAX lowers once)
and once per process (`jtilert.pallas.lowering_cache`: a later program reuses the lowering). Mosaic
lowers a kernel in about a second of Python, so a regression here costs a step's first compile
seconds per kernel. Traced / lowered for the GPU on the CPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from decode_jaxprs import decode_step, sub_jaxprs   # tests/decode_jaxprs.py (tests/ is on sys.path)

from jtilert.ops.table import DecodeConfig, Ops
from jtilert.pallas import gemv, lowering_cache
from jtilert.pallas import interpret as interp


def _kernel_bodies(jaxpr, found: dict) -> dict:
    """{(kernel name, grid, operand types): {ids of the traced kernel bodies}} of every Mosaic kernel."""
    for e in jaxpr.eqns:
        if e.primitive.name == "mpmd_map":
            mesh = e.params["meshes"][0]
            sig = (mesh.kernel_name, tuple(mesh.grid), tuple(str(v.aval) for v in e.invars))
            found.setdefault(sig, set()).add(id(e.params["jaxprs"][0]))
        for inner in sub_jaxprs(e):
            _kernel_bodies(inner, found)
    return found


def test_the_mtp_step_traces_each_kernel_once():
    """The speculative step's verify (2 tokens through both layer loops) and draft (the MTP block, its
    layer index a constant) call every kernel with one signature: one traced body each."""
    step, state, cache = decode_step("dsv32-tp8-shard", 4, Ops(DecodeConfig(backend="pallas")), tokens=2, mtp=True)
    with interp.compile_for_gpu():
        bodies = _kernel_bodies(jax.make_jaxpr(step)(state, cache).jaxpr, {})
    assert len(bodies) >= 12, sorted(bodies)   # the kernels ran (else nothing is checked)
    twice = {sig[0]: len(ids) for sig, ids in bodies.items() if len(ids) > 1}
    assert not twice, twice


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
