"""Sparse MLA decode kernel (bf16 cache and FlashMLA's fp8 cache) against the plain-JAX references,
in GPU interpret mode on the CPU.

Each case draws fresh random inputs, cross-lowers the kernel for CUDA (Mosaic lowering errors without a
GPU), then runs it under the interpreter with race detection; the interpreter poisons every buffer
(outputs and SMEM start as NaN), so an unwritten output or a read of unwritten SMEM fails the check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key, lowered_and_interpreted, rel_err   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import interpret as interp
from jtilert.pallas import sparse_mla as smla

BF16 = jnp.bfloat16


def _inputs(T, H, L, R, S, K, frac_valid):
    keys = jax.random.split(new_key(), 6)
    ql = jax.random.normal(keys[0], (T, H, L), BF16)
    qp = jax.random.normal(keys[1], (T, H, R), BF16)
    kv = (jax.random.normal(keys[2], (S, L)) * jnp.exp(jax.random.normal(keys[2], (S, 1)))).astype(BF16)
    pe = jax.random.normal(keys[3], (S, R), BF16)
    idx = jnp.stack([jax.random.permutation(jax.random.fold_in(keys[4], t), S)[:K]
                     for t in range(T)]).astype(jnp.int32)
    valid = (jax.random.uniform(keys[5], (T, K)) < frac_valid).at[:, 0].set(True)
    return ql, qp, kv, pe, jnp.where(valid, idx, -1)   # masked rows: -1 (the top-k's convention)


@pytest.mark.parametrize("fp8,block_k,T,K,frac_valid", [
    (False, 32, 2, 32, 0.7),     # bf16, 32-row CTAs, masked rows, MTP-verify T=2
    (True, 64, 1, 50, 0.6),      # fp8 cache, fewer selected rows than one block (padded)
])
def test_sparse_mla_matches_reference(fp8, block_k, T, K, frac_valid):
    ql, qp, kv, pe, idx = _inputs(T, 16, 512, 64, 300, K, frac_valid)
    if fp8:
        kv, pe = reference.quantize_kv_fp8(kv, pe), None
    cfg = smla.SparseMLAConfig(block_k=block_k)
    out = lowered_and_interpreted(lambda *a: smla.sparse_mla(*a[:3], pe, *a[3:], 0.07, config=cfg), ql, qp, kv, idx)
    ref = reference.sparse_mla(ql, qp, kv, pe, idx, 0.07)
    assert out.shape == ref.shape and out.dtype == np.float32 and np.isfinite(out).all()
    assert rel_err(out, ref) < 4e-3   # P is rounded to bf16 before P·V (as FlashMLA does)


def test_combine_kernel_writes_the_model_dtype():
    """The split merge in bf16 (`out_dtype`, what the model's absorption kernel reads: no cast launch
    after it) is the kernel's fp32 merge rounded once, bit for bit; the fp32 merge is the reference's
    within fp32 rounding (its sums run in another order, so a bf16 rounding of the two can differ by
    one ulp where the fp32 value sits on a rounding boundary)."""
    k = jax.random.split(new_key(), 3)
    o, m = jax.random.normal(k[0], (2, 1, 4, 16, 64)), jax.random.normal(k[1], (2, 1, 4, 16))
    l = jax.random.uniform(k[2], (2, 1, 4, 16)) + 0.5
    out = lowered_and_interpreted(lambda o, m, l: smla.combine_kernel(o, m, l, out_dtype=BF16), o, m, l)
    out32 = lowered_and_interpreted(lambda o, m, l: smla.combine_kernel(o, m, l), o, m, l)
    assert out.dtype == BF16 and out32.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(jnp.asarray(out32).astype(BF16), np.float32))
    np.testing.assert_allclose(out32, np.asarray(smla.combine(o, m, l)), rtol=1e-5, atol=1e-6)


def test_fp8_cache_layout_is_flashmla():
    """656 bytes per row: e4m3 latent / scale, 4 fp32 power-of-two scales (2^ceil(log2(max(amax/448,
    1e-4)))), 64 bf16 rope values; dequantised rows within e4m3's rounding of the input."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    lat = (rng.standard_normal((5, 512)) * rng.choice([1e-6, 1e-2, 1, 300], (5, 1))).astype(np.float32)
    rope = rng.standard_normal((5, 64)).astype(np.float32)
    words = reference.quantize_kv_fp8(jnp.asarray(lat), jnp.asarray(rope))
    assert words.shape == (5, 164) and words.dtype == jnp.uint32
    b = np.asarray(words).view(np.uint8).reshape(5, 656)
    scale = b[:, 512:528].copy().view(np.float32)
    amax = np.abs(lat.reshape(5, 4, 128)).max(-1)
    np.testing.assert_array_equal(scale, 2.0 ** np.ceil(np.log2(np.maximum(amax / 448, 1e-4))))
    q = b[:, :512].copy().view(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(q, (lat.reshape(5, 4, 128) / scale[..., None]).reshape(5, 512).astype(jnp.float8_e4m3fn))
    np.testing.assert_array_equal(b[:, 528:].copy().view(BF16), rope.astype(BF16))
    kv, pe = reference.dequantize_kv_fp8(words, 512)
    np.testing.assert_array_equal(np.asarray(kv, np.float32),
                                  q.astype(np.float32) * np.repeat(scale, 128, axis=1))
    assert np.all(np.abs(np.asarray(kv, np.float32) - lat) <= np.repeat(scale, 128, axis=1) * 16 + 1e-30)


@pytest.mark.parametrize("cache_kind", ["fp8", "bf16"])
def test_cache_in_model_pallas_equals_reference(monkeypatch, cache_kind):
    """The decode step with the attention's kernels (on the layer stack, traced layer index) equals the
    reference on the same cache (after a 40-token prefill: more positions than tiny's index_topk, so
    the indexer selects); the other ops run their references. "fp8": kv_cache_quant="fp8", init_cache
    holds packed rows only, the attention layer appends the new token quantised (op sparse_mla).
    "bf16": the decode model's layout (W_uv per head in fp8, stacked), where the attention and W_uv
    run as op sparse_mla_heads_linear (W_uv's kernel merges the attention's splits). Both steps are
    jitted (eagerly, every op of the layer compiles on its own)."""
    import jtilert
    from jtilert.model.transformer import decode_weights, init_cache
    from jtilert.ops.table import DecodeConfig, Ops

    fp8 = cache_kind == "fp8"
    cfg = jtilert.preset("tiny", num_hidden_layers=1, kv_lora_rank=512, qk_rope_head_dim=64,
                         index_head_dim=64, num_nextn_predict_layers=0, **({"kv_cache_quant": "fp8"} if fp8 else {}))
    model = jtilert.random_model(cfg, fmt="bf16" if fp8 else "fp8")
    if not fp8:
        model = decode_weights(model, backend="pallas")
    cache = init_cache(cfg, 48, BF16)
    if fp8:
        assert cache["kv"].shape == (1, 48, 164) and cache["kv"].dtype == jnp.uint32 and "pe" not in cache
    keys = jax.random.split(new_key(), 2)
    layer = jnp.int32(0)

    def step(ops, x, start, cache):
        pos = start + jnp.arange(x.shape[0], dtype=jnp.int32)
        cos, sin = reference.rope_cos_sin(cfg, pos)

        norm = model.layers.input_layernorm

        def indexer(qr, q, k, c):
            return model.indexers(ops, layer, norm(x, layer), qr, cos, sin, pos, jnp.int32(start), c, q, k)

        return model.layers.self_attn(ops, layer, x, norm, cos, sin, pos, jnp.int32(start), cache, indexer)

    plain = Ops(DecodeConfig(backend="reference"))
    _, cache, _ = jax.jit(lambda x, c: step(plain, x, 0, c))(
        jax.random.normal(keys[0], (40, cfg.hidden_size), BF16), cache)
    x = jax.random.normal(keys[1], (1, cfg.hidden_size), BF16)
    ref, ref_cache, _ = jax.jit(lambda x, c: step(plain, x, 40, c))(x, cache)
    kernels = Ops(DecodeConfig(backend="pallas", engine_topk=False))
    use = kernels._use_kernel
    op = "sparse_mla" if fp8 else "sparse_mla_heads_linear"
    monkeypatch.setattr(kernels, "_use_kernel", lambda name, *a: name == op and use(name, *a))
    calls = []
    real = smla.sparse_mla_partials
    monkeypatch.setattr(smla, "sparse_mla_partials", lambda *a, **k: calls.append(1) or real(*a, **k))
    if not fp8:   # and no combine kernel: W_uv's merges the splits
        monkeypatch.setattr(smla, "combine_kernel", None)
    with interp.interpret():
        out, out_cache, _ = jax.jit(lambda x, c: step(kernels, x, 40, c))(x, cache)
    assert calls, "the kernel did not run"
    np.testing.assert_array_equal(np.asarray(out_cache["kv"]), np.asarray(ref_cache["kv"]))
    assert np.asarray(ref_cache["kv"][0, 40]).any() and not np.asarray(ref_cache["kv"][0, 41:]).any()
    assert rel_err(out, ref) < 1e-2   # bf16 output of the o projection, P in bf16


NL = 3   # layers in a stack


def _stacked_inputs(cache, S, seed):
    """Queries, layer stacks [NL, S, ...] (each layer's rows different), the selected rows (the cache's
    last row among them, about a fifth masked as -1); cache "bf16", "fp8" (packed) or "tiny" (rope rows of 32
    bytes, read with TMA zero fill)."""
    H, L, R = (8, 64, 16) if cache == "tiny" else (16, 512, 64)
    keys = jax.random.split(jax.random.key(seed), 6)
    ql = jax.random.normal(keys[0], (1, H, L), BF16)
    qp = jax.random.normal(keys[1], (1, H, R), BF16)
    kv = jax.random.normal(keys[2], (NL, S, L), BF16)
    pe = jax.random.normal(keys[3], (NL, S, R), BF16)
    idx = jax.random.permutation(keys[4], S - 1)[:63].astype(jnp.int32)
    idx = jnp.concatenate([idx, jnp.array([S - 1], jnp.int32)])[None]
    valid = (jax.random.uniform(keys[5], idx.shape) < 0.8).at[:, -1].set(True)
    if cache == "fp8":
        kv, pe = reference.quantize_kv_fp8(kv, pe), None
    return ql, qp, kv, pe, jnp.where(valid, idx, -1)


@pytest.mark.parametrize("cache,S,layer", [("bf16", 192, 2), ("fp8", 320, 0), ("tiny", 192, 2), ("bf16", 256, 0)])
def test_sparse_mla_stacked_layer(cache, S, layer):
    """Caches stacked over NL layers with a traced layer index: the result equals the reference on
    that layer's cache alone."""
    ql, qp, kv, pe, idx = _stacked_inputs(cache, S, np.random.randint(1 << 30))
    f = jax.jit(lambda ql, qp, kv, idx, layer: smla.sparse_mla(ql, qp, kv, pe, idx, 0.07, layer=layer))
    out = lowered_and_interpreted(f, ql, qp, kv, idx, jnp.int32(layer))
    ref = reference.sparse_mla(ql, qp, kv[layer], None if pe is None else pe[layer], idx, 0.07)
    assert out.shape == ref.shape and np.isfinite(out).all()
    assert rel_err(out, ref) < 4e-3


def test_sparse_mla_refuses_prefill_chunks_and_the_op_table_runs_the_reference():
    """More tokens than the kernel takes: the kernel raises, naming them; the op table warns and runs
    the reference on the layer."""
    from jtilert.ops import table
    ql, qp, kv, pe, idx = _stacked_inputs("bf16", 128, np.random.randint(1 << 30))
    T = smla.MAX_TOKENS + 1
    ql, qp = jnp.tile(ql, (T, 1, 1)), jnp.tile(qp, (T, 1, 1))
    idx = jnp.tile(idx, (T, 1))
    with pytest.raises(ValueError, match=f"sparse_mla kernel: {T} tokens"):
        smla.sparse_mla(ql, qp, kv, pe, idx, 0.07, layer=jnp.int32(1))
    ops = table.Ops(table.DecodeConfig(backend="pallas"))
    with pytest.warns(UserWarning, match=f"sparse_mla kernel does not apply .*{T} tokens"):
        out = jax.jit(lambda *a: ops("sparse_mla", *a, 0.07, layer=jnp.int32(1)))(ql, qp, kv, pe, idx)
    ref = reference.sparse_mla(ql, qp, kv[1], pe[1], idx, 0.07)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache,S", [("bf16", 320), ("fp8", 192), ("tiny", 320)])
def test_sparse_mla_stacked_lowering_has_no_cache_copies(cache, S):
    """On a layer stack the kernel takes the whole stacks: no dynamic_slice / pad / concatenate /
    gather of a cache in XLA (the tiny model's narrow rope rows are not padded either)."""
    ql, qp, kv, pe, idx = _stacked_inputs(cache, S, np.random.randint(1 << 30))

    def f(ql, qp, kv, pe, idx, layer):
        return smla.sparse_mla(ql, qp, kv, pe, idx, 0.07, layer=layer)

    with interp.compile_for_gpu():
        txt = jax.jit(f).trace(ql, qp, kv, pe, idx, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    stack = f"tensor<{NL}x{S}x"
    kernels = [ln for ln in txt.splitlines() if "custom_call @mosaic_gpu" in ln and stack in ln.rsplit(" : (", 1)[-1]]
    copies = [ln.strip()[:200] for ln in txt.splitlines() if "custom_call" not in ln and stack in ln and any(
        op in ln for op in ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.pad", "stablehlo.concatenate",
                            "stablehlo.gather"))]
    assert not copies, copies
    assert len(kernels) == 1


def _uv_stack(H, L, N, seed, block=128):
    """W_uv stacked over NL layers, fp8 with `block`-block scales: [NL, H, N, L], [NL, H, N/block,
    L/block] (64: the finer blocks of GLM-5's W_uv per head, powers of two as the checkpoint's)."""
    w = jax.random.normal(jax.random.key(seed), (NL, H, N, L)) * 0.05
    return quantize_weight(w, block)


@pytest.mark.parametrize("T, G, n, hc, L, block", [(2, 2, 6, 8, 256, 128), (1, 1, 64, 16, 512, 128),
                                                   (2, 1, 16, 8, 512, 64)])
def test_heads_linear_of_splits_merges_as_the_combine(T, G, n, hc, L, block):
    """The heads GEMV fed the split partials (each CTA merges its head's splits in place of reading
    x) against the reference: combine, rounded to bf16, then heads_linear; two tokens (MTP verify),
    two head groups, and splits with no valid row (m = -inf, l = 0) among them; DeepSeek-V3.2's
    shape at 32 rows a split (64 splits: the weight tile's every row); GLM-5's 64-blocks of scales
    (the merged input built in 64-column blocks)."""
    from jtilert.pallas import gemv
    k = jax.random.split(new_key(), 4)
    N = 128
    o = jax.random.normal(k[0], (T, G, n, hc, L))
    m = jax.random.normal(k[1], (T, G, n, hc)) * 3
    l = jax.random.uniform(k[2], (T, G, n, hc)) + 0.5
    dead = jnp.zeros((T, G, n, hc), bool).at[:, :, 1].set(True).at[T - 1, G - 1, 4].set(True)
    m, l = jnp.where(dead, -jnp.inf, m), jnp.where(dead, 0.0, l)
    w, s = _uv_stack(G * hc, L, N, np.random.randint(1 << 30), block)
    layer = 1
    out = lowered_and_interpreted(lambda o, m, l, lay: gemv.heads_linear_of_splits(o, m, l, w, s, block, layer=lay),
                                  o, m, l, jnp.int32(layer))
    x = smla.combine(o, m, l).astype(BF16)
    ref = reference.heads_linear(x, w[layer], s[layer], block)
    assert out.shape == (T, G * hc, N) and out.dtype == BF16 and np.isfinite(np.asarray(out, np.float32)).all()
    # the merged x as the reference rounds it; a merge summed in another order may round one element to
    # the next bf16 (2^-8 relative), which moves an output by far less than that
    assert rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) < 2e-3


