"""Where one fp8 GEMV launch spends its time, CTA by CTA: Mosaic-GPU's on-device profiler around the
kernels' named phases.

The GEMV kernels mark their phases with `jax.named_scope` (`hw.phase`): "cta" (the whole CTA),
"x_wait" (the token tile's TMA), "x_prep" (B built from x: the f16 rescale or fp8x2's two halves),
"step" (one pipeline step's tensor work; the time between two steps is the wait for the next weight
tile) and "epilogue". With `CompilerParams.profile_space` set, Mosaic records each range's entry and
exit in SM cycles (`%clock`) and each CTA's start on the global timer (ns); one trace per kernel call
is written as JSON. This script collects them for the forms below at o_proj's shape, each called on
`copies` weight copies, one program each (so every call streams from HBM), and summarises per form:

  start_spread_us  how far apart the CTAs start (global timer)
  to_first_step    cycles from the CTA's first event to its first step
  x_wait, x_prep   cycles of those phases (in fp8x2 and wgmma inside the first step)
  first_step       cycles of the first step
  step, gap        median cycles of the other steps and of the wait between two steps
  epilogue, span   cycles of the epilogue and of the CTA's first to last event

medians over CTAs and calls, with the 90th percentile of span. Cycles become µs at the SM clock that
nvidia-smi reports during the run.

    python -m bench.experiments.gemv_phases --out gemv_phases.json      (GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import subprocess
import tempfile

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import numpy as np

PHASES = ("x_wait", "x_prep", "step", "epilogue")


@contextlib.contextmanager
def kernel_profiles(path: str, events: int = 64):
    """Mosaic-GPU kernels built inside collect an on-device profile of up to `events` ranges per
    warpgroup and write it under `path` (one JSON trace per kernel call)."""
    build = plgpu.kernel

    def kernel(*args, compiler_params=None, **kwargs):
        params = dataclasses.replace(compiler_params or plgpu.CompilerParams(), profile_space=events,
                                     profile_dir=path)
        return build(*args, compiler_params=params, **kwargs)

    plgpu.kernel = kernel
    try:
        yield
    finally:
        plgpu.kernel = build


def cta_phases(events: list[dict]) -> dict:
    """One CTA's trace (Mosaic's Chrome-trace events of one tid, in order: ts = the CTA's global-timer
    start in µs plus its SM cycles since its first event / 1000) → the phase summary in cycles."""
    t0 = events[0]["ts"]
    cyc = lambda e: (e["ts"] - t0) * 1e3
    opened, ranges = {}, []
    for e in events:
        if e["ph"] == "B":
            opened.setdefault(e["name"], []).append(cyc(e))
        else:
            ranges.append((e["name"], opened[e["name"]].pop(), cyc(e)))
    steps = sorted((b, e) for n, b, e in ranges if n == "step")
    dur = lambda name: sum(e - b for n, b, e in ranges if n == name)
    return dict(start_us=t0, to_first_step=steps[0][0] if steps else None,
                x_wait=dur("x_wait"), x_prep=dur("x_prep"), epilogue=dur("epilogue"),
                steps=[e - b for b, e in steps], gaps=[b1 - e0 for (_, e0), (b1, _) in zip(steps, steps[1:])],
                span=max(e for _, _, e in ranges))


def read_traces(paths) -> list[list[dict]]:
    """Every CTA's phase summary of each trace file: [call][cta]."""
    calls = []
    for path in sorted(paths):
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        by_cta = {}
        for e in events:
            by_cta.setdefault(e["tid"], []).append(e)
        calls.append([cta_phases(ev) for _, ev in sorted(by_cta.items())])
    return calls


def summarise(calls: list[list[dict]], mhz: float | None) -> dict:
    """Medians over CTAs and calls (cycles, and µs at `mhz`), the CTAs' start spread per call."""
    ctas = [c for call in calls for c in call]
    med = lambda xs: float(np.median(xs)) if len(xs) else None
    out = dict(calls=len(calls), ctas_per_call=len(calls[0]) if calls else 0,
               start_spread_us=med([max(c["start_us"] for c in call) - min(c["start_us"] for c in call)
                                    for call in calls]),
               to_first_step=med([c["to_first_step"] for c in ctas if c["to_first_step"] is not None]),
               x_wait=med([c["x_wait"] for c in ctas]), x_prep=med([c["x_prep"] for c in ctas]),
               first_step=med([c["steps"][0] for c in ctas if c["steps"]]),
               step=med([s for c in ctas for s in c["steps"][1:]]), gap=med([g for c in ctas for g in c["gaps"]]),
               steps_per_cta=med([len(c["steps"]) for c in ctas]), epilogue=med([c["epilogue"] for c in ctas]),
               span=med([c["span"] for c in ctas]),
               span_p90=float(np.percentile([c["span"] for c in ctas], 90)) if ctas else None)
    if mhz:
        out["us_at_sm_clock"] = {k: out[k] / mhz for k in ("to_first_step", "x_wait", "x_prep", "first_step", "step", "gap",
                                                           "epilogue", "span", "span_p90") if out[k] is not None}
    return out


def sm_clock_mhz() -> float | None:
    try:
        txt = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(txt.split()[0])
    except Exception:  # noqa: BLE001 - no nvidia-smi: cycles only
        return None


def main(argv=None) -> int:  # pragma: no cover - GPU only
    from bench.experiments.gemv_w8a8 import w8a8_hilo
    from bench.kernels import DECODE_GEMVS, Shape, gemv_args
    from jtilert.pallas import gemv
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_phases.json")
    ap.add_argument("--copies", type=int, default=3)
    a = ap.parse_args(argv)
    wgmma = gemv.GemvConfig(engine="wgmma")
    forms = {"fp8x2": gemv.linear, "wgmma": lambda x, w, s: gemv.linear(x, w, s, config=wgmma),
             "w8a8_hilo": w8a8_hilo}
    rows = []
    for name, n, k in DECODE_GEMVS:
        key = jax.random.key(5)
        args = [gemv_args(Shape(name, n, k), jax.random.fold_in(key, i)) for i in range(a.copies)]
        for label, fn in forms.items():
            with tempfile.TemporaryDirectory() as d:
                with kernel_profiles(d):
                    # one program per call: a program writes one trace per kernel it lowered (identical
                    # calls in one program share a lowering, and so a trace file)
                    for x, w, s in args:
                        jax.block_until_ready(jax.jit(lambda x, w, s, fn=fn: fn(x, w, s))(x, w, s))
                    jax.effects_barrier()   # the traces are written by host callbacks
                    mhz = sm_clock_mhz()
                traces = glob.glob(os.path.join(d, "*-trace.json"))
                r = dict(shape=name, form=label, sm_mhz=mhz, files=len(traces),
                         **summarise(read_traces(traces), mhz))
            print(json.dumps(r), flush=True)
            rows.append(r)
    with open(a.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
