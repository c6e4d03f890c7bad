"""Layer-stacked weights (`layer=`): the GEMV / MoE / router kernels take a whole stack [L, ...] and
a traced layer index, and equal the unstacked op on layer `layer` (GPU interpret mode on the CPU,
race detection on). The lowering tests check that no slice, gather or cast of a stack is left to
XLA outside the Mosaic kernels (what would copy the layer's weights in every step)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key, rel_err   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.ops import reference
from jtilert.model.presets import TINY
from jtilert.pallas import gemv, moe
from jtilert.pallas import interpret as interp
from jtilert.ops.quant import quantize_weight

F32, BF16, FP8, I32 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int32
L = 3
LAYERS = (0, 2)
TOL = 1e-2


def _stack(shape, fmt):
    """A stack [L, *shape] in `fmt` (fp8 with block scales [L, ., .]); every layer different."""
    w = jax.random.normal(new_key(), (L, *shape), F32) * shape[-1] ** -0.5
    if fmt == "fp8":
        return quantize_weight(w)
    return w.astype(BF16 if fmt == "bf16" else F32), None


def _x(t, k, scale=1.0):
    return (jax.random.normal(new_key(), (t, k), F32) * scale).astype(BF16)


def _per_layer(kernel_fn, ref_fn, args, check):
    """kernel_fn(*args, layer) jitted once (layer traced), run for each layer in LAYERS against
    ref_fn(layer) (the unstacked reference on w[layer])."""
    f = jax.jit(kernel_fn)
    with interp.interpret(detect_races=True):
        for layer in LAYERS:
            got = jax.tree.map(np.asarray, f(*args, jnp.asarray(layer, I32)))
            assert not interp.races_found()
            check(got, ref_fn(layer))


def _close(got, ref):
    assert got.shape == ref.shape
    assert rel_err(got, ref) < TOL


def _at(a, layer):
    return None if a is None else a[layer]


# ---- GEMV wrappers ------------------------------------------------------------------------------

@pytest.mark.parametrize("t,n,k,fmt,cfg", [
    (2, 96, 256, "fp8", gemv.GemvConfig(split_k=1)),
    (3, 64, 256, "bf16", gemv.GemvConfig(split_k=2)),                 # split-K: XLA finish
    (1, 72, 256, "fp8", gemv.GemvConfig(split_k=1, engine="fma")),    # CUDA-core engine
    (2, 64, 128, "f32", None),                                        # fp32 stack: FMA engine, no cast
])
def test_linear_stacked(t, n, k, fmt, cfg):
    x = _x(t, k)
    w, s = _stack((n, k), fmt)
    _per_layer(lambda x, w, s, l: gemv.linear(x, w, s, layer=l, config=cfg),
               lambda l: reference.linear(x, w[l], _at(s, l)), (x, w, s), _close)


def test_linear_residual_stacked():
    t, n, k = 2, 130, 256
    x, r = _x(t, k), _x(t, n)
    w, s = _stack((n, k), "fp8")
    _per_layer(lambda x, w, s, r, l: gemv.linear_residual(x, w, s, r, layer=l),
               lambda l: r + reference.linear(x, w[l], s[l]), (x, w, s, r), _close)


@pytest.mark.parametrize("split", [1, 2])
def test_rmsnorm_linear_stacked(split):
    t, n, k = 2, 96, 256
    x = _x(t, k, 3.0)
    nw = (1 + 0.1 * jax.random.normal(new_key(), (L, k))).astype(BF16)
    w, s = _stack((n, k), "fp8")
    cfg = gemv.GemvConfig(split_k=split)
    _per_layer(lambda x, nw, w, s, l: gemv.rmsnorm_linear(x, nw, 1e-6, w, s, layer=l, config=cfg),
               lambda l: reference.linear(reference.rms_norm(x, nw[l], 1e-6), w[l], s[l]), (x, nw, w, s), _close)


def test_swiglu_pair_stacked():
    t, width, h = 2, 128, 256
    x = _x(t, h)
    g, gs = _stack((width, h), "bf16")
    u, us = _stack((width, h), "bf16")
    _per_layer(lambda x, g, u, l: gemv.swiglu_pair(x, g, None, u, None, layer=l),
               lambda l: reference.swiglu_hidden(x, g[l], None, u[l], None), (x, g, u), _close)


def test_swiglu_stacked():
    t, width, h = 1, 128, 256
    x = _x(t, h)
    g, gs = _stack((width, h), "fp8")
    u, us = _stack((width, h), "fp8")
    d, ds = _stack((h, width), "fp8")
    _per_layer(lambda x, g, gs, u, us, d, ds, l: gemv.swiglu(x, g, gs, u, us, d, ds, layer=l),
               lambda l: reference.swiglu(x, g[l], gs[l], u[l], us[l], d[l], ds[l]), (x, g, gs, u, us, d, ds), _close)


# ---- MoE and router -----------------------------------------------------------------------------

def _experts(e, width, hidden, fmt):
    g, gs = _stack((e, width, hidden), fmt)
    u, us = _stack((e, width, hidden), fmt)
    d, ds = _stack((e, hidden, width), fmt)
    return g, gs, u, us, d, ds


def _routing(t, k, e):
    ids = jax.random.randint(new_key(), (t, k), 0, e).astype(I32)
    return ids, jax.random.uniform(new_key(), (t, k), minval=0.2, maxval=1.5)


@pytest.mark.parametrize("t,fmt", [(2, "fp8"), (1, "bf16")])
def test_moe_experts_stacked(t, fmt):
    e, width, hidden, k = 6, 128, 256, 3
    ex = _experts(e, width, hidden, fmt)
    x = _x(t, hidden)
    ids, w = _routing(t, k, e)
    _per_layer(lambda x, w, ids, ex, l: moe.moe_experts(x, w, ids, *ex, layer=l),
               lambda l: reference.moe_experts(x, w, ids, *(_at(a, l) for a in ex)), (x, w, ids, ex), _close)


def test_expert_gate_up_and_down_stacked():
    t, e, width, hidden, k = 2, 5, 128, 128, 2
    g, gs, u, us, d, ds = _experts(e, width, hidden, "fp8")
    x = _x(t, hidden)
    ids, w = _routing(t, k, e)
    hs = _x(t * k, width)
    _per_layer(lambda x, ids, g, gs, u, us, l: moe.expert_gate_up(x, ids, g, gs, u, us, layer=l),
               lambda l: reference.expert_hidden(x, ids, g[l], gs[l], u[l], us[l]), (x, ids, g, gs, u, us), _close)
    _per_layer(lambda hs, w, ids, d, ds, l: moe.expert_down(hs, w, ids, d, ds, layer=l),
               lambda l: reference.expert_down(hs, w, ids, d[l], ds[l]), (hs, w, ids, d, ds), _close)


def test_route_stacked():
    cfg = TINY   # 16 experts in 4 groups
    h, e = cfg.hidden_size, cfg.n_routed_experts
    gate = jax.random.normal(new_key(), (L, e, h), F32) * h ** -0.5
    bias = 0.1 * jax.random.normal(new_key(), (L, e), F32)
    x = _x(2, h)

    def check(got, ref):
        np.testing.assert_array_equal(got[1], np.asarray(ref[1]))
        np.testing.assert_allclose(got[0], np.asarray(ref[0]), rtol=1e-5, atol=1e-6)

    _per_layer(lambda x, g, b, l: moe.route(cfg, x, g, b, layer=l),
               lambda l: reference.route(cfg, x, gate[l], bias[l]), (x, gate, bias), check)


# ---- lowering: the stacks reach the kernels untouched ------------------------------------------

_MLIR_DTYPE = {jnp.dtype(FP8): "f8E4M3FN", jnp.dtype(BF16): "bf16", jnp.dtype(F32): "f32"}


def _copies_of(text, specs):
    """Ops of the lowered module (outside the Mosaic custom calls) that slice, gather or convert
    one of the stacked arrays in `specs`."""
    types = {f"tensor<{'x'.join(map(str, s.shape))}x{_MLIR_DTYPE[s.dtype]}>" for s in specs}
    return [line.strip()[:200] for line in text.splitlines()
            if re.search(r"stablehlo\.(dynamic_slice|gather|slice|convert)\b", line)
            and any(ty in line for ty in types)]


def _lower(f, *specs):
    with interp.compile_for_gpu():
        text = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return text


S = jax.ShapeDtypeStruct
LAYER = S((), I32)


def _q(*shape):
    """An fp8 stack [L, *shape] and its scales."""
    return S((L, *shape), FP8), S((L, *shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128)), F32)


def test_lowering_reads_stacks_in_place():
    """dsv32-tp8-shard shapes, 3 layers: no XLA copy of a stack in front of any kernel."""
    hid = 7168
    x = S((1, hid), BF16)
    cases = [
        (lambda x, w, s, l: gemv.linear(x, w, s, layer=l), S((2, 1536), BF16), *_q(3072, 1536)),
        (lambda x, w, l: gemv.linear(x, w, layer=l), S((1, 512), BF16), S((L, 4096, 512), BF16)),
        (lambda x, nw, w, s, l: gemv.rmsnorm_linear(x, nw, 1e-6, w, s, layer=l), x, S((L, hid), BF16),
         *_q(2112, hid)),
        (lambda x, w, s, r, l: gemv.linear_residual(x, w, s, r, layer=l), S((2, 2048), BF16), *_q(hid, 2048),
         S((2, hid), BF16)),
        (lambda x, g, gs, u, us, l: gemv.swiglu_pair(x, g, gs, u, us, layer=l), x, *_q(2304, hid), *_q(2304, hid)),
        (lambda x, g, gs, u, us, d, ds, l: gemv.swiglu(x, g, gs, u, us, d, ds, layer=l), x, *_q(256, hid),
         *_q(256, hid), *_q(hid, 256)),
        (lambda x, g, b, l: moe.route(TINY, x, g, b, layer=l), S((1, TINY.hidden_size), BF16),
         S((L, TINY.n_routed_experts, TINY.hidden_size), F32), S((L, TINY.n_routed_experts), F32)),
        (lambda x, w, i, g, gs, u, us, d, ds, l: moe.moe_experts(x, w, i, g, gs, u, us, d, ds, layer=l),
         x, S((1, 9), F32), S((1, 9), I32), *_q(257, 256, hid), *_q(257, 256, hid), *_q(257, hid, 256)),
        (lambda x, i, g, gs, u, us, l: moe.expert_gate_up(x, i, g, gs, u, us, layer=l),
         S((2, hid), BF16), S((2, 8), I32), *_q(256, 256, hid), *_q(256, 256, hid)),
    ]
    for f, *specs in cases:
        stacks = [s for s in specs if s.ndim >= 3]
        text = _lower(f, *specs, LAYER)
        assert not _copies_of(text, stacks), _copies_of(text, stacks)
    # The check does see a slice in front of the kernel (w[layer] in XLA).
    w, s = _q(3072, 1536)
    text = _lower(lambda x, w, s, l: gemv.linear(x, w[l], s[l]), S((1, 1536), BF16), w, s, LAYER)
    assert _copies_of(text, [w, s])


def test_refuses_stacks_without_a_scalar_layer():
    x = _x(1, 128)
    w, s = _stack((64, 128), "fp8")
    with pytest.raises(ValueError, match="need layer="):
        gemv.linear(x, w, s)
    with pytest.raises(ValueError, match="integer scalar"):
        gemv.linear(x, w, s, layer=jnp.zeros((1,), I32))
    with pytest.raises(ValueError, match="stacked"):
        gemv.linear(x, w[0], s[0], layer=jnp.asarray(0, I32))
