"""backend="pallas" end to end on a CPU box with ONE device (issue 14): `Generator(load("tiny"),
backend="pallas")` decodes (generate and stream) in GPU interpret mode, the attention kernels (indexer scoring and the
4-warpgroup sparse MLA) interpreted, and its greedy tokens are the reference's. It runs in a
subprocess: conftest's 8 host devices would size XLA:CPU's thread pool for the interpreter and hide
a hang (see jtilert.pallas.interpret), and a hang must fail the test, not stall it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jtilert

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
PROMPT = np.random.RandomState(0).randint(0, 256, 40)   # the tiny vocabulary; longer than index_topk (32)

SCRIPT = r"""
import faulthandler, sys
faulthandler.dump_traceback_later(TIMEOUT - 15, exit=True)   # a hang prints its stacks, then fails
import jtilert   # first: it sizes XLA:CPU's thread pool before jax starts its backend
import json, jax, numpy as np
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jtilert.pallas import indexer, interpret, sparse_mla

traced, launches = [], [0]
for mod, name in ((indexer, "indexer_scores_kernel"), (sparse_mla, "sparse_mla_partials")):
    fn = getattr(mod, name)
    setattr(mod, name, lambda *a, _f=fn, _n=name, **k: traced.append(_n) or _f(*a, **k))
barrier = gpu_callbacks.ordering_barrier   # the interpreter calls it at each kernel's start and end
gpu_callbacks.ordering_barrier = lambda token: launches.__setitem__(0, launches[0] + 1) or barrier(token)

model = jtilert.load("tiny")
gen = lambda backend: jtilert.Generator(model, max_seq_len=64, backend=backend)
prompt = np.asarray(PROMPT)
pallas = gen("pallas").generate(prompt, N, stop_tokens=[])
kernel_launches = launches[0] // 2
# stream's one step per call (Engine.decode, its token for the host) on the same kernels
streamed = [int(t) for t in gen("pallas").stream(prompt, 2, stop_tokens=[])]
print("RESULT", json.dumps(dict(devices=jax.device_count(), pool=interpret.cpu_pool_threads(jax.device_count()), traced=traced,
                                launches=kernel_launches, layers=model.cfg.num_hidden_layers, pallas=pallas,
                                streamed=streamed)))
"""


def test_pallas_backend_decodes_on_one_cpu_device():
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "JAX_NUM_CPU_DEVICES")}
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.pop("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    n = 4
    script = f"TIMEOUT = {TIMEOUT_S}\nN = {n}\nPROMPT = {PROMPT.tolist()}\n" + SCRIPT
    try:
        run = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"backend='pallas' hung on one CPU device (killed after {TIMEOUT_S} s):\n{(e.stderr or '')[-4000:]}")
    if "Timeout (" in run.stderr:
        pytest.fail(f"backend='pallas' hung on one CPU device (its stacks after {TIMEOUT_S - 15} s):\n{run.stderr[-6000:]}")
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert run.returncode == 0 and lines, f"rc={run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["devices"] == 1
    assert r["pool"] >= 17, "import jtilert did not size XLA:CPU's thread pool for the interpreter"
    # the attention kernels were traced into the decode step and interpreted at every layer of every
    # decode step (the prompt's first token comes from the prefill, which runs the reference)
    assert {"indexer_scores_kernel", "sparse_mla_partials"} <= set(r["traced"]), r["traced"]
    assert r["launches"] >= 2 * r["layers"] * (n - 1), r
    # the reference's tokens, decoded here (the same single-device program as in the child; the
    # compilation cache may already hold its steps, which test_compile_cache compiles)
    reference = jtilert.Generator(jtilert.load("tiny"), max_seq_len=64).generate(PROMPT, n, stop_tokens=[])
    assert r["pallas"] == reference, (r, reference)
    assert r["streamed"] == reference[:2], (r, reference)   # Generator.stream, one step per call
