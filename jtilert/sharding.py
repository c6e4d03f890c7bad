"""Tensor parallelism: the `tp` mesh, how each weight is split, and the model's one all-reduce.

Weights are split the way TileRT splits them: attention by heads (q_b, kv_b rows; o_proj columns),
dense MLP and every expert by their intermediate dimension, the lm head by vocab; the small
projections (q_a, kv_a, the indexer, the router) and the embedding are replicated. Inside the step
(run under `shard_map`) each rank computes a partial sum of every row-split projection, and
`all_reduce` adds them.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jtilert.quant import BLOCK, FP8

AXIS = "tp"

# Set while the step is traced under shard_map: the mesh axis to reduce over, and whether the CUDA
# engine replaces psum.
_axis: contextvars.ContextVar[str | None] = contextvars.ContextVar("jtilert_tp_axis", default=None)
_engine: contextvars.ContextVar[bool] = contextvars.ContextVar("jtilert_tp_engine", default=False)
_split_indexer: contextvars.ContextVar[bool] = contextvars.ContextVar("jtilert_split_indexer", default=False)


def make_mesh(tp: int = 1, devices=None) -> Mesh:
    """A 1-D mesh with axis "tp" over the first `tp` devices."""
    devices = list(jax.devices() if devices is None else devices)
    if not 1 <= tp <= len(devices):
        raise ValueError(f"tp={tp} needs that many devices; {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (AXIS,))


@contextlib.contextmanager
def tensor_parallel(axis: str | None, engine: bool = False, split_indexer: bool = False):
    t1, t2, t3 = _axis.set(axis), _engine.set(engine), _split_indexer.set(split_indexer)
    try:
        yield
    finally:
        _axis.reset(t1)
        _engine.reset(t2)
        _split_indexer.reset(t3)


def indexer_rows(rows: int, tokens: int) -> tuple[jax.Array | None, int | None]:
    """(first row, count) of this rank's share of the index-key cache when the indexer is split over
    the ranks (one decode token, rows divisible by tp), else (None, None): every rank scores every row."""
    axis = _axis.get()
    if axis is None or not _split_indexer.get() or tokens != 1 or rows % jax.lax.axis_size(axis):
        return None, None
    n = rows // jax.lax.axis_size(axis)
    return jax.lax.axis_index(axis) * n, n


def split_topk(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """topk_positions over the whole cache from this rank's scores [1, n] of rows [r·n, (r+1)·n):
    a local top-k per rank, merged across the ranks (the engine's peer-memory merge, or all_gather
    and a sort) into the same (indices [1, k], valid [1, k]) on every rank."""
    from jtilert import ffi
    vals, idx = ffi.split_topk(scores[0], k, _axis.get())
    return idx[None], vals[None] > -jnp.inf


def all_reduce(x: jax.Array) -> jax.Array:
    """Sum of the ranks' partial results: THE all-reduce of the model (identity without tp)."""
    axis = _axis.get()
    if axis is None:
        return x
    if _engine.get():
        from jtilert import ffi
        return ffi.all_reduce(x, axis)
    return jax.lax.psum(x, axis)


def linear_all_reduce(x: jax.Array, w: jax.Array, scale: jax.Array | None) -> jax.Array:
    """all_reduce(x · Wᵀ) for a row-split projection. With the CUDA engine on, one decode token goes
    through the fused kernel that streams W and exchanges finished output tiles while it streams."""
    axis = _axis.get()
    if axis is not None and _engine.get() and x.shape[0] == 1:
        from jtilert import ffi
        return ffi.gemv_all_reduce(x[0], w, scale, axis)[None]
    from jtilert import backend
    return all_reduce(backend.ops().linear(x, w, scale))


