"""Where one fp8 GEMV launch spends its time, CTA by CTA: Mosaic-GPU's on-device profiler
(`bench/cta_profile.py`) around the GEMV kernels' named phases (`hw.phase`): "x_wait" (the token
tile's TMA), "x_prep" (B built from x: the f16 rescale or fp8x2's two halves), "step" (one pipeline
step's tensor work; the time between two steps is the wait for the next weight tile), "epilogue".
For each form (fp8x2, wgmma, w8a8_hilo fed x split, fp8x2_norm: fp8x2 with the RMSNorm's 1/rms)
at the three decode shapes, `copies` calls (one program each, so every call
streams from HBM), summarised per form:

  start_spread_us  how far apart the CTAs start (global timer)
  to_first_step    cycles from the CTA's first event to its first step
  x_wait, x_prep   cycles of those phases (fp8x2, wgmma: before the first step, while the first
                   weight tiles arrive)
  rms              cycles of the norm's 1/rms (fp8x2_norm: the token's row read and reduced, before x_prep)
  first_step       cycles of the first step
  step, gap        median cycles of the other steps and of the wait between two steps
  epilogue, span   cycles of the epilogue and of the CTA's first to last event

medians over CTAs and calls, with the 90th percentile of span. Cycles become µs at the SM clock that
nvidia-smi reports during the run. `--fma`: the FMA engine's GEMVs instead, at their step shapes (the
router's [256, 7168] fp32 with its norm, as the step runs it; the indexer's head weights [64, 7168] over
28 and over 8 K slices): there "x_prep" is the fp32 slice filled from the token's normed row.
`--splits`: W_uv's heads GEMV at DeepSeek-V3.2's tp8 shape (16 heads, [128, 512] each) fed the attention's
output in bf16 (`heads_linear`) and fed its 32 split partials (`heads_linear_of_splits`: "x_wait" is
then the partials' TMA, "merge" their merge inside x_prep).

    python -m bench.experiments.gemv_phases --out gemv_phases.json [--fma | --splits]      (GPU)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile

import jax
import numpy as np

from bench.cta_profile import kernel_profiles, read_trace, sm_clock_mhz


def cta_phases(c) -> dict:
    """One CTA's (`cta_profile.Cta`) GEMV phases in cycles."""
    steps = c.all("step")
    return dict(start_us=c.start_us, to_first_step=steps[0][0] if steps else None,
                x_wait=c.total("x_wait"), x_prep=c.total("x_prep"), rms=c.total("rms"), merge=c.total("merge"),
                epilogue=c.total("epilogue"),
                steps=[e - b for b, e in steps], gaps=[b1 - e0 for (_, e0), (b1, _) in zip(steps, steps[1:])],
                span=c.span)


def summarise(calls: list[list[dict]], mhz: float | None) -> dict:
    """Medians over CTAs and calls (cycles, and µs at `mhz`), the CTAs' start spread per call."""
    ctas = [c for call in calls for c in call]
    med = lambda xs: float(np.median(xs)) if len(xs) else None
    out = dict(calls=len(calls), ctas_per_call=len(calls[0]) if calls else 0,
               start_spread_us=med([max(c["start_us"] for c in call) - min(c["start_us"] for c in call)
                                    for call in calls]),
               to_first_step=med([c["to_first_step"] for c in ctas if c["to_first_step"] is not None]),
               x_wait=med([c["x_wait"] for c in ctas]), x_prep=med([c["x_prep"] for c in ctas]),
               rms=med([c["rms"] for c in ctas]), merge=med([c["merge"] for c in ctas]),
               first_step=med([c["steps"][0] for c in ctas if c["steps"]]),
               step=med([s for c in ctas for s in c["steps"][1:]]), gap=med([g for c in ctas for g in c["gaps"]]),
               steps_per_cta=med([len(c["steps"]) for c in ctas]), epilogue=med([c["epilogue"] for c in ctas]),
               span=med([c["span"] for c in ctas]),
               span_p90=float(np.percentile([c["span"] for c in ctas], 90)) if ctas else None)
    if mhz:
        out["us_at_sm_clock"] = {k: out[k] / mhz for k in ("to_first_step", "x_wait", "x_prep", "rms", "first_step",
                                                           "step", "gap", "epilogue", "span", "span_p90")
                                 if out[k] is not None}
    return out


