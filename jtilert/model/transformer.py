"""The decoder as Flax (nnx) modules: MLA with the absorbed decode formulation and a latent cache,
the DSA lightning indexer, dense SwiGLU and the sigmoid-routed MoE, the lm head and the MTP block.

Weights are stacked per layer group, each weight kind one array [L, ...]:
  `layers`   attention and norms of every layer, the MTP block's layer last (index num_hidden_layers);
  `indexers` the lightning indexers of the layers that run their own ("full"; GLM-5.2's "shared"
             layers reuse the previous top-k and have none);
  `dense`    the dense SwiGLU of the first `first_k_dense_replace` layers;
  `moe`      router, routed and shared experts of the remaining layers (the MTP layer's last).
The caches are stacked the same way (`init_cache`). A step loops over the layers (`_layers`: one
loop for the dense layers, one for the MoE layers, each trip a few layers); every op gets the stacked
arrays and the layer as a `Layer` (the loop's counter plus the layer's place in the trip, which the
kernels add themselves), so no layer is ever copied out of its stack and no index is computed
between the loop and the kernels.

Every step takes T new tokens at positions start..start+T-1 (T = 1 when decoding, 2 in an MTP verify
step, a chunk in prefill), writes them into the preallocated caches and attends over the caches.
The same code runs unsharded and as one rank of a tensor-parallel mesh: local sizes (heads, expert
width, vocab) are read off the weights, and partial sums go through `Ops.all_reduce`.
Parameter names follow the HF checkpoint keys within a layer (`layer_name` maps them).
"""

from __future__ import annotations

import functools
import numbers
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jtilert.ops import reference
from jtilert.parallel import sharding
from jtilert.model.config import ModelConfig
from jtilert.model.presets import preset
from jtilert.ops.layer import Layer
from jtilert.ops.table import Ops
from jtilert.ops.quant import BLOCK, dequantize, quantize_weight
from jtilert.runtime.sampling import sample

F32 = jnp.float32
WEIGHT_FORMATS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.bfloat16}
HEAD_CANDIDATES = 8  # top logits the head hands to decode sampling (greedy, or top_k ≤ 8)
SUBLAYER_EPS = 1e-6  # q_a / kv_a layernorms and the indexer's k_norm use a fixed eps in both model families


def check_format(fmt: str) -> None:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"fmt {fmt!r}: expected one of {', '.join(WEIGHT_FORMATS)}")


def compute_dtype(fmt: str):
    """Activation dtype for a weight format: fp32 weights compute in fp32, bf16 and fp8 in bf16."""
    return WEIGHT_FORMATS[fmt]


class Linear(nnx.Module):
    """y = x · Wᵀ, W [out, in] (or stacked [E, out, in] for experts) in fp32/bf16, or fp8 with 128×128
    block scales. Inside a layer stack every array has the layer axis in front."""

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, fmt: str = "bf16",
                 quantizable: bool = True, experts: int = 0, std: float | None = None):
        shape = ((experts,) if experts else ()) + (out_features, in_features)
        w = jax.random.normal(rngs.params(), shape, F32) * (std or in_features**-0.5)
        if fmt == "fp8" and quantizable:
            q, s = quantize_weight(w)
            self.weight, self.scale = nnx.Param(q), nnx.Param(s)
        else:
            self.weight, self.scale = nnx.Param(w.astype(WEIGHT_FORMATS[fmt])), None

    @property
    def scale_or_none(self):
        return None if self.scale is None else self.scale[...]

    def arrays(self) -> tuple:
        return self.weight[...], self.scale_or_none

    def __call__(self, ops: Ops, x: jax.Array, layer=None, norm: "RMSNorm | None" = None) -> jax.Array:
        """x · Wᵀ; with `norm`, norm(x) · Wᵀ as one op (`rmsnorm_linear`: one GEMV kernel)."""
        if norm is None:
            return ops.linear(x, self.weight[...], self.scale_or_none, layer)
        return ops("rmsnorm_linear", x, norm.weight[...], norm.eps, self.weight[...], self.scale_or_none, layer=layer)


class RowsLinear(Linear):
    """Several projections of the same input as one Linear over their weights concatenated by rows
    (`decode_weights` builds it once, `_rows_linear`): `parts` are the (first row, rows) of each
    projection's output in the result, every part of an fp8 weight but the last starting on a 128-row
    scale block, so each block scale stays one projection's (the padding rows are zeros).
    `ranks`: where some of the projections are split over the tensor-parallel ranks (qr_proj's q_b),
    the ranks its rows are laid out for: one block of rows per rank (the rank's rows of the split
    projections, all rows of the replicated ones), the blocks split over the ranks, and `parts` places
    in one block (what a rank's step sees). 1 where every projection is replicated (any tp)."""

    def __init__(self, weight, scale, parts: tuple[tuple[int, int], ...], ranks: int = 1):
        self.weight = nnx.Param(weight)
        self.scale = None if scale is None else nnx.Param(scale)
        self.parts = tuple(parts)
        self.ranks = ranks

    def split(self, y: jax.Array) -> list[jax.Array]:
        return [y[..., a:a + n] for a, n in self.parts]

    def leading(self, y: jax.Array, j: int) -> jax.Array:
        """y itself, for an op that reads part j as the first columns of a wider x (a kernel then
        reads it in place: a slice passed to a kernel becomes a DynamicSliceFusion, which keeps XLA
        from capturing the layer loop as one CUDA graph). ValueError unless part j is at column 0."""
        if self.parts[j][0] != 0:
            raise ValueError(f"part {j} of {self.parts} starts at column {self.parts[j][0]}, not 0")
        return y


class FFNNorm(nnx.Module):
    """An FFN stack's input norm (the layers' post-attention RMSNorm, stacked like the FFN), which
    the FFN's first kernels apply (`decode_weights`) while their first weight tiles arrive, so no norm
    kernel runs before them."""

    def __init__(self, weight, eps: float):
        self.weight = nnx.Param(weight)
        self.eps = eps

    def args(self) -> tuple:
        """The ops' norm arguments: (weight stack, eps)."""
        return self.weight[...], self.eps


class HeadsLinear(nnx.Module):
    """One projection per attention head (op "heads_linear": y[t, h] = x[t, h, :K] · W[h]ᵀ): weight
    [H, N, K] (in a layer stack [L, H, N, K]) in a float format, or fp8 with one scale per `block`²
    block [H, N/block, K/block]. `decode_weights` lays kv_b out as two of them (`head_weights`)."""

    def __init__(self, weight, scale, block: int = BLOCK):
        self.weight = nnx.Param(weight)
        self.scale = None if scale is None else nnx.Param(scale)
        self.block = block

    def arrays(self) -> tuple:
        """The op's weight arguments: (weight, scale or None, block)."""
        return self.weight[...], None if self.scale is None else self.scale[...], self.block


