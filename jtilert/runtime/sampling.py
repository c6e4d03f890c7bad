"""Sampling settings (passed to the compiled step as arrays, so changing them never recompiles)."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 disable those filters; seed is in [0, 2**32)
    (the sampler's key is 32 bits: a larger seed would silently repeat a smaller one's draws)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")

    def arrays(self) -> dict:
        return {"temperature": jnp.float32(self.temperature), "top_k": jnp.int32(self.top_k),
                "top_p": jnp.float32(self.top_p)}


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def filtered_logprobs(logits: jax.Array, params: dict) -> jax.Array:
    """Log-probabilities [V] after temperature, top-k and top-p; filtered tokens get -inf."""
    t = jnp.maximum(params["temperature"], 1e-6)
    vals, order = jax.lax.top_k(logits / t, logits.shape[-1])  # sorted, descending
    rank = jnp.arange(vals.shape[-1])
    keep = (params["top_k"] <= 0) | (rank < params["top_k"])
    vals = jnp.where(keep, vals, -jnp.inf)
    probs = jax.nn.softmax(vals)
    keep &= (jnp.cumsum(probs) - probs) < params["top_p"]  # the smallest prefix with mass >= top_p
    vals = jnp.where(keep, vals, -jnp.inf)
    return jnp.full_like(logits, -jnp.inf).at[order].set(jax.nn.log_softmax(vals))


def sample(logits: jax.Array, params: dict, key: jax.Array) -> jax.Array:
    """One token id (int32) from logits [V]: argmax when temperature is 0."""
    return jax.lax.cond(
        params["temperature"] <= 0,
        lambda: jnp.argmax(logits).astype(jnp.int32),
        lambda: jax.random.categorical(key, filtered_logprobs(logits, params)).astype(jnp.int32))


def verify(logits: jax.Array, draft: jax.Array, params: dict, key: jax.Array):
    """Speculative check of a deterministic draft token against the target logits [V]:
    (accepted, token). Greedy accepts iff the draft is the argmax; sampling accepts with the target
    probability of the draft and otherwise samples from the target with the draft removed, which
    leaves the output distribution exactly the target's."""
    def greedy():
        best = jnp.argmax(logits).astype(jnp.int32)
        return best == draft, best

    def stochastic():
        k1, k2 = jax.random.split(key)
        lp = filtered_logprobs(logits, params)
        accepted = jax.random.uniform(k1) < jnp.exp(lp[draft])
        resample = jax.random.categorical(k2, lp.at[draft].set(-jnp.inf)).astype(jnp.int32)
        return accepted, jnp.where(accepted, draft, resample)

    return jax.lax.cond(params["temperature"] <= 0, greedy, stochastic)
