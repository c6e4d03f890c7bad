"""CPU tests of the CUDA engine (issue 6): it compiles, its task tables are right, and every
function falls back to the XLA path (equal to psum / the reference) on 8 host devices.

The GPU side (the kernels running on 2 GPUs, compute-sanitizer, timings) is in tests/gpu/.
"""

from __future__ import annotations

import ctypes
import math
import os
import pathlib
import re
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jtilert.ffi as jf
from jtilert.ops import reference
from jtilert.ops.layer import Layer
from jtilert.ffi import moe
from jtilert.ffi import ops as ffi_ops
from jtilert.ffi import plan as ffi_plan

from ffi_inputs import (EXPERT_DOWN_SPECS, STACKED_EXPERT_DOWN_SPECS, expert_down_case, fp8_weights,
                        np_expert_down, np_gemv, sorted_lists, stack_layers)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def _mesh(n=8):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} host devices (tests/conftest.py sets XLA_FLAGS); have {jax.device_count()}")
    return Mesh(np.array(jax.devices()[:n]), ("tp",))


# ------------------------------------------------------------------ the CUDA sources compile

@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA sources cannot be compiled here")
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not found")
def test_cuda_sources_compile_warnings_as_errors():
    """cmake + nvcc build of cuda/ (library and self-test; CMakeLists.txt sets -Werror for nvcc, ptxas and
    g++), into the build directory the package uses, which is keyed by the sources: the suite's later
    uses of the library (the H200 compiles) find it there instead of building it again."""
    import importlib  # noqa: PLC0415

    ffi_build = importlib.import_module("jtilert.ffi.build")
    lib = ffi_build.build(selftest=True)   # raises with the compiler's output where it fails
    assert "-Werror" in (ROOT / "cuda" / "CMakeLists.txt").read_text()
    assert lib == ffi_build.default_build_dir() / ffi_build.LIB_NAME
    assert lib.is_file() and (lib.parent / "jtilert_selftest").is_file() and ffi_build.find_library() == lib
    # the library exports its C API and the three FFI handlers, and keeps cudart private
    nm = shutil.which("nm")
    if nm:
        syms = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
        for s in ("JtAllReduce", "JtGemvAllReduce", "JtMergeTopk", "JtExpertDownAllReduce", "jt_group_create",
                  "jt_all_reduce", "jt_expert_down_all_reduce", "JtGemvAllReduceStacked",
                  "JtExpertDownAllReduceStacked", "jt_gemv_all_reduce_layer", "jt_expert_down_all_reduce_layer",
                  "JtRouteSelect", "jt_route_select", "JtNormRoute", "jt_norm_route"):
            assert f" {s}\n" in syms, s
        assert " cudaMalloc\n" not in syms
    # the C and the Python side take the same MoE shapes (moe_decode checks in Python, ffi.cc in C)
    c = ctypes.CDLL(str(lib))
    c.jt_moe_unsupported.restype = ctypes.c_char_p
    shapes = [(h, i, k) for h in (512, 576, 640, 1024, 6144, 7168, 8192, 8320) for i in (128, 256, 384, 512, 768, 1024, 1152)
              for k in (0, 1, 2, 3, 7, 8, 11, 12)]
    differ = [s for s in shapes if (c.jt_moe_unsupported(*s) is None) != (moe.shape_unsupported(*s) is None)]
    assert not differ, differ
    assert c.jt_moe_unsupported(7168, 256, 8) is None and c.jt_moe_unsupported(7168, 768, 3) is not None


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA sources cannot be compiled here")
def test_gemv_chain_experiment_compiles_warnings_as_errors(tmp_path):
    """bench/experiments/gemv_chain.cu (GPU part `chain`) builds as the session script builds it."""
    r = subprocess.run([_nvcc(), "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Werror=all-warnings",
                        "-Xcompiler=-Wall,-Wextra,-Werror", str(ROOT / "bench" / "experiments" / "gemv_chain.cu"),
                        "-o", str(tmp_path / "gemv_chain")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]


def test_no_multicast_anywhere():
    """NVLink multicast can take a shared host's GPUs down: it must never appear in the engine."""
    banned = ("multimem", "cuMulticast", "multicast_ref", "NVLS", "cudaMulticast")
    for p in list((ROOT / "cuda").rglob("*")) + list((ROOT / "jtilert" / "ffi").rglob("*.py")):
        if p.is_file() and p.suffix in {".cu", ".cuh", ".cc", ".h", ".py", ".txt"}:
            text = p.read_text()
            for b in banned:
                assert b not in text, f"{b} in {p}"


# ------------------------------------------------------------------ task tables

SHAPES = [  # (N, K_local, wdtype): dsv32-tp8-shard o_proj, expert down (1 expert, 8+1 experts), misc
    (7168, 2048, "bf16"), (7168, 2048, "fp8"), (7168, 256, "bf16"), (7168, 256, "fp8"),
    (7168, 2304, "bf16"), (7168, 2304, "fp8"), (6144, 4096, "fp8"), (1001, 512, "bf16"),
    (1, 16, "fp8"), (129, 128, "bf16"), (7168, 18432, "bf16"),
    (7168, 9 * 128, "fp8"), (7168, 9 * 128, "bf16"),  # expert down + shared, dsv32-tp8-shard at tp=2
]


@pytest.mark.parametrize("n,k,wd", SHAPES)
@pytest.mark.parametrize("sms", [132, 114, 16, 1])
def test_plan_covers_every_tile_once_and_balances(n, k, wd, sms):
    plan = ffi_plan.build_gemv_plan(n, k, wdtype=wd, num_sms=sms)
    ffi_plan.check_gemv_plan(plan, num_sms=sms, world=8)
    # no CTA has more than one tile more than another, and no fewer CTAs than needed
    per = [len(plan.cta_tasks(c)) for c in range(plan.num_ctas)]
    assert max(per) - min(per) <= 1
    assert max(per) == math.ceil(plan.num_tiles / min(sms, plan.num_tiles))
    # the kernel keeps ~8 16-byte loads per lane in flight
    chunks = k // ffi_plan.ELEMS_PER_CHUNK[wd]
    assert plan.rpw * min(max(1, math.ceil(chunks / 32)), 8) >= 8 or plan.rpw == 8


@pytest.mark.parametrize("nwc", [1, 2, 4, 8, 16])
def test_plan_explicit_warps(nwc):
    rpw = 2 if nwc % 2 else 1
    plan = ffi_plan.build_gemv_plan(7168, 2048, num_sms=132, nwc=nwc, rpw=rpw)
    ffi_plan.check_gemv_plan(plan, num_sms=132)
    assert plan.tile_rows == nwc * rpw


def test_plan_checker_catches_bad_tables():
    plan = ffi_plan.build_gemv_plan(1000, 256, num_sms=8)
    t = plan.table.copy()
    t[-1] = t[-2]  # a tile twice, one missing
    with pytest.raises(AssertionError):
        ffi_plan.check_gemv_plan(ffi_plan.GemvPlan(**{**plan.__dict__, "table": t}))
    with pytest.raises(ValueError):
        ffi_plan.build_gemv_plan(100, 100, wdtype="fp8")  # K not a multiple of 16
    with pytest.raises(ValueError):
        ffi_plan.build_gemv_plan(100, 128, nwc=3, rpw=1)  # odd tile


def test_build_dir_is_keyed_by_the_sources_and_their_folder(tmp_path, monkeypatch):
    """A copy of cuda/ elsewhere (gpu_session's patched trees) gets a build directory of its own: CMake
    refuses a build directory made from another source folder. An unchanged folder keeps its directory,
    and an edited source moves it."""
    import importlib  # noqa: PLC0415

    ffi_build = importlib.import_module("jtilert.ffi.build")  # the package's `build` is the function

    monkeypatch.setenv("JTILERT_FFI_CACHE", str(tmp_path / "cache"))
    src = ffi_build.source_dir()
    copy = tmp_path / "copy" / "cuda"
    shutil.copytree(src, copy)
    assert ffi_build.default_build_dir(src) == ffi_build.default_build_dir(src)
    assert ffi_build.default_build_dir(copy) != ffi_build.default_build_dir(src)
    before = ffi_build.default_build_dir(copy)
    (copy / "src" / "select.cu").write_text((copy / "src" / "select.cu").read_text() + "\n// edited\n")
    assert ffi_build.default_build_dir(copy) != before


def test_a_library_is_found_only_once_its_build_has_ended(tmp_path, monkeypatch):
    """Processes share the cache's build directory: one that looks while another links must neither load
    the half-written library ("file too short") nor give up. `find_library` waits for the build's lock and
    trusts only a library marked built; a build that fails (or is killed) leaves no mark."""
    import importlib  # noqa: PLC0415
    import threading  # noqa: PLC0415

    ffi_build = importlib.import_module("jtilert.ffi.build")
    monkeypatch.setenv("JTILERT_FFI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("JTILERT_FFI_LIB", raising=False)
    d = ffi_build.default_build_dir()
    assert ffi_build.find_library() is None  # nothing built yet
    d.mkdir(parents=True)
    (d / ffi_build.LIB_NAME).write_bytes(b"\x7fELF")  # a link cut short
    assert ffi_build.find_library() is None

    found = []
    with ffi_build._lock(ffi_build._lock_path(d)):  # a build in progress
        looker = threading.Thread(target=lambda: found.append(ffi_build.find_library()))
        looker.start()
        looker.join(0.5)
        assert looker.is_alive(), "find_library did not wait for the build in progress"
        (d / ffi_build.BUILT).touch()
    looker.join(10)
    assert found == [d / ffi_build.LIB_NAME]

    class Failed:
        returncode, stdout = 1, "nvcc: error"

    monkeypatch.setattr(ffi_build.subprocess, "run", lambda *a, **k: Failed())
    monkeypatch.setattr(ffi_build, "source_dir", lambda: ROOT / "cuda")
    with pytest.raises(RuntimeError, match="failed"):
        ffi_build.build()
    assert not (d / ffi_build.BUILT).exists() and ffi_build.find_library() is None


# ------------------------------------------------------------------ fallbacks on 8 CPU devices

def test_available_is_false_without_gpu():
    assert not jf.available()
    assert jf.unavailable_reason()


def _smap(mesh, f, in_specs, out_specs, check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma))


@pytest.mark.parametrize("check_vma", [True, False])
def test_all_reduce_fallback_equals_psum(check_vma):
    mesh = _mesh()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 7168)), jnp.bfloat16)
    ours = _smap(mesh, lambda v: jf.all_reduce(v, "tp"), P("tp"), P(), check_vma)(x)
    ref = _smap(mesh, lambda v: lax.psum(v, "tp"), P("tp"), P(), check_vma)(x)
    np.testing.assert_array_equal(np.asarray(ours.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))


