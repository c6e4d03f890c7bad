"""On a GPU: the engine's MoE router selection (`jtilert.ffi.route`) against
`reference.select_experts` of the summed split-K partial logits (XLA on the same GPU, the same sum in
the same order): the expert ids exactly, the weights to fp32 rounding,
for DeepSeek-V3.2's, GLM-5's and the tiny model's routers, 1-4 tokens, random and tied scores; and
each form's device time.

Then the engine's whole router (`route.norm_route`: norm, logits, selection in one launch) against
`reference.norm_route` at a traced layer of 61-layer stacks: f within one bf16 rounding, the ids exactly
and the weights to 1e-5 (the logits' fp32 sums run in another order than XLA's: scores that differ by
less than that could swap, which random inputs do not produce), 1-8 tokens; and its time per layer in
a chain over the stacks' 61 layers (each layer's x depends on the last's f, so the weights stream from
HBM) against the Pallas router GEMV + the engine's selection, the path it replaces.
JSON to --out; exit code 1 on a mismatch.

    PYTHONPATH=. python3 tests/gpu/route_check.py [--out route.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")
from prep_check import _median_us  # noqa: E402  (tests/gpu, this script's folder)
from test_ffi_route import CASES, _cfg, _inputs  # noqa: E402

from jtilert.ffi import route  # noqa: E402
from jtilert.ops import reference  # noqa: E402
from jtilert.pallas import moe as pallas_moe  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
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
    router_rows, router_ok = check_norm_route()
    ok &= router_ok
    result = {"device": jax.devices()[0].device_kind, "rows": rows, "router": router_rows, "ok": ok}
    print("ok" if ok else "FAIL", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


# (experts, groups, kept, k, hidden): DeepSeek-V3.2, its H100 store (128 experts a layer), GLM-5, the tiny model's
ROUTERS = [(256, 8, 4, 8, 7168), (128, 4, 2, 8, 7168), (256, 1, 1, 8, 6144), (16, 4, 2, 4, 256)]
LAYERS = 61


def _chain_ms(route_fn, x, nw, gate, bias, reps=20) -> float:
    """Wall-clock ms per layer of a jitted chain of the router over every layer of the stacks (layer l's x
    is x + 0 · layer l-1's f: a dependency, so the layers run in turn)."""
    @jax.jit
    def chain(x, nw, gate, bias):
        def body(l, carry):
            x, acc = carry
            f, w, ids = route_fn(x, nw, gate, bias, l)
            return x + f * jnp.bfloat16(0), acc + w[0, 0] + ids[0, 0].astype(jnp.float32)
        return jax.lax.fori_loop(0, gate.shape[0], body, (x, jnp.float32(0)))
    jax.block_until_ready(chain(x, nw, gate, bias))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(chain(x, nw, gate, bias))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3 / gate.shape[0]


def check_norm_route():
    from test_ffi_route import _router_inputs  # noqa: PLC0415
    rows, ok = [], True
    for e, g, tg, k, h in ROUTERS:
        cfg = _cfg(e, g, tg, k)
        kern = jax.jit(lambda x, nw, gate, bias, i, cfg=cfg: route.norm_route(cfg, x, nw, 1e-6, gate, bias, i))
        at = lambda a, i: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)  # noqa: E731
        ref = jax.jit(lambda x, nw, gate, bias, i, cfg=cfg: reference.norm_route(cfg, x, at(nw, i), 1e-6, at(gate, i),
                                                                                at(bias, i)))
        x8, nw, gate, bias = _router_inputs(8, e, h, layers=LAYERS, seed=e + g)
        for t in (1, 2, 8):
            x = x8[8 - t:]
            layer = jnp.int32(17)
            (gf, gw, gi), (wf, ww, wi) = kern(x, nw, gate, bias, layer), ref(x, nw, gate, bias, layer)
            gf32, wf32 = np.asarray(gf, np.float32), np.asarray(wf, np.float32)
            f_ulps = float(np.max(np.abs(gf32 - wf32) / np.maximum(np.abs(wf32), 1e-30)) * 2**7)   # bf16 ulps at most
            same = bool((np.asarray(gi) == np.asarray(wi)).all())
            err = float(np.abs(np.asarray(gw) - np.asarray(ww)).max())
            good = same and err <= 1e-5 and f_ulps <= 1.0
            ok &= good
            rows.append({"experts": e, "groups": g, "kept": tg, "k": k, "hidden": h, "tokens": t, "f_bf16_ulps": f_ulps,
                         "f_differ": int((gf32 != wf32).sum()), "ids_equal": same, "weights_max_abs_diff": err,
                         "ok": good})
            print(rows[-1], flush=True)
        x = x8[:1]
        two = lambda x, nw, gate, bias, l, cfg=cfg: pallas_moe.norm_route(  # noqa: E731  (the GEMV, then the selection)
            cfg, x, nw, 1e-6, gate, bias, layer=l)
        one = lambda x, nw, gate, bias, l, cfg=cfg: route.norm_route(cfg, x, nw, 1e-6, gate, bias, l)  # noqa: E731
        rows.append({"experts": e, "groups": g, "hidden": h, "timing_T1": True,
                     "one_launch_us_a_layer": 1e3 * _chain_ms(one, x, nw, gate, bias),
                     "gemv_then_select_us_a_layer": 1e3 * _chain_ms(two, x, nw, gate, bias),
                     "one_launch_cupti_us": _median_us(kern, x, nw, gate, bias, jnp.int32(3))})
        print(rows[-1], flush=True)
    return rows, ok


if __name__ == "__main__":
    raise SystemExit(main())
