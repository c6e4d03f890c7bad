"""Each Mosaic kernel is lowered once: once per program (a kernel called from several places with one
signature, as the layer loops and the MTP block call it, is one traced callee, which JAX lowers once)
and once per process (`jtilert.pallas.lowering_cache`: a later program reuses the lowering). Mosaic
lowers a kernel in about a second of Python, so a regression here costs a step's first compile
seconds per kernel. Before jax lowers a step, `lowering_cache.prelower` lowers its kernels in forked
workers. Traced / lowered for the GPU on the CPU."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import pytest
from decode_jaxprs import decode_step, sub_jaxprs   # tests/decode_jaxprs.py (tests/ is on sys.path)

from jtilert.ops.table import DecodeConfig, Ops
from jtilert.pallas import gemv, lowering_cache
from jtilert.pallas import interpret as interp


def _kernel_bodies(jaxpr, found: dict) -> dict:
    """{(kernel name, grid, operand types): {ids of the traced kernel bodies}} of every Mosaic kernel."""
    for e in jaxpr.eqns:
        if e.primitive.name == "mpmd_map":
            mesh = e.params["meshes"][0]
            sig = (mesh.kernel_name, tuple(mesh.grid), tuple(str(v.aval) for v in e.invars))
            found.setdefault(sig, set()).add(id(e.params["jaxprs"][0]))
        for inner in sub_jaxprs(e):
            _kernel_bodies(inner, found)
    return found


def test_the_mtp_step_traces_each_kernel_once():
    """The speculative step's verify (2 tokens through both layer loops) and draft (the MTP block, its
    layer index a constant) call every kernel with one signature: one traced body each."""
    step, state, cache = decode_step("dsv32-tp8-shard", 4, Ops(DecodeConfig(backend="pallas")), tokens=2, mtp=True)
    with interp.compile_for_gpu():
        bodies = _kernel_bodies(jax.make_jaxpr(step)(state, cache).jaxpr, {})
    assert len(bodies) >= 12, sorted(bodies)   # the kernels ran (else nothing is checked)
    twice = {sig[0]: len(ids) for sig, ids in bodies.items() if len(ids) > 1}
    assert not twice, twice


def test_a_later_program_reuses_the_kernels_lowering():
    S = jax.ShapeDtypeStruct
    args = (S((1, 256), jnp.bfloat16), S((64, 256), jnp.bfloat16))
    kernel = jax.jit(gemv.linear)   # as the op table calls kernels: one jitted callee

    def lower(f):
        before = lowering_cache.lowerings
        with interp.compile_for_gpu():
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return lowering_cache.lowerings - before, re.findall(r'module = "((?:[^"\\]|\\.)*)"', text)

    n1, first = lower(lambda x, w: kernel(x, w))
    n2, second = lower(lambda x, w: kernel(x, w) * 2)   # another program, the same kernel
    assert (n1, n2) == (1, 0) and len(first) == 1 and second == first


def _kernel_code(text: str) -> list[str]:
    """The Mosaic modules of a lowered program, printed without source locations and without
    Mosaic's dump file name (a per-process counter)."""
    from bench.prepare import kernel_modules
    return [asm for _, asm in kernel_modules(text)]


_HASH = re.compile(r'kernel_hash = "((?:[^"\\]|\\.)*)"')


def _kernel_hashes(text: str) -> set[str]:
    """The hashes by which jaxlib keeps the compiled Mosaic modules of a lowered program."""
    return set(_HASH.findall(text))


def _handed_kernels(monkeypatch) -> list:
    """What `prelower(..., background=True)` hands to the background compile, recorded instead."""
    handed = []
    monkeypatch.setattr(lowering_cache, "precompile", lambda kernels: handed.extend(kernels) or 0)
    return handed


def test_kernels_lowered_by_workers_are_the_kernels_jax_lowers_and_compiles_alone(monkeypatch):
    """`prelower` lowers a step's kernels in forked workers before jax lowers the step: jax then
    lowers none of them itself (the indexer's too, which writes its caches in place and so is lowered
    from jax's discharged program), and the step's kernels are the ones a plain lowering makes.
    `prelower` hands every kernel to the background compile once its lowering is kept, and the
    one-kernel program the background compiles (`kernel_program`) carries the same module, by the hash
    under which jaxlib keeps compiled kernels, as the step: so the step's compile finds each kernel
    compiled. The decode step's kernels (stacked weights, a traced layer index, caches written in place)."""
    step, state, cache = decode_step("dsv32-tp8-shard", 4, Ops(DecodeConfig(backend="pallas")))
    handed = _handed_kernels(monkeypatch)
    lowering_cache.clear()
    with interp.compile_for_gpu():
        traced = jax.jit(step).trace(state, cache)
        before = lowering_cache.lowerings
        n = lowering_cache.prelower(traced.jaxpr, workers=2, background=True)
        parallel = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert n >= 12 and lowering_cache.lowerings - before == n   # the workers lowered every kernel
        kernels = {k.key: k for k in handed}
        assert len(kernels) == n and all(key in lowering_cache._cache for key in kernels)
        own = set()
        for k in kernels.values():
            fn, args = lowering_cache.kernel_program(k)
            own |= _kernel_hashes(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())
        assert own == _kernel_hashes(parallel)
        lowering_cache.clear()
        before = lowering_cache.lowerings
        plain = jax.jit(lambda s, c: step(s, c)).trace(state, cache).lower(lowering_platforms=("cuda",)).as_text()
        assert lowering_cache.lowerings - before == n   # lowered again, here, one after another
    assert _kernel_code(parallel) == _kernel_code(plain)


