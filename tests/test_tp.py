"""Tensor parallelism on 8 host devices: the same tokens and logits as one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtilert
from jtilert.parallel import sharding


def test_mesh_shape():
    mesh = jtilert.make_mesh(8)
    assert mesh.shape == {"tp": 8}
    with pytest.raises(ValueError, match="tp=9"):
        jtilert.make_mesh(9)


def test_weights_split_like_tilert(tiny_random):
    from flax import nnx
    specs = {".".join(map(str, sharding.path_names(p))): s for p, s in
             jax.tree_util.tree_leaves_with_path(sharding.param_specs(nnx.state(tiny_random)),
                                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))}
    # stacked: the layer axis first, never split
    assert specs["layers.self_attn.q_b_proj.weight"] == jax.P(None, "tp", None)
    assert specs["layers.self_attn.o_proj.weight"] == jax.P(None, None, "tp")
    assert specs["moe.experts.gate.weight"] == jax.P(None, None, "tp", None)
    assert specs["moe.experts.down.weight"] == jax.P(None, None, None, "tp")
    assert specs["dense.down_proj.weight"] == jax.P(None, None, "tp")
    assert specs["moe.shared_experts.gate_proj.weight"] == jax.P(None, "tp", None)
    assert specs["lm_head.weight"] == jax.P("tp", None)
    for replicated in ("layers.self_attn.q_a_proj.weight", "indexers.wq_b.weight", "moe.gate.weight",
                       "embed_tokens", "mtp.eh_proj.weight"):
        assert specs[replicated] == jax.P()
    # the per-layer names of checkpoints keep their own axes
    assert sharding.spec_for(("layers", "1", "mlp", "experts", "gate", "weight"), 3) == jax.P(None, "tp", None)
    # the decode model's kv_b per head [L, H, N, K] (`decode_weights`): by heads, which cuts no scale block
    for part in ("absorb_q", "absorb_o"):
        assert sharding.spec_for(("layers", "self_attn", part, "scale"), 4) == jax.P(None, "tp", None, None)
    sharding.check_split("layers.self_attn.absorb_q.weight", (62, 16, 512, 128), jnp.float8_e4m3fn, 8)
    with pytest.raises(ValueError, match="multiple of 128"):
        sharding.check_split("layers.self_attn.kv_b_proj.weight", (62, 2 * 256, 512), jnp.float8_e4m3fn, 8)


IDS = np.random.RandomState(2).randint(0, 256, 44)
# The decoding tests' Generators: 80 cache rows (60 + 4, and room for a chunk of 16 after any start:
# 60 + 4 + 15 rounded up to 16), the prompt in chunks of 16.
SETTINGS = dict(max_seq_len=60, prefill_chunk=16)


@pytest.fixture(scope="module")
def one(tiny_random):
    """The greedy tokens of one device, which every tensor-parallel variant must decode."""
    return jtilert.Generator(tiny_random, **SETTINGS).generate(IDS, 16, stop_tokens=[])


def test_tp2_logits_equal_single_device(tiny_random):
    np.testing.assert_allclose(jtilert.score(tiny_random, IDS, mesh=jtilert.make_mesh(2)),
                               jtilert.score(tiny_random, IDS), atol=2e-5, rtol=1e-5)


def test_tp8_greedy_and_mtp_equal_single_device(tiny_random, one):
    many = jtilert.Generator(tiny_random, **SETTINGS, mesh=jtilert.make_mesh(8), mtp=True)
    assert many.generate(IDS, 16, stop_tokens=[]) == one


def test_fp8_split_needs_aligned_blocks(tiny_fp8):
    with pytest.raises(ValueError, match="o_proj.*tp=2"):
        jtilert.Generator(tiny_fp8, max_seq_len=64, mesh=jtilert.make_mesh(2))


def test_engine_flag_falls_back_to_the_same_tokens(tiny_random, one):
    """With engine_all_reduce=True and no CUDA engine (CPU), the fused o_proj + all-reduce and the
    all-reduces fall back to XLA and decode the same tokens."""
    eng = jtilert.Generator(tiny_random, **SETTINGS, mesh=jtilert.make_mesh(8), engine_all_reduce=True)
    assert eng.generate(IDS, 8, stop_tokens=[]) == one[:8]   # greedy: the first 8 of 16


def test_head_candidates_merge_over_ranks_with_ties():
    """Each rank's top-k of its vocab slice, merged: the top-k of the whole row, ties to the lower id."""
    from jax.sharding import PartitionSpec as P
    from jtilert.ops import reference
    rng = np.random.RandomState(3)
    x = rng.randn(1, 64).astype(np.float32)
    w = rng.randn(8 * 16, 64).astype(np.float32)
    w[3] = w[5] = 3 * x[0]     # the two largest logits, tied, inside rank 0's slice
    w[7] = w[18] = 2 * x[0]    # the next two, tied across ranks 0 and 1
    mesh = jtilert.make_mesh(8)

    from jtilert.ops.table import Ops

    def merged(x, w):
        return Ops(axis=sharding.AXIS).top_candidates(*reference.lm_head_topk(x, w, 4), w.shape[0])
    vals, ids = jax.jit(jax.shard_map(merged, mesh=mesh, in_specs=(P(), P("tp", None)), out_specs=P(),
                                      check_vma=False))(x, w)
    want_vals, want_ids = reference.lm_head_topk(x, w, 4)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(vals, want_vals)
    assert list(np.asarray(ids[0, :4])) == [3, 5, 7, 18]


def test_split_indexer_decodes_the_same_tokens(tiny_random, one):
    """split_indexer=True: each of 2 (or 8) ranks scores its share of the cached positions and the
    top-k lists are merged (XLA fallback of the engine's merge here); the prompt is longer than
    index_topk, so the merged selection decides the attention. Of the 80 cache rows, the 52 positions
    span the shares of 2 ranks at tp=2 and of 6 at tp=8."""
    for tp in (2, 8):
        split = jtilert.Generator(tiny_random, **SETTINGS, mesh=jtilert.make_mesh(tp), split_indexer=True)
        assert split.engine.new_cache(split.rows)["index_k"].shape[1] == 80
        assert split.generate(IDS, 8, stop_tokens=[]) == one[:8]


def test_pallas_tp2_with_the_engine_all_reduce_equals_tp1():
    """backend="pallas" (GPU interpret mode here) at tp=2 with the engine's fused all-reduce (its XLA
    fallback on a CPU) decodes the tokens of tp=1, in bf16 where the kernels apply. The tp=1 tokens
    are the reference backend's: the tiny checkpoint's choices here lead the next logit by 2.9 or
    more, far beyond the kernels' bf16 error, so they are the pallas backend's at tp=1 as well (its
    logits against the reference: tests/test_pallas_gemv_wiring.py, tests/test_golden_kernels.py)."""
    import jax.numpy as jnp
    model = jtilert.load("tiny", dtype=jnp.bfloat16)
    prompt = np.arange(40) % 200 + 30
    one = jtilert.Generator(model, max_seq_len=64).generate(prompt, 3, stop_tokens=[])
    mesh = jtilert.make_mesh(2)
    two = jtilert.Generator(jtilert.load("tiny", dtype=jnp.bfloat16, mesh=mesh), max_seq_len=64, mesh=mesh,
                            backend="pallas", engine_all_reduce=True).generate(prompt, 3, stop_tokens=[])
    assert two == one
