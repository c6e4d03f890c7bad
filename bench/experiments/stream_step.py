"""Why a step of the stream's program runs slower than a step of the timing loop's (bench/RESULTS.md,
sessions 41-48): both programs in calls of STREAM_STEPS steps queued back to back (`bench.decode.queued`),
in rounds that alternate the forms on one machine:

  timing_loop           the timing loop's program (`device_loop`): every step at one position
  timing_loop_served    the same fed the stream's data: positions moving, each step another of 997
                        random tokens
  stream                the stream's program through the token ring with each step's tokens written at the
                        end of the step, the next position the write's result (`ring_write_behind=False`)
  stream_write_behind   the same with each step's tokens written while the next step runs, before its
                        sampling (`DecodeConfig.ring_write_behind`: as `Generator.stream` runs it)
  mtp_timing_loop, mtp_stream  the same pair for MTP steps (verify 2 tokens, then draft): the timing
                        loop's MTP program and the MTP stream's through the ring

The forms that told apart what the write at a step's end costs (no write, a write of nothing, a Mosaic
kernel in its place, no PDL, no conditionals, caches elsewhere in memory) ran in sessions 41-48 and were
retired with their answers (RESULTS.md; commit 28d335c has them).

    PYTHONPATH=. python3 -m bench.experiments.stream_step --layers 36 [--forms a,b,...] --out stream_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
from unittest import mock

import jax
import jax.numpy as jnp

import jtilert
from bench import decode, provenance
from jtilert.ops.table import DecodeConfig
from jtilert.runtime.generate import STREAM_STEPS, Engine

FORMS = ("timing_loop", "timing_loop_served", "stream", "stream_write_behind", "mtp_timing_loop", "mtp_stream")


def forms(eng, context: int, total: int, only=None) -> dict:
    """{name: (restart, call)} of the forms named in `only` (default every form, FORMS), each
    `queued`-ready at STREAM_STEPS steps a call (the timing loop's forms carry one cache, the stream's
    another, the MTP forms theirs). `eng` writes each step's tokens at the step's end (form `stream`)."""
    unknown = set(only or ()) - set(FORMS)
    if unknown:
        raise ValueError(f"stream_step: no form {sorted(unknown)}; the forms: {', '.join(FORMS)}")
    params = eng.place(jtilert.Sampling().arrays())
    rows = decode.cache_rows(context, 2 * total)
    here = eng.place(jnp.int32(context))
    state = [decode.random_cache(eng, rows), eng.place(jnp.array([1], jnp.int32)),
             eng.place(jnp.array([2], jnp.int32)), eng.place(jax.random.PRNGKey(0))]
    ids = (eng.place(jax.random.randint(jax.random.PRNGKey(1), (997,), 0, eng.cfg.vocab_size, jnp.int32)),)
    stream = [decode.random_cache(eng, rows, seed=1), eng.place(jnp.array([1], jnp.int32)),
              eng.place(jnp.int32(context)), eng.place(jax.random.PRNGKey(1)), None]
    mtp_loop = [decode.random_cache(eng, rows, seed=2), *state[1:]]
    mtp_stream = [decode.random_cache(eng, rows, seed=3), eng.place(jnp.array([1], jnp.int32)),   # donated:
                  eng.place(jnp.array([2], jnp.int32)), eng.place(jnp.int32(context)),             # its own
                  eng.place(jax.random.PRNGKey(2)), None]

    def timing_loop(advance=False, fed=(), mtp=False):
        form = decode.loop_form(eng, decode.device_loop(eng, mtp, advance), mtp_loop if mtp else state, here,
                                params, STREAM_STEPS, fed)
        jax.block_until_ready(form[0]())   # compile
        return form

    def stream_form(config=None):
        """The stream's program, compiled under `config` (another DecodeConfig), where given."""
        with mock.patch.object(eng, "config", config) if config is not None else contextlib.nullcontext():
            call, _ = decode.stream_call(eng, False, tuple(stream[:4]), 4 * total, params, STREAM_STEPS,
                                         None if config is None else eng.loop_options)
        return decode.stream_form(eng, call, stream, context, 4 * total)

    def mtp_stream_form():
        call, _ = decode.stream_call(eng, True, tuple(mtp_stream[:5]), 8 * total, params, STREAM_STEPS)
        return decode.stream_form(eng, call, mtp_stream, context, 8 * total)

    build = {
        "timing_loop": timing_loop,
        "timing_loop_served": lambda: timing_loop(advance=True, fed=ids),
        "stream": stream_form,
        "stream_write_behind": lambda: stream_form(dataclasses.replace(eng.config, ring_write_behind=True)),
        "mtp_timing_loop": lambda: timing_loop(mtp=True),
        "mtp_stream": mtp_stream_form,
    }
    assert list(build) == list(FORMS)
    return {name: build[name]() for name in (only or FORMS)}


def rounds(every: dict, total: int, n: int) -> dict:
    """{name: [ms a step, one a round]}: `n` rounds, each form once a round in turn."""
    ms = {name: [] for name in every}
    for _ in range(n):
        for name, form in every.items():
            ms[name].append(decode.queued({STREAM_STEPS: form}, total, 1)["ms_per_step"][STREAM_STEPS])
    return ms


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv32-tp8-shard")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--backend", default="pallas")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--total", type=int, default=128, help="steps a round of each form")
    p.add_argument("--rounds", type=int, default=4, help="rounds, each form once a round in turn")
    p.add_argument("--forms", default=None, help="comma-separated forms to time (default all: FORMS)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = jtilert.preset(a.preset, num_hidden_layers=a.layers)
    model = jtilert.random_model(cfg, fmt="fp8" if cfg.index_quant == "fp8" else "bf16")
    eng = Engine(model, config=DecodeConfig(backend=a.backend, ring_write_behind=False))   # form `stream`
    if eng.ring is None:
        raise SystemExit("stream_step: the token ring did not load (the CUDA engine is needed)")
    ms = rounds(forms(eng, a.context, a.total, a.forms.split(",") if a.forms else None), a.total, a.rounds)
    result = {"device": jax.devices()[0].device_kind, "commit": provenance.commit(),
              "command": provenance.command("bench.experiments.stream_step", argv), "layers": a.layers,
              "backend": a.backend, "context": a.context, "steps_per_call": STREAM_STEPS, "total": a.total,
              "rounds": ms, "ms_per_step": {name: statistics.median(v) for name, v in ms.items()}}
    for name, v in result["ms_per_step"].items():
        print(f"{name:22s} {v:.3f} ms a step  (rounds: {', '.join(f'{x:.3f}' for x in ms[name])})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
