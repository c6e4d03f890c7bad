"""backend="pallas" end to end: greedy tokens of the tiny fp8 model (bf16 activations) equal the
reference backend's, with the projection kernels running in GPU interpret mode.

The attention ops are pinned to the reference here (their kernels have their own tests), so this
checks the projection / SwiGLU / router wiring of `jtilert.pallas.dispatch`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtilert
from jtilert.pallas import dispatch, gemv


@pytest.fixture(scope="module")
def tiny_fp8_bf16():
    return jtilert.random_model("tiny", fmt="fp8", seed=1, dtype=jnp.bfloat16)


def test_pallas_backend_greedy_equals_reference(tiny_fp8_bf16, monkeypatch):
    monkeypatch.setattr(dispatch, "_attention_ops", lambda: {})
    jax.clear_caches()  # the ops are jitted callees: retrace them so the patched kernel entry is seen
    calls = []
    real = gemv._projection
    monkeypatch.setattr(gemv, "_projection", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = np.random.RandomState(1).randint(0, 256, 12)
    ref = jtilert.Generator(tiny_fp8_bf16, max_seq_len=64).generate(prompt, 2, stop_tokens=[])
    pal = jtilert.Generator(tiny_fp8_bf16, max_seq_len=64, backend="pallas").generate(prompt, 2, stop_tokens=[])
    assert pal == ref
    assert calls, "the GEMV kernels were not used"
