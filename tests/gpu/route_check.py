"""On a GPU: the engine's MoE router selection (`jtilert.ffi.route`) against
`reference.select_experts` of the summed split-K partial logits (XLA on the same GPU, the same sum in
the same order): the expert ids exactly, the weights to fp32 rounding,
for DeepSeek-V3.2's, GLM-5's and the tiny model's routers, 1-4 tokens, random and tied scores; and
each form's device time. JSON to --out; exit code 1 on a mismatch.

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
from test_ffi_route import CASES, _cfg, _inputs  # noqa: E402

from jtilert.ffi import route  # noqa: E402
from jtilert.ops import reference  # noqa: E402


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
    result = {"device": jax.devices()[0].device_kind, "rows": rows, "ok": ok}
    print("ok" if ok else "FAIL", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