@pytest.mark.parametrize("T", [1, 2])
def test_sparse_mla_heads_linear_matches_reference(T):
    """Sparse MLA then W_uv as two launches (no combine kernel) on stacked caches and W_uv with a traced
    layer: the reference's attention in bf16 through the layer's W_uv."""
    ql, qp, kv, pe, idx = _stacked_inputs("bf16", 192, np.random.randint(1 << 30))
    ql, qp, idx = jnp.tile(ql, (T, 1, 1)) * jnp.arange(1, T + 1, dtype=BF16)[:, None, None], jnp.tile(qp, (T, 1, 1)), \
        jnp.tile(idx, (T, 1))
    w, s = _uv_stack(ql.shape[1], ql.shape[2], 128, np.random.randint(1 << 30))
    f = jax.jit(lambda ql, qp, kv, pe, idx, w, s, lay: smla.sparse_mla_heads_linear(ql, qp, kv, pe, idx, 0.07, BF16,
                                                                                   w, s, 128, layer=lay))
    out = lowered_and_interpreted(f, ql, qp, kv, pe, idx, w, s, jnp.int32(2))
    ref = reference.sparse_mla_heads_linear(ql, qp, kv[2], pe[2], idx, 0.07, BF16, w[2], s[2], 128)
    assert out.shape == ref.shape == (T, 16, 128) and out.dtype == BF16
    assert rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) < 1e-2   # P in bf16, as sparse_mla