def head_scale_block(cfg: ModelConfig, rows: int) -> int | None:
    """The scale block of kv_b's per-head fp8 copies (`head_weights`) for a kv_b of `rows` rows: 128
    where every 128-block of each head's W_uk and W_uv rows lies inside one of the checkpoint's
    128-row blocks (DeepSeek-V3.2: heads of 2·128 rows), else 64 where every 64-block does (GLM-5:
    heads of 192 + 256 rows), else None (no exact copy with whole blocks)."""
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    parts = [(h * (nope + v) + a, n) for h in range(rows // (nope + v)) for a, n in ((0, nope), (nope, v))]
    for b in (BLOCK, BLOCK // 2):
        if all((a + j) // BLOCK == (a + min(j + b, n) - 1) // BLOCK for a, n in parts for j in range(0, n, b)):
            return b
    return None


def head_weights(cfg: ModelConfig, w, scale, dtype, block: int | None):
    """kv_b [..., H·(nope+v), lat] as the absorbed attention's two per-head weights, ((W_ukᵀ, scale),
    (W_uv, scale)): W_ukᵀ [..., H, lat, nope] (q_lat[h] = q_nope[h] · W_ukᵀ[h]ᵀ) and W_uv [..., H, v,
    lat] (o[h] = o_lat[h] · W_uv[h]ᵀ). `block` (fp8 kv_b, `head_scale_block`): the e4m3 values as
    stored, each `block`² block with its checkpoint scale (exact: a transpose keeps whole blocks);
    None: an fp8 kv_b dequantised to `dtype`, a float one as it is."""
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    heads, lat = w.shape[-2] // (nope + v), w.shape[-1]
    if block is None and scale is not None:
        w, scale = dequantize(w, scale, dtype), None
    wh = w.reshape(*w.shape[:-2], heads, nope + v, lat)
    uk_t, uv = jnp.swapaxes(wh[..., :nope, :], -1, -2), wh[..., nope:, :]
    if scale is None:
        return (uk_t, None), (uv, None)
    h = np.arange(heads)[:, None, None]
    cols = np.arange(-(-lat // block)) * block // BLOCK   # the checkpoint's column block of each lat block

    def rows(first, n):   # the checkpoint's row block of each block of the heads' rows [H, n blocks, 1]
        return (h * (nope + v) + first + np.arange(-(-n // block))[:, None] * block) // BLOCK
    return (uk_t, jnp.swapaxes(scale[..., rows(0, nope), cols], -1, -2)), (uv, scale[..., rows(nope, v), cols])


def _at(w: jax.Array, layer):
    """Layer `layer` (a `Layer` or an integer scalar) of a stack, sliced in XLA; w itself for None."""
    return w if layer is None else w[Layer.of(layer).index()]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.weight = nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (dim,), F32)).astype(dtype))
        self.eps = eps

    def __call__(self, x, layer=None):
        return reference.rms_norm(x, _at(self.weight[...], layer), self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.weight = nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (dim,), F32)).astype(dtype))
        self.bias = nnx.Param((0.1 * jax.random.normal(rngs.params(), (dim,), F32)).astype(dtype))

    def __call__(self, x, layer=None):
        return reference.layer_norm(x, _at(self.weight[...], layer), _at(self.bias[...], layer), SUBLAYER_EPS)


def _norm_args(norm: FFNNorm | None) -> tuple:
    """An FFN's norm arguments for its ops: (weight stack, eps), or (None, 0.0): x is normed already."""
    return (None, 0.0) if norm is None else norm.args()


def _swiglu_arrays(gate: Linear, up: Linear, down: Linear) -> tuple:
    """(gate, gate_scale, up, up_scale, down, down_scale): the argument order of the SwiGLU ops."""
    return gate.arrays() + up.arrays() + down.arrays()


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)); under tp each rank holds a slice of the intermediate dim.
    In the decode model (`decode_weights`) a layer stack's `norm` is its input norm, applied by its ops."""

    norm: FFNNorm | None = None

    def __init__(self, cfg: ModelConfig, width: int, *, rngs, fmt):
        self.gate_proj = Linear(cfg.hidden_size, width, rngs=rngs, fmt=fmt)
        self.up_proj = Linear(cfg.hidden_size, width, rngs=rngs, fmt=fmt)
        self.down_proj = Linear(width, cfg.hidden_size, rngs=rngs, fmt=fmt)

    def arrays(self) -> tuple:
        return _swiglu_arrays(self.gate_proj, self.up_proj, self.down_proj)

    def __call__(self, ops: Ops, x, layer=None, residual=None):
        """SwiGLU(x) (x normed first where the stack has its `norm`), plus `residual` where given (added
        in the down projection's epilogue)."""
        return ops.mlp(x, self.arrays(), layer, residual=residual, norm=_norm_args(self.norm))


class Router(nnx.Module):
    """The MoE router's fp32 weight [E, hidden] and bias [E]. Random weights are bf16 values, as the
    checkpoints hold the router (bf16, never fp8); the decode model then reads them in bf16
    (`decode_weights`)."""

    def __init__(self, cfg: ModelConfig, *, rngs):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (cfg.n_routed_experts, cfg.hidden_size), F32)
                                 * cfg.hidden_size**-0.5).astype(jnp.bfloat16).astype(F32))
        self.e_score_correction_bias = nnx.Param(0.1 * jax.random.normal(rngs.params(), (cfg.n_routed_experts,), F32))


class Experts(nnx.Module):
    """All routed experts, stacked: gate/up [E, width, hidden], down [E, hidden, width]."""

    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        e, w, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate = Linear(h, w, rngs=rngs, fmt=fmt, experts=e)
        self.up = Linear(h, w, rngs=rngs, fmt=fmt, experts=e)
        self.down = Linear(w, h, rngs=rngs, fmt=fmt, experts=e)

    def arrays(self) -> tuple:
        return _swiglu_arrays(self.gate, self.up, self.down)


class MoE(nnx.Module):
    """Routed experts and the shared expert; `norm` as in `MLP`, applied by the router's kernel, which
    writes the normed x that the routed experts' kernels read (op "norm_route"), and by the shared
    expert's gate/up kernel, which runs beside the router."""

    norm: FFNNorm | None = None

    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        self.cfg = cfg
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs, fmt=fmt)
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts, rngs=rngs, fmt=fmt)

    def __call__(self, ops: Ops, x, layer=None, residual=None):
        """MoE(x) (x normed first where the stack has its `norm`), plus `residual` where given (added in
        the down projections' epilogues)."""
        gate = (self.gate.weight[...], self.gate.e_score_correction_bias[...])
        arrays = (self.experts.arrays(), self.shared_experts.arrays(), layer)
        if self.norm is None:
            weights, ids = ops("route", self.cfg, x, *gate, layer=layer)
            return ops.moe(x, weights, ids, *arrays, residual=residual)
        f, weights, ids = ops("norm_route", self.cfg, x, *self.norm.args(), *gate, layer=layer)
        return ops.moe(x, weights, ids, *arrays, residual=residual, norm=self.norm.args(), x_normed=f)


