"""The indexer prep kernel (`jtilert.pallas.index_prep`: the key's LayerNorm, rope on the index queries
and the key, the Hadamard rotation of both, the queries' fp8 quantisation with the scales folded into
the head weights) against `jtilert.ops.reference.index_prep`, in GPU interpret mode on the CPU.

Each case draws fresh random inputs, cross-lowers the kernel for CUDA (Mosaic lowering errors without
a GPU), then runs it under the interpreter with race detection, against the reference jitted as the
model runs it (`_reference`). Tolerances:
  k: the roped bf16 key is the reference's bit for bit (the norm's sums and rsqrt are the same XLA:CPU
     ops here, rope is elementwise fp32, the permutations are exact); its fp32 Hadamard rotation is
     summed like the queries' (below), so each value is within NOISE · Σ_d |k_d|·D^-0.5 of the
     reference's: the two sums' rounding, with the reference's rounded products k_d · ±D^-0.5 and
     the kernel's final product by D^-0.5 (2^-24 each) inside that first-order bound (D·2^-24 per
     side). A key left unrotated, unscaled or rotated by another matrix is off by O(|k|);
  w: bit for bit wherever the row's scale is the reference's (w times a power of two is exact); the
     scale may differ only where the row's amax lies within fp32 noise of a power-of-two boundary;
  q: the kernel sums the Hadamard rotation of the bf16 rows with ±1 on the tensor cores, then scales
     by D^-0.5 in fp32, where the reference multiplies by ±D^-0.5 first and sums in XLA's order: the
     fp32 values differ by the sums' rounding (at most D·2^-24 of Σ_d |q_d|·D^-0.5 each: 2^-16 for
     both), so an fp8 value may round the other way where the reference's value lies within that of a
     rounding midpoint, one fp8 step at most (a small value of a large row: a few per thousand rows).
     Elsewhere: equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key, run_one_kernel   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.model.presets import preset
from jtilert.ops import reference
from jtilert.ops.quant import FP8_MAX, hadamard
from jtilert.pallas import index_prep as ip
from jtilert.pallas import interpret as interp

BF16, F32, FP8 = jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn
NL = 3          # layers in the k_norm stacks
NOISE = 2.0 ** -16   # the two fp32 sums' rounding, relative to Σ|terms| (D·2^-24 each, D = 128)


def _case(name, tokens, start):
    """The merged projections' outputs of preset `name` under tp = 8 (q_x: the heads' q, then the
    indexer's query; k_x: q_a, the indexer's key, kv_a), the k_norm stacks, cos / sin and head weights."""
    cfg = preset(name)
    hi, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q_col = cfg.num_attention_heads * cfg.qk_head_dim
    k_col = cfg.q_lora_rank
    k = jax.random.split(new_key(), 6)
    q_x = jax.random.normal(k[0], (tokens, q_col + hi * d), BF16)
    k_x = (jax.random.normal(k[1], (tokens, k_col + d + cfg.kv_lora_rank + r)) * 3 + 0.5).astype(BF16)
    nw = (1 + 0.1 * jax.random.normal(k[2], (NL, d))).astype(BF16)
    nb = (0.1 * jax.random.normal(k[3], (NL, d))).astype(BF16)
    cos, sin = reference.rope_cos_sin(cfg, start + jnp.arange(tokens, dtype=jnp.int32))
    w = jax.random.normal(k[4], (tokens, hi), F32)   # the head weights' projection (index_prep scales it)
    return cfg, (q_x, k_x, nw, nb, cos, sin, w), q_col, k_col


def _reference(cfg, q_col, k_col, layer):
    """reference.index_prep as the model runs it, jitted (XLA:CPU may contract the rope's products into
    FMAs, eagerly it does not: a bf16 rope value near a rounding midpoint then rounds the other way;
    the interpreted kernel is jitted too), with its roped queries (fp32), the values its quantiser
    rounds and its roped key before the rotation (fp32)."""
    d = cfg.index_head_dim

    def f(q_x, k_x, nw, nb, cos, sin, w):
        args = (q_x, q_col, k_x, k_col, nw[layer], nb[layer], 1e-6, cos, sin, w)
        q, _, k = (x.astype(F32) for x in reference.index_prep(cfg.replace(index_quant="none"), *args))
        pre = jnp.einsum("thd,de->the", q, jnp.asarray(hadamard(d)))   # the same rope, unrotated
        return reference.index_prep(cfg, *args), q, pre, k
    return jax.jit(f)


def _fp8_step(x):
    """The spacing of e4m3 values at |x| (subnormals: 2^-9)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -6)))
    return 2.0 ** (e - 3)


