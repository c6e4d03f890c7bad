"""The engine's MoE router selection (`jtilert.ffi.route`, cuda/src/route.cu): wiring, the XLA
lowering of its primitive, the CUDA lowering's custom call, and a NumPy model of the kernel's
algorithm (the router GEMV's split-K partial logits summed in order, then the selection) against
`reference.select_experts` of those logits (the kernel itself runs on the GPU: tests/gpu/route_check.py)."""

from __future__ import annotations

import pathlib
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtilert.ffi import _lib
from jtilert.ffi import ops as ffi_ops
from jtilert.ffi import route
from jtilert.ops import reference
from jtilert.ops.layer import Layer
from jtilert.pallas import interpret

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (experts, groups, groups kept, k): DeepSeek-V3.2 / GLM-5 (one group) / the tiny model's router / kept
# groups holding fewer than k experts (dropped experts are chosen too, by index)
CASES = [(256, 8, 4, 8), (256, 1, 1, 8), (16, 4, 2, 4), (16, 8, 1, 4)]


def _cfg(e, g, tg, k, norm=True):
    return types.SimpleNamespace(n_group=g, topk_group=tg, num_experts_per_tok=k, norm_topk_prob=norm,
                                 routed_scaling_factor=2.5)


def _inputs(t, e, layers=3, seed=0, ties=False, splits=4):
    """(partial logits [splits, t, e], bias stack [layers, e]), fp32."""
    rng = np.random.default_rng(seed)
    partials = (rng.normal(size=(splits, t, e)) / splits**0.5).astype(np.float32)
    bias = (0.1 * rng.normal(size=(layers, e))).astype(np.float32)
    if ties:   # equal scores in and across groups: the order goes to the lower index
        partials[..., 1::2] = partials[..., ::2]
        bias[:, 1::2] = bias[:, ::2]
    return jnp.asarray(partials), jnp.asarray(bias)


def test_route_select_is_built_and_exported():
    assert "src/route.cu" in (ROOT / "cuda" / "CMakeLists.txt").read_text()
    assert "JtRouteSelect" in (ROOT / "cuda" / "src" / "ffi.cc").read_text()
    assert _lib.TARGETS["jtilert_route_select"] == "JtRouteSelect"


