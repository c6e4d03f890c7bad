"""CPU tests of the CUDA engine (issue 6): it compiles, its task tables are right, and every
function falls back to the XLA path (equal to psum / the reference) on 8 host devices.

The GPU side (the kernels running on 2 GPUs, compute-sanitizer, timings) is in tests/gpu/.
"""

from __future__ import annotations

import math
import os
import pathlib
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
from jtilert import layers
from jtilert.ffi import ops as ffi_ops
from jtilert.ffi import plan as ffi_plan

from ffi_inputs import EXPERT_DOWN_SPECS, expert_down_case, fp8_weights, np_expert_down, np_gemv

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
def test_cuda_sources_compile_warnings_as_errors(tmp_path):
  """cmake + nvcc build of cuda/ (library and self-test), -Werror for nvcc, ptxas and g++."""
  env = dict(os.environ)
  env["PATH"] = str(pathlib.Path(_nvcc()).parent) + ":" + env.get("PATH", "")
  cfg = ["cmake", "-S", str(ROOT / "cuda"), "-B", str(tmp_path), "-DCMAKE_BUILD_TYPE=Release",
         f"-DJTILERT_XLA_FFI_INCLUDE={jax.ffi.include_dir()}", "-DJTILERT_SELFTEST=ON"]
  if shutil.which("ninja"):
    cfg += ["-G", "Ninja"]
  for cmd in (cfg, ["cmake", "--build", str(tmp_path), "-j", str(os.cpu_count() or 2)]):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
  lib = tmp_path / "libjtilert_engine.so"
  assert lib.is_file() and (tmp_path / "jtilert_selftest").is_file()
  # the library exports its C API and the three FFI handlers, and keeps cudart private
  nm = shutil.which("nm")
  if nm:
    syms = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    for s in ("JtAllReduce", "JtGemvAllReduce", "JtMergeTopk", "JtExpertDownAllReduce", "jt_group_create",
              "jt_all_reduce", "jt_expert_down_all_reduce"):
      assert f" {s}\n" in syms, s
    assert " cudaMalloc\n" not in syms


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
  """Through the model's single all-reduce (jtilert.sharding.all_reduce) with the engine on."""
  mesh = _mesh()
  sharding = pytest.importorskip("jtilert.sharding")
  if not hasattr(sharding, "tensor_parallel"):
    pytest.skip("jtilert.sharding has no tensor_parallel context")
  x = jnp.asarray(np.random.default_rng(1).standard_normal((8 * 3, 7168)), jnp.float32)

  def step(v, engine):
    with sharding.tensor_parallel("tp", engine=engine):
      return sharding.all_reduce(v)

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
  like jtilert.layers (moe_experts' second half + swiglu's down), and matches the fp64 math."""
  mesh = _mesh()
  args = _expert_down_case(np.random.default_rng(6), fp8)
  h, wts, ids, down, ds, hs, sd, ss = args

  def fused(h, wts, ids, down, ds, hs, sd, ss):
    return jf.expert_down_all_reduce(h, wts, ids, down, ds, hs, sd, ss, "tp")

  def unfused(h, wts, ids, down, ds, hs, sd, ss):
    routed = layers.expert_down(h, wts[None], ids[None], down, ds)
    return lax.psum(routed + layers.linear(hs[None], sd, ss), "tp")[0]

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


def _decode_logits(model, mesh, engine, ids):
  """Logits of one-token forward steps over `ids` (the decode regime, T = 1)."""
  from jtilert.generate import Engine
  eng = Engine(model, mesh=mesh, engine_all_reduce=engine)
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


@pytest.mark.parametrize("tp", [2, 8])
def test_model_moe_through_the_fused_op_equals_psum(tiny_bf16, tp, monkeypatch):
  """bf16 model at tp = 2 and 8, engine on: every MoE layer calls expert_down_all_reduce (here its
  fallback), and the decode logits equal the psum path's bit for bit (the o_proj and the dense MLP
  stay on their unfused path so that only the MoE differs; gemv_all_reduce's fallback rounds once
  instead of per rank)."""
  mesh = _mesh(tp)
  calls = []
  orig = jf.expert_down_all_reduce
  monkeypatch.setattr(jf, "expert_down_all_reduce", lambda *a, **k: calls.append(1) or orig(*a, **k))
  monkeypatch.setattr(jf, "gemv_all_reduce",
                      lambda x, w, s, axis: lax.psum(layers.linear(x[None], w, s), axis)[0])
  ids = np.random.default_rng(7).integers(0, 256, 6)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ours = _decode_logits(tiny_bf16, mesh, True, ids)
  moe_layers = sum(tiny_bf16.cfg.is_moe(i) for i in range(tiny_bf16.cfg.num_hidden_layers))
  assert len(calls) == moe_layers, "the MoE did not take the fused path"
  np.testing.assert_array_equal(ours, _decode_logits(tiny_bf16, mesh, False, ids))


def _sorted_lists(rng, world, m):
  sc = np.round(rng.standard_normal((world, m)) * 2) / 2  # many ties
  sc[:, ::7] = -np.inf
  idx = np.stack([r * 100_000 + np.arange(m) * 3 for r in range(world)]).astype(np.int32)
  for r in range(world):
    o = np.lexsort((idx[r], -sc[r]))
    sc[r], idx[r] = sc[r][o], idx[r][o]
  return sc.astype(np.float32), idx


@pytest.mark.parametrize("m,k", [(64, 64), (50, 300), (16, 1)])
def test_merge_topk_fallback_is_global_topk_with_lower_index_ties(m, k):
  mesh = _mesh()
  sc, idx = _sorted_lists(np.random.default_rng(3), 8, m)
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
  monkeypatch.setattr(ffi_ops, "_TEST_FORCE_EMIT", True)
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal(8 * 256), jnp.bfloat16)
  w, s = fp8_weights(rng, 7168, 8 * 256)
  sc, idx = _sorted_lists(rng, 8, 32)

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


def test_model_decode_step_lowers_to_the_fused_kernels(tiny_bf16, monkeypatch):
  """The tp=2 decode step with the engine on, cross-lowered for CUDA: the o_proj, the dense MLP's
  down projection and the MoE down + shared expert become the engine's fused custom calls."""
  from jtilert.generate import Engine
  monkeypatch.setattr(ffi_ops, "_TEST_FORCE_EMIT", True)
  eng = Engine(tiny_bf16, mesh=_mesh(2), engine_all_reduce=True)
  tok = eng.place(jnp.asarray([5], jnp.int32))
  txt = eng.forward.trace(eng.state, eng.new_cache(8), tok, eng.place(jnp.int32(0))).lower(
      lowering_platforms=("cuda",)).as_text()
  moe_layers = sum(tiny_bf16.cfg.is_moe(i) for i in range(tiny_bf16.cfg.num_hidden_layers))
  layers_ = tiny_bf16.cfg.num_hidden_layers
  assert txt.count("custom_call @jtilert_expert_down_all_reduce") == moe_layers
  assert txt.count("custom_call @jtilert_gemv_all_reduce") == layers_ + (layers_ - moe_layers)
  assert "custom_call @jtilert_all_reduce" not in txt


