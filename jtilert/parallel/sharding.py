"""Tensor parallelism: the `tp` mesh and how each weight is split.

Weights are split the way TileRT splits them: attention by heads (q_b, kv_b rows; o_proj columns),
dense MLP and every expert by their intermediate dimension, the lm head by vocab; the small
projections (q_a, kv_a, the indexer, the router) and the embedding are replicated. Inside the step
(run under `shard_map`) each rank computes a partial sum of every row-split projection, and
`jtilert.ops.table.Ops.all_reduce` adds them.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jtilert.ops.quant import BLOCK, FP8

AXIS = "tp"

def make_mesh(tp: int = 1, devices=None) -> Mesh:
    """A 1-D mesh with axis "tp" over the first `tp` devices."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(tp, numbers.Integral) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    if tp > len(devices):
        raise ValueError(f"tp={tp} needs that many devices; {len(devices)} available")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def mesh_tp(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape[AXIS]


# Which axis of each weight is split over tp, by the parameter's name in the module tree.
_SPLIT = {
    "q_b_proj": 0, "kv_b_proj": 0, "o_proj": 1, "absorb_q": 0, "absorb_o": 0,   # (kv_b per head: by heads)
    "qr_proj": 0,   # the decode model's q_b | wq_b: one block of rows per rank (`decode_weights`)
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


def shard_state(state, mesh: Mesh):
    """Place a model state on the mesh with the tp split, checking that split axes divide evenly
    (and that fp8 block scales split on 128-row boundaries)."""
    tp = mesh.shape[AXIS]

    def place(path, x):
        keys = path_names(path)
        check_split(".".join(map(str, keys)), x.shape, x.dtype, tp)
        return jax.device_put(x, NamedSharding(mesh, spec_for(keys, x.ndim)))

    return jax.tree_util.tree_map_with_path(place, state)


# ---- checks before anything is placed ------------------------------------------------------------
# A sharding that does not divide an axis, or a model that does not fit, fails inside orbax or XLA with
# pages of sharding jargon or a repeated out-of-memory report; these say it in one line, before any work.

def check_tp(cfg, tp: int) -> None:
    """ValueError when tp does not divide a width that tensor parallelism splits evenly over the devices."""
    if tp == 1:
        return
    widths = {"num_attention_heads": cfg.num_attention_heads, "vocab_size": cfg.vocab_size}
    if cfg.first_k_dense_replace > 0:
        widths["intermediate_size"] = cfg.intermediate_size
    if cfg.first_k_dense_replace < cfg.num_hidden_layers:
        widths["moe_intermediate_size"] = cfg.moe_intermediate_size
    bad = [f"{k}={v}" for k, v in widths.items() if v % tp]
    if bad:
        fits = [str(d) for d in range(1, 65) if all(v % d == 0 for v in widths.values())]
        raise ValueError(f"tp={tp} does not divide the model's {', '.join(bad)} (tensor parallelism gives each "
                         f"device an equal share; tp can be {', '.join(fits)})")


def check_split(name: str, shape, dtype, tp: int) -> None:
    """ValueError when parameter `name`'s split axis does not divide by tp (or, fp8, when it is one of
    the two block-scaled last axes, not in whole blocks)."""
    axis = split_axis(tuple(name.split(".")))
    if axis is None or tp == 1:
        return
    shape = tuple(shape)
    if shape[axis] % tp:
        raise ValueError(f"parameter {name} of shape {shape}: axis {axis} does not divide by tp={tp}")
    if np.dtype(dtype) == FP8 and axis >= len(shape) - 2 and (shape[axis] // tp) % BLOCK:
        raise ValueError(f"parameter {name} of shape {shape}: fp8 block scales need each of the "
                         f"tp={tp} slices of axis {axis} to be a multiple of {BLOCK}")


def check_params(cfg, params: dict, mesh: Mesh | None) -> None:
    """check_tp, then check_split for every {name: array or ShapeDtypeStruct} (weights before scales,
    so an fp8 weight is named rather than its scale)."""
    tp = mesh_tp(mesh)
    check_tp(cfg, tp)
    for name in sorted(params, key=lambda n: n.endswith(".scale")):
        check_split(name, params[name].shape, params[name].dtype, tp)


def bytes_per_device(params: dict, mesh: Mesh | None) -> int:
    """Bytes each device of `mesh` holds of {name: array or ShapeDtypeStruct} (split axes over tp, the
    rest replicated)."""
    tp, total = mesh_tp(mesh), 0
    for name, x in params.items():
        axis = split_axis(tuple(name.split(".")))
        n = int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        total += n // tp if axis is not None else n
    return total


def free_bytes(device) -> tuple[int, int] | None:
    """(free, limit) bytes of a device's memory, or None where the runtime does not say (CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), stats["bytes_limit"]


def check_memory(need: int, mesh: Mesh | None, what: str) -> None:
    """MemoryError naming the bytes `what` needs on each device and what is free, when it does not fit."""
    devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
    for d in devices:
        got = free_bytes(d)
        if got is not None and need > got[0]:
            raise MemoryError(f"{what}: {_gib(need)} per device, more than the {_gib(got[0])} free on {d} "
                              f"(of {_gib(got[1])})")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)"
