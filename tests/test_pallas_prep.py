"""The attention prep kernel (`jtilert.pallas.mla_prep`: q_pe / k_pe rope, the latent's RMSNorm and
both cache writes, in place) against `jtilert.ops.reference.mla_prep`, in GPU interpret mode on the
CPU.

Each case draws fresh random inputs, cross-lowers the kernel for CUDA (Mosaic lowering errors without
a GPU), then runs it under the interpreter with race detection. The layer's rows must equal the
(jitted) reference's bit for bit (rope is elementwise fp32 and the permutations are exact; the norm's sum and
rsqrt are the same XLA:CPU ops here), every other row of the stacks must be unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key, run_one_kernel   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.model.presets import preset
from jtilert.ops import reference
from jtilert.pallas import interpret as interp
from jtilert.pallas import mla_prep as mp

BF16 = jnp.bfloat16
NL, S = 3, 48   # layers in the stacks, cache rows


def _bits(x):
    return np.asarray(x).view(np.uint16)


def _case(name, tokens, start, layer, index_cols=256):
    """The merged projections' outputs of preset `name` (q_x: the heads' q then the indexer's query
    columns; kv_x: q_a, the indexer's key, kv_a), its kv_a norm stack and caches."""
    cfg = preset(name)
    h, qk, r, lat = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    kv_col = cfg.q_lora_rank + cfg.index_head_dim
    k = jax.random.split(new_key(), 6)
    q_x = jax.random.normal(k[0], (tokens, h * qk + index_cols), BF16)
    kv_x = (jax.random.normal(k[1], (tokens, kv_col + lat + r)) * 3).astype(BF16)
    norm = (1 + 0.1 * jax.random.normal(k[2], (NL, lat))).astype(BF16)
    cos, sin = reference.rope_cos_sin(cfg, start + jnp.arange(tokens, dtype=jnp.int32))
    kv = jax.random.normal(k[3], (NL, S, lat), BF16)
    pe = jax.random.normal(k[4], (NL, S, r), BF16)
    return cfg, (q_x, kv_x, norm, cos, sin, kv, pe, jnp.int32(start), jnp.int32(layer)), kv_col


@pytest.mark.parametrize("name,tokens,start,layer", [
    ("dsv32-tp8-shard", 1, 17, 1),    # 16 heads of 192 (nope 128): one tile of 17 rope rows
    ("dsv32-tp8-shard", 2, 46, 2),    # MTP verify's two tokens at the cache's last rows
    ("glm5-tp8-shard", 1, 0, 0),      # 8 heads of 256 (nope 192), the first row
    ("glm5-tp8-shard", 2, 30, 1),
    ("deepseek-v3.2", 2, 5, 1),       # 128 heads (tp = 1): five tiles
])
def test_mla_prep_matches_reference(name, tokens, start, layer):
    cfg, args, kv_col = _case(name, tokens, start, layer)
    h, qk = cfg.num_attention_heads, cfg.qk_head_dim

    def f(q_x, kv_x, norm, cos, sin, kv, pe, start, layer):
        return mp.mla_prep(q_x, kv_x, kv_col, h, qk, norm, 1e-6, cos, sin, kv, pe, start, layer=layer)

    q_pe, kv, pe = run_one_kernel(f, *args)

    # jitted, as the model runs it: XLA:CPU may contract the rope's products into FMAs, eagerly it does
    # not (a bf16 value near a rounding midpoint then rounds the other way); the interpreter is jitted too
    def ref(q_x, kv_x, norm, cos, sin, kv, pe, start, layer):
        return reference.mla_prep(q_x, kv_x, kv_col, h, qk, norm, 1e-6, cos, sin, kv, pe, start, layer=layer)

    want = jax.tree.map(np.asarray, jax.jit(ref)(*args))
    assert q_pe.shape == want[0].shape == (tokens, h, cfg.qk_rope_head_dim) and q_pe.dtype == BF16
    np.testing.assert_array_equal(_bits(q_pe), _bits(want[0]))
    np.testing.assert_array_equal(_bits(kv), _bits(want[1]))
    np.testing.assert_array_equal(_bits(pe), _bits(want[2]))
    # the new rows are written, everything else of the stacks is the input's
    for new, old in ((kv, args[5]), (pe, args[6])):
        old = np.asarray(old)
        changed = np.any(_bits(new) != _bits(old), axis=-1)
        assert changed[layer, start:start + tokens].all()
        changed[layer, start:start + tokens] = False
        assert not changed.any()


def test_mla_prep_refuses_what_it_does_not_fit_and_the_op_table_runs_the_reference():
    """The fp8 packed cache, rope rows shorter than a 128-byte TMA row (the tiny models) and prefill
    chunks are refused by name; the op table then warns and runs the reference on the stacks."""
    from jtilert.ops import table
    cfg, args, kv_col = _case("dsv32-tp8-shard", 1, 3, 1)
    q_x, kv_x, norm, cos, sin, kv, pe, start, layer = args
    h, qk = cfg.num_attention_heads, cfg.qk_head_dim
    with pytest.raises(ValueError, match="mla_prep kernel: the fp8 packed latent cache"):
        mp.mla_prep(q_x, kv_x, kv_col, h, qk, norm, 1e-6, cos, sin, kv, None, start, layer=layer)
    assert "rope dim 16" in mp.unsupported(1, 8, 32, 16, 64, 640, 208, kv, pe)
    assert "6 tokens" in mp.unsupported(6, h, qk, 64, 512, q_x.shape[1], kv_x.shape[1], kv, pe)
    fp8 = reference.quantize_kv_fp8(jnp.zeros((NL, S, 512)), jnp.zeros((NL, S, 64)))
    ops = table.Ops(table.DecodeConfig(backend="pallas", engine_topk=False))
    with pytest.warns(UserWarning, match="mla_prep kernel does not apply .*fp8 packed latent cache"):
        q_pe, kv8, none = ops("mla_prep", q_x, kv_x, kv_col, h, qk, norm, 1e-6, cos, sin, fp8, None, start,
                              layer=layer)
    want = reference.mla_prep(q_x, kv_x, kv_col, h, qk, norm, 1e-6, cos, sin, fp8, None, start, layer=layer)
    assert none is None and want[2] is None
    np.testing.assert_array_equal(np.asarray(kv8), np.asarray(want[1]))
    np.testing.assert_array_equal(_bits(q_pe), _bits(want[0]))


def test_mla_prep_takes_whole_stacks():
    """One Mosaic kernel that takes the whole caches (aliased: no copy, no slice in XLA)."""
    cfg, args, kv_col = _case("dsv32-tp8-shard", 1, 3, 2)
    h, qk = cfg.num_attention_heads, cfg.qk_head_dim

    def f(q_x, kv_x, norm, cos, sin, kv, pe, start, layer):
        return mp.mla_prep(q_x, kv_x, kv_col, h, qk, norm, 1e-6, cos, sin, kv, pe, start, layer=layer)

    with interp.compile_for_gpu():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in txt.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and f"tensor<{NL}x{S}x512xbf16>" in calls[0] and f"tensor<{NL}x{S}x64xbf16>" in calls[0]
    assert not [line for line in txt.splitlines() if f"tensor<{NL}x{S}x" in line and any(
        op in line for op in ("stablehlo.dynamic_slice", "stablehlo.slice", "stablehlo.dynamic_update_slice",
                              "stablehlo.concatenate", "stablehlo.pad"))]
