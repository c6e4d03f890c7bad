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


# ---- the whole router in one launch (norm_route) ----------------------------------------------------

def _router_inputs(t, e, h, layers=4, seed=0, gate_dtype=jnp.bfloat16, norm_dtype=jnp.bfloat16):
    """(x [t, h] bf16, norm weight stack [layers, h], gate stack [layers, e, h], bias stack [layers, e]
    fp32): seeded random, the gate's values bf16 values as the checkpoints' routers."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(t, h)) * 3.0, jnp.bfloat16)
    nw = jnp.asarray(1.0 + 0.1 * rng.normal(size=(layers, h)), jnp.bfloat16).astype(norm_dtype)
    gate = jnp.asarray(rng.normal(size=(layers, e, h)) * h**-0.5, jnp.bfloat16).astype(gate_dtype)
    bias = jnp.asarray(0.1 * rng.normal(size=(layers, e)), jnp.float32)
    return x, nw, gate, bias


def norm_route_model(cfg, x, norm_weight, eps, gate, bias_row):
    """route.cu's norm_route in NumPy: 1/rms in fp32 from the sum of squares, f rounded twice to bf16
    (x · 1/rms, then times the bf16 norm weight), the logits as f32 sums of exact products, then the
    selection of `kernel_model`."""
    bf16 = jnp.bfloat16
    x32 = np.asarray(x, np.float32)
    rstd = (1.0 / np.sqrt((x32 * x32).sum(-1, dtype=np.float32) / np.float32(x32.shape[-1]) + np.float32(eps)))
    y = np.asarray(jnp.asarray(x32 * rstd.astype(np.float32)[:, None], bf16), np.float32)
    nw = np.asarray(jnp.asarray(np.asarray(norm_weight, np.float32), bf16), np.float32)
    f = np.asarray(jnp.asarray(nw * y, bf16), np.float32)
    logits = (f.astype(np.float64) @ np.asarray(gate, np.float64).T).astype(np.float32)
    return f, logits, *kernel_model(cfg, logits[None], bias_row)


def _ulps_apart(a, b):
    """How many bf16 steps apart two bf16 arrays are, elementwise (same sign assumed)."""
    ia = np.asarray(jnp.asarray(a, jnp.bfloat16)).view(np.int16).astype(np.int32)
    ib = np.asarray(jnp.asarray(b, jnp.bfloat16)).view(np.int16).astype(np.int32)
    return np.abs(ia - ib)


@pytest.mark.parametrize("case", CASES)
def test_norm_route_model_equals_reference(case):
    cfg = _cfg(*case)
    x, nw, gate, bias = _router_inputs(3, case[0], 256, seed=case[0] + case[1])
    f, logits, w, ids = norm_route_model(cfg, x, nw[1], 1e-6, gate[1], bias[1])
    want_f = reference.rms_norm(x, nw[1], 1e-6)   # eager: f rounded to bf16 as the kernel rounds it
    assert _ulps_apart(f, want_f).max() <= 1 and (_ulps_apart(f, want_f) > 0).mean() < 0.01
    want_logits = reference.router_logits(want_f, gate[1])
    np.testing.assert_allclose(logits, np.asarray(want_logits), rtol=0, atol=5e-2)
    want_w, want_ids = reference.select_experts(cfg, jnp.asarray(logits), bias[1])
    np.testing.assert_array_equal(ids, np.asarray(want_ids))
    np.testing.assert_allclose(w, np.asarray(want_w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtypes", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32)])
def test_norm_route_primitive_xla_lowering_equals_reference(case, dtypes, monkeypatch):
    """The primitive bound (as on a GPU with the engine) and lowered by XLA on this machine: f as the
    reference norms x at the traced layer (base 3, offset -1), the selection that of its logits."""
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    cfg = _cfg(*case)
    x, nw, gate, bias = _router_inputs(2, case[0], 128, seed=11, gate_dtype=dtypes[0], norm_dtype=dtypes[1])
    run = jax.jit(lambda *a: route.norm_route_logits(cfg, a[0], a[1], 1e-6, a[2], a[3], Layer(a[4], -1)))
    assert "jtilert_norm_route" in str(run.trace(x, nw, gate, bias, jnp.int32(3)).jaxpr)
    f, logits, w, ids = run(x, nw, gate, bias, jnp.int32(3))
    want_f = jax.jit(reference.rms_norm, static_argnums=2)(x, nw[2], 1e-6)
    np.testing.assert_array_equal(np.asarray(f), np.asarray(want_f))
    # XLA may keep f's excess precision inside the fused program: the logits to bf16 rounding of f
    np.testing.assert_allclose(np.asarray(logits), np.asarray(reference.router_logits(f, gate[2])), atol=5e-2)
    want_w, want_ids = reference.select_experts(cfg, logits, bias[2])
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(want_w))


def test_norm_route_cuda_lowering_emits_one_custom_call_on_the_whole_stacks(monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    cfg = _cfg(*CASES[0])
    x, nw, gate, bias = _router_inputs(1, 256, 7168, layers=3)
    run = jax.jit(lambda *a: route.norm_route(cfg, a[0], a[1], 1e-6, a[2], a[3], a[4]))
    txt = run.trace(x, nw, gate, bias, jnp.int32(2)).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in txt.splitlines() if "custom_call @jtilert_norm_route" in line]
    assert len(call) == 1 and "tensor<3x256x7168xbf16>" in call[0] and "tensor<3x7168xbf16>" in call[0], call
    assert "n_group = 8 : i32" in call[0] and "topk_group = 4 : i32" in call[0] and "eps = 9.99" in call[0], call
    assert not [line for line in txt.splitlines() if "dynamic_slice" in line]   # the stacks, not slices of them


def test_norm_route_shapes_it_does_not_take_name_themselves():
    cfg = _cfg(*CASES[0])
    x, nw, gate, bias = _router_inputs(1, 256, 128, layers=2)
    assert route.norm_route_unsupported(cfg, x, nw, gate, bias) is None
    assert "T <= 8" in route.norm_route_unsupported(cfg, jnp.zeros((9, 128), jnp.bfloat16), nw, gate, bias)
    assert "bfloat16 [T, H]" in route.norm_route_unsupported(cfg, x.astype(jnp.float32), nw, gate, bias)
    assert "stacks" in route.norm_route_unsupported(cfg, x, nw[0], gate, bias)
    assert "stacks" in route.norm_route_unsupported(cfg, x, nw, gate.astype(jnp.float8_e4m3fn), bias)
    assert "float32 [L, E]" in route.norm_route_unsupported(cfg, x, nw, gate, bias[0])
    wide = _router_inputs(1, 1024, 128, layers=2)
    assert "1024 experts" in route.norm_route_unsupported(_cfg(1024, 8, 4, 8), *wide)


def test_without_the_engine_norm_route_runs_the_reference_with_one_warning():
    cfg = _cfg(*CASES[0])
    x, nw, gate, bias = _router_inputs(1, 256, 128)
    _lib._warned.clear()  # noqa: SLF001
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for layer in range(3):
            got = route.norm_route(cfg, x, nw, 1e-6, gate, bias, jnp.int32(layer))
            want = reference.norm_route(cfg, x, nw[layer], 1e-6, gate[layer], bias[layer])
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert len([w for w in rec if "norm_route not used" in str(w.message)]) == 1


def _ops_norm_route_calls(engine_router: bool) -> list[str]:
    """The custom calls of op norm_route through `Ops` (backend pallas, a traced layer), lowered for CUDA."""
    from jtilert.model.presets import TINY
    from jtilert.ops.table import DecodeConfig, Ops
    cfg = TINY.replace(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8)   # hashable
    x, nw, gate, bias = _router_inputs(1, 256, 256, layers=3)
    ops = Ops(DecodeConfig(backend="pallas", engine_router=engine_router))
    run = jax.jit(lambda *a: ops.norm_route(cfg, a[0], a[1], 1e-6, a[2], a[3], layer=Layer(a[4], 1)))
    with interpret.compile_for_gpu():
        txt = run.trace(x, nw, gate, bias, jnp.int32(0)).lower(lowering_platforms=("cuda",)).as_text()
    return [line.split("custom_call @")[1].split("(")[0] for line in txt.splitlines() if "custom_call @" in line]


def test_ops_run_the_one_launch_router_only_when_asked(monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    monkeypatch.setattr(_lib, "load", lambda: (object(), ""))   # the engine's selection, as on a GPU
    assert _ops_norm_route_calls(True) == ["jtilert_norm_route"]
    off = _ops_norm_route_calls(False)
    assert "jtilert_route_select" in off and "jtilert_norm_route" not in off and len(off) == 2, off


def test_ops_say_once_why_the_one_launch_router_does_not_run():
    from jtilert.model.presets import TINY
    from jtilert.ops.table import DecodeConfig, Ops
    x, nw, gate, bias = _router_inputs(1, TINY.n_routed_experts, TINY.hidden_size, layers=1)
    ops = Ops(DecodeConfig(backend="pallas", engine_router=True))
    _lib._warned.clear()  # noqa: SLF001
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):   # one layer's weights, not stacks: the table's kernels run it
            got = ops.norm_route(TINY, x, nw[0], 1e-6, gate[0], bias[0], layer=None)
    want = reference.norm_route(TINY, x, nw[0], 1e-6, gate[0], bias[0])
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    msgs = [str(w.message) for w in rec if "engine_router" in str(w.message)]
    assert len(msgs) == 1 and "norm_route" in msgs[0] and "not stacked" in msgs[0], msgs


def test_the_decode_step_with_the_engines_norm_gemvs_gives_the_references_logits(tiny_fp8, monkeypatch):
    """The tiny fp8 model's decode steps with `DecodeConfig.engine_router` and `engine_index_weights` (the
    primitives bound at every MoE layer and every indexer, as on a GPU with the engine, and lowered by
    XLA here): the reference's logits and greedy tokens, as the pallas path without them."""
    import jtilert
    from jtilert.ops import table
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    jax.clear_caches()
    table._jitted.cache_clear()  # noqa: SLF001
    table._kernel.cache_clear()  # noqa: SLF001
    layers, indexers = [], []
    real, real_iw = route.norm_route, route.index_weights
    monkeypatch.setattr(table.ffi_route, "norm_route", lambda *a: layers.append(a[-1]) or real(*a))
    monkeypatch.setattr(table.ffi_route, "index_weights", lambda *a: indexers.append(a[-1]) or real_iw(*a))
    prompt = np.random.RandomState(1).randint(0, 256, 40)
    ref = jtilert.score(tiny_fp8, prompt, prefill=36)[36:]
    config = table.DecodeConfig(backend="pallas", engine_router=True, engine_index_weights=True)
    got = jtilert.score(tiny_fp8, prompt, prefill=36, config=config)[36:]
    moe_layers = tiny_fp8.cfg.num_hidden_layers - tiny_fp8.cfg.first_k_dense_replace
    assert layers and len(layers) <= moe_layers, layers   # traced once a MoE loop body or in-line layer
    assert indexers and len(indexers) <= tiny_fp8.cfg.num_hidden_layers, indexers
    err = np.abs(got - ref).max()
    assert err <= 2e-2 * np.abs(ref).max()
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * err
    assert clear.sum() >= 2 and (got.argmax(-1) == ref.argmax(-1))[clear].all()



