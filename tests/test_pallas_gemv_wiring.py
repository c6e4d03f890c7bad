"""backend="pallas" end to end: decode logits of the tiny fp8 model (bf16 activations) within bf16
tolerance of the reference backend's, and the same greedy choices where the choice is clear, with the
decode step's kernels of `jtilert.ops.table.OPS` (projections, the fused norm + projection (the
indexer's fp32 head weights among them) and projection + residual, SwiGLU, router, indexer append + scoring, sparse MLA, kv_b's absorption per
head) running in GPU interpret mode. The prompt is longer than tiny's index_topk (32), so the indexer
really selects. The lm head's top-candidates kernel runs where a Generator samples:
tests/test_golden_kernels.py's greedy test decodes with it (the op table must choose it, a kernel that
refuses is an error there) to transformers' tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jtilert
from jtilert.pallas import gemv, indexer, sparse_mla


def test_pallas_backend_greedy_equals_reference(tiny_fp8, monkeypatch):
    assert tiny_fp8.dtype == jnp.bfloat16   # fp8 weights compute in bf16
    # the calls are recorded while tracing: programs an earlier test traced with the same shapes would
    # be reused from JAX's caches and record nothing
    from jtilert.ops import table
    jax.clear_caches()
    table._jitted.cache_clear()
    table._kernel.cache_clear()   # the op table's kernels, looked up again (the recording ones)
    calls = []
    real = gemv._projection
    def projection(*a, **k):   # the fused forms: a norm prologue, a residual epilogue
        calls.append("gemv" + "".join(f"+{f}" for f in ("norm", "residual") if k.get(f) is not None))
        return real(*a, **k)
    monkeypatch.setattr(gemv, "_projection", projection)
    for mod, name in ((indexer, "indexer_scores_kernel"), (sparse_mla, "sparse_mla_partials"),
                      (gemv, "heads_linear")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _f=fn, _n=name, **k: calls.append(_n) or _f(*a, **k))
    prompt = np.random.RandomState(1).randint(0, 256, 40)
    # logits of 4 one-token steps (the decode-shaped kernels) after a 36-token prefill
    ref = jtilert.score(tiny_fp8, prompt, prefill=36)[36:]
    pal = jtilert.score(tiny_fp8, prompt, prefill=36, backend="pallas")[36:]
    err = np.abs(pal - ref).max()
    assert err <= 2e-2 * np.abs(ref).max()
    # greedy tokens agree wherever the reference's top two are further apart than the kernels' error
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * err
    assert clear.sum() >= 2 and (pal.argmax(-1) == ref.argmax(-1))[clear].all()
    # heads_linear: kv_b's latent → v absorption (tiny's q_nope of 16 is narrower than its K grain)
    assert {"gemv", "gemv+norm", "gemv+residual", "indexer_scores_kernel", "sparse_mla_partials",
            "heads_linear"} <= set(calls), f"a kernel was not used: {set(calls)}"
    # the decode model's fused GEMVs, each kernel signature traced once (the dense and MoE bodies share
    # the attention's; prefill chunks run the reference): x_proj, qr_proj and the indexer's head weights
    # with their norms, and the FFN's norm in the dense gate/up, the router (which writes the normed x
    # for the routed experts) and the shared expert's gate/up; o_proj, the dense down and the shared
    # expert's down with the residual
    assert calls.count("gemv+norm") == 6 and calls.count("gemv+residual") == 3, calls