def test_fallback_warns_exactly_once():
    mesh = _mesh()
    from jtilert.ffi import _lib
    _lib._warned.clear()  # noqa: SLF001
    x = jnp.ones((8, 64), jnp.float32)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for n in (64, 32, 16):
            _smap(mesh, lambda v: jf.all_reduce(jf.all_reduce(v, "tp"), "tp"), P("tp"), P())(x[:, :n])
    msgs = [str(w.message) for w in rec if "jtilert.ffi" in str(w.message)]
    assert len(msgs) == 1, msgs


def test_model_all_reduce_with_engine_flag_equals_psum():
    """Through the model's single all-reduce (jtilert.ops.table.Ops.all_reduce) with the engine on."""
    from jtilert.ops.table import DecodeConfig, Ops
    mesh = _mesh()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8 * 3, 7168)), jnp.float32)

    def step(v, engine):
        return Ops(DecodeConfig(engine_all_reduce=engine), "tp").all_reduce(v)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = _smap(mesh, lambda v: step(v, True), P("tp"), P(), False)(x)
    ref = _smap(mesh, lambda v: step(v, False), P("tp"), P(), False)(x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(ref))


@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_all_reduce_fallback_equals_reference(fp8):
    mesh = _mesh()
    rng = np.random.default_rng(2)
    n, k_local = 300, 256
    x = jnp.asarray(rng.standard_normal(8 * k_local), jnp.bfloat16)
    if fp8:
        w, s = fp8_weights(rng, n, 8 * k_local)
        f = _smap(mesh, lambda x, w, s: jf.gemv_all_reduce(x, w, s, "tp"),
                  (P("tp"), P(None, "tp"), P(None, "tp")), P())
        y = f(x, w, s)
    else:
        w, s = jnp.asarray(rng.standard_normal((n, 8 * k_local)) * 0.05, jnp.bfloat16), None
        y = _smap(mesh, lambda x, w: jf.gemv_all_reduce(x, w, None, "tp"), (P("tp"), P(None, "tp")), P())(x, w)
    assert y.shape == (n,) and y.dtype == jnp.bfloat16
    ref = np_gemv(x, w, s)
    rel = np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref)
    assert rel < 5e-3, rel
    # the local GEMV fallback equals a single-device reference
    y1 = jf.gemv(x[:k_local], w[:, :k_local], None if s is None else s[:, :k_local // 128])
    ref1 = np_gemv(x[:k_local], w[:, :k_local], None if s is None else s[:, :k_local // 128])
    assert np.linalg.norm(np.asarray(y1, np.float64) - ref1) / np.linalg.norm(ref1) < 5e-3


def _expert_down_case(rng, fp8):
    return expert_down_case(rng, fp8, world=8, e=6, n=300, k=3, i_loc=128 if fp8 else 16,
                            is_loc=128 if fp8 else 16)


@pytest.mark.parametrize("fp8", [False, True])
def test_expert_down_all_reduce_fallback_equals_the_unfused_path(fp8):
    """The fallback is psum(routed experts' weighted down projections + the shared expert's), rounded
    like jtilert.ops.reference (moe_experts' second half + swiglu's down), and matches the fp64 math."""
    mesh = _mesh()
    args = _expert_down_case(np.random.default_rng(6), fp8)
    h, wts, ids, down, ds, hs, sd, ss = args

    def fused(h, wts, ids, down, ds, hs, sd, ss):
        return jf.expert_down_all_reduce(h, wts, ids, down, ds, hs, sd, ss, "tp")

    def unfused(h, wts, ids, down, ds, hs, sd, ss):
        routed = reference.expert_down(h, wts[None], ids[None], down, ds)
        return lax.psum(routed + reference.linear(hs[None], sd, ss), "tp")[0]

    if not fp8:  # no scales: drop them from the argument lists
        f_ = lambda h, w, i, d, hs, sd: fused(h, w, i, d, None, hs, sd, None)  # noqa: E731
        u_ = lambda h, w, i, d, hs, sd: unfused(h, w, i, d, None, hs, sd, None)  # noqa: E731
        specs, a = EXPERT_DOWN_SPECS[:4] + EXPERT_DOWN_SPECS[5:7], (h, wts, ids, down, hs, sd)
    else:
        f_, u_, specs, a = fused, unfused, EXPERT_DOWN_SPECS, args
    y = _smap(mesh, f_, specs, P())(*a)
    assert y.shape == (down.shape[1],) and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(_smap(mesh, u_, specs, P())(*a), np.float32))
    ref = np_expert_down(*args)
    assert np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref) < 5e-3


# ------------------------------------------------------------------ stacked layers (layer=)

LAYERS = 3


def _stacked_gemv_case(rng, fp8, n=300, k=8 * 256):
    """x [k] and every layer's w [L, n, k] (+ scales [L, ...] for fp8); different weights per layer."""
    x = jnp.asarray(rng.standard_normal(k), jnp.bfloat16)
    if fp8:
        per = [(x,) + fp8_weights(rng, n, k) for _ in range(LAYERS)]
    else:
        per = [(x, jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16), None) for _ in range(LAYERS)]
    return stack_layers(per)


@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_stacked_fallback_equals_reference(fp8):
    """layer= with stacked [L, N, K] weights and a traced layer (the loop index of lax.map inside the
    jitted shard_map): every layer's result equals the fp64 reference of that layer's weights and the
    unstacked op on w[l] bit for bit; a negative layer counts from the end like w[layer]."""
    mesh = _mesh()
    x, w, s = _stacked_gemv_case(np.random.default_rng(8), fp8)
    specs = (P("tp"), P(None, None, "tp")) + ((P(None, None, "tp"),) if fp8 else ())

    def stacked(x, w, *s):
        return lax.map(lambda l: jf.gemv_all_reduce(x, w, s[0] if s else None, "tp", layer=l),
                       jnp.arange(-1, LAYERS, dtype=jnp.int32))

    def per_layer(x, w, *s):
        return jnp.stack([jf.gemv_all_reduce(x, w[l], s[0][l] if s else None, "tp") for l in range(LAYERS)])

    a = (x, w) + ((s,) if fp8 else ())
    ys = np.asarray(_smap(mesh, stacked, specs, P())(*a), np.float32)
    np.testing.assert_array_equal(ys[1:], np.asarray(_smap(mesh, per_layer, specs, P())(*a), np.float32))
    np.testing.assert_array_equal(ys[0], ys[LAYERS])  # layer -1: the last one
    for l in range(LAYERS):
        ref = np_gemv(x, w[l], None if s is None else s[l])
        assert np.linalg.norm(ys[l + 1] - ref) / np.linalg.norm(ref) < 5e-3, l
    assert len({ys[l + 1].tobytes() for l in range(LAYERS)}) == LAYERS  # the layers differ
    # the local GEMV with a traced layer (jit argument)
    k_loc = x.shape[0] // 8
    s_loc = None if s is None else s[:, :, :k_loc // 128]
    y1 = jax.jit(lambda x, w, s, l: jf.gemv(x, w, s, layer=l))(x[:k_loc], w[:, :, :k_loc], s_loc, jnp.int32(2))
    ref1 = np_gemv(x[:k_loc], w[2, :, :k_loc], None if s is None else s_loc[2])
    assert np.linalg.norm(np.asarray(y1, np.float64) - ref1) / np.linalg.norm(ref1) < 5e-3


def _stacked_expert_down_cases(rng, fp8):
    """LAYERS expert-down cases with the same activations (h, wts, ids, hs) and their own weights."""
    first = _expert_down_case(rng, fp8)
    cases = [first]
    for _ in range(LAYERS - 1):
        c = _expert_down_case(rng, fp8)
        cases.append(first[:3] + c[3:5] + first[5:6] + c[6:])
    return cases


@pytest.mark.parametrize("fp8", [False, True])
def test_expert_down_stacked_fallback_equals_reference(fp8):
    """layer= with down [L, E, N, I], shared_down [L, N, Is] (and scales): under a lax.scan over the
    layers (traced index), every layer's result equals the unstacked op on its slices bit for bit and
    the fp64 reference of its weights."""
    mesh = _mesh()
    rng = np.random.default_rng(9)
    cases = _stacked_expert_down_cases(rng, fp8)
    first, st = cases[0], stack_layers(cases)
    keep = [i for i, a in enumerate(st) if a is not None]
    specs = tuple(STACKED_EXPERT_DOWN_SPECS[i] for i in keep)

    def full(args):
        out = [None] * 8
        for i, a in zip(keep, args):
            out[i] = a
        return out

    def stacked(*args):
        h, wts, ids, down, ds, hs, sd, ss = full(args)
        def body(c, l):
            return c, jf.expert_down_all_reduce(h, wts, ids, down, ds, hs, sd, ss, "tp", layer=l)
        return lax.scan(body, 0, jnp.arange(LAYERS, dtype=jnp.int32))[1]

    def per_layer(*args):
        h, wts, ids, down, ds, hs, sd, ss = full(args)
        at = lambda a, l: None if a is None else a[l]  # noqa: E731
        return jnp.stack([jf.expert_down_all_reduce(h, wts, ids, down[l], at(ds, l), hs, sd[l], at(ss, l), "tp")
                          for l in range(LAYERS)])

    a = [st[i] for i in keep]
    ys = np.asarray(_smap(mesh, stacked, specs, P())(*a), np.float32)
    assert ys.shape == (LAYERS, first[3].shape[1])
    np.testing.assert_array_equal(ys, np.asarray(_smap(mesh, per_layer, specs, P())(*a), np.float32))
    for l, case in enumerate(cases):
        ref = np_expert_down(*case)
        assert np.linalg.norm(ys[l] - ref) / np.linalg.norm(ref) < 5e-3, l
    assert len({y.tobytes() for y in ys}) == LAYERS


def test_stacked_argument_errors():
    x = jnp.ones(256, jnp.bfloat16)
    w = jnp.ones((300, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="stacked"):
        jf.gemv(x, w, layer=0)  # w not stacked
    with pytest.raises(ValueError, match="integer scalar"):
        jf.gemv(x, w[None], layer=0.5)
    with pytest.raises(ValueError, match="integer scalar"):
        jf.gemv(x, w[None], layer=jnp.zeros(2, jnp.int32))
    w8, s8 = fp8_weights(np.random.default_rng(0), 300, 256)
    with pytest.raises(ValueError, match="stacked"):
        jf.gemv(x, jnp.stack([w8, w8]), s8[None], layer=1)  # 2 weight layers, 1 scale layer


def _engine(model, mesh, **config):
    """An Engine with one layer per loop iteration (the lowering tests count calls per loop body)."""
    from jtilert.runtime.generate import Engine
    from jtilert.ops.table import DecodeConfig
    return Engine(model, mesh=mesh, config=DecodeConfig(**{"layers_per_iteration": 1, **config}))


def _lower_forward_for_cuda(eng, rows):
    """The engine's one-token forward step, cross-lowered for CUDA (StableHLO text)."""
    tok = eng.place(jnp.asarray([5], jnp.int32))
    return eng.forward._jit.trace(eng.state, eng.new_cache(rows), tok, eng.place(jnp.int32(0))).lower(  # noqa: SLF001
        lowering_platforms=("cuda",)).as_text()


def _layer_loops(cfg):
    """The layer ranges of the step's loops (one loop body each): the dense layers, the MoE layers."""
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe(i)]
    return [r for r in (dense, moe) if r]


def _decode_logits(model, mesh, engine, ids):
    """Logits of one-token forward steps over `ids` (the decode regime, T = 1)."""
    eng = _engine(model, mesh, engine_all_reduce=engine)
    cache, out = eng.new_cache(len(ids) + 1), []
    for p, t in enumerate(ids):
        logits, _, cache = eng.forward(eng.state, cache, eng.place(jnp.asarray([t], jnp.int32)),
                                       eng.place(jnp.int32(p)))
        out.append(np.asarray(logits))
    return np.concatenate(out)


@pytest.fixture(scope="module")
def tiny_bf16(tiny_random):
    """The session's tiny fp32 model with every weight cast to bf16 (bf16 activations)."""
    from flax import nnx
    graphdef, state = nnx.split(tiny_random)
    model = nnx.merge(graphdef, jax.tree.map(lambda v: v.astype(jnp.bfloat16), state))
    model.dtype = jnp.dtype(jnp.bfloat16)
    return model


def test_model_moe_through_the_fused_op_equals_psum(tiny_bf16, monkeypatch):
    """bf16 model at tp = 8, engine on: the MoE layers' loop calls expert_down_all_reduce (here its
    fallback, the same code at any degree) with the stacked weights and the layer index, and the decode
    logits equal the psum path's bit for bit (the o_proj and the dense MLP stay on their unfused path so
    that only the MoE differs; gemv_all_reduce's fallback rounds once instead of per rank)."""
    mesh = _mesh(8)
    calls = []
    orig = jf.expert_down_all_reduce
    monkeypatch.setattr(jf, "expert_down_all_reduce",
                        lambda *a, **k: calls.append(k.get("layer") is not None) or orig(*a, **k))
    monkeypatch.setattr(jf, "gemv_all_reduce", lambda x, w, s, axis, layer=None: lax.psum(
        reference.linear(x[None], *(a if a is None or layer is None else a[Layer.of(layer).index()] for a in (w, s))),
        axis)[0])
    ids = np.random.default_rng(7).integers(0, 256, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = _decode_logits(tiny_bf16, mesh, True, ids)
    assert any(tiny_bf16.cfg.is_moe(i) for i in range(tiny_bf16.cfg.num_hidden_layers))
    assert calls and all(calls), "the MoE did not take the fused path with stacked weights"
    np.testing.assert_array_equal(ours, _decode_logits(tiny_bf16, mesh, False, ids))




@pytest.mark.parametrize("m,k", [(64, 64), (50, 300), (16, 1)])
def test_merge_topk_fallback_is_global_topk_with_lower_index_ties(m, k):
    mesh = _mesh()
    sc, idx = sorted_lists(np.random.default_rng(3), 8, m)
    f = _smap(mesh, lambda s, i: jf.merge_topk(s[0], i[0], "tp", k), (P("tp"), P("tp")), (P(), P()))
    os_, oi = (np.asarray(a) for a in f(jnp.asarray(sc), jnp.asarray(idx)))
    order = np.lexsort((idx.ravel(), -sc.ravel()))[:k]
    np.testing.assert_array_equal(oi, idx.ravel()[order])
    np.testing.assert_array_equal(os_, sc.ravel()[order])
    # unsorted inputs with sorted_inputs=False give the same answer
    perm = np.random.default_rng(4).permutation(m)
    f2 = _smap(mesh, lambda s, i: jf.merge_topk(s[0], i[0], "tp", k, sorted_inputs=False),
               (P("tp"), P("tp")), (P(), P()))
    os2, oi2 = (np.asarray(a) for a in f2(jnp.asarray(sc[:, perm]), jnp.asarray(idx[:, perm])))
    np.testing.assert_array_equal(oi2, oi)


# ------------------------------------------------------------------ the CUDA lowering

def test_cuda_lowering_emits_the_engine_custom_calls(monkeypatch):
    """Cross-lowering for CUDA on the CPU: the primitives become the FFI custom calls with the
    mesh's device groups (the group set-up itself needs GPUs and is skipped here)."""
    mesh = _mesh()
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal(8 * 256), jnp.bfloat16)
    w, s = fp8_weights(rng, 7168, 8 * 256)
    sc, idx = sorted_lists(rng, 8, 32)

    ed = _expert_down_case(rng, True)

    def f(x, w, s, sc, idx, *ed):
        a = jf.all_reduce(x, "tp")
        b = jf.gemv_all_reduce(x, w, s, "tp")
        c, d = jf.merge_topk(sc[0], idx[0], "tp", 32)
        e = jf.expert_down_all_reduce(*ed, "tp")
        return a, b, c, d, e

    g = _smap(mesh, f, (P("tp"), P(None, "tp"), P(None, "tp"), P("tp"), P("tp")) + EXPERT_DOWN_SPECS, (P(),) * 5)
    args = (x, w, s, jnp.asarray(sc), jnp.asarray(idx)) + ed
    txt = g.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    for target in ("jtilert_all_reduce", "jtilert_gemv_all_reduce", "jtilert_merge_topk",
                   "jtilert_expert_down_all_reduce"):
        assert f"custom_call @{target}" in txt, target
    assert "groups = dense<[0, 1, 2, 3, 4, 5, 6, 7]>" in txt
    assert "world = 8 : i32" in txt and "has_scale = 1 : i32" in txt
    # on the CPU platform the same program lowers to the XLA fallback
    txt_cpu = g.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert "custom_call @jtilert" not in txt_cpu


def _custom_call_types(txt, target):
    """The operand types of every ``custom_call @target`` in the StableHLO text."""
    pat = re.compile(r"custom_call @" + re.escape(target) + r"\(.*\} : \((.*)\) -> ")
    return [m.group(1) for m in pat.finditer(txt)]


def test_cuda_lowering_stacked_weights_go_straight_into_the_custom_calls(monkeypatch):
    """A fori_loop over the layers with a traced index, cross-lowered for CUDA: the stacked weights
    and scales (the whole [L, ...] arrays) and the layer's int32 base and offset are operands of the
    engine's *_stacked custom calls, and nothing slices a layer out in XLA (no dynamic_slice anywhere). On
    the CPU platform the same program takes the XLA path, which does slice."""
    mesh = _mesh()
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    rng = np.random.default_rng(10)
    x, w, s = _stacked_gemv_case(rng, True, n=7168)
    ed = stack_layers(_stacked_expert_down_cases(rng, True))

    def f(x, w, s, *ed):
        h, wts, ids, down, ds, hs, sd, ss = ed

        def body(l, acc):
            a = jf.gemv_all_reduce(x, w, s, "tp", layer=l)
            b = jf.expert_down_all_reduce(h, wts, ids, down, ds, hs, sd, ss, "tp", layer=l)
            return acc[0] + a.astype(jnp.float32), acc[1] + b.astype(jnp.float32)

        return lax.fori_loop(0, LAYERS, body, (jnp.zeros(w.shape[1]), jnp.zeros(down.shape[2])))

    g = _smap(mesh, f, (P("tp"), P(None, None, "tp"), P(None, None, "tp")) + STACKED_EXPERT_DOWN_SPECS,
              (P(), P()))
    args = (x, w, s) + ed
    txt = g.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    gemv_types = _custom_call_types(txt, "jtilert_gemv_all_reduce_stacked")
    ed_types = _custom_call_types(txt, "jtilert_expert_down_all_reduce_stacked")
    assert len(gemv_types) == 1 and len(ed_types) == 1, (gemv_types, ed_types)
    # per-rank shapes: K, I and Is split 8 ways, the layer axis whole
    assert gemv_types[0].startswith("tensor<256xbf16>, tensor<3x7168x256xf8E4M3FN>, tensor<3x56x2xf32>, ")
    assert gemv_types[0].endswith(", tensor<1xi32>, tensor<1xi32>"), gemv_types[0]
    ed_ops = [t.strip() for t in ed_types[0].split(", tensor")]
    assert ed_ops[3] == "<3x6x300x128xf8E4M3FN>" and ed_ops[4] == "<3x6x3x1xf32>", ed_ops
    assert ed_ops[6] == "<3x300x128xf8E4M3FN>" and ed_ops[7] == "<3x3x1xf32>", ed_ops
    assert ed_ops[-2:] == ["<1xi32>", "<1xi32>"], ed_ops
    assert "dynamic_slice" not in txt and "stablehlo.gather" not in txt
    assert "custom_call @jtilert_gemv_all_reduce(" not in txt  # only the stacked form
    # the local GEMV (no mesh axis) too
    txt1 = jax.jit(lambda x, w, s, l: jf.gemv(x, w, s, layer=l)).trace(
        x[:256], w[:, :, :256], s[:, :, :2], jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert len(_custom_call_types(txt1, "jtilert_gemv_all_reduce_stacked")) == 1
    assert "dynamic_slice" not in txt1 and "world = 1 : i32" in txt1
    # the CPU lowering of the same program is the XLA path, which slices the layer out
    txt_cpu = g.trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert "custom_call @jtilert" not in txt_cpu and "dynamic_slice" in txt_cpu


def _custom_call_operands(txt, target):
    """The operand names of every ``custom_call @target`` in the StableHLO text."""
    pat = re.compile(r"custom_call @" + re.escape(target) + r"\(([^)]*)\)")
    return [[o.strip() for o in m.group(1).split(",")] for m in pat.finditer(txt)]


def test_model_decode_step_lowers_to_the_fused_kernels(tiny_bf16, monkeypatch):
    """The tp=2 decode step with the engine on, cross-lowered for CUDA: in each layer loop's body the
    o_proj, the dense MLP's down projection and the MoE down + shared expert become the engine's
    fused custom calls in their stacked form, the weights going in as the loop's own [L, ...]
    operands (no slice of a layer in front of the call)."""
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    txt = _lower_forward_for_cuda(_engine(tiny_bf16, _mesh(2), engine_all_reduce=True), 8)
    cfg = tiny_bf16.cfg
    loops = _layer_loops(cfg)
    dense_loops = sum(not cfg.is_moe(r[0]) for r in loops)
    moe_loops = len(loops) - dense_loops
    gemv = _custom_call_operands(txt, "jtilert_gemv_all_reduce_stacked")
    ed = _custom_call_operands(txt, "jtilert_expert_down_all_reduce_stacked")
    assert len(ed) == moe_loops and moe_loops == 1
    assert len(gemv) == 2 * dense_loops + moe_loops   # o_proj in every loop, the dense MLP's down
    assert all(o[1].startswith("%iterArg") for o in gemv), gemv        # w: the loop-carried stack
    assert all(o[3].startswith("%iterArg") and o[6].startswith("%iterArg") for o in ed), ed
    assert "custom_call @jtilert_gemv_all_reduce(" not in txt
    assert "custom_call @jtilert_expert_down_all_reduce(" not in txt
    assert "custom_call @jtilert_all_reduce" not in txt


def test_pallas_step_over_a_mesh_runs_the_engines_router_selection(tiny_bf16, monkeypatch):
    """backend="pallas" at tp=2, cross-lowered for CUDA with the engine: each MoE loop body's router
    selection is the engine's one launch, on the loop's own bias stack (no slice of a layer)."""
    from flax import nnx

    from jtilert.pallas import interpret as interp
    model = nnx.clone(tiny_bf16)   # the kernel takes an fp32 bias, as the fp8 checkpoints store it
    state = nnx.state(model)
    state = jax.tree.map_with_path(lambda p, v: v.astype(jnp.float32) if "e_score_correction_bias" in jax.tree_util.keystr(p)
                                   else v, state)
    nnx.update(model, state)
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    with interp.compile_for_gpu():
        txt = _lower_forward_for_cuda(_engine(model, _mesh(2), backend="pallas"), 64)
    moe_loops = sum(tiny_bf16.cfg.is_moe(r[0]) for r in _layer_loops(tiny_bf16.cfg))
    rs = _custom_call_operands(txt, "jtilert_route_select")
    assert moe_loops >= 1 and len(rs) == moe_loops, rs
    assert all(o[1].startswith(("%arg", "%iterArg")) for o in rs), rs   # an argument, not a value computed here
    stacks = {"tensor<{}xf32>".format("x".join(map(str, v.shape)))
              for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model))
              if "e_score_correction_bias" in jax.tree_util.keystr(p)}
    calls = [line for line in txt.splitlines() if "custom_call @jtilert_route_select" in line]
    assert all(any(st in line for st in stacks) for line in calls), (stacks, calls)   # a whole bias stack


def test_split_indexer_lowers_to_the_engine_merge(tiny_bf16, monkeypatch):
    """split_indexer=True at tp=2, cross-lowered for CUDA: the per-rank top-k lists of the indexer in
    every layer loop's body go through the engine's peer-memory merge."""
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    txt = _lower_forward_for_cuda(_engine(tiny_bf16, _mesh(2), split_indexer=True), 64)
    cfg = tiny_bf16.cfg
    full_loops = sum(any(cfg.indexer_types[i] == "full" for i in r) for r in _layer_loops(cfg))
    assert full_loops >= 1 and txt.count("custom_call @jtilert_merge_topk") == full_loops


def test_two_axis_mesh_groups(monkeypatch):
    """On a (2, 4) mesh the all-reduce over 'tp' forms one group per 'dp' row."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 host devices")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    g = jax.jit(jax.shard_map(lambda v: jf.all_reduce(v, "tp"), mesh=mesh, in_specs=P(("dp", "tp")),
                              out_specs=P("dp")))
    txt = g.trace(jnp.ones(64, jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "groups = dense<[0, 1, 2, 3, 4, 5, 6, 7]>" in txt and "world = 4 : i32" in txt
