"""The token ring (`jtilert.ffi.ring`, cuda/src/ring.cu): wiring, the CUDA lowering's custom call (kept with
its token unused, operands in order), the errors for what it does not take, that it lowers nowhere but
on the engine, the kernel's PTX (the key stored after a system-wide fence), and the host's read of a slot
(keys, counts, a key of an earlier generation, the timeout) on a ring in host memory. The engine's
self-test runs the kernel on the GPU (cuda/tests/selftest.cu, test_token_ring)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtilert.ffi import _lib
from jtilert.ffi import ops as ffi_ops
from jtilert.ffi import ring
from test_ffi_prefetch import _cuda_text, _nvcc

ROOT = pathlib.Path(__file__).resolve().parents[1]
S = jax.ShapeDtypeStruct


def test_ring_is_built_registered_and_its_sizes_agree():
    assert "src/ring.cu" in (ROOT / "cuda" / "CMakeLists.txt").read_text()
    assert "XLA_FFI_DEFINE_HANDLER_SYMBOL(JtTokenRing" in (ROOT / "cuda" / "src" / "ffi.cc").read_text()
    header = (ROOT / "cuda" / "include" / "jtilert" / "engine.h").read_text()
    assert "cudaError_t jt_token_ring_write(" in header and "int32_t* jt_token_ring(" in header
    assert f"#define JT_RING_SLOTS {ring.SLOTS}\n" in header
    assert f"#define JT_RING_SLOT_INTS {ring.SLOT_INTS}\n" in header
    assert _lib.TARGETS["jtilert_token_ring"] == "JtTokenRing"


@pytest.mark.parametrize("loop", [False, True])
def test_the_carried_position_keeps_the_write(monkeypatch, loop):
    """A step that carries the position the write returns keeps the call, at the top level and in a
    loop, with no side effect (which would cost every launch of the step); its operands are the key,
    the values and the count, int32 each. Compiled, XLA keeps it too."""
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)

    def step(pos, tok):
        nxt = tok * 3 + pos
        return ring.write(pos, nxt), nxt
    f = step if not loop else (lambda pos, tok: jax.lax.fori_loop(0, 4, lambda i, c: step(*c), (pos, tok)))
    txt = _cuda_text(jax.jit(f), S((), jnp.int32), S((1,), jnp.int32))
    calls = [line for line in txt.splitlines() if "custom_call @jtilert_token_ring" in line]
    assert len(calls) == 1 and "has_side_effect = true" not in calls[0], txt
    assert re.search(r"\(tensor<1xi32>, tensor<1xi32>, tensor<1xi32>\) -> tensor<1xi32>", calls[0]), calls[0]


def test_the_next_position_takes_the_keys_buffer(monkeypatch):
    """The write's result is aliased to its key (`pos`): XLA writes the next position over it, so a
    loop that carries it needs no copy into the carried buffer after the write (a memcpy node at the
    end of each step's graph, where the next step waits on it). The kernel reads the key before it
    writes the result."""
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    txt = _cuda_text(jax.jit(lambda pos, tok: ring.write(pos, tok * 3 + pos)), S((), jnp.int32), S((1,), jnp.int32))
    call = next(line for line in txt.splitlines() if "custom_call @jtilert_token_ring" in line)
    assert re.search(r"output_operand_alias<output_tuple_indices = \[\], operand_index = 0,", call), call
    src = (pathlib.Path(__file__).parents[1] / "cuda" / "src" / "ring.cu").read_text()
    kernel = src[src.index("__global__ void ring_write_kernel"):]
    assert kernel.index("= *pos;") < kernel.index("next[0] =")


def test_inside_shard_map_each_device_writes(monkeypatch):
    """With tp > 1 the step runs under shard_map (as `Engine._wrap` makes it): one call a device, each
    writing into its own device's ring."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 host devices (tests/conftest.py sets XLA_FLAGS)")
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    f = jax.jit(jax.shard_map(lambda p, t: (ring.write(p, t * 2), t * 2), mesh=mesh, in_specs=(P(), P()),
                              out_specs=(P(), P()), check_vma=False))
    txt = _cuda_text(f, S((), jnp.int32), S((1,), jnp.int32))
    assert len([line for line in txt.splitlines() if "custom_call @jtilert_token_ring" in line]) == 1, txt


def test_an_unused_position_drops_the_write(monkeypatch):
    """What the docstring warns of: the write's result unused, JAX drops the call."""
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    txt = _cuda_text(jax.jit(lambda p, t: (ring.write(p, t), p + 1)[1]), S((), jnp.int32), S((1,), jnp.int32))
    assert "jtilert_token_ring" not in txt


def test_the_next_position_is_the_key_plus_the_count():
    """The position the write returns, as the kernel computes it, in the shape of the one given (a
    trace without a GPU: the abstract value only)."""
    out = jax.eval_shape(lambda p, em, n: ring.write(p, em, n), S((), jnp.int32), S((2,), jnp.int32), S((), jnp.int32))
    assert out.shape == () and out.dtype == jnp.int32
    out = jax.eval_shape(lambda p, t: ring.write(p, t), S((1,), jnp.int32), S((1,), jnp.int32))
    assert out.shape == (1,)


def test_two_values_and_their_count(monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    f = jax.jit(lambda pos, em, n: ring.write(pos, em, n))
    txt = _cuda_text(f, S((), jnp.int32), S((2,), jnp.int32), S((), jnp.int32))
    call = next(line for line in txt.splitlines() if "custom_call @jtilert_token_ring" in line)
    assert re.search(r"\(tensor<1xi32>, tensor<2xi32>, tensor<1xi32>\)", call), call


def test_the_write_survives_the_program_cache(monkeypatch):
    """A step with the write exported, stored and read back as the program cache does (pickled), then
    lowered for the GPU: the custom call is still there."""
    import dataclasses
    import pickle

    from jtilert.runtime import compile_cache
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    f = jax.jit(lambda p, t: (ring.write(p, t * 2), t * 2), donate_argnums=(1,))
    args = (jnp.int32(3), jnp.ones(1, jnp.int32))
    exported = compile_cache.export(f, args, platforms=("cuda",), custom_calls=tuple(_lib.TARGETS))
    stored = pickle.loads(pickle.dumps(dataclasses.replace(exported, _get_vjp=None)))
    txt = compile_cache.lower_exported(stored, (1,), args, platforms=("cuda",)).as_text()
    calls = [line for line in txt.splitlines() if "custom_call @jtilert_token_ring" in line]
    assert len(calls) == 1, txt


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match=f"1 to {ring.MAX_VALUES} values, got 7"):
        ring.write(jnp.int32(0), jnp.zeros(7, jnp.int32))
    with pytest.raises(ValueError, match="got 0"):
        ring.write(jnp.int32(0), jnp.zeros(0, jnp.int32))


def test_it_lowers_only_where_the_engine_runs():
    """No silent no-op: a host waiting for a token nobody writes would wait for ever."""
    with pytest.raises(NotImplementedError, match="CUDA engine"):
        jax.jit(lambda p, t: ring.write(p, t)).lower(jnp.int32(3), jnp.ones(1, jnp.int32))
    if _lib.load()[0] is None:
        with pytest.raises(NotImplementedError, match="not loaded"):
            _cuda_text(jax.jit(lambda p, t: ring.write(p, t)), S((), jnp.int32), S((1,), jnp.int32))
        with pytest.raises(RuntimeError, match="token ring: the CUDA engine is not loaded"):
            ring.TokenRing(jax.devices()[0])


def test_a_stream_takes_every_device_of_its_rings():
    """An engine over devices 0 and 1 and one on device 1 cannot both stream on rings (the first's
    steps write into device 1's ring too); one on device 2 can; all free once given back."""
    from types import SimpleNamespace as NS
    on = lambda *ids: [NS(device=NS(id=i)) for i in ids]
    assert ring.acquire(on(0, 1))
    assert not ring.acquire(on(1)) and not ring.acquire(on(1, 5))
    assert ring.acquire(on(2))
    ring.release(on(0, 1))
    ring.release(on(2))
    assert ring.acquire(on(0, 1, 2, 5))
    ring.release(on(0, 1, 2, 5))


class _HostRing(ring.TokenRing):
    """The reader over a ring in plain host memory (no engine): what the kernel's stores leave there."""

    def __init__(self):   # noqa: super().__init__ needs the engine
        self.slots = np.full((ring.SLOTS, ring.SLOT_INTS), -1, np.int32)

    def keys(self) -> list[int]:
        """The keys written since the ring was cleared, in order."""
        return sorted(int(k) for k in self.slots[:, 0] if k >= 0)

    def store(self, pos, values):   # as ring_write_kernel: values, count, then the key (none: nothing)
        if not len(values):
            return
        slot = self.slots[pos % ring.SLOTS]
        slot[2:2 + len(values)] = values
        slot[1] = len(values)
        slot[0] = pos


def test_the_host_reads_each_step_by_its_key():
    r = _HostRing()
    rng = np.random.default_rng(0)
    pos = 2 * ring.SLOTS - 3   # the slots wrap around
    for i in range(6):
        vals = rng.integers(0, 150_000, size=1 + i % 2).astype(np.int32)
        r.store(pos, vals)
        np.testing.assert_array_equal(r.read(pos), vals)
        pos += len(vals)


def test_a_key_of_an_earlier_generation_is_not_taken():
    r = _HostRing()
    r.store(5, [11])
    r.clear()
    with pytest.raises(TimeoutError, match="position 5 .*key -1"):
        r.read(5, timeout_s=0.01)
    r.store(5 + ring.SLOTS, [12])   # the same slot, another position
    r.store(7, [13, 14])
    with pytest.raises(TimeoutError, match=rf"key {5 + ring.SLOTS}; the ring's keys: \[7, {5 + ring.SLOTS}\]"):
        r.read(5, timeout_s=0.01)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA sources cannot be compiled here")
def test_kernel_stores_the_key_after_a_system_fence(tmp_path):
    """ring.cu alone to PTX for sm_90a, warnings as errors: the next position is stored first (a count
    of 0 ends there), then the values and the count, then a system-scope fence, then the key (volatile
    stores to the host's slot)."""
    ptx = tmp_path / "ring.ptx"
    cmd = [_nvcc(), "-gencode=arch=compute_90a,code=sm_90a", "-Werror=all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror",
           "-I", str(ROOT / "cuda" / "include"), "-ptx", str(ROOT / "cuda" / "src" / "ring.cu"), "-o", str(ptx)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    body = ptx.read_text().split("ring_write_kernel", 1)[1]
    fence = re.search(r"membar\.sys|fence\.sc\.sys", body)
    assert fence, body
    before, after = body[:fence.start()], body[fence.end():]
    assert len(re.findall(r"st\.volatile\.global\.u32", after)) == 1   # the key
    assert len(re.findall(r"st\.volatile\.global\.u32", before)) >= 2   # values (a loop) and the count
    nxt, first = re.search(r"st\.global\.u32", body), re.search(r"st\.volatile\.global", body)
    assert nxt and nxt.start() < first.start() and not re.search(r"st\.global\.u32", after)


# ---- in the Generator: DecodeConfig.token_ring --------------------------------------------------

def test_without_a_gpu_the_steps_return_their_tokens(tiny_random):
    """The ring is the default, and on a machine without a GPU the steps return their tokens, with no
    warning (nothing to fall back from)."""
    import warnings

    import jtilert
    assert jtilert.DecodeConfig().token_ring
    _lib._warned.clear()  # noqa: SLF001
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        eng = jtilert.Generator(tiny_random, max_seq_len=64).engine
    assert eng.rings is None and eng.ring is None
    assert not [r for r in rec if "ring" in str(r.message)]


@pytest.fixture
def host_ring(monkeypatch):
    """Engines built while it is active write their tokens into a `_HostRing` through a host callback
    (as the kernel would), and `Generator.stream` reads them from it."""
    from jtilert.runtime import generate

    r = _HostRing()
    r.device = jax.devices()[0]

    def write(pos, values, count=None):
        values = jnp.ravel(jnp.asarray(values, jnp.int32))
        count = jnp.int32(values.shape[0]) if count is None else count
        jax.experimental.io_callback(lambda p, v, c: r.store(int(p), np.asarray(v)[:int(c)]), None, pos, values,
                                     count, ordered=False)
        return pos + count
    monkeypatch.setattr(ring, "write", write)
    monkeypatch.setattr(generate.Engine, "_token_rings", lambda self: [r] if self.config.token_ring else None)
    return r


@pytest.mark.parametrize("behind", [False, True])
def test_the_stream_loops_carry_what_depends_on_the_write(behind):
    """In the stream's loop body the ring write's result is used: as the next position (the write at
    each step's end), or (the write behind) by the budget and by all three of the next write's
    operands, so that in the CUDA graph nothing overwrites what a write reads before it has read it
    (an order by control edges alone left an MTP stream's position unwritten on a GPU), and by the
    step's random key (the item after the position), so that the step's sampling waits for it."""
    from jtilert.runtime.generate import Engine

    def step(c):   # a two-token step: position first, then the key it draws from
        pos, key = c
        return (pos + 2, key + 1), jnp.stack([key, key + 1]), jnp.int32(2)

    def loop(pos, key, left, stops):
        return Engine._stream_loop(step, (pos, key), 0, 2, left, stops, behind=behind)
    jaxpr = jax.make_jaxpr(loop)(jnp.int32(0), jnp.int32(1), jnp.int32(5), jnp.full(8, -1, jnp.int32))
    [w] = [e for e in jaxpr.eqns if e.primitive.name == "while"]
    body = w.params["body_jaxpr"].jaxpr
    deps = set()
    for e in body.eqns:
        if e.primitive is ring.token_ring_p or any(type(v).__name__ != "Literal" and v in deps for v in e.invars):
            deps.update(e.outvars)
    out = body.outvars   # (pos, key), left, i[, (pos, tokens, count) of the step to write]
    if behind:
        assert [v in deps for v in out] == [False, True, True, False, True, True, True]
    else:
        assert [v in deps for v in out] == [True, False, False, False]


@pytest.mark.parametrize("behind", [False, True])
@pytest.mark.parametrize("mtp", [False, True])
def test_stream_through_the_ring_gives_the_same_tokens(tiny_random, host_ring, mtp, behind):
    """The whole stream with the steps writing into a ring (at each step's end, or while the next step
    runs): the tokens of the steps that return them (greedy, plain and MTP: one or two tokens a step),
    the ring keyed by each step's position."""
    import jtilert
    prompt = [3, 17, 5, 9]
    plain = jtilert.Generator(tiny_random, max_seq_len=64, mtp=mtp, config=jtilert.DecodeConfig(token_ring=False))
    assert plain.engine.rings is None
    want = list(plain.stream(prompt, 12, stop_tokens=[]))
    _lib._warned.clear()  # noqa: SLF001
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gen = jtilert.Generator(tiny_random, max_seq_len=64, mtp=mtp,
                                config=jtilert.DecodeConfig(ring_write_behind=behind))
    # plain and MTP streams alike take the write behind where asked for (the tiny model's layers have no
    # conditionals), without a word
    assert gen.engine.ring_behind == behind and not [w for w in caught if "ring_write_behind" in str(w.message)]
    assert gen.engine.ring is host_ring
    got = list(gen.stream(prompt, 12, stop_tokens=[]))
    assert got == want
    keys = host_ring.keys()
    assert keys[0] == len(prompt) and len(keys) >= gen.stats["steps"] - 1
    if mtp:
        assert gen.stats["drafted"] >= 1 and gen.acceptance == plain.acceptance
    # a second request on the same generator clears the ring first and reads only its own steps
    assert list(gen.stream(prompt[:2], 6, stop_tokens=[])) == list(plain.stream(prompt[:2], 6, stop_tokens=[]))


def test_a_model_whose_layers_run_conditionals_writes_at_each_steps_end(host_ring):
    """The shared indexer's layers run under a conditional, which the write behind would run beside:
    such a model's streams write at each step's end (one write in the loop body, none after it), with a
    warning once; a model without them takes the write behind (a second write, after the loop)."""
    import jtilert
    from decode_jaxprs import count_primitives
    from jtilert.runtime.generate import Engine

    def writes(eng):   # ring writes (host callbacks here) in the stream's program
        args = (eng.state, eng.new_cache(32), eng.place(jnp.array([1], jnp.int32)), eng.place(jnp.int32(3)),
                eng.place(jax.random.PRNGKey(0)), eng.place(np.int32(9)), eng.place(jtilert.Sampling().arrays()),
                eng.place(np.full(8, -1, np.int32)))
        return count_primitives(jax.make_jaxpr(eng.decode_stream._jit)(*args).jaxpr, "io_callback")   # noqa: SLF001

    _lib._warned.clear()  # noqa: SLF001
    with pytest.warns(RuntimeWarning, match="ring_write_behind does not apply to a model whose layers share"):
        shared = Engine(jtilert.random_model("tiny-glm5", fmt="fp32"))
    assert not shared.ring_behind and writes(shared) == 1
    plain = Engine(jtilert.random_model("tiny", fmt="fp32"))
    assert plain.ring_behind and writes(plain) == 2


def test_two_open_streams_on_one_device_do_not_share_the_ring(tiny_random, host_ring):
    """Streams read side by side (zip): the first opened reads the device's ring, the second runs the
    steps that return their tokens (two streams keyed by position in one ring could read each other's
    tokens); each gives its own tokens, and the ring is free again once they end."""
    import jtilert
    prompts = ([3, 17, 5, 9], [8, 1, 2])
    want = [list(jtilert.Generator(tiny_random, max_seq_len=64, config=jtilert.DecodeConfig(token_ring=False))
                 .stream(p, 10, stop_tokens=[])) for p in prompts]
    a, b = (jtilert.Generator(tiny_random, max_seq_len=64) for _ in prompts)
    _lib._warned.clear()  # noqa: SLF001
    with pytest.warns(RuntimeWarning, match="another open stream reads the token ring"):
        got = list(zip(*(g.stream(p, 10, stop_tokens=[]) for g, p in zip((a, b), prompts))))
    assert [list(t) for t in zip(*got)] == want
    # each compiled the ring's steps before its stream; only the second needed the steps that return
    assert a.engine.decode_stream.compiles == 1 and a.engine.decode.compiles == 0
    assert b.engine.decode_stream.compiles == 1 and b.engine.decode.compiles == 1
    assert ring.acquire([host_ring])
    ring.release([host_ring])


@pytest.mark.parametrize("mtp,behind", [(False, False), (True, False), (False, True)])
def test_the_device_loop_ends_at_a_stop_token_or_the_budget(tiny_random, host_ring, mtp, behind):
    """The ring's calls run up to STREAM_STEPS steps each, two in flight: over several calls the tokens
    are the returning steps', and the device writes no step past a stop token or the token budget
    (the calls in flight after the last one run none), whatever the host had dispatched."""
    import jtilert
    from jtilert.runtime.generate import STREAM_STEPS
    prompt = [3, 17, 5, 9]
    plain = jtilert.Generator(tiny_random, max_seq_len=128, mtp=mtp, config=jtilert.DecodeConfig(token_ring=False))
    gen = jtilert.Generator(tiny_random, max_seq_len=128, mtp=mtp,
                            config=jtilert.DecodeConfig(ring_write_behind=behind))
    n = 3 * STREAM_STEPS + 5     # more steps than the two calls dispatched first
    want = list(plain.stream(prompt, n, stop_tokens=[]))
    assert list(gen.stream(prompt, n, stop_tokens=[])) == want
    def written():   # once every call in flight has run (their writes are host callbacks)
        jax.effects_barrier()
        return host_ring.keys()
    keys = written()
    assert keys[0] == len(prompt) and keys[-1] < len(prompt) + n - 1, keys   # n - 1 tokens after the first
    assert len(keys) == gen.stats["steps"], (keys, gen.stats)
    # a stop token: the stream ends with it, and no step after it is written
    at = next(i for i in range(3, len(want)) if want[i] not in want[:i])
    got = list(gen.stream(prompt, n, stop_tokens=[want[at]]))
    assert got == want[:at + 1]
    keys = written()
    assert len(keys) == gen.stats["steps"], (keys, gen.stats)
    assert keys[-1] + (2 if mtp else 1) >= len(prompt) + at and keys[-1] < len(prompt) + at, keys


@pytest.mark.parametrize("mtp", [False, True])
def test_bench_decode_times_the_stream_through_the_ring(tiny_random, host_ring, mtp):
    """bench.decode's host loop runs what the stream runs where the ring is: calls of STREAM_STEPS steps
    read from the ring (every step's slot written under its position); its call variants add the ring's
    two forms."""
    import jtilert
    from bench import decode
    from jtilert.runtime.generate import STREAM_STEPS, Engine
    eng = Engine(tiny_random)
    assert eng.ring is host_ring
    context, n = 20, 3
    cache = decode.random_cache(eng, decode.cache_rows(context, 2 * n * STREAM_STEPS + 8))
    token, draft = eng.place(jnp.array([1], jnp.int32)), eng.place(jnp.array([2], jnp.int32))
    pos, key = eng.place(jnp.int32(context)), eng.place(jax.random.PRNGKey(0))
    params = eng.place(jtilert.Sampling().arrays())
    per_step, enqueue, served, carry = decode.host_loop(eng, cache, token, draft, pos, params, key, mtp, n)
    assert per_step > 0 and enqueue > 0 and served > 0 and len(carry) == (6 if mtp else 5)
    # the stream's n calls after one to warm (from the context + the warm call's steps), then the same n
    # calls queued from the context again: every step's slot written, the queued calls' from the context
    end = int(carry[3 if mtp else 2])
    keys = host_ring.keys()
    assert keys[0] == context and end >= context + n * STREAM_STEPS, (keys, end)
    if not mtp:
        assert end == context + n * STREAM_STEPS
        assert keys == list(range(context, context + (n + 1) * STREAM_STEPS)), keys
    if mtp:
        return
    out, carry = decode.call_variant_loops(eng, carry[:4], params, n, context)
    assert {"token_ring", "token_ring_stream", "host_output_pinned"} <= set(out)
    # each form starts at the same position: the last, the stream's calls under the profiler, wrote n
    # calls' steps from it
    keys = host_ring.keys()
    assert keys == list(range(context, context + n * STREAM_STEPS)), keys
    assert out["token_ring_stream"]["steps_per_call"] == STREAM_STEPS and out["token_ring"]["steps_per_call"] == 1
    assert out["token_ring_stream"]["host_trace"] and out["host_output_pinned"]["host_trace"]
    assert all(v["enqueue_ms"] > 0 and v["host_loop_ms"] > 0 for v in out.values())


def test_bench_decode_call_fit():
    """The fit of a call's fixed cost: exact on t(k) = step + call / k."""
    from bench import decode
    r = decode.call_fit({k: 3.0 + 1.4 / k for k in (1, 8, 32)})
    assert abs(r["call_ms"] - 1.4) < 1e-9 and abs(r["step_ms"] - 3.0) < 1e-9
    r = decode.call_fit({8: 3.2, 32: 3.2})   # no fixed cost
    assert abs(r["call_ms"]) < 1e-9 and abs(r["step_ms"] - 3.2) < 1e-9


def test_bench_decode_queued_forms(tiny_random, host_ring):
    """bench.decode's queued forms run the timing loop's program and the stream's, at every number of
    steps a call; the stream's at its own and at 32 steps a call write the ring from the start position
    on, total steps in all (the last round's)."""
    import jtilert
    from bench import decode
    from jtilert.runtime.generate import Engine
    eng = Engine(tiny_random)
    context, total = 20, 32
    cache = decode.random_cache(eng, decode.cache_rows(context, 2 * total))
    carry = (cache, eng.place(jnp.array([1], jnp.int32)), eng.place(jnp.int32(context)),
             eng.place(jax.random.PRNGKey(0)))
    params = eng.place(jtilert.Sampling().arrays())
    out, carry = decode.queued_forms(eng, carry, params, context, total, rounds=1)
    assert set(out["timing_loop"]["ms_per_step"]) == set(decode.QUEUED_LOOP_STEPS)
    assert set(out["stream"]["ms_per_step"]) == set(decode.QUEUED_STREAM_STEPS)
    assert all(v > 0 for form in out.values() for v in [*form["ms_per_step"].values(), *form["enqueue_ms"].values()])
    jax.effects_barrier()
    assert host_ring.keys() == list(range(context, context + total)), host_ring.keys()
    assert len(carry) == 4 and int(carry[2]) == context


def test_stream_step_experiment(tiny_random, host_ring):
    """bench/experiments/stream_step.py's forms run: the timing loops time their steps, the stream's forms
    (written at each step's end and written behind) write the ring from the context on, and the MTP
    stream writes one key a step."""
    from bench import decode
    from bench.experiments import stream_step
    from jtilert.ops.table import DecodeConfig
    from jtilert.runtime.generate import STREAM_STEPS, Engine
    total = 2 * STREAM_STEPS
    with pytest.raises(ValueError, match="no form"):   # before any compile
        stream_step.forms(None, 20, total, ["stream_no_ring"])
    every = stream_step.forms(Engine(tiny_random, config=DecodeConfig(ring_write_behind=False)), 20, total)
    assert list(every) == list(stream_step.FORMS)
    ms = stream_step.rounds({k: v for k, v in every.items() if "timing" in k}, total, 1)
    assert set(ms) == {"timing_loop", "timing_loop_served", "mtp_timing_loop"}
    assert all(len(v) == 1 and v[0] > 0 for v in ms.values())
    jax.effects_barrier()
    for form in ("stream", "stream_write_behind"):
        host_ring.clear()
        decode.queued({STREAM_STEPS: every[form]}, total, 1)
        jax.effects_barrier()
        assert host_ring.keys() == list(range(20, 20 + total)), (form, host_ring.keys())
    host_ring.clear()   # MTP: a key a step, 1 or 2 tokens each, from the context on
    decode.queued({STREAM_STEPS: every["mtp_stream"]}, total, 1)
    jax.effects_barrier()
    keys = host_ring.keys()
    assert keys[0] == 20 and len(keys) == total and all(b - a in (1, 2) for a, b in zip(keys, keys[1:])), keys


def test_bench_decode_profiles_before_the_call_variants_trace(tiny_random, host_ring, monkeypatch):
    """With --kernels and --call-variants on a GPU (stood in for: CUPTI and the backend's name mocked),
    every CUPTI profile, the stream call's included (per step of the timing loop's profiled call),
    comes before the call variants trace under JAX's profiler, after which CUPTI drops records (a
    device run aborted on it); the served steps' host loop comes before every CUPTI profile, which
    slows every later call of the process; and the loop profile is the timing loop's (steps at one
    position), not that of the call variants' timing loops run before it."""
    import contextlib

    from bench import decode
    traced, order, loops_run = [], [], []
    real_host_loop, real_device_loop = decode.host_loop, decode.device_loop

    def device_loop(eng, mtp, advance=False):
        loop = real_device_loop(eng, mtp, advance)

        def run(*args):
            loops_run.append(advance)
            return loop(*args)
        run.trace = loop.trace   # (the first compile is timed stage by stage)
        return run

    def host_loop(*args, **kw):
        order.append("host loop")
        return real_host_loop(*args, **kw)   # (it sets host_loop.compile_s on this wrapper, as bench_backend reads it)

    def cupti(run):
        assert not traced, "a CUPTI profile after JAX's profiler"
        assert order[:1] == ["host loop"], "a CUPTI profile before the served steps' host loop"
        loops_run.clear()
        jax.block_until_ready(run())
        order.append("profile")
        if order.count("profile") == 1:   # the loop profile
            assert loops_run == [False], "the loop profile ran another loop than the timing loop"
        return [("k_1", 1e-6)], 1e-6

    def trace(*args, **kw):
        traced.append(True)
        return contextlib.nullcontext()
    monkeypatch.setattr(decode, "_cupti", cupti)
    monkeypatch.setattr(decode, "host_loop", host_loop)
    monkeypatch.setattr(decode, "device_loop", device_loop)
    monkeypatch.setattr(decode.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(decode.jax.profiler, "trace", trace)
    monkeypatch.setattr(decode, "host_events", lambda *a, **k: [])
    monkeypatch.setattr(decode, "QUEUED_TOTAL", 32)
    r = decode.bench_backend(tiny_random, "reference", 20, False, 2, 2, kernels=True, call_variants=True)
    assert traced and r["stream_kernel_profile"]["kernels"] == 1 / 2 and r["kernel_profile"]["kernels"] == 1
    assert set(r["queued"]) == {"timing_loop", "stream"}   # measured before the profiles
    assert r["loop_kernel_profile"]["kernels"] == 1 / 2 and r["host_loop_ms"] > 0 and r["steps_per_call"] == 8
    # a timing loop of more steps than a stream call's: the call's steps are what its profile divides by
    traced.clear()
    order.clear()
    r = decode.bench_backend(tiny_random, "reference", 20, False, 10, 1, kernels=True)
    assert r["stream_kernel_profile"]["kernels"] == 1 / 8
