"""Generation: prefill, a decode step compiled once, MTP speculative decoding, scoring.

The compiled steps take the model state, the caches (donated, updated in place), the tokens and
the position as arguments; sampling settings are arrays. Shapes never change while generating, so
each step compiles once per Generator. The host runs one step ahead of the device: it dispatches
step i+1 before it reads step i's tokens, so the device never waits for Python.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jtilert import backend as backend_mod, sharding
from jtilert.model import Transformer, init_cache
from jtilert.sampling import Sampling, sample, verify


class Engine:
    """The compiled steps of one model on one mesh with one backend."""

    def __init__(self, model: Transformer, mesh: Mesh | None = None, backend: str = "reference",
                 engine_all_reduce: bool = False, steps_per_call: int = 8, split_indexer: bool = False):
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        self.cfg, self.dtype = model.cfg, model.dtype
        self.backend = backend_mod.check(backend)
        if backend == "pallas":
            from jtilert import pallas
            if not pallas.available():
                warnings.warn("backend='pallas': the Pallas kernels are not available here; using the reference path",
                              stacklevel=3)
                self.backend = "reference"
        self.graphdef, state = nnx.split(model)
        self.mesh = mesh
        tp = 1 if mesh is None else mesh.shape[sharding.AXIS]
        self.tp = tp
        if tp > 1:
            specs = sharding.param_specs(state)
            self._state_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
            state = sharding.shard_state(state, mesh)
        # The compiled steps take the weights as a flat list of arrays: passing the nnx.State itself
        # costs ~7 µs of host time per array and call (its pytree nodes flatten in Python), 3x the list.
        self.state, self._treedef = jax.tree_util.tree_flatten(state)
        self._engine = engine_all_reduce
        # Each rank scores 1/tp of the cached positions and the top-k lists are merged (decode only).
        self._split_indexer = split_indexer
        self.forward = jax.jit(self._wrap(self._forward), donate_argnums=(1,))
        self.draft = jax.jit(self._wrap(self._draft), donate_argnums=(1,))
        # Generation runs `steps_per_call` steps per dispatch: one call's host cost (24 ms at 61 layers
        # on an H200, bench/RESULTS.md) is more than 2x a step's device time, so per-step dispatch left
        # the GPU idle; in chunks it is paid once per chunk and overlapped.
        self.steps_per_call = steps_per_call
        self.decode = jax.jit(self._wrap(self._decode_steps), donate_argnums=(1,))
        self.speculate = jax.jit(self._wrap(self._speculate_steps), donate_argnums=(1,))

    # --- tracing helpers ---------------------------------------------------------------------
    def _wrap(self, fn):
        """Run `fn(model, cache, *args)` under the backend and, with tp > 1, under shard_map."""
        def run(state, cache, *args):
            with backend_mod.use(self.backend), sharding.tensor_parallel(
                    sharding.AXIS if self.tp > 1 else None, self._engine, self._split_indexer):
                return fn(nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self._treedef, state)), cache, *args)

        if self.tp == 1:
            return run

        def sharded(state, cache, *args):
            f = jax.shard_map(run, mesh=self.mesh, in_specs=(self._state_specs, P()) + (P(),) * len(args),
                              out_specs=P(), check_vma=False)
            return f(state, cache, *args)
        return sharded

    def _decode_steps(self, model, cache, token, pos, params, key):
        """steps_per_call plain decode steps: (cache, tokens [n], last token [1], pos, key)."""
        def body(i, c):
            cache, token, pos, key, toks = c
            cache, token, pos, key = self._decode(model, cache, token, pos, params, key)
            return cache, token, pos, key, toks.at[i].set(token[0])
        init = (cache, token, pos, key, jnp.zeros(self.steps_per_call, jnp.int32))
        cache, token, pos, key, toks = jax.lax.fori_loop(0, self.steps_per_call, body, init)
        return cache, toks, token, pos, key

    def _speculate_steps(self, model, cache, token, draft, pos, params, key):
        """steps_per_call MTP steps: (cache, emitted [n, 2], counts [n], token, draft, pos, key)."""
        def body(i, c):
            cache, token, draft, pos, key, emitted, counts = c
            cache, em, cnt, token, draft, pos, key = self._speculate(model, cache, token, draft, pos, params, key)
            return cache, token, draft, pos, key, emitted.at[i].set(em), counts.at[i].set(cnt)
        n = self.steps_per_call
        init = (cache, token, draft, pos, key, jnp.zeros((n, 2), jnp.int32), jnp.zeros(n, jnp.int32))
        cache, token, draft, pos, key, emitted, counts = jax.lax.fori_loop(0, n, body, init)
        return cache, emitted, counts, token, draft, pos, key

    @staticmethod
    def _forward(model, cache, tokens, start):
        return model(tokens, start, cache)

    @staticmethod
    def _draft(model, cache, hidden, next_tokens, start):
        logits, cache = model.draft(hidden, next_tokens, start, cache)
        return logits, cache

    @staticmethod
    def _decode(model, cache, token, pos, params, key):
        """One plain decode step: (cache, next token [1], pos + 1, key)."""
        h, cache = model.hidden(token, pos, cache)
        key, sub = jax.random.split(key)
        return cache, model.next_token(h, params, sub), pos + 1, key

    @staticmethod
    def _speculate(model, cache, token, draft, pos, params, key):
        """One MTP step: verify the draft for pos+1 with a 2-token forward, then draft again.
        Returns (cache, emitted [2], n_emitted, next token, next draft, next pos, key)."""
        logits, hidden, cache = model(jnp.concatenate([token, draft]), pos, cache)
        key, k1, k2 = jax.random.split(key, 3)
        accepted, first = verify(logits[0], draft[0], params, k1)
        second = sample(logits[1], params, k2)
        mtp_logits, cache = model.draft(hidden, jnp.stack([first, second]), pos, cache)
        drafts = jnp.argmax(mtp_logits, axis=-1).astype(jnp.int32)
        n = jnp.where(accepted, 2, 1)
        nxt = jnp.where(accepted, second, first)
        new_draft = jnp.where(accepted, drafts[1], drafts[0])
        return cache, jnp.stack([first, second]), n, nxt[None], new_draft[None], pos + n, key

    # --- caches ------------------------------------------------------------------------------
    def new_cache(self, rows: int) -> dict:
        cache = init_cache(self.cfg, rows, self.dtype)
        if self.mesh is not None:
            cache = jax.device_put(cache, NamedSharding(self.mesh, P()))
        return cache

    def place(self, x):
        return x if self.mesh is None else jax.device_put(x, NamedSharding(self.mesh, P()))


class Generator:
    """Decode one sequence at a time.

    >>> gen = jtilert.Generator(jtilert.load("tiny"), max_seq_len=512)
    >>> gen.generate(prompt_ids, max_new_tokens=64)
    """

    def __init__(self, model: Transformer, max_seq_len: int = 2048, sampling: Sampling | None = None,
                 mtp: bool = False, backend: str = "reference", mesh: Mesh | None = None,
                 prefill_chunk: int = 64, engine_all_reduce: bool = False, steps_per_call: int = 8,
                 split_indexer: bool = False):
        cfg = model.cfg
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={max_seq_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        if mtp and model.mtp is None:
            raise ValueError("mtp=True but the model has no MTP block (num_nextn_predict_layers=0)")
        self.cfg, self.max_seq_len, self.mtp = cfg, max_seq_len, mtp
        self.sampling = sampling or Sampling()
        self.chunk = prefill_chunk
        # Room for the padded last prefill chunk, and for the steps a decode call runs past the last
        # token kept (up to 2 rows per MTP step).
        self.rows = -(-(max_seq_len + 2 * steps_per_call + 2) // prefill_chunk) * prefill_chunk
        self.engine = Engine(model, mesh, backend, engine_all_reduce, steps_per_call, split_indexer)
        self._cache = None
        self._injected = 0
        self.stats: dict = {}

    # --- validation -------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids, max_new_tokens: int) -> np.ndarray:
        ids = np.asarray(prompt_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt must be a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt token ids must be integers, got dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"token id {int(bad[0])} outside the vocab [0, {self.cfg.vocab_size})")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if ids.size + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({ids.size} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={self.max_seq_len}")
        if ids.size <= self._injected:
            raise ValueError(f"the injected cache holds {self._injected} positions: the prompt must be longer "
                             f"than that (got {ids.size})")
        return ids.astype(np.int32)

    # --- caches -----------------------------------------------------------------------------
    def inject_cache(self, caches: Sequence[dict], length: int, mtp_cache: dict | None = None) -> None:
        """Use externally computed caches (prefill/decode disaggregation) holding positions [0, length).
        `caches[i]` has this layer's arrays as `init_cache` lays them out (`kv` [S, kv_lora], `pe`
        [S, rope], and `index_k`/`index_scale` for layers with an indexer), S >= length; rows past
        `length` are ignored. The next `generate` prefills only the prompt tokens after `length`."""
        template = init_cache(self.cfg, self.rows, self.engine.dtype)
        if len(caches) != len(template["layers"]):
            raise ValueError(f"inject_cache: got {len(caches)} layer caches, the model has {len(template['layers'])}")
        if not 0 < length < self.max_seq_len:
            raise ValueError(f"inject_cache: length must be in (0, max_seq_len={self.max_seq_len}), got {length}")

        def fill(name, want, got):
            if set(got) != set(want):
                raise ValueError(f"inject_cache: {name} has arrays {sorted(got)}, expected {sorted(want)}")
            out = {}
            for k, buf in want.items():
                arr = jnp.asarray(got[k])
                if arr.shape[1:] != buf.shape[1:] or arr.shape[0] < length:
                    raise ValueError(f"inject_cache: {name}.{k} has shape {tuple(arr.shape)}, expected "
                                     f"({'>=' + str(length)}, {', '.join(map(str, buf.shape[1:]))})")
                out[k] = buf.at[:length].set(arr[:length].astype(buf.dtype))
            return out

        cache = {"layers": [fill(f"layer {i}", w, g) for i, (w, g) in enumerate(zip(template["layers"], caches))]}
        if "mtp" in template:
            if mtp_cache is None and self.mtp:
                raise ValueError("inject_cache: mtp=True needs the MTP layer's cache too (mtp_cache=...)")
            cache["mtp"] = fill("mtp", template["mtp"], mtp_cache) if mtp_cache is not None else template["mtp"]
        self._cache = self.engine.place(cache)
        self._injected = length

    def prefill(self, prompt_ids) -> list[dict]:
        """The per-layer caches of prompt_ids, as `inject_cache` takes them (for disaggregation:
        one Generator prefills, another decodes)."""
        ids = self._check_prompt(prompt_ids, 0)
        _, _, cache = self._prefill(ids, 0, self.engine.new_cache(self.rows))
        return cache["layers"]

    def _take_cache(self) -> tuple[dict, int]:
        if self._cache is not None:
            cache, start = self._cache, self._injected
            self._cache, self._injected = None, 0
            return cache, start
        return self.engine.new_cache(self.rows), 0

    # --- prefill ----------------------------------------------------------------------------
    def _prefill(self, ids: np.ndarray, start: int, cache: dict):
        """Run the main model over ids[start:] in fixed-size chunks: (logits of the last prompt
        position, hidden states of positions start.., cache)."""
        eng, c = self.engine, self.chunk
        tail = ids[start:]
        padded = np.zeros(-(-tail.size // c) * c, np.int32)
        padded[:tail.size] = tail
        hidden, logits = [], None
        for i in range(0, padded.size, c):
            logits, h, cache = eng.forward(eng.state, cache, eng.place(jnp.asarray(padded[i:i + c])),
                                           eng.place(jnp.int32(start + i)))
            hidden.append(h)
        last = (tail.size - 1) % c
        return logits[last], jnp.concatenate(hidden)[:tail.size], cache

    def _prefill_draft(self, ids, start, first_token, hidden, cache):
        """Fill the MTP cache over the prompt and return the first draft (for the position after first_token)."""
        eng, c = self.engine, self.chunk
        nxt = np.concatenate([ids[start + 1:], [0]]).astype(np.int32)
        n = nxt.size
        pad = -(-n // c) * c
        nxt_dev = jnp.zeros(pad, jnp.int32).at[:n].set(jnp.asarray(nxt)).at[n - 1].set(first_token)
        hid = jnp.zeros((pad, hidden.shape[-1]), hidden.dtype).at[:n].set(hidden)
        logits = None
        for i in range(0, pad, c):
            logits, cache = eng.draft(eng.state, cache, eng.place(hid[i:i + c]), eng.place(nxt_dev[i:i + c]),
                                      eng.place(jnp.int32(start + i)))
        return jnp.argmax(logits[(n - 1) % c]).astype(jnp.int32)[None], cache

    # --- generation -------------------------------------------------------------------------
    def stream(self, prompt_ids, max_new_tokens: int, sampling: Sampling | None = None,
               stop_tokens: Sequence[int] | None = None) -> Iterator[int]:
        """Yield generated token ids as they are produced (stops after a stop token, which is yielded)."""
        ids = self._check_prompt(prompt_ids, max_new_tokens)
        sampling = sampling or self.sampling
        stops = set(self.cfg.eos_token_id if stop_tokens is None else stop_tokens)
        eng = self.engine
        params = eng.place(sampling.arrays())
        key = eng.place(jax.random.PRNGKey(sampling.seed))
        cache, start = self._take_cache()
        self.stats = {"prompt_tokens": int(ids.size), "generated": 0, "steps": 0, "drafted": 0, "accepted": 0}
        if max_new_tokens == 0:
            return
        t0 = time.perf_counter()
        last_logits, hidden, cache = self._prefill(ids, start, cache)
        key, sub = jax.random.split(key)
        token = eng.place(sample(last_logits, params, sub)[None])
        first = int(token[0])
        self.stats["prefill_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        done = 0

        def emit(tok):
            nonlocal done
            done += 1
            self.stats["generated"] = done
            return tok in stops or done >= max_new_tokens

        if emit(first):
            yield first
            return
        yield first
        pos = eng.place(jnp.int32(ids.size))
        if self.mtp:
            draft, cache = self._prefill_draft(ids, start, token[0], hidden, cache)
            steps = self._speculative_steps(cache, token, draft, pos, params, key)
        else:
            steps = self._plain_steps(cache, token, pos, params, key)
        try:
            for toks in steps:
                for tok in toks:
                    if emit(tok):
                        yield tok
                        return
                    yield tok
        finally:
            steps.close()
            self.stats["decode_s"] = time.perf_counter() - t1

    def _plain_steps(self, cache, token, pos, params, key):
        """Pipelined decode: dispatch call i+1 (steps_per_call steps), then read call i's tokens."""
        eng = self.engine
        pending = None
        while True:
            cache, toks, token, pos, key = eng.decode(eng.state, cache, token, pos, params, key)
            self.stats["steps"] += eng.steps_per_call
            if pending is not None:
                yield [int(t) for t in np.asarray(pending)]
            pending = toks

    def _speculative_steps(self, cache, token, draft, pos, params, key):
        eng = self.engine
        pending = None
        while True:
            cache, emitted, counts, token, draft, pos, key = eng.speculate(eng.state, cache, token, draft, pos,
                                                                           params, key)
            self.stats["steps"] += eng.steps_per_call
            if pending is not None:
                toks, cnts = np.asarray(pending[0]), np.asarray(pending[1])
                self.stats["drafted"] += cnts.size
                self.stats["accepted"] += int(cnts.sum()) - cnts.size
                yield [int(t) for row, c in zip(toks, cnts) for t in row[:c]]
            pending = (emitted, counts)

    def generate(self, prompt_ids, max_new_tokens: int, sampling: Sampling | None = None,
                 stop_tokens: Sequence[int] | None = None) -> list[int]:
        """Generated token ids (the prompt not included)."""
        return list(self.stream(prompt_ids, max_new_tokens, sampling, stop_tokens))

    @property
    def acceptance(self) -> float | None:
        """Fraction of MTP drafts accepted in the last generation (None without MTP)."""
        d = self.stats.get("drafted", 0)
        return self.stats["accepted"] / d if self.mtp and d else None


