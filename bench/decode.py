"""Time per output token (TPOT) of the batch-1 decode step, against the HBM floor (issue 7).

    PYTHONPATH=. python3 -m bench.decode --preset dsv32-tp8-shard --layers 61 --context 4096 \
        --backend reference,pallas [--mtp] [--checkpoint PATH] [--out results.json] [--plot chart.png]

Builds the model with random weights on the device (fp8 for fp8 presets) or loads a checkpoint,
fills the caches with random entries for `context` positions (as an injected prefill would), then
times decode steps:
- device time per step: `steps` consecutive steps inside one compiled loop (one dispatch, so no host
  time), repeated `samples` times; median and p90 over the samples;
- host overhead: the pipelined Python loop `Generator.stream` runs (with the token ring, calls of
  STREAM_STEPS steps; without, one step a call), minus the device time of the timing loop, and minus
  that of the same calls queued with nothing read (`served_step_ms`); the enqueue time of one call
  (until the call returns, its steps still running; `steps_per_call` says how many);
- bytes per step, counted from the parameters actually read (the chosen experts only, one embedding
  row) plus the KV reads; the copy bandwidth measured in the same run; floor = bytes / bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import pathlib
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jtilert
from jtilert.ffi import ring
from jtilert.store import checkpoint
from jtilert.parallel import sharding
from jtilert.pallas import lowering_cache
from jtilert.runtime.generate import STREAM_STEPS, Engine, stop_array
from jtilert.model.transformer import Layout, _no_topk, decode_weights, init_cache, router_in_bf16
from jtilert.ops.table import DecodeConfig

from bench import clocks, provenance, timeline


CPU_COPY_BYTES = 256 << 20   # the array copy_bandwidth passes over on a CPU (the tests shrink it)
TIMELINE_STEPS = 4           # steps of the call --timeline traces (bench/timeline.py reads its second whole step)
QUEUED_LOOP_STEPS = (1, 8, 32)            # steps a call of the timing loop's program in `queued_forms`
QUEUED_STREAM_STEPS = (STREAM_STEPS, 32)  # and of the stream's program through the token ring
QUEUED_TOTAL = 128                        # steps of each form's round (a multiple of every k above)


def copy_bandwidth() -> float:
    """Bytes/s of an elementwise read+write pass (the practical HBM ceiling; every bench/ script's
    copy bandwidth): 2 GiB, device time from CUPTI on a GPU; CPU_COPY_BYTES, wall time on the CPU."""
    gpu = jax.default_backend() == "gpu"
    x = jnp.ones(((2 << 30 if gpu else CPU_COPY_BYTES) // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a * 1.5 + 1)
    f(x).block_until_ready()
    if gpu:
        times = [_cupti(lambda: f(x))[1] for _ in range(10)]
    else:
        times = []
        for _ in range(10):
            t = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(times)


def _cupti(run):
    """(kernels [(name, seconds)], total kernel seconds) of the device work `run()` launches."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        jax.block_until_ready(run())
    finally:
        timings = ext._cupti_get_timings(False)
    kernels = [(name, ms * 1e-3) for name, ms in timings or []]
    return kernels, sum(t for _, t in kernels)


def kernel_class(name: str) -> str:
    """A readable group for a kernel name: our Mosaic/CUDA kernels by name, XLA's by kind."""
    low = name.lower()
    if low.startswith("jtilert") or low.startswith("jt::") or "jt::" in low:
        return name.split("(")[0][:48]
    for key, label in (("nccl", "nccl"), ("radix", "cub sort / top-k"), ("sort", "cub sort / top-k"),
                       ("topk", "top-k"), ("gemm", "xla gemm"), ("gemv", "xla gemv"), ("cutlass", "xla gemm"),
                       ("xmma", "xla gemm"), ("triton", "xla triton"), ("scatter", "xla scatter"),
                       ("dynamic_update", "xla cache update"), ("reduce", "xla reduce"),
                       ("concatenate", "xla concatenate"), ("copy", "xla copy"), ("fusion", "xla fusion")):
        if key in low:
            return label
    return "other"


def kernel_profile(call, steps: int) -> dict:
    """One decode call of `steps` steps under CUPTI: per step, how many kernels it launches and where
    their device time goes."""
    kernels, busy = _cupti(call)
    kernels, busy = [(name, sec / steps) for name, sec in kernels], busy / steps
    groups: dict = {}
    for name, sec in kernels:
        g = groups.setdefault(kernel_class(name), [0, 0.0])
        g[0] += 1
        g[1] += sec
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])
    names: dict = {}   # kernel names without XLA's numbering: which kinds of kernel a step launches
    for name, sec in kernels:
        n = names.setdefault(re.sub(r"([._]\d+)+$", "", name.split("(")[0])[:80], [0, 0.0])
        n[0] += 1
        n[1] += sec
    top_names = sorted(names.items(), key=lambda kv: -kv[1][0])[:60]
    return {"kernels": len(kernels) / steps, "busy_ms": busy * 1e3,
            "groups": [{"group": k, "count": c / steps, "ms": t * 1e3} for k, (c, t) in top],
            "names": [{"name": k, "count": c / steps, "ms": t * 1e3} for k, (c, t) in top_names]}


