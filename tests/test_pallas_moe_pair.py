"""The routed experts' gate/up and down as two phases of one kernel (`moe.moe_experts` on `gemv_pair.chain`):
the phases in GPU interpret mode (there they run as two kernels) against the two kernels bit for bit and
the reference within fp8 rounding, on seeded random stacks; the one kernel lowered for the GPU at
DeepSeek-V3.2's shapes; where the phases do not make one kernel and why."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import interpreted, new_key, rel_err   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import interpret as interp
from jtilert.pallas import moe

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def _stack(shape):
    w = jax.random.normal(new_key(), shape, F32) * shape[-1] ** -0.5
    return quantize_weight(w)


@pytest.mark.parametrize("tokens", [1, 2])
def test_the_phases_give_the_two_kernels_result(tokens):
    """At a traced layer of [L, E, ...] stacks with the residual: the pair's phases equal the gate/up and
    down kernels (`expert_gate_up` unsummed, `expert_down`) to the bit (the same bodies, the same sums)
    and the reference within fp8 rounding. Two tokens share an expert; the gate/up phase runs split-K
    (its partials summed by the down phase)."""
    e, width, hidden, layers, layer = 6, 128, 1024, 3, 1
    k = 3 - tokens   # two selections in all: the interpreter's 8 SMs then take split-K
    g, gs = _stack((layers, e, width, hidden))
    u, us = _stack((layers, e, width, hidden))
    d, ds = _stack((layers, e, hidden, width))
    x = jax.random.normal(new_key(), (tokens, hidden), F32).astype(BF16)
    residual = (4 * jax.random.normal(new_key(), (tokens, hidden), F32)).astype(BF16)
    ids = jax.random.randint(new_key(), (tokens, k), 0, e).astype(jnp.int32)
    if tokens == 2:
        ids = ids.at[1, 0].set(ids[0, 0])
    w = jax.random.uniform(new_key(), (tokens, k), minval=0.2, maxval=1.5)
    args = (x, w, ids, g, gs, u, us, d, ds, residual)
    with interp.interpret():
        first, _, why = moe._pair(*args, jnp.int32(layer))
    assert why is None and first.out_type.ndim == 4 and first.out_type.shape[0] > 1

    def two(i):
        h = moe.expert_gate_up(x, ids, g, gs, u, us, layer=i, unsummed=True)
        return moe.expert_down(h, w, ids, d, ds, layer=i, out_dtype=x.dtype, residual=residual)
    pair = interpreted(jax.jit(lambda i: moe.moe_experts(*args, layer=i)), jnp.int32(layer))
    np.testing.assert_array_equal(np.asarray(pair, np.float32),
                                  np.asarray(interpreted(jax.jit(two), jnp.int32(layer)), np.float32))
    want = residual + reference.moe_experts(x, w, ids, g[layer], gs[layer], u[layer], us[layer], d[layer], ds[layer])
    assert rel_err(pair, want) < 1e-2


def _why(*args, **kw):
    """moe.pair_unsupported on abstract arrays (traced, so that no stack is allocated)."""
    out = []
    jax.eval_shape(lambda *a: out.append(moe.pair_unsupported(*a, **kw)) or 0, *args)
    return out[0]


def test_where_the_phases_do_not_make_one_kernel():
    """bf16 experts, and tokens whose gate/up partials or units outgrow the down phase's SMEM or the SMs, go
    to the two kernels, and `pair_unsupported` says why."""
    S = jax.ShapeDtypeStruct
    e, width, hidden = 256, 256, 7168
    q = lambda *shape: (S(shape, FP8), S((*shape[:-2], -(-shape[-2] // 128), shape[-1] // 128), F32))
    bf = lambda *shape: (S(shape, BF16), None)
    with interp.compile_for_gpu():
        why = _why(S((1, hidden), BF16), S((1, 8), F32), S((1, 8), jnp.int32), *bf(e, width, hidden),
                   *bf(e, width, hidden), *bf(e, hidden, width))
        assert "bf16" in why
        for tokens in (2, 8):
            why = _why(S((tokens, hidden), BF16), S((tokens, 8), F32), S((tokens, 8), jnp.int32), *q(e, width, hidden),
                       *q(e, width, hidden), *q(e, hidden, width))
            assert why is not None and ("SMs" in why or "partials" in why), why
        assert _why(S((1, hidden), BF16), S((1, 8), F32), S((1, 8), jnp.int32), *q(e, width, hidden),
                    *q(e, width, hidden), *q(e, hidden, width)) is None


def test_one_kernel_lowers_for_the_gpu_at_dsv32_shapes():
    """DeepSeek-V3.2's share (tp 8: experts of 256 × 7168, 8 of 256 a token) at a layer of the stacks with
    the residual, one token (the plain decode step): one Mosaic kernel, which lowers for CUDA (Mosaic's
    errors show without a GPU). Two tokens (MTP's verification) take the two kernels
    (`test_where_the_phases_do_not_make_one_kernel`)."""
    tokens = 1
    S = jax.ShapeDtypeStruct
    layers, e, width, hidden = 2, 256, 256, 7168
    q = lambda *shape: (S(shape, FP8), S((*shape[:-2], -(-shape[-2] // 128), shape[-1] // 128), F32))
    args = (S((tokens, hidden), BF16), S((tokens, 8), F32), S((tokens, 8), jnp.int32), *q(layers, e, width, hidden),
            *q(layers, e, width, hidden), *q(layers, e, hidden, width), S((tokens, hidden), BF16))
    with interp.compile_for_gpu():
        assert _why(*args, layer=jnp.int32(1)) is None
        txt = jax.jit(lambda *a: moe.moe_experts(*a, layer=jnp.int32(1))).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert txt.count("custom_call @mosaic_gpu") == 1