class Indexer(nnx.Module):
    """DSA lightning indexer: scores every cached position for the new tokens and keeps the top-k."""

    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        self.cfg = cfg
        norm_dtype = WEIGHT_FORMATS[fmt]
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, fmt=fmt)
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim, rngs=rngs, fmt=fmt)
        self.k_norm = LayerNorm(cfg.index_head_dim, rngs=rngs, dtype=norm_dtype)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, rngs=rngs, fmt="fp32", quantizable=False)

    def __call__(self, ops: Ops, slot, x, qr, cos, sin, positions, start, cache, q=None, k=None, norm=None):
        """(top-k indices [T, k] (-1: masked), cache) for indexer `slot` of the stack, from the layer's
        normed input x and normed q_a output qr. `q`, `k`: (array, column) where the caller computed the
        query projection wq_b(qr) and the key projection wk(x): the decode model's merged GEMVs' whole
        outputs, each projection at its column (qr is then None). `norm`: x is the layer's input before
        its norm, this RMSNorm stack, indexed like the indexers' (every layer has its own indexer); the
        head weights' GEMV then norms x itself."""
        cfg = self.cfg
        q_x, q_col = (self.wq_b(ops, qr, slot), 0) if q is None else q
        k_x, k_col = (self.wk(ops, x if norm is None else norm(x, slot), slot), 0) if k is None else k
        # the head weights' projection in fp32 (index_prep reads its first H columns and scales them by
        # H^-0.5 · D^-0.5)
        if norm is None:
            w = reference.linear(x.astype(F32), _at(self.weights_proj.weight[...], slot).astype(F32))
        else:
            w = ops("index_weights", x, norm.weight[...], norm.eps, self.weights_proj.weight[...], layer=slot)
        # the key's norm, rope on q and k, their Hadamard rotation and q's fp8 quantisation (one kernel;
        # the projections' outputs are read in place): k comes out rotated, fp32 in fp8 mode
        q, w, k = ops("index_prep", cfg, q_x, q_col, k_x, k_col, self.k_norm.weight[...], self.k_norm.bias[...],
                      SUBLAYER_EPS, cos, sin, w, layer=slot)
        topk, k_cache, k_scale = ops.indexer_topk(cfg, q, w, k, cache["index_k"], cache.get("index_scale"),
                                                  positions, start, slot)
        cache = dict(cache, index_k=k_cache)
        if k_scale is not None:
            cache["index_scale"] = k_scale
        return topk, cache


class Attention(nnx.Module):
    """Multi-head latent attention, absorbed for decode: queries are moved into the latent space so
    attention reads only the cached latent rows (kv_lora + rope key per position).

    In the decode model (`decode_weights`), merged projections, each one GEMV with its norm fused in:
    `x_proj`: those of the layer's normed input (q_a, then the indexer's wk where every layer has its
    own indexer, then kv_a); q_a_proj and kv_a_proj_with_mqa are then None.
    `qr_proj`: those of the normed q_a output qr (q_b, then the indexer's wq_b), where every layer has
    its own indexer; q_b_proj is then None.
    `absorb_q` / `absorb_o`: in the decode model kv_b per head (`head_weights`), W_ukᵀ and W_uv, each
    one "heads_linear" launch per layer; kv_b_proj is then None."""

    x_proj: RowsLinear | None = None
    qr_proj: RowsLinear | None = None
    absorb_q: HeadsLinear | None = None
    absorb_o: HeadsLinear | None = None

    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        self.cfg = cfg
        norm_dtype = WEIGHT_FORMATS[fmt]
        h = cfg.num_attention_heads
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, rngs=rngs, fmt=fmt)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, SUBLAYER_EPS, rngs=rngs, dtype=norm_dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, rngs=rngs, fmt=fmt)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, rngs=rngs, fmt=fmt)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, SUBLAYER_EPS, rngs=rngs, dtype=norm_dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), rngs=rngs, fmt=fmt)
        self.o_proj = Linear(h * cfg.v_head_dim, cfg.hidden_size, rngs=rngs, fmt=fmt)

    def __call__(self, ops: Ops, i, x, norm: RMSNorm, cos, sin, positions, start, cache, indexer):
        """Layer i's attention (i a `Layer` or an integer scalar) on its input x normed by `norm`, added
        to x: (x + output, cache, top-k). `indexer(qr, q, k, cache)` gives (top-k, cache) from the
        normed q_a output qr, or from the indexer's query and key projections q, k where the merged
        GEMVs computed them: (the GEMV's whole output, the projection's column), else None."""
        cfg = self.cfg
        t = x.shape[0]
        index_q = index_k = None
        # qa_x, q_x: arrays whose first columns are q_a and q (the merged GEMVs' whole outputs,
        # which the kernels read in place)
        if self.x_proj is not None:
            xp = self.x_proj(ops, x, i, norm=norm)
            qa, *index_k, kva = self.x_proj.split(xp)
            qa_x = self.x_proj.leading(xp, 0)
            index_k = (xp, self.x_proj.parts[1][0]) if index_k else None
        else:
            x_in = norm(x, i)
            qa, kva = self.q_a_proj(ops, x_in, i), self.kv_a_proj_with_mqa(ops, x_in, i)
            qa_x = qa
        if self.qr_proj is not None:
            qr = None
            qp = self.qr_proj(ops, qa_x, i, norm=self.q_a_layernorm)
            q, _ = self.qr_proj.split(qp)
            index_q = (qp, self.qr_proj.parts[1][0])
            q_x = self.qr_proj.leading(qp, 0)
        else:
            qr = self.q_a_layernorm(qa, i)
            q = q_x = self.q_b_proj(ops, qr, i)
        heads = q.shape[-1] // cfg.qk_head_dim  # local heads under tp
        # o_proj's weights into L2 while the attention chain below runs (DecodeConfig.l2_prefetch)
        ops.prefetch(i, q_x, *self.o_proj.arrays())
        # rope on q_pe and k_pe, the latent's norm and both cache rows (one kernel): q_x and the
        # x projections' whole output (kv_a at its column) are read in place
        kv_x, kv_col = (xp, self.x_proj.parts[-1][0]) if self.x_proj is not None else (kva, 0)
        q_pe, kv, pe = ops("mla_prep", q_x, kv_x, kv_col, heads, cfg.qk_head_dim, self.kv_a_layernorm.weight[...],
                           self.kv_a_layernorm.eps, cos, sin, cache["kv"], cache.get("pe"), start, layer=i)
        cache = dict(cache, kv=kv) if pe is None else dict(cache, kv=kv, pe=pe)
        topk, cache = indexer(qr, index_q, index_k, cache)
        w_uk_t, w_uv, at = self._absorption(i, x.dtype)
        # each head's q_nope (the first nope features of its qk_head_dim columns of q_x)
        q_lat = ops("heads_linear", q_x, *w_uk_t, cfg.qk_head_dim, layer=at)
        # the attention over the selected rows, then each head's W_uv
        out = ops.attention_out(q_lat, q_pe, cache["kv"], cache.get("pe"), topk, cfg.softmax_scale, x.dtype, w_uv,
                                self.o_proj.arrays(), i, at is not None, x)
        return out, cache, topk

    def _absorption(self, i, dtype):
        """The "heads_linear" weight arguments (weight, scale, block) of W_ukᵀ and W_uv and the layer
        argument: the decode model's stacks and i, else (a model not laid out by `decode_weights`)
        layer i's kv_b laid out per head here, in `dtype`, and None."""
        if self.absorb_q is not None:
            return self.absorb_q.arrays(), self.absorb_o.arrays(), i
        kv_b = self.kv_b_proj
        scale = None if kv_b.scale is None else _at(kv_b.scale[...], i)
        uk_t, uv = head_weights(self.cfg, _at(kv_b.weight[...], i), scale, dtype, None)
        return uk_t + (BLOCK,), uv + (BLOCK,), None


