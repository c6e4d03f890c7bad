"""What the decode step runs: one `DecodeConfig`, and the one table that maps each op to its
plain-JAX reference (`jtilert.ops.reference`) and its kernel.

`Ops(config, axis)` is handed to the model's modules; every op a module calls goes through it, so
`Generator` → `Engine` → `Transformer.hidden(ops, ...)` → `ops.linear(...)` → `OPS["linear"]` →
`jtilert.pallas.gemv.linear` is the whole path from the user to a kernel.

Weights and caches are stacked per layer ([L, ...]); an op's `layer` argument (a `Layer`: a layer
loop's traced counter plus the call site's offset; or an int32 scalar) says which layer. A kernel
takes the stacked array and the layer's base and offset, adds them and addresses the layer itself;
the reference adds them and slices the layer out in XLA (a copy where the consumer is a library
call).

Choosing, per call: backend "reference" runs the reference. Backend "pallas" runs the kernel when the
call is decode-shaped (≤ `MAX_DECODE_TOKENS` tokens: more tokens are prefill, where XLA's matmuls are
the right tool, so the reference runs without a word) and the kernel supports the arrays; where it
does not, the reference runs and a warning names the op and the shapes, once per op and shape.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jtilert import ffi
from jtilert.ffi import _lib
from jtilert.ffi import moe as ffi_moe
from jtilert.ops import reference
from jtilert.ops.layer import Layer
from jtilert.pallas import index_prep, indexer, interpret, mla_prep, sparse_mla

BACKENDS = ("reference", "pallas")
LAYER_LOOPS = ("loop", "unrolled")
MAX_DECODE_TOKENS = 8
BF16, FP8, F32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
KGRAIN = 64   # the GEMV kernels' K granularity (TMA / swizzle)
QBLOCK = 128  # fp8 block-scale granularity


# DecodeConfig's default XLA options of the decode steps, sorted by name (see its docstring)
STEP_XLA_OPTIONS = (("xla_disable_hlo_passes", "rematerialization"),
                    ("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT"),
                    ("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"))


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How a model is run; given to `Generator` / `score` and passed down to every op.

    backend: "reference" (plain JAX) or "pallas" (Mosaic-GPU kernels where they apply; GPU interpret
        mode on a machine without a GPU).
    engine_all_reduce: with tp > 1, the CUDA engine's all-reduce fused into the row-split
        projections (o_proj, dense down, the MoE down) instead of XLA's psum.
    split_indexer: with tp > 1, each rank scores 1/tp of the cached positions and the top-k lists
        are merged (decode steps of one token).
    engine_topk: backend "pallas" on a GPU: the indexer's top-k through the CUDA engine's one-launch
        select instead of `lax.top_k`.
    layer_loop: how a step runs the layers of a stack. "loop": one `lax.while_loop` per stack (one
        compiled body: fast to compile); "unrolled": one copy of the layer per layer, the layer index
        a constant (no loop between the layers' kernels). Both read the same stacked arrays.
    layers_per_iteration: with layer_loop "loop", the layers in one loop iteration (the loop's trip):
        each iteration of a loop captured in the step's CUDA graph evaluates its condition on the device
        (two kernels and a conditional node), so fewer iterations cost less, and the body compiles
        this many copies of the layer (bench/RESULTS.md: session 14 measures 1, 2 and 4; sessions 53-55
        measure 8 against 4).
    xla_options: XLA compile options of the decode-shaped steps only (decode, MTP verify and draft, their
        device loops, which also record every thunk sequence into a CUDA graph where these options are
        given: `Engine.loop_options`; prefill chunks keep XLA's defaults), as (name, value) pairs or a
        dict. The default (`STEP_XLA_OPTIONS`) records the layer loops into the step's CUDA graph too
        (command buffers over WHILE and CONDITIONAL besides XLA's kernel kinds: one graph launch per call
        instead of one per layer, so the host enqueues a call in about a millisecond) and orders that
        graph by its buffers instead of serializing it, so a layer's independent kernels overlap (the indexer beside
        MLA's query path, the shared expert beside the routed ones). It also turns off XLA's
        rematerialization: where the weights and caches come near XLA's memory limit (a GPU's share
        of DeepSeek-V3.2 at 128K context) that pass recomputes the layer loop's index arithmetic
        next to each use, a kernel each, and it has nothing else to recompute in a decode step, whose
        temporaries are a few activations. () gives XLA's own options
        (bench/gpu_session.sh parts graphs and defaults measure them). XLA checks the names and values
        when it compiles.
    l2_prefetch: backend "pallas" with the CUDA engine: each layer, once its query projections are
        done, prefetches o_proj's weights into L2 (`jtilert.ffi.prefetch_l2`) while the indexer, the
        top-k and sparse MLA run, so o_proj reads them from L2. Off by default: bench/RESULTS.md has
        not measured it in the step yet.
    engine_moe: backend "pallas": a MoE layer's call of one decode token without tp and with the
        residual to add runs its routed and shared experts, their weighted sum and the residual add as
        one launch of the CUDA engine's `jtilert.ffi.moe.moe_decode` instead of the pallas path's four
        kernels (routed gate/up, routed down, shared gate/up, shared down); a decode-shaped call the
        engine does not take runs those four, with a warning once per shape and reason (prefill runs
        them without a word). Off by default: slower in the step (bench/RESULTS.md, session 25).
    token_ring: on a GPU where the CUDA engine loads, the decode steps that `Generator.stream` runs
        leave their new tokens in the engine's token ring (`jtilert.ffi.ring`, fixed pinned host memory
        the host reads) instead of returning them as an output: every output of a call is then a donated
        carried array, so XLA launches its command buffer without updating it for a moved output, and a
        call runs up to `STREAM_STEPS` steps on the device, the host reading each step's tokens as it
        ends. Elsewhere a call runs one step and returns its tokens (on a GPU where the engine does not
        load, with a warning once).
    ring_write_behind: with the token ring, each step of a stream call writes its tokens while the next
        step runs, before that step's sampling (the last step's after the call's loop), instead of at its
        own end, a program measured slower (bench/RESULTS.md, sessions 43-47). Not for models whose
        layers share indexers (their layers run conditionals, `Engine.ring_behind`): those write at each
        step's end, with a warning once.
    """

    backend: str = "reference"
    engine_all_reduce: bool = False
    split_indexer: bool = False
    engine_topk: bool = True
    layer_loop: str = "loop"
    layers_per_iteration: int = 8
    xla_options: tuple[tuple[str, str], ...] = STEP_XLA_OPTIONS
    l2_prefetch: bool = False
    engine_moe: bool = False
    token_ring: bool = True
    ring_write_behind: bool = True

    def __post_init__(self):
        opts = self.xla_options.items() if isinstance(self.xla_options, dict) else self.xla_options
        object.__setattr__(self, "xla_options", tuple(sorted((str(k), _option_value(v)) for k, v in opts)))
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected one of {BACKENDS}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"unknown layer_loop {self.layer_loop!r}; expected one of {LAYER_LOOPS}")
        if not isinstance(self.layers_per_iteration, int) or self.layers_per_iteration < 1:
            raise ValueError(f"layers_per_iteration must be an integer >= 1, got {self.layers_per_iteration!r}")


