"""The decode model's merged GEMVs (`decode_weights`): the projections of a layer's normed input — q_a,
the indexer's wk (where every layer has its own indexer), kv_a — as `Attention.x_proj`, and those of
the normed q_a output — q_b and the indexer's wq_b (where every layer has its own indexer) — as
`Attention.qr_proj`, each one GEMV over their weights concatenated once by rows, its norm fused in
(`rmsnorm_linear`). The rows are the original ones (fp8: each weight but the last padded to whole
128-row scale blocks; under tp, qr_proj holds one block per rank: the rank's q_b rows, then all of
wq_b); the fused GEMV kernel over a merged stack gives each projection's rows bit for bit (interpret
mode: the kernel's per-row math depends on the row's own scale block and the K split, which the merge
keeps at these shapes), and the model's logits stay within fp32 / bf16 rounding of the separate
projections' on the reference backend, tp=1 and tp=2.

kv_b per head (`head_weights`, `Attention.absorb_q` / `absorb_o`): for the pallas Engine the fp8 values
and scales laid out per head, exactly kv_b's (DeepSeek-V3.2, GLM-5 and tiny layouts); the heads_linear
kernel on those stacks gives the reference Engine's bf16 einsums; the logits on that layout are the
reference's bit for bit."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import jtilert
from jtilert.model.transformer import decode_weights
from jtilert.ops.quant import dequantize
from jtilert.runtime import generate


@functools.cache
def _model(name: str, fmt: str, block64: bool = False):
    return jtilert.random_model(jtilert.preset(name, **BLOCK64) if block64 else name, fmt=fmt, seed=3,
                                dtype=jnp.bfloat16)


# tiny with nope 64 / v 128: heads of 192 rows, so kv_b per head takes 64-blocks of scales
BLOCK64 = dict(qk_nope_head_dim=64, v_head_dim=128, num_hidden_layers=2)


@pytest.mark.parametrize("name, fmt, parts, qr_parts", [
    ("tiny", "fp8", ((0, 64), (128, 32), (256, 80)), ((0, 256), (256, 256))),   # fp8: padded to 128-row blocks
    ("tiny", "bf16", ((0, 64), (64, 32), (96, 80)), ((0, 256), (256, 256))),    # no scale blocks: no padding
    ("tiny-glm5", "fp8", ((0, 64), (128, 80)), None)])   # shared indexers: wk, wq_b stay in their own stack
def test_merged_projections_hold_the_projections_rows(name, fmt, parts, qr_parts):
    m = _model(name, fmt)
    d = decode_weights(m)
    attn, dattn = m.layers.self_attn, d.layers.self_attn
    assert attn.x_proj is None and attn.qr_proj is None and attn.q_a_proj is not None   # the user's model untouched
    assert dattn.q_a_proj is None and dattn.kv_a_proj_with_mqa is None
    assert (d.indexers.wk is None) == (len(parts) == 3)
    assert (dattn.q_b_proj is None) == (d.indexers.wq_b is None) == (qr_parts is not None)
    assert decode_weights(d) is d
    merged = [(dattn.x_proj, parts,
               [attn.q_a_proj] + ([m.indexers.wk] if len(parts) == 3 else []) + [attn.kv_a_proj_with_mqa])]
    if qr_parts is not None:
        merged.append((dattn.qr_proj, qr_parts, [attn.q_b_proj, m.indexers.wq_b]))
    else:
        assert dattn.qr_proj is None

    def dense(lin):
        return np.asarray(dequantize(lin.weight[...], lin.scale_or_none, jnp.float32))
    for fused, want, srcs in merged:
        assert fused.parts == want and fused.ranks == 1
        w = dense(fused)
        for (a, n), src in zip(want, srcs):
            np.testing.assert_array_equal(w[:, a:a + n], dense(src))
        covered = np.zeros(w.shape[1], bool)
        for a, n in want:
            covered[a:a + n] = True
        assert not w[:, ~covered].any()   # padding rows are zeros
        if fmt == "fp8":
            assert fused.scale[...].shape[1] == sum(s.scale[...].shape[1] for s in srcs)


def _score(model, merge: bool, monkeypatch, **kw):
    with monkeypatch.context() as mp:
        mp.setattr(generate, "decode_weights", functools.partial(decode_weights, merge=merge))
        return jtilert.score(model, IDS, prefill=36, **kw)


IDS = np.random.RandomState(4).randint(0, 256, 40)


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_merged_gemv_kernel_rows_equal_the_separate_kernels(fmt):
    """The fused GEMV kernel (interpret mode) over a merged stack, with the norm the model fuses into it,
    gives each projection's rows bit for bit as the kernel over that projection's own stack, for a
    traced layer index. The model around it (the splits, the indexer's query and key) is checked on the
    reference below, and the pallas path as a whole against transformers in test_golden_kernels and
    against the reference in test_pallas_gemv_wiring."""
    import jax
    from jtilert.pallas import gemv
    m = _model("tiny", fmt)
    attn, d = m.layers.self_attn, decode_weights(m).layers.self_attn
    run = jax.jit(gemv.rmsnorm_linear, static_argnums=2)
    layer = jnp.int32(1)
    for fused, norm, srcs in [(d.x_proj, m.layers.input_layernorm,
                               [attn.q_a_proj, m.indexers.wk, attn.kv_a_proj_with_mqa]),
                              (d.qr_proj, attn.q_a_layernorm, [attn.q_b_proj, m.indexers.wq_b])]:
        k = fused.weight[...].shape[-1]
        x = jax.random.normal(jax.random.key(7), (2, k), jnp.float32).astype(jnp.bfloat16)
        y = np.asarray(run(x, norm.weight[...], norm.eps, fused.weight[...], fused.scale_or_none, layer=layer),
                       np.float32)
        assert np.abs(y).max() > 0
        for (a, n), src in zip(fused.parts, srcs):
            want = np.asarray(run(x, norm.weight[...], norm.eps, src.weight[...], src.scale_or_none, layer=layer),
                              np.float32)
            np.testing.assert_array_equal(y[:, a:a + n], want)


# The merge and the model's split of x_proj do not depend on tp (the Engine merges before it shards
# the weights) nor on the activation dtype; the cases cover each kind of merge: three parts
# padded to scale blocks (tiny fp8), two parts (tiny-glm5's shared indexers), no scales (fp32, on a
# tp=2 mesh: the replicated merged weight under shard_map).
@pytest.mark.parametrize("name, fmt, tp", [("tiny", "fp8", 1), ("tiny", "fp32", 2), ("tiny-glm5", "fp8", 1)])
def test_merged_reference_gives_the_same_logits(name, fmt, tp, monkeypatch):
    """backend="reference", fp32 activations: XLA:CPU's fp32 GEMM sums a row's products in an order
    that depends on the weight's row count and on the CPU (measured: 2e-7 relative on one projection),
    so the merged product may differ in the last fp32 bit, and that stays at fp32 noise. (With bf16
    activations such a bit can flip a bf16 rounding, then an indexer or router choice, and the logits
    move by bf16 noise or more, depending on the machine.)"""
    m = jtilert.random_model(name, fmt=fmt, seed=3, dtype=jnp.float32)
    mesh = jtilert.make_mesh(tp) if tp > 1 else None
    merged, apart = _score(m, True, monkeypatch, mesh=mesh), _score(m, False, monkeypatch, mesh=mesh)
    scale = np.abs(apart).max()
    err = np.abs(merged - apart).max() / scale
    print(f"{fmt} tp={tp}: max |merged - apart| / max |logit| = {err:.2e}")
    assert err <= 1e-5


def test_merged_weights_under_tp():
    """q_a, wk and kv_a are replicated (every rank projects the whole x); so is their merge. q_b is split
    by heads, wq_b replicated: qr_proj holds one block of rows per rank, the rank's q_b rows then all of
    wq_b, split over the ranks. (tiny's fp8 block scales do not split over tp: bf16 weights.)"""
    import jax
    m = _model("tiny", "bf16")
    eng = generate.Engine(m, mesh=jtilert.make_mesh(2))
    state = jax.tree_util.tree_unflatten(eng._treedef, eng.state)
    w = state["layers"]["self_attn"]["x_proj"]["weight"][...]
    assert w.shape[1] == 176 and w.sharding.is_fully_replicated and len(w.sharding.device_set) == 2
    qr = state["layers"]["self_attn"]["qr_proj"]["weight"][...]
    q_b, wq_b = np.asarray(m.layers.self_attn.q_b_proj.weight[...]), np.asarray(m.indexers.wq_b.weight[...])
    assert qr.shape[1] == 2 * (128 + 256) and len(qr.sharding.device_set) == 2
    for shard in qr.addressable_shards:
        rank = shard.index[1].start // (128 + 256)
        np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate(
            [q_b[:, rank * 128:(rank + 1) * 128], wq_b], axis=1))
    with pytest.raises(ValueError, match="laid out for tp=1, not tp=2"):
        generate.Engine(decode_weights(m), mesh=jtilert.make_mesh(2))


# ---- kv_b per head: the two absorptions' weights (`head_weights`, op "heads_linear") ----------------

def _kv_b(nope: int, v: int, heads: int, lat: int, layers: int = 2):
    """An fp8 kv_b stack [L, H·(nope+v), lat] whose 128-blocks have scales 2^-4..2^3 apart (a block
    given another block's scale shows)."""
    import jax
    from jtilert.ops.quant import quantize_weight
    rows = heads * (nope + v)
    spread = jax.random.randint(jax.random.key(1), (layers, -(-rows // 128), -(-lat // 128)), -4, 4)
    spread = np.repeat(np.repeat(np.exp2(np.asarray(spread, np.float32)), 128, 1), 128, 2)[:, :rows, :lat]
    return quantize_weight(jax.random.normal(jax.random.key(2), (layers, rows, lat)) * spread)


@pytest.mark.parametrize("nope, v, heads, lat, block", [
    (128, 128, 3, 512, 128),   # DeepSeek-V3.2: heads of 2·128 rows
    (192, 256, 3, 512, 64),    # GLM-5: heads of 448 rows, every other one starting mid-block
    (16, 16, 8, 64, 128),      # tiny: 4 heads per block
    (32, 48, 4, 64, None)])    # heads of 80 rows: no whole blocks fit, dequantised instead
def test_head_weights_are_kv_b_per_head_exactly(nope, v, heads, lat, block):
    from jtilert.model.transformer import head_scale_block, head_weights
    cfg = jtilert.preset("tiny", qk_nope_head_dim=nope, v_head_dim=v, kv_lora_rank=lat)
    w, s = _kv_b(nope, v, heads, lat)
    assert head_scale_block(cfg, w.shape[1]) == block
    (uk_t, uk_ts), (uv, uvs) = head_weights(cfg, w, s, jnp.bfloat16, block)
    want = np.asarray(dequantize(w, s, jnp.float32)).reshape(2, heads, nope + v, lat)
    if block is None:
        assert uk_ts is None and uvs is None and uk_t.dtype == jnp.bfloat16
        want = np.asarray(want.astype(jnp.bfloat16), np.float32)
    else:
        assert uk_t.dtype == uv.dtype == jnp.float8_e4m3fn
        assert uk_ts.shape == (2, heads, -(-lat // block), -(-nope // block))
        assert uvs.shape == (2, heads, -(-v // block), -(-lat // block))
    np.testing.assert_array_equal(np.asarray(dequantize(uk_t, uk_ts, jnp.float32, block or 128)),
                                  np.swapaxes(want[:, :, :nope], -1, -2))
    np.testing.assert_array_equal(np.asarray(dequantize(uv, uvs, jnp.float32, block or 128)), want[:, :, nope:])


# tiny's q_nope (16) is narrower than the kernel's K grain: only the latent → v absorption runs the kernel there
@pytest.mark.parametrize("block64, which", [(True, ("q", "o")), (False, ("o",))])
def test_heads_linear_kernel_on_the_decode_stacks(block64, which):
    """The kernel on the pallas Engine's fp8 stacks at a traced layer index (2 tokens: 16 rows of heads)
    gives the reference Engine's einsum on its bf16 copies, within bf16 rounding."""
    import jax
    from jtilert.ops import reference, table
    from jtilert.pallas import gemv
    m = _model("tiny", "fp8", block64)
    fp8, bf16 = (decode_weights(m, backend=b).layers.self_attn for b in ("pallas", "reference"))
    cfg, layer = m.cfg, jnp.int32(1)
    x = {"q": jax.random.normal(jax.random.key(3), (2, 8, cfg.qk_head_dim), jnp.float32).astype(jnp.bfloat16),
         "o": jax.random.normal(jax.random.key(4), (2, 8, cfg.kv_lora_rank), jnp.float32).astype(jnp.bfloat16)}
    run = jax.jit(lambda x, w, s, l, block: gemv.heads_linear(x, w, s, block, layer=l), static_argnums=4)
    for name in ("q", "o"):
        pal, ref = getattr(fp8, f"absorb_{name}").arrays(), getattr(bf16, f"absorb_{name}").arrays()
        assert pal[0].dtype == jnp.float8_e4m3fn and pal[2] == (64 if block64 else 128)
        if name not in which:   # the op table runs the reference there
            assert table._heads_unsupported(x[name], *pal) is not None
            continue
        assert table._heads_unsupported(x[name], *pal) is None
        got = np.asarray(run(x[name], pal[0], pal[1], layer, pal[2]), np.float32)
        want = np.asarray(reference.heads_linear(x[name], ref[0][layer], None, ref[2]), np.float32)
        assert np.abs(want).max() > 0
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_the_pallas_layout_gives_the_reference_logits():
    """The pallas Engine's weights (kv_b per head in fp8, 64-blocks of scales here) on the reference
    backend: the logits of the reference Engine's bit for bit (the same dequantised values)."""
    m = _model("tiny", "fp8", True)
    fp8 = decode_weights(m, backend="pallas")
    assert fp8.layers.self_attn.absorb_q.block == 64
    ids = IDS[:24]
    np.testing.assert_array_equal(jtilert.score(fp8, ids, prefill=20), jtilert.score(m, ids, prefill=20))


def test_a_bf16_valued_router_is_read_in_bf16_with_the_same_logits(monkeypatch):
    """A router whose values are all bf16 values (random models, as the checkpoints' routers) is held
    in bf16 by the decode model, and the logits are those of the fp32 router bit for bit (the reference
    backend: XLA's fp32 einsum of the same values; the pallas path's router kernel, to fp32 rounding:
    the next test). One value that is not a bf16 value keeps the router in fp32."""
    from jtilert.model import transformer
    m = _model("tiny", "fp8")
    w = m.moe.gate.weight.get_value()
    assert w.dtype == jnp.float32 and transformer.router_in_bf16(w)
    for backend in ("reference", "pallas"):
        assert decode_weights(m, backend=backend).moe.gate.weight.get_value().dtype == jnp.bfloat16
    ids = IDS[:22]   # two decode steps
    bf16 = jtilert.score(m, ids, prefill=20)
    monkeypatch.setattr(transformer, "router_in_bf16", lambda w: False)
    assert decode_weights(m, backend="pallas").moe.gate.weight.get_value().dtype == jnp.float32
    np.testing.assert_array_equal(bf16, jtilert.score(m, ids, prefill=20))
    monkeypatch.undo()
    assert not transformer.router_in_bf16(w.at[0, 3, 5].add(1e-6))


@pytest.mark.parametrize("normed", [False, True])
def test_the_router_kernel_reads_a_bf16_router_as_its_fp32_values(normed):
    """The pallas path's router kernel (the FMA GEMV, interpret mode) on a stack of bf16-valued routers:
    held in bf16 or in fp32, the same normed x bit for bit and the same logits to fp32 rounding (the
    products are exact in fp32 either way; the loads' widths differ, and so may the order of the sums),
    for the routers of the tiny model's MoE layers read at a traced layer index."""
    import jax
    from jtilert.pallas import moe
    m = _model("tiny", "fp8")
    gate = m.moe.gate.weight.get_value()   # [L, E, H] fp32 holding bf16 values
    x = jax.random.normal(jax.random.key(4), (1, gate.shape[2]), jnp.float32).astype(jnp.bfloat16)
    nw = jax.random.normal(jax.random.key(5), gate.shape[::2], jnp.float32) * 0.1 + 1

    def run(g, i):
        return moe.norm_router_partials(x, nw, 1e-6, g, layer=i) if normed else (moe.router_partials(x, g, layer=i),)
    for layer in range(gate.shape[0]):
        f32 = jax.jit(run)(gate, jnp.int32(layer))
        bf16 = jax.jit(run)(gate.astype(jnp.bfloat16), jnp.int32(layer))
        logits = np.asarray(f32[0]).sum(0)
        np.testing.assert_allclose(np.asarray(bf16[0]).sum(0), logits, rtol=0, atol=4e-7 * np.abs(logits).max())
        if normed:
            np.testing.assert_array_equal(np.asarray(bf16[1], np.float32), np.asarray(f32[1], np.float32))
        assert np.abs(logits).max() > 0.5