def check_q_w(q8, w8, want_q8, want_w, pre, l1, w):
    """q8 / w8 (kernel) against the reference's (want_q8, want_w), given the reference's fp32 values
    before quantisation `pre` [T, H, D], each row's Σ_d |q_d|·D^-0.5 `l1` [T, H] and the head weights
    w: the tolerance of the module docstring. Returns the number of fp8 values that differ."""
    amax = np.abs(pre).max(-1)
    r = np.maximum(amax, 1e-4) / FP8_MAX
    near_pow2 = np.abs(r / 2.0 ** np.round(np.log2(r)) - 1) <= NOISE * l1 / amax
    same_scale = w8 == want_w
    assert (same_scale | near_pow2).all()
    np.testing.assert_array_equal(w8[~near_pow2], want_w[~near_pow2])
    got, want = q8.astype(np.float32), want_q8.astype(np.float32)
    scale = (want_w / w)[..., None]                      # the reference's scales (exact powers of two)
    v = pre / scale                                      # what the reference rounded to fp8
    diff = (got != want) & same_scale[..., None]
    step = _fp8_step(np.maximum(np.abs(got), np.abs(want)))
    assert (np.abs(got - want)[diff] <= step[diff]).all()
    mid = (got + want) / 2                               # a differing pair straddles v's rounding midpoint
    noise = np.broadcast_to((NOISE * l1 / (want_w / w))[..., None], v.shape)
    assert (np.abs(v - mid)[diff] <= noise[diff]).all()
    return int(diff.sum())


@pytest.mark.parametrize("name,tokens,start,layer,w_width", [
    ("dsv32-tp8-shard", 1, 17, 1, 0),    # 64 index heads, half-split rope: one query tile
    ("dsv32-tp8-shard", 2, 46, 2, 0),    # MTP verify's two tokens: two query tiles
    ("glm5-tp8-shard", 1, 5, 1, 0),      # 32 heads, interleaved rope: half a tile
    ("glm5-tp8-shard", 2, 30, 2, 64),    # the head weights as index_weights' kernel leaves them: rows of 64
    ("dsv32-tp8-shard", 4, 40, 1, 68),   # the most tokens the kernel takes: four query tiles; wider rows
])
def test_index_prep_matches_reference(name, tokens, start, layer, w_width):
    """w_width: the head weights' rows that wide, their first H columns the weights and the rest NaN
    (never read: the kernel copies each token's first H)."""
    cfg, args, q_col, k_col = _case(name, tokens, start)
    hi, d = cfg.index_n_heads, cfg.index_head_dim
    w = args[-1]
    if w_width:
        args = (*args[:-1], jnp.pad(w, ((0, 0), (0, w_width - hi)), constant_values=jnp.nan))

    def f(q_x, k_x, nw, nb, cos, sin, w, layer):
        return ip.index_prep(cfg, q_x, q_col, k_x, k_col, nw, nb, 1e-6, cos, sin, w, layer=layer)

    q8, w8, k = run_one_kernel(f, *args, jnp.int32(layer))
    want, q32, pre, k32 = jax.tree.map(np.asarray, _reference(cfg, q_col, k_col, layer)(*args))
    assert q8.shape == (tokens, hi, d) and q8.dtype == FP8 and w8.shape == (tokens, hi) and w8.dtype == F32
    assert k.shape == want[2].shape == (tokens, d) and k.dtype == want[2].dtype == F32
    bound = NOISE * np.abs(k32).sum(-1, keepdims=True) * d**-0.5   # the module docstring's k tolerance
    assert (np.abs(k - want[2]) <= bound).all(), np.abs(k - want[2]).max()
    assert not np.isnan(w8).any() and not np.isnan(want[1]).any()
    # the head weights as index_prep scales them before the queries' scales
    differ = check_q_w(q8, w8, want[0], want[1], pre, np.abs(q32).sum(-1) * d**-0.5,
                       np.asarray(w) * reference.index_weight_scale(cfg))
    assert differ <= q8.size // 100, differ


