"""The FFN's RMSNorm and residual add folded into its kernels (the decode layer's post-attention norm
and h + FFN(norm(h))): through the op table, backend "pallas" (GPU interpret mode, traced layer and
norm indices into stacks) against backend "reference", whose op normalises first (`Ops.__call__`'s
`norm=`), checked bit for bit against the composition of reference ops the model ran before. The
router's FMA kernel rounds the normed input as `reference.rms_norm` defines it (x/rms to bf16, times the
weight, to bf16), so its fp32 logits match that definition to fp32 summation order; a jitted reference
may differ at the bf16 level (XLA, allowed excess precision, skips the rounding of x/rms inside a
fusion). The wgmma kernels apply 1/rms to their sums (bf16-level differences, within TOL)."""

from __future__ import annotations

import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtilert.model.presets import TINY
from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.ops.table import OPS, DecodeConfig, Ops, _per_layer
from jtilert.pallas import gemv, moe
from jtilert.pallas import interpret as interp

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = 1e-2          # relative (Frobenius): bf16 outputs of fp8 / bf16 weights, another summation order
LAYERS, LAYER, NORM_AT = 3, 2, 4   # the FFN stack's entry, and the norm stack's (another index)
EPS = 1e-6
_seed = itertools.count(9100)


def _key():
    return jax.random.key(next(_seed))


def _normal(shape, scale=1.0):
    return (jax.random.normal(_key(), shape, F32) * scale).astype(BF16)


def _stack(shape, fmt):
    w = jax.random.normal(_key(), shape, F32) * shape[-1] ** -0.5
    return quantize_weight(w) if fmt == "fp8" else (w.astype(BF16), None)


def _norm_stack(hidden):
    return (1 + 0.2 * jax.random.normal(_key(), (NORM_AT + 1, hidden))).astype(BF16)


def _both(name, args):
    """(pallas, reference) results of op `name` at (LAYER, NORM_AT) with the norm folded in; the pallas
    side must run the kernel (a refusal warns, which fails here)."""
    kernel = Ops(DecodeConfig(backend="pallas"))
    op = OPS[name]
    nw, args = args[-1], args[:-1]
    assert op.norm and kernel._use_kernel(name, op, _per_layer(op, args)), name
    out = []
    for ops in (kernel, Ops(DecodeConfig(backend="reference"))):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="jtilert: backend='pallas'")
            run = jax.jit(lambda i, j: ops(name, *args, layer=i, norm=(nw, EPS, j)))
            out.append(jax.tree.map(np.asarray, run(jnp.int32(LAYER), jnp.int32(NORM_AT))))
    return out


def _traced(composed):
    """The composition of reference ops as the model ran them: jitted, at traced (LAYER, NORM_AT)."""
    return jax.jit(composed)(jnp.int32(LAYER), jnp.int32(NORM_AT))


def _close(got, ref):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert not np.isnan(got).any() and np.abs(ref).max() > 0
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < TOL, err


@pytest.mark.parametrize("fmt,tokens", [("fp8", 1), ("bf16", 2)])
def test_swiglu_with_the_norm(fmt, tokens):
    hidden, width = 256, 192
    g, gs = _stack((LAYERS, width, hidden), fmt)
    u, us = _stack((LAYERS, width, hidden), fmt)
    x, nw = _normal((tokens, hidden), 3.0), _norm_stack(hidden)
    with interp.interpret(detect_races=True):
        got, ref = _both("swiglu_hidden", (x, g, gs, u, us, nw))
        assert not interp.races_found()
    take = lambda a, i: None if a is None else a[i]
    composed = _traced(lambda i, j: reference.swiglu_hidden(reference.rms_norm(x, nw[j], EPS), g[i], take(gs, i),
                                                            u[i], take(us, i)))
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(composed, np.float32))
    _close(got, ref)


