"""Why a step of the stream's program runs slower than a step of the timing loop's (bench/RESULTS.md,
session 41): both programs in calls of STREAM_STEPS steps queued back to back (`bench.decode.queued`),
one change at a time, in rounds that alternate the forms on one machine:

  timing_loop           the timing loop's program (`device_loop`): every step at one position
  timing_loop_served    the same fed the stream's data: positions moving, each step another of 997
                        random tokens
  stream                the stream's program through the token ring with each step's tokens written at the
                        end of the step, the next position the write's result (`ring_write_behind=False`)
  stream_write_behind   the same with each step's tokens written while the next step runs, before its
                        sampling (`DecodeConfig.ring_write_behind`: as `Generator.stream` runs it)
  stream_no_ring        the stream's program with no ring write at all
  stream_write_nothing  the stream's program with its ring write in place but writing nothing (a count of
                        0: the engine's kernel launched, no store to host memory, no system fence)
  stream_write_then_fusion  the stream's ring write followed by an XLA kernel that reads its result (the
                        next position, max(·, 0)), so that the FFI call is not the last node of the step
  stream_pallas_next    no ring write: the next position computed by a one-warpgroup Mosaic-GPU kernel in
                        its place (then sliced by XLA), so a custom call of jax's own sits where the write is

  timing_loop_no_pdl, stream_no_pdl  the timing loop's and the stream's programs without programmatic
                        dependent launches (`xla_gpu_enable_pdl=false`): XLA gives PDL edges only between
                        kernel nodes, so the write's node breaks the chain of early launches around it

  mtp_timing_loop, mtp_stream  the same pair for MTP steps (verify 2 tokens, then draft): the timing
                        loop's MTP program and the MTP stream's through the ring (its write runs beside the
                        draft's forward in the H200 compile: predicted to cost little)

  timing_loop_no_cond, stream_no_cond, stream_no_ring_no_cond  the timing loop, the stream and the stream
                        without its write, each step's token made without conditionals (no IF nodes in the
                        step's graph: `next_token_without_conditionals`): does a custom call after the
                        step's IF nodes cost what a custom call at the step's end costs?

  timing_loop_other_cache, stream_write_behind_other_cache  the timing loop and the write-behind stream
                        on a second set of cache arrays, allocated after a spacer that stays alive: the same
                        compiled programs with their caches elsewhere in memory (does a step's time follow
                        where its buffers are? bench/RESULTS.md, sessions 47-48)

stream_write_then_fusion and stream_pallas_next tell whether a step pays for the engine's FFI node at its
end, for any custom call there, or for the write being the step's last node; the two no_pdl forms whether
what the write costs is PDL's overlap lost around it (then their gap is smaller than the default's).

  PYTHONPATH=. python3 -m bench.experiments.stream_step --layers 36 [--forms a,b,...] --out stream_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import statistics
from unittest import mock

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

import jtilert
from bench import decode, provenance
from jtilert.ffi import ring
from jtilert.model.transformer import HEAD_CANDIDATES, Transformer
from jtilert.ops.table import DecodeConfig
from jtilert.pallas import interpret
from jtilert.runtime.generate import STREAM_STEPS, Engine
from jtilert.runtime.sampling import filtered_logprobs


def _count(values, count):
    """The count `ring.write` takes for these values: all of them where none is given."""
    return jnp.int32(jnp.ravel(jnp.asarray(values)).shape[0]) if count is None else count


def no_ring_write(pos, values, count=None):
    """What `ring.write` returns (the next position, pos + count), without writing anything."""
    return pos + _count(values, count)


def _write_nothing(write, pos, values, count=None):
    """`write` (the ring's) with a count of 0, still in the program: the next position is its result
    plus the step's count."""
    n = _count(values, count)
    return write(pos, values, jnp.zeros_like(n)) + n


def _then_fusion(write, pos, values, count=None):
    """`write` (the ring's) with an XLA kernel after it that reads its result: positions are never
    negative, so max(next, 0) is the next position, which XLA cannot know."""
    return jnp.maximum(write(pos, values, count), 0)


LANES = 128


def next_position(pos, values, count=None):
    """What `ring.write` returns (pos + count), computed by one Mosaic-GPU kernel of one warpgroup on
    int32 [LANES] vectors (the copies to and from shared memory need whole rows), the first lane kept."""
    count = _count(values, count)

    def body(p_gmem, n_gmem, o_gmem, p_smem, n_smem, o_smem, barrier):
        plgpu.copy_gmem_to_smem(p_gmem, p_smem, barrier)
        plgpu.copy_gmem_to_smem(n_gmem, n_smem, barrier)
        plgpu.barrier_wait(barrier)
        o_smem[...] = p_smem[...] + n_smem[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((LANES,), jnp.int32),
                          scratch_types=[plgpu.SMEM((LANES,), jnp.int32)] * 3 + [plgpu.Barrier(num_arrivals=2)],
                          interpret=interpret.params(), kernel_name="jtilert_experiment_next_position")
    wide = lambda v: jnp.broadcast_to(jnp.reshape(v, (1,)).astype(jnp.int32), (LANES,))
    return jnp.reshape(kernel(wide(pos), wide(count))[:1], jnp.shape(pos))


def next_token_without_conditionals(self, ops, h, params, key):
    """`Transformer.next_token` without its conditionals (its two `lax.cond`s are the IF nodes of the
    step's CUDA graph): the token always from the head's top candidates, the greedy and the sampled
    choice both computed and one selected. The same token for greedy and for top-k ≤ HEAD_CANDIDATES
    (the settings the forms run: greedy)."""
    w = self.lm_head.weight[...]
    vals, ids = ops.top_candidates(*ops("lm_head_topk", self.norm(h), w, min(HEAD_CANDIDATES, w.shape[0])),
                                   w.shape[0])
    greedy = jnp.argmax(vals[0]).astype(jnp.int32)
    drawn = jax.random.categorical(key, filtered_logprobs(vals[0], params)).astype(jnp.int32)
    return ids[0, jnp.where(params["temperature"] <= 0, greedy, drawn)][None]


FORMS = ("timing_loop", "timing_loop_served", "timing_loop_no_pdl", "stream", "stream_write_behind",
         "stream_no_ring", "stream_write_nothing", "stream_write_then_fusion", "stream_pallas_next", "stream_no_pdl",
         "mtp_timing_loop", "mtp_stream", "timing_loop_no_cond", "stream_no_cond", "stream_no_ring_no_cond",
         "timing_loop_other_cache", "stream_write_behind_other_cache")


def forms(eng, context: int, total: int, only=None) -> dict:
    """{name: (restart, call)} of the forms named in `only` (default every form, FORMS), each
    `queued`-ready at STREAM_STEPS steps a call (the timing loop's forms carry one cache, the stream's
    another, the MTP forms theirs)."""
    unknown = set(only or ()) - set(FORMS)
    if unknown:
        raise ValueError(f"stream_step: no form {sorted(unknown)}; the forms: {', '.join(FORMS)}")
    params = eng.place(jtilert.Sampling().arrays())
    rows = decode.cache_rows(context, 2 * total)
    here = eng.place(jnp.int32(context))
    state = [decode.random_cache(eng, rows), eng.place(jnp.array([1], jnp.int32)),
             eng.place(jnp.array([2], jnp.int32)), eng.place(jax.random.PRNGKey(0))]
    ids = (eng.place(jax.random.randint(jax.random.PRNGKey(1), (997,), 0, eng.cfg.vocab_size, jnp.int32)),)
    # without PDL: the stream compiled under this config, the timing loop with its options
    no_pdl = dataclasses.replace(eng.config, xla_options=with_options(eng.config.xla_options, xla_gpu_enable_pdl=False))
    stream = [decode.random_cache(eng, rows, seed=1), eng.place(jnp.array([1], jnp.int32)),
              eng.place(jnp.int32(context)), eng.place(jax.random.PRNGKey(1)), None]
    mtp_loop = [decode.random_cache(eng, rows, seed=2), *state[1:]]
    mtp_stream = [decode.random_cache(eng, rows, seed=3), eng.place(jnp.array([1], jnp.int32)),   # donated:
                  eng.place(jnp.array([2], jnp.int32)), eng.place(jnp.int32(context)),             # its own
                  eng.place(jax.random.PRNGKey(2)), None]

    spacers = []   # kept alive while the forms run

    def elsewhere(carry: list, seed: int) -> list:
        """A copy of `carry` (its arrays are donated) with a new random cache, allocated after a spacer of
        1 MiB + 12 KiB."""
        spacers.append(eng.place(jnp.zeros((1 << 20) + 12288, jnp.uint8)))
        return [decode.random_cache(eng, rows, seed=seed), *jax.tree.map(jnp.copy, carry[1:])]

    def timing_loop(config=None, advance=False, fed=(), mtp=False, patch=None, carry=None):
        options = None if config is None else dict(config.xla_options)
        form = decode.loop_form(eng, decode.device_loop(eng, mtp, advance, options),
                                carry or (mtp_loop if mtp else state), here, params, STREAM_STEPS, fed)
        with patch or contextlib.nullcontext():
            jax.block_until_ready(form[0]())   # compile
        return form

    def stream_form(patch=None, config=None, carry=None):
        """The stream's program, compiled under `patch` (a ring.write replaced) or `config` (another
        DecodeConfig), where given, instead of the engine's own; on `carry`, where given."""
        carry = carry or stream
        if config is not None:
            patch = mock.patch.object(eng, "config", config)
        with patch or contextlib.nullcontext():
            call, _ = decode.stream_call(eng, False, tuple(carry[:4]), 4 * total, params, STREAM_STEPS,
                                         None if patch is None else eng.loop_options)
        return decode.stream_form(eng, call, carry, context, 4 * total)

    def mtp_stream_form(config=None):
        with mock.patch.object(eng, "config", config) if config is not None else contextlib.nullcontext():
            call, _ = decode.stream_call(eng, True, tuple(mtp_stream[:5]), 8 * total, params, STREAM_STEPS,
                                         None if config is None else eng.loop_options)
        return decode.stream_form(eng, call, mtp_stream, context, 8 * total)

    def write(replacement):
        return mock.patch.object(ring, "write", replacement)

    @contextlib.contextmanager
    def no_cond(*patches):   # these patches and the step's token without conditionals
        with contextlib.ExitStack() as stack:
            for patch in (mock.patch.object(Transformer, "next_token", next_token_without_conditionals), *patches):
                stack.enter_context(patch)
            yield

    behind = dataclasses.replace(eng.config, ring_write_behind=True)
    build = {
        "timing_loop": timing_loop,
        "timing_loop_served": lambda: timing_loop(advance=True, fed=ids),
        "timing_loop_no_pdl": lambda: timing_loop(no_pdl),
        "stream": stream_form,
        "stream_write_behind": lambda: stream_form(config=behind),
        "stream_no_ring": lambda: stream_form(write(no_ring_write)),
        "stream_write_nothing": lambda: stream_form(write(functools.partial(_write_nothing, ring.write))),
        "stream_write_then_fusion": lambda: stream_form(write(functools.partial(_then_fusion, ring.write))),
        "stream_pallas_next": lambda: stream_form(write(next_position)),
        "stream_no_pdl": lambda: stream_form(config=no_pdl),
        "mtp_timing_loop": lambda: timing_loop(mtp=True),
        "mtp_stream": mtp_stream_form,
        "timing_loop_no_cond": lambda: timing_loop(patch=no_cond()),
        "stream_no_cond": lambda: stream_form(no_cond()),
        "stream_no_ring_no_cond": lambda: stream_form(no_cond(write(no_ring_write))),
        "timing_loop_other_cache": lambda: timing_loop(carry=elsewhere(state, 4)),
        "stream_write_behind_other_cache": lambda: stream_form(config=behind, carry=elsewhere(stream, 5)),
    }
    assert list(build) == list(FORMS)
    return {name: build[name]() for name in (only or FORMS)}


def with_options(options: tuple, **changes) -> tuple:
    """XLA options `options` ((name, value) pairs, as DecodeConfig.xla_options) with `changes` set."""
    return tuple((k, v) for k, v in options if k not in changes) + tuple(changes.items())


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
