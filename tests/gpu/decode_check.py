"""On a GPU: the pallas decode path against the reference on one GPU's share of DeepSeek-V3.2
(dsv32-tp8-shard, random fp8 weights; `--preset glm5-tp8-shard`: GLM-5's): logits of 32 one-token
steps after a 4-token prefill.
Both paths compute in bf16; the same model computed in fp32 tells how far bf16 rounding alone moves
the logits (`bf16_reference_vs_fp32`), the yardstick for the pallas path's error.

    PYTHONPATH=. python3 tests/gpu/decode_check.py [--preset dsv32-tp8-shard] [--layers 4] [--out check.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

import jtilert
from jtilert.ops import table as ops
from jtilert.ops.table import DecodeConfig


def stacked_gemv_errors() -> dict:
    """The GEMV kernel on a stack of 3 fp8 weights at dsv32-tp8-shard shapes, each layer against the
    reference on that layer: max |error| / max |reference|."""
    import jax
    import jax.numpy as jnp

    from jtilert.ops import reference
    from jtilert.pallas import gemv
    from jtilert.ops.quant import quantize_weight
    out = {}
    for n, k in ((1536, 7168), (3072, 1536), (576, 7168), (7168, 2048)):
        w, s = quantize_weight(jax.random.normal(jax.random.key(n + k), (3, n, k)) * k**-0.5)
        x = jax.random.normal(jax.random.key(1), (1, k)).astype(jnp.bfloat16)
        f = jax.jit(lambda x, w, s, i: gemv.linear(x, w, s, layer=i))
        errs = []
        for i in range(3):
            got = np.asarray(f(x, w, s, jnp.int32(i)), np.float32)
            want = np.asarray(reference.linear(x, w[i], s[i]), np.float32)
            errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
        out[f"{n}x{k}"] = errs
    return out


def index_weights_errors() -> list[float]:
    """The indexer's head weights kernel (`index_weights`: the FMA engine, its split-K summed by XLA)
    on a stack of 3 fp32 weights [64, 7168], each layer against the reference's normed x (op by op: no
    excess precision) times the weights in float64 on the host: max |error| / max |reference|."""
    import jax
    import jax.numpy as jnp

    from jtilert.ops import reference
    from jtilert.pallas import gemv
    w = jax.random.normal(jax.random.key(5), (3, 64, 7168), jnp.float32) * 7168**-0.5
    nw = (1 + 0.1 * jax.random.normal(jax.random.key(6), (3, 7168))).astype(jnp.bfloat16)
    x = (3 * jax.random.normal(jax.random.key(7), (1, 7168))).astype(jnp.bfloat16)
    f = jax.jit(lambda x, nw, w, i: gemv.index_weights(x, nw, 1e-6, w, layer=i))
    errs = []
    for i in range(3):
        got = np.asarray(f(x, nw, w, jnp.int32(i)))[:, :64]
        normed = np.asarray(reference.rms_norm(x, nw[i], 1e-6), np.float64)   # elementwise, as written
        want = normed @ np.asarray(w[i], np.float64).T     # on the host: no TF32 in the yardstick
        errs.append(float(np.abs(got - want).max() / np.abs(want).max()))
    return errs


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="dsv32-tp8-shard")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--per-op", action="store_true", help="also each kernel alone (the others on the reference)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = jtilert.preset(a.preset, num_hidden_layers=a.layers)
    model = jtilert.random_model(cfg, fmt="fp8", seed=3)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, 4 + a.steps)
    ref = jtilert.score(model, ids, prefill=4)
    ref32 = jtilert.score(jtilert.random_model(cfg, fmt="fp8", seed=3, dtype=np.float32), ids, prefill=4)
    dec = slice(4, None)

    def error(got, want):
        return {"max_abs_err_over_max": float(np.abs(got[dec] - want[dec]).max() / np.abs(want[dec]).max()),
                "argmax_agree": float(np.mean(got[dec].argmax(-1) == want[dec].argmax(-1)))}

    def compare():
        pal = jtilert.score(model, ids, prefill=4, config=DecodeConfig(backend="pallas"))
        return {**error(pal, ref), "vs_fp32": error(pal, ref32)}

    result = {"preset": a.preset, "layers": a.layers, "steps": a.steps, **compare(), "bf16_reference_vs_fp32": error(ref, ref32),
              "stacked_gemv": stacked_gemv_errors(), "index_weights": index_weights_errors()}
    print("bf16 reference vs fp32:", result["bf16_reference_vs_fp32"], flush=True)
    print("stacked GEMV kernel vs reference, per layer:", result["stacked_gemv"], flush=True)
    print("index_weights kernel vs reference, per layer:", result["index_weights"], flush=True)
    # bf16 rounding alone moves a random model's logits by ~10-20 % of their range over a few layers
    # (bf16_reference_vs_fp32), so the bound is relative: the pallas path must be about as close to
    # the fp32 computation as the bf16 reference is, and pick the same tokens about as often.
    ref_err = result["bf16_reference_vs_fp32"]

    def close(r):
        return (r["vs_fp32"]["max_abs_err_over_max"] <= 1.25 * ref_err["max_abs_err_over_max"]
                and r["vs_fp32"]["argmax_agree"] >= ref_err["argmax_agree"] - 1.5 / a.steps)
    result["ok"] = bool(close(result) and max(result["index_weights"]) < 1e-5)   # fp32 sums in another order
    if a.per_op:
        table = dict(ops.OPS)
        for name, op in table.items():
            if op.kernel is None:
                continue
            ops.OPS.update({k: v if k == name else dataclasses.replace(v, kernel=None) for k, v in table.items()})
            result[f"only_{name}"] = compare()
            print(name, result[f"only_{name}"], flush=True)
        ops.OPS.update(table)
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