def test_router_with_the_norm_selects_the_references_experts():
    cfg = TINY   # 16 experts in 4 groups
    e, hidden = cfg.n_routed_experts, cfg.hidden_size
    gate = jax.random.normal(_key(), (LAYERS, e, hidden), F32) * hidden ** -0.5
    bias = 0.1 * jax.random.normal(_key(), (LAYERS, e), F32)
    x, nw = _normal((4, hidden), 3.0), _norm_stack(hidden)
    with interp.interpret(detect_races=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="jtilert.ffi")   # no CUDA engine here: XLA's selection
        (w_k, i_k), (w_r, i_r) = _both("route", (cfg, x, gate, bias, nw))
        logits = jax.jit(lambda x: moe.router_logits(x, gate, layer=jnp.int32(LAYER), norm_weight=nw, eps=EPS,
                                                     norm_layer=jnp.int32(NORM_AT)))(x)
        assert not interp.races_found()
    np.testing.assert_array_equal(i_k, i_r)
    np.testing.assert_allclose(w_k, w_r, rtol=2e-3)   # the jitted reference's excess precision (module doc)
    # the normed input as the reference rounds it: the fp32 logits differ only in summation order
    # (folding the norm's 1/rms in after the product would leave bf16-sized differences, ~4e-3)
    want = reference.dot("th,eh->te", reference.rms_norm(x, nw[NORM_AT], EPS).astype(F32), gate[LAYER])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("tokens", [1, 2])
def test_moe_experts_with_the_norm_and_the_residual(tokens):
    e, width, hidden, k = 6, 128, 256, 3
    g, gs = _stack((LAYERS, e, width, hidden), "fp8")
    u, us = _stack((LAYERS, e, width, hidden), "fp8")
    d, ds = _stack((LAYERS, e, hidden, width), "fp8")
    x, nw, residual = _normal((tokens, hidden), 3.0), _norm_stack(hidden), _normal((tokens, hidden))
    ids = jax.random.randint(_key(), (tokens, k), 0, e).astype(jnp.int32)
    w = jax.random.uniform(_key(), (tokens, k), minval=0.2, maxval=1.5)
    with interp.interpret(detect_races=True):
        got, ref = _both("moe_experts", (x, w, ids, g, gs, u, us, d, ds, residual, nw))
        hid, hid_ref = _both("expert_hidden", (x, ids, g, gs, u, us, nw))
        assert not interp.races_found()
    composed = _traced(lambda i, j: residual + reference.moe_experts(reference.rms_norm(x, nw[j], EPS), w, ids,
                                                                     *[a[i] for a in (g, gs, u, us, d, ds)]))
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(composed, np.float32))
    _close(got, ref)
    _close(hid, hid_ref)


@pytest.mark.parametrize("split", [1, 2])
def test_expert_down_adds_the_residual(split):
    """With and without split-K (the epilogue's add in the kernel, or in XLA's finish)."""
    e, width, hidden, tokens, k = 4, 256, 192, 2, 2
    d, ds = _stack((e, hidden, width), "fp8")
    h = _normal((tokens * k, width))
    ids = jnp.array([[3, 0], [0, 2]], jnp.int32)
    w = jax.random.uniform(_key(), (tokens, k), minval=0.2, maxval=1.5)
    residual = _normal((tokens, hidden), 4.0)
    cfg = gemv.GemvConfig(split_k=split)
    with interp.interpret(detect_races=True):
        got = jax.jit(lambda h, r: moe.expert_down(h, w, ids, d, ds, residual=r, config=cfg))(h, residual)
        plain = jax.jit(lambda h: moe.expert_down(h, w, ids, d, ds, config=cfg))(h)
        assert not interp.races_found()
    # the residual is added to the bf16-rounded sum, as linear_residual adds it
    want = (np.asarray(plain, np.float32) + np.asarray(residual, np.float32)).astype(BF16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    _close(got, residual + reference.expert_down(h, w, ids, d, ds))
