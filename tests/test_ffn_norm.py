"""The FFN's norm applied by its ops' kernels (`FFNNorm`): the router's FMA GEMV, the shared and dense
experts' gate/up GEMV and the routed experts' gate/up (expert mode) norm x themselves while their first
weight tiles arrive (x · weight into B, the sums times 1/rms, as `rmsnorm_linear` does). In GPU
interpret mode on the CPU, at a traced layer of the stacks, against the reference ops (which are the
composition rms_norm → op bit for bit), on fresh seeded inputs; and the decode model's layout of the
norm (each FFN stack holds its layers' post-attention norm weights)."""

from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtilert
from jtilert.model.transformer import FFNNorm, decode_weights
from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.ops.table import OPS, DecodeConfig, Ops, _per_layer
from jtilert.pallas import interpret as interp
from jtilert.pallas import moe

F32, BF16 = jnp.float32, jnp.bfloat16
EPS = 1e-6
_seed = itertools.count(9100)


def _key():
    return jax.random.key(next(_seed))


def _x(shape):
    return (3.0 * jax.random.normal(_key(), shape, F32)).astype(BF16)


def _norm(layers, k):
    return (1 + 0.2 * jax.random.normal(_key(), (layers, k), F32)).astype(BF16)


def _fp8(shape):
    return quantize_weight(jax.random.normal(_key(), shape, F32) * shape[-1] ** -0.5)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert not np.isnan(a).any()
    return np.linalg.norm(a - b) / np.linalg.norm(b)


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


@pytest.mark.parametrize("tokens", [1, 2])
def test_router_logits_of_the_normed_input(tokens):
    """The router's fp32 logits from x normed in the kernel: within the norm's bf16 rounding of the
    reference's fp32 product of rms_norm(x) (the kernel applies 1/rms to the sums), and far from the
    logits of x un-normed. K of several pipeline steps: the FMA engine's slots are refilled while
    the test's race detection watches."""
    e, k, layers, layer = 64, 512, 3, 1
    x, nw = _x((tokens, k)), _norm(layers, k)
    gate = jax.random.normal(_key(), (layers, e, k), F32) * k ** -0.5
    with interp.interpret(detect_races=True):
        parts = jax.jit(lambda i: moe.router_partials(x, gate, nw, EPS, layer=i))(jnp.int32(layer))
        assert not interp.races_found()
    got = np.asarray(parts, np.float64).sum(0)
    want = reference.linear(reference.rms_norm(x, nw[layer], EPS).astype(F32), gate[layer])
    assert _rel(got, want) < 3e-3
    assert _rel(reference.linear(x.astype(F32), gate[layer]), want) > 0.5


def test_route_selects_the_reference_experts_from_the_un_normed_input():
    """The op "route" with the norm's arguments: the reference's experts and weights (the CUDA
    engine's selection is not loaded here: the layer's logits kernel, then XLA's selection)."""
    cfg = jtilert.random_model("tiny", fmt="fp8", seed=3).cfg
    e, k, layers, layer = cfg.n_routed_experts, cfg.hidden_size, 2, 1
    x, nw = _x((1, k)), _norm(layers, k)
    gate = jax.random.normal(_key(), (layers, e, k), F32) * k ** -0.5
    bias = 0.01 * jax.random.normal(_key(), (layers, e), F32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="jtilert: the CUDA engine")
        (w_got, ids_got), (w_ref, ids_ref) = _both("route", (cfg, x, gate, bias, nw, EPS), layer)
    # the reference op jitted (XLA drops the norm's bf16 roundings: its excess-precision
    # simplification) and eager (rounded): the same experts, weights within the norm's rounding
    w_eager, ids_eager = reference.route(cfg, reference.rms_norm(x, nw[layer], EPS), gate[layer], bias[layer])
    np.testing.assert_array_equal(ids_got, ids_ref)
    np.testing.assert_array_equal(ids_got, np.asarray(ids_eager))
    np.testing.assert_allclose(w_got, np.asarray(w_eager), rtol=2e-3)
    np.testing.assert_allclose(w_got, w_ref, rtol=2e-3)


@pytest.mark.parametrize("tokens", [1, 2])
def test_swiglu_hidden_norms_x_in_the_kernel(tokens):
    """The dense / shared experts' gate and up with the norm: within bf16 rounding of the reference op,
    which is swiglu_hidden(rms_norm(x)) bit for bit."""
    n, k, layers, layer = 128, 512, 3, 2
    (g, gs), (u, us) = _fp8((layers, n, k)), _fp8((layers, n, k))
    x, nw = _x((tokens, k)), _norm(layers, k)
    got, ref = _both("swiglu_hidden", (x, g, gs, u, us, nw, EPS), layer)
    composed = jax.jit(lambda i: reference.swiglu_hidden(reference.rms_norm(x, nw[i], EPS), g[i], gs[i], u[i],
                                                         us[i]))(jnp.int32(layer))
    np.testing.assert_array_equal(ref, np.asarray(composed, np.float32))
    assert _rel(got, ref) < 1e-2


@pytest.mark.parametrize("tokens", [1, 2])
def test_moe_experts_norm_x_in_the_expert_mode_kernel(tokens):
    """The routed experts' gate/up in expert mode norm their selection's token row (each CTA its own
    token's rms): within bf16 / fp8 rounding of the reference op with the norm and the residual,
    which is residual + moe_experts(rms_norm(x)) bit for bit."""
    e, width, hidden, kper, layers, layer = 6, 128, 256, 3, 3, 1
    (g, gs), (u, us), (d, ds) = (_fp8((layers, e, width, hidden)), _fp8((layers, e, width, hidden)),
                                 _fp8((layers, e, hidden, width)))
    x, nw = _x((tokens, hidden)), _norm(layers, hidden)
    residual = _x((tokens, hidden))
    ids = jax.random.randint(_key(), (tokens, kper), 0, e).astype(jnp.int32)
    w = jax.random.uniform(_key(), (tokens, kper), minval=0.2, maxval=1.5)
    got, ref = _both("moe_experts", (x, w, ids, g, gs, u, us, d, ds, residual, nw, EPS), layer)
    composed = jax.jit(lambda i: residual + reference.moe_experts(reference.rms_norm(x, nw[i], EPS), w, ids, g[i],
                                                                  gs[i], u[i], us[i], d[i], ds[i]))(jnp.int32(layer))
    np.testing.assert_array_equal(ref, np.asarray(composed, np.float32))
    assert _rel(got, ref) < 1e-2
    # the norm matters here: the un-normed input's result is far off
    assert _rel(residual + reference.moe_experts(x, w, ids, g[layer], gs[layer], u[layer], us[layer], d[layer],
                                                 ds[layer]), ref) > 0.1


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
