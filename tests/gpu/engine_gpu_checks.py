"""GPU correctness checks of jtilert.ffi through JAX (needs >= 2 GPUs).

    PYTHONPATH=. python3 tests/gpu/engine_gpu_checks.py [--calls 10000]

Run by tests/gpu/run_engine_gpu.sh with JTILERT_FFI_LIB pointing at the built
library. Prints one PASS/FAIL line per check and exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
import warnings

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # tests/: ffi_inputs
from ffi_inputs import (EXPERT_DOWN_SPECS, STACKED_EXPERT_DOWN_SPECS, expert_down_case, fp8_weights,  # noqa: E402
                        np_expert_down, np_gemv, sorted_lists, stack_layers)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--dispatch-calls", type=int, default=2000)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the script on host devices through the fallback (checks the script only)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    import jtilert.ffi as jf

    fails = []

    def report(ok, what):
        print(("PASS " if ok else "FAIL ") + what, flush=True)
        if not ok:
            fails.append(what)

    @contextlib.contextmanager
    def checking(what):
        """A check that raises reports itself as failed, and the others still run."""
        try:
            yield
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            report(False, f"{what}: {e}")

    gpus = jax.devices() if args.cpu_smoke else jax.devices("gpu")
    print(f"jax {jax.__version__}, {len(gpus)} GPU(s): {gpus[0].device_kind}")
    print("engine available:", jf.available(), jf.unavailable_reason())
    if len(gpus) < 2 or not (jf.available() or args.cpu_smoke):
        report(False, "need >= 2 GPUs and the engine")
        return 1
    W = 2
    mesh = Mesh(np.array(gpus[:W]), ("tp",))
    rng = np.random.default_rng(0)
    warnings.simplefilter("always")

    def smap(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    def per_rank(f):
        """Wraps f so each rank's output comes back stacked on a leading axis."""
        def g(*a):
            out = f(*a)
            return jax.tree.map(lambda o: o[None], out)
        return g

    def hlo_has(fn, args, name):
        return name in fn.lower(*args).as_text()

    # ---------------- all-reduce vs psum, bit-identical across ranks ----------
    for dtype in (jnp.bfloat16, jnp.float32):
        for n in (1, 7, 14336, 100003):
            for algo in (0, 1):
                x = jnp.asarray(rng.standard_normal((W, n)), dtype)
                fe = smap(per_rank(lambda v, algo=algo: jf.all_reduce(v[0], "tp", algo=algo)),
                          P("tp"), P("tp"))
                fp = smap(per_rank(lambda v: lax.psum(v[0], "tp")), P("tp"), P("tp"))
                with checking(f"all_reduce {dtype} n={n} algo={algo}"):
                    ye = np.asarray(fe(x).astype(jnp.float32))
                    yp = np.asarray(fp(x).astype(jnp.float32))
                    ref = np.asarray(x.astype(jnp.float32)).sum(0)
                    same = all(np.array_equal(ye[0].view(np.uint32), ye[r].view(np.uint32))
                               for r in range(W))
                    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
                    close = np.allclose(ye[0], ref, rtol=tol, atol=tol)
                    eq_psum = np.array_equal(ye[0], yp[0])
                    custom = hlo_has(fe, (x,), "jtilert_all_reduce")
                    report(same and close and custom,
                           f"all_reduce {jnp.dtype(dtype).name} n={n} algo={'two' if algo else 'one'}-shot: "
                           f"custom_call={custom} bit-identical={same} close-to-ref={close} "
                           f"equals-psum-bitwise={eq_psum} max|d psum|="
                           f"{np.abs(ye[0] - yp[0]).max():.3g}")

    # ---------------- GEMV + all-reduce -----------------------------------------
    def loop_mismatches(step, iterations):
        """A jitted loop's check: `step(it)` gives (expert down, its reference, GEMV, its reference);
        the entries outside tolerance summed over the iterations, [1] per rank: (moe, gemv)."""
        def body(it, c):
            y, yr, o, orf = (a.astype(jnp.float32) for a in step(it))
            return (c[0] + jnp.sum(jnp.abs(y - yr) > 0.02 * jnp.abs(yr) + 0.05 * jnp.abs(yr).max()),
                    c[1] + jnp.sum(jnp.abs(o - orf) > 0.02 * jnp.abs(orf) + 0.05))
        z = jnp.zeros((), jnp.int32)
        return jax.tree.map(lambda o: o[None], lax.fori_loop(0, iterations, body, (z, z)))

    def report_loop(fl, args, what):
        t0 = time.perf_counter()
        res = [np.asarray(a) for a in fl(*args)]
        report(all(int(a.sum()) == 0 for a in res), f"{what}: mismatches moe={res[0].tolist()} "
               f"gemv={res[1].tolist()} ({time.perf_counter() - t0:.1f} s incl. compile)")

    def rel_and_same(y, ref):
        """rank 0's relative L2 error against ref, and whether all ranks agree bit for bit."""
        return (np.linalg.norm(y[0] - ref) / np.linalg.norm(ref),
                all(np.array_equal(y[0], y[r]) for r in range(W)))

    for (n, k, fp8) in ((7168, 2048, False), (7168, 2048, True), (7168, 256, False),
                        (1001, 512, True), (999, 2304, False)):
        kg = k * W
        x = jnp.asarray(rng.standard_normal(kg), jnp.bfloat16)
        if fp8:
            w, s = fp8_weights(rng, n, kg)
            in_specs = (P("tp"), P(None, "tp"), P(None, "tp"))
            fn = smap(per_rank(lambda x, w, s: jf.gemv_all_reduce(x, w, s, "tp")), in_specs, P("tp"))
            args_ = (x, w, s)
        else:
            w = jnp.asarray(rng.standard_normal((n, kg)) * 0.05, jnp.bfloat16)
            s = None
            in_specs = (P("tp"), P(None, "tp"))
            fn = smap(per_rank(lambda x, w: jf.gemv_all_reduce(x, w, None, "tp")), in_specs, P("tp"))
            args_ = (x, w)
        with checking(f"gemv_all_reduce N={n} K={k} fp8={fp8}"):
            rel, same = rel_and_same(np.asarray(fn(*args_).astype(jnp.float32)), np_gemv(x, w, s))
            custom = hlo_has(fn, args_, "jtilert_gemv_all_reduce")
            report(same and rel < 8e-3 and custom,
                   f"gemv_all_reduce N={n} K_local={k} {'fp8' if fp8 else 'bf16'}: custom_call={custom} "
                   f"bit-identical={same} rel-err={rel:.2e}")

    # local GEMV (no communication)
    with checking("gemv local"):
        x = jnp.asarray(rng.standard_normal(2048), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((7168, 2048)) * 0.05, jnp.bfloat16)
        y = np.asarray(jax.jit(lambda x, w: jf.gemv(x, w))(x, w).astype(jnp.float32))
        rel = np.linalg.norm(y - np_gemv(x, w, None)) / np.linalg.norm(np_gemv(x, w, None))
        report(rel < 8e-3, f"gemv (local) 7168x2048 bf16: rel-err={rel:.2e}")

    # ---------------- MoE down + shared expert + all-reduce ----------------------
    def ed_case(n, k, i_loc, e, is_loc, fp8):
        return expert_down_case(rng, fp8, world=W, e=e, n=n, k=k, i_loc=i_loc, is_loc=is_loc)

    def expert_down_fn(f, fp8):
        """smap of f(h, wts, ids, down, ds, hs, sd, ss) over the ranks (scales dropped for bf16)."""
        if fp8:
            return smap(per_rank(f), EXPERT_DOWN_SPECS, P("tp"))
        g = lambda h, w, i, d, hs, sd: f(h, w, i, d, None, hs, sd, None)  # noqa: E731
        return smap(per_rank(g), EXPERT_DOWN_SPECS[:4] + EXPERT_DOWN_SPECS[5:7], P("tp"))

    for (n, k, i_loc, e, is_loc, fp8) in ((7168, 8, 256, 16, 256, True), (7168, 8, 256, 16, 256, False),
                                          (7168, 8, 128, 16, 128, True), (1001, 3, 64, 5, 128, False)):
        with checking(f"expert_down_all_reduce N={n} fp8={fp8}"):
            case = ed_case(n, k, i_loc, e, is_loc, fp8)
            args_ = tuple(a for a in case if a is not None)
            fe = expert_down_fn(lambda *a: jf.expert_down_all_reduce(*a, "tp"), fp8)
            fp = expert_down_fn(lambda *a: jf.expert_down_reference(*a, "tp"), fp8)
            y = np.asarray(fe(*args_).astype(jnp.float32))
            rel, same = rel_and_same(y, np_expert_down(*case))
            yp = np.asarray(fp(*args_).astype(jnp.float32))[0]
            rel_p = np.linalg.norm(y[0] - yp) / np.linalg.norm(yp)
            custom = hlo_has(fe, args_, "jtilert_expert_down_all_reduce")
            report(same and rel < 8e-3 and rel_p < 1e-2 and custom,
                   f"expert_down_all_reduce N={n} {k}x[{i_loc}] of E={e} + shared[{is_loc}] per rank "
                   f"{'fp8' if fp8 else 'bf16'}: custom_call={custom} bit-identical={same} "
                   f"rel-err={rel:.2e} rel-diff-vs-psum-path={rel_p:.2e}")

    # interleaved with the o_proj GEMV + all-reduce and all_reduce, many calls in one jitted loop
    with checking("expert_down jitted loop"):
        case = ed_case(7168, 8, 256, 16, 256, True)
        w_o = jnp.asarray(rng.standard_normal((7168, 1024 * W)) * 0.05, jnp.bfloat16)
        x_o = jnp.asarray(rng.standard_normal(1024 * W), jnp.bfloat16)

        def moe_loop(x, w, h, wts, ids, down, ds, hs, sd, ss):
            def step(it):
                hi = h * (1 + it % 5).astype(h.dtype)
                idi = (ids + it) % down.shape[0]
                return (jf.expert_down_all_reduce(hi, wts, idi, down, ds, hs, sd, ss, "tp"),
                        jf.expert_down_reference(hi, wts, idi, down, ds, hs, sd, ss, "tp"),
                        jf.gemv_all_reduce(x, w, None, "tp"), jf.gemv_reference(x, w, None, "tp"))
            return loop_mismatches(step, 2000)

        report_loop(smap(moe_loop, (P("tp"), P(None, "tp")) + EXPERT_DOWN_SPECS, P("tp")), (x_o, w_o, *case),
                    "2000 iterations of expert_down_all_reduce (ids changing on the device) + gemv_all_reduce "
                    "in one jitted fori_loop")

    # ---------------- stacked layers (layer=): whole [L, ...] weights + a traced layer index --------
    def stacked_fn(f, specs, args, layers, n):
        """smap of a fori_loop over the layer indices `layers` (the loop computes each one: a traced
        value) stacking f(layer, *args) [n] per index; the None entries of args (bf16 scales) are
        dropped with their specs and passed to f as None."""
        keep = [i for i, a in enumerate(args) if a is not None]

        def body_fn(*a):
            full = [None] * len(args)
            for i, v in zip(keep, a):
                full[i] = v

            def body(i, ys):
                layer = sum(jnp.where(i == j, jnp.int32(v), jnp.int32(0)) for j, v in enumerate(layers))
                return ys.at[i].set(f(layer, *full))
            return lax.fori_loop(0, len(layers), body, jnp.zeros((len(layers), n), jnp.bfloat16))[None]

        return smap(body_fn, tuple(specs[i] for i in keep), P("tp")), tuple(args[i] for i in keep)

    def no_weight_slice(fn, args, dims):
        """Whether neither the lowered nor the compiled program dynamic-slices the weight stack (one
        layer's shape `dims`, per rank; the stack's and the slice's types end in it): the stacked
        weights go to the kernel whole."""
        stable = "x".join(map(str, dims)) + "x"
        hlo = ",".join(map(str, dims)) + "]"
        lowered = fn.lower(*args)
        return (not any("dynamic_slice" in ln and stable in ln for ln in lowered.as_text().splitlines())
                and not any("dynamic-slice(" in ln and hlo in ln for ln in lowered.compile().as_text().splitlines()))

    L = 3
    layer_vals = [0, 2, 1, -1, L + 4]   # -1: the last layer; L + 4 clamps to the last, like w[layer]

    def eff(v):
        return min(max(v + L if v < 0 else v, 0), L - 1)

    for (n, k, fp8) in ((7168, 1024, True), (7168, 1024, False), (1001, 512, True)):
        with checking(f"gemv_all_reduce layer= N={n} fp8={fp8}"):
            kg = k * W
            x = jnp.asarray(rng.standard_normal(kg), jnp.bfloat16)
            if fp8:
                per = [(x,) + fp8_weights(rng, n, kg) for _ in range(L)]
            else:
                per = [(x, jnp.asarray(rng.standard_normal((n, kg)) * 0.05, jnp.bfloat16), None) for _ in range(L)]
            xs, ws, ss = stack_layers(per)
            specs = (P("tp"), P(None, None, "tp"), P(None, None, "tp"))
            fe, a = stacked_fn(lambda l, x, w, s: jf.gemv_all_reduce(x, w, s, "tp", layer=l), specs, (xs, ws, ss),
                               layer_vals, n)
            y = np.asarray(fe(*a).astype(jnp.float32))           # [W, len(layer_vals), n]
            # the unstacked engine op on w[l]: the same kernel on the same bytes, so the same bits
            fu = smap(per_rank(lambda x, w, *s: jf.gemv_all_reduce(x, w, s[0] if s else None, "tp")),
                      (P("tp"), P(None, "tp")) + ((P(None, "tp"),) if fp8 else ()), P("tp"))
            ok, worst, same_all, eq_unstacked = True, 0.0, True, True
            for j, v in enumerate(layer_vals):
                _, w_l, s_l = per[eff(v)]
                rel, same = rel_and_same(y[:, j], np_gemv(x, w_l, s_l))
                yu = np.asarray(fu(*((x, w_l) + ((s_l,) if fp8 else ()))).astype(jnp.float32))
                eq_unstacked &= np.array_equal(y[0, j], yu[0])
                worst, same_all = max(worst, rel), same_all and same
            custom = hlo_has(fe, a, "jtilert_gemv_all_reduce_stacked")
            no_copy = no_weight_slice(fe, a, (n, k))
            ok = custom and no_copy and same_all and eq_unstacked and worst < 8e-3
            report(ok, f"gemv_all_reduce layer= L={L} N={n} K_local={k} {'fp8' if fp8 else 'bf16'}, layers "
                       f"{layer_vals} in a jitted fori_loop: stacked custom_call={custom} "
                       f"no-weight-slice={no_copy} bit-identical={same_all} "
                       f"equals-unstacked-engine-bitwise={eq_unstacked} max rel-err={worst:.2e}")

    with checking("gemv layer= local"):
        x = jnp.asarray(rng.standard_normal(2048), jnp.bfloat16)
        w3 = jnp.asarray(rng.standard_normal((L, 7168, 2048)) * 0.05, jnp.bfloat16)
        fl = jax.jit(lambda x, w, l: jf.gemv(x, w, layer=l))
        rels = []
        for v in layer_vals:
            y = np.asarray(fl(x, w3, jnp.int32(v)).astype(jnp.float32))
            ref = np_gemv(x, w3[eff(v)], None)
            rels.append(np.linalg.norm(y - ref) / np.linalg.norm(ref))
        custom = hlo_has(fl, (x, w3, jnp.int32(0)), "jtilert_gemv_all_reduce_stacked")
        report(custom and max(rels) < 8e-3, f"gemv (local) layer= L={L} 7168x2048 bf16: custom_call={custom} "
                                             f"max rel-err={max(rels):.2e}")

    for (n, kk, i_loc, e, is_loc, fp8) in ((7168, 8, 256, 16, 256, True), (7168, 8, 256, 16, 256, False),
                                           (1001, 3, 64, 5, 128, False)):
        with checking(f"expert_down_all_reduce layer= N={n} fp8={fp8}"):
            first = ed_case(n, kk, i_loc, e, is_loc, fp8)
            cases = [first]
            for _ in range(L - 1):   # the same activations, every layer its own weights
                c = ed_case(n, kk, i_loc, e, is_loc, fp8)
                cases.append(first[:3] + c[3:5] + first[5:6] + c[6:])
            st = stack_layers(cases)
            fe, a = stacked_fn(lambda l, *c: jf.expert_down_all_reduce(*c, "tp", layer=l), STACKED_EXPERT_DOWN_SPECS,
                               st, layer_vals, n)
            y = np.asarray(fe(*a).astype(jnp.float32))
            fu = expert_down_fn(lambda *c: jf.expert_down_all_reduce(*c, "tp"), fp8)
            worst, same_all, eq_unstacked = 0.0, True, True
            for j, v in enumerate(layer_vals):
                case = cases[eff(v)]
                rel, same = rel_and_same(y[:, j], np_expert_down(*case))
                yu = np.asarray(fu(*(c for c in case if c is not None)).astype(jnp.float32))
                eq_unstacked &= np.array_equal(y[0, j], yu[0])
                worst, same_all = max(worst, rel), same_all and same
            custom = hlo_has(fe, a, "jtilert_expert_down_all_reduce_stacked")
            no_copy = no_weight_slice(fe, a, (e, n, i_loc)) and no_weight_slice(fe, a, (n, is_loc))
            report(custom and no_copy and same_all and eq_unstacked and worst < 8e-3,
                   f"expert_down_all_reduce layer= L={L} N={n} {kk}x[{i_loc}] of E={e} + shared[{is_loc}] "
                   f"{'fp8' if fp8 else 'bf16'}, layers {layer_vals} in a jitted fori_loop: stacked "
                   f"custom_call={custom} no-weight-slice={no_copy} bit-identical={same_all} "
                   f"equals-unstacked-engine-bitwise={eq_unstacked} max rel-err={worst:.2e}")

    # many layer steps in one jitted loop: the layer index changes on the device every iteration
    with checking("stacked layers jitted loop"):
        first = ed_case(7168, 8, 256, 16, 256, True)
        cases = [first] + [first[:3] + c[3:5] + first[5:6] + c[6:]
                           for c in (ed_case(7168, 8, 256, 16, 256, True) for _ in range(L - 1))]
        st = stack_layers(cases)
        w_o = jnp.asarray(rng.standard_normal((L, 7168, 1024 * W)) * 0.05, jnp.bfloat16)
        x_o = jnp.asarray(rng.standard_normal(1024 * W), jnp.bfloat16)

        def layer_loop(x, w, h, wts, ids, down, ds, hs, sd, ss):
            def step(it):
                l = it % L
                hi = h * (1 + it % 5).astype(h.dtype)
                return (jf.expert_down_all_reduce(hi, wts, ids, down, ds, hs, sd, ss, "tp", layer=l),
                        jf.expert_down_reference(hi, wts, ids, down, ds, hs, sd, ss, "tp", layer=l),
                        jf.gemv_all_reduce(x, w, None, "tp", layer=l), jf.gemv_reference(x, w, None, "tp", layer=l))
            return loop_mismatches(step, 999)

        report_loop(smap(layer_loop, (P("tp"), P(None, None, "tp")) + STACKED_EXPERT_DOWN_SPECS, P("tp")),
                    (x_o, w_o, *st), f"999 iterations of stacked expert_down_all_reduce + gemv_all_reduce "
                    f"(layer = it % {L} on the device) in one jitted fori_loop")

    # inside the model: the trained tiny model in bf16 at tp=2, engine on vs psum
    with checking("tiny model engine vs psum"):
        import jtilert
        from flax import nnx
        from jtilert.runtime.generate import Engine
        from jtilert.ops.table import DecodeConfig

        graphdef, state = nnx.split(jtilert.load("tiny"))
        model = nnx.merge(graphdef, jax.tree.map(lambda v: v.astype(jnp.bfloat16), state))
        model.dtype = jnp.dtype(jnp.bfloat16)
        tmesh = jtilert.make_mesh(W, gpus)
        toks = rng.integers(32, 127, 24)
        logits, hlo = {}, ""
        for engine in (True, False):
            eng = Engine(model, mesh=tmesh, config=DecodeConfig(engine_all_reduce=engine))
            cache, out = eng.new_cache(len(toks) + 1), []
            for p_, t_ in enumerate(toks):
                args_ = (eng.state, cache, eng.place(jnp.asarray([t_], jnp.int32)), eng.place(jnp.int32(p_)))
                if engine and p_ == 0:
                    hlo = eng.forward.lower(*args_).as_text()
                lg, _, cache = eng.forward(*args_)
                out.append(np.asarray(lg, np.float32))
            logits[engine] = np.concatenate(out)
        # the layer loops pass the stacked weights and the layer index: the *_stacked targets
        custom = "jtilert_expert_down_all_reduce_stacked" in hlo and "jtilert_gemv_all_reduce_stacked" in hlo
        agree = float(np.mean(logits[True].argmax(-1) == logits[False].argmax(-1)))
        rel = np.linalg.norm(logits[True] - logits[False]) / np.linalg.norm(logits[False])
        report(custom and agree >= 0.9,
               f"tiny model (bf16) tp={W}, {len(toks)} one-token steps, engine vs psum: custom_calls={custom} "
               f"greedy-agreement={agree:.2f} logits rel-diff={rel:.2e}")

    # ---------------- merge_topk --------------------------------------------------
    for (m, k) in ((2048, 2048), (100, 150), (777, 777)):
        sc, idx = sorted_lists(rng, W, m, grain=4, inf_every=13, rank_stride=1_000_000)
        s_j, i_j = jnp.asarray(sc), jnp.asarray(idx)
        fe = smap(per_rank(lambda s, i, k=k: jf.merge_topk(s[0], i[0], "tp", k)),
                  (P("tp"), P("tp")), P("tp"))
        with checking(f"merge_topk m={m} k={k}"):
            os_, oi = (np.asarray(a) for a in fe(s_j, i_j))
            allc = sorted(zip(-sc.ravel(), idx.ravel()))[:k]
            rs = -np.array([a for a, _ in allc], np.float32)
            ri = np.array([b for _, b in allc], np.int32)
            same = all(np.array_equal(os_[0].view(np.uint32), os_[r].view(np.uint32)) and
                       np.array_equal(oi[0], oi[r]) for r in range(W))
            exact = np.array_equal(oi[0], ri) and np.array_equal(os_[0], rs)
            custom = hlo_has(fe, (s_j, i_j), "jtilert_merge_topk")
            report(same and exact and custom,
                   f"merge_topk m={m} k={k}: custom_call={custom} bit-identical={same} exact={exact}")

    # ---------------- exact top-k on one GPU (jtilert.ffi.select) vs lax.top_k -------
    from jtilert.ops import reference
    from jtilert.ops.table import DecodeConfig, Ops

    def score_rows(t, n, kind):
        x = rng.standard_normal((t, n))
        if kind == "ties":
            x = np.round(x * 2) / 2
        elif kind == "zeros":      # +0.0 / -0.0 at the threshold, -inf past a causal limit
            x = rng.choice(np.array([0.0, -0.0, 1.0, -1.0, np.inf]), size=(t, n), p=[.4, .4, .05, .1, .05])
            x[:, n // 3:] = -np.inf
        elif kind == "masked":     # short context in a long cache
            x[:, 100:] = -np.inf
        return jax.device_put(jnp.asarray(x, jnp.float32), gpus[0])

    zs = jax.device_put(jnp.asarray([[-0.0, 0.0, -0.0, 0.0, 1.0]], jnp.float32), gpus[0])
    print("INFO lax.top_k on the GPU, k=4 of [-0.0, +0.0, -0.0, +0.0, 1.0]: indices",
          np.asarray(lax.top_k(zs, 4)[1])[0].tolist(), "(total order of the bits: [4, 1, 3, 0])")
    for (t, n, k, kind) in ((1, 4096, 2048, "normal"), (1, 32768, 2048, "ties"),
                            (1, 131072, 2048, "masked"), (2, 131072, 2048, "ties"),
                            (4, 163840, 2048, "zeros"), (1, 1000, 2048, "normal"),
                            (1, 2048, 2048, "ties"), (8, 9000, 8192, "normal")):
        with checking(f"top_k T={t} N={n} k={k} {kind}"):
            x = score_rows(t, n, kind)
            kk = min(k, n)
            fe = jax.jit(lambda s, k=k: jf.top_k(s, k))
            fu = jax.jit(lambda s, k=k: jf.top_k(s, k, sorted=False))
            rv, ri = (np.asarray(a) for a in jax.jit(lambda s, kk=kk: lax.top_k(s, kk))(x))
            ev, ei = (np.asarray(a) for a in fe(x))
            uv, ui = (np.asarray(a) for a in fu(x))
            exact = np.array_equal(ei, ri) and np.array_equal(ev.view(np.uint32), rv.view(np.uint32))
            order = np.argsort(ri, axis=-1)
            by_index = (np.array_equal(ui, np.take_along_axis(ri, order, -1)) and
                        np.array_equal(uv.view(np.uint32), np.take_along_axis(rv, order, -1).view(np.uint32)))
            fd = jax.jit(lambda s, k=k: Ops(DecodeConfig(backend="pallas"))("topk_positions", s, k))
            di = np.asarray(fd(x))
            li = np.asarray(reference.topk_positions(x, k))
            # the same positions (-1 where the score is -inf), in position order
            drop_in = (np.array_equal(di, np.where(uv > -np.inf, ui, -1))
                       and np.array_equal(np.sort(di, -1), np.sort(li, -1))
                       and hlo_has(fd, (x,), "jtilert_topk_select"))
            custom = hlo_has(fe, (x,), "jtilert_topk_select")
            report(exact and by_index and drop_in and custom,
                   f"top_k T={t} N={n} k={k} {kind}: custom_call={custom} equals-lax.top_k={exact} "
                   f"by-index-mode={by_index} pallas-ops-equals-layers={drop_in} "
                   f"(mismatching indices: {int((ei != ri).sum())})")

    # many calls in one jitted loop (command buffers): the kernel's scratch stays clean
    with checking("top_k jitted loop"):
        x = score_rows(1, 131072, "ties")[0]

        def tk_loop(x):
            def body(it, bad):
                s = jnp.roll(x, it * 977) * (1.0 + (it % 3).astype(jnp.float32))
                v, i = jf.top_k(s, 2048)
                rv, ri = lax.top_k(s, 2048)
                v2, i2 = jf.top_k(s[:40000].reshape(2, 20000), 333, sorted=False)
                rv2, ri2 = lax.top_k(s[:40000].reshape(2, 20000), 333)
                return bad + jnp.sum(i != ri) + jnp.sum(v != rv) + jnp.sum(jnp.sort(i2, -1) != jnp.sort(ri2, -1))
            return lax.fori_loop(0, 1000, body, jnp.zeros((), jnp.int32))

        t0 = time.perf_counter()
        bad = int(jax.jit(tk_loop)(x))
        report(bad == 0, f"1000 iterations of top_k (2 shapes, both modes) in one jitted fori_loop: "
                         f"mismatches={bad} ({time.perf_counter() - t0:.1f} s incl. compile)")

    # split over the 2 GPUs: local top-k of each half + merge_topk
    with checking("split_topk"):
        n, k = 131072, 2048
        for kind in ("normal", "ties", "masked"):
            x = np.asarray(score_rows(1, n, kind))[0]
            xs = jax.device_put(jnp.asarray(x), jax.sharding.NamedSharding(mesh, P("tp")))
            fs = smap(per_rank(lambda s: jf.split_topk(s, k, "tp")), P("tp"), P("tp"))
            sv, si = (np.asarray(a) for a in fs(xs))
            rv, ri = (np.asarray(a) for a in lax.top_k(jnp.asarray(x), k))
            same = all(np.array_equal(sv[0].view(np.uint32), sv[r].view(np.uint32)) and
                       np.array_equal(si[0], si[r]) for r in range(W))
            exact = np.array_equal(si[0], ri) and np.array_equal(sv[0], rv)
            txt = fs.lower(xs).as_text()
            custom = "jtilert_topk_select" in txt and "jtilert_merge_topk" in txt
            report(same and exact and custom,
                   f"split_topk N={n} k={k} {kind} over {W} GPUs: custom_calls={custom} "
                   f"bit-identical={same} equals-one-GPU-lax.top_k={exact}")

    # ---------------- 10,000 calls inside one jitted loop -------------------------
    with checking("jitted loop"):
        n = 7168
        x0 = jnp.asarray(rng.standard_normal((W, n)), jnp.bfloat16)
        wl = jnp.asarray(rng.standard_normal((7168, 2048 * W)) * 0.05, jnp.bfloat16)
        m = 256
        sc = np.sort(rng.standard_normal((W, m)).astype(np.float32), axis=1)[:, ::-1].copy()
        idx = np.stack([r * 10_000 + np.arange(m) for r in range(W)]).astype(np.int32)

        def loop(x, w, s, i):
            x = x[0]

            def body(it, c):
                bad_ar, bad_gemv, bad_topk = c
                xi = x + (it % 7).astype(x.dtype)
                y = jf.all_reduce(xi, "tp")
                yr = lax.psum(xi, "tp")
                bad_ar += jnp.sum(y != yr)
                g = jf.gemv_all_reduce(xi[:2048], w, None, "tp").astype(jnp.float32)
                gr = jf.gemv_reference(xi[:2048], w, None, "tp").astype(jnp.float32)
                bad_gemv += jnp.sum(jnp.abs(g - gr) > 0.02 * jnp.abs(gr) + 0.05)
                ts, ti = jf.merge_topk(s[0] + it.astype(jnp.float32), i[0], "tp", m)
                rs, ri = jf.merge_topk_reference(s[0] + it.astype(jnp.float32), i[0], "tp", m)
                bad_topk += jnp.sum(ti != ri) + jnp.sum(ts != rs)
                return bad_ar, bad_gemv, bad_topk

            z = jnp.zeros((), jnp.int32)
            out = lax.fori_loop(0, args.calls, body, (z, z, z))
            return jax.tree.map(lambda o: o[None], out)

        fl = smap(loop, (P("tp"), P(None, "tp"), P("tp"), P("tp")), P("tp"))
        t0 = time.perf_counter()
        res = [np.asarray(a) for a in fl(x0, wl, jnp.asarray(sc), jnp.asarray(idx))]
        dt = time.perf_counter() - t0
        ok = all(int(a.sum()) == 0 for a in res)
        report(ok, f"{args.calls} iterations of all_reduce + gemv_all_reduce + merge_topk in one "
                   f"jitted fori_loop: mismatches ar={res[0].tolist()} gemv={res[1].tolist()} "
                   f"topk={res[2].tolist()} ({dt:.1f} s incl. compile)")

    # ---------------- many host-dispatched calls ----------------------------------
    with checking("dispatch calls"):
        x = jnp.asarray(rng.standard_normal((W, 7168)), jnp.bfloat16)
        fe = smap(per_rank(lambda v: jf.all_reduce(v[0], "tp")), P("tp"), P("tp"))
        ref = fe(x)
        outs = [fe(x) for _ in range(args.dispatch_calls)]
        ok = all(bool(jnp.array_equal(o, ref)) for o in outs[-50:])
        jax.block_until_ready(outs)
        ok &= all(np.array_equal(np.asarray(o), np.asarray(ref)) for o in outs[::97])
        report(ok, f"{args.dispatch_calls} host-dispatched all_reduce calls: all equal")

    print(f"{'FAILED' if fails else 'OK'}: {len(fails)} failure(s)")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
