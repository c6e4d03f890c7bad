"""Tensor parallelism: the `tp` mesh and how each weight is split.

Weights are split the way TileRT splits them: attention by heads (q_b, kv_b rows; o_proj columns),
dense MLP and every expert by their intermediate dimension, the lm head by vocab; the small
projections (q_a, kv_a, the indexer, the router) and the embedding are replicated. Inside the step
(run under `shard_map`) each rank computes a partial sum of every row-split projection, and
`jtilert.ops.table.Ops.all_reduce` adds them.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jtilert.ops.quant import BLOCK, FP8

AXIS = "tp"

def make_mesh(tp: int = 1, devices=None) -> Mesh:
    """A 1-D mesh with axis "tp" over the first `tp` devices."""
    devices = list(jax.devices() if devices is None else devices)
    if not 1 <= tp <= len(devices):
        raise ValueError(f"tp={tp} needs that many devices; {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (AXIS,))


# Which axis of each weight is split over tp, by the parameter's name in the module tree.
_SPLIT = {
    "q_b_proj": 0, "kv_b_proj": 0, "o_proj": 1,
    "gate_proj": 0, "up_proj": 0, "down_proj": 1,
    "lm_head": 0, "head": 0,
}
_EXPERT_SPLIT = {"gate": 1, "up": 1, "down": 2}


_STACKS = ("layers", "indexers", "dense", "moe")   # jtilert.model.transformer.STACKS: a leading layer axis


def split_axis(path: tuple) -> int | None:
    """The tp-split axis of the parameter at `path` (a tuple of module-tree keys), or None. Works for
    the model's stacked names (`moe.experts.gate.weight`, one more axis in front) and for per-layer
    checkpoint names (`layers.3.mlp.experts.gate.weight`)."""
    names = [str(p) for p in path]
    stacked = len(names) > 1 and names[0] in _STACKS and not names[1].isdigit()
    axis = None
    if "experts" in names and names[-2] in _EXPERT_SPLIT:
        axis = _EXPERT_SPLIT[names[-2]]
    elif len(names) >= 2 and names[-2] in _SPLIT:
        axis = _SPLIT[names[-2]]
    return None if axis is None else axis + stacked


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


def check_split(name: str, shape: tuple, dtype, tp: int) -> None:
    """Refuse a tp split of parameter `name` that does not divide its split axis evenly, or that cuts the
    128-row blocks of fp8 block scales."""
    axis = split_axis(tuple(name.split(".")))
    if axis is None or tp == 1:
        return
    if shape[axis] % tp:
        raise ValueError(f"parameter {name} of shape {tuple(shape)}: axis {axis} does not divide by tp={tp}")
    if dtype == FP8 and (shape[axis] // tp) % BLOCK:
        raise ValueError(f"parameter {name} of shape {tuple(shape)}: fp8 block scales need each of the "
                         f"tp={tp} slices of axis {axis} to be a multiple of {BLOCK}")


def shard_state(state, mesh: Mesh):
    """Place a model state on the mesh with the tp split, checking that split axes divide evenly
    (and that fp8 block scales split on 128-row boundaries)."""
    tp = mesh.shape[AXIS]

    def place(path, x):
        keys = path_names(path)
        check_split(".".join(map(str, keys)), x.shape, x.dtype, tp)
        return jax.device_put(x, NamedSharding(mesh, spec_for(keys, x.ndim)))

    return jax.tree_util.tree_map_with_path(place, state)