def test_sparse_mla_heads_linear_refuses_what_it_cannot_merge():
    """The fp8 cache (partials in byte-plane order), W_uv scales in blocks other than 64 or 128, a latent
    of 64 columns, an fp32 attention output and more splits than the weight tile's rows are named;
    `Ops.sparse_mla_heads_linear` then runs the two ops."""
    assert "fp8 latent cache" in smla.heads_linear_unsupported(16, 512, 64, 2048, True, 128, BF16)
    assert "32-blocks" in smla.heads_linear_unsupported(16, 512, 64, 2048, False, 32, BF16)
    assert smla.heads_linear_unsupported(8, 512, 64, 2048, False, 64, BF16) is None   # GLM-5's W_uv
    assert "kv_lora_rank=64" in smla.heads_linear_unsupported(8, 64, 16, 2048, False, 128, BF16)
    assert "float32" in smla.heads_linear_unsupported(16, 512, 64, 2048, False, 128, jnp.float32)
    assert "65 splits" in smla.heads_linear_unsupported(16, 512, 64, 32 * 65, False, 128, BF16)
    assert smla.heads_linear_unsupported(16, 512, 64, 32 * 64, False, 128, BF16) is None
    assert "65 splits" in smla.heads_linear_unsupported(16, 512, 64, 64 * 65, False, 128, BF16,
                                                        smla.SparseMLAConfig(block_k=64))
    assert smla.heads_linear_unsupported(16, 512, 64, 2048, False, 128, BF16) is None


