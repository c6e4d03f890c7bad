"""Timings of the CUDA engine (issue 6) against the XLA path, on 2+ GPUs.

    PYTHONPATH=. python3 bench/engine.py [--out results.json] [--budget-s 150] [--quick]

Everything is timed inside jitted programs (shard_map over a "tp" mesh of the
first 2 GPUs): a program chains L calls of the op, and the time per op is
(t(2L) - t(L)) / L from the median wall-clock time of whole calls, which
removes dispatch and synchronisation. Weights rotate over distinct arrays so
that they stream from HBM, not from the 60 MB L2. XLA flags are left to the
caller (tests/gpu/run_engine_gpu.sh turns command buffers on).

Sections (in priority order, each skipped once the time budget is spent):
  allreduce  bf16 14/28/56 KiB: engine vs lax.psum
  gemv       o_proj and expert-down shapes: engine fused, engine GEMV alone,
             XLA GEMV alone, XLA GEMV + psum
  moe        MoE down + shared expert at dsv32-tp8-shard shapes: engine fused
             expert_down_all_reduce vs the XLA path (gather, dots, psum)
  topk       merge of 2x2048 candidates: engine vs all_gather + sort
  select     exact top-2048 on one GPU, 4K-160K scores: engine one-launch select
             (sorted, by index) vs lax.top_k
  indexer    128K positions: one GPU vs split over 2 GPUs (plain-JAX scorer), with
             lax.top_k or the engine select (+ engine merge)
  decode     a proxy decode step of DeepSeek-V3.2 widths at tp=2 (few layers)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", default="allreduce,gemv,moe,topk,select,indexer,decode")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on any devices (checks the script, numbers meaningless)")
    args = ap.parse_args()
    t_start = time.perf_counter()

    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jtilert.ffi as jf

    gpus = jax.devices() if args.smoke else jax.devices("gpu")
    W = 2
    mesh = Mesh(np.array(gpus[:W]), ("tp",))
    results: dict = {"device": gpus[0].device_kind, "world": W, "jax": jax.__version__,
                     "engine": jf.available(), "date": time.strftime("%Y-%m-%d"), "rows": []}
    print(f"# {gpus[0].device_kind} x{W}, jax {jax.__version__}, engine={jf.available()} "
          f"{jf.unavailable_reason()}", flush=True)
    reps = 7 if args.quick else 15

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                     check_vma=False))

    def wall(fn, a):
        jax.block_until_ready(fn(*a))  # compile
        for _ in range(3):
            jax.block_until_ready(fn(*a))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def null_program(Lc, in_specs):
        """Same arguments, same number of outputs, no work: its time is the host's
        cost of passing the arguments (about 20 us per sharded array here), which a
        difference of chains with different argument counts would otherwise count."""
        if in_specs is None:
            return jax.jit(lambda *a: tuple(a[0].reshape(-1)[:1] for _ in range(Lc)))
        return smap(lambda *a: tuple(a[0].reshape(-1)[:1].astype(jnp.float32)[None] for _ in range(Lc)),
                    in_specs, tuple([P("tp")] * Lc))

    prof_info = {"printed": False}

    def device_spans(progs, reps=3):
        """Device time of each (fn, args) in progs: the span from the first kernel
        start to the last kernel end of one execution on GPU 0, from a profiler
        trace (CUPTI), median over `reps` executions. None if the trace has no GPU
        kernels. Host time (dispatch, argument passing) is not in it."""
        import glob
        import tempfile

        from jax.profiler import ProfileData
        for fn, a in progs:
            jax.block_until_ready(fn(*a))
        d = tempfile.mkdtemp(prefix="jt_prof_")
        jax.profiler.start_trace(d)
        try:
            for fn, a in progs:
                for _ in range(reps):
                    jax.block_until_ready(fn(*a))
                    time.sleep(0.003)
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(d + "/**/*.xplane.pb", recursive=True)
        if not files:
            return [None] * len(progs)
        pd = ProfileData.from_file(files[0])
        plane = None
        for p in pd.planes:
            if p.name.startswith("/device:GPU:0") or p.name == "/device:GPU:0":
                plane = p
                break
        if not prof_info["printed"]:
            prof_info["printed"] = True
            print("# profiler planes:", [p.name for p in pd.planes][:8], flush=True)
            if plane is not None:
                print("# GPU:0 lines:", [(ln.name, len(list(ln.events))) for ln in plane.lines][:12], flush=True)
        if plane is None:
            return [None] * len(progs)
        def collect(pred):
            out = []
            for ln in plane.lines:
                if not pred(ln.name):
                    continue
                for e in ln.events:
                    if "memcpy" in e.name.lower() or "memset" in e.name.lower():
                        continue
                    out.append((e.start_ns, e.start_ns + e.duration_ns))
            return out
        evs = collect(lambda n: "stream" in n.lower())
        if not evs:
            evs = collect(lambda n: True)
        evs.sort()
        clusters = []
        for st, en in evs:
            if clusters and st - clusters[-1][1] < 1_000_000:  # < 1 ms apart: same execution
                clusters[-1][1] = max(clusters[-1][1], en)
            else:
                clusters.append([st, en])
        if len(clusters) != reps * len(progs):
            print(f"# profiler: {len(clusters)} executions found, expected {reps * len(progs)}", flush=True)
            return [None] * len(progs)
        out = []
        for i in range(len(progs)):
            spans = [(c[1] - c[0]) / 1e3 for c in clusters[i * reps:(i + 1) * reps]]
            out.append(statistics.median(spans))
        return out

    def dev_per_op(make, L):
        """us per op on the device: (span(2L) - span(L)) / L from profiler traces.
        NaN when the trace gives nothing usable (a negative difference was seen for
        some programs on 2026-11-30: the span clustering is then not trusted)."""
        progs = [make(Lc)[:2] for Lc in (L, 2 * L)]
        s1, s2 = device_spans(progs)
        if s1 is None or s2 is None:
            return float("nan")
        if s2 <= s1:
            print(f"# profiler spans not usable: L={L}: {s1:.1f} us, 2L: {s2:.1f} us", flush=True)
            return float("nan")
        return (s2 - s1) / L

    def per_op(make, L):
        """us per op from chains of L and 2L ops. make(Lc) -> (fn, args) or (fn, args,
        in_specs): with in_specs (None: one device) the null program's time is
        subtracted from each chain's."""
        ts = []
        for Lc in (L, 2 * L):
            fn, a, *rest = make(Lc)
            t = wall(fn, a)
            if rest:
                t -= wall(null_program(Lc, rest[0]), a)
            ts.append(t)
        t1, t2 = ts
        return (t2 - t1) / L * 1e6, t1 * 1e6, t2 * 1e6

    def row(section, name, us, **kw):
        r = {"section": section, "name": name, "us": round(us, 3), **kw}
        results["rows"].append(r)
        extra = " ".join(f"{k}={v}" for k, v in kw.items())
        print(f"{section:9s} {name:58s} {us:9.2f} us  {extra}", flush=True)

    secs = set(args.sections.split(","))

    # ---------------------------------------------------------------- all-reduce
    if "allreduce" in secs:
        L = 32 if args.quick else 64
        for kib in (14, 28, 56):
            n = kib * 1024 // 2
            x0 = jnp.asarray(np.random.default_rng(0).standard_normal((W, n)) * 2.0 ** -60, jnp.bfloat16)

            def make(Lc, kind, n=n, x0=x0):
                def f(x):
                    x = x[0]
                    for _ in range(Lc):
                        x = jf.all_reduce(x, "tp") if kind == "engine" else lax.psum(x, "tp")
                    return x[None]
                return smap(f, P("tp"), P("tp")), (x0,)

            dev_e = dev_per_op(lambda Lc: make(Lc, "engine"), L)
            dev_p = dev_per_op(lambda Lc: make(Lc, "psum"), L)
            us_e, *_ = per_op(lambda Lc: make(Lc, "engine"), L)
            us_p, *_ = per_op(lambda Lc: make(Lc, "psum"), L)
            # same values from both chains (x * 2^(2L))
            fe, a = make(4, "engine")
            fp, _ = make(4, "psum")
            same = bool(jnp.array_equal(fe(*a), fp(*a)))
            row("allreduce", f"bf16 {kib} KiB engine, device time per op in a chain", dev_e,
                psum_us=round(dev_p, 2), ratio_vs_psum=round(dev_e / dev_p, 3),
                wall_engine_us=round(us_e, 2), wall_psum_us=round(us_p, 2), equal_to_psum=same)
            if left() < 0:
                break

    # ---------------------------------------------------------------- GEMV + all-reduce
    if "gemv" in secs and left() > 0:
        L = 8 if args.quick else 16
        shapes = [("o_proj", 7168, 2048, "bf16"), ("o_proj", 7168, 2048, "fp8"),
                  ("expert_down x1", 7168, 256, "bf16"), ("expert_down x9", 7168, 2304, "bf16"),
                  ("expert_down x9", 7168, 2304, "fp8")]
        if args.quick:
            shapes = shapes[:3]
        if args.smoke:
            shapes = [("o_proj", 256, 128, "bf16"), ("o_proj", 256, 128, "fp8")]
        for label, n, k, wd in shapes:
            if left() < 0:
                break
            key = jax.random.key(1)
            nw = 2 * L
            kg = k * W
            ws, ss = [], []
            for i in range(nw):
                kk = jax.random.fold_in(key, i)
                if wd == "fp8":
                    ws.append((jax.random.normal(kk, (n, kg), jnp.float32) * 4).astype(jnp.float8_e4m3fn))
                    ss.append(jnp.full((-(-n // 128), kg // 128), 0.01, jnp.float32))
                else:
                    ws.append((jax.random.normal(kk, (n, kg), jnp.float32) * 0.02).astype(jnp.bfloat16))
                    ss.append(None)
            shard = jax.sharding.NamedSharding(mesh, P(None, "tp"))
            ws = [jax.device_put(w, shard) for w in ws]
            ss = [None if s is None else jax.device_put(s, shard) for s in ss]
            x = jax.device_put(jnp.asarray(np.random.default_rng(2).standard_normal(kg), jnp.bfloat16),
                               jax.sharding.NamedSharding(mesh, P("tp")))

            def op(kind, xl, w, s):
                if kind == "engine_fused":
                    return jf.gemv_all_reduce(xl, w, s, "tp")
                if kind == "engine_gemv":
                    return jf.gemv(xl, w, s)
                if kind == "xla_gemv":
                    wb = w.astype(jnp.bfloat16)
                    if s is not None:
                        wb = jf.dequantize(w, s).astype(jnp.bfloat16)
                    return jnp.dot(wb, xl, preferred_element_type=jnp.float32).astype(xl.dtype)
                if kind == "xla_gemv_psum":
                    wb = w.astype(jnp.bfloat16) if s is None else jf.dequantize(w, s).astype(jnp.bfloat16)
                    return lax.psum(jnp.dot(wb, xl, preferred_element_type=jnp.float32), "tp").astype(xl.dtype)
                raise ValueError(kind)

            def make(Lc, kind):
                def g(xl, *rest):
                    outs = []
                    for i in range(Lc):
                        s = rest[Lc + i] if wd == "fp8" else None
                        outs.append(op(kind, xl, rest[i], s)[None])
                    return tuple(outs)
                a = [x] + list(ws[:Lc]) + (list(ss[:Lc]) if wd == "fp8" else [])
                n_w = Lc * (2 if wd == "fp8" else 1)
                in_specs = (P("tp"),) + (P(None, "tp"),) * n_w
                return smap(g, in_specs, (P("tp"),) * Lc), tuple(a), in_specs

            res = {}
            for kind in ("engine_fused", "engine_gemv", "xla_gemv", "xla_gemv_psum"):
                if left() < 0:
                    break
                try:
                    res[kind] = dev_per_op(lambda Lc, kind=kind: make(Lc, kind), L)
                    if res[kind] != res[kind]:  # no profiler data: wall clock minus argument passing
                        res[kind], *_ = per_op(lambda Lc, kind=kind: make(Lc, kind), L)
                except Exception as e:  # noqa: BLE001
                    print(f"gemv {label} {kind} failed: {type(e).__name__}: {e}", flush=True)
            if "engine_fused" in res:
                wbytes = n * k * (1 if wd == "fp8" else 2)
                row("gemv", f"{label} N={n} K_local={k} {wd} engine fused GEMV+AR", res["engine_fused"],
                    **{f"{k_}_us": round(v, 2) for k_, v in res.items() if k_ != "engine_fused"},
                    ratio_vs_engine_gemv=round(res["engine_fused"] / res.get("engine_gemv", float("nan")), 3),
                    ratio_vs_xla_gemv=round(res["engine_fused"] / res.get("xla_gemv", float("nan")), 3),
                    ratio_vs_xla_gemv_psum=round(res["engine_fused"] / res.get("xla_gemv_psum", float("nan")), 3),
                    weight_MB=round(wbytes / 1e6, 2),
                    engine_gemv_TBps=round(wbytes / res.get("engine_gemv", float("nan")) / 1e6, 2))
            del ws, ss

    # ---------------------------------------------------------------- MoE down + shared + all-reduce
    if "moe" in secs and left() > 0:
        # dsv32-tp8-shard per rank: 8 of 256 routed experts [7168, 256] + the shared [7168, 256];
        # op i of a chain reads experts 8i..8i+7 and its own shared weight, so weights stream from HBM
        L = 8
        n, i_loc, nsel, e = (256, 128, 8, 64) if args.smoke else (7168, 256, 8, 256)
        rng = np.random.default_rng(5)
        for wd in ("fp8", "bf16"):
            if left() < 0:
                break
            fp8 = wd == "fp8"
            key = jax.random.key(3)
            dt, sd = (jnp.float8_e4m3fn, 4.0) if fp8 else (jnp.bfloat16, 0.02)
            shard3 = jax.sharding.NamedSharding(mesh, P(None, None, "tp"))
            shard2 = jax.sharding.NamedSharding(mesh, P(None, "tp"))
            down = jax.device_put((jax.random.normal(key, (e, n, i_loc * W), jnp.float32) * sd).astype(dt), shard3)
            shared = [jax.device_put((jax.random.normal(jax.random.fold_in(key, i), (n, i_loc * W), jnp.float32)
                                      * sd).astype(dt), shard2) for i in range(2 * L)]
            down_s = jnp.full((e, -(-n // 128), i_loc * W // 128), 2.0 ** -6, jnp.float32)
            sh_s = jnp.full((-(-n // 128), i_loc * W // 128), 2.0 ** -6, jnp.float32)
            h = jnp.asarray(rng.standard_normal((nsel, i_loc * W)), jnp.bfloat16)
            hs = jnp.asarray(rng.standard_normal(i_loc * W), jnp.bfloat16)
            wts = jnp.asarray(rng.uniform(0.1, 1.0, nsel), jnp.float32)
            ids = [jnp.arange(nsel * i, nsel * (i + 1), dtype=jnp.int32) % e for i in range(2 * L)]

            def make(Lc, kind, down=down, shared=shared, down_s=down_s, sh_s=sh_s, h=h, hs=hs, wts=wts,
                     ids=ids, fp8=fp8):
                op = jf.expert_down_all_reduce if kind == "engine" else jf.expert_down_reference

                def f(h, hs, wts, down, ds, ss, *rest):
                    return tuple(op(h, wts, rest[Lc + i], down, ds if fp8 else None, hs, rest[i],
                                    ss if fp8 else None, "tp")[None] for i in range(Lc))
                in_specs = ((P(None, "tp"), P("tp"), P(), P(None, None, "tp"), P(None, None, "tp"),
                             P(None, "tp")) + (P(None, "tp"),) * Lc + (P(),) * Lc)
                a = (h, hs, wts, down, down_s, sh_s) + tuple(shared[:Lc]) + tuple(ids[:Lc])
                return smap(f, in_specs, (P("tp"),) * Lc), a, in_specs

            res = {}
            for kind in ("engine", "xla"):
                try:
                    res[kind] = dev_per_op(lambda Lc, kind=kind: make(Lc, kind), L)
                    if res[kind] != res[kind]:
                        res[kind], *_ = per_op(lambda Lc, kind=kind: make(Lc, kind), L)
                except Exception as ex:  # noqa: BLE001
                    print(f"moe {wd} {kind} failed: {type(ex).__name__}: {ex}", flush=True)
            if "engine" in res:
                fe, a, _ = make(1, "engine")
                fr, _, _ = make(1, "xla")
                ye, yr = np.asarray(fe(*a)[0], np.float32), np.asarray(fr(*a)[0], np.float32)
                wbytes = (nsel + 1) * n * i_loc * (1 if fp8 else 2)
                row("moe", f"expert down {nsel}x[{n},{i_loc}] + shared {wd}: engine fused (+AR)", res["engine"],
                    xla_unfused_psum_us=round(res.get("xla", float("nan")), 2),
                    ratio_vs_xla=round(res["engine"] / res.get("xla", float("nan")), 3),
                    weight_MB=round(wbytes / 1e6, 2),
                    rel_diff_vs_xla=f"{np.linalg.norm(ye - yr) / np.linalg.norm(yr):.1e}")
            del down, shared

    # ---------------------------------------------------------------- merge top-k
    if "topk" in secs and left() > 0:
        L = 16 if args.quick else 32
        m = k = 64 if args.smoke else 2048
        rng = np.random.default_rng(3)
        lists = []
        for i in range(2 * L):
            sc = -np.sort(-rng.standard_normal((W, m)).astype(np.float32), axis=1)
            idx = np.stack([r * 65536 + np.arange(m) for r in range(W)]).astype(np.int32)
            lists.append((jnp.asarray(sc), jnp.asarray(idx)))

        def make(Lc, kind):
            def f(*a):
                outs = []
                for i in range(Lc):
                    s, ix = a[2 * i][0], a[2 * i + 1][0]
                    if kind == "engine":
                        o = jf.merge_topk(s, ix, "tp", k)
                    else:
                        o = jf.merge_topk_reference(s, ix, "tp", k)
                    outs.append(o[1][None])
                return tuple(outs)
            flat = [t for pair in lists[:Lc] for t in pair]
            in_specs = tuple([P("tp")] * (2 * Lc))
            return smap(f, in_specs, tuple([P("tp")] * Lc)), tuple(flat), in_specs

        us_e = dev_per_op(lambda Lc: make(Lc, "engine"), L)
        us_r = dev_per_op(lambda Lc: make(Lc, "xla"), L)
        if us_e != us_e:
            us_e, *_ = per_op(lambda Lc: make(Lc, "engine"), L)
            us_r, *_ = per_op(lambda Lc: make(Lc, "xla"), L)
        fe, a, _ = make(2, "engine")
        fr, _, _ = make(2, "xla")
        same = all(bool(jnp.array_equal(p, q)) for p, q in zip(fe(*a), fr(*a)))
        row("topk", f"merge_topk 2 ranks x {m} -> {k}: engine", us_e, xla_allgather_sort_us=round(us_r, 2),
            ratio_vs_xla=round(us_e / us_r, 3), equal_to_xla=same)

    # ---------------------------------------------------------------- one-GPU exact top-k
    if "select" in secs and left() > 0:
        L = 4 if args.quick else 8
        K = 64 if args.smoke else 2048
        dev = gpus[0]
        for n in ((4096,) if args.smoke else (4096, 32768, 131072)):
            if left() < 0:
                break
            xs = [jax.device_put(jax.random.normal(jax.random.fold_in(jax.random.key(5), i), (1, n)), dev)
                  for i in range(2 * L)]

            def make(Lc, kind, xs=xs):
                def f(*a):
                    if kind == "xla":
                        return tuple(lax.top_k(x, K)[1] for x in a)
                    return tuple(jf.top_k(x, K, sorted=kind == "engine")[1] for x in a)
                return jax.jit(f), tuple(xs[:Lc]), None

            res = {}
            for kind in ("engine", "engine_by_index", "xla"):
                res[kind] = dev_per_op(lambda Lc, kind=kind: make(Lc, kind), L)
                if res[kind] != res[kind]:
                    res[kind], *_ = per_op(lambda Lc, kind=kind: make(Lc, kind), L)
            fe, a, _ = make(1, "engine")
            fx, _, _ = make(1, "xla")
            same = bool(jnp.array_equal(fe(*a)[0], fx(*a)[0]))
            row("select", f"top-{K} of {n} scores, T=1: engine (sorted)", res["engine"],
                engine_by_index_us=round(res["engine_by_index"], 2), xla_top_k_us=round(res["xla"], 2),
                speedup_vs_xla=round(res["xla"] / res["engine"], 2), equal_to_lax_top_k=same)

    # ---------------------------------------------------------------- split indexer
    if "indexer" in secs and left() > 0:
        S, H, D, K = (4096, 8, 128, 64) if args.smoke else (131072, 64, 128, 2048)
        L = 4
        key = jax.random.key(7)
        keys = [(jax.random.normal(jax.random.fold_in(key, i), (S, D), jnp.float32)).astype(jnp.bfloat16)
                for i in range(2 * L)]
        q = jax.random.normal(jax.random.fold_in(key, 1000), (H, D), jnp.float32).astype(jnp.bfloat16)
        wq = jax.random.uniform(jax.random.fold_in(key, 1001), (H,), jnp.float32)

        def score(kc, q, w):
            logits = jnp.dot(kc, q.T, preferred_element_type=jnp.float32)  # [S, H]
            return jnp.dot(jnp.maximum(logits, 0.0), w)  # [S]

        def single(Lc, kind="xla"):
            dev = gpus[0]
            ks = [jax.device_put(kk, dev) for kk in keys[:Lc]]

            def f(q, w, *ks):
                if kind == "engine_select":
                    return tuple(jf.top_k(score(kc, q, w), K)[1] for kc in ks)
                return tuple(lax.top_k(score(kc, q, w), K)[1] for kc in ks)
            return jax.jit(f), (jax.device_put(q, dev), jax.device_put(wq, dev), *ks), None

        def split(Lc, kind):
            shard = jax.sharding.NamedSharding(mesh, P("tp"))
            ks = [jax.device_put(kk, shard) for kk in keys[:Lc]]

            def f(q, w, *ks):
                r = lax.axis_index("tp")
                outs = []
                for kc in ks:
                    if kind == "engine_select":   # engine select of this half + engine merge
                        outs.append(jf.split_topk(score(kc, q, w), K, "tp")[1][None])
                        continue
                    vals, loc = lax.top_k(score(kc, q, w), K)
                    gi = loc.astype(jnp.int32) + r * (S // W)
                    if kind == "engine":
                        outs.append(jf.merge_topk(vals, gi, "tp", K)[1][None])
                    else:
                        outs.append(jf.merge_topk_reference(vals, gi, "tp", K)[1][None])
                return tuple(outs)
            in_specs = (P(), P(), *[P("tp")] * Lc)
            return smap(f, in_specs, tuple([P("tp")] * Lc)), (q, wq, *ks), in_specs

        us_1 = dev_per_op(single, L)
        us_e = dev_per_op(lambda Lc: split(Lc, "engine"), L)
        us_x = dev_per_op(lambda Lc: split(Lc, "xla"), L)
        us_1s = dev_per_op(lambda Lc: single(Lc, "engine_select"), L)
        us_es = dev_per_op(lambda Lc: split(Lc, "engine_select"), L)
        if us_1 != us_1 or us_e != us_e:
            us_1, *_ = per_op(single, L)
            us_e, *_ = per_op(lambda Lc: split(Lc, "engine"), L)
            us_x, *_ = per_op(lambda Lc: split(Lc, "xla"), L)
        if us_1s != us_1s or us_es != us_es:
            us_1s, *_ = per_op(lambda Lc: single(Lc, "engine_select"), L)
            us_es, *_ = per_op(lambda Lc: split(Lc, "engine_select"), L)
        f1, a1, _ = single(1)
        fe, ae, _ = split(1, "engine")
        same = bool(np.array_equal(np.sort(np.asarray(f1(*a1)[0])), np.sort(np.asarray(fe(*ae)[0][0]))))
        row("indexer", f"S={S} H={H} D={D} top-{K}: split over 2 GPUs + engine merge", us_e,
            single_gpu_us=round(us_1, 2), split_xla_merge_us=round(us_x, 2),
            ratio_vs_single=round(us_e / us_1, 3), same_set_as_single=same)
        f1s, a1s, _ = single(1, "engine_select")
        fes, aes, _ = split(1, "engine_select")
        one = np.asarray(f1s(*a1s)[0])
        same_s = (bool(np.array_equal(one, np.asarray(f1(*a1)[0])))
                  and bool(np.array_equal(np.asarray(fes(*aes)[0][0]), one)))
        row("indexer", f"S={S} H={H} D={D} top-{K}: split over 2 GPUs, engine select + engine merge",
            us_es, single_gpu_engine_select_us=round(us_1s, 2), single_gpu_lax_top_k_us=round(us_1, 2),
            ratio_vs_single_engine_select=round(us_es / us_1s, 3),
            ratio_vs_single_lax_top_k=round(us_es / us_1, 3), same_as_lax_top_k=same_s)

    # ---------------------------------------------------------------- decode-step proxy
    if "decode" in secs and left() > 0:
        # Per layer at tp=2 with DeepSeek-V3.2 widths, bf16 weights: RMSNorm -> local
        # projection 7168 -> 8192 (a stand-in for q/kv/attention producing this rank's
        # 64 heads x 128) -> o_proj [7168 x 8192] + all-reduce -> residual -> RMSNorm ->
        # up/gate 7168 -> 2 x 9 x 1024 (8 routed + 1 shared expert slices) -> SiLU*mul ->
        # down [7168 x 9216] + all-reduce -> residual. Not the real model (no MLA, no
        # routing): it measures what the engine changes in a step of those widths.
        layers = 4
        hd, ka, kf = (256, 128, 128) if args.smoke else (7168, 8192, 9216)
        key = jax.random.key(11)

        def mk(i, shape, spec):
            w = (jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
            return jax.device_put(w, jax.sharding.NamedSharding(mesh, spec))

        params = []
        for li in range(layers):
            params += [mk(10 * li, (ka * W, hd), P("tp")), mk(10 * li + 1, (hd, ka * W), P(None, "tp")),
                       mk(10 * li + 2, (2 * kf * W, hd), P("tp")), mk(10 * li + 3, (hd, kf * W), P(None, "tp"))]
        x0 = jnp.asarray(np.random.default_rng(4).standard_normal(hd), jnp.bfloat16)

        def rms(v):
            vf = v.astype(jnp.float32)
            return (vf * lax.rsqrt(jnp.mean(vf * vf) + 1e-6)).astype(jnp.bfloat16)

        def step(kind):
            def f(x, *ps):
                for li in range(layers):
                    wa, wo, wu, wd_ = ps[4 * li:4 * li + 4]
                    h = rms(x)
                    a = jnp.dot(wa, h, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
                    if kind == "engine":
                        o = jf.gemv_all_reduce(a, wo, None, "tp")
                    else:
                        o = lax.psum(jnp.dot(wo, a, preferred_element_type=jnp.float32), "tp").astype(jnp.bfloat16)
                    x = x + o
                    h = rms(x)
                    gu = jnp.dot(wu, h, preferred_element_type=jnp.float32)
                    g, u = gu[:kf], gu[kf:]
                    a = (jax.nn.silu(g) * u).astype(jnp.bfloat16)
                    if kind == "engine":
                        o = jf.gemv_all_reduce(a, wd_, None, "tp")
                    else:
                        o = lax.psum(jnp.dot(wd_, a, preferred_element_type=jnp.float32), "tp").astype(jnp.bfloat16)
                    x = x + o
                return x
            specs = (P(),) + tuple(s for _ in range(layers) for s in (P("tp"), P(None, "tp"), P("tp"), P(None, "tp")))
            return smap(f, specs, P()), (x0, *params), specs

        fe, a, specs = step("engine")
        fp, _, _ = step("psum")
        us_e, us_p = device_spans([(fe, a), (fp, a)])
        note = "device span of one step (profiler), per layer"
        if us_e is None or us_p is None:
            t_null = wall(null_program(1, specs), a)
            us_e, us_p = (wall(fe, a) - t_null) * 1e6, (wall(fp, a) - t_null) * 1e6
            note = "whole-step wall time minus the argument-passing time, per layer"
        ye, yp = np.asarray(fe(*a), np.float32), np.asarray(fp(*a), np.float32)
        rel = float(np.linalg.norm(ye - yp) / np.linalg.norm(yp))
        row("decode", f"proxy step, {layers} layers x (o_proj + down) at tp=2, engine", us_e / layers,
            psum_us_per_layer=round(us_p / layers, 2), ratio_vs_psum=round(us_e / us_p, 3),
            rel_diff_vs_psum=f"{rel:.1e}", note=note)

    results["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"# done in {results['elapsed_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