def test_the_background_compile_takes_each_kept_kernel_once(monkeypatch):
    """`precompile` hands a kernel to the background once per process, and only one whose lowering is
    kept (the others are lowered, then compiled, by the program's own compile); on the CPU backend,
    and with JTILERT_KERNEL_PRECOMPILE=0, `prelower` starts none."""
    S = jax.ShapeDtypeStruct
    x, w1, w2 = S((1, 256), jnp.bfloat16), S((64, 256), jnp.bfloat16), S((128, 256), jnp.bfloat16)
    kernel = jax.jit(gemv.linear)
    compiled = []
    monkeypatch.setattr(lowering_cache, "_compile_kernel", lambda k: compiled.append(k.in_shapes[1].shape))
    lowering_cache.clear()
    with interp.compile_for_gpu():
        traced = jax.jit(lambda x, a, b: (kernel(x, a), kernel(x, b))).trace(x, w1, w2)
        kernels = list(lowering_cache._kernels(traced.jaxpr.jaxpr))
        assert lowering_cache.precompile(kernels) == 0            # nothing kept yet
        assert lowering_cache.prelower(traced.jaxpr, workers=2, background=False) == 2
        assert lowering_cache.precompile(kernels + kernels) == 2 and lowering_cache.precompile(kernels) == 0
    lowering_cache.background_idle()
    assert sorted(compiled) == [(64, 256), (128, 256)]
    assert not lowering_cache.precompile_enabled()               # the CPU backend
    monkeypatch.setattr(lowering_cache.jax, "default_backend", lambda: "gpu")
    assert lowering_cache.precompile_enabled()
    monkeypatch.setenv("JTILERT_KERNEL_PRECOMPILE", "0")
    assert not lowering_cache.precompile_enabled()


def test_no_worker_is_forked_while_a_background_compile_runs(monkeypatch):
    """A forked worker inherits the locks a background compile holds at the fork: `prelower` waits for
    the compiles it handed before (another program's kernels) before it forks, and hands the new
    kernels only after."""
    S = jax.ShapeDtypeStruct
    kernel = jax.jit(gemv.linear)
    events = []
    monkeypatch.setattr(lowering_cache, "background_idle", lambda: events.append("idle"))
    monkeypatch.setattr(lowering_cache, "precompile", lambda kernels: events.append(len(list(kernels))) or 0)
    real_pool = lowering_cache.concurrent.futures.ProcessPoolExecutor

    def pool(*a, **k):
        events.append("fork")
        return real_pool(*a, **k)
    monkeypatch.setattr(lowering_cache.concurrent.futures, "ProcessPoolExecutor", pool)
    lowering_cache.clear()
    with interp.compile_for_gpu():
        x, w1, w2 = S((1, 256), jnp.bfloat16), S((64, 256), jnp.bfloat16), S((192, 256), jnp.bfloat16)
        traced = jax.jit(lambda x, a, b: (kernel(x, a), kernel(x, b))).trace(x, w1, w2)
        assert lowering_cache.prelower(traced.jaxpr, workers=2, background=True) == 2
    assert events[:2] == ["idle", "fork"] and events[2:] == [2, 1, 1]   # the kept ones (none new), then each


def test_a_kernel_a_worker_cannot_lower_is_lowered_by_jax(monkeypatch):
    """A worker's failure is not an error of its own: that kernel is lowered where jax lowers the
    program (so a real lowering error is raised there, with jax's context)."""
    S = jax.ShapeDtypeStruct
    x, w1, w2 = S((1, 256), jnp.bfloat16), S((64, 256), jnp.bfloat16), S((128, 256), jnp.bfloat16)
    kernel, parent = jax.jit(gemv.linear), os.getpid()
    upstream = lowering_cache._upstream

    def fails_in_a_worker_for_64_rows(gpu_mesh, jax_mesh, jaxpr, in_shapes, *a, **kw):
        if os.getpid() != parent and in_shapes[1].shape[0] == 64:
            raise RuntimeError("a worker's failure")
        return upstream(gpu_mesh, jax_mesh, jaxpr, in_shapes, *a, **kw)
    monkeypatch.setattr(lowering_cache, "_upstream", fails_in_a_worker_for_64_rows)
    lowering_cache.clear()
    with interp.compile_for_gpu():
        traced = jax.jit(lambda x, a, b: (kernel(x, a), kernel(x, b))).trace(x, w1, w2)
        assert lowering_cache.prelower(traced.jaxpr, workers=2) == 1
        before = lowering_cache.lowerings
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert lowering_cache.lowerings - before == 1 and len(_kernel_code(text)) == 2


