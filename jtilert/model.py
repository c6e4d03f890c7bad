"""The decoder as Flax (nnx) modules: MLA with the absorbed decode formulation and a latent cache,
the DSA lightning indexer, dense SwiGLU and the sigmoid-routed MoE, the lm head and the MTP block.

Every step takes T new tokens at positions start..start+T-1 (T = 1 when decoding, 2 in an MTP verify
step, a chunk in prefill), writes them into the preallocated caches and attends over the caches.
The same code runs unsharded and as one rank of a tensor-parallel mesh: local sizes (heads, expert
width, vocab) are read off the weights, and partial sums go through `sharding.all_reduce`.
Module and parameter names follow the HF checkpoint keys, so loading is a rename.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
from flax import nnx

from jtilert import backend, layers, sharding
from jtilert.config import ModelConfig
from jtilert.quant import dequantize, quantize_weight
from jtilert.sampling import sample

F32 = jnp.float32
WEIGHT_FORMATS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp8": jnp.bfloat16}
HEAD_CANDIDATES = 8  # top logits the head hands to decode sampling (greedy, or top_k ≤ 8)
SUBLAYER_EPS = 1e-6  # q_a / kv_a layernorms and the indexer's k_norm use a fixed eps in both model families


def compute_dtype(fmt: str):
    """Activation dtype for a weight format: fp32 weights compute in fp32, bf16 and fp8 in bf16."""
    return WEIGHT_FORMATS[fmt]


class Linear(nnx.Module):
    """y = x · Wᵀ, W [out, in] (or stacked [E, out, in] for experts) in fp32/bf16, or fp8 with 128×128 block scales."""

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

    def dequantized(self, dtype) -> jax.Array:
        return dequantize(self.weight[...], self.scale_or_none, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return backend.ops().linear(x, self.weight[...], self.scale_or_none)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.weight = nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (dim,), F32)).astype(dtype))
        self.eps = eps

    def __call__(self, x):
        return layers.rms_norm(x, self.weight[...], self.eps)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs, dtype=jnp.bfloat16):
        self.weight = nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (dim,), F32)).astype(dtype))
        self.bias = nnx.Param((0.1 * jax.random.normal(rngs.params(), (dim,), F32)).astype(dtype))

    def __call__(self, x):
        return layers.layer_norm(x, self.weight[...], self.bias[...], SUBLAYER_EPS)


def _swiglu_arrays(gate: Linear, up: Linear, down: Linear) -> tuple:
    """(gate, gate_scale, up, up_scale, down, down_scale): the argument order of the SwiGLU ops."""
    return tuple(a for lin in (gate, up, down) for a in (lin.weight[...], lin.scale_or_none))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) · up(x)); under tp each rank holds a slice of the intermediate dim."""

    def __init__(self, cfg: ModelConfig, width: int, *, rngs, fmt):
        self.gate_proj = Linear(cfg.hidden_size, width, rngs=rngs, fmt=fmt)
        self.up_proj = Linear(cfg.hidden_size, width, rngs=rngs, fmt=fmt)
        self.down_proj = Linear(width, cfg.hidden_size, rngs=rngs, fmt=fmt)

    def arrays(self) -> tuple:
        return _swiglu_arrays(self.gate_proj, self.up_proj, self.down_proj)

    def __call__(self, x):
        g, gs, u, us, d, ds = self.arrays()
        return sharding.linear_all_reduce(backend.ops().swiglu_hidden(x, g, gs, u, us), d, ds)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (cfg.n_routed_experts, cfg.hidden_size), F32)
                                * cfg.hidden_size**-0.5)
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
    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        self.cfg = cfg
        self.gate = Router(cfg, rngs=rngs)
        self.experts = Experts(cfg, rngs=rngs, fmt=fmt)
        self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts, rngs=rngs, fmt=fmt)

    def __call__(self, x):
        weights, ids = backend.ops().route(self.cfg, x, self.gate.weight[...], self.gate.e_score_correction_bias[...])
        return sharding.moe_all_reduce(x, weights, ids, self.experts.arrays(), self.shared_experts.arrays())


