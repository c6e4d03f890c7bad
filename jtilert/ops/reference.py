"""Plain-JAX reference ops of the decoder, as pure functions over arrays.

These are the `backend="reference"` path and the references every Pallas / CUDA kernel is tested
against. Shapes use T for the new tokens of one step (1 in decode, 2 in an MTP verify step, a chunk
in prefill) and S for the cache rows. Activations are in the compute dtype; reductions and softmax
run in fp32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jtilert.model.config import ModelConfig
from jtilert.ops.quant import BLOCK, FP8_MAX, act_quant, dequantize, hadamard, pow2_scale

F32 = jnp.float32


# ---- norms and projections -------------------------------------------------------------------

def dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with fp32 accumulation and an fp32 result. XLA:CPU has no bf16×bf16→fp32 dot, so on
    the CPU (tests, interpret mode) the operands are upcast first; on the GPU they stay narrow."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(F32), b.astype(F32)
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def normed(x: jax.Array, norm_weight: jax.Array | None, eps: float) -> jax.Array:
    """rms_norm(x, norm_weight, eps), or x where no norm weight is given (the dense FFN's gate/up take
    the norm's weight and eps, so that its kernel norms x itself)."""
    return x if norm_weight is None else rms_norm(x, norm_weight, eps)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float = 1e-6) -> jax.Array:
    x32 = x.astype(F32)
    mu = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mu), axis=-1, keepdims=True)
    y = (x32 - mu) * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(F32) + bias.astype(F32)).astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """y = x · Wᵀ with W [out, in] (bf16/fp32, or fp8 with block scales), fp32 accumulation."""
    wd = dequantize(w, scale, x.dtype)
    return dot("...k,nk->...n", x, wd).astype(x.dtype)


def heads_linear(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, block: int = BLOCK,
                 head_dim: int | None = None) -> jax.Array:
    """Every head its own projection: y[t, h] = x[t, h, :K] · W[h]ᵀ, x [T, H, D ≥ K] (or [T, W ≥ H·D]
    with head_dim=D: head h's row at columns h·D.. of row t), W [H, N, K] (fp8 with scales
    [H, N/block, K/block], or a float format) → [T, H, N] in x's dtype. MLA's absorbed decode runs it
    twice: q_nope into the latent space (W_uk per head, transposed) and the attended latent out to
    the values (W_uv per head)."""
    k, h = w.shape[-1], w.shape[-3]
    if head_dim is not None and x.ndim == 2:
        x = x[:, :h * head_dim].reshape(x.shape[0], h, head_dim)
    return dot("thk,hnk->thn", x[..., :k], dequantize(w, scale, x.dtype, block)).astype(x.dtype)


def swiglu_hidden(x, gate, gate_scale, up, up_scale, norm_weight=None, eps=0.0):
    """silu(gate(x)) · up(x): both projections rounded to x.dtype, the product in fp32, in x.dtype;
    x `normed` first where a norm weight is given."""
    x = normed(x, norm_weight, eps)
    h = jax.nn.silu(linear(x, gate, gate_scale).astype(F32)) * linear(x, up, up_scale).astype(F32)
    return h.astype(x.dtype)


def swiglu(x, gate, gate_scale, up, up_scale, down, down_scale):
    return linear(swiglu_hidden(x, gate, gate_scale, up, up_scale), down, down_scale)


def shared_expert(x, gate, gate_scale, up, up_scale, norm_weight, eps, down, down_scale, residual):
    """residual + the shared expert of x normed (`swiglu_hidden`, then `linear_residual`): a MoE layer's
    residual stream before its routed experts are added."""
    return linear_residual(swiglu_hidden(x, gate, gate_scale, up, up_scale, norm_weight, eps), down, down_scale,
                           residual)


def rmsnorm_linear(x: jax.Array, norm_weight: jax.Array, eps: float, w: jax.Array,
                   scale: jax.Array | None = None) -> jax.Array:
    """linear(rms_norm(x[..., :K], norm_weight, eps), w, scale), K = norm_weight's width: a norm
    feeding a projection (x may be wider: another projection's output whose first K columns are the
    input)."""
    k = norm_weight.shape[-1]
    return linear(rms_norm(x[..., :k] if x.shape[-1] > k else x, norm_weight, eps), w, scale)