def kernel_model(cfg, partials, bias_row):
    """route.cu's algorithm in NumPy, thread by thread: the logits as the partials' sum in order, the
    group score as the sum of the group's two largest biased scores, groups and experts ranked by
    counting every pair (ties: lower index)."""
    logits = np.zeros(partials.shape[1:], np.float32)
    for part in np.asarray(partials, np.float32):
        logits = logits + part
    s = 1 / (1 + np.exp(-logits))
    b = (s + np.asarray(bias_row, np.float32)).astype(np.float32)
    t, e = b.shape
    w = np.zeros((t, cfg.num_experts_per_tok), np.float32)
    ids = np.zeros((t, cfg.num_experts_per_tok), np.int32)

    def rank(vals, i):
        return sum(int(vals[j] > vals[i] or (vals[j] == vals[i] and j < i)) for j in range(len(vals)))
    for r in range(t):
        v = b[r].copy()
        if cfg.n_group > 1:
            gs = e // cfg.n_group
            top2 = np.sort(v.reshape(cfg.n_group, gs), axis=1)[:, ::-1][:, :2].sum(1).astype(np.float32)
            for i in range(e):
                if rank(top2, i // gs) >= cfg.topk_group:
                    v[i] = -np.inf
        reach = cfg.topk_group * (e // cfg.n_group) >= cfg.num_experts_per_tok
        for i in range(e):
            if reach and v[i] == -np.inf:   # a dropped expert ranks after every kept one: skipped
                continue
            k = rank(v, i)
            if k < cfg.num_experts_per_tok:
                ids[r, k], w[r, k] = i, s[r, i]
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, ids


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_model_equals_reference(case, ties):
    cfg = _cfg(*case)
    partials, bias = _inputs(3, case[0], ties=ties, seed=case[0] + case[1])
    want_w, want_ids = reference.select_experts(cfg, route.logits_of(partials), bias[1])
    got_w, got_ids = kernel_model(cfg, partials, bias[1])
    np.testing.assert_array_equal(got_ids, np.asarray(want_ids))
    np.testing.assert_allclose(got_w, np.asarray(want_w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", CASES)
def test_primitive_xla_lowering_equals_reference(case):
    """The primitive as XLA runs it where the engine is not loaded at lowering time (the stack read
    at the traced layer: base 3, offset -1)."""
    cfg = _cfg(*case)
    partials, bias = _inputs(2, case[0], seed=7)

    @jax.jit
    def f(p, b, base):
        return route.route_select_p.bind(p, b, *Layer(base, -1).operands(), n_group=cfg.n_group,
                                         topk_group=cfg.topk_group, k=cfg.num_experts_per_tok, norm=1,
                                         scaling=cfg.routed_scaling_factor)
    got_w, got_ids = f(partials, bias, jnp.int32(3))
    want_w, want_ids = reference.select_experts(cfg, route.logits_of(partials), bias[2])
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(got_w), np.asarray(want_w))


def test_without_the_engine_the_reference_runs_with_one_warning():
    cfg = _cfg(*CASES[0])
    partials, bias = _inputs(1, 256)
    _lib._warned.clear()  # noqa: SLF001
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for layer in range(3):
            got = route.select_experts(cfg, partials, bias, jnp.int32(layer))
            want = reference.select_experts(cfg, route.logits_of(partials), bias[layer])
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert len([w for w in rec if "route selection not used" in str(w.message)]) == 1


def test_cuda_lowering_emits_the_custom_call_on_the_whole_bias_stack(monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    cfg = _cfg(*CASES[0])
    partials, bias = _inputs(1, 256, layers=61, splits=16)
    f = jax.jit(lambda p, b, i: route.select_experts(cfg, p, b, i))
    txt = f.trace(partials, bias, jnp.int32(5)).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in txt.splitlines() if "custom_call @jtilert_route_select" in line]
    assert len(call) == 1 and "tensor<61x256xf32>" in call[0] and "tensor<16x1x256xf32>" in call[0], call
    assert "n_group = 8 : i32" in call[0] and "topk_group = 4 : i32" in call[0] and "norm = 1 : i32" in call[0]
    assert not [line for line in txt.splitlines() if "dynamic_slice" in line]   # the stack, not a slice of it


def test_shapes_the_kernel_does_not_take_name_themselves():
    cfg = _cfg(2048, 8, 4, 8)
    assert "2048 experts" in route.unsupported(cfg, jnp.zeros((2, 1, 2048)), jnp.zeros((2, 2048)))
    assert "bfloat16" in route.unsupported(_cfg(*CASES[0]), jnp.zeros((2, 1, 256), jnp.bfloat16), jnp.zeros((2, 256)))
    assert "[S, T, E]" in route.unsupported(_cfg(*CASES[0]), jnp.zeros((1, 256)), jnp.zeros((2, 256)))
    assert route.unsupported(_cfg(*CASES[0]), jnp.zeros((2, 1, 256)), jnp.zeros((2, 256))) is None


def test_op_norm_route_runs_the_router_gemv_then_the_engines_selection(monkeypatch):
    """Op "norm_route" through `Ops` (backend pallas, stacked weights, a traced layer), lowered for CUDA
    with the engine loaded: the router's GEMV kernel, then the engine's selection, two launches."""
    from jtilert.model.presets import TINY
    from jtilert.ops.table import DecodeConfig, Ops
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    monkeypatch.setattr(_lib, "load", lambda: (object(), ""))   # the engine's selection, as on a GPU
    cfg = TINY.replace(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8)   # hashable
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 256)), jnp.bfloat16)
    nw = jnp.asarray(1.0 + 0.1 * rng.normal(size=(3, 256)), jnp.bfloat16)
    gate = jnp.asarray(rng.normal(size=(3, 256, 256)) / 16, jnp.bfloat16)
    bias = jnp.asarray(0.1 * rng.normal(size=(3, 256)), jnp.float32)
    ops = Ops(DecodeConfig(backend="pallas"))
    run = jax.jit(lambda *a: ops("norm_route", cfg, a[0], a[1], 1e-6, a[2], a[3], layer=Layer(a[4], 1)))
    with interpret.compile_for_gpu():
        txt = run.trace(x, nw, gate, bias, jnp.int32(0)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line.split("custom_call @")[1].split("(")[0] for line in txt.splitlines() if "custom_call @" in line]
    assert len(calls) == 2 and calls[1] == "jtilert_route_select", calls


def test_the_python_limit_is_the_engines():
    """route.py's shape limit is engine.h's (the Python side refuses what the kernel would)."""
    import re
    header = (ROOT / "cuda" / "include" / "jtilert" / "engine.h").read_text()
    limit = re.search(r"#define JT_ROUTE_MAX_EXPERTS (\d+)", header, re.M).group(1)
    assert int(limit) == route.MAX_EXPERTS


# ---- the whole router in one launch (norm_route_kernel) ----

