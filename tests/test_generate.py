import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtilert
from jtilert import Sampling
from jtilert.model.transformer import init_cache
from jtilert.ops.table import Ops

PROMPT = np.random.RandomState(1).randint(0, 256, 40)  # longer than tiny's index_topk (32)


@pytest.fixture(scope="module")
def gen(tiny_random):
    return jtilert.Generator(tiny_random, max_seq_len=256)


@pytest.fixture(scope="module")
def spec(tiny_random):
    """gen's speculative twin (tests that count compilations make their own)."""
    return jtilert.Generator(tiny_random, max_seq_len=256, mtp=True)


def test_mtp_greedy_equals_plain_greedy(gen, spec):
    plain = gen.generate(PROMPT, 24, stop_tokens=[])
    assert spec.generate(PROMPT, 24, stop_tokens=[]) == plain
    assert spec.stats["drafted"] > 0 and 0 <= spec.acceptance <= 1
    assert gen.acceptance is None


def test_chunk_plan_minimises_fixed_plus_size_per_chunk():
    """A chunk costs CHUNK_FIXED_TOKENS (650) + its size: the plan covering the prompt at least cost."""
    from jtilert.runtime.generate import CHUNK_FIXED_TOKENS, DEFAULT_PREFILL_CHUNK, chunk_plan, chunk_sizes
    assert chunk_sizes(64) == (64,) and chunk_sizes([64, 1024, 64]) == (1024, 64)
    assert CHUNK_FIXED_TOKENS == 650 and DEFAULT_PREFILL_CHUNK == (1024, 128)
    sizes = (1024, 128)
    assert chunk_plan(300, sizes) == [1024]         # 650 + 1024 = 1674 < 3 * 650 + 384 = 2334
    assert chunk_plan(1100, sizes) == [1024, 128]   # 2 * 650 + 1152 = 2452 < 2 * 650 + 2048 = 3348
    assert chunk_plan(200, sizes) == [128, 128]     # 2 * 650 + 256 = 1556 < 1674
    assert chunk_plan(100, sizes) == [128] and chunk_plan(1024, sizes) == [1024]
    assert chunk_plan(32768, sizes) == [1024] * 32 and chunk_plan(32769, sizes) == [1024] * 32 + [128]
    assert chunk_plan(1100, (1024, 256, 64)) == [1024, 256]   # 2580 < 1024 + 64 + 64: 3 * 650 + 1152 = 3102
    assert chunk_plan(300, (1024, 256, 64)) == [256, 64]      # 2 * 650 + 320 = 1620 < 1674
    assert chunk_plan(1000, (1024, 64)) == [1024]             # 1674 < 16 * 650 + 1024
    assert chunk_plan(2100, (1024, 64)) == [1024, 1024, 64] and chunk_plan(2048, (1024, 64)) == [1024, 1024]
    # the cost model's fixed part decides between padding and more chunks
    assert chunk_plan(45, (32, 8)) == [32, 32] and chunk_plan(45, (32, 8), fixed=4) == [32, 8, 8]
    assert chunk_plan(130, (64, 16), fixed=0) == [64, 64, 16]
    # within the cache's rows: 56 rows leave no room for a second 32
    assert chunk_plan(45, (32, 8), room=56) == [32, 8, 8]
    with pytest.raises(ValueError, match="no plan"):
        chunk_plan(45, (32,), room=50)
    for bad in (0, -1, [], [64, 0], "64", 2.5):
        with pytest.raises(ValueError, match="prefill_chunk must be"):
            chunk_sizes(bad)


def test_generator_plans_within_its_cache_rows(tiny_random):
    """The default chunks are (1024, 128), those longer than max_seq_len dropped; the cache has room for
    a chunk of the smallest size after any start, and prefill pads within it."""
    from jtilert.runtime.generate import chunk_plan
    gen = jtilert.Generator(tiny_random, max_seq_len=200)
    assert gen.chunks == (128,) and gen.rows == 384   # 200 + 4 + 127 rounded up to 128
    assert jtilert.Generator(tiny_random, max_seq_len=2048).chunks == (1024, 128)
    small = jtilert.Generator(tiny_random, max_seq_len=45, prefill_chunk=(32, 8))
    assert small.rows == 56 and chunk_plan(45, small.chunks, small.rows) == [32, 8, 8]
    assert chunk_plan(3, small.chunks, small.rows - 43) == [8]   # after an injected 43 tokens: rows 43..50