# ---- the indexer's head weights on the same kernel (index_weights) ---------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_index_weights_primitive_xla_lowering_equals_reference(dtype, monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    x, nw, w, _ = _router_inputs(3, 64, 256, seed=5, gate_dtype=dtype)
    run = jax.jit(lambda *a: route.index_weights(a[0], a[1], 1e-6, a[2], Layer(a[3], -1)))
    assert "jtilert_norm_gemv" in str(run.trace(x, nw, w, jnp.int32(3)).jaxpr)
    want = jax.jit(reference.index_weights, static_argnums=2)(x, nw[2], 1e-6, w[2])
    np.testing.assert_allclose(np.asarray(run(x, nw, w, jnp.int32(3))), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_index_weights_cuda_lowering_emits_one_custom_call_on_the_whole_stacks(monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    x, nw, w, _ = _router_inputs(1, 64, 7168, layers=3, gate_dtype=jnp.float32)
    run = jax.jit(lambda *a: route.index_weights(a[0], a[1], 1e-6, a[2], a[3]))
    txt = run.trace(x, nw, w, jnp.int32(2)).lower(lowering_platforms=("cuda",)).as_text()
    call = [line for line in txt.splitlines() if "custom_call @jtilert_norm_gemv" in line]
    assert len(call) == 1 and "tensor<3x64x7168xf32>" in call[0] and "tensor<1x64xf32>" in call[0], call
    assert not [line for line in txt.splitlines() if "dynamic_slice" in line]


def test_index_weights_shapes_it_does_not_take_name_themselves():
    x, nw, w, _ = _router_inputs(1, 64, 128, layers=2)
    assert route.index_weights_unsupported(x, nw, w) is None
    assert "T <= 8" in route.index_weights_unsupported(jnp.zeros((9, 128), jnp.bfloat16), nw, w)
    assert "stacks" in route.index_weights_unsupported(x, nw, w[0])
    assert "2048 rows" in route.index_weights_unsupported(x, nw, jnp.zeros((2, 2048, 128), jnp.float32))


def test_ops_run_the_engines_index_weights_only_when_asked(monkeypatch):
    from jtilert.ops.table import DecodeConfig, Ops
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    x, nw, w, _ = _router_inputs(1, 64, 256, layers=3, gate_dtype=jnp.float32)

    def calls(**config):
        ops = Ops(DecodeConfig(backend="pallas", **config))
        run = jax.jit(lambda *a: ops.index_weights(a[0], a[1], 1e-6, a[2], layer=Layer(a[3], 1)))
        with interpret.compile_for_gpu():
            txt = run.trace(x, nw, w, jnp.int32(0)).lower(lowering_platforms=("cuda",)).as_text()
        return [line.split("custom_call @")[1].split("(")[0] for line in txt.splitlines() if "custom_call @" in line]
    assert calls(engine_index_weights=True) == ["jtilert_norm_gemv"]
    off = calls()
    assert "jtilert_norm_gemv" not in off and off, off   # the Pallas FMA GEMV


def test_the_python_limits_are_the_engines():
    """route.py's shape limits are engine.h's (the Python side refuses what the kernels would)."""
    import re
    header = (ROOT / "cuda" / "include" / "jtilert" / "engine.h").read_text()

    def define(name):
        return eval(re.search(rf"#define {name} (.+?)(?:\s*//.*)?$", header, re.M).group(1))  # noqa: S307
    assert define("JT_ROUTE_MAX_EXPERTS") == route.MAX_EXPERTS
    assert define("JT_ROUTE_MAX_TOKENS") == route.MAX_TOKENS
    assert define("JT_NORM_ROUTE_MAX_EXPERTS") == route.NORM_ROUTE_MAX_EXPERTS
    assert define("JT_NORM_GEMV_MAX_SMEM") == route.NORM_GEMV_MAX_SMEM
    assert define("JT_NORM_GEMV_MAX_ROWS") == route.NORM_GEMV_MAX_ROWS