def moe_all_reduce(x: jax.Array, weights: jax.Array, ids: jax.Array, experts: tuple, shared: tuple) -> jax.Array:
    """all_reduce(Σ_j weights[t,j] · Expert_{ids[t,j]}(x[t]) + Shared(x[t])) for this rank's slices of the
    SwiGLU experts; `experts` (stacked [E, ...]) and `shared` are (gate, gate_scale, up, up_scale, down,
    down_scale). With the CUDA engine on, one decode token runs the experts' gate/up halves, then one
    kernel for the routed down projections, their weighted sum, the shared expert's down projection and
    the all-reduce (TileRT's ExpertDownAllReduce; the expert ids stay on the device)."""
    from jtilert import backend
    ops = backend.ops()
    axis = _axis.get()
    if axis is not None and _engine.get() and x.shape[0] == 1:
        from jtilert import ffi
        g, gs, u, us, d, ds = experts
        sg, sgs, su, sus, sd, sds = shared
        h = ops.expert_hidden(x, ids, g, gs, u, us)
        hs = ops.swiglu_hidden(x, sg, sgs, su, sus)
        return ffi.expert_down_all_reduce(h, weights[0], ids[0], d, ds, hs[0], sd, sds, axis)[None]
    return all_reduce(ops.moe_experts(x, weights, ids, *experts) + ops.swiglu(x, *shared))


def all_gather_last(x: jax.Array) -> jax.Array:
    """Concatenate the ranks' slices of the last axis (vocab-split logits)."""
    axis = _axis.get()
    if axis is None:
        return x
    return jax.lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)


def top_candidates(vals: jax.Array, ids: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """The global top-k of a vocab-split head from every rank's own top-k (values [T, k], ids of its
    `rows` vocab rows): (values, global vocab ids), descending, ties to the lower id."""
    axis = _axis.get()
    if axis is None:
        return vals, ids
    ids = ids + jax.lax.axis_index(axis) * rows
    # Gathered in rank order = vocab order, so top_k's lower-position tie rule is the lower id.
    vals, ids = (jax.lax.all_gather(a, axis, axis=1, tiled=True) for a in (vals, ids))
    top, pos = jax.lax.top_k(vals, vals.shape[1] // jax.lax.axis_size(axis))
    return top, jnp.take_along_axis(ids, pos, axis=1)


# Which axis of each weight is split over tp, by the parameter's name in the module tree.
_SPLIT = {
    "q_b_proj": 0, "kv_b_proj": 0, "o_proj": 1,
    "gate_proj": 0, "up_proj": 0, "down_proj": 1,
    "lm_head": 0, "head": 0,
}
_EXPERT_SPLIT = {"gate": 1, "up": 1, "down": 2}


def split_axis(path: tuple) -> int | None:
    """The tp-split axis of the parameter at `path` (a tuple of module-tree keys), or None."""
    names = [str(p) for p in path]
    if "experts" in names and names[-2] in _EXPERT_SPLIT:
        return _EXPERT_SPLIT[names[-2]]
    owner = names[-2] if len(names) >= 2 else ""
    if owner in _SPLIT:
        return _SPLIT[owner]
    return None


def spec_for(path: tuple, ndim: int) -> P:
    axis = split_axis(path)
    if axis is None:
        return P()
    return P(*[AXIS if i == axis else None for i in range(ndim)])


def param_specs(state) -> object:
    """PartitionSpecs for a model state pytree (an nnx.State)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: spec_for(path_names(path), x.ndim), state)


def path_names(path) -> tuple:
    """Module-tree names of a pytree path, without nnx's trailing `.value`."""
    keys = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return keys[:-1] if keys and keys[-1] == "value" else keys


def shard_state(state, mesh: Mesh):
    """Place a model state on the mesh with the tp split, checking that split axes divide evenly
    (and that fp8 block scales split on 128-row boundaries)."""
    tp = mesh.shape[AXIS]

    def place(path, x):
        keys = path_names(path)
        spec = spec_for(keys, x.ndim)
        axis = split_axis(keys)
        if axis is not None and tp > 1:
            name = ".".join(map(str, keys))
            if x.shape[axis] % tp:
                raise ValueError(f"parameter {name} of shape {tuple(x.shape)}: axis {axis} does not divide by tp={tp}")
            if x.dtype == FP8 and (x.shape[axis] // tp) % BLOCK:
                raise ValueError(f"parameter {name} of shape {tuple(x.shape)}: fp8 block scales need each of the "
                                 f"tp={tp} slices of axis {axis} to be a multiple of {BLOCK}")
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)
