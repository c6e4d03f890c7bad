"""Reference ops against independent NumPy formulations (fresh random inputs)."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jtilert import preset
from jtilert.ops import reference
from jtilert.ops.quant import act_quant, dequantize, hadamard, quantize_weight

RNG = np.random.default_rng(0)


def test_hadamard_is_orthogonal():
    h = hadamard(128)
    np.testing.assert_allclose(h @ h.T, np.eye(128), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(96)


def official_act_quant(x):
    """The DeepSeek-V3.2 indexer's act_quant with scale_fmt="ue8m0", block 128, in NumPy."""
    g = x.reshape(*x.shape[:-1], -1, 128).astype(np.float32)
    amax = np.maximum(np.abs(g).max(-1), 1e-4)
    scale = np.exp2(np.ceil(np.log2(amax / 448.0)))
    q = (g / scale[..., None]).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape), scale


def test_fp8_indexer_quantisation_is_bit_exact_with_official():
    cfg = preset("deepseek-v3.2")
    k = (RNG.standard_normal((37, 128)) * RNG.uniform(0.01, 30, (37, 1))).astype(np.float32)
    q8, s = reference.indexer_key(cfg, reference.indexer_key_rotated(cfg, jnp.asarray(k)))
    ref_q, ref_s = official_act_quant(k @ hadamard(128))
    np.testing.assert_array_equal(np.asarray(s), ref_s[:, 0])
    np.testing.assert_array_equal(np.asarray(q8).view(np.uint8), ref_q.view(np.uint8))
    assert np.all(np.log2(ref_s) == np.round(np.log2(ref_s)))  # powers of two


