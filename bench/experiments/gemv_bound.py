"""What bounds the fp8 GEMV kernel at batch 1 (GPU only): o_proj's shape (7168 × 2048, residual
epilogue) streamed from HBM (cold) and from L2 (warm: the same weights call after call), under
tuning configurations; K from 256 to 2048 at N = 7168 (the time per K step against the fixed time);
bf16 weights (no e4m3 → f16 conversion, twice the bytes).

    python -m bench.experiments.gemv_bound --out gemv_bound.json
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np

from bench.kernels import Shape, args_bytes, gemv_args, gemv_fns, time_op
from jtilert.pallas import gemv


def measure(sh: Shape, cfg=None) -> dict:
    key = jax.random.key(7)
    make = lambda i: gemv_args(sh, jax.random.fold_in(key, i))
    nbytes = args_bytes(make(0))
    fn, ref = gemv_fns(sh, cfg)
    args = make(0)
    got, want = (np.asarray(jax.jit(f)(*args), np.float64) for f in (fn, ref))
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    if not err < 2e-2:
        raise SystemExit(f"{sh.name} {cfg}: relative error {err:.3g} against XLA's")
    cold = time_op(fn, make, nbytes)
    warm = time_op(fn, make, nbytes, copies=1)
    row = dict(shape=sh.name, n=sh.n, k=sh.k, fmt=sh.fmt, config=str(cfg or "auto"), mb=nbytes / 1e6, rel_err=err,
               cold_us=cold["us"], warm_us=warm["us"], cold_kernels=cold["per_kernel"],
               warm_kernels=warm["per_kernel"])
    print(f"{sh.name:28s} {row['config']:60s} {nbytes / 1e6:6.1f} MB  cold {cold['us']:6.2f} us"
          f"  warm {warm['us']:6.2f} us  {cold['per_kernel']}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_bound.json")
    ap.add_argument("--in-flight", action="store_true", help="only o_proj and x_proj, 0 and 1 wgmma groups in flight")
    a = ap.parse_args(argv)
    o_proj = Shape("o_proj (+residual)", 7168, 2048, kind="residual")
    x_proj = Shape("x_proj (rmsnorm)", 1536 + 128 + 576, 7168, kind="norm")
    C = gemv.GemvConfig
    rows = []
    if a.in_flight:
        for sh, cfg in ((o_proj, None), (o_proj, C(in_flight=1)), (o_proj, None), (o_proj, C(in_flight=1)),
                        (x_proj, None), (x_proj, C(in_flight=1))):
            rows.append(measure(sh, cfg))
    else:
        for cfg in (None, C(stages=2), C(stages=8), C(block_k=128), C(block_k=512, stages=2), C(split_k=2),
                    C(split_k=4)):
            rows.append(measure(o_proj, cfg))
        for k in (256, 512, 1024, 2048):
            rows.append(measure(Shape(f"linear K={k}", 7168, k)))
        rows.append(measure(Shape("o_proj bf16 (+residual)", 7168, 2048, fmt="bf16", kind="residual")))
        rows.append(measure(x_proj))
    with open(a.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
