"""The CUDA engine's small decode kernels, launched alone for Nsight Compute (`ncu`).

Runs, a few times each and outside any CUDA graph, the launches that sit on the decode layer's
critical chain and are short enough that their fixed costs dominate: the router's selection
(dsv32-tp8-shard: 256 experts in 8 groups, 4 kept, 8 chosen, 16 split-K partials) and the indexer's
top-k (2,048 of 4,160 positions, position order, -1 where empty) on normal scores and on scores
rounded to bf16 (many equal keys); `--only moe`: the one-launch MoE (`jtilert.ffi.moe`) at
dsv32-tp8-shard's shapes on tests/gpu/moe_check.py's random stacks. `ncu` then says where each kernel's time goes (part `ncu` of
bench/gpu_session.sh: launch, speed of light, warp stall reasons). `--ctas` picks the top-k's plan
as `jtilert.ffi.select.top_k` takes it.

    ncu --kernel-name regex:'route_select|topk_' python -m bench.experiments.engine_ncu    (GPU)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jtilert.ffi import route, select
from jtilert.model import presets


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctas", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=("route", "topk", "moe"), default=None)
    a = ap.parse_args(argv)
    if a.only == "moe":
        return _moe(a.repeat)
    cfg = presets.preset("dsv32-tp8-shard")
    key = jax.random.key(0)
    partials = jax.random.normal(key, (16, 1, cfg.n_routed_experts), jnp.float32) * 0.3
    bias = jax.random.normal(jax.random.key(1), (61, cfg.n_routed_experts), jnp.float32) * 0.1
    sel = jax.jit(lambda p, b, i: route.select_experts(cfg, p, b, i))
    scores = jax.random.normal(jax.random.key(2), (1, 4160), jnp.float32)
    rows = {"normal": scores, "bf16": scores.astype(jnp.bfloat16).astype(jnp.float32)}
    top = jax.jit(lambda s: select.top_k(s, 2048, sorted=False, empty_as_minus_one=True, ctas=a.ctas))
    for _ in range(a.repeat if a.only != "topk" else 0):
        jax.block_until_ready(sel(partials, bias, jnp.int32(7)))
    for name, s in rows.items() if a.only != "route" else ():
        for _ in range(a.repeat):
            jax.block_until_ready(top(s))
        print(name, "done", flush=True)
    return 0


def _moe(repeat: int) -> int:
    import sys
    sys.path.insert(0, "tests/gpu")
    import moe_check  # noqa: PLC0415 - tests/gpu holds the random stacks
    from jtilert.ffi import moe

    ex, sh = moe_check._stacks(0, True, layers=2)   # noqa: SLF001
    f, res, w, ids = moe_check._token(0)   # noqa: SLF001
    run = jax.jit(lambda *a: moe.moe_decode(*a))
    for _ in range(repeat):
        jax.block_until_ready(run(f, w[0], ids[0], ex, sh, res, jnp.int32(1)))
    print("moe done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