def test_prefill_in_chunks_of_several_sizes_is_the_same_computation(tiny_random, gen, monkeypatch):
    """Large chunks then small: the same logits as one size, the same greedy tokens with MTP (which
    walks the main model's hidden chunks) as without it in one chunk (gen), one compiled step per size
    and none after the first call. A fixed cost of 4 tokens per chunk makes the plans mix the sizes
    (32 + 8 + 8 for 45 tokens)."""
    from jtilert.runtime import generate
    monkeypatch.setattr(generate, "CHUNK_FIXED_TOKENS", 4)
    ids = np.random.RandomState(3).randint(0, 256, 45)   # 32 + 8 + 5 (padded to 8)
    a = jtilert.score(tiny_random, ids, prefill=ids.size, prefill_chunk=8)
    b = jtilert.score(tiny_random, ids, prefill=ids.size, prefill_chunk=(32, 8))
    np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
    plain = gen.generate(ids, 12, stop_tokens=[])
    spec = jtilert.Generator(tiny_random, max_seq_len=128, mtp=True, prefill_chunk=(32, 8))
    assert spec.generate(ids, 12, stop_tokens=[]) == plain
    first = spec.compiles
    assert first == 2 * 4 + 1   # per size: prefill chunk, first token, MTP prefill, first draft; the loop
    spec.generate(ids[:20], 12, stop_tokens=[])   # small chunks only, then a prompt that is all large chunks
    spec.generate(ids[:32], 12, stop_tokens=[])
    assert spec.compiles == first


def test_prefill_with_the_indexer_in_blocks_of_rows_is_the_same_computation(tiny_random, monkeypatch):
    """The indexer scoring a block of 128 cache rows at a time (a tile budget below [T, H, S]: 176 rows,
    the last block partial and skipped by the early chunks) gives the logits of the one-shot scores."""
    from jtilert.ops import reference
    ids = np.random.RandomState(5).randint(0, 256, 150)
    whole = jtilert.score(tiny_random, ids, prefill=ids.size, prefill_chunk=16)
    heads = tiny_random.cfg.index_n_heads
    monkeypatch.setattr(reference, "INDEX_TILE_BYTES", 16 * heads * 4 * 128)
    assert reference.indexer_key_block(16, heads, 176) == 128
    blocked = jtilert.score(tiny_random, ids, prefill=ids.size, prefill_chunk=16)
    np.testing.assert_allclose(blocked, whole, rtol=1e-4, atol=1e-4)


def test_stats_measure_compile_first_token_and_decode_apart(tiny_random):
    """Compilation is timed on its own (all of it before the clock of the first token starts), the
    first token's wait is the prefill's, and the decode rate counts only the tokens after it."""
    import time
    gen = jtilert.Generator(tiny_random, max_seq_len=256, mtp=True)
    t0 = time.perf_counter()
    out = list(gen.stream(PROMPT, 30, stop_tokens=[]))
    wall = time.perf_counter() - t0
    s = gen.stats
    assert len(out) == s["generated"] == 30 and s["prompt_tokens"] == PROMPT.size
    assert s["compile_s"] > 0 and gen.compiles == 5   # prefill chunk, first token, MTP prefill, first draft, step
    assert s["compile_s"] + s["ttft_s"] + s["decode_s"] <= wall
    assert s["ttft_s"] < s["compile_s"]   # no compilation inside the first token's time
    assert s["ms_per_token"] == pytest.approx(s["decode_s"] / 29 * 1e3)
    assert s["tokens_per_s"] == pytest.approx(29 / s["decode_s"]) and 0 <= s["acceptance"] <= 1
    gen.generate(PROMPT, 30, stop_tokens=[])            # the device loop: its step compiles now
    assert gen.stats["compile_s"] > 0 and gen.compiles == 6
    list(gen.stream(PROMPT[:10], 5, stop_tokens=[]))    # everything compiled: nothing to wait for
    assert gen.stats["compile_s"] == 0 and gen.compiles == 6


def test_nothing_compiles_after_the_first_call(tiny_random):
    """The steps compile on the first call of a Generator (once each: the prefill chunk, the first-token
    sampler, the decode loop, the streaming step), and never again: not for new sampling settings, not
    for another prompt length, not for streaming after generating."""
    import jax
    gen = jtilert.Generator(tiny_random, max_seq_len=256)
    backend_compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, _secs, **kw: backend_compiles.append(name) if name == "/jax/core/compile/backend_compile_duration"
        else None)
    gen.generate(PROMPT[:8], 4, stop_tokens=[])
    list(gen.stream(PROMPT[:8], 4, stop_tokens=[]))
    first, seen = gen.compiles, len(backend_compiles)
    assert first == 4
    out = gen.generate(PROMPT[:8], 200, stop_tokens=[], sampling=Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3))
    out2 = gen.generate(PROMPT[:20], 30, stop_tokens=[], sampling=Sampling(temperature=1.3, seed=4))
    out3 = list(gen.stream(PROMPT[:30], 12, stop_tokens=[], sampling=Sampling(temperature=0.5, seed=5)))
    assert len(out) == 200 and len(out2) == 30 and len(out3) == 12
    assert gen.compiles == first and len(backend_compiles) == seen


