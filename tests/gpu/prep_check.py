"""On a GPU: the attention prep kernel (`jtilert.pallas.mla_prep`) against `reference.mla_prep` on random
inputs at the real shapes (dsv32-tp8-shard: 16 heads of 192, glm5-tp8-shard: 8 heads of 256; one
token and MTP verify's two), on layer 1 of 3-layer stacks of 4096 cache rows. Prints max |Δ| of q_pe,
the latent row and the rope-key row, whether the rest of the stacks is unchanged bit for bit, the
kernel's device time, and ok / FAIL; exit code 1 on a failure. Then the indexer prep kernel
(`jtilert.pallas.index_prep`) against `reference.index_prep` at the same presets' indexer shapes
(64 heads, half-split rope / 32 heads, interleaved), layer 1 of the k_norm stacks: max |Δ| of the
dequantised queries (q · scale) in fp8 steps, the share of fp8 values and the scales that differ, max
relative |Δ| of the head weights, max |Δ| of the Hadamard-rotated fp32 key and its largest share of
the tolerance, device time, ok / FAIL. JSON to --out, and to $SAVE_TO/prep_check.json where SAVE_TO
is set.

Tolerance: one bf16 step of the value (|Δ| ≤ 2^-8 · max(|ref|, 2^-10)). In interpret mode the
kernel equals the reference bit for bit; on the GPU the fp32 rope products may contract into FMAs
differently in XLA's fusion and Mosaic's code, and the norm's sum runs in another order. index_prep:
the key's roped bf16 values as mla_prep's rows, carried through the rotation (entries ±D^-0.5: each
key value within D^-0.5 · Σ_d of those steps), plus 2^-15 · Σ_d |k_d|·D^-0.5 for the two fp32 sums
(D·2^-24 each in round-to-nearest; twice that leaves room for the tensor core's accumulation); the
queries within one fp8 step of the row's scale (the Hadamard rotation
sums in the tensor core's order, the reference's fp32 einsum (at "highest" precision: not TF32) in
XLA's, so a value near an fp8 rounding midpoint may round the other way; at most 1% of them may
differ), the head weights bit for bit where the row's scale agrees (a scale may differ by a factor 2
where the row's amax lies within fp32 noise of a power-of-two boundary: at most 1% of the rows).

    PYTHONPATH=. python3 tests/gpu/prep_check.py [--out prep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jtilert
from jtilert.ops import reference
from jtilert.pallas import index_prep as ip
from jtilert.pallas import mla_prep as mp

BF16 = jnp.bfloat16
NL, S, LAYER = 3, 4096, 1


def _median_us(f, *args, iterations=20) -> float | None:
    try:
        from jax.experimental.mosaic.gpu import profiler
        jax.block_until_ready(f(*args))
        _, per_iter = profiler.Cupti(finalize=False).measure(f, aggregate=False, iterations=iterations)(*args)
        return float(np.median([sum(t for _, t in it) for it in per_iter])) * 1e3
    except Exception as e:  # noqa: BLE001 - timing is a bonus, the check is the point
        print(f"  (no timing: {e})")
        return None


def case(name: str, tokens: int, seed: int) -> dict:
    cfg = jtilert.preset(name)
    h, qk, r, lat = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    kv_col = cfg.q_lora_rank + cfg.index_head_dim            # x_proj: q_a, the indexer's wk, kv_a
    q_w = h * qk + cfg.index_n_heads * cfg.index_head_dim      # qr_proj: q_b, the indexer's wq_b
    k = jax.random.split(jax.random.key(seed), 6)
    start = jnp.int32(S - 7)
    q_x = jax.random.normal(k[0], (tokens, q_w), BF16)
    kv_x = (jax.random.normal(k[1], (tokens, kv_col + lat + r)) * 3).astype(BF16)
    norm = (1 + 0.1 * jax.random.normal(k[2], (NL, lat))).astype(BF16)
    cos, sin = reference.rope_cos_sin(cfg, start + jnp.arange(tokens, dtype=jnp.int32))
    kv = jax.random.normal(k[3], (NL, S, lat), BF16)
    pe = jax.random.normal(k[4], (NL, S, r), BF16)
    args = (q_x, kv_x, norm, cos, sin, kv, pe, start, jnp.int32(LAYER))

    def kern(q_x, kv_x, norm, cos, sin, kv, pe, start, layer):
        return mp.mla_prep(q_x, kv_x, kv_col, h, qk, norm, 1e-6, cos, sin, kv, pe, start, layer=layer)

    def ref(q_x, kv_x, norm, cos, sin, kv, pe, start, layer):
        return reference.mla_prep(q_x, kv_x, kv_col, h, qk, norm, 1e-6, cos, sin, kv, pe, start, layer=layer)

    got = jax.tree.map(lambda a: np.asarray(a, np.float32), jax.jit(kern)(*args))
    want = jax.tree.map(lambda a: np.asarray(a, np.float32), jax.jit(ref)(*args))
    rows = slice(int(start), int(start) + tokens)
    parts = {"q_pe": (got[0], want[0]), "latent": (got[1][LAYER, rows], want[1][LAYER, rows]),
             "k_pe": (got[2][LAYER, rows], want[2][LAYER, rows])}
    out = {"preset": name, "tokens": tokens}
    ok = True
    for what, (a, b) in parts.items():
        d = np.abs(a - b)
        out[f"{what}_max_abs_diff"] = float(d.max())
        out[f"{what}_bit_equal"] = bool((a == b).all())
        ok &= bool((d <= 2.0 ** -8 * np.maximum(np.abs(b), 2.0 ** -10)).all())
    rest = []
    for new, old in ((got[1], np.asarray(kv, np.float32)), (got[2], np.asarray(pe, np.float32))):
        new, old = new.copy(), old.copy()
        new[LAYER, rows] = old[LAYER, rows] = 0
        rest.append(bool(np.array_equal(new, old)))
    out["rest_unchanged"] = all(rest)
    ok &= all(rest)
    out["kernel_us"] = _median_us(jax.jit(kern), *args)
    out["ok"] = ok
    print(f"{name} T={tokens}: q_pe {out['q_pe_max_abs_diff']:.3g}, latent {out['latent_max_abs_diff']:.3g}, "
          f"k_pe {out['k_pe_max_abs_diff']:.3g}, rest unchanged {out['rest_unchanged']}, "
          f"{out['kernel_us'] or float('nan'):.1f} us: {'ok' if ok else 'FAIL'}")
    return out


def index_case(name: str, tokens: int, seed: int) -> dict:
    cfg = jtilert.preset(name)
    hi, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q_col = cfg.num_attention_heads * cfg.qk_head_dim         # qr_proj: q_b, then the indexer's wq_b
    k_col = cfg.q_lora_rank                                    # x_proj: q_a, the indexer's wk, kv_a
    k = jax.random.split(jax.random.key(seed), 6)
    start = jnp.int32(S - 7)
    q_x = jax.random.normal(k[0], (tokens, q_col + hi * d), BF16)
    k_x = (jax.random.normal(k[1], (tokens, k_col + d + cfg.kv_lora_rank + r)) * 3 + 0.5).astype(BF16)
    nw = (1 + 0.1 * jax.random.normal(k[2], (NL, d))).astype(BF16)
    nb = (0.1 * jax.random.normal(k[3], (NL, d))).astype(BF16)
    cos, sin = reference.rope_cos_sin(cfg, start + jnp.arange(tokens, dtype=jnp.int32))
    w = jax.random.normal(k[4], (tokens, hi), jnp.float32) * (hi**-0.5 * d**-0.5)
    args = (q_x, k_x, nw, nb, cos, sin, w, jnp.int32(LAYER))

    def kern(q_x, k_x, nw, nb, cos, sin, w, layer):
        return ip.index_prep(cfg, q_x, q_col, k_x, k_col, nw, nb, 1e-6, cos, sin, w, layer=layer)

    def ref(q_x, k_x, nw, nb, cos, sin, w, layer):
        """The reference's outputs and its roped key before the rotation (its bf16 values)."""
        ref_args = (q_x, q_col, k_x, k_col, nw[layer], nb[layer], 1e-6, cos, sin, w)
        plain = reference.index_prep(cfg.replace(index_quant="none"), *ref_args)
        return reference.index_prep(cfg, *ref_args), plain[2]

    got = jax.tree.map(lambda a: np.asarray(a, np.float32), jax.jit(kern)(*args))
    with jax.default_matmul_precision("highest"):   # the Hadamard einsums in fp32, not TF32
        want, k_roped = jax.tree.map(lambda a: np.asarray(a, np.float32), jax.jit(ref)(*args))
    w0 = np.asarray(w)
    scale = [g / w0 for g in (got[1], want[1])]               # each row's power-of-two scale
    deq = [q * s[..., None] for q, s in zip((got[0], want[0]), scale)]
    out = {"preset": name, "tokens": tokens}
    same = scale[0] == scale[1]
    coarse = np.maximum(scale[0], scale[1])[..., None]
    mag = np.maximum(np.abs(deq[0]), np.abs(deq[1])) / coarse     # e4m3 steps: 2^(e-3), 2^-9 below 2^-6
    step = 2.0 ** (np.floor(np.log2(np.maximum(mag, 2.0 ** -6))) - 3) * coarse
    out["q_max_diff_in_steps"] = float((np.abs(deq[0] - deq[1]) / step).max())
    out["q_fp8_differ"] = float(np.mean(got[0] != want[0]))
    out["scales_differ"] = int((~same).sum())
    out["w_max_rel_diff"] = float((np.abs(got[1] - want[1]) / np.abs(want[1])).max())
    out["k_max_abs_diff"] = float(np.abs(got[2] - want[2]).max())
    out["k_bit_equal"] = bool((got[2] == want[2]).all())
    steps = 2.0 ** -8 * np.maximum(np.abs(k_roped), 2.0 ** -10) + 2.0 ** -15 * np.abs(k_roped)
    k_tol = steps.sum(-1, keepdims=True) * d**-0.5                # the docstring's key tolerance
    out["k_max_share_of_tolerance"] = float((np.abs(got[2] - want[2]) / k_tol).max())
    ok = bool(out["q_max_diff_in_steps"] <= 1 and out["q_fp8_differ"] <= 0.01 and same.mean() >= 0.99)
    ok &= bool((got[1][same] == want[1][same]).all())          # w times the same power of two: exact
    ok &= bool(got[2].shape == want[2].shape == (tokens, d) and out["k_max_share_of_tolerance"] <= 1)
    out["kernel_us"] = _median_us(jax.jit(kern), *args)
    out["ok"] = ok
    print(f"index_prep {name} T={tokens}: q {out['q_max_diff_in_steps']:.3g} fp8 steps "
          f"({100 * out['q_fp8_differ']:.2f}% differ, {out['scales_differ']} scales), "
          f"w {out['w_max_rel_diff']:.3g} rel, "
          f"k {out['k_max_abs_diff']:.3g} ({out['k_max_share_of_tolerance']:.2g} of the tolerance), "
          f"{out['kernel_us'] or float('nan'):.1f} us: {'ok' if ok else 'FAIL'}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    print("devices:", jax.devices())
    results = []
    for i, (name, tokens) in enumerate([("dsv32-tp8-shard", 1), ("dsv32-tp8-shard", 2),
                                        ("glm5-tp8-shard", 1), ("glm5-tp8-shard", 2)]):
        try:
            results.append(case(name, tokens, seed=i))
        except Exception as e:  # noqa: BLE001 - report every case
            print(f"{name} T={tokens}: FAIL ({type(e).__name__}: {e})")
            results.append({"preset": name, "tokens": tokens, "ok": False, "error": f"{type(e).__name__}: {e}"})
    index_results = []
    for i, (name, tokens) in enumerate([("dsv32-tp8-shard", 1), ("dsv32-tp8-shard", 2),
                                        ("glm5-tp8-shard", 1), ("glm5-tp8-shard", 2)]):
        try:
            index_results.append(index_case(name, tokens, seed=10 + i))
        except Exception as e:  # noqa: BLE001 - report every case
            print(f"index_prep {name} T={tokens}: FAIL ({type(e).__name__}: {e})")
            index_results.append({"preset": name, "tokens": tokens, "ok": False, "error": f"{type(e).__name__}: {e}"})
    result = {"mla_prep": results, "index_prep": index_results,
              "ok": all(r["ok"] for r in results + index_results)}
    paths = [a.out] + ([os.path.join(os.environ["SAVE_TO"], "prep_check.json")] if os.environ.get("SAVE_TO") else [])
    for path in filter(None, paths):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print("ok" if result["ok"] else "FAIL")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
