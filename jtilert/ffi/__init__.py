"""jtilert's CUDA engine behind XLA FFI custom calls (all ops usable inside ``jax.shard_map``).

- ``all_reduce(x, axis_name)``: NVLink one-shot / two-shot all-reduce.
- ``gemv_all_reduce(x, w, scale, axis_name)`` / ``gemv(x, w, scale)``: persistent GEMV (bf16, or
  fp8 with block scales) with / without the all-reduce of its output fused in.
- ``expert_down_all_reduce(h, weights, ids, down, ..., axis_name)``: the chosen MoE experts' down
  projections (ids read on the device), their weighted sum and the shared expert, all-reduced.
  These three take ``layer=`` (int32, may be traced) with stacked [L, ...] weights: the kernel
  offsets its weight pointers by the layer it reads on the device (no XLA copy of ``w[layer]``).
- ``merge_topk``, ``top_k`` / ``topk`` / ``split_topk``: exact top-k (``jtilert.ffi.select``).
- ``route.select_experts(cfg, partials, bias, layer)``: the MoE router's selection in one launch
  (``jtilert.ffi.route``).
- ``moe.moe_decode(f, weights, ids, experts, shared, residual, layer)``: a MoE layer's routed and
  shared experts for one token in one persistent launch (``jtilert.ffi.moe``; the decode step's
  with ``DecodeConfig.engine_moe``).
- ``prefetch_l2(layer, after, *stacks)``: L2 prefetch of one layer of up to 8 weight stacks, issued
  after ``after``, kept without a consumer (a side-effecting call); ``ordered(x, token)`` orders a
  consumer after a token where one must wait (``jtilert.ffi.prefetch``; a no-op without the engine).

Without the library (``python -m jtilert.ffi.build``, or built on first use) or a GPU, every op
falls back to the XLA path with one warning. Environment: JTILERT_FFI_DISABLE=1, JTILERT_FFI_LIB,
JTILERT_FFI_AUTOBUILD=0, JTILERT_FFI_MAX_BYTES (1 MiB/message), JTILERT_FFI_TIMEOUT_MS (30000 ms).
"""

from jtilert.ffi._lib import load as _load
from jtilert.ffi.build import build
from jtilert.ffi.ops import (all_reduce, dequantize, expert_down_all_reduce, expert_down_reference,
                             gemv, gemv_all_reduce, gemv_reference, merge_topk, merge_topk_reference)
from jtilert.ffi.plan import GemvPlan, build_gemv_plan, check_gemv_plan
from jtilert.ffi.prefetch import ordered, prefetch_l2
from jtilert.ffi.select import split_topk, top_k, topk


def available() -> bool:
    """True if the CUDA engine is loaded (GPU present, library built/loadable)."""
    lib, _ = _load()
    return lib is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False ('' when it is True)."""
    _, why = _load()
    return why


__all__ = [
    "GemvPlan", "all_reduce", "available", "build", "build_gemv_plan", "check_gemv_plan",
    "dequantize", "expert_down_all_reduce", "expert_down_reference", "gemv", "gemv_all_reduce",
    "gemv_reference", "merge_topk", "merge_topk_reference", "ordered", "prefetch_l2", "split_topk",
    "top_k", "topk", "unavailable_reason",
]