def test_decode_arguments_do_not_grow_with_layers(tiny_fp8):
    """The layer stacks keep the arrays a decode call passes to a few dozen, whatever the depth (tiny's
    4 layers and 2)."""
    two = jtilert.random_model(jtilert.preset("tiny", num_hidden_layers=2), fmt="fp8")
    assert two.cfg.num_hidden_layers == 2 and tiny_fp8.cfg.num_hidden_layers == 4
    counts = [jtilert.Generator(m, max_seq_len=64).engine.num_arguments for m in (two, tiny_fp8)]
    assert counts[0] == counts[1] <= 64


def test_sampling_is_seeded_and_filters(gen):
    s = Sampling(temperature=1.0, top_k=5, seed=7)
    a = gen.generate(PROMPT, 16, sampling=s, stop_tokens=[])
    assert a == gen.generate(PROMPT, 16, sampling=s, stop_tokens=[])
    assert a != gen.generate(PROMPT, 16, sampling=Sampling(temperature=1.0, top_k=5, seed=8), stop_tokens=[])
    greedy = gen.generate(PROMPT, 16, stop_tokens=[])
    assert gen.generate(PROMPT, 16, sampling=Sampling(temperature=0.7, top_k=1, seed=1), stop_tokens=[]) == greedy
    assert gen.generate(PROMPT, 16, sampling=Sampling(temperature=0.7, top_p=1e-6, seed=1), stop_tokens=[]) == greedy


def test_filtered_logprobs():
    import jax.numpy as jnp

    from jtilert.runtime.sampling import filtered_logprobs
    logits = jnp.array([0.0, 3.0, 1.0, 2.0, -1.0])
    p = np.exp(np.asarray(filtered_logprobs(logits, Sampling(temperature=1.0, top_k=2).arrays())))
    assert np.count_nonzero(p) == 2 and p[1] > p[3] > 0 and p.sum() == pytest.approx(1)
    probs = np.exp(np.array([0.0, 3.0, 1.0, 2.0, -1.0])) / np.exp(np.array([0.0, 3.0, 1.0, 2.0, -1.0])).sum()
    p = np.exp(np.asarray(filtered_logprobs(logits, Sampling(temperature=1.0, top_p=0.8).arrays())))
    assert set(np.flatnonzero(p)) == {1, 3}  # 0.665 < 0.8 <= 0.665 + 0.245
    assert probs[1] < 0.8 <= probs[1] + probs[3]


def test_mtp_sampling_keeps_target_distribution_support(spec):
    out = spec.generate(PROMPT, 20, sampling=Sampling(temperature=0.9, top_k=3, seed=5), stop_tokens=[])
    assert len(out) == 20 and all(0 <= t < 256 for t in out)


def test_stop_tokens_and_stream(gen):
    full = gen.generate(PROMPT, 12, stop_tokens=[])
    stop = full[5]
    first = full.index(stop)
    assert gen.generate(PROMPT, 12, stop_tokens=[stop]) == full[:first + 1]
    assert list(gen.stream(PROMPT, 12, stop_tokens=[stop])) == full[:first + 1]
    streamed = []
    for t in gen.stream(PROMPT, 12, stop_tokens=[]):
        streamed.append(t)
    assert streamed == full
    # a stream ends as soon as a stop token is read: at most the one step in flight runs past it
    list(gen.stream(PROMPT, 12, stop_tokens=[stop]))
    assert gen.stats["steps"] <= first + 1


def test_inject_cache_continues_like_plain_prefill(tiny_random, gen):
    ids = PROMPT[:36]
    expected = gen.generate(ids, 10, stop_tokens=[])
    caches = gen.prefill(ids[:30])
    other = jtilert.Generator(tiny_random, max_seq_len=256)
    other.inject_cache(caches, ids[:30])
    assert other.generate(ids, 10, stop_tokens=[]) == expected
    bad = [dict(c, kv=c["kv"][:, :3]) for c in caches]
    with pytest.raises(ValueError, match=r"layer 0\.kv has shape"):
        other.inject_cache(bad, ids[:30])
    with pytest.raises(ValueError, match="layer caches"):
        other.inject_cache(caches[:2], ids[:30])
    with pytest.raises(TypeError, match="not a length"):
        other.inject_cache(caches, 30)


