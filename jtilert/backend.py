"""Which implementation the model's hot ops use while a step is traced.

The Flax modules call `ops()` for every op that has a fast path; `use(name)` selects the set for the
duration of a trace. "reference" is plain JAX (jtilert.layers); "pallas" swaps in the Mosaic-GPU
kernels where they exist and keeps the reference elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

from jtilert import layers

BACKENDS = ("reference", "pallas")

REFERENCE = types.SimpleNamespace(
    linear=layers.linear,
    swiglu=layers.swiglu,
    route=layers.route,
    moe_experts=layers.moe_experts,
    indexer_scores=layers.indexer_scores,
    topk_positions=layers.topk_positions,
    sparse_mla=layers.sparse_mla,
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
        from jtilert.pallas import ops as pallas_ops  # imported lazily: Mosaic-GPU is optional on CPU
        return pallas_ops()
    return REFERENCE
