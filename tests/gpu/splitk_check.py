"""On a GPU (issue 14): the split-K GEMVs of the dsv32-tp8-shard decode step, which now finish inside
their kernel (the split CTAs of a row block are one cluster; the first sums the partials and applies
the epilogue), against the reference, bit-stable from run to run, and timed against the previous form
(the same kernel configuration writing fp32 partials that an XLA fusion sums and finishes: the
kernel's cluster finish switched off by `hw.MAX_CLUSTER = 1` while it is traced).

Per shape and form: `err` (max |got - reference| / max |reference|), `kernels` (CUPTI kernels per
call: 1 against 2), `us` (their device time per call), `chain_us` (wall time per call in a jitted
loop of 32 dependent calls, launch gaps included: what the decode step pays).

    PYTHONPATH=. python3 tests/gpu/splitk_check.py [--out splitk.json] [--chain 32]
    (bench/gpu_session.sh splitk; `--smoke` runs small shapes in GPU interpret mode, untimed, on a CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes_check import _err, _weights  # noqa: E402

from jtilert.ops import reference  # noqa: E402
from jtilert.ops.quant import quantize_weight  # noqa: E402
from jtilert.pallas import _hopper as hw  # noqa: E402
from jtilert.pallas import gemv, moe  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32


@contextlib.contextmanager
def xla_finish():
    """Trace the kernels with the previous split-K form: fp32 partials out, XLA's sum and epilogue."""
    keep = hw.MAX_CLUSTER
    hw.MAX_CLUSTER = 1
    try:
        yield
    finally:
        hw.MAX_CLUSTER = keep


def _device(f, *args, iterations=20):
    """(kernels per call, median device µs per call) under CUPTI."""
    from jax.experimental.mosaic.gpu import profiler
    jax.block_until_ready(f(*args))
    _, per_iter = profiler.Cupti(finalize=False).measure(f, aggregate=False, iterations=iterations)(*args)
    return len(per_iter[0]), float(np.median([sum(t for _, t in it) for it in per_iter])) * 1e3


def _chain(op, args, n=32, reps=20):
    """Wall µs per call of `op(*args)` run n times in one jitted loop, each call depending on the last
    (x += 0·y[0, 0]: one tiny XLA fusion per call in both forms)."""
    def body(_, x):
        y = op(x, *args[1:])
        y = y[0] if isinstance(y, tuple) else y
        return x + (y.reshape(-1)[0] * 0).astype(x.dtype)
    f = jax.jit(lambda *a: jax.lax.fori_loop(0, n, body, a[0]))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / n * 1e6


FULL = dict(hidden=7168, x_proj=2240, experts=256, width=256, kper=8, dense=2304, o_in=2048, eh_in=14336)
SMOKE = dict(hidden=1024, x_proj=130, experts=6, width=128, kper=2, dense=96, o_in=512, eh_in=2048)   # CPU


def cases(dims):
    """(what, n, k, weights P, weight itemsize, make(cfg) -> op(x, *rest), args, reference[, forced split])."""
    out = []
    key = iter(range(1000, 2000))
    hd, width, e, kper = dims["hidden"], dims["width"], dims["experts"], dims["kper"]
    x = lambda t, k: jax.random.normal(jax.random.key(next(key)), (t, k), F32).astype(BF16)  # noqa: E731
    q = lambda shape: jax.vmap(quantize_weight)(  # noqa: E731
        jax.random.normal(jax.random.key(next(key)), shape, F32) * shape[-1] ** -0.5)
    for t in (1, 2):
        xs = x(t, hd)
        nw = (1 + 0.1 * jax.random.normal(jax.random.key(next(key)), (hd,))).astype(BF16)
        n = dims["x_proj"]
        w, s = _weights((n, hd), "fp8", next(key))
        out.append((f"x_proj rmsnorm {n}x{hd} fp8, T={t}", n, hd, 1, 1,
                    lambda cfg: (lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s, config=cfg)),
                    (xs, nw, w, s), reference.rmsnorm_linear(xs, nw, 1e-6, w, s)))
        gate = jax.random.normal(jax.random.key(next(key)), (e, hd), F32) * hd ** -0.5
        out.append((f"router fma {e}x{hd} fp32, T={t}", e, hd, 1, 4,
                    lambda cfg: (lambda x, g: gemv._projection(x, (g,), (None,), out_dtype=F32, config=cfg)),
                    (xs, gate), jnp.einsum("tk,nk->tn", xs.astype(F32), gate, precision="highest")))
        for what, n in (("shared expert gate/up pair", width), ("dense gate/up pair", dims["dense"])):
            g, gs = _weights((n, hd), "fp8", next(key))
            u, us = _weights((n, hd), "fp8", next(key))
            out.append((f"{what} {n}x{hd} fp8, T={t}", n, hd, 2, 1,
                        lambda cfg: (lambda x, g, gs, u, us: gemv.swiglu_pair(x, g, gs, u, us, config=cfg)),
                        (xs, g, gs, u, us), reference.swiglu_hidden(xs, g, gs, u, us)))
        (g, gs), (u, us) = q((e, width, hd)), q((e, width, hd))
        ids = jax.random.randint(jax.random.key(next(key)), (t, kper), 0, e).astype(jnp.int32)
        out.append((f"experts' gate/up {kper}x{width}x{hd} fp8 (expert mode), T={t}", width * kper * t, hd, 2, 1,
                    lambda cfg: (lambda x, i, g, gs, u, us: moe.expert_gate_up(x, i, g, gs, u, us, config=cfg)),
                    (xs, ids, g, gs, u, us), reference.expert_hidden(xs, ids, g, gs, u, us)))
        res, xo = x(t, hd), x(t, dims["o_in"])
        w, s = _weights((hd, dims["o_in"]), "fp8", next(key))
        out.append((f"o_proj + residual {hd}x{dims['o_in']} fp8 at split 2 (forced), T={t}", hd, dims["o_in"], 1, 1,
                    lambda cfg: (lambda x, w, s, r: gemv.linear_residual(x, w, s, r, config=cfg)),
                    (xo, w, s, res), reference.linear_residual(xo, w, s, res), 2))
    xe = x(2, dims["eh_in"])
    w, s = _weights((hd, dims["eh_in"]), "fp8", next(key))
    out.append((f"eh_proj (MTP) {hd}x{dims['eh_in']} fp8, T=2", hd, dims["eh_in"], 1, 1,
                lambda cfg: (lambda x, w, s: gemv.linear(x, w, s, config=cfg)), (xe, w, s), reference.linear(xe, w, s)))
    return out


