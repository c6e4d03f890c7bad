"""Which path each op of a full-width decode step takes under backend="pallas": every op that has a
kernel runs it at decode shapes (T = 1..4, the MTP verification included), for the presets the
benchmarks use. Traced abstractly (no weights, no kernel runs), the kernels traced for the GPU."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import pytest
from decode_jaxprs import decode_step, layer_loops, sub_jaxprs   # tests/decode_jaxprs.py (tests/ is on sys.path)

from jtilert.ops.table import OPS, DecodeConfig, Ops
from jtilert.pallas import interpret as interp


class Recording(Ops):
    """Ops that records, per op, whether the kernel was chosen."""

    def __init__(self, config):
        super().__init__(config)
        self._engine_topk = config.engine_topk   # the engine library is not built on a CPU machine
        self.chosen: dict[str, set[bool]] = {}

    def _use_kernel(self, name, op, args):
        use = super()._use_kernel(name, op, args)
        self.chosen.setdefault(name, set()).add(use)
        return use

    def _run_kernel(self, name, op, args, layer):   # also where a method decided without _use_kernel
        self.chosen.setdefault(name, set()).add(True)
        return super()._run_kernel(name, op, args, layer)


def _decisions(name: str, layers: int, tokens: int, mtp: bool) -> dict[str, set[bool]]:
    ops = Recording(DecodeConfig(backend="pallas"))
    step, state, cache = decode_step(name, layers, ops, tokens, mtp)
    with interp.compile_for_gpu(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="jtilert: backend='pallas'")   # a kernel that does not apply
        jax.eval_shape(step, state, cache)
    return ops.chosen


@pytest.mark.parametrize("name, tokens, mtp", [("dsv32-tp8-shard", 1, False), ("dsv32-tp8-shard", 2, True),
                                               ("glm5-tp8-shard", 1, True), ("deepseek-v3.2", 4, False)])
def test_every_kernel_runs_at_decode_shapes(name, tokens, mtp):
    chosen = _decisions(name, 4, tokens, mtp)
    # the head's top-k runs in next_token, expert_hidden only with the engine's all-reduce (tp > 1); a
    # plain linear without tp only in the MTP block (eh_proj: the FFNs' down projections add the residual);
    # route only in a model whose FFN stacks do not hold their norm (the decode model's MoE: norm_route)
    # sparse MLA runs inside sparse_mla_heads_linear, whose W_uv kernel merges its splits (DeepSeek-V3.2's
    # 128-blocks of scales and GLM-5's 64-blocks alike); attention_out (the same with o_proj as a second
    # phase) for one token
    skip = ("lm_head_topk", "expert_hidden", "route", "sparse_mla") + (() if mtp else ("linear",))
    skip += ("sparse_mla_heads_linear",) if tokens == 1 else ("attention_out",)
    expected = {op for op, o in OPS.items() if o.kernel is not None and op not in skip}
    assert expected <= set(chosen), expected - set(chosen)
    assert all(chosen[op] == {True} for op in expected), {op: chosen[op] for op in expected}
    assert not {"sparse_mla", "sparse_mla_heads_linear"} <= set(chosen), chosen


def test_an_op_without_its_kernel_runs_its_parts(monkeypatch):
    # a table entry whose kernel is taken away (tests/gpu/decode_check.py --per-op does this to every op
    # but one) is not run: the attention's output op falls back to the merged sparse MLA + W_uv op and
    # o_proj, and without that one's kernel too, to sparse MLA and W_uv, each its kernel
    without = lambda op: monkeypatch.setitem(OPS, op, dataclasses.replace(OPS[op], kernel=None))
    without("attention_out")
    chosen = _decisions("dsv32-tp8-shard", 4, 1, False)
    assert "attention_out" not in chosen and chosen["sparse_mla_heads_linear"] == {True}, chosen
    assert chosen["linear_residual"] == {True}, chosen   # o_proj with the residual
    without("sparse_mla_heads_linear")
    chosen = _decisions("dsv32-tp8-shard", 4, 1, False)
    assert "sparse_mla_heads_linear" not in chosen, chosen
    assert chosen["sparse_mla"] == {True} and chosen["heads_linear"] == {True}, chosen


def test_prefill_runs_the_reference():
    chosen = _decisions("dsv32-tp8-shard", 4, 16, False)
    assert all(c == {False} for c in chosen.values()), chosen


# ---- the glue budget: what a decoder layer runs outside its kernels ------------------------------

_SHAPE_ONLY = {"reshape", "squeeze", "broadcast_in_dim", "expand_dims", "transpose", "slice", "iota", "jit", "pjit",
               "scan", "while", "cond"}
# a Mosaic kernel / an FFI call / the engine's primitives (its top-k and the router's selection)
_LAUNCHES = {"custom_vmap_call", "ffi_call", "custom_call", "jtilert_topk_select", "jtilert_route_select"}


def _count(jaxpr, counts):
    """Kernel launches and the tensor ops around them (array results, not reshapes or index math)."""
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name in _LAUNCHES:
            counts["kernels"] += 1
            continue
        for inner in sub_jaxprs(e):
            _count(inner, counts)
        if name not in _SHAPE_ONLY and any(getattr(o.aval, "size", 1) > 1 for o in e.outvars):
            counts["glue"] += 1


def _loops(name: str) -> list:
    """The layer loops (dense, then MoE: `layer_loops`) of the one-token pallas step of 5 layers (a
    trip of 3 dense layers, one of 2 MoE layers), as a GPU with the CUDA engine loaded traces them
    (the engine's top-k and router selection taken)."""
    from jtilert.ffi import _lib
    from jtilert.ffi import ops as ffi_ops
    mp = pytest.MonkeyPatch()
    mp.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    mp.setattr(_lib, "load", lambda: (object(), ""))
    jax.clear_caches()   # kernels traced without the engine (JAX caches traces per function) are not reused
    try:
        step, state, cache = decode_step(name, 5, Ops(DecodeConfig(backend="pallas")))
        with interp.compile_for_gpu():
            jaxpr = jax.make_jaxpr(step)(state, cache).jaxpr
    finally:
        mp.undo()
        jax.clear_caches()
    return layer_loops(jaxpr)


def _layer_bodies(name: str) -> list[dict]:
    """Per layer-loop body of the one-token pallas step (dense, then MoE): the counts of one of its
    layers (a trip's layers are copies of one layer)."""
    bodies = []
    for body, _, per_trip in _loops(name):
        counts = {"kernels": 0, "glue": 0}
        _count(body, counts)
        assert all(n % per_trip == 0 for n in counts.values()), (counts, per_trip)
        bodies.append({k: n // per_trip for k, n in counts.items()})
    return bodies


# Today's counts, the ceiling: a change that adds a launch or glue to a layer fails here. The fused
# layer's target is at most 4 launches and no glue; lower these as the fused kernels land.
# The projections of a layer's normed input (q_a, wk, kv_a) run as one merged GEMV (`decode_weights`):
# two launches and their two split-K finishes (4 glue ops) per layer fewer than apart. With the norms
# fused into x_proj and into the merged q_b | wq_b (qr_proj), and o_proj's residual in its epilogue:
# one launch and 9 glue ops fewer again. kv_b's two absorptions run as two heads_linear launches on kv_b
# laid out per head: 2 launches more, 9 glue ops fewer (XLA's dequantise, slices and einsums, which its
# GPU compiler makes ~4 transpose / reduce fusions); sparse MLA's combine kernel writes the latent output
# in bf16 for the second (no cast after it). The router's selection by pairwise ranks counts more ops
# here than lax.top_k (compares, selects and sums, which XLA fuses into a few kernels, against a sort
# per top_k on the GPU): +19 glue ops in the MoE bodies (glm5, one stage: +9). MLA's glue between the
# projections and attention (q_pe and k_pe rope, the latent's norm, both cache writes) as one mla_prep
# launch: 1 launch more, 22 glue ops fewer. The indexer's glue (the key's LayerNorm, q and k rope, q's
# Hadamard rotation and fp8 quantisation, its scales into the head weights) as one index_prep launch:
# 1 launch more, 50 glue ops fewer.
# Counted as a GPU with the engine traces the step (its top-k: a launch, not a top_k op). The router's
# selection as one engine launch (`jtilert.ffi.route`): 1 launch more, 39 glue ops fewer (dsv32; glm5's
# one group: 20). The layer's residual add in its FFN's down projections and the key's Hadamard rotation
# in index_prep (with q's), the indexer's traced offsets as operands of their own (no stack of them): 4
# glue ops fewer in the dense body, 5 in the MoE body. The router GEMV's split-K partials summed by
# the engine's selection: 1 glue op fewer in the MoE body. The top-k writes -1 for masked positions and
# sparse MLA masks idx < 0 (no valid flags): 1 fewer in each. The FFN's norm applied by its first
# kernels (`FFNNorm`: the dense gate/up; the router, which writes the normed x, and the shared gate/up):
# 6 glue ops fewer in each body. x_proj's split-K partials summed by its CTAs as one cluster on the
# GPU, the epilogue in the kernel: 2 glue ops fewer in each body.
# The routed experts' gate/up partials finished by the MoE down kernel (copied into its shared memory)
# instead of by XLA between the two: 8 glue ops fewer in the MoE bodies.
# The indexer's head weights as one FMA GEMV that norms the layer's input itself (its split-K summed by
# XLA; H^-0.5 · D^-0.5 applied in index_prep) instead of XLA's norm, fp32 dot and scale: 1 launch
# more, 9 glue ops fewer in each body.
# Sparse MLA's split partials merged by W_uv's heads GEMV (`sparse_mla_heads_linear`, where W_uv has
# 128-blocks: dsv32) instead of a combine kernel between the two: 1 launch fewer in each body.
# GLM-5's W_uv (64-blocks of scales) merging the splits too: 13 glue ops fewer in each of its bodies.
BUDGET = {"dsv32-tp8-shard": [{"kernels": 13, "glue": 21}, {"kernels": 17, "glue": 21}],
          "glm5-tp8-shard": [{"kernels": 13, "glue": 21}, {"kernels": 17, "glue": 21}]}


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_layer_glue_stays_within_budget(name):
    bodies = _layer_bodies(name)
    assert len(bodies) == 2, bodies   # one loop body per FFN stack
    for got, budget in zip(bodies, BUDGET[name]):
        assert got["kernels"] <= budget["kernels"] and got["glue"] <= budget["glue"], (got, budget)


# ---- the layer index the kernels get: no index arithmetic inside the layer loop ----------------
# A Mosaic or FFI call cannot fuse its operands, so every scalar the loop body computes from the
# loop's counter and hands to a kernel is one more XLA kernel per layer and step on the GPU (max(i, 0)
# fed to the indexer's GEMVs; i + 1 .. i + 3 for a trip's layers, i - 3 for the MoE stacks). A kernel
# gets a layer as the counter itself and a constant (`jtilert.ops.layer.Layer`), and adds the two.
# Each distinct computed index counts once, whatever the number of kernels that read it.

def _index_origin(jaxpr, env, computed: set, counts: dict):
    from jax.extend import core as jcore

    def org(v):
        return ("const",) if isinstance(v, jcore.Literal) else env.get(v, ("other",))
    for e in jaxpr.eqns:
        ins = [org(v) for v in e.invars]
        if e.primitive.name in _LAUNCHES:
            for v, o in zip(e.invars, ins):
                if getattr(v.aval, "size", 2) == 1 and jnp.issubdtype(v.aval.dtype, jnp.integer):
                    counts[o[0]] = counts.get(o[0], 0) + 1
                    if o[0] == "computed":
                        computed.add(o[1])
            continue
        sub = e.params.get("jaxpr") if e.primitive.name in ("pjit", "jit", "closed_call") else None
        if sub is not None:
            inner = getattr(sub, "jaxpr", sub)
            _index_origin(inner, dict(zip(inner.invars, ins)), computed, counts)
            continue
        scalar = all(getattr(o.aval, "size", 2) == 1 for o in e.outvars)
        if e.primitive.name in ("reshape", "convert_element_type", "broadcast_in_dim", "squeeze", "expand_dims"):
            out = ins[0]
        elif scalar and any(o[0] in ("index", "computed") for o in ins):
            out = ("computed", id(e))
        else:
            out = ("const",) if scalar and all(o[0] == "const" for o in ins) else ("other",)
        for v in e.outvars:
            env[v] = out


def _computed_indices(name: str) -> list[int]:
    """Per layer-loop body (dense, MoE) of the one-token pallas step: how many distinct scalars computed
    from the loop's counter reach a kernel launch."""
    out = []
    for body, counter, _ in _loops(name):
        computed, counts = set(), {}
        _index_origin(body, {counter: ("index",)}, computed, counts)
        # the kernels do get the loop's counter, and as many constants (the layers' offsets) beside it
        assert counts.get("index", 0) > 0 and counts.get("const", 0) >= counts["index"], counts
        out.append(len(computed))
    return out


def test_kernels_get_the_layer_index_itself():
    # DeepSeek-V3.2 (every layer has its indexer): each body computes one index, `first + 1`, which the
    # trip's layers after its first read (so that the counter's in-place increment waits only for the
    # first layer's kernels), though their trips run 3 and 2 layers and the MoE stacks' index is the
    # layer's less first_k_dense_replace
    assert _computed_indices("dsv32-tp8-shard") == [1, 1]


# ---- kernels read whole arrays: no slice of another array as a kernel operand ------------------
# A slice passed to a kernel becomes a DynamicSliceFusion around the custom call in XLA's GPU
# compiler; inside the layer loop it depends on the loop (its layer-index operand), which keeps
# XLA from capturing the loop as one CUDA graph (the host then launches every layer's pieces).
# Kernels take the whole array and read their window of it themselves.

_SLICES = {"slice", "dynamic_slice", "gather"}
_VIEWS = {"reshape", "squeeze", "expand_dims", "bitcast_convert_type"}   # an operand's bytes as they are


def _kernel_name(e) -> str:
    for k in ("name", "kernel_name", "call_target_name"):
        v = e.params.get(k)
        if isinstance(v, str):
            return v
    return e.primitive.name


def _sliced_operands(jaxpr, env: dict, where: str, found: list) -> None:
    """Appends (kernel, operand, its slice) for every kernel launch in `jaxpr` (and the jaxprs inside
    it) with an operand that is a slice of another array, or a reshape of one. `env`: the slice
    each sliced variable comes from."""
    for e in jaxpr.eqns:
        name = e.primitive.name
        ins = [env.get(v) if not hasattr(v, "val") else None for v in e.invars]
        if name in _LAUNCHES or name == "pallas_call":
            found += [(f"{where}{_kernel_name(e)}", f"operand {j} {v.aval.str_short()}", o)
                      for j, (v, o) in enumerate(zip(e.invars, ins)) if o is not None]
            continue
        if name in _SLICES:
            src = e.invars[0].aval.str_short()
            for v in e.outvars:
                env[v] = f"{name} of {src} -> {v.aval.str_short()}"
        elif name in _VIEWS and ins[0] is not None:
            for v in e.outvars:
                env[v] = f"{name} of ({ins[0]})"
        sub = e.params.get("jaxpr") if name in ("pjit", "jit", "closed_call", "custom_jvp_call",
                                                "custom_vjp_call", "remat") else None
        if sub is not None:
            inner = getattr(sub, "jaxpr", sub)
            inner_env = {iv: o for iv, o in zip(inner.invars, ins) if o is not None}
            _sliced_operands(inner, inner_env, f"{where}{e.params.get('name', name)}/", found)
            for ov, iv in zip(e.outvars, inner.outvars):
                if inner_env.get(iv) is not None:
                    env[ov] = inner_env[iv]
        elif name == "cond":
            for br in e.params["branches"]:
                _sliced_operands(br.jaxpr, {iv: o for iv, o in zip(br.jaxpr.invars, ins[1:]) if o is not None},
                                 f"{where}cond/", found)
        elif name in ("scan", "while"):
            for k in ("jaxpr", "body_jaxpr", "cond_jaxpr"):
                if k in e.params:
                    _sliced_operands(e.params[k].jaxpr, {}, f"{where}{name}/", found)


@pytest.mark.parametrize("name", sorted(BUDGET))
def test_kernels_get_no_slices_in_the_layer_loop(name):
    for body, _, _ in _loops(name):
        found = []
        _sliced_operands(body, {}, "", found)
        assert not found, "kernels that get a slice of another array:\n" + "\n".join(
            f"{k}: {op} = {src}" for k, op, src in found)