def _option_value(v):
    """An XLA option's value as XLA takes it: a bool or an int as such ("true" / "8" from a command line
    too), anything else as a string."""
    if isinstance(v, (bool, int)):
        return v
    v = str(v)
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    return int(v) if v.lstrip("-").isdigit() else v


# ---- the op table -------------------------------------------------------------------------------

def _tokens(x) -> int:
    """Tokens of a call: the leading axis of its first array (activations [T, K], queries [T, H, D],
    scores [T, S]): the other axes are features or heads, whatever their number."""
    return int(x.shape[0])


def _gemv_unsupported(x, w, scale) -> str | None:
    if x.dtype != BF16:
        return f"activations are {x.dtype}, the kernel takes bfloat16"
    if w.ndim != 2 or w.shape[1] != x.shape[-1] or x.shape[-1] % KGRAIN:
        return f"K={x.shape[-1]} must be a multiple of {KGRAIN}"
    if w.dtype not in (FP8, BF16, F32) or (w.dtype == FP8) != (scale is not None):
        return f"weights {w.dtype} (scales {'given' if scale is not None else 'none'})"
    return None


def _rmsnorm_gemv_unsupported(x, norm_weight, eps, w, scale) -> str | None:
    k = norm_weight.shape[-1]   # x may be wider: the kernel reads its first K columns
    if norm_weight.ndim != 1 or x.shape[-1] < k or (x.shape[-1] > k and x.shape[-1] % 8):
        return f"norm weight {norm_weight.shape} for x {list(x.shape)} (rows wider than K: a multiple of 8)"
    return _gemv_unsupported(jax.ShapeDtypeStruct((*x.shape[:-1], k), x.dtype), w, scale)


def _index_weights_unsupported(x, norm_weight, eps, w) -> str | None:
    if w.dtype != F32 or norm_weight.ndim != 1 or norm_weight.shape[0] != x.shape[-1]:
        return f"weights {w.dtype}{list(w.shape)} (fp32 taken), norm weight {norm_weight.shape} for x {list(x.shape)}"
    return _gemv_unsupported(x, w, None)


