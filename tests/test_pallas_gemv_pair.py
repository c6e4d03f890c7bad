"""Two projections as two phases of one kernel (`jtilert.pallas.gemv_pair`): W_uv of sparse MLA's split
partials, then o_proj with the residual. In GPU interpret mode (there the phases run as two kernels) against
the two shipped kernels bit for bit and the reference within bf16 / fp8 rounding, on seeded random stacks at
a traced layer; the one kernel lowered for the GPU at DeepSeek-V3.2's shapes; a phase that waits reads x
only after the wait."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import interpreted, new_key, rel_err   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import gemv, gemv_pair
from jtilert.pallas import interpret as interp
from jtilert.pallas import sparse_mla as smla

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def _partials(t, g, n, hc, lat):
    k = jax.random.split(new_key(), 3)
    o = jax.random.normal(k[0], (t, g, n, hc, lat))
    m = jax.random.normal(k[1], (t, g, n, hc)) * 3
    l = jax.random.uniform(k[2], (t, g, n, hc)) + 0.5
    return o, m, l


def _stack(shape, block=128):
    return quantize_weight(jax.random.normal(new_key(), shape, F32) * shape[-1] ** -0.5, block)


@pytest.mark.parametrize("tokens", [1, 2])
def test_the_phases_give_the_two_kernels_result(tokens):
    """W_uv of the split partials written as [T, H·N] (`heads_flat`) and o_proj of it with the residual:
    equal to `heads_linear_of_splits` then `linear_residual` to the bit, and within rounding of the
    reference (combine, bf16, W_uv, then o_proj + residual), at a traced layer of the stacks."""
    g, n, hc, lat, nv, d, layers, layer = 2, 6, 8, 256, 128, 384, 3, 1
    o, m, l = _partials(tokens, g, n, hc, lat)
    w, ws = _stack((layers, g * hc, nv, lat))
    wo, wos = _stack((layers, d, g * hc * nv))
    residual = (4 * jax.random.normal(new_key(), (tokens, d), F32)).astype(BF16)

    def pair(o, m, l, lay):
        return gemv_pair.heads_splits_linear(o, m, l, w, ws, 128, wo, wos, residual, layer=lay)

    def two(o, m, l, lay):
        x = gemv.heads_linear_of_splits(o, m, l, w, ws, 128, layer=lay).reshape(tokens, -1)
        return gemv.linear_residual(x, wo, wos, residual, layer=lay)
    got = interpreted(jax.jit(pair), o, m, l, jnp.int32(layer))
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(interpreted(jax.jit(two), o, m, l, jnp.int32(layer)), np.float32))
    x = reference.heads_linear(smla.combine(o, m, l).astype(BF16), w[layer], ws[layer], 128).reshape(tokens, -1)
    want = reference.linear_residual(x, wo[layer], wos[layer], residual)
    assert rel_err(np.asarray(got, np.float32) - np.asarray(residual, np.float32),
                   np.asarray(want, np.float32) - np.asarray(residual, np.float32)) < 2e-2


def test_a_waiting_phase_reads_x_after_the_wait():
    """A projection run as a second phase (`wait` given): its x's TMA is issued inside `first`, after the
    wait, not in the prologue; with the wait a no-op the result is the plain kernel's."""
    x = jax.random.normal(new_key(), (1, 512), F32).astype(BF16)
    w, s = _stack((256, 512))
    plan = gemv.projection_plan(x, (w,), (s,))
    calls = []

    def kernel(*refs):
        plan.body(refs, jax.lax.axis_index("n"), jax.lax.axis_index("s"), None, wait=lambda: calls.append(1))
    import jax.experimental.pallas.mosaic_gpu as plgpu
    run = lambda x: plan.finish(plgpu.kernel(kernel, out_type=plan.out_type, grid=plan.grid, grid_names=plan.names,
                                             scratch_types=plan.scratch, interpret=interp.params())(x, *plan.args[1:]))
    got = interpreted(run, x)
    assert calls, "the wait was not traced"
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(interpreted(gemv.linear, x, w, s), np.float32))


