"""jtilert's CUDA engine behind XLA FFI custom calls (issue 6).

Public functions (all usable inside ``jax.shard_map`` over a mesh axis):

- ``all_reduce(x, axis_name)``: NVLink one-shot / two-shot all-reduce.
- ``gemv_all_reduce(x, w, scale, axis_name)``: persistent GEMV (bf16 or fp8
  block-scaled weights) fused with the all-reduce of its output.
- ``gemv(x, w, scale=None)``: the same GEMV kernel without communication.
- ``expert_down_all_reduce(h, weights, ids, down, down_scale, shared_h,
  shared_down, shared_scale, axis_name)``: the MoE down projections of the
  chosen experts (ids read on the device), their routing-weighted sum and the
  shared expert, fused with the all-reduce (the same kernel, K in segments).
- ``merge_topk(scores, indices, axis_name, k)``: global top-k of per-rank
  candidate lists, bit-identical on every rank.
- ``top_k(scores, k)`` / ``topk(scores, k)`` / ``split_topk(scores, k, axis_name)``: exact
  top-k on one GPU in one launch (``lax.top_k``'s result; ``topk`` is the drop-in for
  ``jtilert.layers.topk_positions``), and split over the ranks + ``merge_topk``
  (``jtilert.ffi.select``).
- ``available()``: whether the CUDA engine is usable in this process.

Without the built library (``python -m jtilert.ffi.build``; it is also built on
first use on a GPU machine with nvcc and cmake) or without a GPU, every
function falls back to the XLA path (``lax.psum``, ``jnp.dot``, all_gather +
sort) with one warning. Environment: JTILERT_FFI_DISABLE=1 forces the
fallback; JTILERT_FFI_LIB names a prebuilt library; JTILERT_FFI_AUTOBUILD=0
stops the build on first use; JTILERT_FFI_MAX_BYTES (default 1 MiB) bounds one
message; JTILERT_FFI_TIMEOUT_MS (default 30000) bounds every spin-wait.
"""

from jtilert.ffi._lib import load as _load
from jtilert.ffi.build import build
from jtilert.ffi.ops import (all_reduce, dequantize, expert_down_all_reduce, expert_down_reference,
                             gemv, gemv_all_reduce, gemv_reference, merge_topk, merge_topk_reference)
from jtilert.ffi.plan import GemvPlan, build_gemv_plan, check_gemv_plan
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
    "gemv_reference", "merge_topk", "merge_topk_reference", "split_topk", "top_k", "topk",
    "unavailable_reason",
]