def score(model: Transformer, token_ids, prefill: int | None = None, mesh: Mesh | None = None,
          backend: str = "reference", prefill_chunk: int = 16) -> np.ndarray:
    """Next-token logits [T, vocab] at every position of token_ids, through the real path: the first
    `prefill` tokens (default: half) go through chunked prefill, the rest through one-token decode steps."""
    ids = np.asarray(token_ids, np.int32)
    gen = Generator(model, max_seq_len=ids.size + 1, mesh=mesh, backend=backend, prefill_chunk=prefill_chunk)
    gen._check_prompt(ids, 0)
    n = max(1, ids.size // 2 if prefill is None else prefill)
    eng, c = gen.engine, gen.chunk
    cache = eng.new_cache(gen.rows)
    out = []
    padded = np.zeros(-(-n // c) * c, np.int32)
    padded[:n] = ids[:n]
    for i in range(0, padded.size, c):
        logits, _, cache = eng.forward(eng.state, cache, eng.place(jnp.asarray(padded[i:i + c])), eng.place(jnp.int32(i)))
        out.append(np.asarray(logits))
    out = [np.concatenate(out)[:n]]
    for p in range(n, ids.size):
        logits, _, cache = eng.forward(eng.state, cache, eng.place(jnp.asarray(ids[p:p + 1])), eng.place(jnp.int32(p)))
        out.append(np.asarray(logits))
    return np.concatenate(out)