def test_index_prep_refuses_what_it_does_not_fit_and_the_op_table_runs_the_reference():
    """Unquantised index queries, the tiny models' rope dims and head widths, prefill chunks are
    refused by name; the op table then warns and runs the reference on the layer's norm."""
    from jtilert.ops import table
    cfg, args, q_col, k_col = _case("glm5-tp8-shard", 1, 3)
    q_x, k_x, nw, nb, cos, sin, w = args
    plain = cfg.replace(index_quant="none")
    with pytest.raises(ValueError, match="index_prep kernel: index_quant='none'"):
        ip.index_prep(plain, q_x, q_col, k_x, k_col, nw, nb, 1e-6, cos, sin, w, layer=jnp.int32(1))
    assert "rope dim 16" in ip.unsupported(1, 8, 128, 16, "fp8", 640, 0, 208, 64)
    assert "index_head_dim=32" in ip.unsupported(1, 8, 32, 16, "fp8", 640, 0, 208, 64)
    assert "6 tokens" in ip.unsupported(6, 32, 128, 64, "fp8", q_x.shape[1], q_col, k_x.shape[1], k_col)
    assert ip.unsupported(2, 32, 128, 64, "fp8", q_x.shape[1], q_col, k_x.shape[1], k_col) is None
    ops = table.Ops(table.DecodeConfig(backend="pallas", engine_topk=False))
    with pytest.warns(UserWarning, match="index_prep kernel does not apply .*index_quant='none'"):
        got = ops("index_prep", plain, q_x, q_col, k_x, k_col, nw, nb, 1e-6, cos, sin, w, layer=jnp.int32(1))
    want = reference.index_prep(plain, q_x, q_col, k_x, k_col, nw[1], nb[1], 1e-6, cos, sin, w)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_index_prep_reads_windows_and_stacks_in_place():
    """One Mosaic kernel that takes the projections' whole outputs (the query projection's as rows of
    index_head_dim: a reshape, no copy) and the whole k_norm stacks (no slice of them in XLA)."""
    cfg, args, q_col, k_col = _case("dsv32-tp8-shard", 1, 3)

    def f(q_x, k_x, nw, nb, cos, sin, w, layer):
        return ip.index_prep(cfg, q_x, q_col, k_x, k_col, nw, nb, 1e-6, cos, sin, w, layer=layer)

    with interp.compile_for_gpu():
        txt = jax.jit(f).trace(*args, jnp.int32(2)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in txt.splitlines() if "custom_call @mosaic_gpu" in line]
    q_x, k_x = args[:2]
    assert len(calls) == 1
    for shape in (f"tensor<{q_x.shape[1] // 128}x128xbf16>", f"tensor<1x{k_x.shape[1]}xbf16>",
                  f"tensor<{NL}x128xbf16>"):
        assert shape in calls[0], shape
    assert not [line for line in txt.splitlines() if any(op in line for op in (
        "stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.concatenate", "stablehlo.pad"))]


def test_matrices_are_the_split_and_the_rotation():
    """x · P splits the rope pairs; (x · P) · (Pᵀ·H) = x · H (the ±1 Hadamard), for both rope layouts."""
    x = np.random.default_rng(np.random.randint(1 << 30)).standard_normal((3, 128)).astype(np.float32)
    signs = np.sign(hadamard(128))
    for inter in (False, True):
        p, hp = (m.astype(np.float32) for m in ip.matrices(128, 64, inter))
        xs = x @ p
        if inter:
            np.testing.assert_array_equal(xs[:, :32], x[:, 0:64:2])
            np.testing.assert_array_equal(xs[:, 32:64], x[:, 1:64:2])
        else:
            np.testing.assert_array_equal(xs, x)
        np.testing.assert_allclose(xs @ hp, x @ signs, rtol=1e-5, atol=1e-4)
