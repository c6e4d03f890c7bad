"""What a Generator's preparation costs per compiled program, and what the program cache saves (issue 13).

    PYTHONPATH=. python3 -m bench.prepare --preset dsv32-tp8-shard --layers 61 --backend pallas --mtp \
        [--loop generate|stream] [--platform cuda] [--cache DIR]

Runs the programs `Generator._prepare` compiles (prefill chunk, first token, MTP prefill and first draft,
decode step) on an abstract model (no weights) and times, per program:
- plain: `trace`, `kernels` (the Mosaic kernels not yet lowered in this process, lowered side by side
  in `--workers` processes: `lowering_cache.prelower`) and `lower` (the rest of jax's lowering; what
  every process pays without the program cache), the module's size, its Mosaic-GPU kernels and how
  many of them Mosaic lowered for this program (the others came from `jtilert.pallas.lowering_cache`:
  lowered by an earlier program of this process);
- cold: `export` (trace + lower + jax.export's checks) and writing the cache entry;
- warm: reading the entry and lowering a call of it (what a second process pays);
- the MLIR lines of each of its Mosaic kernels' modules (`kernel_modules`), the biggest printed. jaxlib
  compiles each distinct kernel once per process and one at a time (`CachedCompile` in
  jaxlib/mosaic/gpu/custom_call.cc holds one lock across every compilation), so the kernels' sizes
  bound that serial part of the first compile's XLA stage.
Lowering for "cuda" works on a machine without a GPU (the kernels are lowered for the GPU, not
interpreted); XLA's compile is not run (on a GPU it comes from JAX's persistent cache).

With `--compile`, a random model is built instead and `Generator._prepare` runs for real here (trace,
lower, XLA compile) through the caches `JTILERT_COMPILATION_CACHE` / `JTILERT_PROGRAM_CACHE` name:
run it twice on one folder for cold and warm.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jtilert.ffi._lib import TARGETS
from jtilert.model.presets import preset
from jtilert.model.transformer import abstract_model, random_model
from jtilert.pallas import interpret, lowering_cache
from jtilert.runtime import compile_cache
from jtilert.runtime.generate import Compiled, Generator
from jtilert.runtime.sampling import Sampling


def kernel_modules(text: str) -> list[tuple[str, str]]:
    """The Mosaic-GPU kernel calls of a lowered program's text, in order: (kernel name, its module printed
    without source locations and without Mosaic's dump file name, a per-process counter). A kernel
    called in several places of the text appears once for each."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic import gpu as mgpu

    def raw(s: str) -> bytes:   # the custom call's escaped string → the module's bytecode
        return re.sub(rb"\\([0-9A-Fa-f]{2}|\\|\")",
                      lambda m: bytes([int(m[1], 16)]) if len(m[1]) == 2 else m[1], s.encode("latin-1"))
    ctx = mlir.make_ir_context()
    mgpu.dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    out = []
    with ctx:
        for m in re.findall(r'module = "((?:[^"\\]|\\.)*)"', text):
            asm = ir.Module.parse(raw(m)).operation.get_asm(enable_debug_info=False)
            name = re.search(r"^module @(\w+)", asm, re.M)   # the module is named after the kernel
            out.append((name.group(1) if name else "?", re.sub(r'dump_basename = "[^"]*"', "", asm)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="dsv32-tp8-shard")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--fmt", default="fp8")
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--loop", choices=("generate", "stream"), default="generate")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--platform", default="cuda")
    ap.add_argument("--cache", help="program cache folder (default: a new temporary one)")
    ap.add_argument("--workers", type=int, default=lowering_cache.default_workers(),
                    help="processes that lower the kernels (0 or 1: one after another, in this process)")
    ap.add_argument("--compile", action="store_true", help="prepare a random model for real (see above)")
    a = ap.parse_args()
    cfg = preset(a.preset, num_hidden_layers=a.layers)
    if a.compile:
        gen = Generator(random_model(cfg, a.fmt), max_seq_len=a.max_seq_len, backend=a.backend, mtp=a.mtp)
        t = time.perf_counter()
        gen._prepare(Sampling(), loop=a.loop == "generate")
        print(f"prepare {time.perf_counter() - t:.2f} s: {gen.compiles} programs, {gen.cached_programs} from the "
              f"program cache  [{a.preset}, {a.layers} layers, {a.backend}, mtp={a.mtp}, {a.loop}, "
              f"{jax.default_backend()}]")
        return
    platforms = (a.platform,)
    folder = Path(a.cache or tempfile.mkdtemp(prefix="jtilert-programs-"))
    rows = []

    def measure(self: Compiled, *args):
        """Stands in for `Compiled.executable`: times the three ways to a lowered program."""
        r = {"program": self._name}
        t = time.perf_counter()
        traced = self._jit.trace(*args)
        r["trace"] = time.perf_counter() - t
        t, before = time.perf_counter(), lowering_cache.lowerings
        lowering_cache.prelower(traced.jaxpr, a.workers, background=False)   # lowering only: no compile
        r["kernels_s"] = time.perf_counter() - t
        t = time.perf_counter()
        lowered = traced.lower(lowering_platforms=platforms)
        r["lower"] = time.perf_counter() - t
        r["lowered"] = lowering_cache.lowerings - before
        text = lowered.as_text()
        r["mb"], r["kernels"] = len(text) / 1e6, text.count("mosaic_gpu_v2")
        r["kernel_lines"] = {name: asm.count("\n") + 1 for name, asm in kernel_modules(text)}   # distinct kernels
        key = compile_cache.program_key(self._engine.program_identity(self._name), self._donate, args, platforms)
        path = folder / f"{key}.jaxexport"
        lowering_cache.clear()   # a cold process lowers the kernels again
        t = time.perf_counter()
        compile_cache.lower_kernels(self._jit, args, a.workers, background=False)
        exported = compile_cache.export(self._jit, args, platforms, tuple(TARGETS))
        r["export"] = time.perf_counter() - t
        t = time.perf_counter()
        compile_cache._write(path, exported)
        r["write"] = time.perf_counter() - t
        t = time.perf_counter()
        exported = compile_cache._read(path)
        r["read"] = time.perf_counter() - t
        t = time.perf_counter()
        compile_cache.lower_exported(exported, self._donate, args, platforms, self._out_shardings)
        r["lower_call"] = time.perf_counter() - t
        r["entry_mb"] = path.stat().st_size / 1e6
        rows.append(r)
        print(f"{r['program']:>15}: trace {r['trace']:6.2f} s  kernels {r['kernels_s']:6.2f} s  lower {r['lower']:6.2f} s  "
              f"({r['kernels']} kernels, {r['lowered']} lowered, "
              f"{r['mb']:.1f} MB)  | cold: export {r['export']:6.2f} s  write {r['write']:.2f} s  | warm: read "
              f"{r['read']:.2f} s  lower call {r['lower_call']:.2f} s  (entry {r['entry_mb']:.1f} MB)", flush=True)
        biggest = sorted(r["kernel_lines"].items(), key=lambda kv: -kv[1])[:6]
        print(f"{'':>15}  Mosaic modules: {sum(r['kernel_lines'].values())} lines; "
              + ", ".join(f"{name} {n}" for name, n in biggest), flush=True)
        return lowered

    Compiled.executable = measure
    model = abstract_model(cfg, a.fmt, jnp.bfloat16)
    with interpret.compile_for_gpu():
        gen = Generator(model, max_seq_len=a.max_seq_len, backend=a.backend, mtp=a.mtp)
        gen._prepare(Sampling(), loop=a.loop == "generate")
    total = {k: sum(r[k] for r in rows) for k in ("trace", "kernels_s", "lower", "export", "write", "read", "lower_call")}
    print(f"{'total':>15}: plain trace + kernels + lower {total['trace'] + total['kernels_s'] + total['lower']:.2f} s | cold export + write "
          f"{total['export'] + total['write']:.2f} s | warm read + lower call {total['read'] + total['lower_call']:.2f} s"
          f"  [{a.preset}, {a.layers} layers, {a.backend}, mtp={a.mtp}, {a.loop}, {a.workers} workers, jax {jax.__version__}]")


if __name__ == "__main__":
    main()
