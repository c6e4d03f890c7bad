"""bench/experiments/pallas_chain.py (issue 14: dependent GEMVs as the phases of one Pallas kernel): the
phase body against XLA in GPU interpret mode, as one kernel per GEMV; the one-kernel forms, whose
grid-wide semaphore the interpreter cannot run, lowered for the GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from bench.experiments import pallas_chain as pc
from jtilert.pallas import interpret as interp

DIMS, GEMVS, CTAS = (512, 256), 4, 8   # 8 row blocks of the whole K; 4 row blocks of 2 K slices


def test_the_plan_fills_the_ctas_with_whole_steps():
    assert pc.plan(7168, 2048, 128) == (112, 1) and pc.plan(2048, 7168, 128) == (32, 4)
    assert pc.plan(*DIMS, CTAS) == (8, 1) and pc.plan(*DIMS[::-1], CTAS) == (4, 2)
    with pytest.raises(ValueError, match="row blocks"):
        pc.plan(1024, 256, 8)
    with pytest.raises(ValueError, match="multiple"):
        pc.plan(512, 200, 8)


def test_each_gemv_of_the_launched_chain_is_xlas():
    args = pc.chain_weights(jax.random.key(3), DIMS, GEMVS)
    with interp.interpret():
        outs = pc.run_form("launches", *args, ctas=CTAS)
    assert [o.shape for o in outs] == [(1, 512), (2, 256)] * 2
    errs = pc.check(outs, *args)
    assert max(errs) < 1e-5, errs
    # the check sees a wrong GEMV: the second one's partials with a slice dropped
    assert pc.check([outs[0], outs[1].at[1].set(0.0)], *args)[1] > 0.1


@pytest.mark.parametrize("form", ["barrier", "prefetch", "ring", "stream"])
def test_the_one_kernel_chain_lowers_for_the_gpu(form):
    S = jax.ShapeDtypeStruct
    big, small = DIMS
    args = (S((small,), jnp.bfloat16), S((GEMVS // 2, big, small), jnp.float8_e4m3fn),
            S((GEMVS // 2, big // 128, small // 128), jnp.float32), S((GEMVS // 2, small, big), jnp.float8_e4m3fn),
            S((GEMVS // 2, small // 128, big // 128), jnp.float32))
    with interp.compile_for_gpu():
        text = jax.jit(functools.partial(pc.run_form, form, ctas=CTAS)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1   # the whole chain one kernel
