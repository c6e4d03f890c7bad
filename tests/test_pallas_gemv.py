"""GEMV kernels (issue 4) against jtilert.ops.reference, in GPU interpret mode on the CPU.

Every case draws fresh random inputs, runs the Mosaic-GPU kernel in the interpreter with race
detection (its buffers start as NaN, so an unwritten output element fails the comparison), and
shapes include row counts that are not multiples of the 64-row tile and K that is not a multiple
of the 128-wide scale block. A few realistic (dsv32-tp8-shard) configurations are cross-lowered
for CUDA, which catches Mosaic lowering errors without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key, interpreted, rel_err   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.ops import reference
from jtilert.pallas import gemv
from jtilert.pallas import interpret as interp

from jtilert.ops.quant import quantize_weight

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def _weight(shape, fmt, scale=1.0, pow2=True):
    w = jax.random.normal(new_key(), shape, F32) * shape[-1] ** -0.5 * scale
    if fmt == "fp8":
        q, s = quantize_weight(w)
        if not pow2:  # arbitrary fp32 scales (not the checkpoint's powers of two)
            s = s * jax.random.uniform(new_key(), s.shape, minval=0.6, maxval=0.95)
        return q, s
    return w.astype(BF16 if fmt == "bf16" else F32), None


def _x(t, k, scale=1.0):
    return (jax.random.normal(new_key(), (t, k), F32) * scale).astype(BF16)


# Bit-exact where the kernel and the reference round the same way; bf16 output rounding otherwise.
TOL = 1e-2


@pytest.mark.parametrize("t,n,k,fmt,split,engine", [
    (1, 96, 256, "fp8", 1, "wgmma"),     # N not a multiple of 64
    (3, 130, 512, "fp8", 2, "wgmma"),    # split-K, 3 tokens
    (2, 80, 64, "fp8", 1, "wgmma"),      # K = 64: a partial scale block (tiny model's q_lora)
    (2, 64, 192, "bf16", 1, "wgmma"),    # K not a multiple of 128
    (1, 72, 256, "fp8", 2, "fma"),       # CUDA-core engine
    (2, 64, 128, "f32", 1, "fma"),       # fp32 weights (router precision)
    # more steps than stages (block_k 128, 4 stages): every slot refilled, the refill after every
    # warp's reads of it (the race detection sees each warp's loads against the one thread's TMA)
    (2, 64, 1024, "f32", 1, "fma"),
])
def test_linear(t, n, k, fmt, split, engine):
    x = _x(t, k)
    w, s = _weight((n, k), fmt)
    cfg = gemv.GemvConfig(split_k=split, block_k=128, engine=engine)
    if fmt == "f32":
        got = interpreted(lambda x, w: gemv._projection(x, (w,), (None,), out_dtype=F32, config=cfg), x, w)
        ref = jnp.einsum("tk,nk->tn", x.astype(F32), w)
        assert rel_err(got, ref) < 1e-5
        return
    got = interpreted(functools.partial(gemv.linear, config=cfg), x, w, s)
    assert got.shape == (t, n)
    assert rel_err(got, reference.linear(x, w, s)) < TOL


@pytest.mark.parametrize("t,n,k,split", [(1, 96, 256, 1), (3, 130, 512, 2), (8, 64, 1024, 1)])
def test_fp8x2_engine_matches_the_reference(t, n, k, split):
    """engine "fp8x2" (both wgmma operands e4m3, x as two e4m3 halves): the bf16-activation GEMV's
    numerics across tokens, split-K and uneven N; activations far from 1 and non-power-of-two block
    scales too."""
    for xs, pow2 in ((1.0, True), (3e3, False), (1e-4, True)):
        x = _x(t, k, xs)
        w, s = _weight((n, k), "fp8", pow2=pow2)
        got = interpreted(functools.partial(gemv.linear, config=gemv.GemvConfig(engine="fp8x2", split_k=split)),
                          x, w, s)
        assert got.shape == (t, n)
        # power-of-two scales: the reference's bf16 weights are exact, and so is x in two halves;
        # other scales: the reference rounds each scaled weight to bf16, the kernel scales in fp32
        assert rel_err(got, reference.linear(x, w, s)) < (2e-3 if pow2 else TOL)


def test_fp8x2_engine_fused_variants_and_experts():
    """The norm prologue, the residual epilogue, the SwiGLU pair and expert mode with the fp8x2 engine."""
    from jtilert.pallas import moe
    cfg = gemv.GemvConfig(engine="fp8x2")
    x = _x(2, 512)
    w, s = _weight((192, 512), "fp8")
    u, us = _weight((192, 512), "fp8")
    nw = (1 + 0.1 * jax.random.normal(new_key(), (512,))).astype(BF16)
    r = _x(2, 192)
    got = interpreted(functools.partial(gemv.rmsnorm_linear, config=cfg), x, nw, 1e-6, w, s)
    assert rel_err(got, reference.linear(reference.rms_norm(x, nw, 1e-6), w, s)) < TOL
    got = interpreted(functools.partial(gemv.linear_residual, config=cfg), x, w, s, r)
    assert rel_err(got, reference.linear_residual(x, w, s, r)) < TOL
    got = interpreted(functools.partial(gemv.swiglu_pair, config=cfg), x, w, s, u, us)
    ref = (jax.nn.silu(reference.linear(x, w, s).astype(F32)) * reference.linear(x, u, us).astype(F32))
    assert rel_err(got, ref) < TOL
    ew, es = _weight((4, 128, 512), "fp8")
    eu, eus = _weight((4, 128, 512), "fp8")
    ids = jnp.array([[3, 0], [1, 3]], jnp.int32)
    got = interpreted(lambda *a: moe.expert_gate_up(*a, config=cfg), x, ids, ew, es, eu, eus)
    want = interpreted(moe.expert_gate_up, x, ids, ew, es, eu, eus)
    assert rel_err(got, want) < TOL


def test_fp8x2_engine_refuses_what_it_cannot_take():
    x = _x(1, 256)
    cfg = gemv.GemvConfig(engine="fp8x2")
    with pytest.raises(ValueError, match="fp8x2 takes fp8 weights"):
        gemv.linear(x, *_weight((64, 256), "bf16"), config=cfg)
    with pytest.raises(ValueError, match="K a multiple of 128"):
        gemv.linear(_x(1, 192), *_weight((64, 192), "fp8"), config=cfg)
    q, s64 = _blocked_fp8((2, 64, 256), 64)
    with pytest.raises(ValueError, match="fp8x2 engine takes 128-blocks"):
        gemv.heads_linear(_x(2, 256).reshape(1, 2, 256), q, s64, 64, config=cfg)


def test_auto_engine_by_weights():
    """The default engine: fp8x2 for fp8 weights with K in whole 128-blocks, wgmma for bf16 weights,
    for K off the 128 grain and for 64-block scales (K slices of 64 columns), fma for fp32 weights."""
    from jtilert.pallas import _hopper as hw
    auto = gemv.GemvConfig()
    with interp.interpret():
        sms = hw.num_sms()
        assert auto.resolved(7168, 2048, 1, 1, 1, sms).engine == "fp8x2"
        assert auto.resolved(7168, 2048, 1, 1, 2, sms).engine == "wgmma"
        assert auto.resolved(64, 192, 1, 1, 1, sms).engine == "wgmma"
        assert auto.resolved(64, 512, 1, 1, 1, sms, slice_unit=hw.KGRAIN).engine == "wgmma"
        assert auto.resolved(256, 7168, 1, 1, 4, sms).engine == "fma"


def test_linear_fp8_scaling_is_robust():
    """Non-power-of-two block scales and activations far from 1 (the f16 B operand is rescaled)."""
    for xs in (3e3, 1e-4):
        x = _x(2, 256, xs)
        w, s = _weight((64, 256), "fp8", pow2=False)
        got = interpreted(functools.partial(gemv.linear, config=gemv.GemvConfig(split_k=1)), x, w, s)
        assert rel_err(got, reference.linear(x, w, s)) < TOL


def test_linear_many_tokens_chunks():
    """More than 8 tokens run as chunks of ≤ 8 (leading dims are flattened)."""
    x = _x(10, 128).reshape(2, 5, 128)
    w, s = _weight((64, 128), "fp8")
    got = interpreted(functools.partial(gemv.linear, config=gemv.GemvConfig(split_k=1)), x, w, s)
    assert got.shape == (2, 5, 64)
    assert rel_err(got, reference.linear(x, w, s)) < TOL


def _blocked_fp8(shape, block):
    """fp8 weights with one power-of-two scale per `block`² block, the scales spread over 2^-4..2^3
    (a block read with another block's scale shows)."""
    q = jnp.clip(jax.random.normal(new_key(), shape, F32) * 64, -448, 448).astype(FP8)
    blocks = (*shape[:-2], -(-shape[-2] // block), -(-shape[-1] // block))
    return q, jnp.exp2(jax.random.randint(new_key(), blocks, -4, 4).astype(F32)) * (shape[-1] ** -0.5 / 64)


@pytest.mark.parametrize("t,heads,n,k,d,fmt,block,extra", [
    (3, 4, 64, 64, 96, "fp8", 128, None),    # 12 rows: CTAs past row 8 stage their own 8-row block; x rows wider than K
    (1, 2, 96, 192, 256, "fp8", 64, None),   # GLM-5's W_ukᵀ K (nope 192: block_k 64), 64-blocks of scales, N % 64 ≠ 0
    (2, 3, 64, 128, 128, "bf16", 128, None),
    (3, 4, 64, 64, 96, "fp8", 128, 136),     # x [T, W]: the heads' rows at columns h·D of a wider row (q in
    (1, 2, 96, 192, 256, "fp8", 64, 0),      # qr_proj's output, the indexer's query after it)
])
def test_heads_linear(t, heads, n, k, d, fmt, block, extra):
    """Every head's own projection in one launch (MLA's absorption): the expert mode with the heads as
    the experts and each (token, head) row of x a selection, the weights a 2-layer stack read at the
    layer index, x's rows wider than K (q's nope part). `extra`: x given as [T, H·D + extra] with
    head_dim=D, read in place (the extra columns large, so reading them shows)."""
    w, s = _blocked_fp8((2, heads, n, k), block) if fmt == "fp8" else _weight((2, heads, n, k), fmt)
    w1, s1 = w[1], None if s is None else s[1]
    if extra is None:
        x, head_dim = _x(t * heads, d).reshape(t, heads, d), None
        want = reference.heads_linear(x, w1, s1, block)
    else:
        x, head_dim = jnp.concatenate([_x(t, heads * d), _x(t, extra, 100.0)], axis=1), d
        want = reference.heads_linear(x, w1, s1, block, d)
        # the wide form's reference is the sliced form's, bit for bit
        np.testing.assert_array_equal(
            np.asarray(want, np.float32),
            np.asarray(reference.heads_linear(x[:, :heads * d].reshape(t, heads, d), w1, s1, block), np.float32))
    got = interpreted(lambda x, w, s, layer: gemv.heads_linear(x, w, s, block, head_dim, layer=layer),
                      x, w, s, jnp.int32(1))
    assert got.shape == (t, heads, n)
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("t,n,k,split,extra,engine", [
    (2, 96, 256, 1, 0, "auto"), (1, 64, 512, 2, 0, "auto"),
    # x wider than K (qr_proj reading q_a as the first columns of x_proj's output): the extra
    # columns large, so a norm or product that reads them shows
    (2, 96, 256, 1, 136, "auto"), (1, 64, 512, 2, 64, "auto"), (2, 64, 256, 1, 64, "fma"),
    (1, 64, 1024, 1, 0, "fma"),   # the FMA engine's x prepared while more steps than stages stream
    # rows too long to hold in registers while B is built (gemv.HELD_ROW_VALUES): 1/rms reduced first
    (3, 64, 3072, 2, 0, "auto")])
def test_rmsnorm_linear(t, n, k, split, extra, engine):
    x = jnp.concatenate([_x(t, k, 3.0), _x(t, extra, 100.0)], axis=1)
    nw = (1 + 0.1 * jax.random.normal(new_key(), (k,))).astype(BF16)
    w, s = _weight((n, k), "fp8")
    cfg = gemv.GemvConfig(split_k=split, engine=engine)
    got = interpreted(lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s, config=cfg), x, nw, w, s)
    ref = reference.linear(reference.rms_norm(x[:, :k], nw, 1e-6), w, s)
    np.testing.assert_array_equal(np.asarray(reference.rmsnorm_linear(x, nw, 1e-6, w, s), np.float32),
                                  np.asarray(ref, np.float32))
    assert rel_err(got, ref) < TOL


@pytest.mark.parametrize("t,n,split,fmt", [(2, 130, 1, "fp8"), (1, 64, 2, "fp8"), (2, 64, 1, "bf16")])
def test_linear_residual(t, n, split, fmt):
    k = 256
    x, r = _x(t, k), _x(t, n)
    w, s = _weight((n, k), fmt)
    got = interpreted(functools.partial(gemv.linear_residual, config=gemv.GemvConfig(split_k=split)), x, w, s, r)
    assert rel_err(got, r + reference.linear(x, w, s)) < TOL


@pytest.mark.parametrize("t,split,fmt", [(1, 2, "fp8"), (2, 1, "bf16")])
def test_swiglu(t, split, fmt):
    h, width = 256, 128
    x = _x(t, h)
    g, gs = _weight((width, h), fmt)
    u, us = _weight((width, h), fmt)
    d, ds = _weight((h, width), fmt)
    cfg = gemv.GemvConfig(split_k=split)
    got = interpreted(functools.partial(gemv.swiglu, config=cfg), x, g, gs, u, us, d, ds)
    assert rel_err(got, reference.swiglu(x, g, gs, u, us, d, ds)) < TOL


def test_linear_k14336_resolved_to_fit_smem():
    """The MTP block's eh_proj shape (K = 2·7168, fp8, 2 tokens) with N scaled down to 6 row blocks:
    the occupancy rule keeps one K slice, whose [8, 14336] token tiles do not fit in SMEM, so the
    resolved config splits K in 4 (as eh_proj's does on the H200); the result is the reference's."""
    n, k, t = 384, 14336, 2
    from jtilert.pallas import _hopper as hw
    with interp.interpret():
        cfg = gemv.GemvConfig().resolved(n, k, t, 1, 1, hw.num_sms())
        assert -(-n // 64) >= 0.7 * hw.num_sms()       # no split for occupancy
    assert (cfg.split_k, cfg.block_k, cfg.stages) == (4, 256, 4)
    x = _x(t, k)
    w, s = _weight((n, k), "fp8")
    got = interpreted(gemv.linear, x, w, s)
    assert rel_err(got, reference.linear(x, w, s)) < TOL


def test_refuses_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 64"):
        gemv.linear(_x(1, 100), *_weight((64, 100), "bf16"))
    with pytest.raises(ValueError, match="tokens per call"):
        gemv._projection(_x(9, 128), (_weight((64, 128), "bf16")[0],), (None,))
    with pytest.raises(ValueError, match="scale blocks"):
        gemv.linear(_x(1, 384), *_weight((64, 384), "fp8"), config=gemv.GemvConfig(split_k=6))


def test_op_table_runs_the_reference_for_prefill_and_warns_where_a_kernel_does_not_apply(monkeypatch):
    import warnings

    from jtilert.ops import table as ops_mod
    ops = ops_mod.Ops(ops_mod.DecodeConfig(backend="pallas"))
    calls = []
    real = gemv._projection
    monkeypatch.setattr(gemv, "_projection", lambda *a, **k: calls.append(1) or real(*a, **k))
    w, s = _weight((64, 128), "fp8")
    x = _x(16, 128)   # a prefill chunk: XLA's matmul (the reference), silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(np.asarray(ops.linear(x, w, s), F32), np.asarray(reference.linear(x, w, s), F32))
    assert calls == []
    ops.linear(_x(1, 128), w, s)   # decode: the kernel
    assert calls == [1]
    x96 = _x(1, 96)                # K not a multiple of the kernel's 64: the reference, with one warning
    w96 = jnp.asarray(np.random.RandomState(5).randn(64, 96), BF16)
    with pytest.warns(UserWarning, match=r"linear kernel does not apply to bfloat16\[1, 96\]"):
        ops.linear(x96, w96, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once per op and shape
        ops.linear(x96, w96, None)


# ---- cross-lowering at the dsv32-tp8-shard shapes (no GPU needed) ------------------------------

def _lower(f, *specs):
    with interp.compile_for_gpu():
        return jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def test_cross_lowering_dsv32_shapes():
    S = jax.ShapeDtypeStruct
    x = S((1, 7168), BF16)
    q = lambda n, k: (S((n, k), FP8), S((-(-n // 128), k // 128), F32))
    _lower(lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s), x, S((7168,), BF16), *q(2112, 7168))
    # the decode model's qr_proj (q_b | wq_b after q_a_layernorm), reading q_a in x_proj's output
    _lower(lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s), S((1, 2240), BF16), S((1536,), BF16),
           *q(3072 + 8192, 1536))
    _lower(gemv.linear, S((1, 1536), BF16), *q(3072, 1536))
    _lower(gemv.linear_residual, S((2, 2048), BF16), *q(7168, 2048), S((2, 7168), BF16))
    _lower(gemv.swiglu_pair, x, *q(2304, 7168), *q(2304, 7168))
    _lower(lambda x, w: gemv.linear(x, w, config=gemv.GemvConfig(engine="fma")), x, S((256, 7168), BF16))
    for f, args in ((lambda x, w, s, r: gemv.linear_residual(x, w, s, r, config=gemv.GemvConfig(engine="fp8x2")),
                     (S((1, 2048), BF16), *q(7168, 2048), S((1, 7168), BF16))),
                    (lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s, config=gemv.GemvConfig(engine="fp8x2")),
                     (x, S((7168,), BF16), *q(2240, 7168))),
                    (lambda x, w, s, u, us: gemv.swiglu_pair(x, w, s, u, us, config=gemv.GemvConfig(engine="fp8x2")),
                     (S((2, 7168), BF16), *q(2304, 7168), *q(2304, 7168)))):
        _lower(f, *args)   # the fp8x2 engine: e4m3 B written from registers, both operands from SMEM
    # a wgmma group left running into the next step (A from registers: what the interpreter does not run)
    cfg = gemv.GemvConfig(in_flight=1)
    _lower(lambda x, w, s, r: gemv.linear_residual(x, w, s, r, config=cfg), S((1, 2048), BF16), *q(7168, 2048),
           S((1, 7168), BF16))


def test_kernel_names_tell_the_projections_apart():
    """Each GEMV kernel is named by its engine, forms and N × K (what CUPTI's per-kernel times show):
    the layer's projections are told apart in a decode step's profile."""
    S = jax.ShapeDtypeStruct
    q = lambda n, k: (S((n, k), FP8), S((-(-n // 128), k // 128), F32))
    txt = _lower(lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s), S((1, 7168), BF16), S((7168,), BF16),
                 *q(2240, 7168))
    assert "jtilert_gemv_fp8x2_norm_2240x7168" in txt
    txt = _lower(gemv.linear_residual, S((1, 2048), BF16), *q(7168, 2048), S((1, 7168), BF16))
    assert "jtilert_gemv_fp8x2_residual_7168x2048" in txt
    txt = _lower(gemv.swiglu_pair, S((1, 7168), BF16), *q(256, 7168), *q(256, 7168))
    assert "jtilert_gemv_fp8x2_swiglu_256x7168" in txt
    txt = _lower(lambda x, w: gemv.linear(x, w, config=gemv.GemvConfig(engine="fma")), S((1, 7168), BF16),
                 S((256, 7168), F32))
    assert "jtilert_gemv_fma_256x7168" in txt


@pytest.mark.parametrize("heads, nope, v, block", [(16, 128, 128, 128), (8, 192, 256, 64)])
def test_cross_lowering_absorption_shapes(heads, nope, v, block):
    """MLA's two absorptions at the dsv32- / glm5-tp8-shard shapes (2 tokens: more rows than 8), kv_b per
    head in fp8 as `decode_weights` lays it out for the kernels, a 5-layer stack."""
    S = jax.ShapeDtypeStruct
    q = lambda n, k: (S((5, heads, n, k), FP8), S((5, heads, -(-n // block), -(-k // block)), F32))
    absorb = lambda x, w, s, layer: gemv.heads_linear(x, w, s, block, layer=layer)
    _lower(absorb, S((2, heads, nope + 64), BF16), *q(512, nope), S((), jnp.int32))
    # q read in place in qr_proj's output (q, then the indexer's query)
    _lower(lambda x, w, s, layer: gemv.heads_linear(x, w, s, block, nope + 64, layer=layer),
           S((2, heads * (nope + 64) + 8192), BF16), *q(512, nope), S((), jnp.int32))
    _lower(absorb, S((2, heads, 512), BF16), *q(v, 512), S((), jnp.int32))
