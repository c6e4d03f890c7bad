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


def test_the_plan_gives_each_cta_one_unit_of_whole_steps():
    assert pc.plan(7168, 2048, 128) == (112, 1, 1) and pc.plan(2048, 7168, 128) == (32, 4, 1)
    assert pc.plan(*DIMS, CTAS) == (8, 1, 1) and pc.plan(*DIMS[::-1], CTAS) == (4, 2, 1)
    # more row blocks than CTAs: units of several row blocks, the split with the fewest weight columns a
    # CTA, then the fewest slices (x_proj-like: 126 units of 2 row blocks × 1024 columns over 132 CTAs;
    # q_b | wq_b: 132 units of 4 × 512)
    assert pc.plan(2304, 7168, 132) == (36, 7, 2) and pc.plan(11264, 1536, 132) == (176, 3, 4)
    assert pc.stages_for(1) == pc.STAGES and pc.stages_for(4) == 2
    with pytest.raises(ValueError, match="multiple"):
        pc.plan(512, 200, 8)
    with pytest.raises(ValueError, match="row blocks a CTA"):
        pc.plan(4096, 256, 8)
    assert pc.pair_dims((7168, 2048)) == (7168, 2048, 2048, 7168)
    with pytest.raises(ValueError, match="at most the other"):
        pc.pair_dims((256, 512, 1024, 512))


@pytest.mark.parametrize("dims, ctas, splits", [(DIMS, CTAS, (1, 2)),
                                                # units of several row blocks, a last one short, and reads
                                                # of the first K columns of the output before: [384, 512]
                                                # as 2 slices × 2 units of 3 blocks, [640, 256] as units
                                                # of 3, 3, 3 and 1 blocks, over 4 CTAs
                                                ((384, 512, 640, 256), 4, (2, 1))])
def test_each_gemv_of_the_launched_chain_is_xlas(dims, ctas, splits):
    args = pc.chain_weights(jax.random.key(3), dims, GEMVS)
    with interp.interpret():
        outs = pc.run_form("launches", *args, ctas=ctas)
    na, _, nb, _ = pc.pair_dims(dims)
    assert [o.shape for o in outs] == [(splits[0], na), (splits[1], nb)] * 2
    errs = pc.check(outs, *args)
    assert max(errs) < 1e-5, errs
    if len(dims) == 2:   # the step's own GEMV down the same chain: within its bf16 outputs' rounding
        with interp.interpret():
            shipped = pc.run_form("shipped", *args, ctas=ctas)
        assert [o.shape for o in shipped] == [(1, na), (1, nb)] * 2
        assert max(pc.check(shipped, *args)) < 1e-2
    else:
        with pytest.raises(ValueError, match="reads all of x"):
            pc.run_form("shipped", *args, ctas=ctas)
    # the check sees a wrong GEMV: the second one's partials with half their rows zeroed
    assert pc.check([outs[0], outs[1].at[:, :nb // 2].set(0.0)], *args)[1] > 0.1


def test_the_attention_pairs_norm_their_inputs_as_the_step_does():
    # each even GEMV of x0, each odd one of the output before, every input RMS-normed: the launched form
    # and the step's own rmsnorm_linear pair against the normed reference, and not within its bound of
    # the plain one
    dims, ctas = (384, 512, 640, 256), 4
    x0, *ws = pc.chain_weights(jax.random.key(5), dims, GEMVS)
    args = (x0 * 3, *ws)   # an rms of about 3: normed and plain inputs differ threefold
    with interp.interpret():
        outs = pc.run_form("launches", *args, ctas=ctas, attn=True)
        shipped = pc.run_form("shipped", *args, ctas=ctas, attn=True)
    errs = pc.check(outs, *args, attn=True)
    assert max(errs) < 2e-3, errs
    assert pc.check(outs, *args)[0] > 0.5
    assert max(pc.check(shipped, *args, attn=True)) < 1e-2
    # the even GEMVs read x0, not the output before: they equal the first one's partials' products
    first = pc.check([outs[0]], *args, attn=True)
    assert pc.check([outs[2]], args[0], args[1][1:], args[2][1:], *args[3:], attn=True) == pytest.approx(first, abs=1e-2)


PAIR = (2304, 7168, 11264, 1536)


# every form at both shapes; the normed attention pairs in every form but barrier, whose phases are
# prefetch's without the early tiles (the lowering of the normed pairs is the file's costliest)
@pytest.mark.parametrize("form, dims, ctas, attn", [
    *[(form, dims, ctas, False) for dims, ctas in ((DIMS, CTAS), (PAIR, 132))
      for form in ("barrier", "prefetch", "ring", "stream")],
    *[(form, PAIR, 132, True) for form in ("prefetch", "ring", "stream")]])
def test_the_one_kernel_chain_lowers_for_the_gpu(form, dims, ctas, attn):
    S = jax.ShapeDtypeStruct
    na, ka, nb, kb = pc.pair_dims(dims)
    args = (S((ka,), jnp.bfloat16), S((GEMVS // 2, na, ka), jnp.float8_e4m3fn),
            S((GEMVS // 2, na // 128, ka // 128), jnp.float32), S((GEMVS // 2, nb, kb), jnp.float8_e4m3fn),
            S((GEMVS // 2, nb // 128, kb // 128), jnp.float32))
    with interp.compile_for_gpu():
        text = jax.jit(functools.partial(pc.run_form, form, ctas=ctas, attn=attn)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1   # the whole chain one kernel