def _residual_gemv_unsupported(x, w, scale, residual) -> str | None:
    if residual.dtype != BF16 or residual.shape != (*x.shape[:-1], w.shape[0]):
        return f"residual {residual.dtype}{list(residual.shape)}, the kernel takes bfloat16 [T, N]"
    return _gemv_unsupported(x, w, scale)


def _swiglu_unsupported(x, gate, gate_scale, up, up_scale, *norm) -> str | None:
    if gate.dtype != up.dtype:
        return "gate and up differ in format"
    return _gemv_unsupported(x, gate, gate_scale) or _gemv_unsupported(x, up, up_scale)


def _heads_unsupported(x, w, scale, block, head_dim=None) -> str | None:
    k = w.shape[-1]
    d = x.shape[-1] if head_dim is None else head_dim
    if x.dtype != BF16 or k % KGRAIN or d < k or x.shape[-1] % 8:
        return f"activations {x.dtype}{list(x.shape)}, K={k} (a multiple of {KGRAIN} is needed)"
    if w.dtype not in (FP8, BF16) or (w.dtype == FP8) != (scale is not None):
        return f"weights {w.dtype} (scales {'given' if scale is not None else 'none'})"
    return None


def _experts_unsupported(x, gate, gate_scale, up) -> str | None:
    if x.dtype != BF16 or x.shape[-1] % KGRAIN:
        return f"activations {x.dtype}, K={x.shape[-1]}"
    if gate.dtype not in (FP8, BF16) or up.dtype != gate.dtype or (gate.dtype == FP8) != (gate_scale is not None):
        return f"expert weights {gate.dtype}"
    if gate.shape[1] % QBLOCK:
        return f"expert width {gate.shape[1]} is not a multiple of {QBLOCK}"
    return None


def _shared_expert_unsupported(x, gate, gate_scale, up, up_scale, norm_weight, eps, down, down_scale,
                               residual) -> str | None:
    h = jax.ShapeDtypeStruct((*x.shape[:-1], gate.shape[0]), BF16)
    return (_swiglu_unsupported(x, gate, gate_scale, up, up_scale)
            or _residual_gemv_unsupported(h, down, down_scale, residual))


def _route_unsupported(x) -> str | None:
    return None if x.dtype == BF16 and x.shape[-1] % KGRAIN == 0 else f"activations {x.dtype}, K={x.shape[-1]}"


def _moe_unsupported(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual=None) -> str | None:
    if residual is not None and (residual.dtype != BF16 or residual.shape != (x.shape[0], down.shape[-2])):
        return f"residual {residual.dtype}{list(residual.shape)}, the kernel takes bfloat16 [T, {down.shape[-2]}]"
    return (_experts_unsupported(x, gate, gate_scale, up)
            or (None if down.dtype in (FP8, BF16) and (down.dtype == FP8) == (down_scale is not None)
                else f"down weights {down.dtype}"))


def _engine_moe_unsupported(axis, f, weights, ids, experts, shared, residual, layer) -> str | None:
    """Why `Ops.moe` does not hand this call to the engine's one-launch MoE (None: it does): the
    kernel computes one token without tp, adds the residual, and reads layer `layer` of the stacks."""
    if axis is not None:
        return f"tp over axis {axis!r}"
    if _tokens(f) != 1:
        return f"{_tokens(f)} tokens (it takes one)"
    if residual is None:
        return "no residual to add"
    return _unstacked(layer) or ffi_moe.unsupported(f, weights, ids, experts, shared, residual)


def _unstacked(layer) -> str | None:
    """Why an engine kernel that reads its layer of the weight stacks cannot take a call without one."""
    return "weights not stacked per layer (no layer index)" if layer is None else None


def _lm_head_unsupported(x, w, k) -> str | None:
    if x.dtype != BF16 or w.dtype != BF16 or x.shape[-1] % KGRAIN:
        return f"activations {x.dtype}, head {w.dtype}, K={x.shape[-1]}"
    return None if k <= 64 else f"k={k} > 64"


def _sparse_mla_unsupported(q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype=F32) -> str | None:
    return sparse_mla.unsupported(q_lat.shape[-2], q_lat.shape[-1], q_pe.shape[-1],
                                  kv_cache.shape[-1] if pe_cache is None else None)


def _sparse_mla_heads_unsupported(q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, w, w_scale,
                                  block) -> str | None:
    why = sparse_mla.heads_linear_unsupported(q_lat.shape[-2], q_lat.shape[-1], q_pe.shape[-1], idx.shape[-1],
                                              pe_cache is None, block, out_dtype)
    if why is None and (w.shape[-3] != q_lat.shape[-2] or w.shape[-1] != q_lat.shape[-1]):
        why = f"W_uv {list(w.shape)} for {q_lat.shape[-2]} heads of {q_lat.shape[-1]} latent columns"
    if why is None and (w.dtype not in (FP8, BF16) or (w.dtype == FP8) != (w_scale is not None)):
        why = f"W_uv {w.dtype} (scales {'given' if w_scale is not None else 'none'})"
    return why


