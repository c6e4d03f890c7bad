"""Generation: prefill, the decode step compiled once, MTP speculative decoding, scoring.

`Engine` holds the compiled steps of one model on one mesh under one `DecodeConfig`. Each step
takes the weights (a flat list of arrays: the layer stacks make it a few dozen), the stacked caches
and the loop-carried scalars; everything it carries (cache, token, position, key) is donated, so the
buffers keep their device addresses from call to call. Each step is compiled ahead of time, once per
shape (`Compiled`), and sampling settings are arrays: nothing compiles while generating.

`Generator.stream` yields each token as soon as its step has made it. On a GPU with the token ring
(`DecodeConfig.token_ring`) a call runs up to `STREAM_STEPS` steps, each writing its tokens into pinned
host memory as it ends, and the host keeps two calls in flight; elsewhere a call runs one step and
returns its token, and the host dispatches step i+1 before it reads step i's. Either way the device
never waits for Python.
`Generator.generate` runs the steps on the device in a loop that ends at a stop token or the
token budget (`GENERATE_STEPS` steps per call at most).
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jtilert import pallas
from jtilert.ffi import _lib, ring
from jtilert.ffi._lib import TARGETS
from jtilert.model.transformer import Layout, Transformer, decode_weights, init_cache, split_cache
from jtilert.ops.table import DecodeConfig, Ops, ops_identity
from jtilert.pallas import interpret
from jtilert.parallel import sharding
from jtilert.runtime import compile_cache, dispatch
from jtilert.runtime.sampling import Sampling, is_int, sample, verify

GENERATE_STEPS = 64   # decode steps per call of `generate` (the loop on the device exits early at a stop)
STREAM_STEPS = 8      # decode steps per call of `stream` through the token ring (each token read as it is made)
MAX_STOPS = 8         # stop tokens the device loops check (`stream` checks any number on the host too)
assert 2 * STREAM_STEPS * 2 <= ring.SLOTS   # two calls in flight, two positions a step at most (MTP)


class Compiled:
    """`jax.jit(fn, donate_argnums)` compiled ahead of time once per argument shapes and reused for
    every later call with them; `compiles` counts the compilations, `compile_s` adds up their time
    and `cached` counts the programs read from the program cache (`compile_cache`): with `engine`,
    the program is stored there under the engine's identity and `name`, and a later process skips
    tracing and lowering it."""

    def __init__(self, fn, donate: tuple[int, ...] = (), name: str | None = None, engine: Engine | None = None,
                 options: dict | None = None, out_shardings=None):
        kw = {} if out_shardings is None else {"out_shardings": out_shardings}
        self._jit = jax.jit(fn, donate_argnums=donate, **kw)
        self._donate, self._name, self._engine, self._options = donate, name, engine, options
        self._out_shardings = out_shardings
        self._done: dict = {}
        self.compiles = 0
        self.cached = 0
        self.compile_s = 0.0

    def executable(self, *args):
        """The executable for these arguments' shapes (arrays or `jax.ShapeDtypeStruct`s with their
        shardings), compiled on first use. Its `out_info` gives the outputs' shapes and shardings.
        A loop that calls one step many times looks it up once and calls it (the executable checks
        its arguments itself): the lookup costs as much host time as the call's own dispatch."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple([(x.shape, x.dtype) for x in leaves]))
        exe = self._done.get(key)
        if exe is None:
            t0 = time.perf_counter()
            eng = self._engine
            identity = eng.program_identity(self._name) if eng is not None else None
            exe, hit = compile_cache.compile_cached(self._jit, self._donate, args, identity,
                                                   custom_calls=tuple(TARGETS), prepare=eng and eng.prepare,
                                                   options=self._options, out_shardings=self._out_shardings)
            self._done[key] = exe
            self.compile_s += time.perf_counter() - t0
            self.compiles += 1
            self.cached += hit
        return exe

    def __call__(self, *args):
        return self.executable(*args)(*args)

    def lower(self, *args):
        return self._jit.lower(*args)