class Block(nnx.Module):
    """A layer's attention and its two norms (the FFN lives in the `dense` / `moe` stacks)."""

    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        norm_dtype = WEIGHT_FORMATS[fmt]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)
        self.self_attn = Attention(cfg, rngs=rngs, fmt=fmt)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)


class MTP(nnx.Module):
    """Multi-token prediction block: from the main model's last hidden state at position i and the
    embedding of token i+1, predicts token i+2 (the draft for speculative decoding). Its decoder
    layer is the last entry of the model's layer stacks."""

    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        norm_dtype = WEIGHT_FORMATS[fmt]
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, rngs=rngs, fmt=fmt)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)


# ---- the layer stacks ---------------------------------------------------------------------------

class Layout:
    """Where each decoder layer's weights and caches sit in the stacks. Layer i < num_hidden_layers is
    a main layer, i = num_hidden_layers the MTP block's. `Layout.of(cfg)` is cached."""

    @staticmethod
    @functools.cache
    def of(cfg: ModelConfig) -> "Layout":
        return Layout(cfg)

    def __init__(self, cfg: ModelConfig):
        self.num_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        self.mtp_layer = cfg.num_hidden_layers if cfg.num_nextn_predict_layers else None
        self.num_dense = min(cfg.first_k_dense_replace, cfg.num_hidden_layers)
        self.num_moe = self.num_layers - self.num_dense
        full = [t == "full" for t in cfg.indexer_types] + [True] * cfg.num_nextn_predict_layers
        self.indexer_slot = tuple(int(s) if f else -1 for f, s in zip(full, np.cumsum(full) - 1))
        self.num_indexers = sum(full)
        self.all_full = all(full)

    def cache_index(self, i: int, cache) -> dict[str, int]:
        """Where layer i's rows sit in the stacked caches: {array name: index in its stack} for the
        arrays of `cache` the layer has (`index_k` / `index_scale` only with its own indexer)."""
        slot = self.indexer_slot[i]
        index = {"kv": i, "pe": i, "index_k": slot, "index_scale": slot}
        return {k: j for k, j in index.items() if k in cache and j >= 0}

    def place(self, i: int) -> tuple[str, int]:
        """(FFN stack, index in it) of layer i."""
        return ("dense", i) if i < self.num_dense else ("moe", i - self.num_dense)


_LAYER = re.compile(r"layers\.(\d+)\.(.*)")


def stacked_name(cfg: ModelConfig, name: str) -> tuple[str, int | None]:
    """The stacked parameter and index that hold per-layer parameter `name` (the checkpoint naming:
    `layers.3.self_attn.q_b_proj.weight`, `mtp.layer.mlp.gate.weight`); (name, None) for the rest."""
    m = _LAYER.fullmatch(name)
    if m:
        i, rest = int(m.group(1)), m.group(2)
    elif name.startswith("mtp.layer."):
        i, rest = cfg.num_hidden_layers, name.removeprefix("mtp.layer.")
    else:
        return name, None
    lay = Layout.of(cfg)
    if rest.startswith("self_attn.indexer."):
        if lay.indexer_slot[i] < 0:
            raise ValueError(f"parameter {name}: layer {i} shares the previous indexer and has none")
        return "indexers." + rest.removeprefix("self_attn.indexer."), lay.indexer_slot[i]
    if rest.startswith("mlp."):
        stack, j = lay.place(i)
        return f"{stack}.{rest.removeprefix('mlp.')}", j
    return "layers." + rest, i


def layer_names(cfg: ModelConfig, stacked: str) -> list[str]:
    """The per-layer parameter names of stacked parameter `stacked`, in stack order ([] if unstacked)."""
    group, _, rest = stacked.partition(".")
    lay = Layout.of(cfg)

    def prefix(i):
        return "mtp.layer." if i == lay.mtp_layer else f"layers.{i}."

    if group == "layers":
        return [prefix(i) + rest for i in range(lay.num_layers)]
    if group == "indexers":
        return [prefix(i) + "self_attn.indexer." + rest for i in range(lay.num_layers) if lay.indexer_slot[i] >= 0]
    if group == "dense":
        return [prefix(i) + "mlp." + rest for i in range(lay.num_dense)]
    if group == "moe":
        return [prefix(i) + "mlp." + rest for i in range(lay.num_dense, lay.num_layers)]
    return []


def flat_params(model: Transformer) -> dict[str, jax.Array]:
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, sharding.path_names(p))): x for p, x in jax.tree_util.tree_leaves_with_path(state)}