def test_workers_that_cannot_start_leave_the_kernels_to_jax(monkeypatch):
    """A fork that fails (no memory for another process, say) is one warning, not an error: jax then
    lowers every kernel itself."""
    S = jax.ShapeDtypeStruct
    x, w1, w2 = S((1, 256), jnp.bfloat16), S((64, 256), jnp.bfloat16), S((128, 256), jnp.bfloat16)
    kernel = jax.jit(gemv.linear)

    def no_fork(*a, **k):
        raise OSError("Cannot allocate memory")
    monkeypatch.setattr(lowering_cache.concurrent.futures, "ProcessPoolExecutor", no_fork)
    lowering_cache.clear()
    with interp.compile_for_gpu():
        traced = jax.jit(lambda x, a, b: (kernel(x, a), kernel(x, b))).trace(x, w1, w2)
        with pytest.warns(RuntimeWarning, match="parallel kernel lowering stopped .OSError.; the remaining 2"):
            assert lowering_cache.prelower(traced.jaxpr, workers=2) == 0
        before = lowering_cache.lowerings
        traced.lower(lowering_platforms=("cuda",))
    assert lowering_cache.lowerings - before == 2


def test_kernels_inside_shard_map_are_lowered_by_the_workers(monkeypatch):
    """Under tp > 1 the kernels run inside shard_map, where jax lowers them with the mesh: the workers
    lower them with the same mesh and axes, and jax finds them all; each kernel's own program (the
    background compile's) calls it in a shard_map on that mesh and holds the same module."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2,), ("tp",))
    kernel = jax.jit(gemv.linear)
    f = jax.shard_map(lambda x, a, b: (kernel(x, a), kernel(x, b)), mesh=mesh, in_specs=(P(), P("tp"), P("tp")),
                      out_specs=(P(None, "tp"), P(None, "tp")), check_vma=False)
    S = jax.ShapeDtypeStruct
    args = (S((1, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P())),
            S((128, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp"))),
            S((256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp"))))
    lowering_cache.clear()
    handed = _handed_kernels(monkeypatch)
    with interp.compile_for_gpu():
        traced = jax.jit(f).trace(*args)
        assert lowering_cache.prelower(traced.jaxpr, workers=2, background=True) == 2
        before = lowering_cache.lowerings
        step_hashes = _kernel_hashes(traced.lower(lowering_platforms=("cuda",)).as_text())
        own = set()   # each kernel's own program (the background compile's): in shard_map on the mesh too
        for k in {k.key: k for k in handed}.values():
            fn, a = lowering_cache.kernel_program(k)
            own |= _kernel_hashes(jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",)).as_text())
    assert lowering_cache.lowerings == before and len(step_hashes) == 2 and own == step_hashes


def test_the_combine_probe_runs_in_interpret_mode_and_lowers_for_cuda():
    """bench/experiments/combine_tma_probe.py: the partials of one head copied by TMA with a squeezed
    middle dimension and a traced head index, weighted by scalar shared-memory reads (what folding the
    combine into W_uv needs) — right in interpret mode, and its Mosaic module builds for CUDA."""
    from bench.experiments import combine_tma_probe as probe
    err, text = probe.check()
    assert err < 1e-4   # fp32 sums of 32 products of normal values
    assert "mosaic_gpu" in text


def test_bench_prepare_names_and_sizes_each_kernel_module():
    """bench.prepare's kernel_modules: one (name, module) per Mosaic kernel call of a lowered program,
    named after the kernel, printed without locations (the size its report gives per distinct kernel)."""
    from bench.prepare import kernel_modules
    S = jax.ShapeDtypeStruct
    args = (S((1, 256), jnp.bfloat16), S((64, 256), jnp.bfloat16), S((128, 256), jnp.bfloat16))
    with interp.compile_for_gpu():
        text = jax.jit(lambda x, a, b: (gemv.linear(x, a), gemv.linear(x, b), gemv.linear(x, a))).trace(
            *args).lower(lowering_platforms=("cuda",)).as_text()
    mods = kernel_modules(text)
    assert sorted(name for name, _ in mods) == ["jtilert_gemv_wgmma_128x256"] + ["jtilert_gemv_wgmma_64x256"] * 2
    assert mods[0][1] == mods[2][1]   # the same kernel, the same module
    assert all(asm.count("\n") > 100 and "loc(" not in asm for _, asm in mods)
