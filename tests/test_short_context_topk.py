"""DecodeConfig.short_context_topk: below `index_topk` cached positions the indexer's selection is every
position, so the top-k is skipped (`reference.leading_positions` under a `lax.cond`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtilert
from jtilert.ffi import select
from jtilert.ops import reference
from jtilert.ops.table import DecodeConfig, Ops


def _scores(positions, rows, seed):
    """Random scores [T, rows] with -inf past each token's position, as the indexer masks them."""
    s = np.random.default_rng(seed).normal(size=(len(positions), rows)).astype(np.float32)
    s[np.arange(rows)[None] > np.asarray(positions)[:, None]] = -np.inf
    return jnp.asarray(s)


@pytest.mark.parametrize("positions", [[0], [13], [15], [3, 11]])
def test_leading_positions_are_the_top_k_where_every_position_fits(positions):
    """Every token's position below k: the top-k (lax.top_k's, in score order) selects the same set, and
    the engine's order (by position, -1 for the masked) is the same array."""
    k, rows = 16, 64
    scores = _scores(positions, rows, seed=sum(positions) + 1)
    got = np.asarray(reference.leading_positions(jnp.asarray(positions, jnp.int32), k))
    want = np.asarray(reference.topk_positions(scores, k))
    assert got.shape == want.shape == (len(positions), k)
    np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(want, axis=1))
    by_position = select.top_k_reference(scores, k, select.EMPTY_AS_MINUS_ONE)[1]
    np.testing.assert_array_equal(got, np.asarray(by_position))


@pytest.mark.parametrize("positions", [[5], [15], [16], [40], [3, 16]])
def test_the_op_selects_as_the_top_k_on_both_sides_of_the_switch(positions):
    """`Ops._topk_positions` under jit with traced positions: with the option, the leading positions
    below k (the same set as the top-k) and the top-k's own result from k on; without it, the top-k."""
    k, rows = 16, 64
    scores = _scores(positions, rows, seed=7 + sum(positions))
    pos = jnp.asarray(positions, jnp.int32)
    want = np.asarray(reference.topk_positions(scores, k))
    off = jax.jit(lambda s, p: Ops(DecodeConfig(short_context_topk=False))._topk_positions(s, k, p))(scores, pos)
    on = jax.jit(lambda s, p: Ops(DecodeConfig(short_context_topk=True))._topk_positions(s, k, p))(scores, pos)
    np.testing.assert_array_equal(np.asarray(off), want)
    if max(positions) < k:
        np.testing.assert_array_equal(np.asarray(on), np.asarray(reference.leading_positions(pos, k)))
        np.testing.assert_array_equal(np.sort(np.asarray(on), axis=1), np.sort(want, axis=1))
    else:
        np.testing.assert_array_equal(np.asarray(on), want)


def test_the_step_has_one_conditional_a_layer_and_generates_the_same_tokens(tiny_random):
    """The tiny model (index_topk 32) from a 20-token prompt for 24 tokens, so that its steps cross
    position 32: greedy tokens equal with and without the option; the option's decode step holds the
    switch (a conditional in each indexer layer's body)."""
    from jtilert.runtime.generate import Engine
    prompt = np.random.RandomState(3).randint(0, 256, 20)
    plain = jtilert.Generator(tiny_random, max_seq_len=128, config=DecodeConfig(short_context_topk=False))
    short = jtilert.Generator(tiny_random, max_seq_len=128, config=DecodeConfig(short_context_topk=True))
    assert short.generate(prompt, 24, stop_tokens=[]) == plain.generate(prompt, 24, stop_tokens=[])

    def cases(config):
        eng = Engine(tiny_random, config=config)
        tok = eng.place(jnp.asarray([5], jnp.int32))
        step = eng.forward._jit.trace(eng.state, eng.new_cache(64), tok, eng.place(jnp.int32(0)))  # noqa: SLF001
        txt = step.lower().as_text()
        return txt.count("stablehlo.case")
    assert cases(DecodeConfig(short_context_topk=True)) > cases(DecodeConfig(short_context_topk=False))
