"""Check and time the Pallas Mosaic-GPU projection / MoE / lm-head kernels on one GPU (issue 4).

    PYTHONPATH=. python3 bench/kernels.py [--only gemv,moe,lmhead] [--sweep] [--quick]

1. Every kernel against its plain-JAX reference (jtilert.ops.reference) on fresh random inputs, outputs
   poisoned first (the kernels write fresh arrays; a wrong or unwritten element shows in the
   relative error and the NaN count).
2. Times at the dsv32-tp8-shard shapes: device time from CUPTI (sum of the kernels of one op call,
   median over calls), each call on a different copy of the weights so that L2 (60 MB) never holds
   them; against the copy bandwidth measured in the same run (an XLA elementwise pass over 2 GiB,
   bytes read + written) and against XLA's best formulation of the same op.
Logs and a JSON of every number go to $OUT (or ./out); the short table is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode
from jtilert.ops import reference
from jtilert.ops.quant import dequantize, quantize_weight

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "kernels_log.txt"), "a")
RESULTS: dict = {"rows": [], "checks": [], "sweep": [], "errors": []}
L2_BYTES = 60 << 20


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


# ---- timing -------------------------------------------------------------------------------------

def cupti_kernels(f, *args, iterations=5):
    """Per-iteration list of (kernel name, ms) for one call of the jitted f(*args)."""
    from jax.experimental.mosaic.gpu import profiler
    _, timings = profiler.Cupti(finalize=False).measure(f, aggregate=False, iterations=iterations)(*args)
    return timings


def time_op(op, make_args, nbytes, copies=None, iterations=4):
    """Median device µs of one op call. `make_args(i)` builds the i-th independent argument set
    (different weight copies) so consecutive calls stream from HBM, not L2."""
    copies = copies or max(2, min(12, -(-3 * L2_BYTES // max(nbytes, 1))))
    argsets = [make_args(i) for i in range(copies)]

    @jax.jit
    def many(argsets):
        return [op(*a) for a in argsets]

    jax.block_until_ready(many(argsets))
    per_iter = cupti_kernels(many, argsets, iterations=iterations)
    totals = [sum(t for _, t in it) * 1e3 / copies for it in per_iter]
    names = sorted({n for n, _ in per_iter[0]})
    kernels_per_call = len(per_iter[0]) / copies
    per_kernel = {}
    for n, ms in per_iter[len(per_iter) // 2]:
        per_kernel[n[:40]] = per_kernel.get(n[:40], 0.0) + ms * 1e3 / copies
    per_kernel = {n: round(v, 2) for n, v in per_kernel.items()}
    # Wall clock for the same jit (includes launch gaps / host dispatch, amortised over `copies`).
    walls = []
    for _ in range(2):
        t0 = time.perf_counter()
        jax.block_until_ready(many(argsets))
        walls.append((time.perf_counter() - t0) * 1e6 / copies)
    del argsets
    return dict(us=statistics.median(totals), wall_us=statistics.median(walls),
                kernels_per_call=kernels_per_call, kernel_names=names, per_kernel=per_kernel,
                l2_resident_risk=copies * nbytes < 2 * L2_BYTES)


# ---- checks -------------------------------------------------------------------------------------

def rel_err(y, ref):
    y = np.asarray(jnp.asarray(y, F32))
    ref = np.asarray(jnp.asarray(ref, F32))
    nan = int(np.isnan(y).sum())
    return float(np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-30)), nan


def check(name, got, ref, tol):
    err, nan = rel_err(got, ref)
    ok = err < tol and nan == 0
    RESULTS["checks"].append(dict(name=name, rel_err=err, nans=nan, ok=ok))
    log(f"check {name}: rel_err={err:.2e} nans={nan} {'OK' if ok else 'FAIL'}")
    return ok


def rand_weight(key, shape, fmt):
    w = jax.random.normal(key, shape, F32) * shape[-1] ** -0.5
    if fmt == "fp8":
        return quantize_weight(w)
    return w.astype(BF16), None


def weight_bytes(w, s):
    return w.size * w.dtype.itemsize + (0 if s is None else s.size * 4)


# ---- XLA formulations ---------------------------------------------------------------------------

def xla_linear_ref(x, w, s):
    return reference.linear(x, w, s)


def xla_linear_blocks(x, w, s):
    """fp8: per-128-block dots on the upcast weight, scales applied to the fp32 block partials."""
    if s is None:
        return reference.linear(x, w, s)
    n, k = w.shape
    if n % 128 or k % 128:
        return reference.linear(x, w, s)
    t = x.shape[0]
    xb = x.reshape(t, k // 128, 128)
    wb = w.astype(BF16).reshape(n // 128, 128, k // 128, 128)
    part = jnp.einsum("tbk,mnbk->tmnb", xb, wb, preferred_element_type=F32)
    y = jnp.einsum("tmnb,mb->tmn", part, s).reshape(t, n)
    return y.astype(x.dtype)


XLA_LINEAR = {"ref": xla_linear_ref, "blocks": xla_linear_blocks}


# ---- GEMV section -------------------------------------------------------------------------------

@dataclasses.dataclass
class Shape:
    name: str
    n: int
    k: int
    fmt: str = "fp8"
    kind: str = "linear"  # linear | norm | residual | swiglu


GEMV_SHAPES = [
    Shape("q_a+kv_a (rmsnorm)", 1536 + 576, 7168, kind="norm"),
    # the decode model's x_proj (q_a | wk | kv_a, one GEMV) against the three it replaces
    Shape("x_proj = q_a+wk+kv_a", 1536 + 128 + 576, 7168),
    Shape("q_a", 1536, 7168),
    Shape("wk", 128, 7168),
    Shape("kv_a", 576, 7168),
    # the decode model's GEMVs with their norms fused: x_proj after input_layernorm, qr_proj (q_b | the
    # indexer's wq_b, one GEMV) after q_a_layernorm, against the two GEMVs qr_proj replaces
    Shape("x_proj (rmsnorm)", 1536 + 128 + 576, 7168, kind="norm"),
    Shape("qr_proj = q_b+wq_b (rmsnorm)", 16 * 192 + 64 * 128, 1536, kind="norm"),
    Shape("wq_b", 64 * 128, 1536),
    Shape("q_b", 16 * 192, 1536),
    Shape("kv_b", 16 * 256, 512),
    Shape("o (+residual)", 7168, 2048, kind="residual"),
    Shape("dense gate/up (swiglu)", 2304, 7168, kind="swiglu"),
    Shape("dense down (+residual)", 7168, 2304, kind="residual"),
]


def gemv_fns(sh: Shape, cfg=None):
    from jtilert.pallas import gemv
    eps = 1e-6
    if sh.kind == "norm":
        return (lambda x, w, s, nw: gemv.rmsnorm_linear(x, nw, eps, w, s, config=cfg),
                lambda x, w, s, nw: min_xla(lambda f: f(reference.rms_norm(x, nw, eps), w, s)))
    if sh.kind == "residual":
        return (lambda x, w, s, r: gemv.linear_residual(x, w, s, r, config=cfg),
                lambda x, w, s, r: min_xla(lambda f: r + f(x, w, s)))
    if sh.kind == "swiglu":
        return (lambda x, w, s, u, us: gemv.swiglu_pair(x, w, s, u, us, config=cfg),
                lambda x, w, s, u, us: min_xla(lambda f: (jax.nn.silu(f(x, w, s).astype(F32))
                                                          * f(x, u, us).astype(F32)).astype(BF16)))
    return (lambda x, w, s: gemv.linear(x, w, s, config=cfg),
            lambda x, w, s: min_xla(lambda f: f(x, w, s)))


_XLA_CHOICE = {"f": xla_linear_ref}


def min_xla(build):
    return build(_XLA_CHOICE["f"])


def gemv_args(sh: Shape, key, t=1):
    ks = jax.random.split(key, 5)
    x = jax.random.normal(ks[0], (t, sh.k), F32).astype(BF16)
    w, s = rand_weight(ks[1], (sh.n, sh.k), sh.fmt)
    extra = ()
    if sh.kind == "norm":
        extra = ((1 + 0.1 * jax.random.normal(ks[2], (sh.k,))).astype(BF16),)
    elif sh.kind == "residual":
        extra = (jax.random.normal(ks[3], (t, sh.n), F32).astype(BF16),)
    elif sh.kind == "swiglu":
        extra = rand_weight(ks[4], (sh.n, sh.k), sh.fmt)
    return (x, w, s, *extra)


def args_bytes(args):
    return sum(a.size * a.dtype.itemsize for a in args if a is not None)


# The decode step's largest fp8 GEMVs (dsv32-tp8-shard), for the GEMV experiments
DECODE_GEMVS = (("o_proj", 7168, 2048), ("x_proj", 2240, 7168), ("q_b|wq_b", 11264, 1536))


def time_gemv_forms(forms, out, shapes=DECODE_GEMVS, extra=None):
    """Each form fn(x, w, s) of the fp8 GEMV at each shape (T = 1): its relative error against the
    bf16-activation reference, cold and warm µs (`time_op`) and µs per kernel; a form that raises at a
    shape gets its error message instead. `extra(x, w, s, exact)`: more fields for a shape's row. The
    rows are printed as JSON lines as they finish and written to `out` with the device."""
    rows = []
    for name, n, k in shapes:
        sh = Shape(name, n, k)
        key = jax.random.key(11)
        make = lambda i, sh=sh: gemv_args(sh, jax.random.fold_in(key, i))
        x, w, s = make(0)
        exact = np.asarray(reference.linear(x, w, s), np.float64)
        nbytes = args_bytes((x, w, s))
        r = dict(shape=name, n=n, k=k, mb=nbytes / 1e6, errors={}, **(extra(x, w, s, exact) if extra else {}))
        for label, fn in forms.items():
            try:
                got = np.asarray(jax.jit(fn)(x, w, s), np.float64)
            except Exception as e:  # noqa: BLE001 - a form that does not apply at this shape
                r[label] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                continue
            r["errors"][label] = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
            cold = time_op(fn, make, nbytes)
            warm = time_op(fn, make, nbytes, copies=1)
            r[label] = dict(cold_us=cold["us"], warm_us=warm["us"], kernels=cold["per_kernel"])
        print(json.dumps(r), flush=True)
        rows.append(r)
    with open(out, "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)
    return rows


def run_gemv(copy_tbs, sweep, quick):
    from jtilert.pallas import gemv
    key = jax.random.key(1)
    for sh in GEMV_SHAPES:
        make = lambda i, sh=sh: gemv_args(sh, jax.random.fold_in(key, 100 + i))
        nbytes = args_bytes(make(0))
        # correctness at the real shape (T=1 and T=2), then timing
        for t in (1,) if quick else (1, 2):
            args = gemv_args(sh, jax.random.fold_in(key, t), t)
            kfn, xfn = gemv_fns(sh)
            _XLA_CHOICE["f"] = xla_linear_ref
            try:
                check(f"gemv {sh.name} T={t}", jax.jit(kfn)(*args), xfn(*args), 2e-2)
            except Exception as e:  # noqa: BLE001
                RESULTS["errors"].append(f"gemv {sh.name}: {e!r}")
                log(f"ERROR gemv {sh.name} T={t}: {traceback.format_exc()}")
        configs = [None]
        if sweep:
            # Next experiments (see bench/RESULTS.md): deeper TMA pipelines (bytes in flight per SM),
            # fewer/more split-K CTAs, and the CUDA-core engine.
            configs += [gemv.GemvConfig(stages=8), gemv.GemvConfig(stages=8, block_k=128),
                        gemv.GemvConfig(split_k=1, stages=8), gemv.GemvConfig(engine="fma")]
        best = None
        for cfg in configs:
            kfn, _ = gemv_fns(sh, cfg)
            try:
                r = time_op(kfn, make, nbytes)
            except Exception as e:  # noqa: BLE001
                log(f"  skip {sh.name} {cfg}: {str(e).splitlines()[0][:200]}")
                continue
            RESULTS["sweep"].append(dict(op=sh.name, config=str(cfg), **r))
            log(f"  {sh.name} {cfg or 'auto'}: {r['us']:.2f} us ({r['kernels_per_call']:.0f} kernels) {r['per_kernel']}")
            if best is None or r["us"] < best[1]["us"]:
                best = (cfg or "auto", r)
        xla_best = time_xla(sh.name, [(n, lambda *a, f=f, sh=sh: gemv_fns_xla(sh, f)(*a)) for n, f in XLA_LINEAR.items()],
                            make, nbytes)
        add_row(sh.name, nbytes, best, xla_best, copy_tbs)
        dump_json()


def gemv_fns_xla(sh, f):
    _XLA_CHOICE["f"] = f
    return gemv_fns(sh)[1]


def time_xla(name, fns, make, nbytes):
    best = None
    for xname, fn in fns:
        try:
            r = time_op(fn, make, nbytes)
        except Exception as e:  # noqa: BLE001
            log(f"  xla {xname} failed: {str(e).splitlines()[0][:200]}")
            continue
        log(f"  {name} XLA[{xname}]: {r['us']:.2f} us ({r['kernels_per_call']:.0f} kernels)")
        if best is None or r["us"] < best[1]["us"]:
            best = (xname, r)
    return best


# ---- TMA stream probe ---------------------------------------------------------------------------

def stream_probe(w, *, split, stages, block_k, block_n=64):
    """The GEMV kernel's weight stream with no arithmetic: grid (row blocks, split-K), each CTA
    pulling its [block_n, K/split] slab through `emit_pipeline` (same BlockSpecs and swizzle as
    jtilert.pallas.gemv). Its time is what this pipeline structure can stream at all."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    n, k = w.shape
    kc = k // split
    steps = kc // block_k
    swz = min(128, block_k * w.dtype.itemsize)
    tr = (plgpu.TilingTransform((8, swz // w.dtype.itemsize)), plgpu.SwizzleTransform(swz))

    def kernel(w_gmem, o_gmem):
        n_idx, s_idx = jax.lax.axis_index("n"), jax.lax.axis_index("s")
        plgpu.emit_pipeline(lambda idx, w_smem: None, grid=(steps,),
                            in_specs=[plgpu.BlockSpec((block_n, block_k), lambda s: (n_idx, s_idx * steps + s),
                                                      transforms=tr)],
                            max_concurrent_steps=stages)(w_gmem)
        o_gmem[n_idx * split + s_idx] = jnp.float32(1)

    grid = (-(-n // block_n), split)
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((grid[0] * split,), F32), grid=grid,
                        grid_names=("n", "s"), kernel_name="stream_probe")(w)


def run_stream(copy_tbs, sweep, quick):
    """How fast emit_pipeline streams fp8 weights at the GEMV grids: stages × step size × split-K."""
    key = jax.random.key(3)
    for n, k in [(2112, 7168), (7168, 2048), (2304 * 2, 7168)]:
        make = lambda i, n=n, k=k: (jax.random.normal(jax.random.fold_in(key, i), (n, k), F32).astype(FP8),)
        nbytes = n * k
        for split in (1, 4):
            for stages, bk in ((2, 256), (4, 256), (8, 256), (4, 512), (12, 128)):
                if k % (split * bk) or stages * 64 * bk > 200 * 1024:
                    continue
                try:
                    r = time_op(functools.partial(stream_probe, split=split, stages=stages, block_k=bk), make, nbytes)
                except Exception as e:  # noqa: BLE001
                    log(f"  stream {n}x{k} split {split} stages {stages} bk {bk}: {str(e).splitlines()[0][:160]}")
                    continue
                tbs = nbytes / r["us"] / 1e6
                RESULTS["sweep"].append(dict(op=f"stream {n}x{k}", split=split, stages=stages, block_k=bk,
                                             us=r["us"], tbs=tbs))
                log(f"  stream {n}x{k} fp8 split {split} ({-(-n // 64) * split} CTAs) stages {stages} bk {bk}: "
                    f"{r['us']:.2f} us, {tbs:.2f} TB/s = {100 * tbs / copy_tbs:.0f} % of copy")


# ---- MoE section --------------------------------------------------------------------------------

def moe_args(key, t=1, e=256, width=256, hidden=7168, k=8):
    ks = jax.random.split(key, 8)
    x = jax.random.normal(ks[0], (t, hidden), F32).astype(BF16)
    ids = jnp.stack([jax.random.permutation(jax.random.fold_in(ks[1], i), e)[:k] for i in range(t)]).astype(jnp.int32)
    w = jax.random.uniform(ks[2], (t, k), minval=0.1, maxval=1.0)
    g, gs = rand_weight(ks[3], (e, width, hidden), "fp8")
    u, us = rand_weight(ks[4], (e, width, hidden), "fp8")
    d, ds = rand_weight(ks[5], (e, hidden, width), "fp8")
    return x, w, ids, g, gs, u, us, d, ds


def run_moe(copy_tbs, sweep, quick):
    from jtilert.ffi import route as ffi_route
    from jtilert.pallas import moe
    from jtilert.model.presets import DSV32_TP8_SHARD as cfg
    key = jax.random.key(7)
    # Expert weight sets are big (256 experts × 3 × 1.8 MB = 1.4 GB): build 2 and vary the ids.
    base = moe_args(key)
    for t in (1,) if quick else (1, 2):
        a = moe_args(jax.random.fold_in(key, t), t=t)
        x, w, ids = a[:3]
        try:
            check(f"moe experts T={t}", jax.jit(moe.moe_experts)(*a), reference.moe_experts(*a), 2e-2)
            h = jax.jit(moe.expert_gate_up)(x, ids, *a[3:7])
            dense_h = jax.nn.silu(jnp.einsum("th,tkih->tki", x.astype(F32), dequantize(a[3][ids], a[4][ids], F32)))
            dense_h = (dense_h * jnp.einsum("th,tkih->tki", x.astype(F32), dequantize(a[5][ids], a[6][ids], F32)))
            check(f"moe gate/up T={t}", h, dense_h.reshape(h.shape).astype(BF16), 2e-2)
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"moe: {e!r}")
            log(f"ERROR moe T={t}: {traceback.format_exc()}")
    g, gs, u, us, d, ds = base[3:]

    n_e, width, hidden = g.shape

    def make(i):
        kk = jax.random.fold_in(key, 500 + i)
        x = jax.random.normal(kk, (1, hidden), F32).astype(BF16)
        ids = jax.random.permutation(kk, n_e)[:8].astype(jnp.int32)[None]   # distinct experts per call
        w = jax.random.uniform(kk, (1, 8), minval=0.1, maxval=1.0)
        h = jax.random.normal(kk, (8, width), F32).astype(BF16)
        return x, w, ids, h

    gu_bytes = 8 * 2 * (g[0].size + gs[0].size * 4) + hidden * 2
    dn_bytes = 8 * (d[0].size + ds[0].size * 4) + 8 * width * 2
    rows = [
        ("experts gate/up (8, swiglu)", gu_bytes,
         lambda x, w, ids, h: moe.expert_gate_up(x, ids, g, gs, u, us),
         [("gather+dot", lambda x, w, ids, h: xla_moe_gate_up(x, ids, g, gs, u, us))]),
        ("experts down (8, weighted)", dn_bytes,
         lambda x, w, ids, h: moe.expert_down(h, w, ids, d, ds),
         [("gather+dot", lambda x, w, ids, h: xla_moe_down(h, w, ids, d, ds))]),
        ("moe experts (both kernels)", gu_bytes + dn_bytes,
         lambda x, w, ids, h: moe.moe_experts(x, w, ids, g, gs, u, us, d, ds),
         [("reference", lambda x, w, ids, h: reference.moe_experts(x, w, ids, g, gs, u, us, d, ds))]),
    ]
    for name, nbytes, kfn, xfns in rows:
        try:
            r = time_op(kfn, make, nbytes, copies=12)
            log(f"  {name}: {r['us']:.2f} us ({r['kernels_per_call']:.0f} kernels) {r['per_kernel']}")
            xb = time_xla(name, xfns, make, nbytes)
            add_row(name, nbytes, ("auto", r), xb, copy_tbs)
        except Exception as e:  # noqa: BLE001
            RESULTS["errors"].append(f"moe timing {name}: {e!r}")
            log(f"ERROR moe timing {name}: {traceback.format_exc()}")
        dump_json()
    # router: fp32 logits (7.3 MB) + selection
    gate = jax.random.normal(key, (256, 7168), F32) * 7168 ** -0.5
    bias = 0.1 * jax.random.normal(key, (256,), F32)
    try:
        xr = jax.random.normal(key, (1, 7168), F32).astype(BF16)
        wk, ik = jax.jit(lambda x: moe.route(cfg, x, gate, bias))(xr)
        wr, ir = reference.route(cfg, xr, gate, bias)
        ok = bool((ik == ir).all())
        RESULTS["checks"].append(dict(name="router ids", ok=ok, rel_err=0.0, nans=0))
        log(f"check router ids equal: {ok}")
        gates = [jax.random.normal(jax.random.fold_in(key, i), (256, 7168), F32) for i in range(8)]
        mk = lambda i: (jax.random.normal(jax.random.fold_in(key, 900 + i), (1, 7168), F32).astype(BF16), gates[i % 8])
        nbytes = 256 * 7168 * 4
        r = time_op(lambda x, g_: ffi_route.logits_of(moe.router_partials(x, g_)), mk, nbytes, copies=8)
        log(f"  router logits fp32: {r['us']:.2f} us {r['per_kernel']}")
        xb = time_xla("router logits", [("f32 dot", lambda x, g_: jnp.einsum("th,eh->te", x.astype(F32), g_))], mk, nbytes)
        add_row("router logits (fp32 W)", nbytes, ("fma", r), xb, copy_tbs)
    except Exception as e:  # noqa: BLE001
        RESULTS["errors"].append(f"router: {e!r}")
        log(f"ERROR router: {traceback.format_exc()}")
    dump_json()


def xla_moe_gate_up(x, ids, g, gs, u, us):
    sel = ids.reshape(-1)
    gd = dequantize(g[sel], gs[sel], BF16)
    ud = dequantize(u[sel], us[sel], BF16)
    a = jnp.einsum("h,nih->ni", x[0], gd, preferred_element_type=F32)
    b = jnp.einsum("h,nih->ni", x[0], ud, preferred_element_type=F32)
    return (jax.nn.silu(a) * b).astype(BF16)


def xla_moe_down(h, w, ids, d, ds):
    sel = ids.reshape(-1)
    dd = dequantize(d[sel], ds[sel], BF16)
    y = jnp.einsum("ni,nhi->nh", h, dd, preferred_element_type=F32)
    return jnp.einsum("n,nh->h", w[0], y).astype(BF16)[None]


# ---- lm head section ----------------------------------------------------------------------------

def run_lmhead(copy_tbs, sweep, quick):
    from jtilert.pallas import lm_head
    key = jax.random.key(11)
    v, hdim = 129280 // 8, 7168
    ws = [(jax.random.normal(jax.random.fold_in(key, i), (v, hdim), F32) * hdim ** -0.5).astype(BF16) for i in range(2)]
    x = jax.random.normal(key, (1, hdim), F32).astype(BF16)
    try:
        vals, ids = jax.jit(lambda x, w: lm_head.lm_head_topk(x, w, k=8))(x, ws[0])
        rv, ri = lm_head.reference_topk(x, ws[0], k=8)
        ok = bool((ids == ri).all())
        check("lm head top-8 values", vals, rv, 1e-3)
        RESULTS["checks"].append(dict(name="lm head top-8 ids", ok=ok, rel_err=0.0, nans=0))
        log(f"check lm head ids equal: {ok}")
    except Exception as e:  # noqa: BLE001
        RESULTS["errors"].append(f"lm head: {e!r}")
        log(f"ERROR lm head: {traceback.format_exc()}")
    mk = lambda i: (jax.random.normal(jax.random.fold_in(key, 50 + i), (1, hdim), F32).astype(BF16), ws[i % 2])
    nbytes = v * hdim * 2
    try:
        r = time_op(lambda x, w: lm_head.lm_head_topk(x, w, k=8), mk, nbytes, copies=2)
        log(f"  lm head top-8: {r['us']:.2f} us {r['per_kernel']}")
        xb = time_xla("lm head", [("dot+top_k", lambda x, w: lax_topk(x, w))], mk, nbytes)
        add_row("lm head 7168->16160 +top8", nbytes, ("auto", r), xb, copy_tbs)
    except Exception as e:  # noqa: BLE001
        RESULTS["errors"].append(f"lm head timing: {e!r}")
        log(f"ERROR lm head timing: {traceback.format_exc()}")
    dump_json()


def lax_topk(x, w):
    logits = jnp.einsum("th,vh->tv", x, w, preferred_element_type=F32)
    return jax.lax.top_k(logits, 8)


def dump_json():
    with open(os.path.join(OUT, "kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def add_row(name, nbytes, best, xla_best, copy_tbs):
    if best is None:
        log(f"ROW {name}: no kernel timing")
        return
    cfg, r = best
    tbs = nbytes / (r["us"] * 1e-6) / 1e12
    row = dict(op=name, mbytes=nbytes / 1e6, us=r["us"], tbs=tbs, frac_copy=tbs / copy_tbs,
               kernels=r["kernels_per_call"], config=str(cfg), wall_us=r["wall_us"],
               l2_risk=r.get("l2_resident_risk", False), per_kernel=r.get("per_kernel"))
    if xla_best is not None:
        row.update(xla=xla_best[0], xla_us=xla_best[1]["us"], speedup=xla_best[1]["us"] / r["us"])
    RESULTS["rows"].append(row)
    log(f"ROW {name}: {nbytes / 1e6:.2f} MB {r['us']:.2f} us {tbs:.2f} TB/s = {100 * tbs / copy_tbs:.1f}% of copy; "
        f"XLA {row.get('xla_us', float('nan')):.2f} us ({row.get('xla')}) -> x{row.get('speedup', float('nan')):.2f}")


def print_table(copy_tbs):
    log("")
    log(f"copy bandwidth (XLA elementwise, 2 GiB read+write): {copy_tbs:.2f} TB/s")
    log(f"{'op':30s} {'MB':>7s} {'us':>7s} {'TB/s':>6s} {'%copy':>6s} {'XLA us':>7s} {'xXLA':>5s} {'k':>3s}  config")
    for r in RESULTS["rows"]:
        cfg = r["config"] if len(r["config"]) < 20 else "cfg"
        log(f"{r['op'][:30]:30s} {r['mbytes']:7.2f} {r['us']:7.2f} {r['tbs']:6.2f} {100 * r['frac_copy']:5.1f}% "
            f"{r.get('xla_us', float('nan')):7.2f} {r.get('speedup', float('nan')):5.2f} {r['kernels']:3.0f}  "
            f"{cfg}{' L2?' if r.get('l2_risk') else ''}")
    bad = [c for c in RESULTS["checks"] if not c["ok"]]
    log(f"checks: {len(RESULTS['checks']) - len(bad)}/{len(RESULTS['checks'])} OK"
        + ("" if not bad else "; FAILED: " + ", ".join(c["name"] for c in bad)))
    if RESULTS["errors"]:
        log(f"errors: {len(RESULTS['errors'])} (see kernels_log.txt)")


def dump_kernels():
    """Compile representative kernels with Mosaic's dump switches on; tar the dumps into $OUT."""
    import subprocess
    import tarfile
    from jtilert.pallas import gemv
    d = os.path.join(OUT, "dump")
    os.makedirs(d, exist_ok=True)
    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTX="1",
                      MOSAIC_GPU_DUMP_TO=d)
    args = gemv_args(Shape("dump", 2112, 7168), jax.random.key(0))
    for eng in ("wgmma",):
        cfg = gemv.GemvConfig(engine=eng)
        try:
            jax.block_until_ready(jax.jit(lambda x, w, s: gemv.linear(x, w, s, config=cfg))(*args))
        except Exception as e:  # noqa: BLE001
            log(f"dump {eng} failed: {e!r}")
    for k in ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS", "MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_TO"):
        os.environ.pop(k, None)
    with tarfile.open(os.path.join(OUT, "dump.tgz"), "w:gz") as tf:
        tf.add(d, arcname="dump")
    subprocess.run(["rm", "-rf", d])
    log(f"dumped kernels to {OUT}/dump.tgz")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="gemv,moe,lmhead", help="sections: stream,gemv,moe,lmhead")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dump", action="store_true", help="ptxas report + SASS of representative kernels to $OUT")
    a = ap.parse_args()
    only = set(a.only.split(","))
    log(f"== bench/kernels.py {time.strftime('%Y-%m-%d %H:%M:%S')} jax {jax.__version__} "
        f"devices {jax.devices()} args {sys.argv[1:]}")
    if a.dump:
        dump_kernels()
    copy_tbs = decode.copy_bandwidth() / 1e12   # TB/s, bytes read + written
    RESULTS["copy_tbs"] = copy_tbs
    log(f"copy bandwidth: {copy_tbs:.3f} TB/s")
    for name, fn in SECTIONS:
        if name in only:
            try:
                fn(copy_tbs, a.sweep, a.quick)
            except Exception as e:  # noqa: BLE001
                RESULTS["errors"].append(f"{name}: {e!r}")
                log(f"ERROR section {name}: {traceback.format_exc()}")
    print_table(copy_tbs)
    dump_json()


# MoE and lm head first: they have never been timed on a GPU, and a sweep can run out of time.
SECTIONS = [("stream", run_stream), ("moe", run_moe), ("lmhead", run_lmhead), ("gemv", run_gemv)]

if __name__ == "__main__":
    main()
