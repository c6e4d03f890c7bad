"""Attention kernels (issue 5) against the plain-JAX references, in GPU interpret mode on the CPU.

Every case draws fresh random inputs, runs the Mosaic-GPU kernel under the interpreter with race
detection (its buffers start as NaN, so an unwritten output element fails the comparison), and
also cross-lowers the kernel for CUDA, which catches Mosaic lowering errors without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtilert import layers
from jtilert.pallas import interpret as interp
from jtilert.pallas import sparse_mla as smla

BF16 = jnp.bfloat16


def _run(f, *args):
    """Cross-lower f for CUDA, then run it in interpret mode with race detection."""
    with interp.compile_for_gpu():
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    with interp.interpret(detect_races=True):
        out = jax.tree.map(np.asarray, f(*args))
        assert not interp.races_found()
    return out


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# ---- sparse MLA ------------------------------------------------------------------------------

@pytest.mark.parametrize("T,H,L,R,S,K,frac_valid", [
    (1, 16, 512, 64, 600, 128, 0.8),     # dsv32-tp8-shard widths, some rows masked
    (2, 8, 64, 16, 100, 32, 1.0),        # tiny widths (padded rope), K < block_k, MTP-verify T=2
    (1, 1, 64, 16, 40, 32, 0.5),         # one head per GPU (tiny at tp=8)
])
def test_sparse_mla(T, H, L, R, S, K, frac_valid):
    keys = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 6)
    ql = jax.random.normal(keys[0], (T, H, L), BF16)
    qp = jax.random.normal(keys[1], (T, H, R), BF16)
    kv = jax.random.normal(keys[2], (S, L), BF16)
    pe = jax.random.normal(keys[3], (S, R), BF16)
    idx = jnp.stack([jax.random.permutation(jax.random.fold_in(keys[4], t), S)[:K]
                     for t in range(T)]).astype(jnp.int32)
    valid = jax.random.uniform(keys[5], (T, K)) < frac_valid
    valid = valid.at[:, 0].set(True)
    f = functools.partial(smla.sparse_mla, scale=0.1)
    out = _run(f, ql, qp, kv, pe, idx, valid)
    ref = layers.sparse_mla(ql, qp, kv, pe, idx, valid, 0.1)
    assert out.shape == ref.shape and out.dtype == np.float32
    assert np.isfinite(out).all()
    assert _rel(out, ref) < 4e-3   # P is rounded to bf16 before P·V (as FlashMLA does)


def test_sparse_mla_negative_indices_mask():
    """idx < 0 with valid=None masks the row, like valid=False (the top-k kernel's convention)."""
    keys = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 5)
    T, H, L, R, S, K = 1, 16, 128, 64, 200, 64
    ql = jax.random.normal(keys[0], (T, H, L), BF16)
    qp = jax.random.normal(keys[1], (T, H, R), BF16)
    kv = jax.random.normal(keys[2], (S, L), BF16)
    pe = jax.random.normal(keys[3], (S, R), BF16)
    idx = jax.random.permutation(keys[4], S)[:K].astype(jnp.int32)[None]
    valid = jnp.arange(K)[None] < 37
    f = functools.partial(smla.sparse_mla, valid=None, scale=0.2)
    out = _run(lambda *a: f(*a), ql, qp, kv, pe, jnp.where(valid, idx, -1))
    ref = layers.sparse_mla(ql, qp, kv, pe, idx, valid, 0.2)
    assert _rel(out, ref) < 4e-3