def test_injected_cache_refuses_a_prompt_that_does_not_extend_its_tokens(tiny_random, gen):
    """A prompt must start with the injected token ids (decoding it from the cache of other tokens
    would be silently wrong); a refused prompt leaves the cache injected for the right one."""
    ids = PROMPT[:36]
    other = jtilert.Generator(tiny_random, max_seq_len=256)
    other.inject_cache(gen.prefill(ids[:30]), ids[:30])
    changed = ids.copy()
    changed[7] = (changed[7] + 1) % 256
    with pytest.raises(ValueError, match=f"position 7 is {changed[7]} in the prompt, {ids[7]} in the cache"):
        other.generate(changed, 4, stop_tokens=[])
    with pytest.raises(ValueError, match="holds 30 tokens: the prompt must extend them"):
        other.generate(ids[:30], 4, stop_tokens=[])
    assert other.generate(ids, 4, stop_tokens=[]) == gen.generate(ids, 4, stop_tokens=[])


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt_ids=[], max_new_tokens=4), "non-empty"),
    (dict(prompt_ids=[1, 256], max_new_tokens=4), "outside the vocab"),
    (dict(prompt_ids=[1, -1], max_new_tokens=4), "outside the vocab"),
    (dict(prompt_ids=list(range(200)), max_new_tokens=100), "exceeds max_seq_len"),
    (dict(prompt_ids=[1.5, 2.0], max_new_tokens=4), "integers"),
    (dict(prompt_ids=[1, 2], max_new_tokens=2.5), r"max_new_tokens must be an integer >= 0, got 2\.5"),
    (dict(prompt_ids=[1, 2], max_new_tokens=-1), "max_new_tokens must be an integer >= 0, got -1"),
])
def test_bad_prompts_raise_before_device_work(gen, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gen.generate(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), r"top_k must be an integer >= 0, got 2\.5"),
    (dict(seed=99999999999999999999999), r"seed must be an integer in \[0, 2\*\*32\), got 9999"),
    (dict(seed=-1), "seed must be"), (dict(seed=1.0), "seed must be")])
def test_bad_sampling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


def test_bad_generator_settings(tiny_random):
    with pytest.raises(ValueError, match="backend"):
        jtilert.Generator(tiny_random, backend="cuda-magic")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        jtilert.Generator(tiny_random, max_seq_len=10**7)
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1 or a sequence of them, got 0"):
        jtilert.Generator(tiny_random, prefill_chunk=0)
    with pytest.raises(ValueError, match="max_seq_len must be a positive integer, got 2.5"):
        jtilert.Generator(tiny_random, max_seq_len=2.5)


@pytest.mark.parametrize("prefill", [0, -3, 37, 2.5])
def test_score_prefill_must_be_within_the_ids(tiny_random, prefill):
    with pytest.raises(ValueError, match=r"prefill must be an integer in \[1, 36\] \(the number of token ids\), "
                                         f"got {prefill}"):
        jtilert.score(tiny_random, PROMPT[:36], prefill=prefill)


def test_random_model_arguments_are_checked():
    with pytest.raises(ValueError, match=r"fmt 'int4': expected one of fp32, bf16, fp8"):
        jtilert.random_model("tiny", fmt="int4")
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\)"):
        jtilert.random_model("tiny", seed=99999999999999999999999)


def test_next_token_from_head_candidates(tiny_random):
    """Greedy and top-k ≤ HEAD_CANDIDATES sample from the head's candidates: greedy is the argmax of the
    full logits, top-k draws only from the full logits' top k; other settings sample the full row."""
    import jax
    import jax.numpy as jnp
    from jtilert.model.transformer import HEAD_CANDIDATES, init_cache
    from jtilert.ops.table import Ops
    m, ops = tiny_random, Ops()
    # jitted once each (the sampling settings are arguments): eagerly, every call traces the head's
    # lax.cond again
    h = jax.jit(lambda ids: m.hidden(ops, ids, 0, init_cache(m.cfg, 16, m.dtype))[0][-1:])(
        jnp.asarray(PROMPT[:12], jnp.int32))
    logits = np.asarray(jax.jit(lambda h: m.logits(ops, h, m.norm)[0])(h))
    next_token = jax.jit(lambda h, params, key: m.next_token(ops, h, params, key)[0])
    top = set(np.argsort(-logits)[:3])
    key = jax.random.PRNGKey(0)
    assert int(next_token(h, Sampling().arrays(), key)) == int(np.argmax(logits))
    drawn = {int(next_token(h, Sampling(temperature=5.0, top_k=3).arrays(), jax.random.fold_in(key, i)))
             for i in range(40)}
    assert drawn <= top and len(drawn) > 1
    wide = {int(next_token(h, Sampling(temperature=50.0).arrays(), jax.random.fold_in(key, i)))
            for i in range(40)}
    assert len(wide) > HEAD_CANDIDATES  # the full-row path: tokens beyond the candidates


