"""Independent float64 NumPy re-implementation used to cross-check the golden files.

Reads only ``config.json`` + ``model.safetensors`` (per-expert key layout) and
``golden.npz`` -- no torch, no transformers -- and recomputes the prompt logits,
the greedy continuation and the indexer scores from the math in
shared/notes/MODELS.md. A mismatch means either the golden files or our
understanding of the reference math is wrong.

    /tmp/tfvenv/bin/python tests/golden/verify_numpy.py      # needs numpy + safetensors
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file

HERE = os.path.dirname(os.path.abspath(__file__))


def rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def layernorm(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return w * (x - mu) / np.sqrt(var + eps) + b


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope_tables(cfg, positions):
    """inv_freq and cos/sin [T, rope_dim/2] (HF conventions, incl. YaRN)."""
    rp = cfg["rope_parameters"]
    d = cfg["qk_rope_head_dim"]
    base = rp["rope_theta"]
    pos_freqs = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    attn_factor = 1.0
    if rp.get("rope_type", "default") == "yarn":
        factor = rp["factor"]
        orig = rp["original_max_position_embeddings"]
        beta_fast, beta_slow = rp.get("beta_fast", 32), rp.get("beta_slow", 1)

        def corr_dim(n_rot):
            return (d * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        inv_freq = (1 / (factor * pos_freqs)) * (1 - extrap) + (1 / pos_freqs) * extrap

        def mscale(s, m):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if rp.get("mscale") and rp.get("mscale_all_dim"):
            attn_factor = mscale(factor, rp["mscale"]) / mscale(factor, rp["mscale_all_dim"])
        else:
            attn_factor = mscale(factor, 1)
    else:
        inv_freq = 1.0 / pos_freqs
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang) * attn_factor, np.sin(ang) * attn_factor


def rope_interleaved(x, cos, sin):
    """x [..., T, (H,) d]; pairs (x[2i], x[2i+1]) rotated by angle i. Output kept interleaved."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out


