"""The fused GEMV ops of the decode layer through the op table: `rmsnorm_linear` (x_proj after
input_layernorm, qr_proj = q_b | wq_b after q_a_layernorm) and `linear_residual` (o_proj plus the
residual). Backend "pallas" runs the kernel (GPU interpret mode, a traced layer index into the stacks)
and must stay within bf16 / fp8 rounding of backend "reference", whose op is the composition of the
reference ops the model ran before the fusion (checked bit for bit here too). Shapes: the tiny decode
model's own stacks, and stacks where the kernel splits K (the norm's 1/rms then computed by every CTA
over the token's whole row and applied to its partial sums)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key   # tests/interpreted.py (tests/ is on sys.path)

import jtilert
from jtilert.model.transformer import decode_weights
from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.ops.table import OPS, DecodeConfig, Ops, _per_layer
from jtilert.pallas import gemv
from jtilert.pallas import interpret as interp

F32, BF16 = jnp.float32, jnp.bfloat16
# relative (Frobenius): bf16 outputs, fp8 weights; the kernel rounds x·w_norm where the reference rounds x/rms
TOL = 1e-2


def _normal(shape, scale=1.0):
    return (jax.random.normal(new_key(), shape, F32) * scale).astype(BF16)


def _pallas_and_reference(name, args, layer):
    """(pallas, reference) results of op `name` on layer `layer` of the stacked args (a traced index);
    the pallas side must run the kernel: a refusal (the reference with a warning) fails."""
    kernel = Ops(DecodeConfig(backend="pallas"))
    op = OPS[name]
    assert kernel._use_kernel(name, op, _per_layer(op, args)), f"{name}: the table does not route to the kernel"
    out = []
    for ops in (kernel, Ops(DecodeConfig(backend="reference"))):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="jtilert: backend='pallas'")
            out.append(np.asarray(jax.jit(lambda i: ops(name, *args, layer=i))(jnp.int32(layer)), np.float32))
    return out


def _check(name, args, layer, composed):
    """The op against the reference op, and the reference op bit for bit against `composed(layer)`, the
    reference ops the model composed before the fusion (both traced with the layer index)."""
    got, ref = _pallas_and_reference(name, args, layer)
    np.testing.assert_array_equal(ref, np.asarray(jax.jit(composed)(jnp.int32(layer)), np.float32))
    assert np.abs(ref).max() > 0 and not np.isnan(got).any()
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < TOL, f"{name}: relative error {err:.2e}"


@functools.cache
def _tiny():
    """The tiny fp8 model (bf16 activations) as the Engine holds it."""
    return decode_weights(jtilert.random_model("tiny", fmt="fp8", seed=11, dtype=BF16))


@pytest.mark.parametrize("tokens, layer", [(1, 4), (2, 1)])   # the MTP layer (last); two tokens (MTP verify)
def test_fused_ops_at_the_tiny_models_stacks(tokens, layer):
    m = _tiny()
    blk, attn = m.layers, m.layers.self_attn
    hidden = m.cfg.hidden_size
    with interp.interpret(detect_races=True):
        x = _normal((tokens, hidden), 3.0)
        norm = blk.input_layernorm
        args = (x, norm.weight[...], norm.eps) + attn.x_proj.arrays()
        _check("rmsnorm_linear", args, layer,
               lambda i: reference.linear(norm(x, i), attn.x_proj.weight[...][i], attn.x_proj.scale[...][i]))
        qa = _normal((tokens, m.cfg.q_lora_rank), 3.0)
        norm = attn.q_a_layernorm
        args = (qa, norm.weight[...], norm.eps) + attn.qr_proj.arrays()
        _check("rmsnorm_linear", args, layer,
               lambda i: reference.linear(norm(qa, i), attn.qr_proj.weight[...][i], attn.qr_proj.scale[...][i]))
        o, residual = _normal((tokens, attn.o_proj.weight[...].shape[-1])), _normal((tokens, hidden))
        w, s = attn.o_proj.arrays()
        _check("linear_residual", (o, w, s, residual), layer, lambda i: residual + reference.linear(o, w[i], s[i]))
        assert not interp.races_found()


@pytest.mark.parametrize("tokens, layer", [(1, 4), (2, 1)])
def test_the_indexers_head_weights_at_the_tiny_models_stacks(tokens, layer):
    """`index_weights` (the FMA engine norms the layer's input itself; rows padded to whole 64-column
    blocks) against what the model composed before: XLA's norm, then an fp32 product."""
    m = _tiny()
    norm, w = m.layers.input_layernorm, m.indexers.weights_proj.weight[...]
    heads = w.shape[1]
    assert w.dtype == F32 and heads % 64
    with interp.interpret(detect_races=True):
        x = _normal((tokens, m.cfg.hidden_size), 3.0)
        args = (x, norm.weight[...], norm.eps, w)
        shapes = {b: jax.eval_shape(lambda i, ops=Ops(DecodeConfig(backend=b)): ops("index_weights", *args, layer=i),
                                    jnp.int32(layer)) for b in ("pallas", "reference")}
        assert shapes["pallas"].shape == (tokens, 64) and shapes["reference"].shape == (tokens, heads), shapes
        assert all(s.dtype == F32 for s in shapes.values()), shapes
        kernel, ref = Ops(DecodeConfig(backend="pallas")), Ops(DecodeConfig(backend="reference"))
        assert kernel._use_kernel("index_weights", OPS["index_weights"], _per_layer(OPS["index_weights"], args))
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="jtilert: backend='pallas'")
            got = np.asarray(jax.jit(lambda i: kernel("index_weights", *args, layer=i))(jnp.int32(layer)))[:, :heads]
        want = np.asarray(jax.jit(lambda i: ref("index_weights", *args, layer=i))(jnp.int32(layer)))
        composed = jax.jit(lambda i: reference.linear(norm(x, i).astype(F32), w[i].astype(F32)))(jnp.int32(layer))
        np.testing.assert_array_equal(want, np.asarray(composed))
        assert np.abs(want).max() > 0 and not np.isnan(got).any()
        # jitted, XLA may keep the normed x's bf16 rounding in excess precision (xla_allow_excess_precision):
        # bf16-level differences; op by op (eagerly) the reference rounds as written, as the kernel does,
        # and only the fp32 sums' order differs
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < 5e-3, f"head weights: relative error {err:.2e} against the jitted reference"
        eager = np.asarray(reference.index_weights(x, norm.weight[...][layer], norm.eps, w[layer]))
        err = np.linalg.norm(got - eager) / np.linalg.norm(eager)
        assert err < 1e-5, f"head weights: relative error {err:.2e} against the reference op by op"
        assert not interp.races_found()


def _stack(layers, n, k):
    w = jax.random.normal(new_key(), (layers, n, k), F32) * k ** -0.5
    return quantize_weight(w)


@pytest.mark.parametrize("tokens", [1, 2])
def test_fused_ops_with_split_k(tokens):
    n, k, layers, layer = 192, 2048, 3, 2
    w, s = _stack(layers, n, k)
    with interp.interpret(detect_races=True):
        cfg = gemv.GemvConfig().resolved(n, k, tokens, 1, 1, 8)
        assert cfg.split_k > 1, cfg   # what the op's default configuration runs here
        x = _normal((tokens, k), 3.0)
        nw = (1 + 0.1 * jax.random.normal(new_key(), (layers, k))).astype(BF16)
        _check("rmsnorm_linear", (x, nw, 1e-6, w, s), layer,
               lambda i: reference.linear(reference.rms_norm(x, nw[i], 1e-6), w[i], s[i]))
        residual = _normal((tokens, n))
        _check("linear_residual", (x, w, s, residual), layer, lambda i: residual + reference.linear(x, w[i], s[i]))
        assert not interp.races_found()
