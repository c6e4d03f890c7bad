"""On a GPU: why the second call of an MTP stream with the ring's write behind, as first built, never
ends (bench/RESULTS.md, sessions 41-47). Since session 47 the Engine's streams tie each step's key to
the write before it (`Engine._after_write`: form `behind_keyed`); the other `behind` forms leave it out.

The tiny model's MTP stream program with the write behind (`stream_program`), called by hand under
each of FORMS: one call at a time (after every call the carried
position and budget, and the ring's keys with their counts; a call not ended after PROBE_S has the ring
probed), then all calls queued at once. A form that hangs only under CONCURRENT scheduling points at a
missing edge in XLA's command-buffer graph; one that hangs with the loop run from the host too, at the
program; one that ends with the layers unrolled, at a layer loop that never ends; one that ends
when the graph is not updated for moved temporaries, at XLA's update of the loop body; one that ends
without PDL, at programmatic edges in the loop's body. XLA runs a program that calls an FFI target
from the host on its first execution (a warm-up: the thunks one by one, the loops from the host) and
records its CUDA graph on the second, so a first call says nothing about the graph. `behind_pure` has no
FFI call at all: each write replaced by what it returns (the position plus the count), so a hang there
is XLA's graph of the loop, not the traced FFI node (its program's graph is recorded on its first call).
`behind_rooted` gives the write a kernel before it in its iteration (its tokens pass through a select), so
it is no longer a root of the loop body's graph; `behind_keyed` orders the write before the step's IF
nodes (the sampling's conditionals), which it otherwise runs beside (the Engine's own program); `behind_no_cond`
has no conditional at all (`unconditional_program`); `behind_lhs` schedules the graph's nodes in the order
of XLA's latency-hiding scheduler (its LHS mode) instead of by their buffers alone.

    python3 -m bench.experiments.ring_behind [--out ring_behind.json] [--hlo DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import json
import pathlib
import threading
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import jtilert
from bench.experiments.stream_step import no_ring_write, with_options
from jtilert.ffi import ring
from jtilert.ops.table import STEP_XLA_OPTIONS, DecodeConfig
from jtilert.runtime.generate import STREAM_STEPS, Engine, stop_array

_step_options = functools.partial(with_options, STEP_XLA_OPTIONS)   # the step's XLA options, some changed

FORMS = {   # name: DecodeConfig fields (backend "reference")
    "behind": {"ring_write_behind": True},
    "behind_serial": {"ring_write_behind": True,
                      "xla_options": _step_options(xla_gpu_command_buffer_scheduling_mode="SERIALIZE")},
    "behind_host_loop": {"ring_write_behind": True,   # WHILE and CONDITIONAL left out: loops from the host
                         "xla_options": _step_options(
                             xla_gpu_enable_command_buffer="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL")},
    "behind_unrolled": {"ring_write_behind": True, "layer_loop": "unrolled"},   # no layer loop inside the step
    # the graph recorded once and not updated for moved temporaries (XLA then allocates through its VMM
    # allocator, each temporary at one virtual address)
    "behind_skip_temp": {"ring_write_behind": True,
                         "xla_options": _step_options(xla_gpu_command_buffer_update_mode="SKIP_TEMP")},
    # no programmatic dependent launch edges in the graph (XLA's default puts them between kernels)
    "behind_no_pdl": {"ring_write_behind": True, "xla_options": _step_options(xla_gpu_enable_pdl=False)},
    "behind_lhs": {"ring_write_behind": True,
                   "xla_options": _step_options(xla_gpu_command_buffer_scheduling_mode="LHS")},
    "behind_pure": {"ring_write_behind": True},     # ring.write replaced by WRITES[name]
    "behind_rooted": {"ring_write_behind": True},
    "behind_keyed": {"ring_write_behind": True},   # the programs of PROGRAMS[name]
    "behind_no_cond": {"ring_write_behind": True},
    "at_end": {"ring_write_behind": False},
}
CALLS = 4
PROBE_S = 20.0


def rooted_write(pos, values, count=None, write=ring.write):
    """`ring.write` after a kernel of the same iteration: the tokens pass through a select (the same
    values: positions are never negative), which XLA cannot fold into the FFI call."""
    return write(pos, jnp.where(jnp.reshape(pos, ()) >= 0, values, -1), count)


WRITES = {"behind_pure": no_ring_write, "behind_rooted": rooted_write}   # forms that replace ring.write


def keyed_program(eng):
    """The Engine's own MTP stream program: each step's random key tied to the write before it in its
    iteration (`Engine._after_write`), so the key's split, which feeds the sampling's conditionals,
    waits for the write: in the CUDA graph the write's node is then ordered before the step's IF nodes,
    while the rest of the step's forward still runs beside it."""
    return eng._wrap(eng.stream_fn(mtp=True))   # noqa: SLF001