class Indexer(nnx.Module):
    """DSA lightning indexer: scores every cached position for the new tokens and keeps the top-k."""

    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        self.cfg = cfg
        norm_dtype = WEIGHT_FORMATS[fmt]
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, rngs=rngs, fmt=fmt)
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim, rngs=rngs, fmt=fmt)
        self.k_norm = LayerNorm(cfg.index_head_dim, rngs=rngs, dtype=norm_dtype)
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, rngs=rngs, fmt="fp32", quantizable=False)

    def __call__(self, x, qa, cos, sin, positions, start, cache):
        cfg, ops = self.cfg, backend.ops()
        t, r = x.shape[0], cfg.qk_rope_head_dim
        q = self.wq_b(qa).reshape(t, cfg.index_n_heads, cfg.index_head_dim)
        k = self.k_norm(self.wk(x))
        rot = cfg.indexer_rope_interleaved
        q = jnp.concatenate([layers.apply_rope(q[..., :r], cos, sin, rot), q[..., r:]], axis=-1)
        k = jnp.concatenate([layers.apply_rope(k[..., :r], cos, sin, rot), k[..., r:]], axis=-1)
        w = layers.linear(x.astype(F32), self.weights_proj.weight[...].astype(F32))
        w = w * (cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)
        q, w = layers.indexer_query(cfg, q, w)
        first, num = sharding.indexer_rows(cache["index_k"].shape[0], t)   # this rank's rows when split
        scores, k_cache, k_scale = ops.indexer_append_scores(cfg, q, w, k, cache["index_k"], cache.get("index_scale"),
                                                             positions, start, first_row=first, num_rows=num)
        cache = dict(cache, index_k=k_cache)
        if k_scale is not None:
            cache["index_scale"] = k_scale
        _record(self, "scores", scores)
        if num is not None:
            return sharding.split_topk(scores, cfg.index_topk), cache
        return ops.topk_positions(scores, cfg.index_topk), cache


class Attention(nnx.Module):
    """Multi-head latent attention, absorbed for decode: queries are moved into the latent space so
    attention reads only the cached latent rows (kv_lora + rope key per position)."""

    def __init__(self, cfg: ModelConfig, has_indexer: bool, *, rngs, fmt):
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
        self.indexer = Indexer(cfg, rngs=rngs, fmt=fmt) if has_indexer else None

    def __call__(self, x, cos, sin, positions, start, cache, topk):
        cfg, ops = self.cfg, backend.ops()
        t, lat, nope, r = x.shape[0], cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        qa = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qa)
        heads = q.shape[-1] // cfg.qk_head_dim  # local heads under tp
        q = q.reshape(t, heads, cfg.qk_head_dim)
        q_nope, q_pe = q[..., :nope], layers.apply_rope(q[..., nope:], cos, sin, True)
        kva = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kva[:, :lat])
        k_pe = layers.apply_rope(kva[:, lat:], cos, sin, True)
        if cfg.kv_cache_quant == "fp8":
            cache = dict(cache, kv=_write(cache["kv"], layers.quantize_kv_fp8(latent, k_pe), start))
        else:
            cache = dict(cache, kv=_write(cache["kv"], latent, start), pe=_write(cache["pe"], k_pe, start))
        if self.indexer is not None:
            topk, cache = self.indexer(x, qa, cos, sin, positions, start, cache)
        wkv = self.kv_b_proj.dequantized(x.dtype).reshape(heads, nope + cfg.v_head_dim, lat)
        q_lat = layers.dot("thn,hnl->thl", q_nope, wkv[:, :nope]).astype(x.dtype)
        _record(self, "q_lat", q_lat)
        _record(self, "q_pe", q_pe)
        o_lat = ops.sparse_mla(q_lat, q_pe, cache["kv"], cache.get("pe"), *topk, cfg.softmax_scale)
        o = layers.dot("thl,hvl->thv", o_lat.astype(x.dtype), wkv[:, nope:])
        o = o.reshape(t, heads * cfg.v_head_dim).astype(x.dtype)
        out = sharding.linear_all_reduce(o, self.o_proj.weight[...], self.o_proj.scale_or_none)
        return out, cache, topk


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, *, rngs, fmt):
        norm_dtype = WEIGHT_FORMATS[fmt]
        has_indexer = index >= cfg.num_hidden_layers or cfg.indexer_types[index] == "full"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)
        self.self_attn = Attention(cfg, has_indexer, rngs=rngs, fmt=fmt)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)
        self.mlp = MoE(cfg, rngs=rngs, fmt=fmt) if cfg.is_moe(index) else MLP(cfg, cfg.intermediate_size, rngs=rngs, fmt=fmt)

    def __call__(self, x, cos, sin, positions, start, cache, topk):
        a, cache, topk = self.self_attn(self.input_layernorm(x), cos, sin, positions, start, cache, topk)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h)), cache, topk


