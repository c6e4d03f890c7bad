"""Why a step of the stream's program runs slower than a step of the timing loop's (bench/RESULTS.md,
session 41): both programs in calls of STREAM_STEPS steps queued back to back (`bench.decode.queued`),
one change at a time, in rounds that alternate the forms on one machine:

  timing_loop          the timing loop's program (`device_loop`), the engine's step options
  timing_loop_graph1   the same compiled with the stream's options (`Engine.loop_options`: every thunk
                       sequence recorded into a CUDA graph; compiled for an H200 on the CPU, this program's
                       graph is the same either way, so this form is the control)
  timing_loop_served   the timing loop's program with the stream's data: positions moving, each step fed
                       another of 997 random tokens
  stream               the stream's program through the token ring, as `Generator.stream` runs it
  stream_no_ring       the same with no ring write (the next position pos + 1, computed in the step)
  stream_step_options  the stream's program compiled with the engine's step options
  stream_fixed_count   the stream's program with a loop of exactly STREAM_STEPS steps: no stop test and no
                       token budget in the loop's condition (as the timing loop's)
  stream_guarded       the same loop of STREAM_STEPS steps, each step under a conditional that skips it once
                       a stop token came or the budget is spent (what a fixed-count stream would need)

  PYTHONPATH=. python3 -m bench.experiments.stream_step --layers 36 --out stream_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from unittest import mock

import jax
import jax.numpy as jnp

import jtilert
from bench import decode, provenance
from jtilert.ffi import ring
from jtilert.ops.table import DecodeConfig
from jtilert.runtime.generate import STREAM_STEPS, Engine, _stop_hits


def _no_ring_write(pos, values, count=None):
    return pos + (jnp.ravel(jnp.asarray(values)).shape[0] if count is None else count)


def _fixed_count_loop(step, carry: tuple, left, stops, steps: int = STREAM_STEPS) -> tuple:
    carry = jax.lax.fori_loop(0, steps, lambda i, c: step(c)[0], carry)
    return (*carry, left)


def _guarded_loop(step, carry: tuple, left, stops, steps: int = STREAM_STEPS) -> tuple:
    def body(i, c):
        carry, left = c

        def run(carry):
            carry, emitted, n = step(carry)
            return carry, jnp.where(jnp.any(_stop_hits(emitted, n, stops)), 0, left - n)
        return jax.lax.cond(left > 0, run, lambda carry: (carry, left), carry)
    carry, left = jax.lax.fori_loop(0, steps, body, (carry, left))
    return (*carry, left)


def forms(eng, context: int, total: int) -> dict:
    """{name: (restart, call)} of every form, each `queued`-ready at STREAM_STEPS steps a call (the
    timing loop's forms carry one cache, the stream's another)."""
    params = eng.place(jtilert.Sampling().arrays())
    rows = decode.cache_rows(context, 2 * total)
    here = eng.place(jnp.int32(context))
    state = [decode.random_cache(eng, rows), eng.place(jnp.array([1], jnp.int32)),
             eng.place(jnp.array([2], jnp.int32)), eng.place(jax.random.PRNGKey(0))]
    out = {}
    ids = (eng.place(jax.random.randint(jax.random.PRNGKey(1), (997,), 0, eng.cfg.vocab_size, jnp.int32)),)
    for name, options, advance, fed in (("timing_loop", None, False, ()),
                                        ("timing_loop_graph1", eng.loop_options, False, ()),
                                        ("timing_loop_served", None, True, ids)):
        loop = decode.device_loop(eng, False, advance, options)
        out[name] = decode.loop_form(eng, loop, state, here, params, STREAM_STEPS, fed)
        jax.block_until_ready(out[name][0]())   # compile
    stream = [decode.random_cache(eng, rows, seed=1), eng.place(jnp.array([1], jnp.int32)),
              eng.place(jnp.int32(context)), eng.place(jax.random.PRNGKey(1)), None]

    def stream_form(options=None, patch=None):
        with patch or contextlib.nullcontext():
            call, _ = decode.stream_call(eng, False, tuple(stream[:4]), 4 * total, params, STREAM_STEPS, options)
        return decode.stream_form(eng, call, stream, context, 4 * total)
    out["stream"] = stream_form()
    out["stream_no_ring"] = stream_form(eng.loop_options, mock.patch.object(ring, "write", _no_ring_write))
    out["stream_step_options"] = stream_form(eng.step_options or {})
    out["stream_fixed_count"] = stream_form(eng.loop_options, mock.patch.object(Engine, "_stream_loop",
                                                                                  staticmethod(_fixed_count_loop)))
    out["stream_guarded"] = stream_form(eng.loop_options, mock.patch.object(Engine, "_stream_loop",
                                                                              staticmethod(_guarded_loop)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv32-tp8-shard")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--backend", default="pallas")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--total", type=int, default=128, help="steps a round of each form")
    p.add_argument("--rounds", type=int, default=4, help="rounds, each form once a round in turn")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = jtilert.preset(a.preset, num_hidden_layers=a.layers)
    model = jtilert.random_model(cfg, fmt="fp8" if cfg.index_quant == "fp8" else "bf16")
    eng = Engine(model, config=DecodeConfig(backend=a.backend))
    if eng.ring is None:
        raise SystemExit("stream_step: the token ring did not load (the CUDA engine is needed)")
    every = forms(eng, a.context, a.total)
    ms = {name: [] for name in every}
    for _ in range(a.rounds):
        for name, form in every.items():
            ms[name].append(decode.queued({STREAM_STEPS: form}, a.total, 1)["ms_per_step"][STREAM_STEPS])
    result = {"device": jax.devices()[0].device_kind, "commit": provenance.commit(),
              "command": provenance.command("bench.experiments.stream_step", argv), "layers": a.layers,
              "backend": a.backend,
              "context": a.context, "steps_per_call": STREAM_STEPS, "total": a.total, "rounds": ms,
              "ms_per_step": {name: statistics.median(v) for name, v in ms.items()}}
    for name, v in result["ms_per_step"].items():
        print(f"{name:22s} {v:.3f} ms a step  (rounds: {', '.join(f'{x:.3f}' for x in ms[name])})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
