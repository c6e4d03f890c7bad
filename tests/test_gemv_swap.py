"""bench/experiments/gemv_swap.py: the swapped-operand fp8 GEMV against the bf16-activation reference,
in GPU interpret mode on the CPU, and cross-lowered for CUDA at the shapes its GPU run times."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from interpreted import rel_err   # tests/interpreted.py (tests/ is on sys.path)

from bench.experiments import gemv_swap as g
from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import interpret as interp


@pytest.mark.parametrize("t,n,k,cfg", [
    (1, 128, 512, g.SwapConfig()),
    (3, 192, 768, g.SwapConfig(block_n=64, block_k=256)),                  # three row blocks of 64
    (8, 160, 1024, g.SwapConfig(block_k=256, split_k=2, stages=2)),        # a partial row block, split-K
])
def test_matches_bf16_activations(t, n, k, cfg):
    """Two e4m3 halves of x: the bf16-activation reference up to the fp32 summation order and the
    output's rounding; rows of tokens ≥ T and the A rows past the halves never reach the output."""
    kx, kw = jax.random.split(jax.random.key(300 + t))
    x = (jax.random.normal(kx, (t, k), jnp.float32) * 3).astype(jnp.bfloat16)
    w, s = quantize_weight(jax.random.normal(kw, (n, k), jnp.float32) * k**-0.5)
    with interp.interpret(detect_races=True):
        got = g.linear(x, w, s, cfg)
        assert not interp.races_found()
    assert got.shape == (t, n) and got.dtype == jnp.bfloat16
    assert rel_err(got, reference.linear(x, w, s)) < 2e-3


def test_refuses_what_it_does_not_tile():
    w = jnp.zeros((128, 384), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="whole 256-column steps"):
        g.linear(jnp.ones((1, 384), jnp.bfloat16), w, jnp.ones((1, 3)), g.SwapConfig(block_k=256))
    with pytest.raises(ValueError, match="T ≤ 8"):
        g.linear(jnp.ones((9, 384), jnp.bfloat16), w, jnp.ones((1, 3)))


@pytest.mark.parametrize("name", list(g.CONFIGS))
def test_lowers_for_the_gpu(name):
    """Each timed configuration lowers to a CUDA kernel at o_proj's shape (no GPU needed)."""
    x = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((7168, 2048), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((56, 16), jnp.float32)
    with interp.compile_for_gpu():
        txt = jax.jit(lambda x, w, s: g.linear(x, w, s, g.CONFIGS[name])).trace(x, w, s).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "jtilert_gemv_swap" in txt
