"""One `jtilert.pallas.moe.expert_down` launch at dsv32-tp8-shard's decode shapes (8 routed experts of
width 256, hidden 7168, fp8, the layer's residual), for Nsight Compute: h as the gate/up kernel's
bf16 output, or with --partials as its split-K partials [4, 2, 8, 256] fp32 (for a tree whose
expert_down finishes them itself).

    ncu --kernel-name regex:moe_down --launch-skip 1 --launch-count 1 python3 -m bench.experiments.moe_down_ncu
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jtilert.ops.quant import quantize_weight
from jtilert.pallas import moe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--partials", action="store_true", help="h as split-K partials [4, 2, 8, 256] fp32")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    keys = jax.random.split(jax.random.key(0), 5)
    d, ds = quantize_weight(jax.random.normal(keys[0], (64, 7168, 256), jnp.float32) * 256 ** -0.5)
    h = (jax.random.normal(keys[1], (4, 2, 8, 256), jnp.float32) if a.partials
         else jax.random.normal(keys[1], (8, 256), jnp.float32).astype(jnp.bfloat16))
    ids = jax.random.permutation(keys[2], 64)[:8].astype(jnp.int32)[None]
    w = jax.random.uniform(keys[3], (1, 8), minval=0.1, maxval=0.3)
    r = jax.random.normal(keys[4], (1, 7168), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda h, r: moe.expert_down(h, w, ids, d, ds, residual=r))
    for _ in range(a.repeat):
        r = f(h, r)
    print(float(jnp.linalg.norm(r.astype(jnp.float32))))


if __name__ == "__main__":
    main()