def rope_half(x, cos, sin):
    """Non-interleaved (half-split) RoPE: pairs (x[i], x[i + d/2])."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def softmax_scale(cfg):
    s = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rp = cfg["rope_parameters"]
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        m = 0.1 * rp["mscale_all_dim"] * math.log(rp["factor"]) + 1.0
        s *= m * m
    return s


def forward(cfg, W, ids, is_glm):
    g = lambda k: W[k].astype(np.float64)
    T = len(ids)
    H, dn, dr, dv = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    kvl = cfg["kv_lora_rank"]
    IH, ID, topk = cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"]
    eps = cfg["rms_norm_eps"]
    cos, sin = rope_tables(cfg, np.arange(T))
    scale = softmax_scale(cfg)
    causal = np.tril(np.ones((T, T), dtype=bool))
    indexer_types = cfg.get("indexer_types") or ["full"] * cfg["num_hidden_layers"]
    x = g("model.embed_tokens.weight")[ids]
    sel = None
    all_scores = {}
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        h = rms(x, g(p + "input_layernorm.weight"), eps)
        # ---- MLA (q_a / kv_a norms use eps 1e-6 in HF regardless of rms_norm_eps)
        qa = rms(h @ g(p + "self_attn.q_a_proj.weight").T, g(p + "self_attn.q_a_layernorm.weight"), 1e-6)
        q = (qa @ g(p + "self_attn.q_b_proj.weight").T).reshape(T, H, dn + dr)
        kva = h @ g(p + "self_attn.kv_a_proj_with_mqa.weight").T
        c = rms(kva[:, :kvl], g(p + "self_attn.kv_a_layernorm.weight"), 1e-6)
        kpe = rope_interleaved(kva[:, kvl:], cos, sin)  # [T, dr]
        qpe = rope_interleaved(q[..., dn:].transpose(1, 0, 2), cos, sin)  # [H, T, dr]
        kvb = g(p + "self_attn.kv_b_proj.weight").reshape(H, dn + dv, kvl)
        w_uk, w_uv = kvb[:, :dn], kvb[:, dn:]
        qlat = np.einsum("thn,hnc->htc", q[..., :dn], w_uk)  # absorbed
        sc = (np.einsum("htc,sc->hts", qlat, c) + np.einsum("htr,sr->hts", qpe, kpe)) * scale
        # ---- DSA indexer
        if indexer_types[L] == "full":
            qi = (qa @ g(p + "self_attn.indexer.wq_b.weight").T).reshape(T, IH, ID)
            ki = layernorm(
                h @ g(p + "self_attn.indexer.wk.weight").T,
                g(p + "self_attn.indexer.k_norm.weight"),
                g(p + "self_attn.indexer.k_norm.bias"),
            )
            rot = rope_interleaved if is_glm else rope_half
            qi = np.concatenate([rot(qi[..., :dr].transpose(1, 0, 2), cos, sin).transpose(1, 0, 2), qi[..., dr:]], -1)
            ki = np.concatenate([rot(ki[:, :dr], cos, sin), ki[:, dr:]], -1)
            wts = (h @ g(p + "self_attn.indexer.weights_proj.weight").T) * IH**-0.5  # [T, IH]
            I = np.einsum("th,ths->ts", wts, np.maximum(np.einsum("thd,sd->ths", qi, ki) * ID**-0.5, 0))
            I = np.where(causal, I, -np.inf)
            all_scores[L] = I
            sel = np.zeros((T, T), dtype=bool)
            for t in range(T):
                n = min(topk, t + 1)
                sel[t, np.argsort(-I[t, : t + 1], kind="stable")[:n]] = True
        mask = causal & sel
        sc = np.where(mask[None], sc, -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        olat = np.einsum("hts,sc->htc", pr, c)
        o = np.einsum("htc,hvc->thv", olat, w_uv).reshape(T, H * dv)
        x = x + o @ g(p + "self_attn.o_proj.weight").T
        # ---- FFN
        h = rms(x, g(p + "post_attention_layernorm.weight"), eps)

        def mlp(pre, v):
            return (silu(v @ g(pre + "gate_proj.weight").T) * (v @ g(pre + "up_proj.weight").T)) @ g(
                pre + "down_proj.weight"
            ).T

        if cfg["mlp_layer_types"][L] == "dense":
            x = x + mlp(p + "mlp.", h)
            continue
        E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        ng, tg = cfg["n_group"], cfg["topk_group"]
        s = 1 / (1 + np.exp(-(h @ g(p + "mlp.gate.weight").T)))
        ch = s + g(p + "mlp.gate.e_score_correction_bias")
        out = mlp(p + "mlp.shared_experts.", h)
        for t in range(T):
            gs = np.sort(ch[t].reshape(ng, E // ng), -1)[:, -2:].sum(-1)
            keep_g = np.argsort(-gs, kind="stable")[:tg]
            allowed = np.full(E, -np.inf)
            for gi in keep_g:
                allowed[gi * (E // ng) : (gi + 1) * (E // ng)] = ch[t, gi * (E // ng) : (gi + 1) * (E // ng)]
            ex = np.argsort(-allowed, kind="stable")[:k]
            wt = s[t, ex]
            if cfg["norm_topk_prob"]:
                wt = wt / (wt.sum() + 1e-20)
            wt = wt * cfg["routed_scaling_factor"]
            for e, we in zip(ex, wt):
                out[t] += we * mlp(p + f"mlp.experts.{e}.", h[t : t + 1])[0]
        x = x + out
    x = rms(x, g("model.norm.weight"), eps)
    return x @ g("lm_head.weight").T, all_scores


def main() -> int:
    bad = 0
    for name in ("dsv32", "glm5", "glm52"):
        d = os.path.join(HERE, name)
        cfg = json.load(open(os.path.join(d, "config.json")))
        W = load_file(os.path.join(d, "model.safetensors"))
        gold = np.load(os.path.join(d, "golden.npz"))
        is_glm = cfg["model_type"] == "glm_moe_dsa"
        ids = gold["input_ids"].astype(np.int64)
        logits, scores = forward(cfg, W, ids, is_glm)
        err = np.abs(logits - gold["logits"]).max()
        serr = max(
            np.abs(np.where(np.isinf(v), 0, v) - np.where(np.isinf(gold[f"index_scores_l{L}"]), 0, gold[f"index_scores_l{L}"])).max()
            for L, v in scores.items()
        )
        full = np.concatenate([ids, gold["greedy"][:-1].astype(np.int64)])
        lf, _ = forward(cfg, W, full, is_glm)
        rows = lf[len(ids) - 1 :]
        greedy_ok = bool((rows.argmax(-1) == gold["greedy"]).all())
        gerr = np.abs(rows - gold["greedy_logits"]).max()
        print(
            f"{name}: max|logits diff| {err:.2e}  max|greedy_logits diff| {gerr:.2e}  "
            f"max|index score diff| {serr:.2e}  greedy match {greedy_ok}  "
            f"logits absmax {np.abs(gold['logits']).max():.2f}"
        )
        bad += not (err < 1e-4 and gerr < 1e-4 and greedy_ok)
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
