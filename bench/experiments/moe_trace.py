"""Where the one-launch MoE's time goes: %globaltimer stamps per CTA of one `moe_decode` launch.

A diagnostic, not shipped: the stamps live in `moe_trace.patch` (cuda/src/moe.cu plus a `g_trace`
array and the `jt_moe_trace` symbol that copies it out). On a GPU, in a throw-away copy of the
checkout (`patch`, not `git apply`: inside another repository's folder git apply skips the paths
outside it without a word):

    patch -p1 < bench/experiments/moe_trace.patch
    PYTHONPATH=. python3 -m jtilert.ffi.build && PYTHONPATH=. python3 bench/experiments/moe_trace.py out.json

Prints, for 5 launches after the first, each stamp's [min, median, max] over the CTAs in µs from the
first CTA's entry (bench/results/moe-trace-s25run*.log)."""

import ctypes
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

NAMES = ["entry", "prologue", "phase1", "polled", "phase2", "exit", "prod_p1_issued", "prod_p2_issued",
         "p1_first_data", "p2_first_data", "p2_last_data", "p1_last_data", "p2_last_dots"]


def main(out=None) -> int:
    sys.path.insert(0, "tests/gpu")
    import moe_check  # noqa: PLC0415 - tests/gpu holds the random stacks
    from jtilert.ffi import _lib, moe  # noqa: PLC0415

    ex, sh = moe_check._stacks(0, True, layers=2)   # noqa: SLF001
    f, res, w, ids = moe_check._token(0)   # noqa: SLF001
    run = jax.jit(lambda *a: moe.moe_decode(*a))
    lib, why = _lib.load()
    if lib is None or not hasattr(lib.dll, "jt_moe_trace"):
        raise SystemExit(f"no engine with jt_moe_trace ({why}): apply moe_trace.patch and build first")
    result = {}
    for rep in range(5):
        jax.block_until_ready(run(f, w[0], ids[0], ex, sh, res, jnp.int32(rep % 2)))
        buf = (ctypes.c_longlong * (moe.CTAS * 16))()   # moe_trace.patch's g_trace[kCtas][16]
        assert lib.dll.jt_moe_trace(buf) == 0
        t = np.array(buf, dtype=np.int64).reshape(moe.CTAS, 16).astype(np.float64)
        t0 = t[:, 0].min()
        rows = {}
        for j, name in enumerate(NAMES):
            v = t[:, j]
            v = (v[v > 0] - t0) / 1e3   # 0: not stamped in this launch (phase 2's stamps in the CTAs without rows)
            if v.size:
                rows[name] = {"min": float(v.min()), "median": float(np.median(v)), "max": float(v.max()), "n": int(v.size)}
        print(rep, json.dumps(rows), flush=True)
        result[rep] = rows
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:2]))