def _indexer_unsupported(cfg, q, w, k, k_cache, k_scale, positions, start) -> str | None:
    return indexer.unsupported(q.shape[0], q.shape[1], k_cache, k_scale)


def _attention_out_unsupported(q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, w, w_scale, block, wo,
                               wo_scale, residual) -> str | None:
    t, heads, n = q_lat.shape[0], w.shape[-3], w.shape[-2]
    if t != 1:
        return f"{t} tokens (the phases' units fit the SMs for one)"
    return (_sparse_mla_heads_unsupported(q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, w, w_scale, block)
            or _residual_gemv_unsupported(jax.ShapeDtypeStruct((t, heads * n), BF16), wo, wo_scale, residual)
            or sparse_mla.attention_out_unsupported(q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, w, w_scale,
                                                    block, wo, wo_scale, residual))


def _mla_prep_unsupported(q_x, kv_x, kv_col, heads, qk_head_dim, norm_weight, eps, cos, sin, kv_cache, pe_cache,
                          start) -> str | None:
    return mla_prep.unsupported(q_x.shape[0], heads, qk_head_dim, 2 * cos.shape[-1], norm_weight.shape[-1],
                                q_x.shape[-1], kv_x.shape[-1], kv_cache, pe_cache,
                                q_x.dtype if q_x.dtype == kv_x.dtype else kv_x.dtype)


def _index_prep_unsupported(cfg, q_x, q_col, k_x, k_col, norm_weight, norm_bias, eps, cos, sin, w) -> str | None:
    return index_prep.unsupported(q_x.shape[0], cfg.index_n_heads, cfg.index_head_dim, 2 * cos.shape[-1],
                                  cfg.index_quant, q_x.shape[-1], q_col, k_x.shape[-1], k_col,
                                  q_x.dtype if q_x.dtype == k_x.dtype else k_x.dtype)


@dataclasses.dataclass(frozen=True)
class Op:
    """One op: its reference, its kernel ("module:function" under jtilert, taking `layer=`), which
    positional arguments carry the layer axis, and why the kernel would not apply (None: it does).
    `in_place`: the op writes rows into stacked caches, so its reference too takes the whole stacks
    and `layer=` (only the kernel checks see one layer of them)."""

    reference: Callable
    kernel: str | None = None
    stacked: tuple[int, ...] = ()
    unsupported: Callable[..., str | None] = lambda *a: None
    in_place: bool = False


