"""Abstract decode steps and their jaxprs, for the tests that inspect what a step traces (which
kernels, what glue, which operands) without weights or a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jcore

from jtilert.model.presets import preset
from jtilert.model.transformer import abstract_model, decode_weights, init_cache
from jtilert.ops.table import Ops


def decode_step(name: str, layers: int, ops: Ops, tokens: int = 1, mtp: bool = False):
    """(step, abstract weights, abstract cache) of a decode step of preset `name` (`mtp`: then the
    MTP draft), for `jax.eval_shape` / `jax.make_jaxpr`."""
    cfg = preset(name, num_hidden_layers=layers)
    model = decode_weights(abstract_model(cfg, "fp8", jnp.bfloat16), backend=ops.config.backend)   # as Engine holds it
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: init_cache(cfg, 256, jnp.bfloat16))

    def step(state, cache):
        model = nnx.merge(graphdef, state)
        toks = jnp.zeros((tokens,), jnp.int32)
        h, cache = model.hidden(ops, toks, jnp.int32(100), cache)
        if mtp:
            _, cache = model.draft(ops, h, toks, jnp.int32(100), cache)
        return h, cache
    return step, state, cache


def sub_jaxprs(eqn):
    """The jaxprs inside an equation's parameters (a jit's body, a loop's, a cond's branches)."""
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else [v]:
            if hasattr(x, "jaxpr") and hasattr(x, "consts"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def count_primitives(jaxpr, name: str) -> int:
    """How often primitive `name` occurs in a jaxpr and every jaxpr nested in it."""
    return sum((e.primitive.name == name) + sum(count_primitives(j, name) for j in sub_jaxprs(e)) for e in jaxpr.eqns)


def layer_loops(jaxpr) -> list[tuple]:
    """The layer loops of a step's jaxpr (`Transformer._layers`: dense, then MoE), per loop: (its body's
    jaxpr, the body's counter: the trip's first layer, the layers a trip: the counter's increment)."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "while":
            body = e.params["body_jaxpr"].jaxpr
            counter = body.invars[e.params["body_nconsts"]]
            [step] = [q for q in body.eqns if body.outvars[0] in q.outvars]   # the counter's next value
            assert step.primitive.name == "add" and step.invars[0] is counter, step
            assert isinstance(step.invars[1], jcore.Literal), step
            out.append((body, counter, int(step.invars[1].val)))
    return out
