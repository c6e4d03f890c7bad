"""On a GPU: the kernel shapes whose configuration had to change to fit the shared memory (issue 15),
run at their resolved configuration against the reference, timed against the alternatives; then the
MTP path that failed (dsv32-tp8-shard, random fp8 weights, a few layers) generating with
backend="pallas" against backend="reference".

    PYTHONPATH=. python3 tests/gpu/shapes_check.py [--layers 4] [--out shapes.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jtilert
from jtilert.ops import reference
from jtilert.ops.quant import quantize_weight
from jtilert.pallas import _hopper as hw
from jtilert.pallas import gemv, moe
from prep_check import _median_us  # tests/gpu, this script's folder

BF16, F32 = jnp.bfloat16, jnp.float32


def _weights(shape, fmt, seed):
    w = jax.random.normal(jax.random.key(seed), shape, F32) * shape[-1] ** -0.5
    return quantize_weight(w) if fmt == "fp8" else (w.astype(BF16), None)


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def gemv_cases() -> list[dict]:
    out = []
    # (what, n, k, t, fmt, pair, the configurations to time: None = the resolved one)
    cases = [
        ("eh_proj (MTP), dsv32", 7168, 14336, 2, "fp8", False,
         [None, gemv.GemvConfig(split_k=7), gemv.GemvConfig(split_k=8), gemv.GemvConfig(split_k=14)]),
        ("eh_proj (MTP), dsv32, one token", 7168, 14336, 1, "fp8", False, [None]),
        ("eh_proj (MTP), glm-5", 6144, 12288, 2, "fp8", False, [None, gemv.GemvConfig(split_k=6)]),
        ("o_proj, dsv32 tp=1", 7168, 16384, 1, "fp8", False, [None, gemv.GemvConfig(split_k=8)]),
        ("dense down, dsv32 tp=1", 7168, 18432, 1, "fp8", False, [None]),
        ("dense gate/up, glm-5 tp=1, fp8", 12288, 6144, 1, "fp8", True,
         [None, gemv.GemvConfig(split_k=2, stages=2)]),
        ("dense gate/up, glm-5 tp=1, bf16", 12288, 6144, 1, "bf16", True,
         [None, gemv.GemvConfig(split_k=2, stages=3)]),
    ]
    for i, (what, n, k, t, fmt, pair, configs) in enumerate(cases):
        x = (jax.random.normal(jax.random.key(100 + i), (t, k), F32)).astype(BF16)
        w, s = _weights((n, k), fmt, 200 + i)
        if pair:
            u, us = _weights((n, k), fmt, 300 + i)
            want = reference.swiglu_hidden(x, w, s, u, us)
            call = lambda cfg: jax.jit(lambda x, w, s, u, us: gemv.swiglu_pair(x, w, s, u, us, config=cfg))  # noqa: E731
            args = (x, w, s, u, us)
        else:
            want = reference.linear(x, w, s)
            call = lambda cfg: jax.jit(lambda x, w, s: gemv.linear(x, w, s, config=cfg))  # noqa: E731
            args = (x, w, s)
        nbytes = sum(a.size * a.dtype.itemsize for a in args[1:] if a is not None)
        for cfg in configs:
            resolved = (cfg or gemv.GemvConfig()).resolved(n, k, t, 2 if pair else 1, w.dtype.itemsize, hw.num_sms())
            f = call(cfg)
            row = {"what": what, "n": n, "k": k, "t": t, "config": str(resolved), "default": cfg is None,
                   "err": _err(f(*args), want)}
            row["us"] = _median_us(f, *args)
            row["TB/s"] = nbytes / row["us"] / 1e6 if row["us"] else None
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def expert_down_cases() -> list[dict]:
    """The MoE down projection of dsv32-tp8-shard (256 experts of width 256, 8 per token) at 2..8
    tokens: K = T·8·256 grew past what one K slice holds at 3 tokens."""
    out = []
    e, width, hidden, kper = 256, 256, 7168, 8
    d, ds = _weights((e, hidden, width), "fp8", 7)
    for t in (2, 3, 4, 8):
        h = jax.random.normal(jax.random.key(t), (t * kper, width), F32).astype(BF16)
        wts = jax.random.uniform(jax.random.key(t + 10), (t, kper), F32)
        ids = jax.random.randint(jax.random.key(t + 20), (t, kper), 0, e).astype(jnp.int32)
        want = reference.expert_down(h, wts, ids, d, ds)
        f = jax.jit(lambda h, w, i, d, ds: moe.expert_down(h, w, i, d, ds))
        row = {"what": f"expert down, dsv32-tp8-shard, T={t}", "err": _err(f(h, wts, ids, d, ds), want),
               "us": _median_us(f, h, wts, ids, d, ds)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def mtp_generate(layers_: int, new_tokens: int) -> dict:
    cfg = jtilert.preset("dsv32-tp8-shard", num_hidden_layers=layers_)
    model = jtilert.random_model(cfg, fmt="fp8", seed=3)
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, 12)
    out = {}
    for backend in ("reference", "pallas"):
        t0 = time.time()
        gen = jtilert.Generator(model, max_seq_len=256, mtp=True, backend=backend)
        toks = gen.generate(prompt, max_new_tokens=new_tokens, stop_tokens=())
        out[backend] = {"tokens": [int(v) for v in toks], "s": time.time() - t0,
                        "stats": {k: float(v) for k, v in gen.stats.items() if np.isscalar(v)}}
        print(backend, json.dumps(out[backend]), flush=True)
    a, b = out["reference"]["tokens"], out["pallas"]["tokens"]
    out["agree"] = float(np.mean([x == y for x, y in zip(a, b)])) if a and b else 0.0
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--skip-mtp", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    result = {"gemv": gemv_cases(), "expert_down": expert_down_cases()}
    if not a.skip_mtp:
        result["mtp"] = mtp_generate(a.layers, a.tokens)
    result["ok"] = bool(all(r["err"] < 3e-2 for r in result["gemv"] + result["expert_down"])
                        and (a.skip_mtp or result["mtp"]["agree"] >= 0.9))
    print(json.dumps({"ok": result["ok"]}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