OPS: dict[str, Op] = {
    "linear": Op(reference.linear, "pallas.gemv:linear", (1, 2), _gemv_unsupported),
    # the norm's weight folded into the GEMV's B operand, its 1/rms in the epilogue
    "rmsnorm_linear": Op(reference.rmsnorm_linear, "pallas.gemv:rmsnorm_linear", (1, 3, 4), _rmsnorm_gemv_unsupported),
    # the indexer's head weights (fp32) of the layer's input, normed by the kernel (index_prep reads the
    # first H columns of its rows, padded to whole blocks)
    "index_weights": Op(reference.index_weights, "pallas.gemv:index_weights", (1, 3), _index_weights_unsupported),
    "linear_residual": Op(reference.linear_residual, "pallas.gemv:linear_residual", (1, 2), _residual_gemv_unsupported),
    "heads_linear": Op(reference.heads_linear, "pallas.gemv:heads_linear", (1, 2), _heads_unsupported),
    # the dense FFN's norm (weight and eps after the other arguments; None: x is normed already)
    # applied by the kernel while its first weight tiles arrive
    "swiglu_hidden": Op(reference.swiglu_hidden, "pallas.gemv:swiglu_pair", (1, 2, 3, 4, 5), _swiglu_unsupported),
    "route": Op(reference.route, "pallas.moe:route", (2, 3), lambda cfg, x, gate, bias: _route_unsupported(x)),
    # a MoE layer's norm applied by the router's kernel, which writes the normed x for the experts
    "norm_route": Op(reference.norm_route, "pallas.moe:norm_route", (2, 4, 5),
                     lambda cfg, x, nw, eps, gate, bias: _route_unsupported(x)),
    # the residual (last argument, may be None) added in the down kernel's epilogue; gate/up and down as two
    # phases of one kernel where they fit the SMs (one decode token), else two kernels
    "moe_experts": Op(reference.moe_experts, "pallas.moe:moe_experts", (3, 4, 5, 6, 7, 8), _moe_unsupported),
    # residual + the shared expert (its norm's weight and eps after gate/up): its down kernel finishes the
    # gate/up kernel's partials itself
    "shared_expert": Op(reference.shared_expert, "pallas.moe:shared_expert", (1, 2, 3, 4, 5, 7, 8),
                        _shared_expert_unsupported),
    "expert_hidden": Op(reference.expert_hidden, "pallas.moe:expert_gate_up", (2, 3, 4, 5),
                        lambda x, ids, g, gs, u, us: _experts_unsupported(x, g, gs, u)),
    # its reference path is in Ops.indexer_topk (an in-place write into the stack, then the scores)
    # the kernel's own choice: one launch that appends and scores, or (split indexer, key rows shorter
    # than a 128-byte TMA) XLA's in-place append and the scoring kernel
    "indexer_append_scores": Op(reference.indexer_append_scores, "pallas.indexer:indexer_append_scores", (4, 5),
                                _indexer_unsupported),
    "sparse_mla": Op(reference.sparse_mla, "pallas.sparse_mla:sparse_mla", (2, 3), _sparse_mla_unsupported),
    # sparse MLA then W_uv per head, the attention's splits merged in W_uv's kernel (no combine kernel);
    # `Ops.sparse_mla_heads_linear` runs the two ops above instead where it does not apply
    "sparse_mla_heads_linear": Op(reference.sparse_mla_heads_linear, "pallas.sparse_mla:sparse_mla_heads_linear",
                                  (2, 3, 7, 8), _sparse_mla_heads_unsupported),
    # the same, then o_proj with the residual: W_uv and o_proj as two phases of one kernel (one token)
    "attention_out": Op(reference.attention_out, "pallas.sparse_mla:attention_out", (2, 3, 7, 8, 10, 11),
                        _attention_out_unsupported),
    # q_pe and k_pe rope, the latent's norm, both cache rows (bf16 caches; the fp8 packed one: the reference)
    "mla_prep": Op(reference.mla_prep, "pallas.mla_prep:mla_prep", (5, 9, 10), _mla_prep_unsupported, in_place=True),
    # the indexer's key norm, q and k rope, their Hadamard rotation, q's fp8 quantisation (its scales into w)
    "index_prep": Op(reference.index_prep, "pallas.index_prep:index_prep", (5, 6), _index_prep_unsupported),
    "lm_head_topk": Op(reference.lm_head_topk, "pallas.lm_head:lm_head_topk", (), _lm_head_unsupported),
    "topk_positions": Op(reference.topk_positions, "ffi.select:topk", ()),
}


def ops_identity() -> tuple:
    """What OPS runs now, for the program cache's keys: each op's reference and kernel by name. A
    reference from outside jtilert (a benchmark's variant put into the table) also carries a hash of
    its source, which jtilert's source digest does not see; with it, a program traced with a
    replaced op is never read back for the library's own, nor the other way round."""
    def name(fn) -> str:
        mod = getattr(fn, "__module__", "") or ""
        out = f"{mod}.{getattr(fn, '__qualname__', repr(fn))}"
        if not mod.startswith("jtilert"):
            try:
                src = inspect.getsource(fn).encode()
            except (OSError, TypeError):
                code = getattr(fn, "__code__", None)
                src = repr(fn).encode() if code is None else code.co_code + repr(code.co_consts).encode()
            out += ":" + hashlib.sha256(src).hexdigest()[:16]
        return out
    return tuple((k, name(op.reference), op.kernel, op.stacked) for k, op in sorted(OPS.items()))


def _per_layer(op: Op, args) -> tuple:
    """args with each stacked array replaced by the shape of one layer of it (for the checks)."""
    return tuple(jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if i in op.stacked and a is not None else a
                 for i, a in enumerate(args))


def _take(a, index):
    return None if a is None else a[index]


@functools.cache
def _kernel(path: str) -> Callable:
    """The kernel function behind `jax.jit`, its non-array arguments static: JAX lowers a jitted
    callee once per signature and reuses it, so a kernel called from several places of a step (the
    dense and MoE loop bodies, every layer of an unrolled step) is lowered once (lowering a Mosaic
    kernel takes seconds). The interpret parameters key the cache: kernels traced for the GPU and
    for the interpreter are different programs."""
    mod, fn = path.split(":")
    fn = getattr(importlib.import_module(f"jtilert.{mod}"), fn)

    def call(*args, **kwargs):
        static = tuple(i for i, a in enumerate(args) if not _is_array(a))
        names = tuple(k for k, v in kwargs.items() if not _is_array(v))
        return _jitted(fn, static, names, interpret.params())(*args, **kwargs)
    return call