def index_weights(x: jax.Array, norm_weight: jax.Array, eps: float, w: jax.Array) -> jax.Array:
    """The indexer's head weights' projection [T, H] fp32 of a layer's input x: rms_norm(x) (rounded
    as rms_norm rounds it) times w [H, K] in fp32. (`index_prep` scales it and reads its first H
    columns: a kernel's result may be wider.)"""
    return linear(rms_norm(x, norm_weight, eps).astype(F32), w.astype(F32))


def linear_residual(x: jax.Array, w: jax.Array, scale: jax.Array | None, residual: jax.Array) -> jax.Array:
    """residual + linear(x, w, scale): the projection rounded to x.dtype, then added in residual's
    dtype (a decoder layer's residual stream)."""
    return residual + linear(x, w, scale)


# ---- rotary embeddings -----------------------------------------------------------------------

def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies for the rope slice and the cos/sin scale (YaRN's attention factor)."""
    r, dim = cfg.rope, cfg.qk_rope_head_dim
    inv = 1.0 / (r.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if r.type != "yarn":
        return inv, 1.0

    def mscale(s, m=1.0):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    def corr_dim(rot):
        return dim * math.log(r.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(r.theta))

    low = max(math.floor(corr_dim(r.beta_fast)), 0)
    high = min(math.ceil(corr_dim(r.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    inv = inv / r.factor * (1 - extrapolate) + inv * extrapolate
    if r.mscale and r.mscale_all_dim:
        attn = mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim)
    else:
        attn = mscale(r.factor)
    return inv.astype(np.float32), float(attn)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, rope_dim // 2] in fp32 for the given positions."""
    inv, attn = rope_inv_freq(cfg)
    freqs = positions.astype(F32)[:, None] * jnp.asarray(inv)[None, :]
    return jnp.cos(freqs) * attn, jnp.sin(freqs) * attn


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """Rotate x [T, ..., d] by per-token angles; pairs are (2i, 2i+1) if interleaved, else (i, i + d/2).
    The layout of x is kept, so cached keys stay in the checkpoint's convention."""
    d = x.shape[-1]
    extra = x.ndim - 2
    c = cos.reshape(cos.shape[0], *([1] * extra), d // 2)
    s = sin.reshape(sin.shape[0], *([1] * extra), d // 2)
    x32 = x.astype(F32)
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        y = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(x.shape)
    else:
        x1, x2 = x32[..., : d // 2], x32[..., d // 2:]
        y = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return y.astype(x.dtype)


# ---- MLA's glue between the projections and attention ----------------------------------------

def write_rows(buf: jax.Array, rows: jax.Array, layer, start: jax.Array) -> jax.Array:
    """Write rows [T, ...] into layer `layer` of a stacked cache [L, S, ...] at row `start`, in place
    (layer None: buf is one layer [S, ...])."""
    if layer is None:
        return jax.lax.dynamic_update_slice(buf, rows.astype(buf.dtype), (start,) + (0,) * (buf.ndim - 1))
    return jax.lax.dynamic_update_slice(buf, rows[None].astype(buf.dtype), (layer, start) + (0,) * (buf.ndim - 2))


def mla_prep(q_x: jax.Array, kv_x: jax.Array, kv_col: int, heads: int, qk_head_dim: int, norm_weight: jax.Array,
             eps: float, cos: jax.Array, sin: jax.Array, kv_cache: jax.Array, pe_cache: jax.Array | None,
             start: jax.Array, layer=None):
    """What a layer computes between its projections and attention: q_x [T, W ≥ H·qk_head_dim] holds
    head h's query at columns h·qk_head_dim.. (its last R = 2·cos.shape[-1] columns the rope part),
    kv_x [T, ·] holds kv_a at columns kv_col.. (latent [lat], then the rope key [R]). → (q_pe [T, H, R]
    roped (interleaved), kv_cache, pe_cache) with the latent RMSNormed (norm_weight [lat], or [L, lat]
    with `layer`) and the roped key written at row `start` (of layer `layer` of stacks [L, S, ...]);
    pe_cache None: kv_cache is the packed fp8 cache (`quantize_kv_fp8`) and takes both."""
    t, r = q_x.shape[0], 2 * cos.shape[-1]
    lat = norm_weight.shape[-1]
    q = q_x[:, :heads * qk_head_dim].reshape(t, heads, qk_head_dim)
    q_pe = apply_rope(q[..., qk_head_dim - r:], cos, sin, True)
    kva = kv_x[:, kv_col:kv_col + lat + r]
    latent = rms_norm(kva[:, :lat], norm_weight if layer is None else norm_weight[layer], eps)
    k_pe = apply_rope(kva[:, lat:], cos, sin, True)
    if pe_cache is None:
        return q_pe, write_rows(kv_cache, quantize_kv_fp8(latent, k_pe), layer, start), None
    return q_pe, write_rows(kv_cache, latent, layer, start), write_rows(pe_cache, k_pe, layer, start)


# ---- DSA lightning indexer -------------------------------------------------------------------

def indexer_query(cfg: ModelConfig, q: jax.Array, w: jax.Array):
    """Prepare the new tokens' index queries q [T, H, D] and head weights w [T, H] (fp32, already
    holding H^-0.5 · D^-0.5) for `indexer_scores`. In fp8 mode q is Hadamard-rotated and quantised
    per 128-wide block, its scale folded into w (as the official kernel does)."""
    if cfg.index_quant == "none":
        return q, w
    q = jnp.einsum("thd,de->the", q.astype(F32), jnp.asarray(hadamard(q.shape[-1])))
    q8, qs = act_quant(q)  # one block: D == 128
    return q8, w * qs[..., 0]


def index_weight_scale(cfg: ModelConfig) -> np.float32:
    """H^-0.5 · D^-0.5, what `index_prep` multiplies the head weights' projection by (fp32)."""
    return np.float32(cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)


def index_prep(cfg: ModelConfig, q_x: jax.Array, q_col: int, k_x: jax.Array, k_col: int, norm_weight: jax.Array,
               norm_bias: jax.Array, eps: float, cos: jax.Array, sin: jax.Array, w: jax.Array):
    """What a layer's indexer computes between its projections and the scoring: q_x [T, ·] holds the
    index queries (H = index_n_heads heads of D = index_head_dim) at columns q_col.., k_x [T, ·] the key
    [D] at column k_col; the key LayerNormed (norm_weight, norm_bias [D]), rope (`indexer_rope_interleaved`)
    on the first R = 2·cos.shape[-1] columns of every query head and of the key, then `indexer_query`
    with the head weights w [T, ≥ H] (fp32: their projection in the first H columns, times
    `index_weight_scale` here) and `indexer_key_rotated` → (q [T, H, D], w [T, H], k [T, D]: fp32
    Hadamard-rotated in fp8 mode, else in k_x's dtype)."""
    t, r = q_x.shape[0], 2 * cos.shape[-1]
    h, d = cfg.index_n_heads, cfg.index_head_dim
    w = w[:, :h] * index_weight_scale(cfg)
    q = q_x[:, q_col:q_col + h * d].reshape(t, h, d)
    k = layer_norm(k_x[:, k_col:k_col + d], norm_weight, norm_bias, eps)
    rot = cfg.indexer_rope_interleaved
    q = jnp.concatenate([apply_rope(q[..., :r], cos, sin, rot), q[..., r:]], axis=-1)
    k = jnp.concatenate([apply_rope(k[..., :r], cos, sin, rot), k[..., r:]], axis=-1)
    q, w = indexer_query(cfg, q, w)
    return q, w, indexer_key_rotated(cfg, k)


def indexer_key_rotated(cfg: ModelConfig, k: jax.Array) -> jax.Array:
    """New index keys k [T, D] before quantisation: Hadamard-rotated in fp32 in fp8 mode, else k."""
    if cfg.index_quant == "none":
        return k
    return jnp.einsum("td,de->te", k.astype(F32), jnp.asarray(hadamard(k.shape[-1])))


def indexer_key(cfg: ModelConfig, k: jax.Array):
    """Cache entry for new index keys k [T, D] as `index_prep` returns them (already rotated):
    (key, scale [T] or None), the key quantised per row in fp8 mode."""
    if cfg.index_quant == "none":
        return k, None
    k8, ks = act_quant(k)
    return k8, ks[..., 0]


def indexer_append_scores(cfg: ModelConfig, q, w, k, k_cache, k_scale, positions, start, score=None,
                          first_row=None, num_rows=None):
    """Write the new tokens' index keys k [T, D] (`index_prep`'s: rotated in fp8 mode) into the cache
    at row `start` (quantised in fp8 mode), then score every cache row with `score` (default
    `indexer_scores`): (scores [T, S], k_cache, k_scale). With num_rows: only the scores of rows
    [first_row, first_row + num_rows) ([T, num_rows]; the indexer split over GPUs)."""
    k, ks = indexer_key(cfg, k)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (start, 0))
    if ks is not None:
        k_scale = jax.lax.dynamic_update_slice(k_scale, ks, (start,))
    scores = (score or indexer_scores)(q, w, k_cache, k_scale, positions)
    if num_rows is not None:
        scores = jax.lax.dynamic_slice_in_dim(scores, first_row, num_rows, axis=1)
    return scores, k_cache, k_scale


INDEX_TILE_BYTES = 1 << 29   # the most bytes of fp32 logits [T, H, keys] `indexer_scores` holds at once


def indexer_key_block(tokens: int, heads: int, rows: int, tile_bytes: int | None = None) -> int:
    """Cache rows `indexer_scores` scores per step: all of them where the fp32 logits of every row
    [T, H, S] fit in `tile_bytes` (default INDEX_TILE_BYTES: decode steps and short contexts), else
    the fewest blocks whose logits fit, of equal size (a multiple of 128, at least 128; the last block
    padded). A prefill chunk of 2048 tokens against 131072 rows with DeepSeek-V3.2's 64 index heads
    would hold 64 GiB at once; in blocks of 1024 rows it holds 512 MiB."""
    budget = INDEX_TILE_BYTES if tile_bytes is None else tile_bytes
    per_row = tokens * heads * 4
    if per_row * rows <= budget:
        return rows
    most = max(128, budget // per_row // 128 * 128)
    blocks = -(-rows // most)
    even = -(-rows // blocks)   # the rows spread over that many blocks
    return -(-even // 128) * 128


def indexer_scores(q: jax.Array, w: jax.Array, k_cache: jax.Array, k_scale: jax.Array | None,
                   positions: jax.Array, tile_bytes: int | None = None) -> jax.Array:
    """I(t, s) = Σ_h w[t,h] · ReLU(q[t,h] · k[s]) (· k_scale[s]) for every cache row s, -inf where s > positions[t].
    q [T, H, D], w [T, H] fp32, k_cache [S, D] (fp8 or float), k_scale [S] or None → [T, S] fp32.
    The fp32 logits [T, H, ·] are held for at most `indexer_key_block` rows at a time (a loop over
    blocks of rows, skipping the blocks past every token's position), so a long context's prefill
    chunk never holds [T, H, S]; each score is the same computation either way."""
    t, h, _ = q.shape
    s = k_cache.shape[0]
    block = indexer_key_block(t, h, s, tile_bytes)
    if block >= s:
        return _indexer_block_scores(q, w, k_cache, k_scale, positions, 0)
    n = -(-s // block)
    pad = n * block - s
    k_cache = jnp.pad(k_cache, ((0, pad), (0, 0)))
    k_scale = None if k_scale is None else jnp.pad(k_scale, (0, pad))
    last = jnp.max(positions)

    def body(i, out):
        first = i * block

        def score(out):
            k = jax.lax.dynamic_slice_in_dim(k_cache, first, block)
            ks = None if k_scale is None else jax.lax.dynamic_slice_in_dim(k_scale, first, block)
            return jax.lax.dynamic_update_slice(out, _indexer_block_scores(q, w, k, ks, positions, first), (0, first))

        return jax.lax.cond(first <= last, score, lambda out: out, out)   # blocks past every position stay -inf

    out = jax.lax.fori_loop(0, n, body, jnp.full((t, n * block), -jnp.inf, F32))
    return out[:, :s] if pad else out


def _indexer_block_scores(q, w, k_cache, k_scale, positions, first):
    """`indexer_scores` of the cache rows k_cache [B, D] (rows first.. of the cache) → [T, B] fp32."""
    kd = jnp.bfloat16 if k_cache.dtype == jnp.float8_e4m3fn else k_cache.dtype  # fp8 is exact in bf16
    logits = dot("thd,sd->ths", q.astype(kd), k_cache.astype(kd))
    scores = jnp.einsum("th,ths->ts", w, jax.nn.relu(logits))
    if k_scale is not None:
        scores = scores * k_scale[None, :]
    visible = first + jnp.arange(k_cache.shape[0])[None, :] <= positions[:, None]
    return jnp.where(visible, scores, -jnp.inf)


def empty_as_minus_one(vals: jax.Array, idx: jax.Array) -> jax.Array:
    """A top-k's positions idx with -1 where its score vals is not above -inf (a masked position)."""
    return jnp.where(vals > -jnp.inf, idx.astype(jnp.int32), -1)


def topk_positions(scores: jax.Array, k: int) -> jax.Array:
    """Top-k cache rows per token from scores [T, S]: indices [T, k] int32. Ties go to the lower
    position; a row whose score is -inf (past the causal limit) comes back as -1, which
    `sparse_mla` masks."""
    k = min(k, scores.shape[-1])
    return empty_as_minus_one(*jax.lax.top_k(scores, k))


def lm_head_topk(x: jax.Array, w: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k largest logits of x [T, H] against this rank's head rows w [V, H]: (values [T, k] fp32,
    vocab ids [T, k] int32), descending, ties to the lower id (the logits as `Transformer.logits`
    computes them)."""
    vals, ids = jax.lax.top_k(dot("th,vh->tv", x, w.astype(x.dtype)), min(k, w.shape[0]))
    return vals, ids.astype(jnp.int32)


# ---- absorbed sparse MLA ---------------------------------------------------------------------

# FlashMLA's fp8 latent cache ("V32_FP8Sparse"): per position L fp8 e4m3 latent values, L/128 fp32
# scales (one per 128 values, powers of two) and R bf16 rope values, 656 bytes for L=512, R=64. Kept
# as little-endian uint32 words [S, L/4 + L/128 + R/2]: one array row per position.
KV_FP8_GROUP = 128


def kv_fp8_words(lat: int, rope: int) -> int:
    return lat // 4 + lat // KV_FP8_GROUP + rope // 2


def quantize_kv_fp8(latent: jax.Array, k_pe: jax.Array) -> jax.Array:
    """Latent [..., L] and rope key [..., R] → packed FlashMLA fp8 rows [..., L/4 + L/128 + R/2] uint32.
    Scale of a 128-value group: 2^ceil(log2(max(amax / 448, 1e-4))) — FlashMLA clamps the scale at
    1e-4, i.e. amax at 0.0448 (`quant.pow2_scale` alone clamps amax at 1e-4); stored values are
    latent / scale in e4m3."""
    *lead, lat = latent.shape
    g = latent.astype(F32).reshape(*lead, lat // KV_FP8_GROUP, KV_FP8_GROUP)
    scale = pow2_scale(jnp.maximum(jnp.abs(g).max(-1), 1e-4 * FP8_MAX))
    q = (g / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(*lead, lat)
    as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(*lead, -1)  # noqa: E731
    row = jnp.concatenate([as_bytes(q), as_bytes(scale), as_bytes(k_pe.astype(jnp.bfloat16))], -1)
    return jax.lax.bitcast_convert_type(row.reshape(*lead, -1, 4), jnp.uint32)


def dequantize_kv_fp8(rows: jax.Array, lat: int) -> tuple[jax.Array, jax.Array]:
    """Packed rows [..., W] uint32 → (latent [..., L] bf16, rope [..., R] bf16); exact: e4m3 times a
    power of two fits in bf16."""
    *lead, _ = rows.shape
    b = jax.lax.bitcast_convert_type(rows, jnp.uint8).reshape(*lead, -1)
    ng = lat // KV_FP8_GROUP
    q = jax.lax.bitcast_convert_type(b[..., :lat], jnp.float8_e4m3fn).astype(F32)
    scale = jax.lax.bitcast_convert_type(b[..., lat:lat + 4 * ng].reshape(*lead, ng, 4), F32)
    kv = (q.reshape(*lead, ng, KV_FP8_GROUP) * scale[..., None]).reshape(*lead, lat)
    pe = jax.lax.bitcast_convert_type(b[..., lat + 4 * ng:].reshape(*lead, -1, 2), jnp.bfloat16)
    return kv.astype(jnp.bfloat16), pe


def sparse_mla(q_lat: jax.Array, q_pe: jax.Array, kv_cache: jax.Array, pe_cache: jax.Array | None,
               idx: jax.Array, scale: float, out_dtype=F32) -> jax.Array:
    """Attention of absorbed queries over the selected latent rows.
    q_lat [T, H, L], q_pe [T, H, R], kv_cache [S, L] with pe_cache [S, R] — or kv_cache in the packed
    fp8 layout (`quantize_kv_fp8`) with pe_cache None —, idx [T, K] (rows with idx < 0 are masked)
    → o_lat [T, H, L], computed in fp32 and returned in `out_dtype` (the model: its activations'
    dtype, which the absorption reads)."""
    valid = idx >= 0
    idx = jnp.maximum(idx, 0)
    if pe_cache is None:
        kv, pe = dequantize_kv_fp8(kv_cache[idx], q_lat.shape[-1])
    else:
        kv, pe = kv_cache[idx], pe_cache[idx]  # [T, K, L], [T, K, R]
    kv, pe = kv.astype(F32), pe.astype(F32)
    s = (jnp.einsum("thl,tkl->thk", q_lat.astype(F32), kv)
         + jnp.einsum("thr,tkr->thk", q_pe.astype(F32), pe)) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("thk,tkl->thl", p, kv).astype(out_dtype)


def sparse_mla_heads_linear(q_lat, q_pe, kv_cache, pe_cache, idx, scale: float, out_dtype, w, w_scale=None,
                            block: int = BLOCK) -> jax.Array:
    """`sparse_mla`'s output in `out_dtype` through every head's W_uv (`heads_linear`): [T, H, N]."""
    return heads_linear(sparse_mla(q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype), w, w_scale, block)


def attention_out(q_lat, q_pe, kv_cache, pe_cache, idx, scale: float, out_dtype, w, w_scale, block: int, wo, wo_scale,
                  residual) -> jax.Array:
    """residual + o_proj(`sparse_mla_heads_linear`'s heads as one row [T, H·N]): the attention's output
    added to the layer's residual stream (`linear_residual`)."""
    o = sparse_mla_heads_linear(q_lat, q_pe, kv_cache, pe_cache, idx, scale, out_dtype, w, w_scale, block)
    return linear_residual(o.reshape(o.shape[0], -1), wo, wo_scale, residual)


# ---- MoE router -----------------------------------------------------------------------------

def router_logits(x: jax.Array, gate: jax.Array) -> jax.Array:
    """The router's logits [T, E] in fp32: x [T, H] · gate [E, H]ᵀ, both read in fp32."""
    return jnp.einsum("th,eh->te", x.astype(F32), gate.astype(F32))


def route(cfg: ModelConfig, x: jax.Array, gate: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sigmoid group-limited routing: (weights [T, k] fp32, expert ids [T, k] int32)."""
    return select_experts(cfg, router_logits(x, gate), bias)


def norm_route(cfg: ModelConfig, x: jax.Array, norm_weight: jax.Array, eps: float, gate: jax.Array,
               bias: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(f, weights, ids): f = rms_norm(x, norm_weight, eps), the MoE's input, and `route` of f (the
    router is the first reader of a MoE layer's normed input; its kernel writes f for the routed
    experts)."""
    f = rms_norm(x, norm_weight, eps)
    return (f, *route(cfg, f, gate, bias))


def select_experts(cfg: ModelConfig, logits: jax.Array, bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The router's selection from fp32 logits [T, E]: selection uses sigmoid score + bias (top-2 sum
    per group, top groups, then top experts, in descending order, ties to the lower index); weights are
    the unbiased scores of the chosen experts, normalised, times routed_scaling_factor.

    Each stage ranks by comparing every pair of candidates (`_descending_ranks`): for the ≤ 256
    experts of a router that is a few XLA fusions, where `lax.top_k` is a sort kernel (and a copy) per
    stage on the GPU, and it picks exactly what top_k picks."""
    s = jax.nn.sigmoid(logits.astype(F32))
    biased = s + bias.astype(F32)[None, :]
    t, e = biased.shape
    if cfg.n_group > 1:
        grouped = biased.reshape(t, cfg.n_group, e // cfg.n_group)
        group_score = jnp.where(_descending_ranks(grouped) < 2, grouped, 0.0).sum(-1)   # its top 2
        keep = _descending_ranks(group_score) < cfg.topk_group
        biased = jnp.where(jnp.repeat(keep, e // cfg.n_group, axis=1), biased, -jnp.inf)
    chosen = _descending_ranks(biased)[:, None, :] == jnp.arange(cfg.num_experts_per_tok)[:, None]   # [T, k, E]
    ids = jnp.sum(jnp.where(chosen, jnp.arange(e, dtype=jnp.int32), 0), axis=-1)
    w = jnp.take_along_axis(s, ids, axis=1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, ids


def _descending_ranks(v: jax.Array) -> jax.Array:
    """Each entry's place in v's descending order along the last axis (0 = the largest), ties to the
    lower index: #{i : v_i > v_j} + #{i < j : v_i = v_j}, counted over every pair (the last axis is
    small: experts or groups)."""
    n = v.shape[-1]
    vi, vj = v[..., :, None], v[..., None, :]
    idx = jnp.arange(n)
    ahead = (vi > vj) | ((vi == vj) & (idx[:, None] < idx[None, :]))
    return jnp.sum(ahead, axis=-2, dtype=jnp.int32)


def moe_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, gate, gate_scale, up, up_scale,
                down, down_scale, residual: jax.Array | None = None) -> jax.Array:
    """Σ_k weights[t,k] · Expert_{ids[t,k]}(x[t]) (+ residual, added like `linear_residual`). Expert
    weights are stacked [E, out, in] (with optional block scales [E, ., .]). Few tokens (T·k < E: decode)
    gather the chosen experts' weights once per (token, choice); more (prefill) group the choices by
    expert (`moe_grouped`), so each chosen expert's weights are read about once per call and no token
    runs an expert it did not choose."""
    t, k = ids.shape
    if t * k < gate.shape[0]:
        h = expert_hidden(x, ids, gate, gate_scale, up, up_scale)
        out = expert_down(h, weights, ids, down, down_scale)
    else:
        out = moe_grouped(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale)
    return out if residual is None else residual + out


GROUP_ROWS = 64   # rows of one expert's tile in `moe_grouped` (wgmma's M)


def group_by_expert(ids: jax.Array, n_experts: int, rows: int = GROUP_ROWS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The T·k choices ids [T, k] sorted by expert into tiles of `rows` rows, each tile holding choices
    of one expert only: (the choice in each tile row [n_tiles, rows] int32: its flat index t·k + j, or
    T·k for an empty row; the expert of each tile [n_tiles] int32; the tile row of each choice [T·k]).
    Within an expert the choices keep their order. n_tiles = T·k // rows + min(E, T·k) is the static
    bound (an expert's last tile may be partly empty); tiles past the used ones are empty."""
    n = ids.size
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)   # choices sorted by expert
    counts = jnp.bincount(flat, length=n_experts)
    tiles = (counts + rows - 1) // rows
    tile_end = jnp.cumsum(tiles)                       # one past each expert's last tile
    first_choice = jnp.cumsum(counts) - counts         # each expert's first place in `order`
    expert = flat[order]
    row = (tile_end - tiles)[expert] * rows + jnp.arange(n, dtype=jnp.int32) - first_choice[expert]
    n_tiles = n // rows + min(n_experts, n)
    choice = jnp.full((n_tiles * rows,), n, jnp.int32).at[row].set(order)
    place = jnp.zeros((n,), jnp.int32).at[order].set(row.astype(jnp.int32))
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), n_experts - 1)
    return choice.reshape(n_tiles, rows), tile_expert.astype(jnp.int32), place


def moe_grouped(x: jax.Array, weights: jax.Array, ids: jax.Array, gate, gate_scale, up, up_scale,
                down, down_scale, rows: int = GROUP_ROWS) -> jax.Array:
    """`moe_experts` for many tokens: the choices grouped by expert into tiles (`group_by_expert`),
    each tile one batched GEMM against its expert's weights (gate/up, SwiGLU, down), then each token's
    k rows gathered back and weighted as `expert_down` sums them (fp32, in a fixed order: no
    scatter-add, whose atomic order would make results vary run to run on a GPU)."""
    t, k = ids.shape
    choice, tile_expert, place = group_by_expert(ids, gate.shape[0], rows)
    token = jnp.where(choice < t * k, choice // k, t)                        # empty rows read a zero row
    xs = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[token]   # [n_tiles, rows, H]
    g, gs = _pick(gate, gate_scale, tile_expert)
    u, us = _pick(up, up_scale, tile_expert)
    h = (jax.nn.silu(dot("nrh,nih->nri", xs, dequantize(g, gs, x.dtype)))
         * dot("nrh,nih->nri", xs, dequantize(u, us, x.dtype))).astype(x.dtype)
    d, ds = _pick(down, down_scale, tile_expert)
    y = dot("nri,nhi->nrh", h, dequantize(d, ds, x.dtype)).reshape(-1, x.shape[1])
    return dot("tk,tkh->th", weights, y[place].reshape(t, k, -1)).astype(x.dtype)


def _pick(w, s, sel):
    return w[sel], (None if s is None else s[sel])


def expert_hidden(x: jax.Array, ids: jax.Array, gate, gate_scale, up, up_scale) -> jax.Array:
    """h [T·k, I] = silu(x[t] · gate[ids[t,j]]ᵀ) · (x[t] · up[ids[t,j]]ᵀ) for the chosen experts only,
    fp32 math, in x.dtype (the first half of `moe_experts` for few tokens)."""
    sel = ids.reshape(-1)
    g, gs = _pick(gate, gate_scale, sel)
    u, us = _pick(up, up_scale, sel)
    xs = jnp.repeat(x, ids.shape[1], axis=0)  # [T*k, hidden]
    h = (jax.nn.silu(dot("nh,nih->ni", xs, dequantize(g, gs, x.dtype)))
         * dot("nh,nih->ni", xs, dequantize(u, us, x.dtype)))
    return h.astype(x.dtype)


def expert_down(h: jax.Array, weights: jax.Array, ids: jax.Array, down, down_scale) -> jax.Array:
    """Σ_j weights[t,j] · down[ids[t,j]] · h[t·k + j] [T, hidden]: each expert's projection in fp32,
    the weighted sum in fp32, rounded to h.dtype (the second half of `moe_experts`)."""
    t, k = ids.shape
    d, ds = _pick(down, down_scale, ids.reshape(-1))
    y = dot("ni,nhi->nh", h, dequantize(d, ds, h.dtype))
    return dot("tk,tkh->th", weights, y.reshape(t, k, -1)).astype(h.dtype)
