"""On a GPU: does an L2 prefetch of a layer's weights (`jtilert.ffi.prefetch_l2`) make that layer's GEMV
faster? The hypothesis: a decode layer's GEMVs are partly bound by streaming their weights from HBM,
and the attention chain before them (~35 µs a layer, latency bound, HBM mostly idle) could instead
pull the next GEMVs' weights into the 50 MB L2. This measures it on o_proj's fp8 GEMV (the stack
[3, 7168, 2048] fp8 + scales, `gemv.linear_residual`, 14.7 MB a layer) and the router's FMA GEMV
(gate [3, 256, 7168] fp32, `moe.router_partials`, 7.3 MB a layer), each in one jitted function per
variant that first reads a 256 MB array (row maxima: L2 then holds nothing of the weights and no dirty
lines), then: (cold) the GEMV; (wait) a ~30 µs compute-bound wait with a tiny footprint, standing in
for the attention chain, then the GEMV; (prefetch) the prefetch of the GEMV's layer, the same wait, the
GEMV; (other layer) the same with the prefetch of another layer (the gain must come from the right
bytes); (streaming wait) the prefetch, then an elementwise op over 60 MB (120 MB of other traffic
through L2) as the wait, then the GEMV (do the prefetched lines survive traffic?); (warm) the GEMV
twice, the second one timed (the weights were just read: the L2 floor). Every step is ordered after
the previous one by data (`jtilert.ffi.ordered`). Per variant: the GEMV kernels' device time (CUPTI,
median over --calls calls), the prefetch kernel's time and the wait's; and whether every variant's
result is bitwise the cold one's (a prefetch changes no value). Exit code 1 on a mismatch or when the
prefetch kernel does not run.

    PYTHONPATH=. python3 tests/gpu/prefetch_check.py [--calls 30] [--out prefetch.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jtilert.ffi as jf
from bench.decode import _cupti
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import gemv, moe

BF16, F32 = jnp.bfloat16, jnp.float32
LAYERS, LAYER = 3, 1
O_PROJ = (7168, 2048)          # o_proj's [N, K] (dsv32 at tp = 8: 14.7 MB of fp8 a layer)
GATE = (256, 7168)             # the router's gate [E, H] (7.3 MB of fp32 a layer)
FLUSH_BYTES = 256 << 20        # read before every variant: more than L2 (50-60 MB) several times over
FLUSH_ROW = 2048               # the flush reduces rows of this many elements (one kernel, a small output)
STREAM_BYTES = 60 << 20        # the streaming wait's array
SPIN_ELEMS = 1 << 16           # the compute wait's array (256 KB of fp32: nothing of note in L2)
WAIT_US = 30.0                 # the compute wait's target device time
VARIANTS = ("cold", "wait", "prefetch", "other_layer", "stream", "warm")


def spin(v, rounds: int):
    """A dependent chain of `rounds` sin · a + b per element: one compute-bound fusion whose time
    grows with `rounds` and which touches only `v`."""
    for _ in range(rounds):
        v = jnp.sin(v) * 0.75 + 0.25
    return v


def calibrate_spin() -> tuple[int, float]:
    """(rounds, µs) of a spin wait of about WAIT_US of device time."""
    v = jnp.linspace(0.0, 1.0, SPIN_ELEMS, dtype=F32)
    rounds, us = 128, 0.0
    for _ in range(4):
        f = jax.jit(lambda v, r=rounds: spin(v, r))
        jax.block_until_ready(f(v))
        us = statistics.median(_cupti(lambda f=f: f(v))[1] for _ in range(5)) * 1e6
        if us >= WAIT_US:
            break
        rounds = min(1 << 15, math.ceil(rounds * 1.15 * WAIT_US / max(us, 0.1)))
    return rounds, us


def make_variant(gemv_fn, variant: str, rounds: int):
    """One jitted call: flush, then `variant`'s steps, then the GEMV; returns the GEMV's result."""

    def step(big, spin_buf, stream_buf, x, i, ws):
        # a read-only pass (row maxima): L2 then holds clean lines of `big`, none of the weights, and
        # no dirty lines whose write-back would slow the next kernel's reads
        flushed = jnp.max(big.reshape(-1, FLUSH_ROW), axis=1)
        x = jf.ordered(x, flushed)
        if variant in ("wait", "prefetch", "other_layer", "stream"):
            after = flushed
            if variant != "wait":
                layer = i if variant != "other_layer" else (LAYER + 1) % LAYERS   # a constant: no kernel
                after = jf.prefetch_l2(layer, flushed, *ws)
            if variant == "stream":
                waited = jf.ordered(stream_buf, after) * 3 + 1
            else:
                waited = spin(jf.ordered(spin_buf, after), rounds)
            x = jf.ordered(x, waited)
        if variant == "warm":
            x = jf.ordered(x, gemv_fn(x, ws, i))
        return gemv_fn(x, ws, i)
    return jax.jit(step)


def kernel_times(kernels, variant: str) -> dict:
    """Device µs of the GEMV kernels (the Mosaic kernels; the last GEMV's, for warm), the prefetch
    kernel, and of every other kernel before the first GEMV kernel (the flush, and the wait)."""
    names = [n for n, _ in kernels]
    g_idx = [j for j, n in enumerate(names) if "jtilert_gemv" in n or "mosaic_gpu" in n]
    p_idx = [j for j, n in enumerate(names) if "prefetch_l2" in n]
    if not g_idx:
        raise RuntimeError(f"no GEMV kernel in {names}")
    timed = g_idx[len(g_idx) // 2:] if variant == "warm" else g_idx
    before = [j for j in range(g_idx[0]) if j not in p_idx]
    return {"gemv": sum(kernels[j][1] for j in timed) * 1e6,
            "prefetch": sum(kernels[j][1] for j in p_idx) * 1e6 if p_idx else None,
            "before": sum(kernels[j][1] for j in before) * 1e6}


def run_case(name: str, gemv_fn, x, ws, calls: int, rounds: int, bufs) -> dict:
    i = jnp.int32(LAYER)
    mb = sum(w[LAYER].nbytes for w in ws) / 1e6
    out, results = {"case": name, "layer_mb": mb, "variants": {}}, {}
    for variant in VARIANTS:
        f = make_variant(gemv_fn, variant, rounds)
        y = jax.block_until_ready(f(*bufs, x, i, ws))
        results[variant] = np.asarray(y).tobytes()
        samples, first = [], None
        for _ in range(calls):
            kernels, _ = _cupti(lambda f=f: f(*bufs, x, i, ws))
            first = first or kernels
            samples.append(kernel_times(kernels, variant))
        med = {k: (statistics.median(s[k] for s in samples) if samples[0][k] is not None else None)
               for k in samples[0]}
        med["kernels"] = [f"{n.replace('(anonymous namespace)::', '').split('(')[0][:60]} {t * 1e6:.1f}"
                          for n, t in first]
        out["variants"][variant] = med
    for med in out["variants"].values():   # the wait: what runs before the GEMV beyond cold's flush
        med["wait"] = med["before"] - out["variants"]["cold"]["before"]
    out["bitwise_equal"] = {v: results[v] == results["cold"] for v in VARIANTS}
    return out


def report(r: dict) -> bool:
    v = r["variants"]
    cold, pre, kern = v["cold"]["gemv"], v["prefetch"]["gemv"], v["prefetch"]["prefetch"]
    print(f"{r['case']} cold {cold:.1f} us, after prefetch {pre:.1f} us ({pre / cold:.2f}x), "
          f"prefetch kernel {'(none ran)' if kern is None else f'{kern:.1f} us'}", flush=True)
    print(f"  ({r['layer_mb']:.1f} MB a layer) cold after the wait alone {v['wait']['gemv']:.1f} us; "
          f"prefetch of another layer {v['other_layer']['gemv']:.1f} us; prefetch + streaming wait "
          f"{v['stream']['gemv']:.1f} us; warm (just read) {v['warm']['gemv']:.1f} us; waits: compute "
          f"{v['prefetch']['wait']:.1f} us, streaming {v['stream']['wait']:.1f} us", flush=True)
    print(f"  kernels of one prefetch call (us): {'; '.join(v['prefetch']['kernels'])}", flush=True)
    same = all(r["bitwise_equal"].values())
    print(f"  results bitwise equal to cold: {'yes' if same else r['bitwise_equal']}", flush=True)
    return same


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if jax.default_backend() != "gpu" or not jf.available():
        print(f"needs a GPU and the engine library: {jf.unavailable_reason() or jax.default_backend()}")
        return 1
    rounds, spin_us = calibrate_spin()
    print(f"{jax.devices()[0].device_kind}: compute wait of {rounds} rounds, {spin_us:.1f} us", flush=True)
    key = jax.random.split(jax.random.key(0), 6)
    bufs = (jax.random.normal(key[0], (FLUSH_BYTES // 2,), BF16),
            jnp.linspace(0.0, 1.0, SPIN_ELEMS, dtype=F32),
            jax.random.normal(key[1], (STREAM_BYTES // 2,), BF16))

    (n, k), (e, h) = O_PROJ, GATE
    w, s = quantize_weight(jax.random.normal(key[2], (LAYERS, n, k), F32) * k ** -0.5)
    x = jax.random.normal(key[3], (1, k), BF16)
    residual = jax.random.normal(key[4], (1, n), BF16)
    o_proj = run_case("o_proj", lambda x, ws, i: gemv.linear_residual(x, ws[0], ws[1], residual, layer=i),
                      x, (w, s), a.calls, rounds, bufs)
    del w, s
    gate = jax.random.normal(key[5], (LAYERS, e, h), F32) * h ** -0.5
    xr = jax.random.normal(key[3], (1, h), BF16)
    router = run_case("router", lambda x, ws, i: moe.router_partials(x, ws[0], layer=i),
                      xr, (gate,), a.calls, rounds, bufs)
    ok = True
    for r in (o_proj, router):
        ok &= report(r)
        ran = r["variants"]["prefetch"]["prefetch"] is not None
        if not ran:
            print(f"  FAIL: no prefetch kernel ran in {r['case']}'s prefetch variant", flush=True)
        ok &= ran
    print("ok" if ok else "FAIL", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "wait_rounds": rounds, "wait_us": spin_us,
                       "calls": a.calls, "cases": [o_proj, router], "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
