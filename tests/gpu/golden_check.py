"""The golden kernel-sized models on the GPU, one kernel at a time: which op's kernel moves the logits
away from transformers' (tests/test_golden_kernels.py checks them all at once).

    python3 tests/gpu/golden_check.py [--models dsv32_kernel,glm5_kernel] [--out golden_check.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # tests/ (the golden package)

import jtilert  # noqa: E402
from jtilert.ops import table  # noqa: E402
from jtilert.store import checkpoint  # noqa: E402
from golden import kernel_models  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--models", default=",".join(sorted(kernel_models.CONFIGS)), help="comma-separated")
    a = ap.parse_args()
    result = {}
    ops = dict(table.OPS)
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
