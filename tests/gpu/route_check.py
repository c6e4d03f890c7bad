"""On a GPU: the engine's MoE router selection (`jtilert.ffi.route`) against
`reference.select_experts` of the summed split-K partial logits (XLA on the same GPU, the same sum in
the same order): the expert ids exactly, the weights to fp32 rounding,
for DeepSeek-V3.2's, GLM-5's and the tiny model's routers, 1-4 tokens, random and tied scores; and
each form's device time.

Then the whole router in one launch (`route.norm_route_logits`, `DecodeConfig.engine_router`) at the
same routers' shapes (hidden 7168 / 6144 / 128), bf16 and fp32 stacks, 1-4 tokens: f against the
reference's norm (at most one bf16 step apart, in under 1 % of the values), the logits against the
fp32 product of the kernel's own f with the gate (1e-4), the ids and weights against
`reference.select_experts` of the kernel's own logits (exactly / 1e-6); its device time against the
pallas path's router GEMV and selection (CUPTI, the sum of their kernels). The same kernel without
the selection, the indexer's head weights (`route.index_weights`), against the reference and the
Pallas FMA GEMV. JSON to --out; exit code 1 on a mismatch.

    PYTHONPATH=. python3 tests/gpu/route_check.py [--out route.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")
from prep_check import _median_us  # noqa: E402  (tests/gpu, this script's folder)
from test_ffi_route import CASES, _cfg, _inputs, _router_inputs, _ulps_apart  # noqa: E402

from jtilert.ffi import route  # noqa: E402
from jtilert.model.presets import TINY  # noqa: E402
from jtilert.ops import reference  # noqa: E402
from jtilert.ops.layer import Layer  # noqa: E402
from jtilert.pallas import gemv as pallas_gemv  # noqa: E402
from jtilert.pallas import moe as pallas_moe  # noqa: E402

HIDDEN = {256: (7168, 6144), 16: (TINY.hidden_size,)}   # the routers' hidden sizes by their experts


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    # The references' fp32 products in fp32, not TF32 (XLA's default for f32 dots on the GPU).
    jax.config.update("jax_default_matmul_precision", "highest")
    rows, ok = [], True
    for case in CASES:
        cfg = _cfg(*case)
        kern = jax.jit(lambda lg, b, i, cfg=cfg: route.select_experts(cfg, lg, b, i))
        ref = jax.jit(lambda p, b, i, cfg=cfg: reference.select_experts(
            cfg, route.logits_of(p), jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False)))
        for t in (1, 2, 4):
            for seed, ties in ((0, False), (1, False), (2, True)):
                partials, bias = _inputs(t, case[0], layers=61, seed=seed, ties=ties, splits=16)
                layer = jnp.int32(17)
                (gw, gi), (ww, wi) = kern(partials, bias, layer), ref(partials, bias, layer)
                same = bool((np.asarray(gi) == np.asarray(wi)).all())
                err = float(np.abs(np.asarray(gw) - np.asarray(ww)).max())
                good = same and err <= 1e-5
                ok &= good
                rows.append({"experts": case[0], "groups": case[1], "kept": case[2], "k": case[3], "tokens": t,
                             "ties": ties, "ids_equal": same, "weights_max_abs_diff": err, "ok": good})
                print(rows[-1], flush=True)
        partials, bias = _inputs(1, case[0], layers=61, splits=16)
        rows.append({"experts": case[0], "groups": case[1], "timing_T1": True,
                     "kernel_us": _median_us(kern, partials, bias, jnp.int32(3)),
                     "xla_reference_us": _median_us(ref, partials, bias, jnp.int32(3))})
        print(rows[-1], flush=True)
    norm_rows, norm_ok = norm_route_rows()
    iw_rows, iw_ok = index_weights_rows()
    result = {"device": jax.devices()[0].device_kind, "rows": rows, "norm_route": norm_rows,
              "index_weights": iw_rows, "ok": ok and norm_ok and iw_ok}
    ok = result["ok"]
    print("ok" if ok else "FAIL", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


def norm_route_rows() -> tuple[list, bool]:
    rows, ok = [], True
    for case in CASES[:3]:
        cfg = _cfg(*case)
        kern = jax.jit(lambda x, nw, g, b, i, cfg=cfg: route.norm_route_logits(cfg, x, nw, 1e-6, g, b, Layer(i, 1)))
        for h in HIDDEN[case[0]]:
            for t in (1, 2, 4):
                for dt in (jnp.bfloat16, jnp.float32):
                    x, nw, gate, bias = _router_inputs(t, case[0], h, layers=8, seed=t, gate_dtype=dt, norm_dtype=dt)
                    f, logits, w, ids = kern(x, nw, gate, bias, jnp.int32(4))
                    want_f = reference.rms_norm(x, nw[5], 1e-6)
                    steps = _ulps_apart(f, want_f)
                    want_logits = reference.router_logits(f, gate[5])
                    want_w, want_ids = reference.select_experts(cfg, logits, bias[5])
                    row = {"experts": case[0], "groups": case[1], "hidden": h, "tokens": t,
                           "stacks": jnp.dtype(dt).name, "f_max_steps": int(steps.max()),
                           "f_frac_differing": float((steps > 0).mean()),
                           "logits_max_abs_diff": float(jnp.abs(logits - want_logits).max()),
                           "ids_equal": bool((np.asarray(ids) == np.asarray(want_ids)).all()),
                           "weights_max_abs_diff": float(jnp.abs(w - want_w).max())}
                    row["ok"] = (row["f_max_steps"] <= 1 and row["f_frac_differing"] < 0.01
                                 and row["logits_max_abs_diff"] <= 1e-4 and row["ids_equal"]
                                 and row["weights_max_abs_diff"] <= 1e-6)
                    ok &= row["ok"]
                    rows.append(row)
                    print(row, flush=True)
            x, nw, gate, bias = _router_inputs(1, case[0], h, layers=61, gate_dtype=jnp.bfloat16)
            pallas = jax.jit(lambda x, nw, g, b, i, cfg=cfg: pallas_moe.norm_route(cfg, x, nw, 1e-6, g, b,
                                                                                  layer=Layer(i, 1)))
            rows.append({"experts": case[0], "groups": case[1], "hidden": h, "timing_T1": True,
                         "norm_route_us": _median_us(kern, x, nw, gate, bias, jnp.int32(3)),
                         "pallas_router_and_select_us": _median_us(pallas, x, nw, gate, bias, jnp.int32(3))})
            print(rows[-1], flush=True)
    return rows, ok


def index_weights_rows() -> tuple[list, bool]:
    """The indexer's head weights (`route.index_weights`: the norm GEMV without a selection) at
    DeepSeek-V3.2's, GLM-5's and the tiny model's shapes against the reference's normed x (op by op: no
    excess precision) times the weights in float64 on the host, as decode_check.py checks the Pallas
    kernel (1e-4 of the largest: fp32 sums in another order, and a 1/rms an ulp apart may round an
    element of f the other way), and its time against the Pallas FMA GEMV with XLA's sum."""
    rows, ok = [], True
    kern = jax.jit(lambda x, nw, w, i: route.index_weights(x, nw, 1e-6, w, Layer(i, 1)))
    pallas = jax.jit(lambda x, nw, w, i: pallas_gemv.index_weights(x, nw, 1e-6, w, layer=Layer(i, 1)))
    for heads, h in ((64, 7168), (32, 6144), (TINY.index_n_heads, TINY.hidden_size)):
        for t in (1, 2, 4):
            x, nw, w, _ = _router_inputs(t, heads, h, layers=8, seed=t, gate_dtype=jnp.float32)
            got = np.asarray(kern(x, nw, w, jnp.int32(4)))
            normed = np.asarray(reference.rms_norm(x, nw[5], 1e-6), np.float64)
            want = normed @ np.asarray(w[5], np.float64).T
            err = float(np.abs(got - want).max() / np.abs(want).max())
            rows.append({"heads": heads, "hidden": h, "tokens": t, "max_err_over_max": err, "ok": err <= 1e-4})
            ok &= rows[-1]["ok"]
            print(rows[-1], flush=True)
        x, nw, w, _ = _router_inputs(1, heads, h, layers=61, gate_dtype=jnp.float32)
        rows.append({"heads": heads, "hidden": h, "timing_T1": True,
                     "norm_gemv_us": _median_us(kern, x, nw, w, jnp.int32(3)),
                     "pallas_fma_gemv_and_sum_us": _median_us(pallas, x, nw, w, jnp.int32(3))})
        print(rows[-1], flush=True)
    return rows, ok


if __name__ == "__main__":
    raise SystemExit(main())