def test_layers_per_iteration_gives_the_same_tokens_with_fewer_loop_iterations(tiny_random, gen):
    """DecodeConfig.layers_per_iteration (default 8): each layer loop's trip runs that many layers (at
    most its stack's), and the tokens equal one layer per iteration's; 0 is refused."""
    from decode_jaxprs import layer_loops   # tests/decode_jaxprs.py (tests/ is on sys.path)
    from jtilert.model.transformer import Layout
    cfg = jtilert.DecodeConfig()
    per = cfg.layers_per_iteration
    assert per == 8 and gen.engine.config == cfg
    g = jtilert.Generator(tiny_random, max_seq_len=256, config=jtilert.DecodeConfig(layers_per_iteration=1))
    assert g.generate(PROMPT, 12, stop_tokens=[]) == gen.generate(PROMPT, 12, stop_tokens=[])

    def loops(config):   # the layers a trip of each layer loop of the step
        ops = Ops(config)
        cache = init_cache(tiny_random.cfg, 64, tiny_random.dtype)
        jaxpr = jax.make_jaxpr(lambda t, c: tiny_random.hidden(ops, t, jnp.int32(3), c))(jnp.zeros(1, jnp.int32), cache)
        return [per_trip for _, _, per_trip in layer_loops(jaxpr.jaxpr)]
    lay = Layout.of(tiny_random.cfg)
    stacks = [n for n in (lay.num_dense, tiny_random.cfg.num_hidden_layers - lay.num_dense) if n]
    assert loops(jtilert.DecodeConfig(layers_per_iteration=1)) == [1] * len(stacks)
    assert loops(cfg) == [min(n, per) for n in stacks] and max(loops(cfg)) > 1
    with pytest.raises(ValueError, match="layers_per_iteration"):
        jtilert.DecodeConfig(layers_per_iteration=0)


def test_xla_options_reach_the_decode_steps_only(tiny_random, gen):
    """DecodeConfig.xla_options (e.g. XLA's command-buffer scheduling) are compile options of the
    decode-shaped steps; prefill chunks keep XLA's defaults; the tokens do not change."""
    cfg = jtilert.DecodeConfig(xla_options={"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
                                            "xla_gpu_command_buffer_unroll_loops": True})
    assert cfg.xla_options == (("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT"),
                               ("xla_gpu_command_buffer_unroll_loops", True))
    # the default: the layer loops in the command buffers, CONCURRENT scheduling, no rematerialization
    # (the fixture `gen` runs it)
    default = {"xla_disable_hlo_passes": "rematerialization", "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
               "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"}
    assert jtilert.DecodeConfig().xla_options == tuple(sorted(default.items()))
    # the device loops' also record every thunk sequence into a CUDA graph (Engine.loop_options)
    short = {"xla_gpu_graph_min_graph_size": "1"}
    assert gen.engine.decode._options == default and gen.engine.decode_loop._options == {**default, **short}
    g = jtilert.Generator(tiny_random, max_seq_len=256, config=cfg)
    assert g.generate(PROMPT, 12, stop_tokens=[]) == gen.generate(PROMPT, 12, stop_tokens=[])
    assert g.engine.forward._options is None and g.engine.decode._options == dict(cfg.xla_options)
    assert g.engine.decode_loop._options == {**dict(cfg.xla_options), **short}
    plain = jtilert.Generator(tiny_random, max_seq_len=256, config=jtilert.DecodeConfig(xla_options=()))
    assert plain.engine.decode_loop._options is None
    bad = jtilert.Generator(tiny_random, max_seq_len=256, config=jtilert.DecodeConfig(
        xla_options=(("xla_gpu_command_buffer_scheduling_mode", "BOGUS"),)))
    with pytest.raises(Exception, match="not a valid enum value"):   # XLA read it: it reached the compile
        bad.generate(PROMPT, 2, stop_tokens=[])