def main(argv=None) -> int:  # pragma: no cover - GPU only
    from bench.experiments.gemv_w8a8 import w8a8_hilo
    from bench.kernels import DECODE_GEMVS, Shape, gemv_args
    from jtilert.pallas import gemv
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_phases.json")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--fma", action="store_true", help="the FMA engine's GEMVs (router, head weights)")
    ap.add_argument("--splits", action="store_true", help="W_uv's heads GEMV fed x, and fed the split partials")
    a = ap.parse_args(argv)
    wgmma = gemv.GemvConfig(engine="wgmma")
    norm = lambda x: jax.random.uniform(jax.random.key(7), x.shape[-1:], minval=0.5, maxval=1.5).astype(x.dtype)
    forms = {"fp8x2": gemv.linear, "wgmma": lambda x, w, s: gemv.linear(x, w, s, config=wgmma),
             "w8a8_hilo": w8a8_hilo,
             "fp8x2_norm": lambda x, w, s: gemv.rmsnorm_linear(x, norm(x), 1e-6, w, s)}
    shapes, make = DECODE_GEMVS, lambda name, n, k, key: gemv_args(Shape(name, n, k), key)
    if a.fma:
        from jtilert.pallas import moe
        split = lambda s: gemv.GemvConfig(split_k=s, split_sum="xla")
        forms = {"router": lambda x, w, s: moe.norm_router_partials(x, norm(x), 1e-6, w),
                 "head_weights_28": lambda x, w, s: gemv.index_weights(x, norm(x), 1e-6, w, config=split(28)),
                 "head_weights_8": lambda x, w, s: gemv.index_weights(x, norm(x), 1e-6, w, config=split(8))}
        shapes = (("router 256x7168", 256, 7168), ("head weights 64x7168", 64, 7168))

        def make(name, n, k, key):   # fp32 weights, no scales: the FMA engine's operands
            x = jax.random.normal(key, (1, k), np.float32).astype(jax.numpy.bfloat16)
            w = jax.random.normal(jax.random.fold_in(key, 1), (n, k), np.float32) * k**-0.5
            return x, w, None
    if a.splits:
        from jtilert.ops.quant import quantize_weight
        heads, n_split = 16, 32
        forms = {"heads": lambda o, m, l, w, s: gemv.heads_linear(o, w, s),
                 "heads_of_splits": lambda o, m, l, w, s: gemv.heads_linear_of_splits(o, m, l, w, s)}
        shapes = (("W_uv 16x128x512", 128, 512),)

        def make(name, n, k, key):   # (x or o, m, l, w, s): the two forms' operands
            ks = jax.random.split(key, 4)
            o = jax.random.normal(ks[0], (1, 1, n_split, heads, k), np.float32)
            m = jax.random.normal(ks[1], (1, 1, n_split, heads), np.float32)
            l = jax.random.uniform(ks[2], (1, 1, n_split, heads), np.float32) + 0.5
            w, s = quantize_weight(jax.random.normal(ks[3], (heads, n, k), np.float32) * k**-0.5)
            return o, m, l, w, s
    rows = []
    for name, n, k in shapes:
        key = jax.random.key(5)
        args = [make(name, n, k, jax.random.fold_in(key, i)) for i in range(a.copies)]
        for label, fn in forms.items():
            if a.fma and (label == "router") != (n == 256):   # each FMA form at its own shape
                continue
            with tempfile.TemporaryDirectory() as d:
                with kernel_profiles(d):
                    # one program per call: a program writes one trace per kernel it lowered (identical
                    # calls in one program share a lowering, and so a trace file)
                    for arg in args:
                        if a.splits and label == "heads":   # the merged x in bf16, as the model feeds W_uv
                            o, m, l, w, s = arg
                            from jtilert.pallas.sparse_mla import combine
                            arg = (combine(o, m, l).astype(jax.numpy.bfloat16), m, l, w, s)
                        jax.block_until_ready(jax.jit(lambda *xs, fn=fn: fn(*xs))(*arg))
                    jax.effects_barrier()   # the traces are written by host callbacks
                    mhz = sm_clock_mhz()
                traces = glob.glob(os.path.join(d, "*-trace.json"))
                calls = [[cta_phases(c) for c in read_trace(t)[1]] for t in sorted(traces)]
                r = dict(shape=name, form=label, sm_mhz=mhz, files=len(traces), **summarise(calls, mhz))
            print(json.dumps(r), flush=True)
            rows.append(r)
    with open(a.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
