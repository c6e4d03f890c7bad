"""Does programmatic dependent launch (PDL) cut the cost between kernels, and where (issue 14)?

    PYTHONPATH=. python3 -m bench.pdl_probe [--n 32] [--calls 2000] [--out pdl.json]

Times chains of `n` dependent tiny kernels in one jitted call, per kernel:
- `mosaic`: a Pallas Mosaic-GPU kernel (out = in + 1), no PDL;
- `mosaic_pdl`: the same kernel waiting on its producer (`griddepcontrol_wait`, which marks it for a PDL
  launch) and releasing its dependents when done (`griddepcontrol_launch_dependents`);
- `fusion`: XLA fusions (sin · 1.0001) kept apart by optimization barriers.
Run it once per XLA setting (bench/gpu_session.sh part `pdl`): command buffers on (the decode step's
flags), off (every kernel launched on the stream), and on with XLA's own PDL off
(`--xla_gpu_enable_pdl=false`). What reading jaxlib 0.11.2's source predicts: in command buffers a Mosaic
kernel is captured into a child graph of its own, so its PDL attribute has no predecessor to act on
(mosaic ≈ mosaic_pdl there); on the stream it does (mosaic_pdl < mosaic); XLA's fusions get
programmatic edges in command buffers by default (fusion faster than with --xla_gpu_enable_pdl=false).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

SIZE = 128   # f32 elements per kernel: launch cost, no work


def mosaic_step(pdl: bool):
    """One tiny Mosaic-GPU kernel, out = in + 1, jitted so that a chain lowers it once."""
    def body(x_ref, o_ref):
        if pdl:
            plgpu.griddepcontrol_wait()
        o_ref[...] = x_ref[...] + 1.0
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
    return jax.jit(plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((SIZE,), jnp.float32)))


def fusion_step(x):
    return lax.optimization_barrier(jnp.sin(x) * 1.0001)


def chain(step, n: int):
    def run(x):
        for _ in range(n):
            x = step(x)
        return x
    return jax.jit(run)


def per_kernel_us(f, n: int, calls: int) -> float:
    x = jnp.ones((SIZE,), jnp.float32)
    for _ in range(10):
        x = f(x)
    x.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(calls):
        x = f(x)
    x.block_until_ready()
    return (time.perf_counter() - t0) / (calls * n) * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=32, help="kernels per chain")
    p.add_argument("--calls", type=int, default=2000, help="timed calls of each chain")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "n": a.n, "calls": a.calls, "us_per_kernel": {}}
    variants = {"mosaic": mosaic_step(False), "mosaic_pdl": mosaic_step(True), "fusion": fusion_step}
    for name, step in variants.items():
        try:
            result["us_per_kernel"][name] = per_kernel_us(chain(step, a.n), a.n, a.calls)
        except Exception as e:  # a variant this machine cannot run is recorded, the others still run
            result["us_per_kernel"][name] = f"error: {str(e).splitlines()[0][:300]}"
    print(json.dumps(result, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