def decode_weights(model: Transformer, merge: bool = True, tp: int = 1, backend: str = "reference") -> Transformer:
    """The model as the compiled steps of `backend` read it, built once (the Engine holds it), for `tp` ranks:
      - kv_b as the two absorptions' per-head weights (`head_weights`: `Attention.absorb_q` W_ukᵀ,
        `absorb_o` W_uv, one "heads_linear" op each per layer and step): backend "pallas" keeps an
        fp8 kv_b in fp8 (the same e4m3 values and scales, laid out per head: half the bytes of
        bf16), "reference" dequantises it to the compute dtype once instead of in every step;
      - the projections of each layer's normed input x — q_a, kv_a and, where every layer runs its
        own indexer (its stack then indexed like the layers), the indexer's wk — one `RowsLinear`
        (`Attention.x_proj`) over their weights concatenated by rows: one GEMV launch (and one
        split-K finish) per layer instead of two or three, the same rows multiplied by the same x.
        The indexer's fp32 head-weights projection stays apart (an fp32 product: `index_weights`).
      - where every layer runs its own indexer and q_b and wq_b have one format, the projections of
        the normed q_a output — q_b (split over the tp ranks by heads) and the indexer's wq_b
        (replicated) — one `RowsLinear` (`Attention.qr_proj`): one GEMV launch per layer instead of
        two. Its rows are one block per rank (the rank's q_b rows, then all of wq_b): per GPU a copy
        of q_b / tp + wq_b, ≈ 1.05 GB over DeepSeek-V3.2's 61 layers at tp = 8 (fp8).
      - the layers' post-attention norm as each FFN stack's `norm` (`FFNNorm`, stacked like the FFN),
        applied by the FFN's first kernels (the dense gate/up GEMV; in the MoE the router, which
        writes the normed x for the routed experts, and the shared expert's gate/up) instead of by
        an XLA norm before them.
      - the MoE router's fp32 weights in bf16 where every value is a bf16 value (`router_in_bf16`;
        the checkpoints' routers are bf16): the router's fp32 products of the same values, half the
        bytes of a GEMV on each MoE layer's chain.
    With the norms fused into those GEMVs (`rmsnorm_linear`), the same values the step would compute;
    the other weights are shared with `model`, not copied, and `model` is untouched. Idempotent for
    one tp. `merge=False`: without the merged GEMVs, the FFN norms moved and the router in bf16 (for
    comparisons)."""
    attn = model.layers.self_attn
    if attn.qr_proj is not None and attn.qr_proj.ranks != tp:
        raise ValueError(f"this decode model's merged q_b | wq_b is laid out for tp={attn.qr_proj.ranks}, "
                         f"not tp={tp}: build it from the model itself")
    heads = attn.absorb_q is None
    ffn_norm = merge and model.layers.post_attention_layernorm is not None
    router = merge and model.moe is not None and router_in_bf16(model.moe.gate.weight.get_value())
    merge = merge and attn.x_proj is None
    if not (heads or merge or ffn_norm or router):
        return model
    out = nnx.clone(model)
    if heads:
        kv_b = attn.kv_b_proj
        w, s = kv_b.weight.get_value(), kv_b.scale.get_value() if kv_b.scale is not None else None
        block = head_scale_block(model.cfg, w.shape[1]) if backend == "pallas" and s is not None else None
        build = functools.partial(head_weights, model.cfg, dtype=model.dtype, block=block)
        sh = w.sharding   # [L, H, ...] split over tp like kv_b's rows: by heads
        if isinstance(sh, jax.sharding.NamedSharding):
            sh = jax.sharding.NamedSharding(sh.mesh, jax.P(*sh.spec[:2]))
        parts = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), jax.eval_shape(build, w, s))
        if not isinstance(w, jax.ShapeDtypeStruct):   # arrays, not an abstract model (`abstract_model`)
            _check_room(jax.tree.leaves(parts), f"kv_b per head in {jnp.dtype(parts[0][0].dtype).name} for the "
                                                "compiled steps")
            parts = jax.jit(build, out_shardings=jax.tree.map(lambda a: sh, parts))(w, s)
        (uk_t, uk_ts), (uv, uvs) = parts
        out.layers.self_attn.absorb_q = HeadsLinear(uk_t, uk_ts, block or BLOCK)
        out.layers.self_attn.absorb_o = HeadsLinear(uv, uvs, block or BLOCK)
        out.layers.self_attn.kv_b_proj = None
    if merge:
        own_index = model.indexers is not None and model.layout.all_full   # indexer stack indexed like the layers
        parts = [attn.q_a_proj]
        if own_index and _same_format(model.indexers.wk, attn.q_a_proj):
            parts.append(model.indexers.wk)
        parts.append(attn.kv_a_proj_with_mqa)
        out.layers.self_attn.x_proj = _rows_linear(parts)
        out.layers.self_attn.q_a_proj = None
        out.layers.self_attn.kv_a_proj_with_mqa = None
        if len(parts) == 3:
            out.indexers.wk = None
        # (a q_b that does not split over tp in whole scale blocks keeps the two projections apart)
        if own_index and _same_format(model.indexers.wq_b, attn.q_b_proj) and _splits(attn.q_b_proj, tp):
            out.layers.self_attn.qr_proj = _rows_linear([attn.q_b_proj, model.indexers.wq_b], (True, False), tp)
            out.layers.self_attn.q_b_proj = None
            out.indexers.wq_b = None
    if ffn_norm:
        norm = model.layers.post_attention_layernorm
        lay = model.layout
        for name, lo, hi in (("dense", 0, lay.num_dense), ("moe", lay.num_dense, lay.num_layers)):
            if getattr(out, name) is not None:
                getattr(out, name).norm = FFNNorm(_stack_rows(norm.weight.get_value(), lo, hi), norm.eps)
        out.layers.post_attention_layernorm = None
    if router:
        w = model.moe.gate.weight.get_value()
        _check_room([jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=w.sharding)],
                    "the router in bfloat16 for the compiled steps")
        out.moe.gate.weight = nnx.Param(jax.jit(lambda w: w.astype(jnp.bfloat16), out_shardings=w.sharding)(w))
    return out


def router_in_bf16(w) -> bool:
    """Whether the decode model holds the router weight `w` in bf16: an fp32 array (not an abstract
    one) whose every value is a bf16 value, so the router's products are the same."""
    if isinstance(w, jax.ShapeDtypeStruct) or w.dtype != F32:
        return False
    return bool(jax.jit(lambda w: jnp.all(w.astype(jnp.bfloat16).astype(F32) == w))(w))


