"""Attention kernels (issue 5) against the plain-JAX references, in GPU interpret mode on the CPU.

Every case draws fresh random inputs, runs the Mosaic-GPU kernel under the interpreter with race
detection (its buffers start as NaN, so an unwritten output element fails the comparison), and
also cross-lowers the kernel for CUDA, which catches Mosaic lowering errors without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key, lowered_and_interpreted, rel_err   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.ops import reference
from jtilert.pallas import interpret as interp
from jtilert.pallas import sparse_mla as smla

BF16 = jnp.bfloat16


# ---- sparse MLA ------------------------------------------------------------------------------

@pytest.mark.parametrize("T,H,L,R,S,K,frac_valid", [
    (1, 16, 512, 64, 600, 128, 0.8),     # dsv32-tp8-shard widths, some rows masked
    (2, 8, 64, 16, 100, 32, 1.0),        # tiny widths (padded rope), K < block_k, MTP-verify T=2
    (1, 1, 64, 16, 40, 32, 0.5),         # one head per GPU (tiny at tp=8)
])
def test_sparse_mla(T, H, L, R, S, K, frac_valid):
    keys = jax.random.split(new_key(), 6)
    ql = jax.random.normal(keys[0], (T, H, L), BF16)
    qp = jax.random.normal(keys[1], (T, H, R), BF16)
    kv = jax.random.normal(keys[2], (S, L), BF16)
    pe = jax.random.normal(keys[3], (S, R), BF16)
    idx = jnp.stack([jax.random.permutation(jax.random.fold_in(keys[4], t), S)[:K]
                     for t in range(T)]).astype(jnp.int32)
    valid = jax.random.uniform(keys[5], (T, K)) < frac_valid
    idx = jnp.where(valid.at[:, 0].set(True), idx, -1)   # masked rows: -1 (the top-k's convention)
    f = functools.partial(smla.sparse_mla, scale=0.1)
    out = lowered_and_interpreted(f, ql, qp, kv, pe, idx)
    ref = reference.sparse_mla(ql, qp, kv, pe, idx, 0.1)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.isfinite(out).all()
    assert rel_err(out, ref) < 4e-3   # P is rounded to bf16 before P·V (as FlashMLA does)


def test_sparse_mla_negative_indices_mask():
    """idx < 0 masks the row (the top-k's convention): the same output as attention over the
    unmasked rows alone."""
    keys = jax.random.split(new_key(), 5)
    T, H, L, R, S, K = 1, 16, 128, 64, 200, 64
    ql = jax.random.normal(keys[0], (T, H, L), BF16)
    qp = jax.random.normal(keys[1], (T, H, R), BF16)
    kv = jax.random.normal(keys[2], (S, L), BF16)
    pe = jax.random.normal(keys[3], (S, R), BF16)
    idx = jax.random.permutation(keys[4], S)[:K].astype(jnp.int32)[None]
    valid = jnp.arange(K)[None] < 37
    f = functools.partial(smla.sparse_mla, scale=0.2)
    out = lowered_and_interpreted(lambda *a: f(*a), ql, qp, kv, pe, jnp.where(valid, idx, -1))
    ref = reference.sparse_mla(ql, qp, kv, pe, idx[:, :37], 0.2)
    assert rel_err(out, ref) < 4e-3


# ---- indexer scoring -------------------------------------------------------------------------

from jtilert.pallas import indexer as ix  # noqa: E402
from jtilert.ops.quant import act_quant  # noqa: E402

SMALL = ix.IndexerConfig(num_ctas=3, stages=2)   # several blocks per CTA, slot reuse


def _index_inputs(T, H, D, S, fp8, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (T, H, D))
    w = jax.random.normal(keys[1], (T, H)) * (H ** -0.5 * D ** -0.5)
    k = jax.random.normal(keys[2], (S, D))
    if fp8:
        q8, qs = act_quant(q)
        k8, ks = act_quant(k)
        return q8, w * qs[..., 0], k8, ks[:, 0]
    return q.astype(BF16), w, k.astype(BF16), None


@pytest.mark.parametrize("T,H,S,pos,start,end,fp8", [
    (1, 64, 1024, [700], 0, None, True),        # dsv32 index heads, context < cache, fp8 + scales
    (1, 64, 768, [767], 0, None, True),         # context == cache, several blocks per CTA
    (2, 64, 512, [40, 41], 0, None, False),     # MTP verify step, bf16 keys ("none" mode), 1 block valid
    (1, 32, 1024, [900], 256, 768, True),       # a range that starts mid-cache (one GPU's share)
    (1, 64, 1024, [100], 256, 768, True),       # range entirely past the context: all -inf
    (1, 8, 320, [319], 0, None, False),         # tiny widths: 8 heads (padded), a partial last block
    (1, 64, 192, [100], 64, 192, True),         # a range ending in a partial block, at the cache's end
    (1, 64, 256, [250], 64, 128, True),         # a range shorter than one block
    (1, 32, 64, [40], 0, None, True),           # a cache shorter than one block (TMA zero fill)
])
def test_indexer_scores(T, H, S, pos, start, end, fp8):
    D = 128 if H != 8 else 32
    q, w, k, ks = _index_inputs(T, H, D, S, fp8, np.random.randint(1 << 30))
    pos = jnp.array(pos, jnp.int32)
    f = functools.partial(ix.indexer_scores, start=start, rows=None if end is None else end - start, config=SMALL)
    out = lowered_and_interpreted(f, q, w, k, ks, pos)
    ref = np.asarray(reference.indexer_scores(q, w, k, ks, pos))[:, start:end]
    assert out.shape == ref.shape
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), fin)
    np.testing.assert_array_equal(out[~fin], ref[~fin])      # -inf exactly where the reference has it
    if fin.any():
        assert np.abs(out[fin] - ref[fin]).max() <= 1e-5 * np.abs(ref[fin]).max()


def test_indexer_traced_start_and_offset():
    """start / pos_offset as traced scalars (a cache sharded by position across GPUs)."""
    q, w, k, ks = _index_inputs(1, 64, 128, 512, True, np.random.randint(1 << 30))
    pos = jnp.array([1000], jnp.int32)

    def f(q, w, k, ks, pos, start, off):
        return ix.indexer_scores(q, w, k, ks, pos, start=start, rows=256, pos_offset=off, config=SMALL)

    out = lowered_and_interpreted(f, q, w, k, ks, pos, jnp.int32(128), jnp.int32(700))
    # rows 128..383 of this shard hold global positions 828..1083: rows past 1000 are -inf
    full = np.asarray(reference.indexer_scores(q, w, k, ks, pos - 700))[:, 128:384]
    fin = np.isfinite(full)
    np.testing.assert_array_equal(np.isfinite(out), fin)
    assert np.abs(out[fin] - full[fin]).max() <= 1e-5 * np.abs(full[fin]).max()


# ---- key append inside the indexer kernel ----------------------------------------------------

def _append_case(T, H, D, S, fp8, seed):
    from jtilert.model.presets import preset
    cfg = preset("tiny").replace(index_quant="fp8" if fp8 else "none", index_head_dim=D, index_n_heads=H)
    q, w, kc, ks = _index_inputs(T, H, D, S, fp8, seed)
    # the new keys as index_prep hands them over: already rotated (fp32) in fp8 mode, else bf16
    k = jax.random.normal(jax.random.key(seed + 1), (T, D)) * 3
    return cfg, q, w, k if fp8 else k.astype(BF16), kc, ks


@pytest.mark.parametrize("T,H,S,pos,start,end,fp8", [
    (1, 64, 512, [300], 0, None, True),         # dsv32 widths, new row mid-cache, fp8 + scales
    (1, 64, 768, [767], 0, None, True),         # the last cache row, several blocks per CTA
    (2, 64, 512, [127, 128], 0, None, False),   # MTP verify: two rows in two blocks (two CTAs), bf16
    (2, 64, 512, [200, 201], 0, None, True),    # MTP verify, fp8: both rows (and scales) in one block
    (1, 64, 1024, [600], 256, 768, True),       # a range starting mid-cache that holds the new row
    (1, 64, 1024, [900], 256, 768, True),       # the new row is another GPU's: nothing written here
    (1, 64, 64, [63], 0, None, True),           # a cache shorter than one block (TMA zero fill)
    (1, 8, 256, [40], 0, None, False),          # 8 heads (padded); the rows of 64 bytes are
])                                              # appended by XLA (too short for one TMA)
def test_indexer_append_scores(T, H, S, pos, start, end, fp8):
    """The kernel appends the new keys (fp8 quantised bit for bit as jtilert.ops.quant, or bf16) at
    their rows of the range, in place, and scores them from the fresh keys as the reference does."""
    D = 128 if H != 8 else 32
    cfg, q, w, k, kc, ks = _append_case(T, H, D, S, fp8, np.random.randint(1 << 30))
    pos = jnp.array(pos, jnp.int32)

    def f(q, w, k, kc, ks, pos):
        if H == 8:
            return ix.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0])
        return ix.append_and_score(q, w, k, kc, ks, pos, start=start, rows=None if end is None else end - start,
                                   config=SMALL)

    scores, kc_out, ks_out = lowered_and_interpreted(f, q, w, k, kc, ks, pos)
    ref, rkc, rks = reference.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0])
    lo, hi = start, end or S
    in_range = [(lo <= int(p) < hi) for p in pos]
    want_kc = np.asarray(rkc if all(in_range) else kc)    # rows outside the range are left alone
    np.testing.assert_array_equal(kc_out.view(np.uint8), want_kc.view(np.uint8))
    if fp8:
        np.testing.assert_array_equal(ks_out, np.asarray(rks if all(in_range) else ks))
    ref = np.asarray(ref)[:, lo:hi]
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(scores), fin)
    if all(in_range):
        assert np.abs(scores[fin] - ref[fin]).max() <= 1e-5 * np.abs(ref[fin]).max()


def test_indexer_append_scores_one_gpus_share():
    """The model's op with the indexer split over GPUs (first_row traced, num_rows static): the
    kernel scores that share of the rows, the whole cache gets the new key, as in the reference."""
    cfg, q, w, k, kc, ks = _append_case(1, 64, 128, 1024, True, np.random.randint(1 << 30))
    pos = jnp.array([600], jnp.int32)

    def f(q, w, k, kc, ks, pos, first):
        return ix.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0], first_row=first, num_rows=256)

    scores, kc_out, ks_out = lowered_and_interpreted(f, q, w, k, kc, ks, pos, jnp.int32(512))
    ref, rkc, rks = reference.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0], first_row=512, num_rows=256)
    np.testing.assert_array_equal(kc_out.view(np.uint8), np.asarray(rkc).view(np.uint8))
    np.testing.assert_array_equal(ks_out, np.asarray(rks))
    ref = np.asarray(ref)
    assert scores.shape == ref.shape == (1, 256)
    fin = np.isfinite(ref)
    assert 0 < fin.sum() < 256   # the share holds the context's end: finite rows, then -inf
    np.testing.assert_array_equal(np.isfinite(scores), fin)
    assert np.abs(scores[fin] - ref[fin]).max() <= 1e-5 * np.abs(ref[fin]).max()


def test_indexer_append_under_shard_map():
    """Interpreted kernels inside shard_map (the tp > 1 decode step) run one device at a time."""
    cfg, q, w, k, kc, ks = _append_case(1, 64, 128, 256, True, np.random.randint(1 << 30))
    pos = jnp.array([100], jnp.int32)
    mesh = jax.make_mesh((2,), ("tp",))
    P = jax.sharding.PartitionSpec

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(), out_specs=P())
    def f(q, w, k, kc, ks, pos):
        return ix.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0])

    with interp.interpret():
        out = jax.tree.map(np.asarray, f(q, w, k, kc, ks, pos))
    ref = reference.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0])
    np.testing.assert_array_equal(out[1].view(np.uint8), np.asarray(ref[1]).view(np.uint8))
    np.testing.assert_array_equal(out[2], np.asarray(ref[2]))
    fin = np.isfinite(np.asarray(ref[0]))
    assert np.abs(out[0][fin] - np.asarray(ref[0])[fin]).max() <= 1e-5 * np.abs(np.asarray(ref[0])[fin]).max()


# ---- layer-stacked caches: the layer is addressed inside the kernel ---------------------------

NL = 3   # layers in a stack


def _stacked_case(T, S, fp8, seed):
    """A model op's inputs with key caches stacked over NL layers, each layer's rows different."""
    cfg, q, w, k, kc, ks = _append_case(T, 64, 128, NL * S, fp8, seed)
    return cfg, q, w, k, kc.reshape(NL, S, 128), None if ks is None else ks.reshape(NL, S)


@pytest.mark.parametrize("S,layer,pos,fp8,share", [
    (192, 2, [150], True, None),          # the new row in the partial last block (TMA zero fill, clipped stores)
    (192, 0, [191], False, None),         # bf16 keys, the cache's last row
    (256, 2, [200, 201], True, None),     # a whole number of blocks, MTP verify's two tokens
    (320, 2, [300], True, (256, 64)),     # one GPU's share (traced first row), shorter than a block
])
def test_indexer_append_scores_stacked(S, layer, pos, fp8, share):
    """The model's op on a layer stack with a traced layer index: the layer's rows equal the
    reference's on that layer alone (key and scale bit for bit, scores), the other layers are
    returned untouched."""
    cfg, q, w, k, kc, ks = _stacked_case(len(pos), S, fp8, np.random.randint(1 << 30))
    pos = jnp.array(pos, jnp.int32)
    first, num = share or (None, None)

    def f(q, w, k, kc, ks, pos, layer, first):
        return ix.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0], first_row=first, num_rows=num,
                                        layer=layer)

    scores, kc_out, ks_out = lowered_and_interpreted(jax.jit(f), q, w, k, kc, ks, pos, jnp.int32(layer),
                                                     jnp.int32(first or 0))
    ref, rkc, rks = reference.indexer_append_scores(cfg, q, w, k, kc[layer], None if ks is None else ks[layer],
                                                 pos, pos[0], first_row=first, num_rows=num)
    np.testing.assert_array_equal(kc_out[layer].view(np.uint8), np.asarray(rkc).view(np.uint8))
    others = [i for i in range(NL) if i != layer]
    np.testing.assert_array_equal(kc_out[others].view(np.uint8), np.asarray(kc)[others].view(np.uint8))
    if fp8:
        np.testing.assert_array_equal(ks_out[layer], np.asarray(rks))
        np.testing.assert_array_equal(ks_out[others], np.asarray(ks)[others])
    ref = np.asarray(ref)
    assert scores.shape == ref.shape
    fin = np.isfinite(ref)
    assert fin.any()
    np.testing.assert_array_equal(np.isfinite(scores), fin)
    assert np.abs(scores[fin] - ref[fin]).max() <= 1e-5 * np.abs(ref[fin]).max()


def test_indexer_traced_offsets_are_operands_of_their_own():
    """Traced start, pos_offset and layer reach the kernel each as an int32 [1] operand (a scalar's
    reshape: a bitcast in XLA); nothing packs them into one array, which XLA would compute in a kernel
    of its own per layer and step."""
    cfg, q, w, k, kc, ks = _stacked_case(2, 256, True, np.random.randint(1 << 30))
    pos = jnp.array([200, 201], jnp.int32)

    def f(q, w, kc, ks, pos, start, off, layer):
        return ix.indexer_scores(q, w, kc, ks, pos, start=start, rows=128, pos_offset=off, layer=layer)

    with interp.compile_for_gpu():
        txt = jax.jit(f).trace(q, w, kc, ks, pos, jnp.int32(64), jnp.int32(0), jnp.int32(1)).lower(
            lowering_platforms=("cuda",)).as_text()
    lines = txt.splitlines()
    calls = [line for line in lines if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1
    assert calls[0].rsplit(" : (", 1)[-1].split(") ->")[0].count("tensor<1xi32>") == 3, calls[0][-300:]
    glue = [line.strip() for line in lines if "stablehlo." in line and "custom_call" not in line]
    assert all(line.split(" = ")[-1].startswith("stablehlo.reshape") for line in glue), glue


def test_indexer_refuses_prefill_chunks_and_the_op_table_runs_the_reference():
    """More tokens than the kernel takes: the kernel raises, naming them; the op table warns and runs
    the reference on the layer (the same scores, the key appended in place in the stack)."""
    from jtilert.ops import table
    S, layer = 128, 1
    cfg, q, w, k, kc, ks = _stacked_case(6, S, True, np.random.randint(1 << 30))
    pos = jnp.arange(40, 46, dtype=jnp.int32)
    with pytest.raises(ValueError, match="indexer kernel: 6 tokens"):
        ix.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0], layer=jnp.int32(layer))
    ops = table.Ops(table.DecodeConfig(backend="pallas", engine_topk=False))
    with pytest.warns(UserWarning, match="indexer_append_scores kernel does not apply .*6 tokens"):
        idx, kc_out, ks_out = jax.jit(lambda *a: ops.indexer_topk(cfg, *a, pos[0], jnp.int32(layer)))(
            q, w, k, kc, ks, pos)
    scores, rkc, rks = reference.indexer_append_scores(cfg, q, w, k, kc[layer], ks[layer], pos, pos[0])
    ridx = reference.topk_positions(scores, cfg.index_topk)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ridx))
    np.testing.assert_array_equal(np.asarray(kc_out[layer]).view(np.uint8), np.asarray(rkc).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(ks_out[layer]), np.asarray(rks))
    np.testing.assert_array_equal(np.asarray(kc_out[0]).view(np.uint8), np.asarray(kc[0]).view(np.uint8))


def _cache_copies(f, args, stack_prefix):
    """Cross-lower f for CUDA; → the StableHLO lines outside the Mosaic custom calls that slice, pad,
    concatenate or gather an array whose type starts with `stack_prefix` (e.g. "3x320x": a stacked
    cache), and the number of Mosaic custom calls that take such an array."""
    with interp.compile_for_gpu():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    copies, kernels = [], 0
    for line in txt.splitlines():
        if "custom_call @mosaic_gpu" in line:
            kernels += f"tensor<{stack_prefix}" in line.rsplit(" : (", 1)[-1]
        elif (any(op in line for op in ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.pad",
                                        "stablehlo.concatenate", "stablehlo.gather"))
              and f"tensor<{stack_prefix}" in line):
            copies.append(line.strip()[:200])
    return copies, kernels


@pytest.mark.parametrize("fp8,S", [(True, 320), (False, 192), (True, 256)])
def test_indexer_stacked_lowering_has_no_cache_copies(fp8, S):
    """The decode op on a layer stack lowers to one Mosaic kernel that takes the whole stacks (no
    dynamic_slice / pad / concatenate of a cache in XLA, whatever S), also for one GPU's share."""
    cfg, q, w, k, kc, ks = _stacked_case(1, S, fp8, np.random.randint(1 << 30))
    pos = jnp.array([S - 30], jnp.int32)
    for share in (None, (S // 2, S // 2)):
        first, num = share or (None, None)

        def f(q, w, k, kc, ks, pos, layer, first):
            return ix.indexer_append_scores(cfg, q, w, k, kc, ks, pos, pos[0], first_row=first, num_rows=num,
                                            layer=layer)

        copies, kernels = _cache_copies(f, (q, w, k, kc, ks, pos, jnp.int32(2), jnp.int32(first or 0)),
                                        f"{NL}x{S}x")
        assert not copies, copies
        assert kernels == 1
