"""The program cache (`jtilert.runtime.compile_cache`): a second process reads each step's exported
program instead of tracing and lowering it, with the same tokens; every part of the key misses when
it changes; a damaged entry is rebuilt with one warning."""

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jtilert
from jtilert.runtime import compile_cache

ROOT = Path(__file__).resolve().parent.parent

# A fresh process: the embedded tiny model's greedy tokens (loaded: a random model would compile its
# builders first), its compilations, the programs read from the cache, and how often the model was
# traced (every trace of a step runs Transformer.hidden or __call__).
CHILD = """
import json, numpy as np, jtilert
from jtilert.model.transformer import Transformer
traces = []
for name in ("__call__", "hidden"):
    def counted(self, *a, _f=getattr(Transformer, name), **k):
        traces.append(1)
        return _f(self, *a, **k)
    setattr(Transformer, name, counted)
gen = jtilert.Generator(jtilert.load("tiny"), max_seq_len=64)
out = gen.generate(np.arange(1, 20), 8, stop_tokens=[])
print(json.dumps({"tokens": out, "compiles": gen.compiles, "cached": gen.cached_programs, "traces": len(traces)}))
"""


def _child(cache: Path, **env) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "JTILERT_COMPILATION_CACHE": str(cache),
           "JTILERT_PROGRAM_CACHE": "on", **env}
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_programs_and_decodes_the_same_tokens(tmp_path):
    first = _child(tmp_path)
    assert first["cached"] == 0 and first["compiles"] == 3 and first["traces"] > 0   # prefill, first token, loop
    assert len(list((tmp_path / "programs").glob("*.jaxexport"))) == 3
    second = _child(tmp_path)
    assert second == dict(first, cached=3, traces=0)   # nothing traced, same tokens
    # without the program cache (this process: conftest turns it off), the same tokens
    gen = jtilert.Generator(jtilert.load("tiny"), max_seq_len=64)
    assert gen.generate(np.arange(1, 20), 8, stop_tokens=[]) == first["tokens"] and gen.cached_programs == 0


@pytest.fixture
def programs(tmp_path, monkeypatch):
    """A program cache of its own (on: conftest turns it off for the other tests), and warnings not
    yet given in this process."""
    monkeypatch.setenv("JTILERT_COMPILATION_CACHE", str(tmp_path))
    monkeypatch.setenv("JTILERT_PROGRAM_CACHE", "on")
    monkeypatch.setattr(compile_cache, "_warned", set())
    return tmp_path / "programs"


def _step(cache, x):
    return cache + x, (cache * x).sum()


ARGS = (jnp.arange(8.0), jnp.float32(2.0))


def _compile(identity=("step",)):
    return compile_cache.compile_cached(jax.jit(_step, donate_argnums=(0,)), (0,), ARGS, identity)


def test_cached_program_keeps_donation_and_results(programs):
    exe, hit = _compile()
    assert not hit
    exe, hit = _compile()
    assert hit
    cache = jnp.arange(8.0)
    out = exe(cache, jnp.float32(2.0))
    assert cache.is_deleted()   # the carried argument is still donated
    want = _step(jnp.arange(8.0), jnp.float32(2.0))
    assert all(np.array_equal(a, b) for a, b in zip(out, want))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad module"])
