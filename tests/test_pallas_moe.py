"""MoE kernels (issue 4) against jtilert.ops.reference, in GPU interpret mode on the CPU (race detection
on, buffers start as NaN): the selected experts' gate/up + down with the routing-weighted sum (and the
layer's residual in the down kernel's epilogue, with and without split-K), the shared expert packed as
one more expert, and the router on inputs built to produce ties and all-in-one-group selections."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from interpreted import new_key, interpreted, rel_err   # tests/interpreted.py (tests/ is on sys.path)

from jtilert.ops import reference
from jtilert.ops.table import DecodeConfig, Ops
from jtilert.model.presets import DEEPSEEK_V32, GLM_5, TINY
from jtilert.pallas import gemv
from jtilert.pallas import interpret as interp
from jtilert.pallas import moe
from jtilert.pallas.gemv import GemvConfig
from jtilert.ops.quant import quantize_weight

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def _w(shape, fmt):
    w = jax.random.normal(new_key(), shape, F32) * shape[-1] ** -0.5
    return quantize_weight(w) if fmt == "fp8" else (w.astype(BF16), None)


def _experts(e, width, hidden, fmt):
    g, gs = _w((e, width, hidden), fmt)
    u, us = _w((e, width, hidden), fmt)
    d, ds = _w((e, hidden, width), fmt)
    return g, gs, u, us, d, ds


@pytest.mark.parametrize("t,fmt", [(2, "fp8"), (1, "bf16")])
def test_moe_experts(t, fmt):
    e, width, hidden, k = 6, 128, 256, 3
    g, gs, u, us, d, ds = _experts(e, width, hidden, fmt)
    x = jax.random.normal(new_key(), (t, hidden), F32).astype(BF16)
    ids = jax.random.randint(new_key(), (t, k), 0, e).astype(jnp.int32)
    if t == 2:
        ids = ids.at[1, 0].set(ids[0, 0])   # two tokens share an expert
    w = jax.random.uniform(new_key(), (t, k), minval=0.2, maxval=1.5)
    got = interpreted(moe.moe_experts, x, w, ids, g, gs, u, us, d, ds)
    assert got.shape == (t, hidden)
    assert rel_err(got, reference.moe_experts(x, w, ids, g, gs, u, us, d, ds)) < 1e-2


def test_moe_with_shared_expert():
    e, width, hidden, k = 5, 128, 128, 2
    routed = _experts(e, width, hidden, "fp8")
    shared = _experts(1, width, hidden, "fp8")
    shared = tuple(a[0] for a in shared)
    packed = moe.pack_shared_expert(*routed, *shared)
    x = jax.random.normal(new_key(), (1, hidden), F32).astype(BF16)
    ids = jnp.array([[4, 1]], jnp.int32)
    w = jnp.array([[0.7, 1.3]], F32)
    got = interpreted(lambda x, w, i: moe.moe_with_shared(x, w, i, packed), x, w, ids)
    ref = reference.moe_experts(x, w, ids, *routed).astype(F32) + reference.swiglu(x, *shared).astype(F32)
    assert rel_err(got, ref) < 1e-2


def _route_check(cfg, x, gate, bias):
    w_k, i_k = interpreted(lambda x, g, b: moe.route(cfg, x, g, b), x, gate, bias)
    w_r, i_r = reference.route(cfg, x, gate, bias)
    np.testing.assert_array_equal(i_k, np.asarray(i_r))
    np.testing.assert_allclose(w_k, np.asarray(w_r), rtol=1e-5, atol=1e-6)
    return i_k


def test_router_ties_and_one_group():
    cfg = TINY   # 16 experts in 4 groups, keep 2 groups, top-4 experts
    h = cfg.hidden_size
    gate = jax.random.normal(new_key(), (cfg.n_routed_experts, h), F32) * h ** -0.5
    # Exact ties: experts 1, 2 and 9 have identical gate rows, so identical scores.
    gate = gate.at[2].set(gate[1]).at[9].set(gate[1])
    x = jax.random.normal(new_key(), (2, h), F32).astype(BF16)
    bias = jnp.zeros((cfg.n_routed_experts,), F32)
    _route_check(cfg, x, gate, bias)
    # All selected experts in one group: a large bias on group 2 (experts 8..11).
    bias = bias.at[8:12].set(10.0)
    ids = _route_check(cfg, x, gate, bias)
    assert set(np.asarray(ids).ravel()) <= {8, 9, 10, 11}


def _select_by_top_k(cfg, logits, bias):
    """The router's selection as DeepSeek's code writes it, with lax.top_k at each stage."""
    s = jax.nn.sigmoid(logits)
    biased = s + bias[None, :]
    t, e = biased.shape
    if cfg.n_group > 1:
        grouped = biased.reshape(t, cfg.n_group, e // cfg.n_group)
        _, keep = jax.lax.top_k(jax.lax.top_k(grouped, 2)[0].sum(-1), cfg.topk_group)
        mask = jnp.zeros((t, cfg.n_group), bool).at[jnp.arange(t)[:, None], keep].set(True)
        biased = jnp.where(jnp.repeat(mask, e // cfg.n_group, axis=1), biased, -jnp.inf)
    _, ids = jax.lax.top_k(biased, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(s, ids, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, ids


@pytest.mark.parametrize("cfg", [DEEPSEEK_V32, GLM_5], ids=["dsv32", "glm5"])
def test_selection_by_ranks_is_top_k(cfg):
    """select_experts ranks by pairwise comparison instead of sorting: the same experts, in the same
    (descending) order, the same weights bit for bit, on ties too (to the lower index)."""
    e = cfg.n_routed_experts
    logits = jax.random.normal(new_key(), (6, e), F32)
    logits = logits.at[3:].set(jnp.round(logits[3:] * 2) / 2)        # rows with many exact ties
    bias = jax.random.normal(new_key(), (e,), F32) * 0.1
    for b in (bias, jnp.zeros_like(bias)):
        w, ids = jax.jit(functools.partial(reference.select_experts, cfg))(logits, b)
        w_ref, ids_ref = jax.jit(functools.partial(_select_by_top_k, cfg))(logits, b)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
        np.testing.assert_array_equal(np.asarray(w), np.asarray(w_ref))


def test_cross_lowering_dsv32_moe():
    S = jax.ShapeDtypeStruct
    e, width, hidden = 256, 256, 7168
    q = lambda *shape: (S(shape, FP8), S((*shape[:-2], -(-shape[-2] // 128), shape[-1] // 128), F32))
    with interp.compile_for_gpu():
        jax.jit(moe.moe_experts).trace(S((1, hidden), BF16), S((1, 8), F32), S((1, 8), jnp.int32),
                                       *q(e, width, hidden), *q(e, width, hidden), *q(e, hidden, width)
                                       ).lower(lowering_platforms=("cuda",))
        # the down projection on the fp8x2 engine (what the interpreter cannot check: its layouts)
        jax.jit(lambda h, w, ids, d, ds: moe.expert_down(h, w, ids, d, ds, config=GemvConfig(engine="fp8x2"))).trace(
            S((8, width), BF16), S((1, 8), F32), S((1, 8), jnp.int32), *q(e, hidden, width)
        ).lower(lowering_platforms=("cuda",))


def _both_backends(op: str, args, layer: int) -> list:
    """Op `op` of the op table at traced layer `layer`, [pallas, reference] as fp32 arrays, in GPU interpret
    mode with race detection; the pallas backend must run its kernel (its fallback warning is an error)."""
    out = []
    with interp.interpret(detect_races=True):
        for backend in ("pallas", "reference"):
            ops = Ops(DecodeConfig(backend=backend))
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="jtilert: backend='pallas'")
                out.append(np.asarray(jax.jit(lambda i: ops(op, *args, layer=i))(jnp.int32(layer)), np.float32))
        assert not interp.races_found()
    return out


@pytest.mark.parametrize("tokens", [1, 2])
def test_moe_experts_with_the_residual_through_the_op_table(tokens):
    """The layer's residual added in the down kernel's epilogue, at a traced layer of the stacks: within
    bf16 / fp8 rounding of the reference op, which is residual + the reference MoE bit for bit."""
    e, width, hidden, k, layers, layer = 6, 128, 256, 3, 3, 2
    stacks = [_w((layers, *shape), "fp8") for shape in ((e, width, hidden), (e, width, hidden), (e, hidden, width))]
    arrays = tuple(a for w_s in stacks for a in w_s)
    x = jax.random.normal(new_key(), (tokens, hidden), F32).astype(BF16)
    residual = (4 * jax.random.normal(new_key(), (tokens, hidden), F32)).astype(BF16)
    ids = jax.random.randint(new_key(), (tokens, k), 0, e).astype(jnp.int32)
    w = jax.random.uniform(new_key(), (tokens, k), minval=0.2, maxval=1.5)
    out = _both_backends("moe_experts", (x, w, ids, *arrays, residual), layer)
    composed = jax.jit(lambda i: residual + reference.moe_experts(x, w, ids, *[a[i] for a in arrays]))(jnp.int32(layer))
    np.testing.assert_array_equal(out[1], np.asarray(composed, np.float32))
    assert rel_err(out[0], out[1]) < 1e-2


@pytest.mark.parametrize("split,engine", [(1, "auto"), (2, "auto"), (1, "fp8x2"), (2, "fp8x2")])
def test_expert_down_adds_the_residual(split, engine):
    """With and without split-K (the residual added in the kernel's epilogue, or in XLA's finish), to
    the bf16-rounded sum as linear_residual adds it; on both tensor-core engines (fp8x2: h in two
    e4m3 halves, the routing weights and block scales applied to the block sums)."""
    e, width, hidden, tokens = 4, 256, 192, 2
    d, ds = _w((e, hidden, width), "fp8")
    h = jax.random.normal(new_key(), (tokens * 2, width), F32).astype(BF16)
    ids = jnp.array([[3, 0], [0, 2]], jnp.int32)
    w = jax.random.uniform(new_key(), (tokens, 2), minval=0.2, maxval=1.5)
    residual = (4 * jax.random.normal(new_key(), (tokens, hidden), F32)).astype(BF16)
    cfg = GemvConfig(split_k=split, engine=engine)
    got = interpreted(jax.jit(lambda h, r: moe.expert_down(h, w, ids, d, ds, residual=r, config=cfg)), h, residual)
    plain = interpreted(jax.jit(lambda h: moe.expert_down(h, w, ids, d, ds, config=cfg)), h)
    want = (np.asarray(plain, np.float32) + np.asarray(residual, np.float32)).astype(BF16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert rel_err(got, residual + reference.expert_down(h, w, ids, d, ds)) < 1e-2


def test_expert_down_fp8x2_takes_fp8_weights_only():
    d = jnp.zeros((2, 64, 128), BF16)
    with pytest.raises(ValueError, match="fp8x2 with fp8 weights"):
        moe.expert_down(jnp.zeros((2, 128), BF16), jnp.ones((1, 2)), jnp.array([[0, 1]], jnp.int32), d, None,
                        config=GemvConfig(engine="fp8x2"))


@pytest.mark.parametrize("engine", ["auto", "fp8x2"])
def test_expert_down_finishes_the_gate_up_partials(engine):
    """expert_gate_up(unsummed=True)'s split-K partials, copied into the down kernel's shared memory and
    finished there (h = silu(Σ gate) · Σ up, rounded to bf16), give what the down kernel gives on h
    finished by XLA: the same sums in the same order. The partials are seeded random numbers with
    rows of every scale, not zeros; past STAGE_MAX_BYTES XLA finishes them first (the same result)."""
    e, width, hidden, tokens, k, splits = 5, 256, 256, 1, 4, 3
    d, ds = _w((e, hidden, width), "fp8")
    parts = (jax.random.normal(new_key(), (splits, 2, tokens * k, width), F32)
             * jnp.array([0.3, 1.0, 3.0])[:, None, None, None])
    ids = jnp.array([[4, 0, 2, 1]], jnp.int32)
    w = jax.random.uniform(new_key(), (tokens, k), minval=0.2, maxval=1.5)
    residual = (4 * jax.random.normal(new_key(), (tokens, hidden), F32)).astype(BF16)
    cfg = GemvConfig(engine=engine)
    down = jax.jit(lambda h: moe.expert_down(h, w, ids, d, ds, residual=residual, config=cfg))
    staged = interpreted(down, parts)
    finished = interpreted(down, gemv.finish_partials(parts, kind="swiglu_f32"))
    np.testing.assert_array_equal(np.asarray(staged, np.float32), np.asarray(finished, np.float32))
    part = parts.sum(0)
    h_ref = (part[0] * jax.nn.sigmoid(part[0]) * part[1]).astype(BF16)
    assert rel_err(staged, residual + reference.expert_down(h_ref, w, ids, d, ds)) < 1e-2
    # whatever the gate/up kernel returns (partials, or h where it ran without split-K) the down takes
    x = jax.random.normal(new_key(), (tokens, hidden), F32).astype(BF16)
    g, gs, u, us, _, _ = _experts(e, width, hidden, "fp8")
    for split in (1, 2):
        up_cfg = GemvConfig(split_k=split)
        h = interpreted(jax.jit(lambda x: moe.expert_gate_up(x, ids, g, gs, u, us, config=up_cfg, unsummed=True)), x)
        assert h.shape == ((split, 2, tokens * k, width) if split > 1 else (tokens * k, width))
        summed = interpreted(jax.jit(lambda x: moe.expert_gate_up(x, ids, g, gs, u, us, config=up_cfg)), x)
        got = gemv.finish_partials(jnp.asarray(h), kind="swiglu_f32") if split > 1 else jnp.asarray(h).astype(BF16)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(summed, np.float32))
    # the shared expert's rounding (kind "swiglu": g and u to bf16 first) staged as XLA finishes it, and
    # not the routed experts' (the partials' scales make the two differ)
    down_bf = jax.jit(lambda h: moe.expert_down(h, w, ids, d, ds, residual=residual, config=cfg, kind="swiglu"))
    staged_bf = interpreted(down_bf, parts)
    np.testing.assert_array_equal(np.asarray(staged_bf, np.float32),
                                  np.asarray(interpreted(down_bf, gemv.finish_partials(parts, kind="swiglu")), np.float32))
    assert not np.array_equal(np.asarray(staged_bf, np.float32), np.asarray(staged, np.float32))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(moe, "STAGE_MAX_BYTES", parts.nbytes - 1)
    try:
        too_big = interpreted(down, parts)
    finally:
        monkey.undo()
    np.testing.assert_array_equal(np.asarray(too_big, np.float32), np.asarray(finished, np.float32))


@pytest.mark.parametrize("tokens,width", [(1, 256), (2, 128), (1, 64)])
def test_shared_expert_through_the_op_table(tokens, width):
    """residual + the shared expert of x normed, at a traced layer of the stacks: the gate/up kernel's
    split-K partials finished by the down kernel with the reference's rounding (g and u to bf16), within
    bf16 / fp8 rounding of the reference op, which is the reference's swiglu_hidden then linear_residual
    bit for bit. Width 64 (not whole 128-column blocks) runs the GEMV pair and the residual GEMV."""
    hidden, layers, layer = 1024, 3, 2   # K wide enough for the interpreter's 8 SMs to split it
    (g, gs), (u, us), (d, ds) = (_w((layers, *shape), "fp8") for shape in
                                 ((width, hidden), (width, hidden), (hidden, width)))
    nw = (1 + 0.3 * jax.random.normal(new_key(), (layers, hidden), F32)).astype(BF16)
    x = (3 * jax.random.normal(new_key(), (tokens, hidden), F32)).astype(BF16)
    residual = (4 * jax.random.normal(new_key(), (tokens, hidden), F32)).astype(BF16)
    args = (x, g, gs, u, us, nw, 1e-6, d, ds, residual)
    if width % 128 == 0:   # the down kernel stages split-K partials here (not a finished h)
        with interp.interpret():
            parts = jax.eval_shape(lambda: gemv.swiglu_pair(x, g, gs, u, us, nw, 1e-6, layer=jnp.int32(layer),
                                                            unsummed=True))
        assert parts.ndim == 4 and parts.shape[0] > 1
    out = _both_backends("shared_expert", args, layer)
    composed = jax.jit(lambda i: reference.linear_residual(
        reference.swiglu_hidden(x, g[i], gs[i], u[i], us[i], nw[i], 1e-6), d[i], ds[i], residual))(jnp.int32(layer))
    np.testing.assert_array_equal(out[1], np.asarray(composed, np.float32))
    assert rel_err(out[0] - np.asarray(residual, np.float32), out[1] - np.asarray(residual, np.float32)) < 2e-2