def step_bytes(model, context: int, tp: int = 1) -> dict:
    """Bytes one decode step must read on one device: weights (routed experts: only the chosen k of
    E; the embedding: one row; tp-split weights: one slice) and the KV / index-key reads."""
    cfg = model.cfg
    lay = Layout.of(cfg)
    weights = 0
    # the pallas Engine's weights, as shapes only (the reference backend holds kv_b in bf16)
    steps_read = decode_weights(nnx.eval_shape(lambda: model), tp=tp, backend="pallas")
    for name, x in checkpoint.flat_params(steps_read).items():
        n = x.size * jnp.dtype(x.dtype).itemsize
        if sharding.split_axis(tuple(name.split("."))) is not None:
            n //= tp
        if name.startswith("mtp."):
            continue  # the MTP block runs only in speculative steps
        if name.split(".")[0] in ("layers", "indexers", "moe") and lay.mtp_layer is not None:
            n = n * (x.shape[0] - 1) // x.shape[0]   # the stacks' last layer is the MTP block's
        if name.startswith("moe.experts."):
            n = n * cfg.num_experts_per_tok // cfg.n_routed_experts
        if name == "embed_tokens":
            n = x.shape[1] * jnp.dtype(x.dtype).itemsize
        if name == "moe.gate.weight" and router_in_bf16(model.moe.gate.weight.get_value()):
            n //= 2   # held in bf16 by the decode model (the shapes above cannot tell)
        weights += n
    seen = min(context + 1, cfg.index_topk)
    dtype_bytes = jnp.dtype(model.dtype).itemsize
    row = (cfg.kv_lora_rank + 4 * cfg.kv_lora_rank // 128 + 2 * cfg.qk_rope_head_dim if cfg.kv_cache_quant == "fp8"
           else (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes)   # FlashMLA's fp8 row: 656 B
    mla = cfg.num_hidden_layers * seen * row
    key_bytes = cfg.index_head_dim + 4 if cfg.index_quant == "fp8" else cfg.index_head_dim * dtype_bytes
    indexer = sum(t == "full" for t in cfg.indexer_types) * (context + 1) * key_bytes
    return {"weights": weights, "mla_kv": mla, "index_keys": indexer, "total": weights + mla + indexer}


def cache_rows(context: int, steps: int) -> int:
    """Cache rows for `steps` steps (MTP steps write 2 rows) after `context` positions, rounded up to 64
    as the Generator rounds its cache: the indexer kernel reads the index cache in TMA tiles of 8 rows
    and does not apply (a warning, then the reference) to other row counts."""
    return -(-(context + 2 * steps + 16) // 64) * 64


def random_cache(eng: Engine, rows: int, seed: int = 0) -> dict:
    """Caches with random entries in every row (rows past the position are masked anyway). One small
    jit per distinct leaf shape: a single jit over all layers' leaves took 3.5 min to compile."""
    shapes = jax.eval_shape(lambda: init_cache(eng.cfg, rows, eng.dtype))
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return eng.place({name: _random_leaf(k, x.shape, x.dtype, name == "index_scale")
                      for k, (name, x) in zip(keys, sorted(shapes.items()))})


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_leaf(key, shape, dtype, scales: bool):
    if scales:  # index-key scales: powers of two, as the fp8 quantiser makes them
        return jnp.exp2(jax.random.randint(key, shape, -8, -4).astype(jnp.float32))
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def bench_rows(context: int, steps: int, samples: int) -> int:
    """Cache rows of `bench_backend` for the longest run of steps from `context`: a timed loop's 2n
    steps, or the host loop's calls (steps · samples of them, STREAM_STEPS steps each through the token
    ring, one more call to warm), or a round of `queued_forms`."""
    return cache_rows(context, max(2 * steps, (steps * samples + 1) * STREAM_STEPS, QUEUED_TOTAL))


def step_times(timed, n1, n2, steps: int, samples: int) -> tuple[list, list, str]:
    """(seconds a step, per sample; seconds of each n-step call; how they were taken) from `samples`
    pairs of `timed(n1)` and `timed(n2)` calls of a loop of n and 2n steps. A call costs its dispatch
    (flattening the arguments: milliseconds at 61 layers) plus its steps; the difference of a 2n- and
    an n-step loop is n steps of device time alone. Where timer noise is larger than n steps (tiny
    models on a busy CPU) the n-step loop with its dispatch is the figure: an upper bound."""
    per_step, short = [], []
    for _ in range(samples):
        t1, t2 = timed(n1), timed(n2)
        per_step.append((t2 - t1) / steps)
        short.append(t1)
    if statistics.median(per_step) > 0:
        return per_step, short, "difference of 2n- and n-step loops"
    return [t / steps for t in short], short, "n-step loop with its dispatch (upper bound)"


def device_loop(eng: Engine, mtp: bool, advance: bool = False, options: dict | None = None):
    """decode (or MTP) steps in one compiled loop, every step at the same position (`advance`: step
    i at pos + i, or pos + 2i for MTP steps, as served steps move on); the number of steps is an
    argument, so one compile serves every loop length. Given a last argument `ids` (int32 [N], decode
    steps), step i reads token ids[i % N] instead of the token the step before made (which is still
    made, and carried), so the steps' tokens vary as a served stream's do. options: XLA's compile
    options (default the engine's step options)."""
    step = eng._wrap(eng._speculate if mtp else eng._decode)

    def run(state, cache, token, draft, pos0, params, key, steps, ids=None):
        if mtp and ids is not None:
            raise ValueError("device_loop: fed tokens are for decode steps")

        def body(i, c):
            cache, token, draft, key = c
            pos = pos0 + i * (2 if mtp else 1) if advance else pos0
            if mtp:
                cache, token, draft, _, key, _, _ = step(state, cache, token, draft, pos, key, params)
            else:
                given = token if ids is None else jax.lax.dynamic_slice(ids, (i % ids.shape[0],), (1,))
                cache, made, _, key, _ = step(state, cache, given, pos, key, params)
                token = made if ids is None else jnp.maximum(token, made)   # made stays live
            return cache, token, draft, key
        return jax.lax.fori_loop(0, steps, body, (cache, token, draft, key))

    return jax.jit(run, donate_argnums=(1,), compiler_options=eng.step_options if options is None else options)


class _Skipped(nnx.Module):
    """Stands in for a sub-layer stack in the timing variants: attention → (0, cache, no top-k), MLP → 0."""

    def __init__(self, cfg, attention: bool):
        self.cfg, self.attention = cfg, attention

    def __call__(self, ops, i, x, *args):
        if self.attention:
            cache = args[-2]
            return jnp.zeros_like(x), cache, _no_topk(self.cfg, x.shape[0], cache)
        return jnp.zeros_like(x)


def variant(model, skip: tuple[str, ...]):
    """A view of `model` (same weight arrays) with every layer's attention and/or MLP skipped."""
    m = nnx.merge(*nnx.split(model))
    if "attention" in skip:
        m.layers.self_attn = _Skipped(m.cfg, True)
    if "mlp" in skip:
        m.dense = m.moe = _Skipped(m.cfg, False)
    return m


BREAKDOWN = {"without attention": ("attention",), "without MLP/MoE": ("mlp",),
             "embedding + head only": ("attention", "mlp")}


def breakdown(model, backend, context, steps, samples, mesh, engine) -> dict:
    """Per-layer split of the step time by timing variants: attention = full − without attention,
    MLP/MoE = full − without MLP, the rest = embedding + final norm + lm head + sampling."""
    out = {}
    for label, skip in BREAKDOWN.items():
        r = bench_backend(variant(model, skip), backend, context, False, steps, samples, mesh, engine, host=False)
        out[label] = r["step_ms_median"]
    return out


def bench_backend(model, backend: str, context: int, mtp: bool, steps: int, samples: int, mesh=None,
                  engine: bool = False, host: bool = True, kernels: bool = False, split_indexer: bool = False,
                  layer_loop: str = "loop", xla_options: tuple | None = None, call_variants: bool = False,
                  trace_timeline: bool = False, l2_prefetch: bool = False, engine_moe: bool = False,
                  compile_profile: bool = False,
                  timeline_layers: tuple[int, int] = timeline.DETAIL_LAYERS) -> dict:
    """xla_options: DecodeConfig.xla_options (None: its default). call_variants: also time the step
    loop with each step at its own position (`advancing_step_ms`), the same with each step reading
    another token (`fed_token_step_ms`, decode steps), a call's fixed device cost (`queued`: the
    forms of `queued_forms`, decode steps, tp = 1), and the plain step's host loop in
    the forms of `call_variant_loops` (tp = 1). trace_timeline: right after the
    timed loops (and their CUPTI profile), one call of the loop of TIMELINE_STEPS steps under JAX's
    profiler: the kernels' start and end times in one step (bench/timeline.py's summary, the result's
    "timeline"; `timeline_layers` [lo, hi) listed kernel by kernel); no CUPTI profile may follow it
    (the one-step kernel profile is left out). l2_prefetch, engine_moe: DecodeConfig's. compile_profile:
    the first compile's XLA stage under JAX's profiler (`compile_breakdown`)."""
    opts = {} if xla_options is None else {"xla_options": xla_options}
    loop, _, per = layer_loop.partition("/")   # "loop/2": DecodeConfig.layers_per_iteration = 2
    if per:                                    # (else DecodeConfig's default)
        opts["layers_per_iteration"] = int(per)
    eng = Engine(model, mesh=mesh, config=DecodeConfig(backend=backend, engine_all_reduce=engine,
                                                       split_indexer=split_indexer, layer_loop=loop,
                                                       l2_prefetch=l2_prefetch, engine_moe=engine_moe, **opts))
    host_steps = steps * samples
    rows = bench_rows(context, steps, samples)
    cache = random_cache(eng, rows)
    token, draft = eng.place(jnp.array([1], jnp.int32)), eng.place(jnp.array([2], jnp.int32))
    pos = eng.place(jnp.int32(context))
    params = eng.place(jtilert.Sampling().arrays())
    key = eng.place(jax.random.PRNGKey(0))
    loop, fed = device_loop(eng, mtp), ()   # fed: the loop's token ids, where it is given some
    n1, n2 = eng.place(jnp.int32(steps)), eng.place(jnp.int32(2 * steps))

    def timed(n):
        nonlocal cache, token, draft, key
        t = time.perf_counter()
        cache, token, draft, key = jax.block_until_ready(loop(eng.state, cache, token, draft, pos, params, key, n,
                                                              *fed))
        return time.perf_counter() - t

    # the first call as a Generator's compile makes it (the kernels lowered in parallel first), each
    # stage timed: tracing, the kernels' parallel lowering, the rest of the lowering (the kernels from
    # that cache), XLA's compile, and the first call (which reuses the compiled program)
    compile_stages = compile_breakdown(loop, (eng.state, cache, token, draft, pos, params, key, n1),
                                       profile=compile_profile)
    compile_stages["first_call_s"] = timed(n1)
    # the kernels compiled in the background beside those stages, and its threads' seconds (they
    # overlap the stages: not a stage)
    lowering_cache.background_idle()
    precompiled = {"kernels": lowering_cache.precompiled, "busy_s": round(lowering_cache.precompile_s, 3)}
    compile_s = sum(v for k, v in compile_stages.items() if k.endswith("_s"))
    # the GPU's clocks in each part: the served steps' small kernels ran slower than the timing loop's
    gpu_clocks, dev = {}, jax.devices()[0]
    with clocks.sampled(gpu_clocks, "timing_loop", dev):
        per_step, short, timing = step_times(timed, n1, n2, steps, samples)
    device_s = statistics.median(per_step)

    # The served steps and the timing-loop variants before any CUPTI profile: served calls measured
    # after CUPTI has profiled in the process run slower (bench/RESULTS.md, session 40).
    early = {}
    if host:
        with clocks.sampled(gpu_clocks, "host_loop", dev):
            host_s, enqueue_s, served_s, carry = host_loop(eng, cache, token, draft, pos, params, key, mtp,
                                                           host_steps)
        cache, token, key = carry[0], carry[1], carry[4 if mtp else 3]   # (a stream call's `left` after them)
        draft = carry[2] if mtp else draft
        pos = eng.place(jnp.int32(context))
        # the host loop against the timing loop's step (host_overhead_*), and against the same calls
        # queued with nothing read (served_step_ms: the served steps' device time; host_over_served_frac)
        early.update(host_loop_ms=host_s * 1e3, host_overhead_ms=max(0.0, host_s - device_s) * 1e3,
                     host_overhead_frac=max(0.0, host_s - device_s) / host_s, served_step_ms=served_s * 1e3,
                     host_over_served_frac=(host_s - served_s) / host_s, enqueue_ms=enqueue_s * 1e3,
                     steps_per_call=STREAM_STEPS if eng.ring is not None else 1,
                     arguments=eng.num_arguments, step_compile_s=host_loop.compile_s)
    if call_variants:
        # the same timing with each step at its own position, as the served steps run (the timing
        # loop back after, for its profile and trace below)
        timing_loop, loop = loop, device_loop(eng, mtp, advance=True)
        timed(n1)   # compile
        early["advancing_step_ms"] = statistics.median(step_times(timed, n1, n2, steps, samples)[0]) * 1e3
        if not mtp:
            # and with every step reading another token (random ids), as a served stream's steps do
            # where the timing loop's token soon repeats itself: is it the data that makes the served
            # steps' kernels slower?
            fed = (eng.place(jax.random.randint(jax.random.PRNGKey(1), (997,), 0, model.cfg.vocab_size, jnp.int32)),)
            timed(n1)   # compile
            early["fed_token_step_ms"] = statistics.median(step_times(timed, n1, n2, steps, samples)[0]) * 1e3
        loop, fed = timing_loop, ()
        if not mtp and eng.tp == 1:
            # a call's fixed device cost, from calls of 1 to 32 steps queued (before any CUPTI profile)
            early["queued"], (cache, token, _, key) = queued_forms(eng, (cache, token, pos, key), params, context,
                                                                   QUEUED_TOTAL)
    loop_profile = None
    if kernels and jax.default_backend() == "gpu":
        # The same program as the step time: busy time per step of one n-step loop call. The one-step
        # profile below is another program (Engine.decode), so its busy time against this step time
        # does not show whether kernels overlap; this one does (busy > step: they ran concurrently).
        with clocks.sampled(gpu_clocks, "loop_profile", dev):
            loop_profile = kernel_profile(lambda: timed(n1), steps)
        loop_profile["gaps_ms"] = device_s * 1e3 - loop_profile["busy_ms"]
    step_timeline = None
    if trace_timeline and not mtp:
        # Now, while the loop's CUDA graphs are live: a command buffer XLA has to make anew under the
        # profiler (after another program's, the steps' below) it runs thunk by thunk, one kernel after
        # another. After JAX's profiler CUPTI drops the records of graphs made before, so no Mosaic
        # CUPTI profile may follow (bench/timeline.py's trace_step).
        n_trace = eng.place(jnp.int32(TIMELINE_STEPS))
        with tempfile.TemporaryDirectory() as folder:
            step_timeline = timeline.trace_step(lambda: timed(n_trace), folder, detail=timeline_layers)
        step_timeline["untraced_step_us"] = device_s * 1e6   # the profiler slows the step: compare
        if loop_profile is not None:
            step_timeline["loop_profile_kernels"] = loop_profile["kernels"]   # per step, without the profiler
    if engine:  # an "engine" run whose library did not load ran psum: say which one ran
        from jtilert import ffi
        engine = ffi.available()
    result = {"backend": backend, "layer_loop": layer_loop, "layers_per_iteration": eng.config.layers_per_iteration,
              "xla_options": dict(eng.config.xla_options), "mtp": mtp, "tp": eng.tp, "all_reduce": "engine" if engine else "psum",
              "split_indexer": split_indexer, "l2_prefetch": l2_prefetch, "engine_moe": engine_moe,
              "step_ms_median": device_s * 1e3, "step_ms_p90": float(np.percentile(per_step, 90)) * 1e3,
              "tok_s": 1.0 / device_s, "compile_s": compile_s, "compile_stages": compile_stages,
              "precompiled": precompiled, "steps_timed": 3 * steps * samples,
              "call_overhead_ms": (statistics.median(short) - steps * device_s) * 1e3, "timing": timing,
              **early}
    if kernels and jax.default_backend() == "gpu" and not mtp and step_timeline is None:
        # before the call variants: they trace calls under JAX's profiler, after which CUPTI drops
        # records
        carry = (cache, token, pos, key)
        holder = [jax.block_until_ready(eng.decode(eng.state, *carry, params))]

        def one_step():
            holder[0] = eng.decode(eng.state, *holder[0][:4], params)
            return holder[0]
        with clocks.sampled(gpu_clocks, "one_step_profile", dev):
            result["kernel_profile"] = kernel_profile(one_step, 1)
        result["kernel_profile"]["gaps_ms"] = device_s * 1e3 - result["kernel_profile"]["busy_ms"]
        carry = holder[0][:4]
        if eng.ring is not None and eng.tp == 1:
            # one call of the stream's program through the token ring, as many steps as the timing
            # loop's profiled call up to a call's STREAM_STEPS: the served step's kernels against the
            # timing loop's
            k = min(steps, STREAM_STEPS)
            call, first = stream_call(eng, False, carry, k, params)
            carry = jax.block_until_ready(call(*first))[:4]   # warm
            served = [(*carry, eng.place(np.int32(k)))]

            def one_call():
                served[0] = call(*served[0])
                return served[0]
            with clocks.sampled(gpu_clocks, "stream_profile", dev):
                result["stream_kernel_profile"] = kernel_profile(one_call, k)
            carry = served[0][:4]
        cache, token, key = carry[0], carry[1], carry[3]
        pos = eng.place(jnp.int32(context))
    if host and call_variants and not mtp and eng.tp == 1:
        with clocks.sampled(gpu_clocks, "call_variants", dev):
            result["call_variants"], carry = call_variant_loops(eng, (cache, token, pos, key), params, host_steps,
                                                                context)
        cache = carry[0]
    if loop_profile is not None:
        result["loop_kernel_profile"] = {k: loop_profile[k] for k in ("kernels", "busy_ms", "gaps_ms", "groups")}
    if step_timeline is not None:
        result["timeline"] = step_timeline
    result["clocks"] = gpu_clocks
    stats = jax.devices()[0].memory_stats() or {}
    result["peak_device_bytes"] = int(stats.get("peak_bytes_in_use", 0))
    return result


def compile_breakdown(jitted, args: tuple, profile: bool = False) -> dict:
    """Seconds of each stage of `jitted`'s first compile for `args`, in the order the Generator's
    compile runs them: trace, the Mosaic kernels lowered by forked workers, the lowering of the
    program, XLA's compile (JAX's persistent cache included, where it is on). profile: XLA's compile
    under JAX's profiler, its host events by name in "xla_compile_events" (µs; the profiler slows it)."""
    stages, t = {}, time.perf_counter()

    def lap(name):
        nonlocal t
        now = time.perf_counter()
        stages[name], t = now - t, now

    traced = jitted.trace(*args)
    lap("trace_s")
    lowering_cache.prelower(traced.jaxpr)
    lap("kernels_s")
    lowered = traced.lower()
    lap("lower_s")
    folder = tempfile.mkdtemp() if profile else None
    with jax.profiler.trace(folder, create_perfetto_trace=True) if profile else contextlib.nullcontext():
        lowered.compile()
    lap("xla_compile_s")
    if profile:
        stages["xla_compile_events"] = host_events(folder, top=60)
    return stages


def host_loop(eng, cache, token, draft, pos, params, key, mtp, n):
    """(seconds per step, median enqueue seconds of one call, seconds per step of the same calls queued
    with nothing read, the carried arrays) of the loop `Generator.stream` runs: with the token ring, `n`
    calls of STREAM_STEPS steps, two in flight, each step's tokens read from the ring as it writes them;
    without, `n` calls of one step, each dispatched before the previous step's token is read (the
    position advances by one row per step, or two per MTP step). The queued calls start at the same
    position and the host never waits for them: they take the served steps' device time, and what the
    stream takes over that is the host's."""
    carry = (cache, token, draft, pos, key) if mtp else (cache, token, pos, key)
    keep = len(carry)
    start = int(np.asarray(pos).reshape(-1)[0])

    def queued(call, carry, steps):   # n calls from the start, nothing read
        carry = list(carry)
        carry[keep - 2] = eng.place(jnp.int32(start))
        jax.block_until_ready(carry)
        t = time.perf_counter()
        for _ in range(n):
            carry = call(*carry)
        jax.block_until_ready(carry)
        return (time.perf_counter() - t) / (n * steps), carry

    if eng.ring is not None:   # DecodeConfig.token_ring
        t = time.perf_counter()
        call, first = stream_call(eng, mtp, carry, (n + 3) * STREAM_STEPS * 4, params)   # never reached
        out = jax.block_until_ready(call(*first))  # compile (and warm)
        host_loop.compile_s = time.perf_counter() - t
        host_s, enqueue_s, out = ring_loop(call, out, n, eng.ring, keep - 2, STREAM_STEPS)
        served_s, out = queued(call, out, STREAM_STEPS)
        return host_s, enqueue_s, served_s, out
    step = eng.speculate if mtp else eng.decode
    t = time.perf_counter()
    out = jax.block_until_ready(step(eng.state, *carry, params))  # compile (and warm)
    host_loop.compile_s = time.perf_counter() - t
    exe = step.executable(eng.state, *out[:keep], params)
    call = lambda *c: exe(eng.state, *c, params)   # noqa: E731
    host_s, enqueue_s, out = call_loop(call, out, keep, n)
    served_s, out = queued(lambda *c: call(*c)[:keep], out[:keep], 1)
    return host_s, enqueue_s, served_s, out


def call_loop(call, out, keep: int, n: int):
    """(seconds per step, median enqueue seconds of one call, the carried arrays): `n` calls of
    `call(*out[:keep])`, each dispatched before the previous call's host output (its last output, where
    it returns more than the `keep` carried arrays) is read."""
    t = time.perf_counter()
    pending, enqueue = None, []
    for _ in range(n):
        t0 = time.perf_counter()
        out = call(*out[:keep])
        enqueue.append(time.perf_counter() - t0)
        if pending is not None:
            np.asarray(pending)
        pending = out[-1] if len(out) > keep else None
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n, statistics.median(enqueue), out[:keep]


def stream_call(eng, mtp: bool, carry, left: int, params, steps: int = STREAM_STEPS, options: dict | None = None):
    """(call, first): the stream's program through the token ring (`Engine.decode_stream` /
    `speculate_stream`, no stop token, looked up once as the Generator's stream does) as a call of its
    carried arrays, and `carry` with `left`, the tokens still wanted, placed after it: the first call's
    arguments. steps: the steps a call runs at most; options: XLA's compile options (either given
    compiles the decode stream's program here, by default with the engine's loop options)."""
    stops = eng.place(stop_array([]))
    first = (*carry, eng.place(np.int32(left)))
    if steps == STREAM_STEPS and options is None:
        stream = eng.speculate_stream if mtp else eng.decode_stream
        exe = stream.executable(eng.state, *first, params, stops)
    else:   # the Engine's program, compiled here
        exe = jax.jit(eng._wrap(eng.stream_fn(mtp, steps)), donate_argnums=tuple(range(1, len(first) + 1))).lower(
            eng.state, *first, params, stops).compile(eng.loop_options if options is None else options)
    return (lambda *c: exe(eng.state, *c, params, stops)), first


def call_fit(ms: dict) -> dict:
    """The least-squares fit of t(k) = step + call / k to {k: ms a step of calls of k steps}:
    {"ms_per_step": ms, "call_ms": a call's fixed cost, "step_ms": a step's}."""
    x = np.array([1.0 / k for k in ms])
    a = np.vstack([np.ones_like(x), x]).T
    (step, call), *_ = np.linalg.lstsq(a, np.array(list(ms.values()), float), rcond=None)
    return {"ms_per_step": ms, "call_ms": float(call), "step_ms": float(step)}


def queued(forms: dict, total: int, rounds: int = 3) -> dict:
    """`total` steps in calls queued back to back, nothing read, for each form {k: (restart, call)} of
    one program (call() makes one call of k steps and returns what it carries; restart() readies the
    next round and returns something to wait for), each the median of `rounds` rounds: {"ms_per_step":
    {k: ms}, "enqueue_ms": {k: the median enqueue of a call}, and `call_fit`'s "call_ms", "step_ms"}.
    A call that returns only when the call before it has ended shows its steps' device time as its
    enqueue."""
    ms, enqueue = {}, {}
    for k, (restart, call) in forms.items():
        per, each = [], []
        for _ in range(rounds):
            jax.block_until_ready(restart())
            t = time.perf_counter()
            for _ in range(total // k):
                t0 = time.perf_counter()
                last = call()
                each.append(time.perf_counter() - t0)
            jax.block_until_ready(last)
            per.append((time.perf_counter() - t) / total * 1e3)
        ms[k], enqueue[k] = statistics.median(per), statistics.median(each) * 1e3
    return {**call_fit(ms), "enqueue_ms": enqueue}


def loop_form(eng, loop, carry: list, pos, params, k: int, ids: tuple = ()) -> tuple:
    """(restart, call) for `queued`: calls of k steps of `loop` (a `device_loop`) from `pos` (and fed
    `ids`, where given); carry: [cache, token, draft, key], replaced by each call's. restart is one call
    more (the first compiles and warms)."""
    n = eng.place(jnp.int32(k))

    def call():
        carry[:] = loop(eng.state, carry[0], carry[1], carry[2], pos, params, carry[3], n, *ids)
        return carry
    return call, call


def stream_form(eng, call, state: list, start: int, left: int) -> tuple:
    """(restart, call) for `queued`: calls of a `stream_call`'s `call`; state: its carried arrays
    (cache, token, pos, key, left), or (cache, token, draft, pos, key, left) for MTP, replaced by each
    call's. restart: the positions from `start` again and `left` tokens wanted (never reached). Warmed
    once here."""
    def restart():
        state[-3], state[-1] = eng.place(jnp.int32(start)), eng.place(jnp.int32(left))
        return state

    def one():
        state[:] = call(*state)
        return state
    jax.block_until_ready((restart(), one()))
    return restart, one


def queued_forms(eng, carry, params, start: int, total: int, rounds: int = 3):
    """What a call costs the device beyond its steps (`queued`): k steps a call of the timing loop's
    program (`device_loop`, every step at `start`) for k in QUEUED_LOOP_STEPS, and where the token ring
    is, of the stream's program (positions moving from `start`) for k in QUEUED_STREAM_STEPS. Between
    the forms of one program only the number of calls changes, so the fit of t(k) = step + call / k
    gives a call's fixed device cost (`call_ms`) and a step's (`step_ms`). carry: (cache, token, pos,
    key). Returns ({program: `queued`'s entry}, the carry after)."""
    cache, token, pos, key = carry
    here = eng.place(jnp.int32(start))
    state = [cache, token, eng.place(jnp.array([2], jnp.int32)), key]
    loop = device_loop(eng, False)
    out = {"timing_loop": queued({k: loop_form(eng, loop, state, here, params, k) for k in QUEUED_LOOP_STEPS},
                                 total, rounds)}
    if eng.ring is not None:
        state = [state[0], state[1], here, state[3], None]   # the stream's carried arrays
        forms = {}
        for k in QUEUED_STREAM_STEPS:
            call, _ = stream_call(eng, False, tuple(state[:4]), 4 * total, params, k)
            forms[k] = stream_form(eng, call, state, start, 4 * total)
        out["stream"] = queued(forms, total, rounds)
    return out, (state[0], state[1], pos, state[3])


def ring_loop(call, carry, n: int, tokens, at: int = 2, steps: int = 1):
    """`call_loop` for calls of `steps` steps each that leave their tokens in the token ring `tokens`
    under each step's position (carry[at]), as `Generator.stream` runs them: the ring cleared (the
    steps before are done), two calls dispatched, then each call's steps read from their slots as they
    are written and the next call dispatched. (seconds per step, median enqueue seconds of one call,
    the carried arrays)."""
    tokens.clear()
    pos = int(np.asarray(carry[at]).ravel()[0])
    t = time.perf_counter()
    enqueue = []

    def dispatch(carry):
        t0 = time.perf_counter()
        carry = call(*carry)
        enqueue.append(time.perf_counter() - t0)
        return carry
    for i in range(n):
        carry = dispatch(carry)
        for _ in range(steps if i else 0):   # the steps of the call before this one
            pos += len(tokens.read(pos))
    for _ in range(steps):
        pos += len(tokens.read(pos))
    jax.block_until_ready(carry)
    return (time.perf_counter() - t) / (n * steps), statistics.median(enqueue), carry


def decode_to_ring(model, ops, cache, token, pos, key, params):
    """`Engine._decode` with its token written into the token ring under the step's position instead of
    returned (the write gives the next position): call variant "token_ring"."""
    cache, token, _, key, _ = Engine._decode(model, ops, cache, token, pos, key, params)
    return cache, token, ring.write(pos, token), key


def call_variant_loops(eng, carry, params, n, start: int):
    """What makes a call's enqueue cost: the plain step's host loop (looked up once) in the forms a
    user's stream runs, each compiled with the step's XLA options: "host_output_pinned" (`Engine.decode`,
    one step a call: the four carried arrays donated, the token again as a fifth output written into
    pinned host memory and read by the host: what `Generator.stream` runs where there is no token
    ring). Where the engine's token ring is (`DecodeConfig.token_ring`) also "token_ring" (one step a
    call, the token written into the ring, every output donated) and "token_ring_stream"
    (`Engine.decode_stream`, what the stream runs there: STREAM_STEPS steps a call, two calls in flight;
    its enqueue is a call's, its host loop a step's). `carry`: (cache, token, pos, key); every form
    starts at position `start`, so each runs `n` calls' steps within the cache's rows. Returns ({form:
    {enqueue_ms, host_loop_ms, steps_per_call}}, the carry after); "host_output_pinned" and
    "token_ring_stream" also have "host_trace"."""
    out, carry = {}, tuple(carry[:4])

    def with_state(exe):
        return lambda *c: exe(eng.state, *c, params)
    calls = {"host_output_pinned": with_state(eng.decode.executable(eng.state, *carry, params))}
    extra = {}   # what a form carries after the four: the stream's tokens still wanted
    if eng.ring is not None:
        ring_step = jax.jit(eng._wrap(decode_to_ring), donate_argnums=(1, 2, 3, 4))
        calls["token_ring"] = with_state(ring_step.lower(eng.state, *carry, params).compile(eng.step_options))
        calls["token_ring_stream"], first = stream_call(eng, False, carry, (2 * n + 3) * STREAM_STEPS, params)
        extra["token_ring_stream"] = first[4:]   # never reached
    def restart(carry):
        return carry[0], carry[1], eng.place(np.int32(start)), carry[3]
    for name, call in calls.items():
        keep, steps = (5, STREAM_STEPS) if name in extra else (4, 1)
        carry = restart(carry)
        res = jax.block_until_ready(call(*carry, *extra.get(name, ())))   # warm
        if name.startswith("token_ring"):
            loop_s, enqueue_s, res = ring_loop(call, res, n, eng.ring, 2, steps)
        else:
            loop_s, enqueue_s, res = call_loop(call, res, keep, n)
        carry = tuple(res[:4])
        extra[name] = tuple(res[4:]) if name in extra else ()   # the stream's budget, carried on
        out[name] = {"enqueue_ms": enqueue_s * 1e3, "host_loop_ms": loop_s * 1e3, "steps_per_call": steps}
    out["host_output_pinned"]["host_trace"], res = traced_calls(
        lambda: call_loop(calls["host_output_pinned"], restart(carry) + (None,), 4, n), n)
    carry = tuple(res[:4])
    if "token_ring_stream" in calls:
        out["token_ring_stream"]["host_trace"], res = traced_calls(
            lambda: ring_loop(calls["token_ring_stream"], restart(carry) + extra["token_ring_stream"], n, eng.ring,
                              2, STREAM_STEPS), n)
        carry = tuple(res[:4])
    return out, carry


def traced_calls(loop, n: int, top: int = 40):
    """Where the host time of a call goes: `loop()`, a `call_loop` or `ring_loop` of `n` calls, under
    JAX's profiler, its host events (XLA's runtime TraceMe annotations: execute, buffer donation,
    command-buffer update and launch, ...) summed by name and divided by n: [(name, µs per call,
    events per call)], the largest first; nested events each count. Returns (that list, the loop's
    carried arrays)."""
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        *_, carry = loop()
    return host_events(folder, n, top), carry


def host_events(folder: str, n: int = 1, top: int = 40) -> list:
    """The host events of a JAX profiler trace in `folder` summed by name and divided by n: [(name,
    µs, events)], the largest first; nested events each count."""
    events = timeline.load_trace(folder)
    names = timeline.process_names(events)
    totals: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and "GPU" not in names.get(e.get("pid"), "") and "dur" in e:
            t = totals.setdefault(e["name"], [0.0, 0])
            t[0] += float(e["dur"])
            t[1] += 1
    rows = sorted(((k, v[0] / n, v[1] / n) for k, v in totals.items()), key=lambda r: -r[1])
    return [[k, round(us, 2), round(c, 2)] for k, us, c in rows[:top]]


def _layer_range(text: str) -> tuple[int, int]:
    """LO:HI (--timeline-layers) as (LO, HI), 0 <= LO < HI."""
    lo, sep, hi = text.partition(":")
    if not sep or not lo.isdigit() or not hi.isdigit() or int(lo) >= int(hi):
        raise argparse.ArgumentTypeError(f"{text!r}: LO:HI with 0 <= LO < HI expected")
    return int(lo), int(hi)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv32-tp8-shard")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field of the preset, e.g. --set kv_cache_quant=fp8 (repeatable)")
    p.add_argument("--checkpoint", default=None, help="load this checkpoint instead of random weights")
    p.add_argument("--fmt", default=None, help="weight format for random weights (default fp8 for fp8 presets)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--backend", default="reference", help="comma-separated: reference,pallas")
    p.add_argument("--mtp", action="store_true", help="also time the MTP speculative step (verify 2 + draft)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the config is split over tp devices)")
    p.add_argument("--all-reduce", default="psum", help="comma-separated: psum,engine (the CUDA engine)")
    p.add_argument("--layer-loop", default="loop", help="comma-separated: loop,unrolled (DecodeConfig.layer_loop); "
                   "loop/N: N layers per loop iteration (DecodeConfig.layers_per_iteration)")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="an XLA compile option of the decode steps only (DecodeConfig.xla_options; given ones replace its "
                        "default, CONCURRENT scheduling), repeatable")
    p.add_argument("--l2-prefetch", action="store_true",
                   help="DecodeConfig.l2_prefetch: o_proj's weights prefetched into L2 during the attention chain")
    p.add_argument("--engine-moe", action="store_true",
                   help="DecodeConfig.engine_moe: each MoE layer in one launch of the engine's persistent kernel")
    p.add_argument("--split-indexer", action="store_true",
                   help="with --tp: each rank scores 1/tp of the cached positions, top-k lists merged")
    p.add_argument("--steps", type=int, default=10, help="steps per timed sample")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--plot", default=None, help="write a PNG chart here")
    p.add_argument("--compile-profile", action="store_true",
                   help="the first compile's XLA stage under JAX's profiler: its host events by name in compile_stages")
    p.add_argument("--kernels", action="store_true", help="CUPTI profiles of one step, of the timing loop "
                   "and (with the token ring) of a stream call: kernel count, busy time, groups")
    p.add_argument("--breakdown", action="store_true",
                   help="time variants without attention / without MLP to split the step (first all-reduce only)")
    p.add_argument("--timeline", action="store_true",
                   help="after the first pallas run's timed loops, one call of that loop (4 steps) under JAX's profiler: "
                        "each kernel's start and end in one step, per layer (the run's \"timeline\"; with --out, a Gantt "
                        "chart of layers 4-7 in <out stem>-timeline.png); no --kernels profile after it (that run's "
                        "loop profile only)")
    p.add_argument("--timeline-layers", type=_layer_range, default=timeline.DETAIL_LAYERS, metavar="LO:HI",
                   help="the layers the timeline lists kernel by kernel, [LO, HI) (default %(default)s)")
    p.add_argument("--call-variants", action="store_true",
                   help="also time the plain step's host loop in the forms a stream runs: the token as a pinned "
                        "host output, through the token ring (what a call's enqueue costs; tp=1)")
    a = p.parse_args(argv)

    mesh = jtilert.make_mesh(a.tp) if a.tp > 1 else None
    if a.checkpoint:
        model = jtilert.load(a.checkpoint, mesh=mesh)
    else:
        overrides = dict(_field(kv) for kv in a.set)
        if a.layers:
            overrides["num_hidden_layers"] = a.layers
        cfg = jtilert.preset(a.preset, **overrides)
        fmt = a.fmt or ("fp8" if cfg.index_quant == "fp8" else "bf16")
        model = jtilert.random_model(cfg, fmt=fmt, mesh=mesh)
    cfg = model.cfg
    if bench_rows(a.context, a.steps, a.samples) > cfg.max_position_embeddings:
        raise SystemExit(f"--context {a.context} too large for this model")
    nbytes = step_bytes(model, a.context, a.tp)
    bw = copy_bandwidth()
    floor_ms = nbytes["total"] / bw * 1e3
    result = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
              "commit": provenance.commit(), "command": provenance.command("bench.decode", argv),
              "preset": a.checkpoint or a.preset, "overrides": a.set, "layers": cfg.num_hidden_layers, "context": a.context, "tp": a.tp,
              "bytes_per_step": nbytes, "copy_bandwidth_GBs": bw / 1e9, "floor_ms": floor_ms, "runs": []}
    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)

    ars = a.all_reduce.split(",")
    traced = False   # a run traced its timeline: later runs take no CUPTI kernel profile (bench/timeline.py)
    for backend, loop in ((b, lp) for lp in a.layer_loop.split(",") for b in a.backend.split(",")):
        for ar in ars:
            for mtp in (False, True) if a.mtp else (False,):
                if a.kernels and not mtp and traced:
                    print(f"{backend}: no kernel profile after the timeline's trace (CUPTI would drop records)")
                r = bench_backend(model, backend, a.context, mtp, a.steps, a.samples, mesh, ar == "engine",
                                  kernels=a.kernels and not mtp and not traced, split_indexer=a.split_indexer,
                                  layer_loop=loop, xla_options=tuple(tuple(kv.split("=", 1)) for kv in a.xla_option) or None,
                                  call_variants=a.call_variants, l2_prefetch=a.l2_prefetch, engine_moe=a.engine_moe,
                                  compile_profile=a.compile_profile,
                                  trace_timeline=a.timeline and backend == "pallas" and not mtp and not traced,
                                  timeline_layers=a.timeline_layers)
                traced = traced or "timeline" in r
                r["step_over_floor"] = r["step_ms_median"] / floor_ms
                result["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("kernel_profile", "timeline")}), flush=True)
                save()
        if a.breakdown:
            result.setdefault("breakdown", {})[backend] = breakdown(model, backend, a.context, a.steps, a.samples,
                                                                    mesh, ars[0] == "engine")
            save()
    for r in result["runs"]:   # against the reference with the same layer loop
        ref = next((q for q in result["runs"] if q["backend"] == "reference" and q["all_reduce"] == "psum"
                    and not q["mtp"] and q["layer_loop"] == r["layer_loop"]), None)
        r["speedup_vs_reference"] = ref["step_ms_median"] / r["step_ms_median"] if ref else None

    print(f"{result['device']}  {result['preset']}  layers={cfg.num_hidden_layers} context={a.context}  "
          f"bytes/step={nbytes['total'] / 1e6:.1f} MB  copy={bw / 1e9:.0f} GB/s  floor={floor_ms:.3f} ms")
    print(f"{'backend':10} {'loop':8} {'a-r':6} {'mtp':4} {'step ms':>8} {'p90':>8} {'tok/s':>8} {'x floor':>8} {'x ref':>6} "
          f"{'host %':>7} {'compile s':>9}   (host %: the host loop over the timing loop's step)")
    for r in result["runs"]:
        print(f"{r['backend']:10} {r['layer_loop']:8} {r['all_reduce']:6} {str(r['mtp']):4} {r['step_ms_median']:8.3f} {r['step_ms_p90']:8.3f} "
              f"{r['tok_s']:8.1f} {r['step_over_floor']:8.2f} {r['speedup_vs_reference'] or 0:6.2f} "
              f"{100 * r['host_overhead_frac']:7.1f} {r['compile_s']:9.1f}")
    for r in result["runs"]:
        if "served_step_ms" in r:
            print(f"{r['backend']}/{r['layer_loop']}: the stream's host loop {r['host_loop_ms']:.3f} ms a step, the same "
                  f"calls queued (served steps' device time) {r['served_step_ms']:.3f} ms: the host's share "
                  f"{100 * r['host_over_served_frac']:.1f} %")
        if "fed_token_step_ms" in r:
            print(f"{r['backend']}/{r['layer_loop']}: the timing loop's step {r['step_ms_median']:.3f} ms; with the "
                  f"positions moving {r['advancing_step_ms']:.3f} ms, and each step fed another token "
                  f"{r['fed_token_step_ms']:.3f} ms")
        for program, q in r.get("queued", {}).items():
            each = ", ".join(f"{k}: {v:.3f}" for k, v in q["ms_per_step"].items())
            print(f"{r['backend']}/{r['layer_loop']}: {program}'s program in queued calls, ms a step by steps a call "
                  f"{each}; fit: {q['step_ms']:.3f} ms a step + {q['call_ms']:.3f} ms a call; enqueue ms a call "
                  + ", ".join(f"{k}: {v:.3f}" for k, v in q["enqueue_ms"].items()))
        prof = r.get("kernel_profile")
        if prof:
            print(f"{r['backend']}/{r['layer_loop']}: {prof['kernels']:.0f} kernels per step, {prof['busy_ms']:.3f} ms busy, "
                  f"{prof['gaps_ms']:.3f} ms between kernels; by group:")
            for g in prof["groups"][:12]:
                print(f"    {g['group']:48} {g['count']:7.1f} {g['ms']:9.3f} ms")
        lp = r.get("loop_kernel_profile")
        if lp:
            print(f"{r['backend']}/{r['layer_loop']} in the timed loop: {lp['kernels']:.0f} kernels per step, "
                  f"{lp['busy_ms']:.3f} ms busy, {lp['gaps_ms']:.3f} ms between kernels (< 0: they overlap)")
    full = {r["backend"]: r["step_ms_median"] for r in result["runs"] if not r["mtp"]}
    for backend, parts in result.get("breakdown", {}).items():
        f, rest = full[backend], parts["embedding + head only"]
        attn, mlp = f - parts["without attention"], f - parts["without MLP/MoE"]
        parts.update(attention_ms=attn, mlp_ms=mlp, rest_ms=rest, attention_per_layer_ms=attn / cfg.num_hidden_layers,
                     mlp_per_layer_ms=mlp / cfg.num_hidden_layers)
        print(f"{backend}: attention {attn:.3f} ms ({attn / cfg.num_hidden_layers * 1e3:.1f} us/layer), "
              f"MLP/MoE {mlp:.3f} ms ({mlp / cfg.num_hidden_layers * 1e3:.1f} us/layer), "
              f"embedding + head + sampling {rest:.3f} ms, of {f:.3f} ms")
    for r in result["runs"]:
        tl = r.get("timeline")   # bench/timeline.py's summary of one step
        if tl is None:
            continue
        if not tl.get("kernels"):
            print(f"{r['backend']} timeline: {tl.get('note')}")
        else:
            print(f"{r['backend']} timeline of one step: span {tl['span_us']:.1f} us, busy {tl['busy_us']:.1f} us, "
                  f"idle {tl['idle_us']:.1f} us, {tl['kernels']} kernels, {tl['layers_found']} layers (median span "
                  f"{tl['layer_span_us_median']} us); a chain of {tl['chain']['records']} records one after another: "
                  f"{tl['chain']['busy_us']:.1f} us running, {tl['chain']['wait_us']:.1f} us between them")
        if a.out:
            out = pathlib.Path(a.out)
            timeline.plot(tl, out.with_name(out.stem + "-timeline.png"))
    save()
    if a.plot:
        plot(result, a.plot)
    return result


def _field(kv: str) -> tuple[str, object]:
    """'name=value' → (name, value), the value parsed as JSON where it can be (numbers, booleans)."""
    name, sep, value = kv.partition("=")
    if not sep:
        raise SystemExit(f"--set {kv!r}: expected FIELD=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = result["runs"]
    labels = [f"{r['backend']}/{r['all_reduce']}{' +mtp' if r['mtp'] else ''}" for r in runs]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, [r["step_ms_median"] for r in runs], color="tab:blue")
    ax.axhline(result["floor_ms"], color="tab:red", linestyle="--", label=f"HBM floor {result['floor_ms']:.2f} ms")
    ax.set_ylabel("time per decode step (ms)")
    ax.set_title(f"{result['preset']}, {result['layers']} layers, context {result['context']}, {result['device']}",
                 fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
