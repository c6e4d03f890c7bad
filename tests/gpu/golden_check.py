"""The golden kernel-sized models on the GPU, one kernel at a time: which op's kernel moves the logits
away from transformers' (tests/test_golden_kernels.py checks them all at once). With --shadow, every
kernel call of the decode steps (all kernels on) is also run on the reference with the same inputs,
and each call's error is printed: the first call that goes wrong names the kernel and its shapes.

    python3 tests/gpu/golden_check.py [--models dsv32_kernel,glm5_kernel] [--shadow] [--out golden_check.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # tests/ (the golden package)

import jtilert  # noqa: E402
from jtilert.ops import table  # noqa: E402
from jtilert.store import checkpoint  # noqa: E402
from golden import kernel_models  # noqa: E402


def _difference(got, want):
    """(max |got - want|, max |want|) over every array leaf, as float32 scalars (traced)."""
    err, top = jnp.float32(0), jnp.float32(0)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        err = jnp.maximum(err, jnp.max(jnp.abs(a - b)))
        top = jnp.maximum(top, jnp.max(jnp.abs(b)))
    return err, top


def shadowed(calls: list):
    """Patch table.Ops so that each kernel call also runs the reference on its inputs; every call's
    (op, shapes, error, max |reference|) is appended to `calls` when the step runs."""
    kernel_call, kernel_topk = table.Ops.__call__, table.Ops.indexer_topk

    def record(name, shapes):
        return lambda err, top: calls.append((name, shapes, float(err), float(top)))

    def call(self, name, *args, layer=None):
        got = kernel_call(self, name, *args, layer=layer)
        if self._kernels and table.OPS[name].kernel is not None:
            ref = table.Ops(dataclasses.replace(self.config, backend="reference"), self.axis)
            want = kernel_call(ref, name, *args, layer=layer)
            jax.debug.callback(record(name, table._shapes(args)), *_difference(got, want))
        return got

    def indexer_topk(self, cfg, q, w, k, k_cache, k_scale, positions, start, layer):
        got = kernel_topk(self, cfg, q, w, k, k_cache, k_scale, positions, start, layer)
        if self._kernels:
            ref = table.Ops(dataclasses.replace(self.config, backend="reference"), self.axis)
            want = kernel_topk(ref, cfg, q, w, k, k_cache, k_scale, positions, start, layer)
            (gi, gv), (wi, wv) = got[0], want[0]
            # the selected positions as a set per token: a 0/1 mask over the cache rows
            rows = k_cache.shape[1]
            mask = lambda i, v: jnp.zeros((i.shape[0], rows + 1), jnp.float32).at[
                jnp.arange(i.shape[0])[:, None], jnp.where(v, i, rows)].set(1)[:, :rows]
            err, top = _difference((got[1:], mask(gi, gv)), (want[1:], mask(wi, wv)))
            jax.debug.callback(record("indexer_topk", table._shapes((q, w, k, k_cache))), err, top)
        return got

    table.Ops.__call__, table.Ops.indexer_topk = call, indexer_topk


def heads_probe() -> dict:
    """heads_linear (the GEMV's expert mode, the heads as the experts) against its reference at the
    golden models' W_uv shape (N = 16 rows per head) and around it, per head: as given, and with each
    head's rows padded to the 64-row block (is it the overhang of a head's rows past N?)."""
    from jtilert.ops import reference
    from jtilert.pallas import gemv
    out = {}
    for t, h, n, k in ((1, 4, 16, 64), (1, 4, 32, 64), (1, 4, 64, 64), (1, 4, 80, 64), (2, 4, 16, 128),
                       (1, 16, 128, 512)):
        key = jax.random.split(jax.random.key(n * 1000 + k + t), 2)
        w = (jax.random.normal(key[0], (2, h, n, k)) * k ** -0.5).astype(jnp.bfloat16)
        x = jax.random.normal(key[1], (t, h, k)).astype(jnp.bfloat16)
        want = np.asarray(reference.heads_linear(x, w[1]), np.float32)
        pad = -n % 64
        wp = jnp.pad(w, ((0, 0), (0, 0), (0, pad), (0, 0)))
        for name, ww in (("as_given", w), ("rows_padded", wp)):
            got = np.asarray(jax.jit(lambda x, w: gemv.heads_linear(x, w, layer=jnp.int32(1)))(x, ww),
                             np.float32)[..., :n]
            err = np.abs(got - want).max(axis=(0, 2)) / np.abs(want).max()
            out[f"t{t} h{h} n{n} k{k} {name}"] = [round(float(e), 4) for e in err]
            print("heads_linear", t, h, n, k, name, out[f"t{t} h{h} n{n} k{k} {name}"], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--models", default=",".join(sorted(kernel_models.CONFIGS)), help="comma-separated")
    ap.add_argument("--shadow", action="store_true", help="every kernel call against the reference on its inputs")
    a = ap.parse_args()
    result = {}
    ops = dict(table.OPS)
    calls = []
    if a.shadow:
        result["heads_probe"] = heads_probe()
        shadowed(calls)
    for name in a.models.split(","):
        g = dict(np.load(f"tests/golden/{name}/golden.npz"))
        folder = pathlib.Path(tempfile.mkdtemp())
        kernel_models.write_folder(name, int(g["seed"]), folder)
        model = checkpoint.load_hf(folder)
        ids, want = kernel_models.scored(g)
        k = model.cfg.index_topk

        def err(backend):
            got = jtilert.score(model, ids, prefill=k, prefill_chunk=k, backend=backend)
            return float(np.abs(got - want).max())
        row = {"reference": err("reference"), "all": err("pallas")}
        if a.shadow:
            row["calls"] = list(calls)
            for c in calls:
                print(name, *c, flush=True)
            calls.clear()
            result[name] = row
            continue
        for op, o in ops.items():
            if o.kernel is None:
                continue
            table.OPS.update({n: v if n == op else dataclasses.replace(v, kernel=None) for n, v in ops.items()})
            row[op] = err("pallas")
            table.OPS.update(ops)
            print(name, op, row[op], flush=True)
        result[name] = row
        print(name, json.dumps(row), flush=True)
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
