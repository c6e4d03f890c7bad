"""The Pallas kernels against transformers: backend="pallas" (GPU interpret mode on a CPU) on the
kernel-sized golden models (tests/golden/kernel_models.py writes their bf16 checkpoints from the seed
in golden.npz; tests/golden/make_golden.py made the float32 transformers outputs).

Every op that has a kernel must run it: the op table's warning that a kernel does not apply is an
error here, and the ops that chose their kernel are recorded and checked. The prompt's first
index_topk tokens are a prefill chunk (more than 8 tokens: the reference path); every later
position is a one-token decode step through the kernels, and those positions have more causal keys
than index_topk, so the indexer really selects.

Tolerance: jtilert runs these models with bf16 activations (weights are bf16-exact on both sides),
transformers in float32. Logits reach |x| ≈ 9, where one bf16 step is 0.03-0.06; measured
differences are ≤ 0.1 on seeds without a flipped selection (a flipped indexer or router choice moves
logits by 0.5-3.5). make_golden.py picked seeds whose selections and greedy choices have margins
above the bf16 error (tests/golden/README.md), so atol 0.2 is 2× the measured error and far below a
flip; the greedy tokens must be equal.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtilert
from jtilert.ffi import _lib
from jtilert.ops import table
from jtilert.pallas import interpret as interp
from jtilert.store import checkpoint

from golden import kernel_models  # tests/golden/kernel_models.py (tests/ is on sys.path)

MODELS = sorted(kernel_models.CONFIGS)
ATOL = 0.2
# every op with a kernel, except the two that need the CUDA engine (expert_hidden: tp > 1 with the
# engine's all-reduce; topk_positions: the engine's top-k), the head, which only greedy decoding runs,
# the plain linear (without tp every projection of a layer folds a norm or the residual in),
# mla_prep: these models' rope rows of 16 values (32 bytes) are narrower than its 128-byte TMA rows, and
# index_prep: their index queries (64 wide) are not quantised, the kernel quantises 128-wide heads to fp8;
# route: the decode model's MoE routes with norm_route (the router's kernel applies the FFN's norm)
# sparse_mla_heads_linear merges the attention's splits in W_uv's kernel for latents of whole 128-column
# blocks: these models' latent is 64 wide, so their attention runs as sparse_mla then heads_linear (the
# merged form is checked at full width in tests/gpu/decode_check.py and tests/test_pallas_sparse_mla.py);
# attention_out, the same with o_proj as the pair's second phase, needs the same widths (its checks:
# tests/test_pallas_gemv_pair.py, tests/gpu/gemv_pair_check.py)
DECODE_OPS = {op for op, o in table.OPS.items() if o.kernel and op not in ("expert_hidden", "topk_positions",
                                                                              "lm_head_topk", "linear", "mla_prep",
                                                                              "index_prep", "route",
                                                                              "sparse_mla_heads_linear",
                                                                              "attention_out")}


@pytest.fixture(scope="module", params=MODELS)
def golden(request, tmp_path_factory):
    name = request.param
    g = dict(np.load(f"tests/golden/{name}/golden.npz"))
    folder = tmp_path_factory.mktemp(name)
    tensors = kernel_models.write_folder(name, int(g["seed"]), folder)
    assert kernel_models.checksum(tensors) == g["weights_crc32"], "NumPy drew other weights than make_golden.py"
    model = checkpoint.load_hf(folder)
    assert model.dtype == jnp.bfloat16
    return model, g


@pytest.fixture
def kernels_only(monkeypatch):
    """Warnings that a kernel does not apply are errors; yields the set of ops that ran a kernel."""
    monkeypatch.setattr(_lib, "_warned", set())   # each warning comes once per process: not hidden by an earlier test
    used = set()
    choose = table.Ops._use_kernel

    def record(self, name, op, args):
        use = choose(self, name, op, args)
        if use:
            used.add(name)
        return use

    monkeypatch.setattr(table.Ops, "_use_kernel", record)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="jtilert: backend='pallas'")
        # but: these models' q_nope (16 per head, as make_golden.py drew them) is narrower than the
        # heads_linear kernel's K grain; kv_b's other absorption (K = kv_lora) runs the kernel
        warnings.filterwarnings("ignore", message=r"jtilert: backend='pallas' but the heads_linear kernel .*K=16 ")
        warnings.filterwarnings("ignore", message=r"jtilert: backend='pallas' but the mla_prep kernel .*rope dim 16")
        warnings.filterwarnings("ignore",
                                message=r"jtilert: backend='pallas' but the index_prep kernel .*index_quant='none'")
        yield used


def test_kernel_logits_match_transformers(golden, kernels_only):
    model, g = golden
    ids, want = kernel_models.scored(g)
    k = model.cfg.index_topk
    assert g["input_ids"].size > k  # the sparse selection really runs
    # positions < index_topk: one prefill chunk (the reference), the rest one-token decode steps (kernels)
    logits = jtilert.score(model, ids, prefill=k, prefill_chunk=k, backend="pallas")
    assert kernels_only >= DECODE_OPS, DECODE_OPS - kernels_only
    np.testing.assert_allclose(logits, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("golden", ["dsv32_kernel"], indirect=True)   # the head kernel: one model is enough
def test_kernel_greedy_tokens_match_transformers(golden, kernels_only):
    model, g = golden
    ids, n = g["input_ids"], len(g["greedy"])
    gen = jtilert.Generator(model, max_seq_len=ids.size + n, backend="pallas", prefill_chunk=model.cfg.index_topk)
    out = gen.generate(ids, n, stop_tokens=[])
    want = DECODE_OPS | {"lm_head_topk"}
    assert kernels_only >= want, want - kernels_only
    assert out == g["greedy"].tolist()


def test_kernel_steps_lower_for_the_gpu(golden, kernels_only):
    """The same models' greedy decode step lowered for CUDA (no GPU needed): interpret mode never runs
    Mosaic's layout inference or its TMA checks, which these small shapes (K = 64, rows of 208
    columns) reach and the full-size models do not."""
    model, _ = golden
    gen = jtilert.Generator(model, max_seq_len=64, backend="pallas", prefill_chunk=model.cfg.index_topk)
    eng = gen.engine
    cache = eng.new_cache(gen.rows)
    token, pos, key = jnp.zeros((1,), jnp.int32), jnp.int32(40), jax.random.PRNGKey(0)
    step = eng._wrap(eng._decode)
    with interp.compile_for_gpu():
        text = jax.jit(step).trace(eng.state, cache, token, pos, key, jtilert.Sampling().arrays()).lower(
            lowering_platforms=("cuda",)).as_text()
    want = DECODE_OPS | {"lm_head_topk"}
    assert kernels_only >= want, want - kernels_only
    assert text.count("custom_call @mosaic_gpu") >= len(DECODE_OPS)
