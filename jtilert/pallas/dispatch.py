"""`backend="pallas"`: which op runs which kernel.

Each wrapper here has the signature of its `jtilert.layers` reference and falls back to that
reference where the kernels do not apply (prefill-sized token counts, fp32 activations, shapes the
kernels refuse), so a model runs end to end with `backend="pallas"` on any shape; the decode path
(a few bf16 tokens) runs the Mosaic-GPU kernels, in GPU interpret mode on a machine without a GPU.
"""

from __future__ import annotations

import importlib
import os
import types

import jax.numpy as jnp

from jtilert import layers
from jtilert.pallas import gemv

BF16, FP8 = jnp.bfloat16, jnp.float8_e4m3fn
MAX_DECODE_TOKENS = 8   # above this, XLA's matmuls (the reference) are the better tool


def _decode_tokens(x) -> bool:
    t = 1
    for d in x.shape[:-1]:
        t *= d
    return t <= MAX_DECODE_TOKENS


def _gemv_ok(x, w, scale) -> bool:
    return (x.dtype == BF16 and _decode_tokens(x) and w.ndim == 2 and w.shape[1] == x.shape[-1]
            and x.shape[-1] % gemv.KGRAIN == 0 and (w.dtype == FP8) == (scale is not None)
            and w.dtype in (FP8, BF16, jnp.float32))


def linear(x, w, scale=None):
    if _gemv_ok(x, w, scale):
        return gemv.linear(x, w, scale)
    return layers.linear(x, w, scale)


def swiglu(x, gate, gate_scale, up, up_scale, down, down_scale):
    if (_gemv_ok(x, gate, gate_scale) and _gemv_ok(x, up, up_scale) and gate.dtype == up.dtype
            and down.shape[1] % gemv.KGRAIN == 0 and (down.dtype == FP8) == (down_scale is not None)):
        return gemv.swiglu(x, gate, gate_scale, up, up_scale, down, down_scale)
    return layers.swiglu(x, gate, gate_scale, up, up_scale, down, down_scale)


def swiglu_hidden(x, gate, gate_scale, up, up_scale):
    if _gemv_ok(x, gate, gate_scale) and _gemv_ok(x, up, up_scale) and gate.dtype == up.dtype:
        return gemv.swiglu_pair(x, gate, gate_scale, up, up_scale)
    return layers.swiglu_hidden(x, gate, gate_scale, up, up_scale)


def lm_head_topk(x, w, k):
    if x.dtype == BF16 and w.dtype == BF16 and _decode_tokens(x) and x.shape[-1] % gemv.KGRAIN == 0 and k <= 64:
        from jtilert.pallas import lm_head
        return lm_head.lm_head_topk(x, w, k)
    return layers.lm_head_topk(x, w, k)


def _engine_topk(fallback):
    """`topk_positions` through the CUDA engine's one-launch top-k (jtilert.ffi.select) for decode
    token counts when the engine loads (on a GPU; built once on first use); `fallback` otherwise,
    or when JTILERT_FFI_TOPK=0. Checked on an H200 against `lax.top_k` (tests/gpu); in a 61-layer
    step there its kernels took 1.08 ms against lax.top_k's 3.14 ms (bench/RESULTS.md)."""
    def topk_positions(scores, k):
        from jtilert.ffi import _lib, select  # noqa: PLC0415
        if (scores.ndim == 2 and scores.shape[0] <= MAX_DECODE_TOKENS
                and os.environ.get("JTILERT_FFI_TOPK", "1") != "0"):
            lib, why = _lib.load()
            if lib is not None:
                return select.topk(scores, k)
            if why != _lib.NO_GPU:  # a GPU without the engine: say why the slower top-k runs
                _lib.warn_once("dispatch-topk", f"jtilert: the CUDA engine did not load ({why}); "
                                                "the indexer's top-k runs as lax.top_k")
        return fallback(scores, k)
    return topk_positions


def _attention_ops() -> dict:
    """Kernels from the attention modules of this package, when they exist and export the op."""
    found = {}
    for mod_name, names in (("attention", ("indexer_scores", "topk_positions", "sparse_mla")),
                            ("indexer", ("indexer_scores", "indexer_append_scores")), ("topk", ("topk_positions",)),
                            ("sparse_mla", ("sparse_mla",))):
        try:
            mod = importlib.import_module(f"jtilert.pallas.{mod_name}")
        except ImportError:
            continue
        for n in names:
            if hasattr(mod, n) and n not in found:
                found[n] = getattr(mod, n)
    return found


def ops() -> types.SimpleNamespace:
    table = dict(
        linear=linear,
        swiglu=swiglu,
        route=layers.route,
        moe_experts=layers.moe_experts,
        expert_hidden=layers.expert_hidden,
        swiglu_hidden=swiglu_hidden,
        indexer_scores=layers.indexer_scores,
        indexer_append_scores=layers.indexer_append_scores,
        topk_positions=layers.topk_positions,
        sparse_mla=layers.sparse_mla,
        lm_head_topk=lm_head_topk,
    )
    try:
        from jtilert.pallas import moe
        table.update(route=moe.route_op, moe_experts=moe.moe_experts_op, expert_hidden=moe.expert_hidden_op)
    except ImportError:
        pass
    table.update(_attention_ops())
    table.update(topk_positions=_engine_topk(table["topk_positions"]))
    return types.SimpleNamespace(**table)
