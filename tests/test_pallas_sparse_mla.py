"""Sparse MLA decode kernel (bf16 cache and FlashMLA's fp8 cache) against the plain-JAX references,
in GPU interpret mode on the CPU.

Each case draws fresh random inputs, cross-lowers the kernel for CUDA (Mosaic lowering errors without a
GPU), then runs it under the interpreter with race detection; the interpreter poisons every buffer
(outputs and SMEM start as NaN), so an unwritten output or a read of unwritten SMEM fails the check.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtilert import layers
from jtilert.pallas import interpret as interp
from jtilert.pallas import sparse_mla as smla

BF16 = jnp.bfloat16


def _run(f, *args):
    with interp.compile_for_gpu():
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    with interp.interpret(detect_races=True):
        out = np.asarray(f(*args))
        assert not interp.races_found()
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _inputs(T, H, L, R, S, K, frac_valid):
    keys = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 6)
    ql = jax.random.normal(keys[0], (T, H, L), BF16)
    qp = jax.random.normal(keys[1], (T, H, R), BF16)
    kv = (jax.random.normal(keys[2], (S, L)) * jnp.exp(jax.random.normal(keys[2], (S, 1)))).astype(BF16)
    pe = jax.random.normal(keys[3], (S, R), BF16)
    idx = jnp.stack([jax.random.permutation(jax.random.fold_in(keys[4], t), S)[:K]
                     for t in range(T)]).astype(jnp.int32)
    valid = (jax.random.uniform(keys[5], (T, K)) < frac_valid).at[:, 0].set(True)
    return ql, qp, kv, pe, idx, valid


@pytest.mark.parametrize("fp8,block_k,T,K,frac_valid", [
    (False, 32, 2, 32, 0.7),     # bf16, 32-row CTAs, masked rows, MTP-verify T=2
    (True, 64, 1, 50, 0.6),      # fp8 cache, fewer selected rows than one block (padded)
])
def test_sparse_mla_matches_reference(fp8, block_k, T, K, frac_valid):
    ql, qp, kv, pe, idx, valid = _inputs(T, 16, 512, 64, 300, K, frac_valid)
    if fp8:
        kv, pe = layers.quantize_kv_fp8(kv, pe), None
    cfg = smla.SparseMLAConfig(block_k=block_k)
    out = _run(lambda *a: smla.sparse_mla(*a[:3], pe, *a[3:], 0.07, config=cfg), ql, qp, kv, idx, valid)
    ref = layers.sparse_mla(ql, qp, kv, pe, idx, valid, 0.07)
    assert out.shape == ref.shape and out.dtype == np.float32 and np.isfinite(out).all()
    assert _rel(out, ref) < 4e-3   # P is rounded to bf16 before P·V (as FlashMLA does)


def test_fp8_cache_layout_is_flashmla():
    """656 bytes per row: e4m3 latent / scale, 4 fp32 power-of-two scales (2^ceil(log2(max(amax/448,
    1e-4)))), 64 bf16 rope values; dequantised rows within e4m3's rounding of the input."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    lat = (rng.standard_normal((5, 512)) * rng.choice([1e-6, 1e-2, 1, 300], (5, 1))).astype(np.float32)
    rope = rng.standard_normal((5, 64)).astype(np.float32)
    words = layers.quantize_kv_fp8(jnp.asarray(lat), jnp.asarray(rope))
    assert words.shape == (5, 164) and words.dtype == jnp.uint32
    b = np.asarray(words).view(np.uint8).reshape(5, 656)
    scale = b[:, 512:528].copy().view(np.float32)
    amax = np.abs(lat.reshape(5, 4, 128)).max(-1)
    np.testing.assert_array_equal(scale, 2.0 ** np.ceil(np.log2(np.maximum(amax / 448, 1e-4))))
    q = b[:, :512].copy().view(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(q, (lat.reshape(5, 4, 128) / scale[..., None]).reshape(5, 512).astype(jnp.float8_e4m3fn))
    np.testing.assert_array_equal(b[:, 528:].copy().view(BF16), rope.astype(BF16))
    kv, pe = layers.dequantize_kv_fp8(words, 512)
    np.testing.assert_array_equal(np.asarray(kv, np.float32),
                                  q.astype(np.float32) * np.repeat(scale, 128, axis=1))
    assert np.all(np.abs(np.asarray(kv, np.float32) - lat) <= np.repeat(scale, 128, axis=1) * 16 + 1e-30)


def test_fp8_cache_in_model_pallas_equals_reference(monkeypatch):
    """kv_cache_quant="fp8": init_cache holds packed rows only, the attention layer appends the new
    token quantised, and the decode step with the kernel equals the reference backend on the same
    cache (after a 40-token prefill: more positions than tiny's index_topk, so the indexer selects).
    The kernel's step runs eagerly: the GPU interpreter can deadlock on a 2-core machine when a kernel runs
    inside a large jit (its simulated warpgroups and TMA threads wait on XLA:CPU's thread pool)."""
    import jtilert
    from jtilert import backend
    from jtilert.model import init_cache

    cfg = jtilert.preset("tiny", num_hidden_layers=1, kv_lora_rank=512, qk_rope_head_dim=64,
                         index_head_dim=64, num_nextn_predict_layers=0, kv_cache_quant="fp8")
    attn = jtilert.random_model(cfg, fmt="bf16").layers[0].self_attn
    cache = init_cache(cfg, 48, BF16)["layers"][0]
    assert cache["kv"].shape == (48, 164) and cache["kv"].dtype == jnp.uint32 and "pe" not in cache
    keys = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 2)

    def step(x, start, cache):
        pos = start + jnp.arange(x.shape[0], dtype=jnp.int32)
        return attn(x, *layers.rope_cos_sin(cfg, pos), pos, jnp.int32(start), cache, None)

    _, cache, _ = jax.jit(step, static_argnums=1)(jax.random.normal(keys[0], (40, cfg.hidden_size), BF16), 0, cache)
    x = jax.random.normal(keys[1], (1, cfg.hidden_size), BF16)
    ref, ref_cache, _ = step(x, 40, cache)   # eager like the kernel's step: the same rounding
    ops = types.SimpleNamespace(**vars(backend.REFERENCE))
    ops.sparse_mla = smla.sparse_mla
    monkeypatch.setattr(backend, "ops", lambda: ops)
    with interp.interpret():
        out, out_cache, _ = step(x, 40, cache)
    np.testing.assert_array_equal(np.asarray(out_cache["kv"]), np.asarray(ref_cache["kv"]))
    assert np.asarray(ref_cache["kv"][40]).any() and not np.asarray(ref_cache["kv"][41:]).any()
    assert _rel(out, ref) < 1e-2   # bf16 output of the o projection, P in bf16


@pytest.mark.parametrize("kw", [dict(stop="gather"), dict(stop="softmax"), dict(spread=True)])
def test_timing_variants_cross_lower(kw):
    """Variants that bench/attention.py times compile for CUDA. Stage-cut ones leave outputs unwritten
    ("index" and "qk" are prefixes of these); `spread` is checked on the GPU by the bench's error
    column: in the interpreter its four warpgroups block in barrier waits at once, which can starve
    XLA:CPU's thread pool on a 2-core machine and hang."""
    ql, qp, kv, pe, idx, valid = _inputs(1, 16, 512, 64, 300, 128, 1.0)
    for cache, pcache, bk in ((kv, pe, 32), (layers.quantize_kv_fp8(kv, pe), None, 64)):
        cfg = smla.SparseMLAConfig(block_k=bk, **kw)
        f = functools.partial(smla.sparse_mla, pe_cache=pcache, scale=0.1, config=cfg)
        with interp.compile_for_gpu():
            jax.jit(lambda q, p, c, i, v: f(q, p, c, idx=i, valid=v)).trace(
                ql, qp, cache, idx, valid).lower(lowering_platforms=("cuda",))
