"""On a GPU: the routed experts' gate/up and down as one kernel of two phases (`jtilert.pallas.moe.moe_experts`
on `gemv_pair.chain`, the decode step's) against the two kernels (`expert_gate_up`, `expert_down`) and the
reference (XLA on the same GPU), on fresh seeded random fp8 stacks at dsv32-tp8-shard's shapes (H 7168,
I 256, 8 of E experts a token, the residual added), power-of-two block scales and arbitrary ones, at
several layers of the stack. Then each form's time a MoE in a dependent chain over the stack's layers
(one jitted loop, command buffers: the step's setting; moe_check.py's chain), rounds alternating the
forms: wall clock and CUPTI (kernels a MoE, busy µs). JSON to --out; exit code 1 on a mismatch.

    PYTHONPATH=. python3 tests/gpu/moe_pair_check.py [--out moe_pair.json] [--rounds 2]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from moe_check import _rel, _stacks, _token, check_main, time_chains   # tests/gpu/moe_check.py

from jtilert.ops import reference
from jtilert.pallas import moe

H, I, K, E, L = 7168, 256, 8, 64, 8
BF16, F32 = jnp.bfloat16, jnp.float32


def _forms():
    def two(f, w, ids, ex, res, layer):
        g, gs, u, us, d, ds = ex
        h = moe.expert_gate_up(f, ids, g, gs, u, us, layer=layer, unsummed=True)
        return moe.expert_down(h, w, ids, d, ds, layer=layer, out_dtype=f.dtype, residual=res)

    def pair(f, w, ids, ex, res, layer):
        return moe.moe_experts(f, w, ids, *ex, res, layer=layer)

    def xla(f, w, ids, ex, res, layer):
        return res + reference.moe_experts(f, w, ids, *[a[layer] for a in ex])
    return {"two": two, "pair": pair, "xla": xla}


def check(rows) -> bool:
    ok = True
    forms = _forms()
    for seed, pow2 in ((0, True), (1, False)):
        ex, _ = _stacks(seed, pow2, e=E, layers=L)
        for layer in (0, L // 2 + 1, L - 1):
            f, res, w, ids = _token(seed * 10 + layer, e=E)
            if layer == 0:
                why = moe.pair_unsupported(f, w[0], ids[0], *ex, res, layer=jnp.int32(layer))
                if why is not None:
                    print(f"FAIL: the pair does not apply at these shapes: {why}", flush=True)
                    return False
            outs = {n: np.asarray(jax.jit(fn)(f, w[0], ids[0], ex, res, jnp.int32(layer)), np.float32)
                    for n, fn in forms.items()}
            resf = np.asarray(res, np.float32)
            ref = outs["xla"] - resf
            row = {"seed": seed, "pow2_scales": pow2, "layer": layer,
                   "pair_rel_err": _rel(outs["pair"] - resf, ref), "two_rel_err": _rel(outs["two"] - resf, ref),
                   "pair_vs_two_rel": _rel(outs["pair"] - resf, outs["two"] - resf),
                   "pair_equals_two": bool((outs["pair"] == outs["two"]).all())}
            # the same sums in the same order as the two kernels: equal to the bit is expected; the bound
            # against the reference as moe_check's (its bf16 dequantisation adds its own error off pow2)
            row["ok"] = (bool(np.isfinite(outs["pair"]).all()) and row["pair_rel_err"] <= (1e-2 if pow2 else 3e-2)
                         and row["pair_vs_two_rel"] <= 1e-3)
            ok &= row["ok"]
            rows.append(row)
            print(row, flush=True)
    return ok


def timing(rows, rounds: int):
    """The two kernels and the one as dependent chains of MoE calls, alternating over `rounds`
    (moe_check.time_chains)."""
    ex, _ = _stacks(2, True, e=E, layers=L)
    f0, res, w, ids = _token(3, L, e=E)
    time_chains({n: fn for n, fn in _forms().items() if n != "xla"}, (f0, w, ids, ex, res), rows, rounds=rounds)


def main(argv=None) -> int:
    return check_main(check, timing, {"shapes": {"H": H, "I": I, "k": K, "E": E, "L": L},
                                      "weight_mb_per_moe": 3 * K * I * H / 1e6}, argv)


if __name__ == "__main__":
    raise SystemExit(main())
