"""On a GPU: the attention prep kernel (`jtilert.pallas.mla_prep`) against `reference.mla_prep` on random
inputs at the real shapes (dsv32-tp8-shard: 16 heads of 192, glm5-tp8-shard: 8 heads of 256; one
token and MTP verify's two), on layer 1 of 3-layer stacks of 4096 cache rows. Prints max |Δ| of q_pe,
the latent row and the rope-key row, whether the rest of the stacks is unchanged bit for bit, the
kernel's device time, and ok / FAIL; exit code 1 on a failure. JSON to --out, and to
$SAVE_TO/prep_check.json where SAVE_TO is set.

Tolerance: one bf16 step of the value (|Δ| ≤ 2^-8 · max(|ref|, 2^-10)). In interpret mode the
kernel equals the reference bit for bit; on the GPU the fp32 rope products may contract into FMAs
differently in XLA's fusion and Mosaic's code, and the norm's sum runs in another order.

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
    result = {"mla_prep": results, "ok": all(r["ok"] for r in results)}
    paths = [a.out] + ([os.path.join(os.environ["SAVE_TO"], "prep_check.json")] if os.environ.get("SAVE_TO") else [])
    for path in filter(None, paths):
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print("ok" if result["ok"] else "FAIL")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
