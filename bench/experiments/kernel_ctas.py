"""Every Mosaic-GPU kernel of one decode step, CTA by CTA: when its CTAs start and end.

One step of the pallas decode path (dsv32-tp8-shard, `--layers` layers, context `--context`) runs with
Mosaic's on-device profiler on (`bench/cta_profile.py`): each kernel writes one trace (the first
call of a kernel in the layer loop), its CTAs' starts on the global timer and their spans in cycles.
Per kernel: CTAs, how far apart they start (the launch ramp: a grid of more CTAs than fit at once
starts its last ones when the first end), the median, 90th percentile and longest span, and the
tail — how long after the median CTA the last one ends (a straggler costs its whole span at one CTA's
rate). The step runs thunk by thunk (a host callback per kernel keeps XLA from capturing it in a CUDA
graph), so gaps between kernels mean nothing here; what happens inside each does.

    python -m bench.experiments.kernel_ctas --out kernel_ctas.json      (GPU)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile

import numpy as np

from bench.cta_profile import Cta, kernel_profiles, read_trace, sm_clock_mhz


def kernel_summary(name: str, ctas: list[Cta], mhz: float | None) -> dict:
    """One kernel's CTAs: start spread (µs), spans (cycles; µs at `mhz`), and the tail: the last
    CTA's end after the median CTA's end (µs, at `mhz`)."""
    spans = np.array([c.span for c in ctas], float)
    starts = np.array([c.start_us for c in ctas], float)
    out = dict(kernel=name, ctas=len(ctas), start_spread_us=float(starts.max() - starts.min()),
               span_median=float(np.median(spans)), span_p90=float(np.percentile(spans, 90)),
               span_max=float(spans.max()))
    if mhz:
        ends = starts + spans / mhz
        out.update(span_median_us=out["span_median"] / mhz, span_max_us=out["span_max"] / mhz,
                   tail_us=float(ends.max() - np.median(ends)), kernel_us=float(ends.max() - starts.min()))
    return out


def main(argv=None) -> int:  # pragma: no cover - GPU only
    import jax
    import jax.numpy as jnp

    import jtilert
    from bench.decode import cache_rows, random_cache
    from jtilert.ops.table import DecodeConfig
    from jtilert.runtime.generate import Engine
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernel_ctas.json")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    a = ap.parse_args(argv)
    cfg = jtilert.preset("dsv32-tp8-shard", num_hidden_layers=a.layers)
    eng = Engine(jtilert.random_model(cfg, fmt="fp8"), config=DecodeConfig(backend="pallas"))
    cache = random_cache(eng, cache_rows(a.context, 4))
    token, pos = eng.place(jnp.array([1], jnp.int32)), eng.place(jnp.int32(a.context))
    params, key = eng.place(jtilert.Sampling().arrays()), eng.place(jax.random.PRNGKey(0))
    with tempfile.TemporaryDirectory() as d:
        with kernel_profiles(d):
            step = jax.jit(eng._wrap(eng._decode))
            jax.block_until_ready(step(eng.state, cache, token, pos, key, params))
            jax.effects_barrier()   # the traces are written by host callbacks
            mhz = sm_clock_mhz()
        rows = [kernel_summary(*read_trace(t), mhz) for t in sorted(glob.glob(os.path.join(d, "*-trace.json")))]
    rows.sort(key=lambda r: -r.get("kernel_us", r["span_max"]))
    for r in rows:
        print(json.dumps(r), flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, layers=a.layers, context=a.context, sm_mhz=mhz,
                       kernels=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