class Engine:
    """The compiled steps of one model on one mesh under one DecodeConfig."""

    def __init__(self, model: Transformer, mesh: Mesh | None = None, config: DecodeConfig = DecodeConfig()):
        self.cfg, self.dtype, self.config = model.cfg, model.dtype, config
        if config.backend == "pallas":
            if not pallas.available():
                raise RuntimeError("backend='pallas': jax.experimental.pallas.mosaic_gpu does not import here")
        self.mesh = mesh
        # the kernels run in GPU interpret mode (host callbacks): no program cache, no host output
        self._interpreted = config.backend == "pallas" and interpret.params() is not None
        self.tp = tp = sharding.mesh_tp(mesh)
        sharding.check_tp(self.cfg, tp)
        self.graphdef, state = nnx.split(decode_weights(model, tp=tp, backend=config.backend))
        if tp > 1:
            specs = sharding.param_specs(state)
            self._state_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
            state = sharding.shard_state(state, mesh)
        # The steps take the weights as a flat list of arrays (an nnx.State argument costs host time
        # per array and call to flatten).
        self.state, self._treedef = jax.tree_util.tree_flatten(state)
        self._identity = self._program_identity()
        self.forward = Compiled(self._wrap(self._forward), (1,), "forward", self)
        self.draft = Compiled(self._wrap(self._draft), (1,), "draft", self)   # MTP prefill: chunk-shaped
        opts = self.step_options   # the decode-shaped steps: DecodeConfig.xla_options
        # What a step returns for `stream` (the token; MTP: the emitted tokens and their count) it writes
        # into pinned host memory itself, so reading it starts no transfer of its own. Not where the
        # kernels run in GPU interpret mode: their ordered host callbacks add an effect token to the
        # step's outputs, which jax 0.11.2 leaves out when it lowers the outputs' memory kinds (a failed
        # zip); nor under PjRt's dispatch thread, where a pinned host output is read before the step
        # writes it (`dispatch`). There the token stays in device memory and `_HostCopy` copies it.
        host = None if self._interpreted or dispatch.on() else self.sharding.with_memory_kind("pinned_host")
        self.decode = Compiled(self._wrap(self._decode), (1, 2, 3, 4), "decode", self, opts,
                               out_shardings=(None,) * 4 + (host,))
        self.speculate = Compiled(self._wrap(self._speculate), (1, 2, 3, 4, 5), "speculate", self, opts,
                                  out_shardings=(None,) * 5 + (host, host))
        # With the token ring (DecodeConfig.token_ring) `stream` runs up to STREAM_STEPS steps a call
        # instead, each writing its tokens into the ring as soon as they exist; every output is a donated
        # carried array. None where there is no ring.
        self.rings = self._token_rings()
        self.decode_stream = self.speculate_stream = None
        loop_opts = self.loop_options
        if self.rings is not None:
            self.decode_stream = Compiled(self._wrap(self.stream_fn(mtp=False)), (1, 2, 3, 4, 5), "decode_stream",
                                          self, loop_opts)
            self.speculate_stream = Compiled(self._wrap(self.stream_fn(mtp=True)), (1, 2, 3, 4, 5, 6),
                                             "speculate_stream", self, loop_opts)
        self.decode_loop = Compiled(self._wrap(self._decode_loop), (1, 2, 3, 4), "decode_loop", self, loop_opts)
        self.speculate_loop = Compiled(self._wrap(self._speculate_loop), (1, 2, 3, 4, 5), "speculate_loop", self,
                                       loop_opts)
        self.first_token = Compiled(_first_token, (2,), "first_token", self)
        self.first_draft = Compiled(_first_draft, (), "first_draft", self)

    # --- the program cache -------------------------------------------------------------------
    def _program_identity(self) -> tuple | None:
        """What the steps close over, for their keys in the program cache (`compile_cache`): the
        model (config, dtype, module graph), the DecodeConfig, the mesh, and whether the CUDA engine
        loaded (its ops lower to plain XLA where it did not), what the op table runs (an op replaced
        in `OPS`, as a benchmark's variant does, is another program), and whether the dispatch thread
        is on (the returning steps' token output is in device memory then). None (not cached) where
        the kernels run in GPU interpret mode: their host callbacks cannot be stored."""
        if self._interpreted:
            return None
        mesh = None if self.mesh is None else (self.mesh.axis_names, self.mesh.devices.shape,
                                              tuple(int(d.id) for d in self.mesh.devices.flat))
        engine = (_lib.load()[1] or "loaded") if self._may_use_engine() else None
        graph = hashlib.sha256(repr(self.graphdef).encode()).hexdigest()
        return (repr(self.cfg), jnp.dtype(self.dtype).name, repr(self.config), graph, mesh, engine, ops_identity(),
                dispatch.on())

    def _may_use_engine(self) -> bool:
        """Whether tracing may call the CUDA engine (a GPU, and a config that uses it)."""
        c = self.config
        return interpret.on_gpu() and (c.backend == "pallas" or c.engine_all_reduce or c.split_indexer
                                       or c.token_ring)

    @property
    def ring_behind(self) -> bool:
        """Whether the stream's steps write their tokens into the ring while the next step runs
        (DecodeConfig.ring_write_behind). Not where the model's layers run conditionals (the shared
        indexer's layers, `Layout.all_full` false): the write runs beside a step's forward, and a CUDA
        graph in which it runs beside a conditional node may never end (`_stream_loop`). Those streams
        write at each step's end, with a warning once."""
        if self.rings is None or not self.config.ring_write_behind:
            return False
        if not Layout.of(self.cfg).all_full:
            _lib.warn_once("ring-write-behind-conditionals",
                           "jtilert: DecodeConfig.ring_write_behind does not apply to a model whose layers share "
                           "indexers (each layer's indexer runs under a conditional); each stream step writes its "
                           "tokens at its end")
            return False
        return True

    def _token_rings(self) -> list | None:
        """The token ring of every device of the engine (`Generator.stream` reads the first's), or None
        where the steps return their tokens (`DecodeConfig.token_ring`)."""
        if not self.config.token_ring or self._interpreted or not interpret.on_gpu():
            return None
        lib, why = _lib.load()
        if lib is None:
            _lib.warn_once("token-ring", f"jtilert: the CUDA engine did not load ({why}); the decode steps "
                                         "return their tokens instead of writing them into its token ring")
            return None
        return [ring.TokenRing(d) for d in self.sharding.device_set]

    @property
    def ring(self):
        """The token ring the host reads (the first device's), or None."""
        if self.rings is None:
            return None
        first = jax.devices()[0] if self.mesh is None else self.mesh.devices.flat[0]
        return next(r for r in self.rings if r.device == first)

    @property
    def step_options(self) -> dict | None:
        """XLA compile options of the decode-shaped steps (`DecodeConfig.xla_options`; None: XLA's own)."""
        return dict(self.config.xla_options) or None

    @property
    def loop_options(self) -> dict | None:
        """XLA compile options of the steps that loop over decode steps on the device (`stream`'s calls
        through the ring, `generate`'s): the step's, with every thunk sequence recorded into a CUDA
        graph however short (None where the step's are: XLA's own, which leave loops to the host).
        Such a program's top level can be its loop and a copy, and XLA records no sequence of fewer
        than `xla_gpu_graph_min_graph_size` thunks (default 5): the loop would run from the host, each
        step's condition read back before the next (RESULTS.md, session 37)."""
        opts = self.step_options
        return None if opts is None else {**opts, "xla_gpu_graph_min_graph_size": "1"}

    def program_identity(self, name: str) -> tuple | None:
        return None if self._identity is None else (name, *self._identity)

    def prepare(self, exported) -> bool:
        """Before compiling a cached program: the set-up its tracing and lowering would have done.
        A program that calls the CUDA engine needs the engine's FFI targets registered and, over a
        mesh, its device groups created; False where the engine does not load here."""
        if b"jtilert_" not in exported.mlir_module_serialized:
            return True
        lib, _ = _lib.load()
        if lib is None:
            return False
        rows = _lib.groups_of(self.mesh, sharding.AXIS) if self.tp > 1 else None
        for row in () if rows is None else rows:
            lib.group(tuple(int(v) for v in row))
        return True

    # --- tracing -----------------------------------------------------------------------------
    def _wrap(self, fn):
        """Run `fn(model, ops, cache, *args)` with this engine's ops and, with tp > 1, under shard_map."""
        def run(state, cache, *args):
            model = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._treedef, state))
            return fn(model, Ops(self.config, sharding.AXIS if self.tp > 1 else None), cache, *args)

        if self.tp == 1:
            return run

        def sharded(state, cache, *args):
            f = jax.shard_map(run, mesh=self.mesh, in_specs=(self._state_specs, P()) + (P(),) * len(args),
                              out_specs=P(), check_vma=False)
            return f(state, cache, *args)
        return sharded

    @staticmethod
    def _forward(model, ops, cache, tokens, start):
        logits, hidden, cache = model(ops, tokens, start, cache)
        return logits, hidden, cache

    @staticmethod
    def _draft(model, ops, cache, hidden, next_tokens, start):
        return model.draft(ops, hidden, next_tokens, start, cache)

    @staticmethod
    def _decode(model, ops, cache, token, pos, key, params):
        """One plain decode step: (cache, next token [1], pos + 1, key, the token again for the host:
        the first four are donated to the next step, the last is read back)."""
        h, cache = model.hidden(ops, token, pos, cache)
        key, sub = jax.random.split(key)
        token = model.next_token(ops, h, params, sub)
        return cache, token, pos + 1, key, token

    @staticmethod
    def _stream_loop(step, carry: tuple, at: int, width: int, left, stops, steps: int = STREAM_STEPS,
                     behind: bool = False) -> tuple:
        """Up to `steps` calls of `step(carry) -> (carry, emitted [width], n)` (a step that makes its first
        n emitted tokens, moves the position, carry[at], on by n and draws from the random key after it,
        carry[at + 1]), each step's tokens written into the token ring under its position, ending after
        a step whose n tokens hold a stop token (one of `stops`) or once `left`, the tokens still wanted,
        is 0 or less: (*carry, left), all carried to the next call.

        A write returns the position after the step it wrote, which keeps it in the program. Without
        `behind` a step's tokens are written at its end and the loop carries the write's result as the
        next position, a program measured slower (bench/RESULTS.md, sessions 41-47). `behind`
        (`DecodeConfig.ring_write_behind`): each step's tokens are written while the next step runs, and
        the last step's after the loop. There the position moves on in the step, and the write's result
        is checked against it: the budget, and the next write's position, tokens and count, pass through
        that check, so they depend on the write by data and nothing overwrites what it reads before it
        has read it. (A mismatch, which never happens, ends the stream: left = -1.) The step's random
        key passes through that check too (`_after_write`), so the write runs beside the step's forward
        but before its sampling: where the write ran beside the sampling's conditional nodes, the second
        launch of the loop's CUDA graph never ended on a GPU (sessions 42-47; the model's layers have
        none, `ring_behind`)."""
        if not behind:
            def body(c):
                carry, left, i = c
                pos = carry[at]
                carry, emitted, n = step(carry)
                carry = (*carry[:at], ring.write(pos, emitted, n), *carry[at + 1:])   # the next position
                stop = jnp.any(_stop_hits(emitted, n, stops))
                return carry, jnp.where(stop, 0, left - n), i + 1

            carry, left, _ = jax.lax.while_loop(lambda c: (c[2] < steps) & (c[1] > 0), body,
                                                (carry, left, jnp.int32(0)))
            return (*carry, left)

        def body_behind(c):
            carry, left, i, pending = c
            pos = carry[at]
            ok = ring.write(*pending) == pos   # the step before's tokens, beside this step
            carry = (*carry[:at + 1], Engine._after_write(carry[at + 1], ok), *carry[at + 2:])
            carry, emitted, n = step(carry)
            stop = jnp.any(_stop_hits(emitted, n, stops))
            left = jnp.where(ok, jnp.where(stop, 0, left - n), -1)
            pending = (jnp.where(ok, pos, -1), jnp.where(ok, emitted, -1), jnp.where(ok, n, 0).astype(jnp.int32))
            return carry, left, i + 1, pending

        nothing = (carry[at], jnp.zeros(width, jnp.int32), jnp.int32(0))   # a write of no tokens writes nothing
        carry, left, _, pending = jax.lax.while_loop(lambda c: (c[2] < steps) & (c[1] > 0), body_behind,
                                                     (carry, left, jnp.int32(0), nothing))
        return (*carry, jnp.where(ring.write(*pending) == carry[at], left, -1))

    @staticmethod
    def _after_write(key, ok):
        """The random key, unchanged, made to depend on the ring write's check `ok` (true unless the
        stream ends), so that what draws from it waits for the write."""
        return key ^ jnp.where(ok, 0, 1).astype(key.dtype)

    def stream_fn(self, mtp: bool, steps: int = STREAM_STEPS):
        """The stream's program before `_wrap`: `_speculate_stream` (MTP, STREAM_STEPS steps a call) or
        `_decode_stream` of up to `steps` steps a call, with this engine's ring write (`ring_behind`)."""
        if mtp:
            if steps != STREAM_STEPS:
                raise ValueError(f"stream_fn: MTP streams run STREAM_STEPS ({STREAM_STEPS}) steps a call, not {steps}")
            return functools.partial(self._speculate_stream, behind=self.ring_behind)
        return functools.partial(self._decode_stream, steps=steps, behind=self.ring_behind)

    @staticmethod
    def _decode_stream(model, ops, cache, token, pos, key, left, params, stops, steps: int = STREAM_STEPS,
                       behind: bool = False):
        """`_stream_loop` of decode steps, up to `steps` a call: (cache, token, pos, key, left)."""
        def step(c):
            c = Engine._decode(model, ops, *c, params)
            return c[:4], c[4], jnp.int32(1)   # the step's token
        return Engine._stream_loop(step, (cache, token, pos, key), 2, 1, left, stops, steps, behind)

    @staticmethod
    def _speculate_stream(model, ops, cache, token, draft, pos, key, left, params, stops, behind: bool = False):
        """`_stream_loop` of MTP steps (1 or 2 tokens each): (cache, token, draft, pos, key, left)."""
        def step(c):
            *c, emitted, n = Engine._speculate(model, ops, *c, params)
            return tuple(c), emitted, n
        return Engine._stream_loop(step, (cache, token, draft, pos, key), 3, 2, left, stops, behind=behind)

    @staticmethod
    def _speculate(model, ops, cache, token, draft, pos, key, params):
        """One MTP step: verify the draft for pos+1 with a 2-token forward, then draft again.
        Returns (cache, next token [1], next draft [1], next pos, key, emitted [2], n_emitted)."""
        logits, hidden, cache = model(ops, jnp.concatenate([token, draft]), pos, cache)
        key, k1, k2 = jax.random.split(key, 3)
        accepted, first = verify(logits[0], draft[0], params, k1)
        second = sample(logits[1], params, k2)
        mtp_logits, cache = model.draft(ops, hidden, jnp.stack([first, second]), pos, cache)
        drafts = jnp.argmax(mtp_logits, axis=-1).astype(jnp.int32)
        n = jnp.where(accepted, 2, 1)
        nxt = jnp.where(accepted, second, first)
        new_draft = jnp.where(accepted, drafts[1], drafts[0])
        return cache, nxt[None], new_draft[None], pos + n, key, jnp.stack([first, second]), n

    @staticmethod
    def _generate_loop(step, carry: tuple, stops, budget, width: int) -> tuple:
        """Up to GENERATE_STEPS calls of `step(carry) -> (carry, emitted [width], n)` (a step that emits
        its first n tokens), their tokens gathered in one array; the loop ends after a step that emits a
        stop token (one of `stops`; the output ends at it) or once `budget` tokens are out:
        (*carry, tokens [width · (GENERATE_STEPS + 1)], count, steps)."""
        def cond(c):
            return (c[2] < jnp.minimum(budget, width * GENERATE_STEPS)) & (c[3] < GENERATE_STEPS) & ~c[4]

        def body(c):
            carry, out, n, steps, _ = c
            carry, emitted, made = step(carry)
            hit = _stop_hits(emitted, made, stops)
            stop = jnp.any(hit)
            made = jnp.where(stop, jnp.argmax(hit) + 1, made)   # up to the first stop token
            out = jax.lax.dynamic_update_slice(out, emitted, (n,))
            return carry, out, n + made, steps + 1, stop

        out = jnp.zeros(width * (GENERATE_STEPS + 1), jnp.int32)
        z = jnp.int32(0)
        carry, out, n, steps, _ = jax.lax.while_loop(cond, body, (carry, out, z, z, jnp.bool_(False)))
        return (*carry, out, n, steps)

    @staticmethod
    def _decode_loop(model, ops, cache, token, pos, key, params, stops, budget):
        """`_generate_loop` of decode steps: (cache, token, pos, key, tokens, count, steps)."""
        def step(c):
            *c, token = Engine._decode(model, ops, *c, params)
            return tuple(c), token, jnp.int32(1)
        return Engine._generate_loop(step, (cache, token, pos, key), stops, budget, 1)

    @staticmethod
    def _speculate_loop(model, ops, cache, token, draft, pos, key, params, stops, budget):
        """`_generate_loop` of MTP steps (1 or 2 tokens each; the drafts accepted are count − steps):
        (cache, token, draft, pos, key, tokens, count, steps)."""
        def step(c):
            *c, emitted, n = Engine._speculate(model, ops, *c, params)
            return tuple(c), emitted, n
        return Engine._generate_loop(step, (cache, token, draft, pos, key), stops, budget, 2)

    # --- caches ------------------------------------------------------------------------------
    def new_cache(self, rows: int) -> dict:
        return self.place(init_cache(self.cfg, rows, self.dtype))

    @property
    def sharding(self):
        """Where `place` puts arrays: the first device, or replicated over the mesh."""
        return SingleDeviceSharding(jax.devices()[0]) if self.mesh is None else NamedSharding(self.mesh, P())

    def place(self, x):
        """x on this engine's device(s), committed (replicated over the mesh)."""
        return jax.device_put(x, self.sharding)

    def aval(self, shape, dtype) -> jax.ShapeDtypeStruct:
        """The abstract value of an array `place` would make."""
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=self.sharding)

    def compile_s(self) -> float:
        """Seconds spent compiling this engine's steps so far."""
        return sum(c.compile_s for c in self.steps())

    def steps(self) -> tuple[Compiled, ...]:
        steps = (self.forward, self.draft, self.decode, self.speculate, self.decode_stream, self.speculate_stream,
                 self.decode_loop, self.speculate_loop, self.first_token, self.first_draft)
        return tuple(c for c in steps if c is not None)

    @property
    def num_arguments(self) -> int:
        """Arrays a decode call passes: weights, cache arrays and the six loop scalars."""
        return len(self.state) + len(jax.tree_util.tree_leaves(jax.eval_shape(
            lambda: init_cache(self.cfg, 8, self.dtype)))) + 6


