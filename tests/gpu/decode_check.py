"""On a GPU: the pallas decode path against the reference on one GPU's share of DeepSeek-V3.2
(dsv32-tp8-shard, random fp8 weights): logits of 32 one-token steps after a 4-token prefill.

    PYTHONPATH=. python3 tests/gpu/decode_check.py [--layers 4] [--out check.json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import jtilert


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = jtilert.preset("dsv32-tp8-shard", num_hidden_layers=a.layers)
    model = jtilert.random_model(cfg, fmt="fp8", seed=3)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, 4 + a.steps)
    ref = jtilert.score(model, ids, prefill=4)
    pal = jtilert.score(model, ids, prefill=4, backend="pallas")
    dec = slice(4, None)
    err = np.abs(pal[dec] - ref[dec]).max() / np.abs(ref[dec]).max()
    same = float(np.mean(pal[dec].argmax(-1) == ref[dec].argmax(-1)))
    result = {"layers": a.layers, "steps": a.steps, "max_abs_err_over_max": float(err), "argmax_agree": same,
              "ok": bool(err < 3e-2 and same >= 0.9)}
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
