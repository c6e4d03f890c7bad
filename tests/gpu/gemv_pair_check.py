"""On a GPU: the attention's output path as one kernel of two phases (`jtilert.pallas.gemv_pair`: W_uv
merging sparse MLA's split partials, then o_proj with the residual) against its two kernels
(`gemv.heads_linear_of_splits`, `gemv.linear_residual`) and against the reference (XLA on the same GPU),
on fresh seeded random fp8 stacks at dsv32-tp8-shard's shapes (16 heads of 128 over a 512-wide latent in
64 splits, o_proj 7168 × 2048) and GLM-5's (8 heads, W_uv in 64-blocks of scales, o_proj 6144 × 1024), at
several layers of the stack. Then both forms in a dependent chain over the layers (each output the next
residual; moe_check.time_chains), rounds alternating: CUPTI kernels and busy µs a call. JSON to --out;
exit code 1 on a mismatch.

    PYTHONPATH=. python3 tests/gpu/gemv_pair_check.py [--out gemv_pair.json] [--rounds 2]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from moe_check import L, _rel, check_main, time_chains   # tests/gpu/moe_check.py

from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import gemv, gemv_pair
from jtilert.pallas import sparse_mla as smla

BF16, F32 = jnp.bfloat16, jnp.float32
SHAPES = {"dsv32": dict(heads=16, lat=512, nv=128, d=7168, splits=64, block=128),
          "glm5": dict(heads=8, lat=512, nv=128, d=6144, splits=64, block=64)}


def _inputs(seed, heads, lat, nv, d, splits, block):
    k = jax.random.split(jax.random.key(seed), 6)
    o = jax.random.normal(k[0], (1, 1, splits, heads, lat), F32)
    m = jax.random.normal(k[1], (1, 1, splits, heads), F32) * 3
    l = jax.random.uniform(k[2], (1, 1, splits, heads), F32) + 0.5
    w, ws = quantize_weight(jax.random.normal(k[3], (L, heads, nv, lat), F32) * lat ** -0.5, block)
    wo, wos = quantize_weight(jax.random.normal(k[4], (L, d, heads * nv), F32) * (heads * nv) ** -0.5)
    res = (jax.random.normal(k[5], (1, d), F32) * 4).astype(BF16)
    return res, (o, m, l, w, ws, wo, wos)


def _forms(block):
    def pair(res, o, m, l, w, ws, wo, wos, layer):
        return gemv_pair.heads_splits_linear(o, m, l, w, ws, block, wo, wos, res, layer=layer)

    def two(res, o, m, l, w, ws, wo, wos, layer):
        x = gemv.heads_linear_of_splits(o, m, l, w, ws, block, layer=layer).reshape(1, -1)
        return gemv.linear_residual(x, wo, wos, res, layer=layer)

    def xla(res, o, m, l, w, ws, wo, wos, layer):
        x = reference.heads_linear(smla.combine(o, m, l).astype(BF16), w[layer], ws[layer], block).reshape(1, -1)
        return reference.linear_residual(x, wo[layer], wos[layer], res)
    return {"pair": pair, "two": two, "xla": xla}


def check(rows) -> bool:
    ok = True
    for name, shape in SHAPES.items():
        forms = _forms(shape["block"])
        for layer in (0, L - 1):
            res, ops = _inputs(layer, **shape)
            first, second = gemv_pair.heads_splits_linear_plans(*ops[:5], shape["block"], *ops[5:], res,
                                                                layer=jnp.int32(layer))
            why = gemv_pair.chain_unsupported(first, second)
            outs = {n: np.asarray(jax.jit(fn)(res, *ops, jnp.int32(layer)), np.float32) for n, fn in forms.items()}
            resf = np.asarray(res, np.float32)
            row = {"shape": name, "layer": layer, "one_kernel": why is None, "why_not": why,
                   "units": [first.units, second.units],
                   "pair_rel_err": _rel(outs["pair"] - resf, outs["xla"] - resf),
                   "pair_equals_two": bool((outs["pair"] == outs["two"]).all())}
            row["ok"] = why is None and row["pair_equals_two"] and row["pair_rel_err"] <= 2e-2
            ok &= row["ok"]
            rows.append(row)
            print(row, flush=True)
    return ok


def timing(rows, rounds: int):
    """Both forms, each shape, as dependent chains over the layers (moe_check.time_chains)."""
    for name, shape in SHAPES.items():
        res, ops = _inputs(7, **shape)
        time_chains({n: fn for n, fn in _forms(shape["block"]).items() if n != "xla"}, (res, *ops), rows,
                    rounds=rounds, per_layer=0)
        for row in rows[-2 * rounds:]:
            row["shape"] = name


def main(argv=None) -> int:
    return check_main(check, timing, {"layers": L, "shapes": SHAPES}, argv)


if __name__ == "__main__":
    raise SystemExit(main())