def test_fp8_scores_track_unquantised_scores():
    fp8, plain = preset("deepseek-v3.2"), preset("deepseek-v3.2").replace(index_quant="none")
    t, h, s = 2, 64, 300
    q = jnp.asarray(RNG.standard_normal((t, h, 128)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((s, 128)), jnp.float32)
    w = jnp.asarray(RNG.standard_normal((t, h)) * 0.1, jnp.float32)
    pos = jnp.array([s - 2, s - 1])
    exact = reference.indexer_scores(*reference.indexer_query(plain, q, w), *reference.indexer_key(plain, k), pos)
    approx = reference.indexer_scores(*reference.indexer_query(fp8, q, w),
                                      *reference.indexer_key(fp8, reference.indexer_key_rotated(fp8, k)), pos)
    visible = np.isfinite(np.asarray(exact))
    assert np.array_equal(visible, np.isfinite(np.asarray(approx))) and not visible[0, -1]
    err = np.abs(np.asarray(approx) - np.asarray(exact))[visible]
    assert err.max() < 0.1 * np.abs(np.asarray(exact)[visible]).max()


@pytest.mark.parametrize("quant", ["fp8", "none"])
def test_indexer_scores_in_blocks_of_rows_are_the_one_shot_scores(quant):
    """A prefill chunk's scores, computed a block of cache rows at a time (a tile budget far below
    [T, H, S]), are the scores of the one-shot computation, and so is the top-k (ties to the lower
    position, the future masked); a chunk in the middle of the cache skips the blocks past it."""
    cfg = preset("deepseek-v3.2").replace(index_quant=quant)
    t, h, s = 24, 8, 1000    # 1000 rows: blocks of 128 leave a partial last block
    q = jnp.asarray(RNG.standard_normal((t, h, 128)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((s, 128)), jnp.float32)
    k = k.at[500].set(k[300])    # two rows with equal scores: the top-k keeps the lower first
    w = jnp.asarray(RNG.standard_normal((t, h)) * 0.1, jnp.float32)
    qq, ww = reference.indexer_query(cfg, q, w)
    kk, ks = reference.indexer_key(cfg, k)
    budget = t * h * 4 * 128    # one block of 128 rows
    assert reference.indexer_key_block(t, h, s, budget) == 128
    assert reference.indexer_key_block(t, h, s) == s and reference.indexer_key_block(1, 64, 131072) == 131072
    assert reference.indexer_key_block(2048, 64, 131072) * 2048 * 64 * 4 <= 1 << 30
    assert reference.indexer_key_block(1024, 64, 4224) == 1408   # 3 equal blocks of 512 MiB at most, no padding
    for pos in (jnp.arange(t) + 600, jnp.arange(t) + s - t, jnp.arange(t) * 40):   # middle, end, spread
        one = reference.indexer_scores(qq, ww, kk, ks, pos)
        blocked = reference.indexer_scores(qq, ww, kk, ks, pos, tile_bytes=budget)
        np.testing.assert_array_equal(np.isfinite(blocked), np.isfinite(one))
        np.testing.assert_allclose(np.asarray(blocked), np.asarray(one), rtol=1e-5, atol=1e-5)   # fp32 sums
        a, b = reference.topk_positions(one, 64), reference.topk_positions(blocked, 64)
        assert np.array_equal(a, b)
    pos = jnp.arange(t) + 600
    idx = reference.topk_positions(reference.indexer_scores(qq, ww, kk, ks, pos, tile_bytes=budget), s)
    order = np.asarray(idx).tolist()
    assert all(r.index(300) < r.index(500) for r in order)   # the tie goes to the lower position


def test_weight_quantisation_round_trip():
    w = RNG.standard_normal((300, 200)).astype(np.float32) * 0.05
    q, s = quantize_weight(w)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (3, 2)
    back = np.asarray(dequantize(q, s, jnp.float32))
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.05


def test_topk_ties_go_to_the_lower_position_and_mask_the_future():
    scores = jnp.array([[1.0, 3.0, 3.0, 2.0, 3.0, -jnp.inf]])
    assert reference.topk_positions(scores, 4).tolist() == [[1, 2, 4, 3]]
    assert reference.topk_positions(jnp.array([[5.0, -jnp.inf, -jnp.inf]]), 2).tolist() == [[0, -1]]


def test_sparse_mla_equals_dense_masked_attention():
    t, h, lat, r, s, k = 2, 4, 16, 8, 30, 10
    q_lat, q_pe = RNG.standard_normal((t, h, lat)), RNG.standard_normal((t, h, r))
    kv, pe = RNG.standard_normal((s, lat)), RNG.standard_normal((s, r))
    idx = np.stack([RNG.choice(s, k, replace=False) for _ in range(t)])
    valid = RNG.random((t, k)) < 0.8
    valid[:, 0] = True
    out = reference.sparse_mla(*map(jnp.asarray, (q_lat, q_pe, kv, pe, np.where(valid, idx, -1))), 0.3)
    for i in range(t):
        keep = idx[i][valid[i]]
        sc = (q_lat[i] @ kv[keep].T + q_pe[i] @ pe[keep].T) * 0.3
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        np.testing.assert_allclose(np.asarray(out[i]), p @ kv[keep], rtol=1e-5, atol=1e-5)


def test_grouping_by_expert_places_every_choice_once():
    """Tiles hold one expert each, every (token, choice) exactly once, in token order within an expert,
    whatever the load: experts chosen by every token, experts chosen by none."""
    rng = np.random.default_rng(11)
    e, k, rows = 16, 4, 4
    for t in (4, 9, 33):
        ids = np.stack([rng.choice(np.r_[0, 0, 0, 3, 5:e], k, replace=False) for _ in range(t)]).astype(np.int32)
        ids[:, 0] = 7                                         # expert 7: one choice of every token
        choice, tile_expert, place = map(np.asarray, reference.group_by_expert(jnp.asarray(ids), e, rows))
        assert choice.shape == (t * k // rows + min(e, t * k), rows)
        used = choice[choice < t * k]
        assert sorted(used.tolist()) == list(range(t * k))
        assert (choice.reshape(-1)[place] == np.arange(t * k)).all()
        flat = ids.reshape(-1)
        for tile, ex in zip(choice, tile_expert):
            assert (flat[tile[tile < t * k]] == ex).all()
        for ex in range(e):
            order = [c for c in choice.reshape(-1) if c < t * k and flat[c] == ex]
            assert order == sorted(order)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_moe_grouped_equals_the_gathered_path(fmt):
    """Prefill's grouped experts against decode's per-choice gather (expert_hidden + expert_down) on
    the same seeded inputs, several tokens choosing the same experts (more than a tile's rows)."""
    rng = np.random.default_rng(12)
    e, hid, inter, t = 16, 256, 128, 40
    cfg = preset("tiny", n_routed_experts=e, hidden_size=hid)

    def weight(n, kk):
        w = rng.standard_normal((e, n, kk)) * kk**-0.5
        if fmt == "bf16":
            return jnp.asarray(w, jnp.bfloat16), None
        return quantize_weight(w)

    (g, gs), (u, us), (d, ds) = weight(inter, hid), weight(inter, hid), weight(hid, inter)
    x = jnp.asarray(rng.standard_normal((t, hid)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((e, hid)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(e) * 0.5, jnp.float32).at[2].set(5.0)   # expert 2 for every token
    wts, ids = reference.route(cfg, x, router, bias)
    assert int((ids == 2).sum()) == t and t > reference.GROUP_ROWS // 2
    grouped = reference.moe_grouped(x, wts, ids, g, gs, u, us, d, ds, rows=32)
    gathered = reference.expert_down(reference.expert_hidden(x, ids, g, gs, u, us), wts, ids, d, ds)
    assert float(jnp.abs(grouped.astype(jnp.float32)).mean()) > 0.1
    # the same fp32 products summed in the same order: equal up to the GEMMs' own fp32 rounding
    np.testing.assert_allclose(np.asarray(grouped, np.float32), np.asarray(gathered, np.float32),
                               rtol=1e-2, atol=1e-2)
    assert float(jnp.mean(grouped != gathered)) < 0.02
    np.testing.assert_array_equal(np.asarray(reference.moe_experts(x, wts, ids, g, gs, u, us, d, ds)),
                                  np.asarray(reference.moe_grouped(x, wts, ids, g, gs, u, us, d, ds)))


def test_decode_weights_lay_kv_b_out_per_head_and_share_the_rest(tiny_fp8):
    """The reference Engine's model: kv_b per head (W_ukᵀ, W_uv) in the compute dtype with the values the
    step used to dequantise every step (the pallas Engine's fp8 copies: tests/test_decode_weights.py),
    q_a / wk / kv_a merged into x_proj and q_b / wq_b into qr_proj, the router's bf16 values in bf16,
    every other weight the same array; the logits unchanged."""
    import jtilert
    from jtilert.model.transformer import decode_weights
    from jtilert.store import checkpoint
    cfg = tiny_fp8.cfg
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    d = decode_weights(tiny_fp8)
    kv_b = tiny_fp8.layers.self_attn.kv_b_proj
    assert d.layers.self_attn.kv_b_proj is None and kv_b.scale is not None   # the user's model is untouched
    wkv = np.asarray(dequantize(kv_b.weight[...], kv_b.scale[...], tiny_fp8.dtype))
    wkv = wkv.reshape(wkv.shape[0], -1, nope + v, wkv.shape[-1])
    q, o = d.layers.self_attn.absorb_q, d.layers.self_attn.absorb_o
    assert q.scale is None and o.scale is None and q.weight[...].dtype == tiny_fp8.dtype
    np.testing.assert_array_equal(np.asarray(q.weight[...]), np.swapaxes(wkv[:, :, :nope], -1, -2))
    np.testing.assert_array_equal(np.asarray(o.weight[...]), wkv[:, :, nope:])
    a, b = checkpoint.flat_params(tiny_fp8), checkpoint.flat_params(d)
    merged = {f"{m}.{p}" for m in ("layers.self_attn.q_a_proj", "layers.self_attn.kv_a_proj_with_mqa", "indexers.wk",
                                   "layers.self_attn.q_b_proj", "indexers.wq_b", "layers.self_attn.kv_b_proj")
              for p in ("weight", "scale")}
    assert set(a) - set(b) == merged | {"layers.post_attention_layernorm.weight"}
    copies = {f"layers.self_attn.{m}.{p}" for m in ("x_proj", "qr_proj") for p in ("weight", "scale")}
    copies |= {"dense.norm.weight", "moe.norm.weight"}   # the FFN stacks' rows of the post-attention norm
    assert set(b) - set(a) == copies | {"layers.self_attn.absorb_q.weight", "layers.self_attn.absorb_o.weight"}
    np.testing.assert_array_equal(np.asarray(b["moe.gate.weight"]), np.asarray(a["moe.gate.weight"]))
    assert b["moe.gate.weight"].dtype == jnp.bfloat16 and a["moe.gate.weight"].dtype == jnp.float32
    copies.add("moe.gate.weight")
    assert all(a[k] is b[k] for k in b if "absorb" not in k and k not in copies)
    ids = np.random.default_rng(5).integers(0, 256, 20)
    np.testing.assert_array_equal(jtilert.score(tiny_fp8, ids, prefill=10),
                                  jtilert.score(d, ids, prefill=10))