def _first_token(logits, last, key, params):
    """The token after the prompt from the last prefill chunk's logits [c, V] (the prompt's last
    position is row `last`), and the key for the decode steps."""
    key, sub = jax.random.split(key)
    return sample(logits[last], params, sub)[None], key


def _first_draft(logits, last):
    """The MTP block's first draft [1]: the argmax of row `last` of its last prefill chunk's logits."""
    return jnp.argmax(logits[last]).astype(jnp.int32)[None]


def chunk_sizes(prefill_chunk) -> tuple[int, ...]:
    """`prefill_chunk` (an int, or several) as distinct sizes, largest first; a ValueError otherwise."""
    sizes = (prefill_chunk,) if is_int(prefill_chunk) else tuple(prefill_chunk) if isinstance(
        prefill_chunk, (tuple, list)) else ()
    if not sizes or not all(is_int(c) and c >= 1 for c in sizes):
        raise ValueError(f"prefill_chunk must be an integer >= 1 or a sequence of them, got {prefill_chunk!r}")
    return tuple(sorted({int(c) for c in sizes}, reverse=True))


# The fixed cost of one prefill chunk, in tokens (`chunk_plan`'s cost model: a chunk of c tokens costs
# CHUNK_FIXED_TOKENS + c). On one H200 with DeepSeek-V3.2's one-GPU share (61 layers, fp8) at a 4096
# context, a chunk takes about 140 ms plus 0.21 ms per token (a 1024-token prompt: 16 chunks of 64
# 2.42 s, 4 of 256 0.81 s, one of 1024 0.358 s), and 140 / 0.21 ≈ 650: reading every weight once per
# chunk dominates, so padding up to a larger chunk often beats several small ones. At a long context
# each token costs more (the indexer scores every cached row), so this overstates the fixed part
# there; the plan it picks then differs from the best one in its last chunk at most.
CHUNK_FIXED_TOKENS = 650

