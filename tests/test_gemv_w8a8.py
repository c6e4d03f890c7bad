"""bench/experiments/gemv_w8a8.py: the fp8-activation GEMV experiment against its reference, in GPU
interpret mode on the CPU, and cross-lowered for CUDA at the shapes its GPU run times."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from interpreted import rel_err   # tests/interpreted.py (tests/ is on sys.path)

from bench.experiments import gemv_w8a8 as g
from jtilert.ops import reference
from jtilert.ops.quant import act_quant, quantize_weight
from jtilert.pallas import interpret as interp


@pytest.mark.parametrize("t,n,k,split", [(1, 128, 512, 1), (3, 192, 768, 1), (2, 64, 1024, 2)])
def test_matches_its_reference(t, n, k, split):
    kx, kw = jax.random.split(jax.random.key(100 + t))
    x = (jax.random.normal(kx, (t, k), jnp.float32) * 3).astype(jnp.bfloat16)
    w, s = quantize_weight(jax.random.normal(kw, (n, k), jnp.float32) * k**-0.5)
    with interp.interpret(detect_races=True):
        got = g.linear_w8a8(*act_quant(x), w, s, split=split)
        assert not interp.races_found()
    assert got.shape == (t, n) and got.dtype == jnp.bfloat16
    assert rel_err(got, g.reference(x, w, s)) < 1e-2
    # fp8 activations: a few percent from the bf16-activation reference, not more
    assert 1e-3 < rel_err(got, reference.linear(x, w, s)) < 6e-2


@pytest.mark.parametrize("t", [1, 4])
def test_two_halves_keep_bf16_accuracy(t):
    """act_quant_hilo: a bf16 value's 8 significant bits are two 4-bit e4m3 halves, so the two halves
    reproduce the bf16-activation reference (up to the fp32 summation order and the output's bf16
    rounding), where one fp8 half is 2-3 % off."""
    kx, kw = jax.random.split(jax.random.key(200 + t))
    x = (jax.random.normal(kx, (t, 512), jnp.float32) * 3).astype(jnp.bfloat16)
    w, s = quantize_weight(jax.random.normal(kw, (128, 512), jnp.float32) * 512**-0.5)
    exact = reference.linear(x, w, s)
    with interp.interpret(detect_races=True):
        two = g.w8a8_hilo(x, w, s)
        one = g.w8a8(x, w, s)
        assert not interp.races_found()
    assert two.shape == (t, 128)
    assert rel_err(two, exact) < 1e-3 and rel_err(one, exact) > 1e-2
    with pytest.raises(ValueError):   # 2 × 5 rows do not fit 8 columns
        g.w8a8_hilo(jnp.ones((5, 512), jnp.bfloat16), w, s)


def test_refuses_shapes_it_does_not_tile():
    with pytest.raises(ValueError, match="slices"):
        g.linear_w8a8(jnp.zeros((1, 768), jnp.float8_e4m3fn), jnp.ones((1, 6)), jnp.zeros((64, 768), jnp.float8_e4m3fn),
                      jnp.ones((1, 6)), split=2)
    with pytest.raises(ValueError, match="K % 256"):
        g.linear_w8a8(jnp.zeros((1, 384), jnp.float8_e4m3fn), jnp.ones((1, 3)), jnp.zeros((64, 384), jnp.float8_e4m3fn),
                      jnp.ones((1, 3)))


@pytest.mark.parametrize("n,k", [(7168, 2048), (2240, 7168)])   # o_proj; x_proj (split-K)
def test_cross_lowers_for_cuda(n, k):
    S = jax.ShapeDtypeStruct
    with interp.compile_for_gpu():
        txt = jax.jit(g.w8a8).trace(S((1, k), jnp.bfloat16), S((n, k), jnp.float8_e4m3fn),
                                    S((-(-n // 128), k // 128), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "jtilert_gemv_w8a8" in txt


def test_cluster_sum_lowers_for_cuda_and_refuses_bad_splits():
    """The split-K partials added in the kernel through the cluster's shared memory (what the
    interpreter does not run: remote refs) lower for CUDA at x_proj's shape; a split outside 2..8
    (a portable cluster) is refused."""
    S = jax.ShapeDtypeStruct
    with interp.compile_for_gpu():
        txt = jax.jit(g.w8a8_cluster2).trace(S((1, 7168), jnp.bfloat16), S((2240, 7168), jnp.float8_e4m3fn),
                                             S((18, 56), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "jtilert_gemv_w8a8_cluster" in txt
    with pytest.raises(ValueError, match="cluster_sum needs a split of 2..8"):
        g.linear_w8a8(jnp.zeros((1, 512), jnp.float8_e4m3fn), jnp.ones((1, 4)), jnp.zeros((64, 512), jnp.float8_e4m3fn),
                      jnp.ones((1, 4)), split=1, cluster_sum=True)