def select_cond(pred, true_fn, false_fn, *operands):
    """`lax.cond` as both branches and a select: the same values, no conditional in the program."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), true_fn(*operands), false_fn(*operands))


def unconditional_program(eng):
    """The MTP stream program (`stream_program`) traced with every `lax.cond` as a select
    (`select_cond`), so the loop body's CUDA graph has no IF node for the write behind to run beside."""
    inner = stream_program(eng)

    def run(*args):
        with mock.patch.object(jax.lax, "cond", select_cond):
            return inner(*args)
    return run


PROGRAMS = {"behind_keyed": keyed_program,   # forms that change the program around the write
            "behind_no_cond": unconditional_program}


def keys(tokens: ring.TokenRing) -> list:
    """The ring's written slots as (key, count), by key."""
    return sorted((int(s[0]), int(s[1])) for s in tokens.slots if s[0] >= 0)


def stream_program(eng):
    """The Engine's MTP stream step with the write behind where its config asks for it, without the key
    tied to the write (`Engine._after_write` left out): the write runs beside the step's IF nodes."""
    inner = keyed_program(eng)

    def run(*args):   # the patch holds while the program is traced
        with mock.patch.object(Engine, "_after_write", staticmethod(lambda key, ok: key)):
            return inner(*args)
    return run


def by_hand(gen, prompt, hlo: pathlib.Path | None, name: str, wait: bool, stuck_s: float | None = None) -> list:
    """CALLS calls of the MTP stream program, each waited for (`wait`) or all queued at once: what
    each left behind (queued: read after the last)."""
    _, s = gen._start(prompt, 120, jtilert.Sampling(temperature=0.0), loop=False)   # noqa: SLF001
    eng = gen.engine
    stops = eng.place(stop_array([]))
    carry = (*gen._carry(s), eng.place(np.int32(100)))   # noqa: SLF001
    exe = jax.jit(PROGRAMS.get(name, stream_program)(eng), donate_argnums=(1, 2, 3, 4, 5, 6)).lower(
        eng.state, *carry, s["params"], stops).compile(eng.loop_options)
    if hlo is not None and wait:
        try:
            (hlo / f"{name}.txt").write_text(exe.as_text())
        except Exception as e:   # noqa: BLE001  (the text is a help, not the experiment)
            print(name, "no HLO text:", e)
    eng.ring.clear()
    calls = [{"start_pos": int(np.asarray(s["pos"]).reshape(-1)[0])}]
    for i in range(CALLS):
        carry = exe(eng.state, *carry, s["params"], stops)
        print(name, "call", i, "enqueued", flush=True)
        if wait:
            calls.append(state(i, carry, eng, stuck_s))
            print(name, calls[-1], flush=True)
    if not wait:
        calls.append(state(CALLS - 1, carry, eng, stuck_s))
    print(name, "waited" if wait else "queued", calls, flush=True)
    return calls


def state(i: int, carry, eng, stuck_s: float | None = None) -> dict:
    """What call i left behind, once it has ended. If it has not ended after PROBE_S, the ring is
    probed: its keys printed, cleared, and printed again a second later (keys that come back were
    written again by a call still running). If it has not ended after `stuck_s`, every thread's stack is
    printed and the process ends."""
    probe = threading.Timer(PROBE_S, lambda: probe_ring(eng.ring, i))
    probe.start()
    if stuck_s is not None:
        faulthandler.dump_traceback_later(stuck_s, exit=True)   # where the host waits, if it hangs
    pos, left = (int(np.asarray(carry[k]).reshape(-1)[0]) for k in (3, 5))
    probe.cancel()
    faulthandler.cancel_dump_traceback_later()
    return {"call": i, "pos": pos, "left": left, "keys": keys(eng.ring)}


def probe_ring(tokens: ring.TokenRing, i: int) -> None:
    before = keys(tokens)
    tokens.clear()
    time.sleep(1.0)
    print(f"call {i} not ended after {PROBE_S} s; keys {before}; a second after clearing them: {keys(tokens)}",
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    p.add_argument("--hlo", type=pathlib.Path, help="a folder for each form's compiled HLO")
    p.add_argument("--forms", default=",".join(FORMS))
    p.add_argument("--stuck-s", type=float, default=60.0,
                   help="print every thread's stack and exit when a call has not ended after this")
    a = p.parse_args()
    if a.hlo is not None:
        a.hlo.mkdir(parents=True, exist_ok=True)
    model = jtilert.load("tiny")
    prompt = jtilert.tokenizer("tiny").encode("The if statement")
    results = {"stream_steps": STREAM_STEPS}
    for name in a.forms.split(","):
        cfg = DecodeConfig(backend="reference", **FORMS[name])
        gen = jtilert.Generator(model, max_seq_len=1024, mtp=True, config=cfg)
        with mock.patch.object(ring, "write", WRITES[name]) if name in WRITES else contextlib.nullcontext():
            results[name] = {"waited": by_hand(gen, prompt, a.hlo, name, True, a.stuck_s),
                             "queued": by_hand(gen, prompt, None, name, False, a.stuck_s)}
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
