"""The FFN's norm applied by the FFN's first kernels (`FFNNorm`): a MoE layer's router (FMA GEMV) norms x
as the reference rounds it and writes the normed x for the routed experts' kernels (op "norm_route");
the dense and the shared expert's gate/up GEMV norm x while their first weight tiles arrive (x · weight
into B, the sums times 1/rms, as `rmsnorm_linear` does). In GPU interpret mode on the CPU, at a traced
layer of the stacks, against the reference ops, on fresh seeded inputs; and the decode model's layout
of the norm (each FFN stack holds its layers' post-attention norm weights)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key, rel_err   # tests/interpreted.py (tests/ is on sys.path)

import jtilert
from jtilert.model.transformer import FFNNorm, decode_weights
from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.ops.table import OPS, DecodeConfig, Ops, _per_layer
from jtilert.pallas import interpret as interp
from jtilert.pallas import moe

F32, BF16 = jnp.float32, jnp.bfloat16
EPS = 1e-6


def _x(shape):
    return (3.0 * jax.random.normal(new_key(), shape, F32)).astype(BF16)


def _norm(layers, k):
    return (1 + 0.2 * jax.random.normal(new_key(), (layers, k), F32)).astype(BF16)


def _fp8(shape):
    return quantize_weight(jax.random.normal(new_key(), shape, F32) * shape[-1] ** -0.5)


def _both(name, args, layer):
    """(pallas, reference) of op `name` at a traced layer; the pallas side must run the kernel."""
    kernel = Ops(DecodeConfig(backend="pallas"))
    assert kernel._use_kernel(name, OPS[name], _per_layer(OPS[name], args)), name
    out = []
    with interp.interpret(detect_races=True):
        for ops in (kernel, Ops(DecodeConfig(backend="reference"))):
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="jtilert: backend='pallas'")
                out.append(jax.tree.map(lambda a: np.asarray(a, np.float32),
                                        jax.jit(lambda i: ops(name, *args, layer=i))(jnp.int32(layer))))
        assert not interp.races_found()
    return out


def _bf16_ulps(a, b):
    """|a - b| in units of b's bf16 spacing (a, b bf16 values as fp32)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a - b) / np.maximum(np.spacing(np.abs(b).astype(jnp.bfloat16)).astype(np.float32), 1e-30)


@pytest.mark.parametrize("tokens", [1, 2, 9])   # 9: two chunks of ≤ 8 tokens
def test_router_norms_x_as_the_reference_and_writes_it(tokens):
    """The router's kernel with the norm: the normed x it writes is the reference's rms_norm (its sum
    of squares in another order: a 1/rms one ulp apart may move a rounding by one bf16 ulp), and its
    fp32 logits are those of that normed x, far from the logits of x un-normed. K of several
    pipeline steps: the FMA engine's slots are refilled while the test's race detection watches."""
    e, k, layers, layer = 64, 512, 3, 1
    x, nw = _x((tokens, k)), _norm(layers, k)
    gate = jax.random.normal(new_key(), (layers, e, k), F32) * k ** -0.5
    with interp.interpret(detect_races=True):
        parts, f = jax.jit(lambda i: moe.norm_router_partials(x, nw, EPS, gate, layer=i))(jnp.int32(layer))
        assert not interp.races_found()
    want_f = reference.rms_norm(x, nw[layer], EPS)
    assert f.shape == want_f.shape and f.dtype == jnp.bfloat16
    ulps = _bf16_ulps(f, want_f)
    assert ulps.max() <= 1 and (ulps == 0).mean() > 0.99, (ulps.max(), (ulps == 0).mean())
    got = np.asarray(parts, np.float64).sum(0)
    want = reference.linear(f.astype(F32), gate[layer])
    assert rel_err(got, want) < 1e-5
    assert rel_err(reference.linear(x.astype(F32), gate[layer]), want) > 0.5