def test_split_indexer_lowers_to_the_engine_merge(tiny_bf16, monkeypatch):
  """split_indexer=True at tp=2, cross-lowered for CUDA: every indexer's per-rank top-k lists go
  through the engine's peer-memory merge."""
  from jtilert.generate import Engine
  monkeypatch.setattr(ffi_ops, "_TEST_FORCE_EMIT", True)
  eng = Engine(tiny_bf16, mesh=_mesh(2), split_indexer=True)
  tok = eng.place(jnp.asarray([5], jnp.int32))
  txt = eng.forward.trace(eng.state, eng.new_cache(64), tok, eng.place(jnp.int32(0))).lower(
      lowering_platforms=("cuda",)).as_text()
  assert txt.count("custom_call @jtilert_merge_topk") == tiny_bf16.cfg.indexer_types.count("full")


def test_two_axis_mesh_groups(monkeypatch):
  """On a (2, 4) mesh the all-reduce over 'tp' forms one group per 'dp' row."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 host devices")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
  monkeypatch.setattr(ffi_ops, "_TEST_FORCE_EMIT", True)
  g = jax.jit(jax.shard_map(lambda v: jf.all_reduce(v, "tp"), mesh=mesh, in_specs=P(("dp", "tp")),
                            out_specs=P("dp")))
  txt = g.trace(jnp.ones(64, jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
  assert "groups = dense<[0, 1, 2, 3, 4, 5, 6, 7]>" in txt and "world = 4 : i32" in txt
