"""On a GPU, under PjRt's dispatch thread (PJRT_GPU_ENABLE_ASYNC_DISPATCH=1): which Generator.stream
forms run, each in a process of its own (a crash ends only its own form). Forms: the ring's stream, the
steps that return their token into pinned host memory (the stream without a ring), and those steps with
the token left in device memory; each with the program cache on and off."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

FORMS = ("ring", "pinned", "device")


def one(form: str) -> dict:
    import jtilert
    from jtilert.ops.table import DecodeConfig
    from jtilert.runtime.generate import Compiled

    cfg = dataclasses.replace(DecodeConfig(backend="pallas"), token_ring=form == "ring")
    gen = jtilert.Generator(jtilert.load("tiny"), max_seq_len=1024, config=cfg)
    if form == "device":   # the returning step with every output in device memory (`_HostCopy` copies)
        eng = gen.engine
        eng.decode = Compiled(eng._wrap(eng._decode), (1, 2, 3, 4), "decode_device", eng, eng.step_options)
    prompt = jtilert.tokenizer("tiny").encode("The if statement")
    out = []
    for _ in range(2):
        t0 = time.perf_counter()
        ids = list(gen.stream(prompt, 120, sampling=jtilert.Sampling(temperature=0.0)))
        out.append({"ids": ids, "s": time.perf_counter() - t0})
    return {"requests": out, "ms_per_token": gen.stats.get("ms_per_token")}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--form":
        print(json.dumps(one(sys.argv[2])))
        return
    results = {}
    for cache in ("on", "off"):
        for form in FORMS:
            env = dict(os.environ, PJRT_GPU_ENABLE_ASYNC_DISPATCH="1", JTILERT_PROGRAM_CACHE=cache)
            p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--form", form], env=env,
                               capture_output=True, text=True, timeout=240)
            key = f"{form}/cache_{cache}"
            lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
            res = json.loads(lines[-1]) if p.returncode == 0 and lines else None
            tail = [x for x in p.stderr.splitlines() if "arning" not in x][-12:]
            results[key] = {"rc": p.returncode, "result": res, "stderr_tail": tail if p.returncode else []}
            print(key, "rc", p.returncode, "ms/token", res and res["ms_per_token"], flush=True)
            if p.returncode:
                print("\n".join(tail), flush=True)
    ref = results.get("device/cache_off", {}).get("result")
    for k, v in results.items():
        if v["result"] and ref:
            print(k, "same tokens as device/cache_off:", [a["ids"] == b["ids"] for a, b in
                                                          zip(v["result"]["requests"], ref["requests"])])
    if len(sys.argv) > 1:
        json.dump(results, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