def test_norm_route_gives_the_reference_experts_and_normed_x():
    """The op "norm_route": the reference's normed x, experts and weights (the CUDA engine's
    selection is not loaded here: the layer's logits kernel, then XLA's selection)."""
    cfg = jtilert.random_model("tiny", fmt="fp8", seed=3).cfg
    e, k, layers, layer = cfg.n_routed_experts, cfg.hidden_size, 2, 1
    x, nw = _x((1, k)), _norm(layers, k)
    gate = jax.random.normal(new_key(), (layers, e, k), F32) * k ** -0.5
    bias = 0.01 * jax.random.normal(new_key(), (layers, e), F32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="jtilert: the CUDA engine")
        (f_got, w_got, ids_got), (f_ref, w_ref, ids_ref) = _both("norm_route", (cfg, x, nw, EPS, gate, bias), layer)
    # the reference op eager (rounded as written; jitted, XLA may drop the norm's bf16 roundings)
    f_eager = reference.rms_norm(x, nw[layer], EPS)
    w_eager, ids_eager = reference.route(cfg, f_eager, gate[layer], bias[layer])
    assert _bf16_ulps(f_got, f_eager).max() <= 1
    assert _bf16_ulps(f_ref, f_eager).max() <= 1
    np.testing.assert_array_equal(ids_got, np.asarray(ids_eager))
    np.testing.assert_array_equal(ids_got, ids_ref)
    np.testing.assert_allclose(w_got, np.asarray(w_eager), rtol=1e-5)
    np.testing.assert_allclose(w_got, w_ref, rtol=2e-3)


@pytest.mark.parametrize("tokens", [1, 2])
def test_swiglu_hidden_norms_x_in_the_kernel(tokens):
    """The dense and the shared expert's gate and up with the norm: within bf16 rounding of the reference op,
    which is swiglu_hidden(rms_norm(x)) bit for bit."""
    n, k, layers, layer = 128, 512, 3, 2
    (g, gs), (u, us) = _fp8((layers, n, k)), _fp8((layers, n, k))
    x, nw = _x((tokens, k)), _norm(layers, k)
    got, ref = _both("swiglu_hidden", (x, g, gs, u, us, nw, EPS), layer)
    composed = jax.jit(lambda i: reference.swiglu_hidden(reference.rms_norm(x, nw[i], EPS), g[i], gs[i], u[i],
                                                         us[i]))(jnp.int32(layer))
    np.testing.assert_array_equal(ref, np.asarray(composed, np.float32))
    assert rel_err(got, ref) < 1e-2


def test_moe_takes_a_norm_only_with_the_routers_normed_input():
    """Ops.moe: the routed experts have no norm of their own, so a norm without the normed x the
    router wrote (or that x without a norm) is refused."""
    ops = Ops(DecodeConfig(backend="reference"))
    x = _x((1, 64))
    with pytest.raises(ValueError, match="normed input"):
        ops.moe(x, None, None, (None,) * 6, (None,) * 6, norm=(_norm(1, 64)[0], EPS))
    with pytest.raises(ValueError, match="normed input"):
        ops.moe(x, None, None, (None,) * 6, (None,) * 6, x_normed=x)


def test_the_decode_model_holds_each_ffn_stacks_norm():
    """decode_weights moves the post-attention norm into the FFN stacks, entry for entry (the MTP
    layer's in the MoE stack's last), and the step no longer takes it from the layer stack."""
    m = jtilert.random_model("tiny", fmt="fp8", seed=5, dtype=BF16)
    d = decode_weights(m)
    w = np.asarray(m.layers.post_attention_layernorm.weight[...], np.float32)
    lay = m.layout
    assert d.layers.post_attention_layernorm is None
    for stack, rows in ((d.dense, w[:lay.num_dense]), (d.moe, w[lay.num_dense:])):
        assert isinstance(stack.norm, FFNNorm) and stack.norm.eps == m.layers.post_attention_layernorm.eps
        np.testing.assert_array_equal(np.asarray(stack.norm.weight[...], np.float32), rows)
    assert decode_weights(d) is d   # idempotent
    assert m.moe.norm is None and m.layers.post_attention_layernorm is not None   # the model is untouched
