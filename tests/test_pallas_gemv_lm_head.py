"""lm head kernel (issue 4): vocab-sharded GEMV with top-k candidates in the epilogue, in GPU
interpret mode (race detection on, buffers start as NaN), against XLA logits + lax.top_k."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtilert.pallas import interpret as interp
from jtilert.pallas import lm_head

F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize("t,v,k", [(1, 200, 5), (2, 128, 1)])
def test_lm_head_topk(t, v, k):
    h = 128
    kx, kw = jax.random.split(jax.random.key(3000 + t + v))
    x = jax.random.normal(kx, (t, h), F32).astype(BF16)
    w = (jax.random.normal(kw, (v, h), F32) * h ** -0.5).astype(BF16)
    # An exact tie for first place between vocab 7 and v - 3 (the lower id must win). Token 0 is ±1
    # and the two rows 4·token 0, so every partial sum is a small integer: the logits are exact (512)
    # whatever order the kernel sums in, and the tie is a tie in any arithmetic.
    x = x.at[0].set(jnp.where(x[0] >= 0, 1.0, -1.0).astype(BF16))
    w = w.at[7].set(x[0] * 4).at[v - 3].set(x[0] * 4)
    with interp.interpret(detect_races=True):
        vals, ids = jax.tree.map(np.asarray, lm_head.lm_head_topk(x, w, k=k))
        assert not interp.races_found()
    rv, ri = lm_head.reference_topk(x, w, k=k)
    assert not np.isnan(vals).any()
    np.testing.assert_array_equal(ids, np.asarray(ri))
    np.testing.assert_allclose(vals, np.asarray(rv), rtol=1e-5, atol=1e-5)
    assert ids[0, 0] == 7


def test_cross_lowering_dsv32_lm_head():
    S = jax.ShapeDtypeStruct
    with interp.compile_for_gpu():
        jax.jit(lambda x, w: lm_head.lm_head_topk(x, w, k=8)).trace(
            S((1, 7168), BF16), S((16160, 7168), BF16)).lower(lowering_platforms=("cuda",))