@pytest.mark.parametrize("heads, d, block", [(16, 7168, 128), (8, 6144, 64)])
def test_one_kernel_lowers_for_the_gpu_at_full_shapes(heads, d, block):
    """DeepSeek-V3.2's share (16 heads of 128 over the 512-wide latent in 64 splits of one group, o_proj
    7168 × 2048 with the residual) and GLM-5's (8 heads, W_uv in 64-blocks of scales, o_proj 6144 × 1024)
    at a layer of the stacks: one Mosaic kernel that lowers for CUDA."""
    S = jax.ShapeDtypeStruct
    layers, nv, lat = 2, 128, 512
    args = (S((1, 1, 64, heads, lat), F32), S((1, 1, 64, heads), F32), S((1, 1, 64, heads), F32),
            S((layers, heads, nv, lat), FP8), S((layers, heads, nv // block, lat // block), F32),
            S((layers, d, heads * nv), FP8), S((layers, d // 128, heads * nv // 128), F32), S((1, d), BF16))
    with interp.compile_for_gpu():
        f = lambda o, m, l, w, ws, wo, wos, r: gemv_pair.heads_splits_linear(o, m, l, w, ws, block, wo, wos, r,
                                                                             layer=jnp.int32(1))
        out = []
        jax.eval_shape(lambda *a: out.append(gemv_pair.chain_unsupported(*gemv_pair.heads_splits_linear_plans(
            *a[:5], block, *a[5:], layer=jnp.int32(1)))) or 0, *args)
        assert out == [None]
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert txt.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("heads, why", [(16, None), (128, "heads mode, the epilogue in the kernel")])
def test_attention_out_says_where_its_pair_does_not_apply(heads, why):
    """DeepSeek-V3.2's one layer at tp 8 (16 heads) takes the pair; at tp 1 (128 heads) W_uv's GEMV sums its
    split-K partials after the kernel, so it cannot hand o_proj one row a token, and the op says so (the op
    table then runs sparse_mla_heads_linear and o_proj)."""
    from jtilert.pallas import sparse_mla
    S = jax.ShapeDtypeStruct
    lat, rope, nv, d, ctx, topk = 512, 64, 128, 7168, 4096, 2048
    args = (S((1, heads, lat), BF16), S((1, heads, rope), BF16), S((ctx, lat), BF16), S((ctx, rope), BF16),
            S((1, topk), jnp.int32), 0.07, BF16, S((heads, nv, lat), FP8), S((heads, 1, 4), F32), 128,
            S((d, heads * nv), FP8), S((d // 128, heads * nv // 128), F32), S((1, d), BF16))
    with interp.compile_for_gpu():
        got = sparse_mla.attention_out_unsupported(*args)
    assert got == why if why is None else why in got, got


def test_attention_out_through_the_op_table():
    """Op attention_out at a traced layer (16 heads over a 512-wide latent, bf16 caches, the residual):
    the pallas backend runs its kernels (sparse MLA's partials, then W_uv and o_proj as the pair) within
    rounding of the reference op, which is the reference's sparse_mla_heads_linear then linear_residual
    bit for bit; `Ops.attention_out` runs the op for one token without tp."""
    import warnings

    from test_pallas_sparse_mla import NL, _stacked_inputs, _uv_stack   # tests/ is on sys.path

    from jtilert.ops.table import DecodeConfig, Ops
    layer, d = 2, 256
    ql, qp, kv, pe, idx = _stacked_inputs("bf16", 192, np.random.randint(1 << 30))
    w, s = _uv_stack(ql.shape[1], ql.shape[2], 128, np.random.randint(1 << 30))
    wo, wos = _stack((NL, d, ql.shape[1] * 128))
    residual = (4 * jax.random.normal(new_key(), (1, d), F32)).astype(BF16)
    args = (ql, qp, kv, pe, idx, 0.07, BF16, w, s, 128, wo, wos, residual)
    out = []
    with interp.interpret(detect_races=True):
        for backend in ("pallas", "reference"):
            ops = Ops(DecodeConfig(backend=backend))
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="jtilert: backend='pallas'")   # the kernel must run
                out.append(np.asarray(jax.jit(lambda i: ops("attention_out", *args, layer=i))(jnp.int32(layer)),
                                      np.float32))
        method = np.asarray(jax.jit(lambda i: Ops(DecodeConfig(backend="pallas")).attention_out(
            ql, qp, kv, pe, idx, 0.07, BF16, (w, s, 128), (wo, wos), i, True, residual))(jnp.int32(layer)), np.float32)
        assert not interp.races_found()
    composed = jax.jit(lambda i: reference.linear_residual(reference.sparse_mla_heads_linear(
        ql, qp, kv[i], pe[i], idx, 0.07, BF16, w[i], s[i], 128).reshape(1, -1), wo[i], wos[i], residual))(jnp.int32(layer))
    np.testing.assert_array_equal(out[1], np.asarray(composed, np.float32))
    np.testing.assert_array_equal(method, out[0])
    res = np.asarray(residual, np.float32)
    assert rel_err(out[0] - res, out[1] - res) < 2e-2
