"""The decode step as XLA compiles it for an H200, on a machine without a GPU: the kernels one step
launches (issue 14's count) and XLA's compile time (issue 13).

    .venv-xla/bin/python -m bench.xla_kernels --preset dsv32-tp8-shard --layers 61 [--context 4096] \
        [--program decode] [--option NAME=VALUE ...] [--out result.json] [--hlo step.hlo]

`make xla-venv` makes .venv-xla: the project with jax's CUDA plugin, whose XLA compiles for a GPU it
is only told about (a compile-only H200 from `bench/targets/h200.txtpb`). The programs are those `Generator._prepare` builds for an abstract model
(no weights): the Mosaic kernels lowered for the GPU, the CUDA engine's FFI targets registered from
its library (`jtilert.ffi._lib.register_targets`: built here with nvcc, never run). Each program
compiles with the step's own XLA options (`DecodeConfig.xla_options`) and any `--option`.

`graph` reads XLA's thunk sequence: how many CUDA graphs (command buffers) a call launches, the nodes
recorded in them, the thunks the host runs itself (what a call's enqueue scales with).
`launches` reads the optimized HLO: a fusion, a custom call (a Mosaic kernel or an engine call), a
copy or any other instruction that is not a view or a tuple is one kernel; a while loop's body and
its condition count once per iteration (its known trip count) plus XLA's `set_while_condition`
kernel, a conditional its smaller branch plus `set_case_condition` (the step's one conditional is the
sampler's: its smaller branch, the head's candidates, is the greedy path the benchmarks run; each
conditional's branch sizes are listed). That is what CUPTI counts for a step.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the plugin registers without a device; the rest runs here

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

TARGET = pathlib.Path(__file__).with_name("targets") / "h200.txtpb"
VIEWS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-start", "copy-done",
         "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}


# ---- what a module launches ---------------------------------------------------------------------

def computations(text: str) -> tuple[dict[str, list[tuple[str, str, str]]], str]:
    """({computation: [(opcode, instruction, line)]}, entry computation) of an HLO module's text."""
    comps, cur, entry = {}, None, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?(%[\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            cur = head.group(2)
            comps[cur] = []
            entry = cur if head.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            m = re.match(r"\s+(?:ROOT )?(%[\w.\-]+) = .*? ([a-z][\w-]*)\(", line)
            if m:
                comps[cur].append((m.group(2), m.group(1), line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def kernel_name(op: str, inst: str, line: str) -> str:
    """A launch's name as CUPTI shows it: a Mosaic kernel's name, an FFI target, XLA's fusion name."""
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        mosaic = re.search(r'op_name="[^"]*/(jtilert_\w+)/mpmd_map', line)
        return mosaic.group(1) if target == "mosaic_gpu_v2" and mosaic else target
    return re.sub(r"(\.\d+)+$", "", inst.lstrip("%")) if op == "fusion" else op


def launches(text: str) -> dict:
    """Kernels one execution of an optimized HLO module launches: {"kernels": n, "names": {name: n},
    "loops": [{"loop", "trips", "kernels_per_trip", "names"}] (a loop's own condition kernels
    included; "names": a trip's kernels by name),
    "conditionals": [sorted kernel counts of each conditional's branches]}."""
    comps, entry = computations(text)
    loops, branches_seen = [], []

    def count(name: str, times: int, tally: collections.Counter) -> None:
        for op, inst, line in comps[name]:
            if op in VIEWS:
                continue
            if op == "while":
                body = re.search(r"body=(%[\w.\-]+)", line).group(1)
                cond = re.search(r"condition=(%[\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                n = int(trips.group(1)) if trips else 1
                one = collections.Counter()
                count(body, 1, one)
                count(cond, 1, one)
                one["set_while_condition"] += 1
                loops.append({"loop": inst.lstrip("%"), "trips": n, "kernels_per_trip": sum(one.values()),
                              "names": dict(one.most_common())})
                for k, v in one.items():
                    tally[k] += v * n * times
                cond_only = collections.Counter()   # the condition once more: the test that ends the loop
                count(cond, 1, cond_only)
                cond_only["set_while_condition"] += 1
                for k, v in cond_only.items():
                    tally[k] += v * times
            elif op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = [b.strip() for b in branches.group(1).split(",")] if branches else [
                    re.search(r"true_computation=(%[\w.\-]+)", line).group(1),
                    re.search(r"false_computation=(%[\w.\-]+)", line).group(1)]
                sub = []
                for b in names:
                    t = collections.Counter()
                    count(b, times, t)
                    sub.append(t)
                tally.update(min(sub, key=lambda t: sum(t.values())))
                tally["set_case_condition"] += times
                branches_seen.append(sorted(sum(t.values()) for t in sub))
            elif op in ("call", "async-start") and re.search(r"(?:to_apply|calls)=(%[\w.\-]+)", line):
                count(re.search(r"(?:to_apply|calls)=(%[\w.\-]+)", line).group(1), times, tally)
            else:
                tally[kernel_name(op, inst, line)] += times

    tally = collections.Counter()
    count(entry, 1, tally)
    return {"kernels": sum(tally.values()), "names": dict(tally.most_common()), "loops": loops,
            "conditionals": branches_seen}


def graph(thunks: str) -> dict:
    """What the host launches a call, from XLA's thunk sequence after its thunk passes (the dump's
    `*.thunk_sequence_after_thunk_passes.txt`): {"command_buffers": CUDA graphs, "nodes": the thunks
    recorded in them (a loop's body and condition and a conditional's branches once each: they run
    as child graphs on the device), "outside": the thunks the host runs itself}."""
    out = {"command_buffers": 0, "nodes": 0, "outside": 0}
    inside: list[int] = []   # indents of the command buffers the current line lies in
    for line in thunks.splitlines():
        m = re.match(r"^( *)\d+: (k\w+)", line)
        if not m:
            continue
        indent, kind = len(m.group(1)), m.group(2)
        while inside and indent <= inside[-1]:
            inside.pop()
        if inside:
            out["nodes"] += 1
        elif kind != "kCommandBuffer":
            out["outside"] += 1
        if kind == "kCommandBuffer":
            out["command_buffers"] += not inside
            inside.append(indent)
    return out


# ---- compiling for the H200 without one ---------------------------------------------------------

def h200():
    """A compile-only H200 device (jax's CUDA plugin; no driver needed)."""
    from jax.experimental import topologies
    topo = topologies.get_topology_desc("", "cuda", target_config=TARGET.read_text(), topology="1x1x1")
    return topo.devices[0]


def compile_programs(cfg, *, context: int, backend: str, mtp: bool, loop: bool, want: set[str],
                     options: dict, ring: bool = False, layers_per_iteration: int | None = None,
                     ring_write_behind: bool | None = None, dump: str | None = None) -> list[dict]:
    """Prepares a Generator for `cfg` (abstract weights) and compiles the programs named in `want` for
    the H200: per program its XLA compile seconds, memory and `launches`; the optimized HLO text too.
    ring: the engine has a token ring (a stand-in: preparing reads only its device), so `stream`'s
    steps are the ring's (`decode_stream`, `speculate_stream`). layers_per_iteration, ring_write_behind:
    DecodeConfig's (None: its default). dump: a folder that keeps XLA's dump of each program (its HLO
    passes and thunk sequence)."""
    from jax._src import compiler
    from jax._src.lib import xla_client as xc

    from jtilert.ffi import _lib
    from jtilert.ffi import ops as ffi_ops
    from jtilert.model.transformer import abstract_model
    from jtilert.ops.table import DecodeConfig
    from jtilert.pallas import interpret
    from jtilert.runtime.generate import Compiled, Engine, Generator
    from jtilert.runtime.sampling import Sampling

    dev = h200()
    _lib.register_targets()
    ffi_ops.EMIT_WITHOUT_GPU = True
    rows = []

    def compile_for_h200(self: Compiled, *args):   # stands in for Compiled.executable
        traced = self._jit.trace(*args)
        lowered = traced.lower(lowering_platforms=("cuda",))
        if self._name not in want:
            return lowered
        with tempfile.TemporaryDirectory() as tmp:   # XLA writes the thunk sequence there
            where = tmp if dump is None else os.path.join(dump, self._name)
            overrides = {**(self._options or {}), **options, "xla_dump_to": where,
                         "xla_dump_hlo_module_re": "jit_run"}
            opts = compiler.get_compile_options(num_replicas=1, num_partitions=1, device_assignment=np.array([[dev.id]]),
                                                backend=dev.client, env_options_overrides=overrides)
            t = time.perf_counter()
            exe = dev.client.compile(lowered.compiler_ir("stablehlo"), executable_devices=xc.DeviceList((dev,)),
                                     compile_options=opts)
            seconds = time.perf_counter() - t
            [thunks] = pathlib.Path(where).glob("*.thunk_sequence_after_thunk_passes.txt")
            cuda_graph = graph(thunks.read_text())
        text = exe.hlo_modules()[0].to_string()
        mem = exe.get_compiled_memory_stats()
        rows.append({"program": self._name, "xla_compile_s": seconds, "hlo": text, "graph": cuda_graph,
                     "argument_gib": mem.argument_size_in_bytes / 2**30, "alias_gib": mem.alias_size_in_bytes / 2**30,
                     "temp_gib": mem.temp_size_in_bytes / 2**30, **launches(text)})
        return lowered

    def router_in_bf16(model):
        """The abstract model with its router held in bf16, as the decode model holds a checkpoint's
        (`transformer.router_in_bf16` needs the values to tell)."""
        if model.moe is not None:
            w = model.moe.gate.weight.get_value()
            model.moe.gate.weight.set_value(jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=w.sharding))
        return model

    class StandInRing:
        device = dev

    saved, saved_rings = Compiled.executable, Engine._token_rings
    Compiled.executable = compile_for_h200
    if ring:
        Engine._token_rings = lambda self: [StandInRing()] if self.config.token_ring else None
    try:
        with interpret.compile_for_gpu():
            gen = Generator(router_in_bf16(abstract_model(cfg, "fp8", jnp.bfloat16)), max_seq_len=context, mtp=mtp,
                            config=DecodeConfig(backend=backend, **{k: v for k, v in (
                                ("layers_per_iteration", layers_per_iteration),
                                ("ring_write_behind", ring_write_behind)) if v is not None}))
            gen._prepare(Sampling(), loop=loop)
    finally:
        Compiled.executable, Engine._token_rings = saved, saved_rings
    return rows


def main(argv=None) -> list[dict]:
    from bench import provenance
    from jtilert.model.presets import preset

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="dsv32-tp8-shard")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--context", type=int, default=4096, help="the Generator's max_seq_len (cache rows)")
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--program", default="decode", help="programs to compile, comma-separated (decode, "
                    "decode_loop with --loop, speculate with --mtp, decode_stream / speculate_stream with "
                    "--ring, forward, first_token, ...)")
    ap.add_argument("--loop", action="store_true", help="prepare generate()'s device loop, not stream()'s step")
    ap.add_argument("--ring", action="store_true", help="stream()'s steps through the token ring (decode_stream, "
                    "speculate_stream), as on a GPU where the CUDA engine loads")
    ap.add_argument("--layers-per-iteration", type=int, default=None,
                    help="DecodeConfig.layers_per_iteration (default: DecodeConfig's)")
    ap.add_argument("--option", action="append", default=[], help="an XLA option NAME=VALUE for these compiles")
    ap.add_argument("--out", help="write the result (without the HLO) as JSON here")
    ap.add_argument("--hlo", help="write the first program's optimized HLO here")
    ap.add_argument("--ring-write-at-end", action="store_true",
                    help="DecodeConfig.ring_write_behind off (with --ring): each stream step writes at its end")
    ap.add_argument("--dump", help="keep XLA's dump of each program in DIR/<program>")
    a = ap.parse_args(argv)
    options = dict(kv.split("=", 1) for kv in a.option)
    cfg = preset(a.preset, num_hidden_layers=a.layers)
    rows = compile_programs(cfg, context=a.context, backend=a.backend, mtp=a.mtp, loop=a.loop,
                            want=set(a.program.split(",")), options=options, ring=a.ring,
                            layers_per_iteration=a.layers_per_iteration,
                            ring_write_behind=False if a.ring_write_at_end else None, dump=a.dump)
    for r in rows:
        loops = ", ".join(f"{x['loop']} {x['trips']} × {x['kernels_per_trip']}" for x in r["loops"])
        print(f"{r['program']}: {r['kernels']} kernels a call ({a.preset}, {a.layers} layers, context {a.context}); "
              f"XLA compile {r['xla_compile_s']:.1f} s; loops: {loops or 'none'}; arguments {r['argument_gib']:.1f} GiB; "
              f"CUDA graphs {r['graph']['command_buffers']} of {r['graph']['nodes']} nodes, {r['graph']['outside']} "
              "thunks outside")
        for name, n in list(r["names"].items())[:40]:
            print(f"  {n:6d}  {name}")
    if a.hlo and rows:
        pathlib.Path(a.hlo).write_text(rows[0]["hlo"])
    if a.out:
        result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": "compile-only H200, no GPU",
                  "commit": provenance.commit(), "command": provenance.command("bench.xla_kernels", argv),
                  "jax": jax.__version__,
                  "preset": a.preset, "layers": a.layers, "context": a.context, "backend": a.backend,
                  "layers_per_iteration": a.layers_per_iteration,
                  "options": options, "target": TARGET.name,
                  "programs": [{k: v for k, v in r.items() if k != "hlo"} for r in rows]}
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    return rows


if __name__ == "__main__":
    main()