def test_ops_asks_the_merged_ops_condition_once(monkeypatch):
    """`Ops.sparse_mla_heads_linear` decides between the merged op and the two ops by the merged op's
    condition, then runs its kernel without asking the table again."""
    import dataclasses

    from jtilert.ops import table

    asked = []
    op = table.OPS["sparse_mla_heads_linear"]
    monkeypatch.setitem(table.OPS, "sparse_mla_heads_linear",
                        dataclasses.replace(op, unsupported=lambda *a: asked.append(a) or None))
    ran = []
    monkeypatch.setattr(table, "_kernel", lambda path: lambda *a, **k: ran.append(path) or "out")
    ops = table.Ops(table.DecodeConfig(backend="pallas", engine_topk=False))
    T, H, L, R, S, K, N = 1, 16, 512, 64, 256, 128, 128
    sds = jax.ShapeDtypeStruct
    args = (sds((T, H, L), BF16), sds((T, H, R), BF16), sds((2, S, L), BF16), sds((2, S, R), BF16),
            sds((T, K), jnp.int32), 0.1, BF16)
    w_uv = (sds((2, H, N, L), jnp.float8_e4m3fn), sds((2, H, 1, L // 128), jnp.float32), 128)
    assert ops.sparse_mla_heads_linear(*args, w_uv, jnp.int32(1), True) == "out"
    assert ran == [op.kernel] and len(asked) == 1
    assert asked[0][2].shape == (S, L)   # asked about one layer of the stacks