def _stack_rows(w, lo: int, hi: int):
    """Entries lo..hi-1 of a stacked array (or of an abstract one, `abstract_model`)."""
    if isinstance(w, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((hi - lo, *w.shape[1:]), w.dtype, sharding=w.sharding)
    return w[lo:hi]


def _same_format(a: Linear, b: Linear) -> bool:
    """Whether two Linears' weights can be one merged weight: one dtype, both with block scales or neither."""
    return a.weight.get_value().dtype == b.weight.get_value().dtype and (a.scale is None) == (b.scale is None)


def _splits(linear: Linear, tp: int) -> bool:
    """Whether a stacked Linear's rows split over tp ranks, in whole 128-row scale blocks for fp8."""
    n = linear.weight.get_value().shape[1]
    return tp == 1 or (n % tp == 0 and (linear.scale is None or (n // tp) % BLOCK == 0))


def _rows_linear(linears: list[Linear], split: tuple[bool, ...] | None = None, tp: int = 1) -> RowsLinear:
    """One RowsLinear over stacked Linears [L, N_j, K] of one format: their weights concatenated by
    rows, each fp8 one but the last padded with zero rows to a whole 128-row scale block (its block
    scales then stay its own: the padding adds no scale rows). With tp > 1, one such block of rows
    per rank, holding that rank's rows of the Linears whose rows are split over tp (`split`) and all
    rows of the others; the last part padded too, so every rank's block starts on a scale block."""
    ws = [m.weight.get_value() for m in linears]
    ss = [m.scale.get_value() if m.scale is not None else None for m in linears]
    split = split or (False,) * len(linears)
    fp8 = ss[0] is not None
    if any((s is not None) != fp8 or w.dtype != ws[0].dtype or w.shape[::2] != ws[0].shape[::2]
           for w, s in zip(ws, ss)):
        raise ValueError(f"merged projections need one format and shape [L, N, K]: {[w.shape for w in ws]}")
    grain = BLOCK if fp8 else 1
    rows = [w.shape[1] // tp if cut else w.shape[1] for w, cut in zip(ws, split)]   # of one rank
    if any(cut and not _splits(m, tp) for m, cut in zip(linears, split)):
        raise ValueError(f"merged projections: rows {[w.shape[1] for w in ws]} do not split over tp={tp}"
                         + (f" in whole {BLOCK}-row scale blocks" if fp8 else ""))
    padded = [-(-n // grain) * grain for n in rows[:-1]] + [-(-rows[-1] // grain) * grain if tp > 1 else rows[-1]]
    scale_rows = [-(-n // BLOCK) for n in rows]
    starts = np.cumsum([0] + padded[:-1]).tolist()
    parts = tuple((int(a), n) for a, n in zip(starts, rows))
    # the output sharding: a tp-split input's (rank blocks split like its rows), else the first's
    sh = next((w.sharding for w, cut in zip(ws, split) if cut), ws[0].sharding)
    ssh = next((s.sharding for s, cut in zip(ss, split) if cut), ss[0].sharding) if fp8 else None
    w = jax.ShapeDtypeStruct((ws[0].shape[0], tp * sum(padded), ws[0].shape[2]), ws[0].dtype, sharding=sh)
    s = None if not fp8 else jax.ShapeDtypeStruct((w.shape[0], tp * sum(scale_rows), ss[0].shape[2]),
                                                  ss[0].dtype, sharding=ssh)
    if isinstance(ws[0], jax.ShapeDtypeStruct):   # an abstract model
        return RowsLinear(w, s, parts, tp)

    def blocks(xs, rows, padded):
        """Each rank's rows of xs [L, N_j, ...], each part padded to `padded` rows, the ranks' blocks in order."""
        out = []
        for r in range(tp):
            for x, cut, n, p in zip(xs, split, rows, padded):
                x = x[:, r * n:(r + 1) * n] if cut else x
                out.append(jnp.pad(x, ((0, 0), (0, p - n), (0, 0))) if p > n else x)
        return jnp.concatenate(out, axis=1)
    _check_room([w] + ([s] if fp8 else []),
                f"the merged projections {[n for _, n in parts]} for the compiled steps")
    w = jax.jit(blocks, static_argnums=(1, 2), out_shardings=sh)(ws, tuple(rows), tuple(padded))
    if fp8:
        s = jax.jit(blocks, static_argnums=(1, 2), out_shardings=ssh)(ss, tuple(scale_rows), tuple(scale_rows))
    return RowsLinear(w, s, parts, tp)


def _check_room(arrays: list[jax.ShapeDtypeStruct], what: str) -> None:
    """MemoryError naming the bytes per device when the devices of these (sharded) arrays-to-be do not
    have them free (where the runtime says: GPUs), before they are allocated."""
    sh = arrays[0].sharding
    need = sum(int(np.prod(a.sharding.shard_shape(a.shape), dtype=np.int64)) * a.dtype.itemsize for a in arrays)
    sharding.check_memory(need, getattr(sh, "mesh", None), what)


def check_fits(model: Transformer, mesh, what: str) -> None:
    """Before placing `model`'s parameters (it may be abstract) on `mesh` (None: the default device): a
    ValueError when tp does not divide a split axis, a MemoryError when the weights do not fit in what
    the devices have free (where the runtime says: GPUs)."""
    params = flat_params(model)
    sharding.check_params(model.cfg, params, mesh)
    sharding.check_memory(sharding.bytes_per_device(params, mesh), mesh, f"the weights of {what}")


def abstract_model(cfg: ModelConfig, fmt: str, dtype=None) -> Transformer:
    check_format(fmt)
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), fmt=fmt, dtype=dtype))


def layer_params(model: Transformer) -> dict[str, jax.ShapeDtypeStruct]:
    """The per-layer parameters (checkpoint naming: `layers.3.self_attn.q_b_proj.weight`,
    `mtp.layer.mlp.gate.weight`) of a model, as shapes: what HF folders and converted checkpoints hold."""
    out = {}
    for name, x in flat_params(model).items():
        names = layer_names(model.cfg, name)
        if not names:
            out[name] = jax.ShapeDtypeStruct(x.shape, x.dtype)
        for n in names:
            out[n] = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return out


def layer_arrays(model: "Transformer") -> dict[str, jax.Array]:
    """The parameters under their per-layer names (`layers.3.self_attn.q_b_proj.weight`), each one
    layer of its stack (a view for inspection: slicing copies on the device)."""
    out = {}
    for name, x in flat_params(model).items():
        names = layer_names(model.cfg, name)
        out.update({n: x[i] for i, n in enumerate(names)} if names else {name: x})
    return out


def _stack(modules: list) -> nnx.Module | None:
    """One module whose every array is the modules' arrays stacked on a new leading axis."""
    if not modules:
        return None
    graphdef, _ = nnx.split(modules[0])
    states = [nnx.split(m)[1] for m in modules]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, fmt: str = "bf16", dtype=None):
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {tuple(WEIGHT_FORMATS)}")
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype or compute_dtype(fmt))
        lay = self.layout
        dense_dtype = WEIGHT_FORMATS[fmt]
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), F32)
                                      .astype(dense_dtype))
        self.layers = _stack([Block(cfg, rngs=rngs, fmt=fmt) for _ in range(lay.num_layers)])
        self.indexers = _stack([Indexer(cfg, rngs=rngs, fmt=fmt) for _ in range(lay.num_indexers)])
        self.dense = _stack([MLP(cfg, cfg.intermediate_size, rngs=rngs, fmt=fmt) for _ in range(lay.num_dense)])
        self.moe = _stack([MoE(cfg, rngs=rngs, fmt=fmt) for _ in range(lay.num_moe)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=dense_dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, fmt=fmt, quantizable=False)
        self.mtp = MTP(cfg, rngs=rngs, fmt=fmt) if cfg.num_nextn_predict_layers else None

    @property
    def layout(self) -> Layout:
        return Layout.of(self.cfg)

    def _rope(self, positions):
        return reference.rope_cos_sin(self.cfg, positions)

    # --- one decoder layer -----------------------------------------------------------------------
    def _layer(self, ops: Ops, i: Layer, ffn: str, x, cos, sin, positions, start, cache, topk):
        """Decoder layer i (`ffn` names its FFN stack): (x, cache, top-k)."""
        lay, blk = self.layout, self.layers
        slot = i if lay.all_full else jnp.asarray(lay.indexer_slot, jnp.int32)[i.index()]

        def indexer(qr, q, k, c):
            # the indexer's head weights (and wk where not merged) read the normed input
            if lay.all_full:   # slot is the layer itself: no index arithmetic (in a layer loop it is a
                # kernel), and the norm's stack is indexed as the indexers': the head weights' GEMV
                # norms x itself
                return self.indexers(ops, slot, x, qr, cos, sin, positions, start, c, q, k,
                                     norm=blk.input_layernorm)

            def run(c, slot):
                return self.indexers(ops, slot, blk.input_layernorm(x, i), qr, cos, sin, positions, start, c, q, k)
            return jax.lax.cond(slot >= 0, lambda c: run(c, jnp.maximum(slot, 0)), lambda c: (topk, c), c)

        h, cache, topk = blk.self_attn(ops, i, x, blk.input_layernorm, cos, sin, positions, start, cache, indexer)
        # the FFN's norm: in the decode model its first kernels apply it (the dense gate/up; the
        # router, which writes the normed x for the routed experts, and the shared gate/up), else
        # one XLA computation here; the residual add goes into the FFN's down projections
        stack, j = (self.dense, i) if ffn == "dense" else (self.moe, i - lay.num_dense)
        f = h if stack.norm is not None else blk.post_attention_layernorm(h, i)
        return stack(ops, f, j, residual=h), cache, topk

    def _layers(self, ops, lo: int, hi: int, ffn: str, carry, cos, sin, positions, start):
        """Layers lo..hi-1: one loop whose trip runs `DecodeConfig.layers_per_iteration` layers (one
        compiled body), or unrolled (`DecodeConfig.layer_loop`). The loop carries its trip's first
        layer, and the trip's layers are that counter plus 0, 1, ..: `Layer`s whose two parts the
        kernels add themselves, so nothing is computed between the loop's counter and the kernels
        (each index computed in XLA would be a kernel of its own). The layers after the last whole
        trip run after the loop, their indices constants."""
        def layer(i: Layer, c):
            x, cache, topk = c
            return self._layer(ops, i, ffn, x, cos, sin, positions, start, cache, topk)

        if ops.config.layer_loop == "unrolled" or hi <= lo:
            for i in range(lo, hi):
                carry = layer(Layer(jnp.int32(i)), carry)
            return carry
        per_trip = min(ops.config.layers_per_iteration, hi - lo)
        end = hi - (hi - lo) % per_trip   # after the last whole trip

        def trip(state):
            # The counter's increment overwrites it in place, so it waits for every kernel that reads
            # it: only the trip's first layer reads the counter; the others read `first + 1`, a value
            # of their own, so the increment runs beside the second layer instead of after the last.
            first, c = state
            rest = first + 1
            for k in range(per_trip):
                c = layer(Layer(first, 0) if k == 0 else Layer(rest, k - 1), c)
            return first + per_trip, c
        _, carry = jax.lax.while_loop(lambda state: state[0] < end, trip, (jnp.int32(lo), carry))
        for i in range(end, hi):
            carry = layer(Layer(jnp.int32(i)), carry)
        return carry

    # --- the model -------------------------------------------------------------------------------
    def logits(self, ops: Ops, h, norm: RMSNorm):
        """Full-vocab fp32 logits [T, V] (gathered over tp ranks from the vocab-split head)."""
        local = reference.dot("th,vh->tv", norm(h), self.lm_head.weight[...].astype(h.dtype))
        return ops.all_gather_last(local)

    def next_token(self, ops: Ops, h: jax.Array, params: dict, key: jax.Array) -> jax.Array:
        """The decode step's token [1] after the last hidden state h [1, hidden]. Greedy and top-k
        sampling (top_k ≤ HEAD_CANDIDATES) draw from the head's top candidates, so the full logits row
        is never written (the Pallas head keeps only its top logits); other settings sample the full
        logits. Both give exactly the distribution of `sample(logits)`, greedy the same token. Only
        the chosen branch streams the head's weights."""
        w = self.lm_head.weight[...]
        k = min(HEAD_CANDIDATES, w.shape[0])   # candidates per rank, and after the merge

        def from_candidates():
            vals, ids = ops.top_candidates(*ops("lm_head_topk", self.norm(h), w, k), w.shape[0])
            return ids[0, sample(vals[0], params, key)][None]

        fits = (params["temperature"] <= 0) | ((params["top_k"] > 0) & (params["top_k"] <= k))
        return jax.lax.cond(fits, from_candidates,
                            lambda: sample(self.logits(ops, h, self.norm)[0], params, key)[None])

    def hidden(self, ops: Ops, tokens: jax.Array, start: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """Main model on tokens [T] at positions start.. up to the final norm: (hidden [T, hidden], cache)."""
        positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
        cos, sin = self._rope(positions)
        x = self.embed_tokens[...][tokens].astype(self.dtype)
        lay = self.layout
        carry = (x, cache, _no_topk(self.cfg, tokens.shape[0], cache))
        carry = self._layers(ops, 0, lay.num_dense, "dense", carry, cos, sin, positions, start)
        carry = self._layers(ops, lay.num_dense, self.cfg.num_hidden_layers, "moe", carry, cos, sin, positions, start)
        return carry[0], carry[1]

    def __call__(self, ops: Ops, tokens: jax.Array, start: jax.Array, cache: dict):
        """Main model on tokens [T] at positions start.. : (logits [T, V] fp32, hidden [T, hidden], cache)."""
        x, cache = self.hidden(ops, tokens, start, cache)
        return self.logits(ops, x, self.norm), x, cache

    def draft(self, ops: Ops, hidden: jax.Array, next_tokens: jax.Array, start: jax.Array, cache: dict):
        """MTP block at positions start.. on the main model's hidden states and the tokens that
        followed them: (logits of the token after next [T, V], cache)."""
        m, lay = self.mtp, self.layout
        positions = start + jnp.arange(hidden.shape[0], dtype=jnp.int32)
        cos, sin = self._rope(positions)
        e = self.embed_tokens[...][next_tokens].astype(self.dtype)
        x = m.eh_proj(ops, jnp.concatenate([m.enorm(e), m.hnorm(hidden)], axis=-1))
        i = Layer(jnp.int32(lay.mtp_layer))
        x, cache, _ = self._layer(ops, i, lay.place(lay.mtp_layer)[0], x, cos, sin, positions, start, cache,
                                  _no_topk(self.cfg, hidden.shape[0], cache))
        return self.logits(ops, x, m.norm), cache


def _no_topk(cfg: ModelConfig, tokens: int, cache: dict):
    """The top-k carried into the first layer (every first layer runs its own indexer): all masked."""
    k = min(cfg.index_topk, cache["kv"].shape[1])
    return jnp.full((tokens, k), -1, jnp.int32)


def init_cache(cfg: ModelConfig, rows: int, dtype) -> dict:
    """Preallocated caches for `rows` positions, stacked over the layers (the MTP layer last): latent
    `kv` [L, S, kv_lora] and rope key `pe` [L, S, rope] (or, with kv_cache_quant="fp8", `kv` alone in
    FlashMLA's packed fp8 rows), and for the layers with their own indexer the index keys `index_k`
    [I, S, D] (fp8 + `index_scale` [I, S], one fp32 scale per position, in fp8 mode)."""
    lay = Layout.of(cfg)
    n, lat, r = lay.num_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cfg.kv_cache_quant == "fp8":
        cache = {"kv": jnp.zeros((n, rows, reference.kv_fp8_words(lat, r)), jnp.uint32)}
    else:
        cache = {"kv": jnp.zeros((n, rows, lat), dtype), "pe": jnp.zeros((n, rows, r), dtype)}
    fp8 = cfg.index_quant == "fp8"
    cache["index_k"] = jnp.zeros((lay.num_indexers, rows, cfg.index_head_dim), jnp.float8_e4m3fn if fp8 else dtype)
    if fp8:
        cache["index_scale"] = jnp.ones((lay.num_indexers, rows), F32)
    return cache


def split_cache(cfg: ModelConfig, cache: dict) -> tuple[list[dict], dict | None]:
    """The stacked caches as one dict per main layer (`index_k`/`index_scale` only in the layers with
    their own indexer) and the MTP layer's dict (None without MTP)."""
    lay = Layout.of(cfg)

    per = [{k: cache[k][j] for k, j in lay.cache_index(i, cache).items()} for i in range(lay.num_layers)]
    return (per[:-1], per[-1]) if lay.mtp_layer is not None else (per, None)


def random_model(cfg: ModelConfig | str, fmt: str = "bf16", seed: int = 0, dtype=None, mesh=None) -> Transformer:
    """A model with random weights, made on the devices: each part is built by a compiled function
    (a stack's layers one after another inside it) straight into its tensor-parallel sharding, so even
    a full-size model never passes through one device or the host."""
    what = f"random_model({cfg!r}, fmt={fmt!r})" if isinstance(cfg, str) else f"random_model(fmt={fmt!r})"
    if isinstance(cfg, str):
        cfg = preset(cfg)
    check_format(fmt)
    if not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    norm_dtype = WEIGHT_FORMATS[fmt]
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), fmt=fmt, dtype=dtype))
    check_fits(abstract, mesh, what)
    graphdef, state = nnx.split(abstract)
    lay = Layout.of(cfg)

    def key_of(name):
        return jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()))

    stacks = {"layers": (_Ctor(Block, cfg, fmt=fmt), lay.num_layers),
              "indexers": (_Ctor(Indexer, cfg, fmt=fmt), lay.num_indexers),
              "dense": (_Ctor(MLP, cfg, cfg.intermediate_size, fmt=fmt), lay.num_dense),
              "moe": (_Ctor(MoE, cfg, fmt=fmt), lay.num_moe)}
    for name, (ctor, n) in stacks.items():
        if n:
            keys = jnp.stack([key_of(f"{name}.{i}") for i in range(n)])
            state[name] = _build(ctor, mesh, (name,), n)(keys)
    state["norm"] = _build(_Ctor(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, dtype=norm_dtype), mesh, ())(key_of("norm"))
    state["lm_head"] = _build(_Ctor(Linear, cfg.hidden_size, cfg.vocab_size, fmt=fmt, quantizable=False), mesh,
                              ("lm_head",))(key_of("lm_head"))
    if cfg.num_nextn_predict_layers:
        state["mtp"] = _build(_Ctor(MTP, cfg, fmt=fmt), mesh, ("mtp",))(key_of("mtp"))
    embed = jax.jit(lambda k: jax.random.normal(k, (cfg.vocab_size, cfg.hidden_size), F32).astype(norm_dtype),
                    out_shardings=None if mesh is None else jax.sharding.NamedSharding(mesh, jax.P()))
    state["embed_tokens"] = nnx.Param(embed(jax.random.key(seed)))
    return nnx.merge(graphdef, state)


