"""Which implementation the model's hot ops use while a step is traced.

The Flax modules call `ops()` for every op that has a fast path; `use(name)` selects the set for the
duration of a trace. "reference" is plain JAX (jtilert.layers); "pallas" swaps in the Mosaic-GPU
kernels where they exist and keeps the reference elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types

import jax
import numpy as np

from jtilert import layers

BACKENDS = ("reference", "pallas")

REFERENCE = types.SimpleNamespace(
    linear=layers.linear,
    swiglu=layers.swiglu,
    route=layers.route,
    moe_experts=layers.moe_experts,
    expert_hidden=layers.expert_hidden,
    swiglu_hidden=layers.swiglu_hidden,
    indexer_scores=layers.indexer_scores,
    indexer_append_scores=layers.indexer_append_scores,
    topk_positions=layers.topk_positions,
    sparse_mla=layers.sparse_mla,
    lm_head_topk=layers.lm_head_topk,
)

_current: contextvars.ContextVar[str] = contextvars.ContextVar("jtilert_backend", default="reference")


def check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    return name


@contextlib.contextmanager
def use(name: str):
    token = _current.set(check(name))
    try:
        yield
    finally:
        _current.reset(token)


def ops() -> types.SimpleNamespace:
    if _current.get() == "pallas":
        from jtilert.pallas import interpret, ops as pallas_ops  # lazily: Mosaic-GPU is optional on CPU
        return _lowered_once(pallas_ops(), interpret.params())
    return REFERENCE


def _lowered_once(table: types.SimpleNamespace, mode) -> types.SimpleNamespace:
    """`table` with every op behind its own `jax.jit`. Every layer calls the same kernels with the
    same shapes, and JAX traces and lowers a jitted callee once per signature and calls it after,
    so a 61-layer step lowers each Mosaic kernel once instead of once per layer (lowering the
    unwrapped ops took 29 s for 4 layers and 129 s for 8). Arguments that are not arrays (configs,
    k, the softmax scale) are static. `mode` (the interpret parameters, None on the GPU) keys the
    cache: kernels traced for the GPU and for the interpreter are different programs."""
    return types.SimpleNamespace(**{name: functools.partial(_call_jitted, fn, mode)
                                    for name, fn in vars(table).items()})


def _is_array(x) -> bool:
    return x is None or isinstance(x, (jax.Array, np.ndarray)) or (
        isinstance(x, (tuple, list)) and all(map(_is_array, x)))


def _call_jitted(fn, mode, *args, **kwargs):
    static = tuple(i for i, a in enumerate(args) if not _is_array(a))
    static_names = tuple(k for k, v in kwargs.items() if not _is_array(v))
    return _jitted(fn, static, static_names, mode)(*args, **kwargs)


@functools.cache
def _jitted(fn, static, static_names, mode):
    return jax.jit(fn, static_argnums=static, static_argnames=static_names)
