"""Inputs and fp64 references shared by the engine's CPU tests (test_ffi.py) and its GPU checks
(tests/gpu/engine_gpu_checks.py)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# in_specs of expert_down_all_reduce's (h, wts, ids, down, ds, hs, sd, ss) over the "tp" axis
EXPERT_DOWN_SPECS = (P(None, "tp"), P(), P(), P(None, None, "tp"), P(None, None, "tp"), P("tp"),
                     P(None, "tp"), P(None, "tp"))


def fp8_weights(rng, n, k):
    """Random fp8 e4m3 weights [n, k] and power-of-two 128x128 block scales."""
    w = jnp.asarray(rng.standard_normal((n, k)) * 4, jnp.float32).astype(jnp.float8_e4m3fn)
    s = jnp.asarray(2.0 ** rng.integers(-3, 2, (math.ceil(n / 128), math.ceil(k / 128))), jnp.float32)
    return w, s


def np_gemv(x, w, s):
    """fp64 W·x, W dequantised with its block scales s (None: no scales)."""
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    if s is not None:
        n, k = wf.shape
        wf = wf * np.repeat(np.repeat(np.asarray(s, np.float64), 128, 0)[:n], 128, 1)[:, :k]
    return wf @ np.asarray(x.astype(jnp.float32), np.float64)


def expert_down_case(rng, fp8, *, world, e, n, k, i_loc, is_loc):
    """Global (over `world` ranks) inputs (h, wts, ids, down, ds, hs, sd, ss) of
    expert_down_all_reduce: k of e routed experts of width i_loc per rank, a shared expert of width
    is_loc per rank, output n; each rank holds an I / Is slice. ds = ss = None for bf16."""
    i, i_s = world * i_loc, world * is_loc
    h = jnp.asarray(rng.standard_normal((k, i)), jnp.bfloat16)
    hs = jnp.asarray(rng.standard_normal(i_s), jnp.bfloat16)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, k), jnp.float32)
    ids = jnp.asarray(rng.choice(e, k, replace=False), jnp.int32)
    if fp8:
        down, ds = zip(*[fp8_weights(rng, n, i) for _ in range(e)])
        down, ds = jnp.stack(down), jnp.stack(ds)
        sd, ss = fp8_weights(rng, n, i_s)
    else:
        down = jnp.asarray(rng.standard_normal((e, n, i)) * 0.05, jnp.bfloat16)
        sd = jnp.asarray(rng.standard_normal((n, i_s)) * 0.05, jnp.bfloat16)
        ds = ss = None
    return h, wts, ids, down, ds, hs, sd, ss


def stack_layers(cases):
    """One stacked case from per-layer cases of the same shapes: every weight / scale array gets a
    leading layer axis (None stays None); the activations of the first case are kept. For
    expert_down cases (h, wts, ids, down, ds, hs, sd, ss) the stacked entries are down, ds, sd, ss;
    for GEMV cases (x, w, s), w and s."""
    first = cases[0]
    stacked = (3, 4, 6, 7) if len(first) == 8 else (1, 2)
    return tuple((None if a is None else jnp.stack([c[i] for c in cases])) if i in stacked else a
                 for i, a in enumerate(first))


# in_specs of the stacked expert-down case: the layer axis of down, ds, sd, ss is not sharded
STACKED_EXPERT_DOWN_SPECS = (P(None, "tp"), P(), P(), P(None, None, None, "tp"),
                             P(None, None, None, "tp"), P("tp"), P(None, None, "tp"),
                             P(None, None, "tp"))


def np_expert_down(h, wts, ids, down, ds, hs, sd, ss):
    """fp64 Σ_j w_j · Down[ids_j] · h_j + SharedDown · h_s."""
    y = np_gemv(hs, sd, ss)
    for j, e in enumerate(np.asarray(ids)):
        y = y + float(wts[j]) * np_gemv(h[j], down[e], None if ds is None else ds[e])
    return y


def sorted_lists(rng, world, m, grain=2, inf_every=7, rank_stride=100_000):
    """merge_topk's inputs: per rank m scores on a 1/grain grid (many ties), every inf_every-th -inf,
    and distinct indices (rank · rank_stride + 3 · position), each rank's list sorted by (score
    descending, index ascending): (scores [world, m] fp32, indices [world, m] int32)."""
    sc = np.round(rng.standard_normal((world, m)) * grain) / grain
    sc[:, ::inf_every] = -np.inf
    idx = np.stack([r * rank_stride + np.arange(m) * 3 for r in range(world)]).astype(np.int32)
    for r in range(world):
        o = np.lexsort((idx[r], -sc[r]))
        sc[r], idx[r] = sc[r][o], idx[r][o]
    return sc.astype(np.float32), idx