class _Ctor:
    """A hashable constructor call (the jit cache key for building one kind of sub-module)."""

    def __init__(self, cls, *args, **kwargs):
        self.cls, self.args, self.kwargs = cls, args, tuple(sorted(kwargs.items()))

    def __call__(self, rngs):
        return self.cls(*self.args, rngs=rngs, **dict(self.kwargs))

    def __eq__(self, other):
        return isinstance(other, _Ctor) and (self.cls, self.args, self.kwargs) == (other.cls, other.args, other.kwargs)

    def __hash__(self):
        return hash((self.cls, self.args, self.kwargs))


@functools.lru_cache(maxsize=None)
def _build(ctor: _Ctor, mesh, prefix: tuple, stack: int = 0):
    """The compiled builder of one kind of sub-module, its outputs in their tp shardings: from one key,
    or with `stack` > 0 from `stack` keys, the layers built one after another (`lax.map`, so only one
    layer's fp32 draws exist at a time) into arrays with a leading layer axis. `prefix` is the
    sub-module's name in the model (the sharding rules need it)."""
    abstract = nnx.split(nnx.eval_shape(lambda: ctor(nnx.Rngs(0))))[1]

    def spec(p, x):
        return jax.sharding.NamedSharding(mesh, sharding.spec_for(prefix + sharding.path_names(p), x.ndim + bool(stack)))

    shardings = None if mesh is None else jax.tree_util.tree_map_with_path(spec, abstract)

    def one(key):
        return nnx.split(ctor(nnx.Rngs(key)))[1]

    return jax.jit((lambda keys: jax.lax.map(one, keys)) if stack else one, out_shardings=shardings)
