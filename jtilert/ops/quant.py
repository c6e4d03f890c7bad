"""fp8 e4m3 with 128×128 block scales: the DeepSeek-V3.2 checkpoint format, and the indexer's activation quantiser."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 128
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Scale tensor shape for a weight [..., out, in]: [..., ceil(out/128), ceil(in/128)]."""
    *lead, n, k = shape
    return (*lead, -(-n // BLOCK), -(-k // BLOCK))


def expand_scale(scale: jax.Array, shape: tuple[int, ...], block: int = BLOCK) -> jax.Array:
    """Broadcast block scales [..., nb, kb] of `block`² blocks to the full weight shape [..., n, k]."""
    *_, n, k = shape
    s = jnp.repeat(jnp.repeat(scale, block, axis=-2), block, axis=-1)
    return s[..., :n, :k]


def dequantize(w: jax.Array, scale: jax.Array | None, dtype=jnp.bfloat16, block: int = BLOCK) -> jax.Array:
    """W = q · scale_inv[i // block, j // block] for fp8 weights (the checkpoint's block is 128); a
    plain cast otherwise."""
    if scale is None:
        return w.astype(dtype)
    return (w.astype(jnp.float32) * expand_scale(scale, w.shape, block)).astype(dtype)


def quantize_weight(w: np.ndarray | jax.Array, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """Block-quantise a weight [..., out, in] to fp8 with power-of-two ("ue8m0") `block`² scales (the
    checkpoint's 128; `dequantize` takes the same `block`)."""
    w = jnp.asarray(w, jnp.float32)
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, nb * block - n), (0, kb * block - k)])
    blocks = padded.reshape(*lead, nb, block, kb, block)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = pow2_scale(amax)
    q = blocks / scale[..., :, None, :, None]
    q = q.reshape(padded.shape)[..., :n, :k].astype(FP8)
    return q, scale


def pow2_scale(amax: jax.Array) -> jax.Array:
    """Smallest power of two s with amax / s <= 448 (the official "ue8m0" scale format). ceil(log2)
    is read off the fp32 bits, as the official kernels do: exact where a rounded log2 is not, and
    the same integer ops in the Pallas kernels that quantise (jtilert.pallas.indexer)."""
    r = jnp.maximum(amax.astype(jnp.float32), 1e-4) / FP8_MAX     # a normal float: no subnormal case
    bits = jax.lax.bitcast_convert_type(r, jnp.int32)
    e = (bits >> 23) + jnp.where(bits & 0x7FFFFF, 1, 0).astype(jnp.int32)   # biased exponent of the ceiling
    return jax.lax.bitcast_convert_type(e << 23, jnp.float32)


def act_quant(x: jax.Array, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """Quantise the last axis in `block`-wide groups to fp8 with power-of-two scales, as the official
    DeepSeek-V3.2 indexer does: returns (q [..., d] fp8, scale [..., d // block] fp32)."""
    *lead, d = x.shape
    g = x.astype(jnp.float32).reshape(*lead, d // block, block)
    scale = pow2_scale(jnp.max(jnp.abs(g), axis=-1))
    q = (g / scale[..., None]).astype(FP8).reshape(*lead, d)
    return q, scale


def hadamard(d: int) -> np.ndarray:
    """Sylvester Hadamard matrix scaled by d^-0.5 (orthogonal): the official indexer's `rotate_activation`."""
    if d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {d}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h * d**-0.5