class MTP(nnx.Module):
    """Multi-token prediction block: from the main model's last hidden state at position i and the
    embedding of token i+1, predicts token i+2 (the draft for speculative decoding)."""

    def __init__(self, cfg: ModelConfig, *, rngs, fmt):
        norm_dtype = WEIGHT_FORMATS[fmt]
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, rngs=rngs, fmt=fmt)
        self.layer = DecoderLayer(cfg, cfg.num_hidden_layers, rngs=rngs, fmt=fmt)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=norm_dtype)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, fmt: str = "bf16", dtype=None):
        if fmt not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {tuple(WEIGHT_FORMATS)}")
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype or compute_dtype(fmt))
        dense_dtype = WEIGHT_FORMATS[fmt]
        self.embed_tokens = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), F32)
                                      .astype(dense_dtype))
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs=rngs, fmt=fmt) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs, dtype=dense_dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, fmt=fmt, quantizable=False)
        self.mtp = MTP(cfg, rngs=rngs, fmt=fmt) if cfg.num_nextn_predict_layers else None

    def _rope(self, positions):
        return layers.rope_cos_sin(self.cfg, positions)

    def logits(self, h, norm: RMSNorm):
        """Full-vocab fp32 logits [T, V] (gathered over tp ranks from the vocab-split head)."""
        local = layers.dot("th,vh->tv", norm(h), self.lm_head.weight[...].astype(h.dtype))
        return sharding.all_gather_last(local)

    def next_token(self, h: jax.Array, params: dict, key: jax.Array) -> jax.Array:
        """The decode step's token [1] after the last hidden state h [1, hidden]. Greedy and top-k
        sampling (top_k ≤ HEAD_CANDIDATES) draw from the head's top candidates, so the full logits row
        is never written (the Pallas head keeps only its top logits); other settings sample the full
        logits. Both give exactly the distribution of `sample(logits)`, greedy the same token. Only
        the chosen branch streams the head's weights."""
        w = self.lm_head.weight[...]
        k = min(HEAD_CANDIDATES, w.shape[0])   # candidates per rank, and after the merge

        def from_candidates():
            vals, ids = sharding.top_candidates(*backend.ops().lm_head_topk(self.norm(h), w, k), w.shape[0])
            return ids[0, sample(vals[0], params, key)][None]

        fits = (params["temperature"] <= 0) | ((params["top_k"] > 0) & (params["top_k"] <= k))
        return jax.lax.cond(fits, from_candidates, lambda: sample(self.logits(h, self.norm)[0], params, key)[None])

    def hidden(self, tokens: jax.Array, start: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """Main model on tokens [T] at positions start.. up to the final norm: (hidden [T, hidden], cache)."""
        positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
        cos, sin = self._rope(positions)
        x = self.embed_tokens[...][tokens].astype(self.dtype)
        new_layers, topk = [], None
        for layer, c in zip(self.layers, cache["layers"]):
            x, c, topk = layer(x, cos, sin, positions, start, c, topk)
            new_layers.append(c)
        return x, dict(cache, layers=new_layers)

    def __call__(self, tokens: jax.Array, start: jax.Array, cache: dict):
        """Main model on tokens [T] at positions start.. : (logits [T, V] fp32, hidden [T, hidden], cache)."""
        x, cache = self.hidden(tokens, start, cache)
        return self.logits(x, self.norm), x, cache

    def draft(self, hidden: jax.Array, next_tokens: jax.Array, start: jax.Array, cache: dict):
        """MTP block at positions start.. on the main model's hidden states and the tokens that
        followed them: (logits of the token after next [T, V], cache)."""
        m = self.mtp
        positions = start + jnp.arange(hidden.shape[0], dtype=jnp.int32)
        cos, sin = self._rope(positions)
        e = self.embed_tokens[...][next_tokens].astype(self.dtype)
        x = m.eh_proj(jnp.concatenate([m.enorm(e), m.hnorm(hidden)], axis=-1))
        x, c, _ = m.layer(x, cos, sin, positions, start, cache["mtp"], None)
        return self.logits(x, m.norm), dict(cache, mtp=c)


def _record(module: nnx.Module, name: str, value) -> None:
    """Expose an intermediate to `nnx.capture` (models/tiny/train.py distils the indexer from them).
    Outside a capture it does nothing: a plain `sow` would add variables to the model's state."""
    if hasattr(module, "__captures__"):  # set by nnx.capture (flax 0.12)
        module.sow(nnx.Intermediate, name, value)


def _write(buf: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    """Write rows [T, ...] into a preallocated cache buffer [S, ...] at row `start`."""
    return jax.lax.dynamic_update_slice(buf, rows.astype(buf.dtype), (start,) + (0,) * (buf.ndim - 1))


def init_cache(cfg: ModelConfig, rows: int, dtype) -> dict:
    """Preallocated per-layer caches for `rows` positions: latent `kv` and rope key `pe` (or, with
    kv_cache_quant="fp8", `kv` alone in FlashMLA's packed fp8 rows), and for layers with their own
    indexer the index keys (fp8 + one fp32 scale per position in fp8 mode)."""
    def layer_cache(has_indexer):
        lat, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if cfg.kv_cache_quant == "fp8":
            c = {"kv": jnp.zeros((rows, layers.kv_fp8_words(lat, r)), jnp.uint32)}
        else:
            c = {"kv": jnp.zeros((rows, lat), dtype), "pe": jnp.zeros((rows, r), dtype)}
        if has_indexer:
            fp8 = cfg.index_quant == "fp8"
            c["index_k"] = jnp.zeros((rows, cfg.index_head_dim), jnp.float8_e4m3fn if fp8 else dtype)
            if fp8:
                c["index_scale"] = jnp.ones((rows,), F32)
        return c

    cache = {"layers": [layer_cache(t == "full") for t in cfg.indexer_types]}
    if cfg.num_nextn_predict_layers:
        cache["mtp"] = layer_cache(True)
    return cache


def random_model(cfg: ModelConfig | str, fmt: str = "bf16", seed: int = 0, dtype=None, mesh=None) -> Transformer:
    """A model with random weights, made on the devices: each part is built by a compiled function
    (layers of one kind share one compilation) straight into its tensor-parallel sharding, so even
    a full-size model never passes through one device or the host."""
    if isinstance(cfg, str):
        from jtilert.config import preset
        cfg = preset(cfg)
    norm_dtype = WEIGHT_FORMATS[fmt]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), fmt=fmt, dtype=dtype)))
    first_of_kind = {}
    for i, t in enumerate(cfg.indexer_types):
        first_of_kind.setdefault((t, cfg.is_moe(i)), i)

    def part(name, ctor, prefix=()):
        key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(name.encode()))
        return _build(ctor, mesh, prefix)(key)

    for i, t in enumerate(cfg.indexer_types):
        rep = first_of_kind[(t, cfg.is_moe(i))]
        state["layers"][i] = part(f"layers.{i}", _Ctor(DecoderLayer, cfg, rep, fmt=fmt))
    state["norm"] = part("norm", _Ctor(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, dtype=norm_dtype))
    state["lm_head"] = part("lm_head", _Ctor(Linear, cfg.hidden_size, cfg.vocab_size, fmt=fmt, quantizable=False),
                            prefix=("lm_head",))
    if cfg.num_nextn_predict_layers:
        state["mtp"] = part("mtp", _Ctor(MTP, cfg, fmt=fmt))
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
def _build(ctor: _Ctor, mesh, prefix: tuple):
    """The compiled builder of one kind of sub-module, its outputs in their tp shardings; `prefix`
    is the sub-module's own name where the sharding rule needs it (the lm head)."""
    abstract = nnx.split(nnx.eval_shape(lambda: ctor(nnx.Rngs(0))))[1]
    shardings = None if mesh is None else jax.tree_util.tree_map_with_path(
        lambda p, x: jax.sharding.NamedSharding(mesh, sharding.spec_for(prefix + sharding.path_names(p), x.ndim)),
        abstract)
    return jax.jit(lambda key: nnx.split(ctor(nnx.Rngs(key)))[1], out_shardings=shardings)