def test_a_damaged_entry_is_rebuilt_with_one_warning(programs, damage):
    _compile()
    [entry] = programs.glob("*.jaxexport")
    if damage == "garbage":
        entry.write_bytes(b"not a pickle")
    elif damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:100])
    else:   # a readable entry whose program does not parse
        e = pickle.loads(entry.read_bytes())
        import dataclasses
        e["exported"] = dataclasses.replace(e["exported"], mlir_module_serialized=b"\x00junk")
        entry.write_bytes(pickle.dumps(e))
    with pytest.warns(RuntimeWarning, match="damaged compiled-program cache entry") as caught:
        exe, hit = _compile()
    assert not hit and len(caught) == 1
    assert np.array_equal(exe(jnp.arange(8.0), jnp.float32(2.0))[0], jnp.arange(8.0) + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _compile()[1]   # rebuilt: read again without a warning


def test_a_step_that_is_lowered_has_its_kernels_lowered_first(programs, monkeypatch):
    """Every path that lowers a step hands its traced program to `lowering_cache.prelower` first (which
    lowers the Mosaic kernels side by side: tests/test_kernel_lowering.py); a program read from the
    cache is not lowered, so nothing is."""
    seen = []
    monkeypatch.setattr(compile_cache.lowering_cache, "prelower",
                        lambda jaxpr, workers=None, background=None: seen.append(jaxpr) or 0)
    assert not _compile()[1] and len(seen) == 1 and hasattr(seen[0], "consts")   # a miss: its closed jaxpr
    assert _compile()[1] and len(seen) == 1                                    # a hit
    monkeypatch.setenv("JTILERT_PROGRAM_CACHE", "off")
    assert not _compile()[1] and len(seen) == 2                                # no program cache


def test_lower_kernels_passes_on_whether_the_kernels_compile_in_the_background(monkeypatch):
    """bench.prepare lowers without compiling: it asks `lower_kernels` for no background compile, which
    goes on to `prelower`; the Generator's compile leaves it to `prelower` (on a GPU: on)."""
    seen = []
    monkeypatch.setattr(compile_cache.lowering_cache, "prelower",
                        lambda jaxpr, workers=None, background=None: seen.append(background) or 0)
    f = jax.jit(lambda x: x + 1)
    compile_cache.lower_kernels(f, ARGS[:1], 0, background=False)
    compile_cache.lower_kernels(f, ARGS[:1], 0)
    assert seen == [False, None]


def test_off_switches(programs, monkeypatch):
    monkeypatch.setenv("JTILERT_PROGRAM_CACHE", "off")
    assert compile_cache.programs_folder() is None and not _compile()[1] and not programs.exists()
    monkeypatch.setenv("JTILERT_PROGRAM_CACHE", "on")
    monkeypatch.setenv("JTILERT_COMPILATION_CACHE", "off")
    assert compile_cache.programs_folder() is None and not _compile()[1]


def test_every_part_of_the_key_misses_when_it_changes(monkeypatch, tmp_path):
    key = compile_cache.program_key
    base = key(("step", "cfg"), (0,), ARGS)
    assert key(("step", "cfg"), (0,), ARGS) == base
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    replicated = jax.device_put(ARGS[0], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    changed = [
        key(("decode", "cfg"), (0,), ARGS),                                      # another step
        key(("step", "cfg2"), (0,), ARGS),                                       # what it closes over
        key(("step", "cfg"), (), ARGS),                                          # donation
        key(("step", "cfg"), (0,), (jnp.arange(9.0), ARGS[1])),                  # a shape
        key(("step", "cfg"), (0,), (jnp.arange(8), ARGS[1])),                    # a dtype
        key(("step", "cfg"), (0,), (jax.device_put(ARGS[0], jax.devices()[1]), ARGS[1])),   # the device
        key(("step", "cfg"), (0,), (replicated, ARGS[1])),                        # the sharding / mesh
        key(("step", "cfg"), (0,), ([ARGS[0]], ARGS[1])),                         # the tree
        key(("step", "cfg"), (0,), ARGS, ("cuda",)),                              # the platform
    ]
    for name in ("JTILERT_LOWERING_WORKERS", "JTILERT_KERNEL_PRECOMPILE"):   # how the kernels are made, not what
        monkeypatch.setenv(name, "0")
        assert key(("step", "cfg"), (0,), ARGS) == base, name
        monkeypatch.delenv(name)
    monkeypatch.setenv("JTILERT_FFI_DISABLE", "1")
    changed.append(key(("step", "cfg"), (0,), ARGS))                             # an engine switch
    monkeypatch.delenv("JTILERT_FFI_DISABLE")
    with jax.default_matmul_precision("bfloat16"):
        changed.append(key(("step", "cfg"), (0,), ARGS))                         # jax's config
    monkeypatch.setattr(compile_cache, "_fixed_key", lambda: "another jax")
    changed.append(key(("step", "cfg"), (0,), ARGS))                             # versions and source
    assert len({base, *changed}) == len(changed) + 1
    (tmp_path / "a.py").write_text("x = 1\n")
    digest = compile_cache.source_digest(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    assert compile_cache.source_digest(tmp_path) != digest                     # jtilert's own source


def test_engine_identity_names_model_and_config(tiny_random):
    base = jtilert.Generator(tiny_random, max_seq_len=64).engine.program_identity("decode")
    assert jtilert.Generator(tiny_random, max_seq_len=64).engine.program_identity("decode") == base
    other = [
        jtilert.Generator(tiny_random, max_seq_len=64, split_indexer=True).engine.program_identity("decode"),
        jtilert.Generator(tiny_random, max_seq_len=64,
                          config=jtilert.DecodeConfig(layer_loop="unrolled")).engine.program_identity("decode"),
        jtilert.Generator(jtilert.random_model(jtilert.preset("tiny", num_hidden_layers=2), fmt="fp8"),
                          max_seq_len=64).engine.program_identity("decode"),                   # another model
        jtilert.Generator(tiny_random, max_seq_len=64, mesh=jtilert.make_mesh(2)).engine.program_identity("decode"),
    ]
    assert all(o != base for o in other)
    # GPU interpret mode's host callbacks cannot be stored: no program cache for it
    assert jtilert.Generator(tiny_random, max_seq_len=64, backend="pallas").engine.program_identity("decode") is None


def test_sharded_steps_come_back_from_the_cache(programs, tiny_random):
    """Over a tp=2 mesh (shard_map, weights split across the devices): the second Generator reads
    every program, its outputs sharded as before, and decodes the same tokens."""
    mesh = jtilert.make_mesh(2)
    first = jtilert.Generator(tiny_random, max_seq_len=64, mesh=mesh)
    want = first.generate(np.arange(1, 20), 8, stop_tokens=[])
    second = jtilert.Generator(tiny_random, max_seq_len=64, mesh=mesh)
    assert second.generate(np.arange(1, 20), 8, stop_tokens=[]) == want
    assert first.cached_programs == 0 and second.cached_programs == second.compiles == 3
    eng = second.engine
    cache = eng.new_cache(second.rows)
    exe = eng.forward.executable(eng.state, cache, eng.place(np.zeros(second.chunks[-1], np.int32)), eng.place(np.int32(0)))
    assert all(o.sharding.is_equivalent_to(eng.sharding, len(o.shape)) for o in jax.tree_util.tree_leaves(exe.out_info))


@pytest.mark.parametrize("tp", [1, 2])
def test_streamed_outputs_are_written_to_pinned_host_memory(programs, tiny_random, tp):
    """What `stream` reads after each step is in pinned host memory when the step is compiled and when
    it comes back from the program cache (its exported module does not carry the memory kind), and
    the tokens are the same either way; the carried arrays stay on the device."""
    mesh = jtilert.make_mesh(tp) if tp > 1 else None
    want = None
    for n in range(2):
        gen = jtilert.Generator(tiny_random, max_seq_len=64, mesh=mesh)
        got = list(gen.stream(np.arange(1, 20), 6, stop_tokens=[]))
        assert want is None or got == want
        want = got
        eng = gen.engine
        cache = eng.new_cache(gen.rows)
        one, pos, key = eng.place(np.zeros(1, np.int32)), eng.place(np.int32(20)), eng.place(np.zeros(2, np.uint32))
        exe = eng.decode.executable(eng.state, cache, one, pos, key, eng.place(jtilert.Sampling().arrays()))
        kinds = [o.sharding.memory_kind for o in jax.tree_util.tree_leaves(exe.out_info)]
        assert kinds[-1] == "pinned_host" and set(kinds[:-1]) == {"device"}, kinds
    assert gen.cached_programs > 0


def test_under_the_dispatch_thread_the_streamed_token_stays_in_device_memory(programs, tiny_random, monkeypatch):
    """With PjRt's dispatch thread on (`jtilert.runtime.dispatch`) a pinned host output is read before
    the step writes it, so the returning steps keep their token in device memory: the same tokens, and
    the program cache keys the two forms apart (a program stored without the thread is not read with it)."""
    want = list(jtilert.Generator(tiny_random, max_seq_len=64).stream(np.arange(1, 20), 6, stop_tokens=[]))
    monkeypatch.setenv("PJRT_GPU_ENABLE_ASYNC_DISPATCH", "1")
    gen = jtilert.Generator(tiny_random, max_seq_len=64)
    assert list(gen.stream(np.arange(1, 20), 6, stop_tokens=[])) == want
    assert gen.cached_programs == 0
    eng = gen.engine
    cache = eng.new_cache(gen.rows)
    one, pos, key = eng.place(np.zeros(1, np.int32)), eng.place(np.int32(20)), eng.place(np.zeros(2, np.uint32))
    exe = eng.decode.executable(eng.state, cache, one, pos, key, eng.place(jtilert.Sampling().arrays()))
    assert {o.sharding.memory_kind for o in jax.tree_util.tree_leaves(exe.out_info)} == {"device"}


def test_the_dispatch_thread_is_turned_on_before_jax_makes_its_clients():
    """`use_dispatch_thread` sets PjRt's variable in a fresh process; once JAX's clients exist it
    refuses (the setting is read when they are made), unless the variable was set already."""
    code = ("import os, jax, jtilert\n"
            "jtilert.use_dispatch_thread()\n"
            "print(os.environ.get('PJRT_GPU_ENABLE_ASYNC_DISPATCH'))\n"
            "jax.devices()\n"
            "try:\n"
            "    os.environ.pop('PJRT_GPU_ENABLE_ASYNC_DISPATCH'); jtilert.use_dispatch_thread(); print('no error')\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e)\n"
            "os.environ['PJRT_GPU_ENABLE_ASYNC_DISPATCH'] = '1'; jtilert.use_dispatch_thread(); print('on already')\n")
    env = {k: v for k, v in os.environ.items() if k != "PJRT_GPU_ENABLE_ASYNC_DISPATCH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "1" and lines[1].startswith("refused:") and "clients are made" in lines[1]
    assert lines[2] == "on already"