DEFAULT_PREFILL_CHUNK = (1024, 128)   # two compiled prefill steps; a prompt's tail pads to 128 or 1024


def chunk_plan(n: int, sizes: tuple[int, ...], room: int | None = None, fixed: int | None = None) -> list[int]:
    """The chunks a prefill of n tokens runs, in order: of the sequences of `sizes` covering n tokens
    (the last chunk padded) within `room` cache rows (default: any), the one of least estimated
    cost Σ (fixed + c) over its chunks c (`fixed` default CHUNK_FIXED_TOKENS), fewer chunks on a tie;
    largest first. Cost = fixed · chunks + tokens covered, padding included. E.g. sizes (1024, 128):
    300 tokens → [1024] (650 + 1024 = 1674 against 3 · 650 + 384 = 2334 for three 128s); 1100 →
    [1024, 128] (2 · 650 + 1152 = 2452; [1024, 1024] is 3348); 200 → [128, 128] (1556 < 1674).
    Only the last chunk holds padding (a plan whose padding covered a whole chunk of it would cost
    more without that chunk)."""
    return list(_plan(int(n), tuple(sizes), None if room is None else int(room),
                      CHUNK_FIXED_TOKENS if fixed is None else int(fixed)))


@functools.lru_cache(maxsize=256)
def _plan(n: int, sizes: tuple[int, ...], room: int | None, fixed: int) -> tuple[int, ...]:
    if n <= 0:
        return ()
    g = math.gcd(*sizes)
    units = sorted({c // g for c in sizes}, reverse=True)
    top = -(-n // g) + units[0] - 1          # covering more than this pads a whole chunk
    if room is not None:
        top = min(top, room // g)
    need = -(-n // g)
    # fewest chunks summing exactly to m units, and the last chunk of one such sum
    never = top + 1
    count, last = [0] + [never] * top, [0] * (top + 1)
    for m in range(1, top + 1):
        for u in units:
            if u <= m and count[m - u] + 1 < count[m]:
                count[m], last[m] = count[m - u] + 1, u
    options = [(fixed * count[m] + m * g, count[m], m) for m in range(need, top + 1) if count[m] < never]
    if not options:
        raise ValueError(f"no plan of chunks {sizes} covers {n} tokens within {room} cache rows")
    best = min(options)[2]
    plan = []
    while best:
        plan.append(last[best] * g)
        best -= last[best]
    return tuple(sorted(plan, reverse=True))


def chunks_of(ids: np.ndarray, sizes: tuple[int, ...], room: int | None = None):
    """(offset, chunk) of the chunks `chunk_plan` cuts ids into (within `room` cache rows), the last
    padded with zeros."""
    off = 0
    for c in chunk_plan(ids.size, sizes, room):
        part = np.zeros(c, np.int32)
        part[:min(c, ids.size - off)] = ids[off:off + c]
        yield off, part
        off += c


class Generator:
    """Decode one sequence at a time.

    >>> gen = jtilert.Generator(jtilert.load("tiny"), max_seq_len=512)
    >>> gen.generate(prompt_ids, max_new_tokens=64)

    `prefill_chunk`: the prompt's tokens per prefill step, one size or several (default (1024, 128)),
    each size one compiled step: a prompt runs in the sequence of them that `chunk_plan` estimates
    cheapest (a chunk's fixed cost is worth about 650 tokens, so a 300-token prompt runs as one
    padded 1024 chunk, 1100 tokens as 1024 + 128).
    """

    def __init__(self, model: Transformer, max_seq_len: int = 2048, sampling: Sampling | None = None,
                 mtp: bool = False, backend: str = "reference", mesh: Mesh | None = None,
                 prefill_chunk: int | Sequence[int] = DEFAULT_PREFILL_CHUNK, engine_all_reduce: bool = False, split_indexer: bool = False,
                 config: DecodeConfig | None = None):
        cfg = model.cfg
        if not is_int(max_seq_len) or max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        if mtp and model.mtp is None:
            raise ValueError("mtp=True but the model has no MTP block (num_nextn_predict_layers=0)")
        sizes = chunk_sizes(prefill_chunk)
        config = config or DecodeConfig(backend=backend, engine_all_reduce=engine_all_reduce,
                                        split_indexer=split_indexer)
        self.cfg, self.max_seq_len, self.mtp = cfg, max_seq_len, mtp
        self.sampling = sampling or Sampling()
        # Chunk sizes no longer than the sequence can be (each compiles its own prefill step)
        self.chunks = tuple(c for c in sizes if c <= max_seq_len) or sizes[-1:]
        # Room for the steps a call runs past the last token kept (the step in flight when a stop token
        # is read, up to 2 rows per MTP step), and for the padded last prefill chunk: a chunk of the
        # smallest size fits after any start (an injected cache's length need not be a multiple of it);
        # `chunk_plan` pads within these rows.
        c = self.chunks[-1]
        self.rows = -(-(max_seq_len + 4 + c - 1) // c) * c
        cache = jax.eval_shape(lambda: init_cache(cfg, self.rows, model.dtype))   # replicated on each device
        sharding.check_memory(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache)), mesh,
                              f"the cache of Generator(max_seq_len={max_seq_len}) ({self.rows} positions)")
        self.engine = Engine(model, mesh, config)
        self._cache = None
        self._injected_ids: np.ndarray | None = None   # the token ids an injected cache holds
        self.stats: dict = {}

    @property
    def compiles(self) -> int:
        """Compilations of this Generator's steps so far."""
        return sum(c.compiles for c in self.engine.steps())

    @property
    def cached_programs(self) -> int:
        """Of those, the programs read from the program cache (not traced nor lowered here)."""
        return sum(c.cached for c in self.engine.steps())

    # --- validation -------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids, max_new_tokens: int, injected: bool = True) -> np.ndarray:
        """prompt_ids as int32, or a ValueError saying what is wrong with them (with `injected`, also
        when they do not extend the ids of an injected cache the next call would continue)."""
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt token ids must be integers, got dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} outside the vocab [0, {self.cfg.vocab_size})")
        if not is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        if ids.size + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({ids.size} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={self.max_seq_len}")
        held = self._injected_ids if injected else None
        if held is not None:
            if ids.size <= held.size:
                raise ValueError(f"the injected cache holds {held.size} tokens: the prompt must extend them "
                                 f"(got {ids.size} tokens)")
            diff = np.flatnonzero(ids[:held.size] != held)
            if diff.size:
                i = int(diff[0])
                raise ValueError(f"the prompt does not start with the {held.size} token ids the injected cache "
                                 f"holds: position {i} is {int(ids[i])} in the prompt, {int(held[i])} in the cache")
        return ids.astype(np.int32)

    # --- caches -----------------------------------------------------------------------------
    def inject_cache(self, caches: Sequence[dict], token_ids, mtp_cache: dict | None = None) -> None:
        """Use externally computed caches (prefill/decode disaggregation) of the tokens `token_ids`
        (positions [0, length), length = len(token_ids)). `caches[i]` has layer i's arrays (`kv`
        [S, kv_lora], `pe` [S, rope], and `index_k` / `index_scale` for layers with their own indexer),
        as `prefill(token_ids)` returns them, S >= length; rows past `length` are ignored. The next
        `generate` / `stream` needs a prompt that starts with `token_ids` and is longer (anything else is
        a ValueError, and the cache stays injected); it prefills only the tokens after them."""
        if isinstance(token_ids, numbers.Integral):
            raise TypeError(f"inject_cache: pass the token ids the caches hold (their count is the length), "
                            f"not a length ({token_ids})")
        ids = np.asarray(token_ids)
        length = ids.size
        lay = Layout.of(self.cfg)
        template = init_cache(self.cfg, self.rows, self.engine.dtype)
        main = self.cfg.num_hidden_layers
        if len(caches) != main:
            raise ValueError(f"inject_cache: got {len(caches)} layer caches, the model has {main}")
        if ids.ndim != 1 or not 0 < length < self.max_seq_len:
            raise ValueError(f"inject_cache: token_ids must be a 1-D sequence of 1 to max_seq_len-1="
                             f"{self.max_seq_len - 1} ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer) or ((ids < 0) | (ids >= self.cfg.vocab_size)).any():
            raise ValueError(f"inject_cache: token_ids must be integers in [0, {self.cfg.vocab_size})")
        if mtp_cache is None and self.mtp:
            raise ValueError("inject_cache: mtp=True needs the MTP layer's cache too (mtp_cache=...)")
        given = list(enumerate(caches)) + ([(main, mtp_cache)] if mtp_cache is not None else [])
        cache = dict(template)
        for i, got in given:
            name = "mtp" if i == main else f"layer {i}"
            want = lay.cache_index(i, template)
            if set(got) != set(want):
                raise ValueError(f"inject_cache: {name} has arrays {sorted(got)}, expected {sorted(want)}")
            for k, j in want.items():
                arr = jnp.asarray(got[k])
                row_shape = template[k].shape[2:]
                if arr.shape[1:] != row_shape or arr.shape[0] < length:
                    raise ValueError(f"inject_cache: {name}.{k} has shape {tuple(arr.shape)}, expected "
                                     f"(>={length}, {', '.join(map(str, row_shape))})")
                cache[k] = cache[k].at[j, :length].set(arr[:length].astype(cache[k].dtype))
        self._cache = self.engine.place(cache)
        self._injected_ids = ids.astype(np.int32)

    def prefill(self, prompt_ids) -> list[dict]:
        """The per-layer caches of prompt_ids, as `inject_cache` takes them (for disaggregation:
        one Generator prefills, another decodes)."""
        ids = self._check_prompt(prompt_ids, 0, injected=False)
        *_, cache = self._prefill(ids, 0, self.engine.new_cache(self.rows))
        return split_cache(self.cfg, cache)[0]

    def _take_cache(self) -> tuple[dict, int]:
        if self._cache is not None:
            cache, start = self._cache, self._injected_ids.size
            self._cache, self._injected_ids = None, None
            return cache, start
        return self.engine.new_cache(self.rows), 0

    # --- prefill ----------------------------------------------------------------------------
    def _prefill(self, ids: np.ndarray, start: int, cache: dict):
        """Run the main model over ids[start:] in the chunks of `chunk_plan`: (the last chunk's logits,
        the row of the prompt's last position in it, the chunks' hidden states, cache). Only compiled
        steps run, so a new prompt length compiles nothing."""
        eng, tail = self.engine, ids[start:]
        hidden, logits = [], None
        for off, part in chunks_of(tail, self.chunks, self.rows - start):
            logits, h, cache = eng.forward(eng.state, cache, eng.place(part), eng.place(np.int32(start + off)))
            hidden.append(h)
        return logits, tail.size - 1 - off, hidden, cache

    def _prefill_draft(self, ids, start, first: int, hidden: list, cache):
        """Fill the MTP layer's cache over the prompt (chunk by chunk, on the main model's hidden
        chunks) and return the first draft (for the position after `first`)."""
        eng, n = self.engine, ids.size - start
        nxt = np.zeros(sum(h.shape[0] for h in hidden), np.int32)    # the token after each prompt position
        nxt[:n - 1], nxt[n - 1] = ids[start + 1:], first
        logits, off = None, 0
        for h in hidden:
            c = h.shape[0]
            logits, cache = eng.draft(eng.state, cache, h, eng.place(nxt[off:off + c]), eng.place(np.int32(start + off)))
            off += c
        return eng.first_draft(logits, eng.place(np.int32(n - 1 - (off - c)))), cache

    def _prepare(self, sampling: Sampling, loop: bool) -> None:
        """Compile, before the clock starts, every step the coming generation runs: the prefill chunk,
        the first token (and the MTP block's prefill and first draft), then the stream's calls
        (`Engine.decode_stream` / `speculate_stream` through the token ring, else one step a call) or the
        device loop (`generate`). Shapes are known without running anything; each
        step compiles once per Generator."""
        eng, i32 = self.engine, jnp.int32
        cache = jax.tree_util.tree_map(lambda x: eng.aval(x.shape, x.dtype),
                                       jax.eval_shape(lambda: init_cache(self.cfg, self.rows, eng.dtype)))
        params = jax.tree_util.tree_map(lambda x: eng.aval(np.shape(x), np.asarray(x).dtype), sampling.arrays())
        scalar = eng.aval((), i32)
        for c in self.chunks:   # any chunk size may be a prompt's last (the first token reads its logits)
            logits, hidden, _ = eng.forward.executable(eng.state, cache, eng.aval((c,), i32), scalar).out_info
            token, key = eng.first_token.executable(logits, scalar, eng.aval((2,), jnp.uint32), params).out_info
            if self.mtp:
                draft_logits, _ = eng.draft.executable(eng.state, cache, hidden, eng.aval((c,), i32), scalar).out_info
                draft = eng.first_draft.executable(draft_logits, scalar).out_info
        stops = eng.aval((MAX_STOPS,), i32)
        carry = (cache, token, draft, scalar, key) if self.mtp else (cache, token, scalar, key)
        if loop:
            (eng.speculate_loop if self.mtp else eng.decode_loop).executable(eng.state, *carry, params, stops, scalar)
        elif eng.rings is not None:
            (eng.speculate_stream if self.mtp else eng.decode_stream).executable(eng.state, *carry, scalar, params,
                                                                                 stops)
        else:
            (eng.speculate if self.mtp else eng.decode).executable(eng.state, *carry, params)

    def _start(self, prompt_ids, max_new_tokens, sampling, loop: bool):
        """Compile what is missing, prefill and make the first token: (first token id, device state for
        the steps). Starts `stats`: compile_s (compiling in this call), ttft_s (from the end of
        compilation to the first token, the MTP block's prefill included)."""
        ids = self._check_prompt(prompt_ids, max_new_tokens)
        sampling = sampling or self.sampling
        eng = self.engine
        compiled = eng.compile_s()
        self._prepare(sampling, loop)
        self.stats = {"prompt_tokens": int(ids.size), "generated": 0, "steps": 0, "drafted": 0, "accepted": 0,
                      "compile_s": eng.compile_s() - compiled}
        t0 = time.perf_counter()
        params = eng.place(sampling.arrays())
        cache, start = self._take_cache()
        logits, last, hidden, cache = self._prefill(ids, start, cache)
        token, key = eng.first_token(logits, eng.place(np.int32(last)), eng.place(_seed_key(sampling.seed)), params)
        first = int(token[0])
        state = {"cache": cache, "token": token, "pos": eng.place(np.int32(ids.size)), "key": key, "params": params}
        if self.mtp:
            state["draft"], state["cache"] = self._prefill_draft(ids, start, first, hidden, cache)
        self.stats["ttft_s"] = time.perf_counter() - t0
        return first, state

    def _finish_stats(self, t1: float) -> None:
        """Decode figures of the tokens after the first, measured from the first token on: decode_s,
        ms_per_token and tokens_per_s (wall clock, as the caller received them)."""
        s = self.stats
        s["decode_s"] = time.perf_counter() - t1
        after_first = s["generated"] - 1
        s["ms_per_token"] = s["decode_s"] / after_first * 1e3 if after_first > 0 else None
        s["tokens_per_s"] = after_first / s["decode_s"] if after_first > 0 and s["decode_s"] > 0 else None
        s["acceptance"] = self.acceptance

    # --- generation -------------------------------------------------------------------------
    def stream(self, prompt_ids, max_new_tokens: int, sampling: Sampling | None = None,
               stop_tokens: Sequence[int] | None = None) -> Iterator[int]:
        """Yield generated token ids as they are produced, each as soon as its step finishes (stops
        after a stop token, which is yielded)."""
        stops = set(self.cfg.eos_token_id if stop_tokens is None else stop_tokens)
        if max_new_tokens == 0:
            self._check_prompt(prompt_ids, 0)
            return
        first, s = self._start(prompt_ids, max_new_tokens, sampling, loop=False)
        t1 = time.perf_counter()
        done = 1
        self.stats["generated"] = 1
        yield first
        if first in stops or done >= max_new_tokens:
            self._finish_stats(t1)
            return
        steps = self._ring_steps(s, stops, max_new_tokens - 1) if self._take_rings() else self._returned_steps(s)
        try:
            for toks in steps:
                for tok in toks:
                    done += 1
                    self.stats["generated"] = done
                    yield tok
                    if tok in stops or done >= max_new_tokens:
                        return
        finally:
            steps.close()
            self._finish_stats(t1)

    def _carry(self, s) -> tuple:
        """The arrays the decode steps carry from call to call, from `_start`'s state."""
        return tuple(s[k] for k in (("cache", "token", "draft", "pos", "key") if self.mtp else
                                    ("cache", "token", "pos", "key")))

    def _count(self, toks: list) -> list:
        """Counts one step that emitted `toks` in `stats` (MTP: one draft, accepted if two)."""
        self.stats["steps"] += 1
        if self.mtp:
            self.stats["drafted"] += 1
            self.stats["accepted"] += len(toks) - 1
        return toks

    def _returned_steps(self, s):
        """One step per call (`Engine.decode` / `Engine.speculate`), pipelined: dispatch step i+1, then
        read step i's tokens from what it returned."""
        eng, params = self.engine, s["params"]
        carry = self._carry(s)
        keep = len(carry)
        # the loop's shapes never change: the executable is looked up once
        step = (eng.speculate if self.mtp else eng.decode).executable(eng.state, *carry, params)
        pending = None
        while True:
            out = step(eng.state, *carry, params)
            carry = out[:keep]
            if pending is not None:
                if self.mtp:
                    em, n = pending[0].result(), int(pending[1].result())
                    yield self._count([int(t) for t in em[:n]])
                else:
                    yield self._count([int(pending[0].result()[0])])
            pending = [_HostCopy(x) for x in out[keep:]]

    def _take_rings(self) -> bool:
        """Whether this stream's steps write into the engine's token rings (`ring.acquire`): not where it
        has none, nor while another open stream holds one of them (then its steps return their tokens,
        with a warning once)."""
        rings = self.engine.rings
        if rings is None:
            return False
        if ring.acquire(rings):
            return True
        _lib.warn_once("token-ring-busy", "jtilert: another open stream reads the token ring of a device this "
                                          "stream runs on; its steps return their tokens instead (compiled now)")
        return False

    def _ring_steps(self, s, stops: set, left: int):
        """The stream's steps through the token rings, which it has acquired (and releases when it ends):
        calls of `Engine.decode_stream` / `speculate_stream`, each up to STREAM_STEPS steps that end at a
        stop token or once `left` tokens are made. Two calls are in flight; each step's tokens are read
        from the ring under its position as soon as the step writes them (the next position is that plus
        their count), and once a call's steps are read the next call is dispatched. So the host is never
        more than 2 · STREAM_STEPS steps (4 · STREAM_STEPS positions, ≤ ring.SLOTS) behind the device.
        The request's first token has been read, so no step of an earlier request is still running when
        the ring is cleared. The device checks the first MAX_STOPS stop tokens; the stream checks all."""
        eng, params = self.engine, s["params"]
        tokens = eng.ring
        try:
            stop_arr = eng.place(stop_array(sorted(stops)[:MAX_STOPS]))
            carry = (*self._carry(s), eng.place(np.int32(left)))
            compiled = eng.speculate_stream if self.mtp else eng.decode_stream
            step = compiled.executable(eng.state, *carry, params, stop_arr)   # looked up once
            tokens.clear()
            pos = int(np.asarray(s["pos"]).reshape(-1)[0])
            for _ in range(2):
                carry = step(eng.state, *carry, params, stop_arr)
            while True:
                for _ in range(STREAM_STEPS):
                    toks = [int(t) for t in tokens.read(pos)]
                    pos += len(toks)
                    yield self._count(toks)
                carry = step(eng.state, *carry, params, stop_arr)
        finally:
            ring.release(eng.rings)

    def generate(self, prompt_ids, max_new_tokens: int, sampling: Sampling | None = None,
                 stop_tokens: Sequence[int] | None = None) -> list[int]:
        """Generated token ids (the prompt not included). The steps run in loops on the device that
        end at a stop token or the budget, up to GENERATE_STEPS steps per call."""
        stops = list(self.cfg.eos_token_id if stop_tokens is None else stop_tokens)
        if len(stops) > MAX_STOPS:
            return list(self.stream(prompt_ids, max_new_tokens, sampling, stop_tokens))
        if max_new_tokens == 0:
            self._check_prompt(prompt_ids, 0)
            return []
        first, s = self._start(prompt_ids, max_new_tokens, sampling, loop=True)
        out = [first]
        t1 = time.perf_counter()
        eng = self.engine
        stop_arr = eng.place(stop_array(stops))
        loop = eng.speculate_loop if self.mtp else eng.decode_loop
        carry, params = self._carry(s), s["params"]
        while out[-1] not in stops and len(out) < max_new_tokens:
            budget = eng.place(np.int32(max_new_tokens - len(out)))
            *carry, toks, n, steps = loop(eng.state, *carry, params, stop_arr, budget)
            n, steps = int(n), int(steps)
            self.stats["steps"] += steps
            if self.mtp:
                self.stats["drafted"] += steps
                self.stats["accepted"] += n - steps
            new = [int(t) for t in np.asarray(toks)[:n]]
            for t in new:
                out.append(t)
                if t in stops or len(out) >= max_new_tokens:
                    break
        self.stats["generated"] = len(out)
        self._finish_stats(t1)
        return out

    @property
    def acceptance(self) -> float | None:
        """Fraction of MTP drafts accepted in the last generation (None without MTP)."""
        d = self.stats.get("drafted", 0)
        return self.stats["accepted"] / d if self.mtp and d else None


def _stop_hits(emitted, n, stops):
    """Which of a step's emitted tokens (its first n are made) are stop tokens: bool [len(emitted)]."""
    return (jnp.arange(emitted.shape[0]) < n) & jnp.any(emitted[:, None] == stops[None, :], axis=1)


def stop_array(stops: list) -> np.ndarray:
    """Up to MAX_STOPS stop tokens as the device loops take them: int32 [MAX_STOPS], -1 past them."""
    return np.array(list(stops) + [-1] * (MAX_STOPS - len(stops)), np.int32)


def _seed_key(seed: int) -> np.ndarray:
    """`jax.random.PRNGKey(seed)` made on the host (threefry; `Sampling` keeps seeds in [0, 2**32)), so a
    new seed compiles nothing."""
    return np.array([0, seed], np.uint32)


class _HostCopy:
    """A step's output being copied to the host (started at once, read with `result()`); one the step
    wrote into host memory (`Engine.decode`'s) needs no copy."""

    def __init__(self, x: jax.Array):
        self._x = x
        if x.sharding.memory_kind not in ("pinned_host", "unpinned_host"):
            x.copy_to_host_async()

    def result(self) -> np.ndarray:
        return np.asarray(self._x)


def score(model: Transformer, token_ids, prefill: int | None = None, mesh: Mesh | None = None,
          backend: str = "reference", prefill_chunk: int | Sequence[int] = 16,
          config: DecodeConfig | None = None) -> np.ndarray:
    """Next-token logits [T, vocab] at every position of token_ids, through the real path: the first
    `prefill` tokens (default: half) go through chunked prefill, the rest through one-token decode steps."""
    ids = np.asarray(token_ids)
    gen = Generator(model, max_seq_len=ids.size + 1, mesh=mesh, backend=backend, prefill_chunk=prefill_chunk,
                    config=config)
    ids = gen._check_prompt(ids, 0)
    if prefill is not None and (not is_int(prefill) or not 1 <= prefill <= ids.size):
        raise ValueError(f"score: prefill must be an integer in [1, {ids.size}] (the number of token ids), "
                         f"got {prefill!r}")
    n = max(1, ids.size // 2) if prefill is None else int(prefill)
    eng = gen.engine
    cache = eng.new_cache(gen.rows)
    out = []
    for off, part in chunks_of(ids[:n], gen.chunks, gen.rows):
        logits, _, cache = eng.forward(eng.state, cache, eng.place(part), eng.place(np.int32(off)))
        out.append(np.asarray(logits))
    out = [np.concatenate(out)[:n]]
    for p in range(n, ids.size):
        logits, _, cache = eng.forward(eng.state, cache, eng.place(ids[p:p + 1]), eng.place(np.int32(p)))
        out.append(np.asarray(logits))
    return np.concatenate(out)
