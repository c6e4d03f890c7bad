"""Prefill speed: seconds and prompt tokens per second of `Generator`'s chunked prefill, by prompt length
and chunk size, and the time to first token (issue 15).

    PYTHONPATH=. python3 -m bench.prefill --preset dsv32-tp8-shard --layers 61 --lengths 1024,32768 \
        --chunks 256,1024,1024+128 [--moe grouped,dense] [--out results.json]

Builds the model with random weights on the device (fp8 for fp8 presets), then for each chunk size and
prompt length: compiles the prefill chunk (not timed), runs the whole prompt's prefill `samples` times
(device time: the last chunk's outputs are waited for), and the first token of a `generate` call
(`Generator.stats["ttft_s"]`: prefill + first-token sampling, compiled before its clock).

The floor is bytes over the copy bandwidth measured in the same run: every chunk reads every weight once
(the prompt's tokens choose nearly every expert) and the cache rows its attention reads.
`--moe dense` times the MoE as it ran before experts were grouped (every token through every expert,
mixed with a dense [T, E] weight matrix), for a comparison in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jtilert
from bench.decode import _field, copy_bandwidth
from jtilert.ops import reference, table
from jtilert.ops.quant import dequantize
from jtilert.runtime.generate import chunk_plan

from bench import provenance
from jtilert.store import checkpoint


def dense_moe(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, residual=None):
    """The MoE before grouping: every token through every expert, mixed by a dense [T, E] matrix."""
    t, k = ids.shape
    if t * k < gate.shape[0]:
        out = reference.expert_down(reference.expert_hidden(x, ids, gate, gate_scale, up, up_scale),
                                    weights, ids, down, down_scale)
    else:
        dense = jnp.zeros((t, gate.shape[0]), jnp.float32).at[jnp.arange(t)[:, None], ids].add(weights)
        h = (jax.nn.silu(reference.dot("th,eih->tei", x, dequantize(gate, gate_scale, x.dtype)))
             * reference.dot("th,eih->tei", x, dequantize(up, up_scale, x.dtype)))
        h = (h * dense[:, :, None]).astype(x.dtype)
        out = reference.dot("tei,ehi->th", h, dequantize(down, down_scale, x.dtype)).astype(x.dtype)
    return out if residual is None else residual + out


@contextlib.contextmanager
def moe_variant(name: str):
    """The MoE reference the prefill steps trace: "grouped" (the library's), or "dense". The variant
    goes into the op table (`OPS["moe_experts"]`), which the steps call: patching
    `reference.moe_experts` would not reach them (the table holds the function it was built with). The
    program cache keys on the table (`ops_identity`), so each variant is its own compiled program."""
    if name not in MOE_VARIANTS:
        raise ValueError(f"unknown --moe variant {name!r}; expected one of {tuple(MOE_VARIANTS)}")
    op = table.OPS["moe_experts"]
    table.OPS["moe_experts"] = dataclasses.replace(op, reference=MOE_VARIANTS[name])
    try:
        yield
    finally:
        table.OPS["moe_experts"] = op


MOE_VARIANTS = {"grouped": reference.moe_experts, "dense": dense_moe}


def param_bytes(model) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for n, x in checkpoint.flat_params(model).items()
               if not n.startswith("mtp"))


def time_prefill(model, length: int, chunk: int, samples: int, backend: str, seed: int = 0) -> dict:
    cfg = model.cfg
    ids = np.random.default_rng(seed).integers(2, cfg.vocab_size, length).astype(np.int32)
    gen = jtilert.Generator(model, max_seq_len=length + 8, prefill_chunk=chunk, backend=backend)
    eng = gen.engine
    t0 = time.perf_counter()
    logits, *_ = gen._prefill(ids, 0, eng.new_cache(gen.rows))   # compiles the chunk step
    jax.block_until_ready(logits)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(samples):
        cache = eng.new_cache(gen.rows)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        logits, *_ = gen._prefill(ids, 0, cache)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - t0)
        del cache
    gen.generate(ids, max_new_tokens=1)
    s = statistics.median(times)
    return {"length": length, "chunk": "+".join(map(str, chunk)), "chunks": len(chunk_plan(length, gen.chunks, gen.rows)),
            "prefill_s_median": s,
            "prefill_s_min": min(times), "prompt_tok_s": length / s, "first_call_s": first_s,
            "ttft_s": gen.stats["ttft_s"], "samples": samples}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="dsv32-tp8-shard")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field (repeatable)")
    p.add_argument("--fmt", default=None, help="weight format (default fp8 for fp8 presets)")
    p.add_argument("--lengths", default="1024", help="comma-separated prompt lengths")
    p.add_argument("--chunks", default="64,256,1024",
                   help="comma-separated prefill chunk configs; 1024+128: both sizes, a prompt in the "
                        "chunks of least estimated cost (chunk_plan)")
    p.add_argument("--moe", default="grouped", help="comma-separated: grouped,dense")
    p.add_argument("--backend", default="pallas", help="the Generator's backend (prefill chunks run XLA)")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON here")
    a = p.parse_args(argv)

    overrides = dict(_field(kv) for kv in a.set)
    if a.layers:
        overrides["num_hidden_layers"] = a.layers
    cfg = jtilert.preset(a.preset, **overrides)
    model = jtilert.random_model(cfg, fmt=a.fmt or ("fp8" if cfg.index_quant == "fp8" else "bf16"))
    bw = copy_bandwidth()
    weights = param_bytes(model)
    result = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
              "commit": provenance.commit(), "command": provenance.command("bench.prefill", argv),
              "preset": a.preset, "overrides": a.set, "layers": cfg.num_hidden_layers, "backend": a.backend,
              "copy_bandwidth_GBs": bw / 1e9, "weight_bytes": weights, "runs": []}
    for moe in a.moe.split(","):
        for chunk in (tuple(int(c) for c in item.split("+")) for item in a.chunks.split(",")):
            for length in map(int, a.lengths.split(",")):
                try:
                    with moe_variant(moe):
                        r = time_prefill(model, length, chunk, a.samples, a.backend)
                except Exception as e:   # e.g. out of memory at a large chunk: recorded, the sweep goes on
                    r = {"length": length, "chunk": "+".join(map(str, chunk)), "error": str(e).splitlines()[0][:300]}
                r["moe"] = moe
                if "prefill_s_median" in r:
                    r["floor_s"] = r["chunks"] * weights / bw
                    r["over_floor"] = r["prefill_s_median"] / r["floor_s"]
                result["runs"].append(r)
                print(json.dumps(r), flush=True)
                if a.out:
                    with open(a.out, "w") as f:
                        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