def down_cases(dims, tokens):
    """The MoE down projection, where K = T·k·width needs split-K (from 4 tokens at the dsv32 shard)."""
    out = []
    e, width, hidden, kper = dims["experts"], dims["width"], dims["hidden"], dims["kper"]
    d, ds = jax.vmap(quantize_weight)(jax.random.normal(jax.random.key(7), (e, hidden, width), F32) * width ** -0.5)
    for t in tokens:
        h = jax.random.normal(jax.random.key(t), (t * kper, width), F32).astype(BF16)
        wts = jax.random.uniform(jax.random.key(t + 10), (t, kper), F32)
        ids = jax.random.randint(jax.random.key(t + 20), (t, kper), 0, e).astype(jnp.int32)
        out.append((f"expert down {hidden}x({kper}x{width}) fp8, T={t}", h, wts, ids, d, ds,
                    reference.expert_down(h, wts, ids, d, ds)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--chain", type=int, default=32)
    p.add_argument("--smoke", action="store_true",
                   help="small shapes in GPU interpret mode, no timing: checks this script on a CPU")
    a = p.parse_args(argv)
    dims = SMOKE if a.smoke else FULL
    timed = not a.smoke
    rows = []
    for case in cases(dims):
        what, n, k, npair, itemsize, make, args, want = case[:8]
        forced = case[8] if len(case) > 8 else 0
        t = args[0].shape[0]
        base = gemv.GemvConfig(engine="fma") if itemsize == 4 else gemv.GemvConfig(split_k=forced)
        resolved = base.resolved(n, k, t, npair, itemsize, 132 if a.smoke else hw.num_sms())
        # the same configuration in both forms (the cluster form's own resolution)
        cfg = gemv.GemvConfig(block_k=resolved.block_k, split_k=resolved.split_k, stages=resolved.stages,
                              engine=resolved.engine)
        row = {"what": what, "config": str(resolved)}
        outs = {}
        for form, ctx in (("cluster", contextlib.nullcontext()), ("xla", xla_finish())):
            with ctx:
                f = jax.jit(make(cfg))
                outs[form] = got = f(*args)
                again = f(*args)
                row[form] = {"err": _err(got, want),
                             "bitwise_stable": bool(np.array_equal(np.asarray(got), np.asarray(again)))}
                if timed:
                    row[form]["kernels"], row[form]["us"] = _device(f, *args)
                    row[form]["chain_us"] = _chain(make(cfg), args, a.chain)
        row["cluster_vs_xla"] = _err(outs["cluster"], outs["xla"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    for what, h, wts, ids, d, ds, want in down_cases(dims, (2,) if a.smoke else (4, 8)):
        row = {"what": what}
        for form, ctx in (("cluster", contextlib.nullcontext()), ("xla", xla_finish())):
            with ctx:
                cfg = gemv.GemvConfig(split_k=2) if a.smoke else None
                f = jax.jit(lambda h, w, i, d, ds: moe.expert_down(h, w, i, d, ds, config=cfg))
                got, again = f(h, wts, ids, d, ds), f(h, wts, ids, d, ds)
                row[form] = {"err": _err(got, want),
                             "bitwise_stable": bool(np.array_equal(np.asarray(got), np.asarray(again)))}
                if timed:
                    row[form]["kernels"], row[form]["us"] = _device(f, h, wts, ids, d, ds)
        print(json.dumps(row), flush=True)
        rows.append(row)
    ok = all(r[f]["err"] < 3e-2 and r[f]["bitwise_stable"] for r in rows for f in ("cluster", "xla"))
    summary = {"ok": bool(ok)}
    if timed:
        # one kernel fewer per call where the shape splits K (the forms are the same kernel otherwise)
        summary["ok"] = ok = ok and all(r["cluster"]["kernels"] < r["xla"]["kernels"] for r in rows)
        summary["us_saved_per_call_device"] = {r["what"]: r["xla"]["us"] - r["cluster"]["us"] for r in rows}
        summary["us_saved_per_call_chain"] = {r["what"]: r["xla"]["chain_us"] - r["cluster"]["chain_us"]
                                              for r in rows if "chain_us" in r["cluster"]}
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"rows": rows, **summary}, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
