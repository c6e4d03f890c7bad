"""Split-K GEMVs that finish inside their kernel (issue 14): the split CTAs of a row block are one CTA
cluster, each stores its fp32 partial to a GMEM workspace, the cluster synchronises on a
ClusterBarrier and its first CTA sums the partials and applies the epilogue. Every case forces a
split (1 < split_k ≤ 8) and draws fresh seeded random inputs; the kernel runs in GPU interpret mode
(the cluster's CTAs as threads, race detection on, buffers starting as NaN, so an unwritten output
element or a read of a peer's partial before its store fails: checked, the simulator reports a race
without the cluster barrier, and with the partial stores waited for `.read` only) against
jtilert.ops.reference.
Shapes include a last row block that overhangs N and, in expert mode, several selections per token.
A split above the portable cluster size keeps XLA's finish and is checked too."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import _hopper as hw
from jtilert.pallas import gemv, moe
from jtilert.pallas import interpret as interp

F32, BF16 = jnp.float32, jnp.bfloat16
TOL = 1e-2          # relative (Frobenius): bf16 outputs, fp8 / bf16 weights
_seed = itertools.count(14000)


def _key():
    return jax.random.key(next(_seed))


def _x(t, k, scale=1.0):
    return (jax.random.normal(_key(), (t, k), F32) * scale).astype(BF16)


def _w(shape, fmt):
    w = jax.random.normal(_key(), shape, F32) * shape[-1] ** -0.5
    if fmt == "fp8":
        return quantize_weight(w) if len(shape) == 2 else jax.vmap(quantize_weight)(w)
    return w.astype(BF16 if fmt == "bf16" else F32), None


@pytest.fixture
def launches(monkeypatch):
    """The grid and cluster of every kernel traced in the test (plgpu.kernel wrapped)."""
    seen = []
    real = plgpu.kernel

    def kernel(body, **kw):
        seen.append((kw.get("kernel_name"), tuple(kw.get("grid", ())), tuple(kw.get("cluster", ()))))
        return real(body, **kw)
    monkeypatch.setattr(plgpu, "kernel", kernel)
    return seen


def _run(f, *args):
    with interp.interpret(detect_races=True):
        out = jax.tree.map(np.asarray, jax.jit(f)(*args))
        assert not interp.races_found()
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert not np.isnan(a).any(), "unwritten (NaN) output elements"
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _one_cluster_launch(launches, split):
    """The test traced exactly one kernel, clustered over its split axis (and nothing else)."""
    assert len(launches) == 1, launches
    _, grid, cluster = launches[0]
    assert grid[1] == 1 and cluster[:2] == (1, split) and all(c == 1 for c in cluster[2:]), launches[0]


@pytest.mark.parametrize("t,n,k,split,extra", [
    (2, 130, 1024, 4, 0),      # x_proj's form (norm + fp8, split 4); N overhangs the last row block
    (1, 64, 512, 2, 64),       # x wider than K (qr_proj reading q_a in place); the extra columns large
])
def test_rmsnorm_linear_fp8(t, n, k, split, extra, launches):
    x = jnp.concatenate([_x(t, k, 3.0), _x(t, extra, 100.0)], axis=1)
    nw = (1 + 0.1 * jax.random.normal(_key(), (k,))).astype(BF16)
    w, s = _w((n, k), "fp8")
    cfg = gemv.GemvConfig(split_k=split)
    got = _run(lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s, config=cfg), x, nw, w, s)
    _one_cluster_launch(launches, split)
    assert got.shape == (t, n)
    assert _rel(got, reference.linear(reference.rms_norm(x[:, :k], nw, 1e-6), w, s)) < TOL


@pytest.mark.parametrize("t,split,fmt", [(3, 2, "fp8"), (1, 3, "bf16")])
def test_linear_residual(t, split, fmt, launches):
    n, k = 96, 768
    x, r = _x(t, k), _x(t, n, 4.0)
    w, s = _w((n, k), fmt)
    cfg = gemv.GemvConfig(split_k=split)
    got = _run(functools.partial(gemv.linear_residual, config=cfg), x, w, s, r)
    _one_cluster_launch(launches, split)
    assert _rel(got, reference.linear_residual(x, w, s, r)) < TOL


@pytest.mark.parametrize("t,split", [(1, 4), (2, 8)])
def test_swiglu_pair_fp8(t, split, launches):
    """The dense / shared-expert gate and up in one pass, silu(g)·u in the leader's epilogue."""
    n, k = 72, 2048
    x = _x(t, k)
    g, gs = _w((n, k), "fp8")
    u, us = _w((n, k), "fp8")
    got = _run(functools.partial(gemv.swiglu_pair, config=gemv.GemvConfig(split_k=split)), x, g, gs, u, us)
    _one_cluster_launch(launches, split)
    assert _rel(got, reference.swiglu_hidden(x, g, gs, u, us)) < TOL


