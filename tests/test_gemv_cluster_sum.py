"""The GEMV's split-K partials summed in the kernel by the row block's CTAs as one cluster
(`GemvConfig(split_sum="cluster")`; "auto" does so on the GPU for a one-weight projection whose own
split is 2..8: not a gate/up pair, not in expert mode, not for the FMA engine or the partials form). GPU interpret mode runs no remote
refs, so on the CPU the cluster form is lowered for the GPU and its structure checked (a cluster of
`split` CTAs, no XLA sum after the kernel; test_kernel_shapes checks its shared memory against
Mosaic's count); the interpreter runs the XLA sum, whose numbers the other GEMV tests check.
bench/RESULTS.md (session 18) has its GPU check and timing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from decode_jaxprs import sub_jaxprs   # tests/decode_jaxprs.py (tests/ is on sys.path)

from jtilert.pallas import _hopper as hw
from jtilert.pallas import gemv, moe
from jtilert.pallas import interpret as interp

S = jax.ShapeDtypeStruct
FP8, BF16, F32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32
X_PROJ = (S((1, 7168), BF16), S((7168,), BF16), S((2240, 7168), FP8), S((18, 56), F32))


def _kernels(jaxpr, out):
    """The meshes (grid, cluster) of every Mosaic kernel in `jaxpr`."""
    for e in jaxpr.eqns:
        if e.primitive.name == "mpmd_map":
            out.append(e.params["meshes"][0])
        for inner in sub_jaxprs(e):
            _kernels(inner, out)
    return out


def _traced(f, args, config=None):
    return jax.make_jaxpr(lambda *a: f(*a, config=config))(*args).jaxpr


def _norm_linear(x, nw, w, s, config=None):
    return gemv.rmsnorm_linear(x, nw, 1e-6, w, s, config=config)


def test_split_k_sums_in_a_cluster_on_the_gpu():
    cfg = gemv.GemvConfig(split_k=4, split_sum="cluster")
    with interp.compile_for_gpu():
        jaxpr = _traced(_norm_linear, X_PROJ, cfg)
        (mesh,) = _kernels(jaxpr, [])
        text = jax.jit(lambda *a: _norm_linear(*a, config=cfg)).trace(*X_PROJ).lower(
            lowering_platforms=("cuda",)).as_text()
    assert tuple(mesh.cluster) == (4,) and tuple(mesh.cluster_names) == ("s",), mesh
    assert tuple(mesh.grid) == (2240 // 64,), mesh
    # the kernel's output is the result: no reduction of partials by XLA after it
    assert "stablehlo.reduce" not in text
    assert jaxpr.outvars[0].aval.shape == (1, 2240)


def test_auto_sums_a_projection_in_a_cluster_on_the_gpu():
    with interp.compile_for_gpu():
        (mesh,) = _kernels(_traced(_norm_linear, X_PROJ, gemv.GemvConfig(split_k=4)), [])
        assert tuple(mesh.cluster) == (4,) and tuple(mesh.grid) == (2240 // 64,), mesh
        # x_proj's own split (the occupancy rule) is within a portable cluster
        (mesh,) = _kernels(_traced(_norm_linear, X_PROJ), [])
        assert 1 < tuple(mesh.cluster)[0] <= gemv.CLUSTER_MAX, mesh
        # a split the shape needs beyond a cluster is kept, summed by XLA
        (mesh,) = _kernels(_traced(_norm_linear, X_PROJ, gemv.GemvConfig(split_k=14)), [])
        assert not tuple(mesh.cluster or ()) and tuple(mesh.grid) == (2240 // 64, 14), mesh
        # a gate/up pair (the shared expert's: split 8) sums in XLA
        pair = (S((1, 7168), BF16), S((7168,), BF16)) + (S((256, 7168), FP8), S((2, 56), F32)) * 2
        (mesh,) = _kernels(jax.make_jaxpr(lambda x, nw, g, gs, u, us: gemv.swiglu_pair(
            x, g, gs, u, us, nw, 1e-6))(*pair).jaxpr, [])
        assert not tuple(mesh.cluster or ()) and tuple(mesh.grid)[1] > 1, mesh
        # expert mode (the routed experts' gate/up) sums in XLA
        xe = (S((1, 7168), BF16), S((8,), jnp.int32)) + (S((256, 256, 7168), FP8), S((256, 2, 56), F32)) * 2
        meshes = _kernels(jax.make_jaxpr(lambda x, ids, g, gs, u, us: moe.expert_gate_up(x, ids, g, gs, u, us))(
            *xe).jaxpr, [])
        assert meshes and all(not tuple(m.cluster or ()) for m in meshes), meshes
        assert any(len(tuple(m.grid)) > 1 and tuple(m.grid)[1] > 1 for m in meshes), meshes  # split-K


def test_the_indexers_head_weights_split_wide_and_sum_in_xla():
    """The indexer's head weights (fp32 weights [64, 7168], the FMA engine, an fp32 result): one row block
    over 28 CTAs (K = 112 grains of 64), no cluster (the FMA engine's never sum in one), XLA's sum after it."""
    args = (S((1, 7168), BF16), S((7168,), BF16), S((64, 7168), F32))

    def head_weights(x, nw, w):
        return gemv.index_weights(x, nw, 1e-6, w)
    with interp.compile_for_gpu():
        jaxpr = jax.make_jaxpr(head_weights)(*args).jaxpr
        (mesh,) = _kernels(jaxpr, [])
        # the FMA engine's own split of the shape would be a cluster of 8 if "auto" allowed it
        cfg = gemv.GemvConfig(engine="fma").resolved(64, 7168, 1, 1, 4, 132, cluster_sum=True, cluster_auto=True)
    assert cfg.split_k == 8 and cfg.split_sum == "xla", cfg
    assert not tuple(mesh.cluster or ()) and tuple(mesh.grid) == (1, 28), mesh
    assert jaxpr.outvars[0].aval.shape == (1, 64) and jaxpr.outvars[0].aval.dtype == F32


def test_auto_interpret_mode_and_the_partials_form_sum_in_xla():
    with interp.interpret():
        (mesh,) = _kernels(_traced(_norm_linear, X_PROJ, gemv.GemvConfig(split_k=4)), [])
        assert not tuple(mesh.cluster or ()) and tuple(mesh.grid) == (2240 // 64, 4)
        with pytest.raises(ValueError, match="split_sum='cluster' needs the GPU"):
            _traced(_norm_linear, X_PROJ, gemv.GemvConfig(split_k=4, split_sum="cluster"))
    with interp.compile_for_gpu():
        # the router's form returns the split-K partials for its consumer to sum: never a cluster
        with pytest.raises(ValueError, match="split_sum='cluster' needs the GPU"):
            gemv._projection(jnp.zeros((1, 7168), BF16), (jnp.zeros((256, 7168), F32),), (None,), out_dtype=F32,
                             partials=True, config=gemv.GemvConfig(split_sum="cluster", engine="fma"))
        meshes = _kernels(jax.make_jaxpr(moe.router_partials)(S((1, 7168), BF16), S((256, 7168), F32)).jaxpr, [])
        assert meshes and all(not tuple(m.cluster or ()) for m in meshes), meshes
        assert any(tuple(m.grid)[1] > 1 for m in meshes), meshes   # split-K (else nothing is checked)


def test_cluster_bounds_and_names():
    with interp.compile_for_gpu():
        with pytest.raises(ValueError, match="at most 8 splits"):
            _traced(_norm_linear, X_PROJ, gemv.GemvConfig(split_k=14, split_sum="cluster"))
        with pytest.raises(ValueError, match="unknown split_sum"):
            _traced(_norm_linear, X_PROJ, gemv.GemvConfig(split_sum="gmem"))
        # the split search keeps to a portable cluster
        (mesh,) = _kernels(_traced(_norm_linear, X_PROJ, gemv.GemvConfig(split_sum="cluster")), [])
        assert 1 < tuple(mesh.cluster)[0] <= gemv.CLUSTER_MAX, mesh


def test_the_cluster_buffers_are_counted():
    cfg = gemv.GemvConfig(split_k=4, split_sum="cluster", block_k=128, stages=4, engine="fp8x2")
    xla = gemv.dataclasses.replace(cfg, split_sum="xla")
    with_cluster = hw.smem_bytes(gemv.projection_smem(cfg, k=7168, p=2, itemsize=1, tb=1))
    without = hw.smem_bytes(gemv.projection_smem(xla, k=7168, p=2, itemsize=1, tb=1))
    # the cluster form: two [64] fp32 partials buffers (1 KiB each on Mosaic's alignment), two
    # barriers, and an output tile of bf16 rows [1, 8, 64] (1 KiB) instead of the fp32 partials
    # [2, 8, 64] (4 KiB). (test_kernel_shapes checks the count against Mosaic's for a split-K GEMV.)
    assert with_cluster - without == 2 * 1024 + 2 * hw.BARRIER_BYTES + 1024 - 4096