def _layer_argument(layer) -> Layer:
    """A kernel's layer as the jitted kernel's argument: base and offset int32 scalars, neither weakly
    typed. A jitted kernel is traced (and lowered) once per argument type, so every call site shares
    one lowering of each kernel: the offset is an argument, not a constant of the trace, and a weakly
    typed base (a Python int, say) would be another type."""
    layer = Layer.of(layer)
    return Layer(jnp.asarray(layer.base, jnp.int32), np.int32(layer.offset))


def _is_array(x) -> bool:
    return x is None or isinstance(x, (jax.Array, np.ndarray, Layer)) or (
        isinstance(x, (tuple, list)) and all(map(_is_array, x)))


@functools.cache
def _jitted(fn, static, static_names, mode):
    return jax.jit(fn, static_argnums=static, static_argnames=static_names)


def _refused(name: str, args, e: ValueError) -> None:
    shapes = _shapes(args)
    _lib.warn_once(f"ops:{name}:{shapes}", f"jtilert: backend='pallas' but the {name} kernel does not apply to "
                   f"{shapes} ({e}); running the reference", UserWarning, stacklevel=5)


def _shapes(args) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in args if hasattr(a, "shape") and hasattr(a, "dtype"))


# ---- the ops a model calls ----------------------------------------------------------------------