def test_expert_gate_up_fp8(launches):
    """Expert mode: grid (row blocks, 1, selections), cluster (1, split, 1); 3 selections per token of
    2 tokens (two selections of one expert), each CTA reading its expert's rows; a 2-layer stack."""
    e, width, hidden, kper, t, split = 5, 96, 512, 3, 2, 4
    g, gs = _w((2, e, width, hidden), "fp8")
    u, us = _w((2, e, width, hidden), "fp8")
    x = _x(t, hidden)
    ids = jax.random.randint(_key(), (t, kper), 0, e).astype(jnp.int32).at[1, 2].set(3).at[0, 1].set(3)
    cfg = gemv.GemvConfig(split_k=split)
    got = _run(lambda x, i, g, gs, u, us: moe.expert_gate_up(x, i, g, gs, u, us, layer=jnp.int32(1), config=cfg),
               x, ids, g, gs, u, us)
    _one_cluster_launch(launches, split)
    assert launches[0][1] == (2, 1, t * kper)
    want = reference.expert_hidden(x, ids, g[1], gs[1], u[1], us[1])
    assert got.shape == (t * kper, width)
    assert _rel(got, want) < TOL


def test_router_fma_fp32(launches):
    """The router's form: fp32 weights on the CUDA-core engine, split 8 (the whole portable cluster),
    fp32 logits summed by the leader in order s = 0..7."""
    e, k, t = 72, 2048, 2
    x = _x(t, k)
    w = jax.random.normal(_key(), (e, k), F32) * k ** -0.5
    cfg = gemv.GemvConfig(engine="fma", split_k=8)
    got = _run(lambda x, w: gemv._projection(x, (w,), (None,), out_dtype=F32, config=cfg), x, w)
    _one_cluster_launch(launches, 8)
    want = jnp.einsum("tk,nk->tn", x.astype(F32), w, precision="highest")
    assert got.dtype == np.float32 and _rel(got, want) < 1e-5


def test_heads_linear_fp8(launches):
    """MLA's absorption form (the heads as experts, x read in place with a stride), split 2."""
    t, heads, n, k = 2, 3, 64, 512
    w, s = _w((heads, n, k), "fp8")
    x = _x(t, heads * k).reshape(t, heads, k)
    got = _run(lambda x, w, s: gemv.heads_linear(x, w, s, config=gemv.GemvConfig(split_k=2)), x, w, s)
    _one_cluster_launch(launches, 2)
    assert _rel(got, reference.heads_linear(x, w, s)) < TOL


def test_expert_down_fp8(launches):
    """The MoE down projection's split-K (K = tokens × selections × width) in its cluster."""
    t, kper, width, hidden, e, split = 2, 3, 256, 130, 5, 3
    d, ds = _w((e, hidden, width), "fp8")
    h = _x(t * kper, width)
    wts = jax.random.uniform(_key(), (t, kper), F32, 0.2, 1.5)
    ids = jax.random.randint(_key(), (t, kper), 0, e).astype(jnp.int32)
    got = _run(lambda h, w, i, d, ds: moe.expert_down(h, w, i, d, ds, config=gemv.GemvConfig(split_k=split)),
               h, wts, ids, d, ds)
    _one_cluster_launch(launches, split)
    assert _rel(got, reference.expert_down(h, wts, ids, d, ds)) < TOL


def test_split_above_a_portable_cluster_keeps_xlas_finish(launches):
    """split 16 > hw.MAX_CLUSTER: no cluster, the kernel's partials summed by XLA (the old path)."""
    assert gemv.finish_of(16) == "xla" and gemv.finish_of(hw.MAX_CLUSTER) == "cluster" and gemv.finish_of(1) == "kernel"
    t, n, k = 1, 64, 1024
    x, r = _x(t, k), _x(t, n)
    w, _ = _w((n, k), "bf16")
    got = _run(functools.partial(gemv.linear_residual, config=gemv.GemvConfig(split_k=16)), x, w, None, r)
    assert launches[0][1:] == ((1, 16), ())
    assert _rel(got, reference.linear_residual(x, w, None, r)) < TOL


def test_occupancy_split_stays_within_a_portable_cluster():
    """The occupancy rule grows split-K up to hw.MAX_CLUSTER, no further (one row block, K = 16384
    would have taken 16 before)."""
    gpu = gemv.GemvConfig(a_in_registers=True)     # as on the H200 (132 SMs)
    assert gpu.resolved(64, 16384, 1, 1, 1, 132).split_k == hw.MAX_CLUSTER
    # the dsv32-tp8-shard shapes that split (x_proj, router, shared expert, experts', dense pair),
    # their cluster's buffers included
    assert gpu.resolved(2240, 7168, 1, 1, 1, 132).split_k == 4
    assert gemv.GemvConfig(engine="fma").resolved(256, 7168, 1, 1, 4, 132).split_k == 8
    assert gpu.resolved(256, 7168, 1, 2, 1, 132).split_k == 8
    assert gpu.resolved(256 * 8, 7168, 1, 2, 1, 132).split_k == 4
    assert gpu.resolved(2304, 7168, 1, 2, 1, 132).split_k == 4
