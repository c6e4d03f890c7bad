"""The decode model's merged GEMV (`decode_weights`, `Attention.x_proj`): the projections of a layer's
normed input — q_a, the indexer's wk (where every layer has its own indexer), kv_a — run as one GEMV
over their weights concatenated once by rows. The rows are the original ones (fp8: each weight but the
last padded to whole 128-row scale blocks); the GEMV kernel over the merged stack gives each
projection's rows bit for bit (interpret mode: the kernel's per-row math depends on the row's own
scale block and the K split, which the merge keeps at these shapes), and the model's logits stay
within fp32 / bf16 rounding of the separate projections' on the reference backend, tp=1 and tp=2."""

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
def _model(name: str, fmt: str):
    return jtilert.random_model(name, fmt=fmt, seed=3, dtype=jnp.bfloat16)


@pytest.mark.parametrize("name, fmt, parts", [
    ("tiny", "fp8", ((0, 64), (128, 32), (256, 80))),      # q_a | wk | kv_a, padded to 128-row blocks
    ("tiny", "bf16", ((0, 64), (64, 32), (96, 80))),       # no scale blocks: no padding
    ("tiny-glm5", "fp8", ((0, 64), (128, 80)))])           # shared indexers: wk stays in its own stack
def test_x_proj_holds_the_projections_rows(name, fmt, parts):
    m = _model(name, fmt)
    d = decode_weights(m)
    attn, fused = m.layers.self_attn, d.layers.self_attn.x_proj
    assert fused.parts == parts and attn.x_proj is None and attn.q_a_proj is not None   # the user's model untouched
    assert d.layers.self_attn.q_a_proj is None and d.layers.self_attn.kv_a_proj_with_mqa is None
    assert (d.indexers.wk is None) == (len(parts) == 3)
    assert decode_weights(d) is d
    srcs = [attn.q_a_proj] + ([m.indexers.wk] if len(parts) == 3 else []) + [attn.kv_a_proj_with_mqa]

    def dense(lin):
        return np.asarray(dequantize(lin.weight[...], lin.scale_or_none, jnp.float32))
    w = dense(fused)
    for (a, n), src in zip(parts, srcs):
        np.testing.assert_array_equal(w[:, a:a + n], dense(src))
    covered = np.zeros(w.shape[1], bool)
    for a, n in parts:
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
    """The GEMV kernel (interpret mode) over the merged stack gives each projection's rows bit for bit as
    the kernel over that projection's own stack, for a traced layer index. The model around it (the
    split, the indexer's key) is checked on the reference below, and the pallas path as a whole against
    transformers in test_golden_kernels and against the reference in test_pallas_gemv_wiring."""
    import jax
    from jtilert.pallas import gemv
    m = _model("tiny", fmt)
    attn, fused = m.layers.self_attn, decode_weights(m).layers.self_attn.x_proj
    srcs = [attn.q_a_proj, m.indexers.wk, attn.kv_a_proj_with_mqa]
    x = jax.random.normal(jax.random.key(7), (2, m.cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    layer = jnp.int32(1)
    run = jax.jit(lambda x, w, s, l: gemv.linear(x, w, s, layer=l))
    y = np.asarray(run(x, fused.weight[...], fused.scale_or_none, layer), np.float32)
    assert np.abs(y).max() > 0
    for (a, n), src in zip(fused.parts, srcs):
        want = np.asarray(run(x, src.weight[...], src.scale_or_none, layer), np.float32)
        np.testing.assert_array_equal(y[:, a:a + n], want)


# The merge and the model's split of x_proj do not depend on tp (the Engine merges before it shards
# the weights) nor on the activation dtype; the cases cover each kind of merge: three parts
# padded to scale blocks (tiny fp8), two parts (tiny-glm5's shared indexers), no scales (fp32, on a
# tp=2 mesh: the replicated merged weight under shard_map, at the fp32 tolerance).
@pytest.mark.parametrize("name, fmt, tp", [("tiny", "fp8", 1), ("tiny", "fp32", 2), ("tiny-glm5", "fp8", 1)])
def test_merged_reference_gives_the_same_logits(name, fmt, tp, monkeypatch):
    """backend="reference": XLA:CPU's fp32 GEMM sums a row's products in an order that depends on the
    weight's row count (measured: 2e-7 relative on one projection), so the merged product may differ in
    the last fp32 bit; with fp32 activations that stays at fp32 noise, with bf16 activations a flipped
    bf16 rounding can carry through the layers (bf16 noise)."""
    m = jtilert.random_model(name, fmt="fp32", seed=3) if fmt == "fp32" else _model(name, fmt)
    mesh = jtilert.make_mesh(tp) if tp > 1 else None
    merged, apart = _score(m, True, monkeypatch, mesh=mesh), _score(m, False, monkeypatch, mesh=mesh)
    scale = np.abs(apart).max()
    err = np.abs(merged - apart).max() / scale
    print(f"{fmt} tp={tp}: max |merged - apart| / max |logit| = {err:.2e}")
    assert err <= (1e-5 if fmt == "fp32" else 1e-2)


def test_merged_weight_is_replicated_under_tp():
    """q_a, wk and kv_a are replicated (every rank projects the whole x); so is their merge. (tiny's fp8
    block scales do not split over tp: bf16 weights.)"""
    import jax
    eng = generate.Engine(_model("tiny", "bf16"), mesh=jtilert.make_mesh(2))
    state = jax.tree_util.tree_unflatten(eng._treedef, eng.state)
    w = state["layers"]["self_attn"]["x_proj"]["weight"][...]
    assert w.shape[1] == 176 and w.sharding.is_fully_replicated and len(w.sharding.device_set) == 2