class Ops:
    """The decode step's ops under one DecodeConfig; `axis` is the tensor-parallel mesh axis while
    the step is traced under shard_map (None without tp)."""

    def __init__(self, config: DecodeConfig = DecodeConfig(), axis: str | None = None):
        self.config, self.axis = config, axis
        self._kernels = config.backend == "pallas"
        self._engine_topk = self._kernels and config.engine_topk and _engine_loads()

    def __call__(self, name: str, *args, layer=None):
        """Run op `name` on one layer (`layer` given: the stacked arguments of OPS[name] carry it)."""
        op = OPS[name]
        if self._use_kernel(name, op, args if layer is None else _per_layer(op, args)):
            return self._run_kernel(name, op, args, layer)
        return self._run_reference(op, args, layer)

    def _run_kernel(self, name: str, op: Op, args, layer):
        """The kernel of `op`, whose table condition has said it applies; where the kernel's own checks
        refuse the shapes (a model too small for its tiles, say), the reference, with a warning."""
        kw = {} if layer is None or not op.stacked else {"layer": _layer_argument(layer)}
        try:
            return _kernel(op.kernel)(*args, **kw)
        except ValueError as e:
            _refused(name, args, e)
        return self._run_reference(op, args, layer)

    @staticmethod
    def _run_reference(op: Op, args, layer):
        index = None if layer is None else Layer.of(layer).index()
        if op.in_place:
            return op.reference(*args, layer=index)
        if index is not None:
            args = tuple(_take(a, index) if i in op.stacked else a for i, a in enumerate(args))
        return op.reference(*args)

    def _use_kernel(self, name: str, op: Op, args) -> bool:
        if not self._kernels or op.kernel is None:
            return False
        x = next(a for a in args if hasattr(a, "shape") and a.ndim >= 2)
        if name == "topk_positions":
            return self._engine_topk and x.shape[0] <= MAX_DECODE_TOKENS
        if _tokens(x) > MAX_DECODE_TOKENS:
            return False
        why = op.unsupported(*args)
        if why is not None:
            _refused(name, args, ValueError(why))
        return why is None

    # the ops with more than one kernel, and the tensor-parallel collectives ---------------------

    def linear(self, x, w, scale, layer=None):
        return self("linear", x, w, scale, layer=layer)

    def prefetch(self, layer, after, *stacks):
        """`DecodeConfig.l2_prefetch`: an L2 prefetch of layer `layer` of the weight stacks (None
        entries skipped), issued once `after` is computed; nothing where it is off or there is no
        traced layer. The call is side-effecting: it stays in the step without a consumer and runs
        beside the kernels that follow `after`."""
        if self.config.l2_prefetch and self.config.backend == "pallas" and layer is not None:
            ffi.prefetch_l2(layer, after, *[a for a in stacks if a is not None])

    def all_reduce(self, x):
        """Sum of the ranks' partial results: THE all-reduce of the model (identity without tp)."""
        if self.axis is None:
            return x
        if self.config.engine_all_reduce:
            return ffi.all_reduce(x, self.axis)
        return jax.lax.psum(x, self.axis)

    def linear_all_reduce(self, x, w, scale, layer=None, residual=None):
        """all_reduce(x · Wᵀ) for a row-split projection, plus `residual` where given. With the engine,
        one decode token goes through the fused kernel that streams W and exchanges finished output
        tiles while it streams. Without tp the residual is added in the GEMV's epilogue (one kernel)."""
        if residual is not None and self.axis is None:
            return self("linear_residual", x, w, scale, residual, layer=layer)
        if self.axis is not None and self.config.engine_all_reduce and x.shape[0] == 1:
            y = ffi.gemv_all_reduce(x[0], w, scale, self.axis, layer=layer)[None]
        else:
            y = self.all_reduce(self.linear(x, w, scale, layer))
        return y if residual is None else residual + y

    def mlp(self, x, arrays, layer=None, residual=None, norm=(None, 0.0)):
        """Dense SwiGLU of one layer (arrays: gate, gate_scale, up, up_scale, down, down_scale) on x
        normed by `norm` (its weight stack and eps; weight None: x as given), plus `residual` where
        given."""
        g, gs, u, us, d, ds = arrays
        hidden = self("swiglu_hidden", x, g, gs, u, us, *norm, layer=layer)
        return self.linear_all_reduce(hidden, d, ds, layer, residual=residual)

    def _engine_applies(self, flag: str, name: str, x, w, unsupported) -> bool:
        """Whether DecodeConfig.<flag> asks for the engine's kernel of op `name` on this decode-shaped
        call and it applies (`unsupported()`: None, else why not); where it was asked for and does not
        apply, a warning once per shape (x's and w's) and reason."""
        if not (getattr(self.config, flag) and self._kernels and _tokens(x) <= MAX_DECODE_TOKENS):
            return False
        why = unsupported()
        if why is not None:
            shapes = _shapes((x, w))
            _lib.warn_once(f"ops:{flag}:{shapes}:{why}", f"jtilert: {flag} but the engine's kernel does not "
                           f"take {name} on {shapes} ({why}); running the pallas path", UserWarning)
        return why is None

    def moe(self, x, weights, ids, experts: tuple, shared: tuple, layer=None, residual=None, norm=(None, 0.0),
            x_normed=None):
        """all_reduce(Σ_j weights[t,j] · Expert_{ids[t,j]}(f[t]) + Shared(f[t])) for this rank's slices,
        plus `residual` where given, where f is x normed by `norm` (as in `mlp`). With a norm, `x_normed`
        is f as another kernel wrote it (the router's, `norm_route`), which the routed experts read;
        the shared expert norms x itself, so it runs while the router and the selection do. Without
        tp the residual goes into the shared expert's down projection and that sum into the routed
        down's epilogue (no add of its own). With the engine, one decode token runs the experts'
        gate/up, then one kernel for the routed down projections, their weighted sum, the shared
        expert's down and the all-reduce."""
        if (norm[0] is None) != (x_normed is None):
            raise ValueError("moe: a norm goes with the normed input the router wrote, and only with it")
        f = x if x_normed is None else x_normed
        if self._engine_applies("engine_moe", "moe", f, experts[0], lambda: _engine_moe_unsupported(
                self.axis, f, weights, ids, experts, shared, residual, layer)):
            return ffi_moe.moe_decode(f, weights, ids, experts, shared, residual, layer)
        g, gs, u, us, d, ds = experts
        sg, sgs, su, sus, sd, sds = shared
        if self.axis is None and residual is not None:
            base = self("shared_expert", x, sg, sgs, su, sus, *norm, sd, sds, residual, layer=layer)
            return self("moe_experts", f, weights, ids, *experts, base, layer=layer)
        hs = self("swiglu_hidden", x, sg, sgs, su, sus, *norm, layer=layer)
        if self.axis is not None and self.config.engine_all_reduce and x.shape[0] == 1:
            h = self("expert_hidden", f, ids, g, gs, u, us, layer=layer)
            out = ffi.expert_down_all_reduce(h, weights[0], ids[0], d, ds, hs[0], sd, sds, self.axis,
                                             layer=layer)[None]
            return out if residual is None else residual + out
        if self.axis is None:
            return self("moe_experts", f, weights, ids, *experts, self.linear(hs, sd, sds, layer), layer=layer)
        routed = self("moe_experts", f, weights, ids, *experts, None, layer=layer)
        out = self.all_reduce(routed + self.linear(hs, sd, sds, layer))
        return out if residual is None else residual + out

    def sparse_mla_heads_linear(self, q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, w_uv: tuple, layer,
                                w_stacked: bool):
        """Sparse MLA over layer `layer` of the caches, its output in `out_dtype` through every head's
        W_uv (w_uv: weight, scale, block; `w_stacked`: stacks read at `layer` too, else one layer's
        weights) → [T, H, N]. With the kernels, one op whose GEMV merges the attention's splits itself
        where it applies (stacked W_uv, bf16 caches), else op "sparse_mla" then op "heads_linear"
        (each still its kernel where it applies)."""
        args = (q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, *w_uv)
        op = OPS["sparse_mla_heads_linear"]
        if (self._kernels and op.kernel is not None and w_stacked and _tokens(q_lat) <= sparse_mla.MAX_TOKENS
                and op.unsupported(*_per_layer(op, args)) is None):
            return self._run_kernel("sparse_mla_heads_linear", op, args, layer)
        o_lat = self("sparse_mla", q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, layer=layer)
        return self("heads_linear", o_lat, *w_uv, layer=layer if w_stacked else None)

    def attention_out(self, q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, w_uv: tuple, wo: tuple, layer,
                      w_stacked: bool, residual):
        """residual + o_proj of `sparse_mla_heads_linear`'s heads as one row (wo: weight, scale). With the
        kernels, one op (W_uv and o_proj as two phases of one kernel) where it applies (one token without
        tp, stacked W_uv, bf16 caches), else `sparse_mla_heads_linear` then `linear_all_reduce`."""
        args = (q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, *w_uv, *wo, residual)
        op = OPS["attention_out"]
        if (self._kernels and op.kernel is not None and self.axis is None and w_stacked
                and op.unsupported(*_per_layer(op, args)) is None):   # (one token: the op's condition)
            return self._run_kernel("attention_out", op, args, layer)
        o = self.sparse_mla_heads_linear(q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, w_uv, layer, w_stacked)
        return self.linear_all_reduce(o.reshape(o.shape[0], -1), *wo, layer, residual=residual)

    def indexer_rows(self, rows: int, tokens: int):
        """(first row, count) of this rank's share of the index-key cache when the indexer is split
        (one decode token, rows divisible by tp), else (None, None): every rank scores every row."""
        if self.axis is None or not self.config.split_indexer or tokens != 1 or rows % jax.lax.axis_size(self.axis):
            return None, None
        n = rows // jax.lax.axis_size(self.axis)
        return jax.lax.axis_index(self.axis) * n, n

    def indexer_topk(self, cfg, q, w, k, k_cache, k_scale, positions, start, layer):
        """Append the new index keys k [T, D] (`index_prep`'s: Hadamard-rotated fp32 in fp8 mode) at row
        `start` of layer `layer` of the stacked key cache and select the top-k cached positions:
        (indices [T, k] with -1 for masked positions, k_cache, k_scale). Under a split indexer each rank
        scores its share of the rows and the ranks' top-k lists are merged."""
        first, num = self.indexer_rows(k_cache.shape[1], q.shape[0])
        op = OPS["indexer_append_scores"]
        args = (cfg, q, w, k, k_cache, k_scale, positions, start)
        if self._use_kernel("indexer_append_scores", op, _per_layer(op, args)):
            scores, k_cache, k_scale = _kernel(op.kernel)(*args, first, num, layer=_layer_argument(layer))
        else:   # XLA appends the key in place, then the reference scores the layer's rows
            index = Layer.of(layer).index()
            k8, ks = reference.indexer_key(cfg, k)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k8[None].astype(k_cache.dtype), (index, start, 0))
            if ks is not None:
                k_scale = jax.lax.dynamic_update_slice(k_scale, ks[None], (index, start))
            scores = reference.indexer_scores(q, w, k_cache[index], _take(k_scale, index), positions)
            if num is not None:
                scores = jax.lax.dynamic_slice_in_dim(scores, first, num, axis=1)
        if num is None:
            return self("topk_positions", scores, cfg.index_topk), k_cache, k_scale
        vals, idx = ffi.split_topk(scores[0], cfg.index_topk, self.axis)
        return reference.empty_as_minus_one(vals, idx)[None], k_cache, k_scale

    def all_gather_last(self, x):
        """Concatenate the ranks' slices of the last axis (vocab-split logits)."""
        if self.axis is None:
            return x
        return jax.lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)

    def top_candidates(self, vals, ids, rows: int):
        """The global top-k of a vocab-split head from every rank's own top-k (values [T, k], ids of
        its `rows` vocab rows): (values, global vocab ids), descending, ties to the lower id."""
        if self.axis is None:
            return vals, ids
        ids = ids + jax.lax.axis_index(self.axis) * rows
        # gathered in rank order = vocab order, so top_k's lower-position tie rule is the lower id
        vals, ids = (jax.lax.all_gather(a, self.axis, axis=1, tiled=True) for a in (vals, ids))
        top, pos = jax.lax.top_k(vals, vals.shape[1] // jax.lax.axis_size(self.axis))
        return top, jnp.take_along_axis(ids, pos, axis=1)


def _engine_loads() -> bool:
    """Whether the CUDA engine's top-k can run here (a GPU where the engine builds and loads); warns
    once on a GPU where it does not."""
    lib, why = _lib.load()
    if lib is None and why != _lib.NO_GPU:
        _lib.warn_once("ops-topk", f"jtilert: the CUDA engine did not load ({why}); the indexer's top-k runs "
                                   "as lax.top_k")
    return lib is not None
