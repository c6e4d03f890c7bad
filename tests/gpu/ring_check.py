"""On a GPU: Generator.stream through the token ring (DecodeConfig.token_ring, the default) gives the
same tokens as the steps that return them, on the embedded tiny model, plain and with MTP, greedy and
sampled, two requests in turn; and the time per token of each.

    python3 tests/gpu/ring_check.py [--write-behind] [out.json]

--write-behind: the ring's streams with DecodeConfig.ring_write_behind (the default: each step's tokens
written while the next step runs, before its sampling); without it they write at each step's end."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import jtilert
from jtilert.ops.table import DecodeConfig


def run(ring: bool, mtp: bool, backend: str, sampling, behind: bool = False):
    model = jtilert.load("tiny")
    cfg = dataclasses.replace(DecodeConfig(backend=backend), token_ring=ring, ring_write_behind=behind)
    gen = jtilert.Generator(model, max_seq_len=1024, mtp=mtp, config=cfg)
    prompt = jtilert.tokenizer("tiny").encode("The if statement")
    out = []
    for _ in range(2):
        t0 = time.perf_counter()
        ids = list(gen.stream(prompt, 120, sampling=sampling))
        out.append({"ids": ids, "s": time.perf_counter() - t0})
    # the ring's stream wrote its steps' keys (not the returning steps after a busy ring)
    used = gen.engine.ring is not None and int(gen.engine.ring.slots[:, 0].max()) >= 0
    return {"ring_used": used, "requests": out, "stats": {k: v for k, v in gen.stats.items()
                                                                           if isinstance(v, (int, float))}}


def main():
    args = sys.argv[1:]
    behind = "--write-behind" in args
    args = [a for a in args if a != "--write-behind"]
    results, bad = {}, 0
    for backend in ("reference", "pallas"):
        for mtp in (False, True):
            for name, sampling in (("greedy", jtilert.Sampling(temperature=0.0)),
                                   ("sampled", jtilert.Sampling(temperature=0.8, top_p=0.95, seed=1))):
                key = f"{backend}/{'mtp' if mtp else 'plain'}/{name}"
                try:
                    ring = run(True, mtp, backend, sampling, behind)
                except TimeoutError as e:   # a stream that stopped: the next case still runs
                    bad += 1
                    results[key] = {"ok": False, "error": str(e)}
                    print("FAIL", key, e, flush=True)
                    continue
                ret = run(False, mtp, backend, sampling)
                same = [a["ids"] == b["ids"] for a, b in zip(ring["requests"], ret["requests"])]
                ok = ring["ring_used"] and not ret["ring_used"] and all(same)
                bad += not ok
                results[key] = {"ok": ok, "same": same, "ring": ring, "returning": ret}
                print(("PASS" if ok else "FAIL"), key, "ring used:", ring["ring_used"],
                      "tokens:", [len(r["ids"]) for r in ring["requests"]],
                      "ms/token ring %s returning %s" % (ring["stats"].get("ms_per_token"),
                                                             ret["stats"].get("ms_per_token", -1)), flush=True)
    if args:
        json.dump(results, open(args[0], "w"), indent=1)
    print("OK" if not bad else f"{bad} FAILED")
    sys.exit(bool(bad))


if __name__ == "__main__":
    main()