def _router_inputs(t, e, h, layers=3, seed=0):
    """(x [t, h] bf16, norm weight stack [layers, h] bf16, gate stack [layers, e, h] bf16, bias [layers, e])."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(3 * rng.normal(size=(t, h)), jnp.bfloat16)
    nw = jnp.asarray(1.0 + 0.1 * rng.normal(size=(layers, h)), jnp.bfloat16)
    gate = jnp.asarray(rng.normal(size=(layers, e, h)) / h**0.5, jnp.bfloat16)
    bias = jnp.asarray(0.1 * rng.normal(size=(layers, e)), jnp.float32)
    return x, nw, gate, bias


@pytest.mark.parametrize("case", CASES)
def test_norm_route_primitive_xla_lowering_equals_reference(case):
    """The primitive as XLA runs it where the engine is not loaded at lowering time: reference.norm_route
    at the traced layer (base 3, offset -1) of the stacks."""
    cfg = _cfg(*case)
    x, nw, gate, bias = _router_inputs(2, case[0], 256, seed=case[1])

    @jax.jit
    def f(x, nw, gate, bias, base):
        return route.norm_route_p.bind(x, nw, gate, bias, *Layer(base, -1).operands(), eps=1e-6, n_group=cfg.n_group,
                                       topk_group=cfg.topk_group, k=cfg.num_experts_per_tok, norm=1,
                                       scaling=cfg.routed_scaling_factor)
    got = f(x, nw, gate, bias, jnp.int32(3))
    want = jax.jit(lambda *a: reference.norm_route(cfg, a[0], a[1][2], 1e-6, a[2][2], a[3][2]))(x, nw, gate, bias)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert len(set(np.asarray(got[2][0]).tolist())) == cfg.num_experts_per_tok   # a real selection


def test_norm_route_without_the_engine_runs_the_reference_with_one_warning():
    cfg = _cfg(*CASES[0])
    x, nw, gate, bias = _router_inputs(1, 256, 256)
    _lib._warned.clear()  # noqa: SLF001
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for layer in range(3):
            got = route.norm_route(cfg, x, nw, 1e-6, gate, bias, jnp.int32(layer))
            want = reference.norm_route(cfg, x, nw[layer], 1e-6, gate[layer], bias[layer])
            np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert len([w for w in rec if "CUDA router" in str(w.message)]) == 1


def test_norm_route_cuda_lowering_emits_one_custom_call_on_the_whole_stacks(monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    cfg = _cfg(*CASES[0])
    x, nw, gate, bias = _router_inputs(2, 256, 512, layers=7)
    f = jax.jit(lambda *a: route.norm_route(cfg, a[0], a[1], 1e-6, a[2], a[3], a[4]))
    txt = f.trace(x, nw, gate, bias, jnp.int32(5)).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in txt.splitlines() if "custom_call @jtilert_norm_route" in line]
    assert len(call) == 1, txt[-3000:]
    assert "tensor<7x256x512xbf16>" in call[0] and "tensor<7x512xbf16>" in call[0] and "tensor<7x256xf32>" in call[0]
    assert "eps = 9.99999997E-7 : f32" in call[0] and "n_group = 8 : i32" in call[0], call[0]
    assert not [line for line in txt.splitlines() if "dynamic_slice" in line]   # the stacks, not slices of them


def test_norm_route_shapes_the_kernel_does_not_take_name_themselves():
    cfg = _cfg(*CASES[0])
    x, nw, gate, bias = _router_inputs(1, 256, 256)
    assert route.norm_route_unsupported(cfg, x, nw, gate, bias) is None
    assert "float32" in route.norm_route_unsupported(cfg, x, nw, gate.astype(jnp.float32), bias)
    assert "T ≤ 8" in route.norm_route_unsupported(cfg, jnp.zeros((9, 256), jnp.bfloat16), nw, gate, bias)
    assert "H ≤ 8192" in route.norm_route_unsupported(cfg, jnp.zeros((1, 8200), jnp.bfloat16), nw, gate, bias)
    big = jax.ShapeDtypeStruct((3, 512, 256), jnp.bfloat16)
    assert "512 experts" in route.norm_route_unsupported(_cfg(512, 8, 4, 8), x, nw, big, jnp.zeros((3, 512)))
    with pytest.raises(ValueError, match="float32"):
        route.norm_route(cfg, x, nw, 1e-6, gate.astype(jnp.float32), bias, jnp.int32(0))


def test_the_router_limits_are_the_engines():
    import re
    header = (ROOT / "cuda" / "include" / "jtilert" / "engine.h").read_text()
    for name, value in (("JT_ROUTE_MAX_TOKENS", route.ROUTER_MAX_TOKENS), ("JT_ROUTE_MAX_HIDDEN", route.ROUTER_MAX_HIDDEN),
                        ("JT_ROUTE_MAX_ROUTER_EXPERTS", route.ROUTER_MAX_EXPERTS)):
        assert int(re.search(rf"#define {name} (\d+)", header, re.M).group(1)) == value, name
